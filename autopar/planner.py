"""The planner: a driver over a list of passes (data) that turns a captured model into a Plan.

Pipeline (each stage inspectable, see ``autopar.ir``):

1. ``GRAPH_PASSES`` once: tensor facts, the fused kernels the cost model assumes on a GPU
   cluster, and single-device costs (``annotate_tensors``, ``annotate_fusions``,
   ``annotate_cost``);
2. for each candidate mesh, ``MESH_PASSES``: the strategies of every node on that mesh
   (``annotate_strategies``), a layout's restrictions where one is given, and the solver's input
   (``formulate``), then ``autopar.solver.solve`` — the meshes side by side in forked processes
   (``autopar.mesh_pool``);
3. keep the mesh with the smallest objective, or, among the meshes within ``MESH_TIE`` of it,
   the smallest simulated step (or the caller's ``score``), and write the Plan
   (``autopar.plan_record``).

Any pass can be turned off by name (``PlanConfig.disable``). Candidate meshes for N devices (when
``config.mesh_shape`` is not given): the 1-D mesh ``(N,)`` and every ``(N/t, t)`` with ``t``
dividing the devices of a node, so the inner (tensor-parallel) axis stays on NVLink.

Determinism: CP-SAT runs with a fixed seed and one worker, so every rank computing the plan gets
the same one; ``autopar.parallelize`` nevertheless plans on rank 0 and broadcasts the JSON.
"""

from __future__ import annotations

import logging
import math
import os
import time
import warnings
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch.fx import Node

from autopar.capture import Captured, traced_by
from autopar.cluster import Cluster
from autopar.config import PlanConfig
from autopar.display import replication_notes
from autopar.graph import op_name
from autopar.ir import STRATEGIES, NodeStrategies, Strategy
from autopar.mesh import Mesh
from autopar.mesh_pool import Background, solve_meshes
from autopar.passes import Pass, PassContext, run_passes
from autopar.passes.annotate import annotate_cost, annotate_tensors
from autopar.passes.chains import annotate_chains
from autopar.passes.formulate import STRATEGY_GRAPH, formulate, parse_fixed
from autopar.passes.fusion import FUSIONS, annotate_fusions, fusion_plan
from autopar.passes.recompute_ops import recompute_summary
from autopar.passes.strategies import (
    annotate_strategies,
    getitem_strategies,
    offloaded_layers,
    recomputed_layers,
    repeated_layers,
    unruled_ops,
    with_follow,
)
from autopar.plan_record import build_plan
from autopar.planfile import Plan
from autopar.second_look import (
    activation_copy_floor,
    bound_meshes,
    fewer_layers_count,
    in_fewer_layers,
    memory_bound,
    per_activation,
)
from autopar.simulate import graph_facts, simulate_captured
from autopar.solver import Cutoff, InfeasibleError, NotBetter, SolverConfig, solve

__all__ = [
    "GRAPH_PASSES",
    "MESH_PASSES",
    "activation_copy_floor",
    "bound_meshes",
    "candidate_meshes",
    "constrain_strategies",
    "fewer_layers_count",
    "memory_bound",
    "per_activation",
    "plan_captured",
    "plan_recomputing",
]

log = logging.getLogger("autopar.planner")

MESH_TIE = 0.03
"""Meshes whose solved objective lies within this fraction of the least are ranked by their
simulated step, not their objective. The objective sums each collective's time; the simulator
overlaps a gradient's data-parallel reduction with the backward still to run, which favours the
wider data-parallel axis. Table 1's row 1 (GPT 1.7B on 32 A100), 4 micro-batches accumulated:
objective 718.9 ms on (16, 2) and 725.9 ms on (32,), simulated 2.787 s and 2.715 s. So a mesh
solved after another stops (``NotBetter``) only where it cannot come within ``MESH_TIE`` less the
relative gap of it (``SolverConfig.cutoff_gap``), not where it cannot beat it. On row 3
(``recompute="auto"``) that finds 2 micro-batches on (64, 2) without recomputation, 2.404 s, where
the cutoff at the gap kept the whole batch recomputing selectively, 2.533 s (the best Megatron-LM
layout: 2.514 s); planning rows 1 and 3 took 10 s more (44 s to 55 s, 40 s to 48 s); LLaMA-3-8B's
and GPT-3 175B's did not change."""

NodeConstraint = Callable[[Node, Strategy], bool]
"""A layout's rule: whether a node may run a strategy."""


GRAPH_PASSES: tuple[Pass, ...] = (annotate_tensors, annotate_fusions, annotate_chains, annotate_cost)
"""Passes run once per captured graph."""
MESH_PASSES: tuple[Pass, ...] = (annotate_strategies, formulate)
"""Passes run for each candidate mesh, before the solver."""


def candidate_meshes(cluster: Cluster) -> list[tuple[int, ...]]:
    n = cluster.world_size
    out: list[tuple[int, ...]] = [(n,)]
    for t in range(2, cluster.gpus_per_node + 1):
        if cluster.gpus_per_node % t == 0 and n % t == 0 and t < n:
            out.append((n // t, t))
    return out


def detect_mixed_precision(cap: Captured) -> bool:
    """True when the model's parameters are bf16/fp16 (an fp32 master copy is then counted)."""
    for n in cap.graph.nodes:
        if n.op == "placeholder" and n.name in cap.params:
            val = n.meta.get("val")
            if isinstance(val, torch.Tensor) and val.dtype in (torch.float16, torch.bfloat16):
                return True
    return False


def constrain_strategies(pred: NodeConstraint) -> Pass:
    """A pass that drops the strategies ``pred`` forbids (a layout's rules, e.g. Megatron's norms
    replicated on the tensor axis).

    Leaders keep the strategies ``pred`` accepts (tied nodes keep sharing one tuple, so repeated
    layers stay tied); followers are re-derived against their leader's remaining strategies.
    """

    def constrain_strategies(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
        memo: dict[tuple[int, str], tuple[Strategy, ...]] = {}
        # Followers bound to their leader (``NodeStrategies.bound``) veto the leader's strategies
        # they cannot run with, and keep exactly the leader's survivors.
        vetoed: dict[str, set[int]] = {}
        for n in gm.graph.nodes:
            ns = n.meta.get(STRATEGIES)
            if ns is not None and ns.bound:
                bad = vetoed.setdefault(ns.follows, set())
                bad |= {k for k, j in enumerate(ns.follow_map) if not pred(n, ns.strategies[j])}
        survivors: dict[str, list[int]] = {}
        for n in gm.graph.nodes:
            ns = n.meta.get(STRATEGIES)
            if ns is None:
                continue
            if ns.bound:
                keep = survivors[ns.follows]
                picked = tuple(ns.strategies[ns.follow_map[k]] for k in keep)
                n.meta[STRATEGIES] = replace(ns, strategies=picked, follow_map=tuple(range(len(picked))))
                continue
            if n.name in vetoed:
                keep = [k for k, s in enumerate(ns.strategies) if pred(n, s) and k not in vetoed[n.name]]
                keep = keep or [0]  # the replicated strategy: always runnable
                survivors[n.name] = keep
                n.meta[STRATEGIES] = replace(ns, strategies=tuple(ns.strategies[k] for k in keep))
                continue
            if ns.follows and op_name(n) == "getitem":
                n.meta[STRATEGIES] = getitem_strategies(n)
                continue
            key = (id(ns.strategies), op_name(n))
            if key not in memo:
                memo[key] = tuple(s for s in ns.strategies if pred(n, s)) or ns.strategies
            kept = memo[key]
            if ns.follows:
                n.meta[STRATEGIES] = with_follow(n, NodeStrategies(kept))
            elif len(kept) != len(ns.strategies):
                n.meta[STRATEGIES] = replace(ns, strategies=kept)
        return gm

    return constrain_strategies


def plan_captured(
    cap: Captured,
    cluster: Cluster,
    config: PlanConfig | None = None,
    *,
    node_constraint: NodeConstraint | None = None,
    layout: str = "",
    path_cutoff: float | None = None,
    background: Background | None = None,
    score: Callable[[Plan], float] | None = None,
    fewer_layers: bool = True,
    **options: Any,
) -> Plan:
    """Plan an already captured program (``autopar.plan`` captures, then calls this).

    ``config`` (or its fields as keyword ``options``) holds every planning option.
    ``node_constraint``: a layout's restriction on strategies (``autopar.layouts``).
    ``path_cutoff``: seconds the plan's compute path must stay within (``autopar.solver``'s
    constraint (h); the 3D search's bound from a better candidate): ``NotBetter`` when no mesh
    has such a plan. ``background``: work for this process while the meshes are solved in others
    (``Background``). ``score``: seconds a finished plan takes as the caller will run it (the 3D
    search plays its micro-batches and schedules); ``None``: its simulated step. Meshes whose
    objective lies within ``MESH_TIE`` of the least are ranked by it (``MESH_TIE``).
    ``fewer_layers``: under ``recompute="auto"``, try the mode chosen in fewer layers
    (``plan_recomputing``); the 3D search does so for its fastest candidate only.
    """
    config = PlanConfig.build(config, **options).resolved(cluster.device.memory)
    if config.recompute == "auto":  # the cheapest recomputation that fits: none, selective, full
        common = dict(node_constraint=node_constraint, layout=layout, path_cutoff=path_cutoff, score=score)
        try:
            p = plan_captured(
                cap,
                cluster,
                config.replace(recompute="none", recompute_layers=None),
                background=background,
                **common,
            )
        except NotBetter as e:  # none may fit at all: a lighter footprint may still beat the cutoff
            p = plan_recomputing(cap, cluster, config, kept=None, pruned=e, **common)
        except InfeasibleError as e:
            p = plan_recomputing(cap, cluster, config, kept=e.smallest, fewer_layers=fewer_layers, **common)
        if fewer_layers:  # second looks are the 3D search's own otherwise (``autopar.refine``)
            p = per_activation(p, config, cluster, lambda c: plan_captured(cap, cluster, c, **common), score)
        return p
    workers = config.workers if config.workers is not None else min(2, os.cpu_count() or 1)
    t_start = time.perf_counter()
    budget = config.device_budget
    if config.mesh_shape is not None:
        cluster.validate_mesh(config.mesh_shape)
        meshes = [config.mesh_shape]
    else:
        meshes = candidate_meshes(cluster)
        if config.meshes is not None:
            meshes = [m for m in meshes if m in config.meshes] or meshes
    mixed = config.mixed_precision if config.mixed_precision is not None else detect_mixed_precision(cap)
    ctx = PassContext(captured=cap, cluster=cluster, config=config, mixed_precision=mixed)
    gm = run_passes(cap.gm, ctx, GRAPH_PASSES)
    for mesh in meshes:  # bad `fixed` entries are reported here, before any solve
        parse_fixed(cap, config, len(mesh))
    unruled = unruled_ops(gm)
    if unruled:  # once per plan, in the caller's process (not in a forked solve)
        warnings.warn(
            f"autopar: no sharding rule for {', '.join(unruled)}; these ops run replicated (correct, possibly slower)",
            stacklevel=_user_stacklevel(),
        )
    mesh_passes = list(MESH_PASSES)
    if node_constraint is not None:
        mesh_passes.insert(1, constrain_strategies(node_constraint))

    def annotate(mesh: tuple[int, ...], passes: list[Pass] = mesh_passes) -> PassContext:
        mctx = PassContext(
            captured=cap, cluster=cluster, config=config, mesh=Mesh(mesh, cluster), mixed_precision=mixed
        )
        run_passes(gm, mctx, passes)
        return mctx

    def attempt(
        mesh: tuple[int, ...], cutoff: Cutoff | None = None, live: Callable[[], Cutoff | None] | None = None
    ) -> tuple[float, Any]:
        """Annotate strategies for ``mesh`` and solve; the Solution, the InfeasibleError, or
        NotBetter where it cannot beat ``cutoff`` (a mesh solved before it) or ``live`` (one
        solved beside it)."""
        t0 = time.perf_counter()
        mctx = annotate(mesh, [p for p in mesh_passes if p is not formulate])
        copies = activation_copy_floor(gm, cluster) if config.offload_activations else 0.0
        if path_cutoff is not None and copies > path_cutoff:  # the host link alone is slower
            why = (
                f"its activation copies take at least {copies * 1e3:.2f} ms a micro-batch, out and back, "
                f"over the {path_cutoff * 1e3:.2f} ms a better plan allows"
            )
            return time.perf_counter() - t0, NotBetter(math.inf, path_cutoff, why)
        run_passes(gm, mctx, [p for p in mesh_passes if p is formulate])
        t_strat = time.perf_counter() - t0
        try:
            sol = solve(
                gm.meta[STRATEGY_GRAPH],
                memory_budget=budget,
                config=SolverConfig(
                    time_limit=config.time_limit,
                    work_limit=config.work_limit,
                    relative_gap=config.screen_gap if config.screen_gap is not None else config.relative_gap,
                    cutoff_gap=config.relative_gap - MESH_TIE,  # near ties are solved: ranked below
                ),
                cutoff=cutoff,
                path_cutoff=path_cutoff,
                live_cutoff=live,
            )
            return t_strat, sol
        except (InfeasibleError, NotBetter) as e:
            return t_strat, e

    outcomes = solve_meshes(meshes, attempt, workers, background)
    solved: list[tuple[tuple[int, ...], Any]] = []
    tried = []
    errors = []
    for mesh, (t_strat, sol) in zip(meshes, outcomes):
        if isinstance(sol, NotBetter):  # another mesh was faster: not a candidate
            tried.append(
                {"mesh": list(mesh), "feasible": False, "pruned": str(sol), "strategy_time": t_strat}
            )
            continue
        if isinstance(sol, InfeasibleError):
            errors.append(sol)
            tried.append({"mesh": list(mesh), "feasible": False})
            continue
        tried.append(
            {
                "mesh": list(mesh),
                "feasible": True,
                "objective": sol.objective,
                "memory": sol.memory,
                "optimal": sol.optimal,
                "gap": sol.gap,
                "strategy_time": t_strat,
                "solve_time": sol.solve_time,
                "classes": sol.num_classes,
                "edge_vars": sol.num_edge_vars,
            }
        )
        solved.append((mesh, sol))
    if not solved and len(errors) < len(meshes):  # some mesh fits, none within the path cutoff
        whys = sorted({str(sol) for _, sol in outcomes if isinstance(sol, NotBetter)})
        raise NotBetter(math.inf, path_cutoff, "; ".join(whys) or None)
    if not solved:
        if len(errors) == 1:
            raise errors[0]
        known = [e.smallest for e in errors if e.smallest is not None]
        raise InfeasibleError(
            "no mesh shape fits the memory budget:\n  "
            + "\n  ".join(f"{m}: {e}" for m, e in zip(meshes, errors)),
            smallest=min(known) if known else None,
        )

    def finish(mesh: tuple[int, ...], sol: Any) -> Plan:
        """The Plan of ``mesh``'s solution, its step simulated."""
        if len(meshes) > 1:  # the mesh's strategies again (the plan reads them; not the solver's input)
            annotate(mesh, [p for p in mesh_passes if p is not formulate])
        p = build_plan(gm, cap, Mesh(mesh, cluster), sol, config.grad_compression)
        p.recompute = config.recompute
        if config.recompute == "ops":
            p.info["per_activation"] = recompute_summary(gm.graph, sol.choice)
            if not any(n.recomputed for n in p.nodes):  # the solver kept every activation
                p.recompute = "none"
        if p.recompute != "none":
            order = repeated_layers(gm.graph)
            only = recomputed_layers(gm.graph, config.recompute_layers)
            if only is not None and len(only) < len(order):
                p.recompute_layers = tuple(n for n in order if n in only)
        p.compile = config.compile
        p.offload_optimizer = config.offload_optimizer is True
        off = offloaded_layers(gm.graph, config.offload_activations)
        if off:
            p.offload_layers = tuple(n for n in repeated_layers(gm.graph) if n in off)
        p.fusions = fusion_plan(gm.meta.get(FUSIONS, ()))
        facts = graph_facts(gm)
        p.info.update(
            {
                "optimizer": config.optimizer,
                "param_bytes": facts.param_bytes,
                "first_reader": facts.first_reader,
            }
        )
        if config.optimizer_state_dtype is not None:  # the optimizer step's moments (simulate)
            p.info["optimizer_state_dtype"] = config.optimizer_state_dtype
        sim = simulate_captured(p, gm, cluster)
        p.predicted = replace(p.predicted, step_time=sim.step_time)
        p.info["simulated"] = {
            "compute_and_comm": sim.timeline.busy[0],
            "exposed_grad_sync": sim.timeline.exposed_sync[0],
            "optimizer": sim.optimizer_time,
        }
        p.info.update(
            {
                "meshes_tried": tried,  # the rivals' scores join it below (one list, shared)
                "planning_time": time.perf_counter() - t_start,
                "pass_timings": dict(ctx.timings),
                "cluster_desc": cluster.describe(),
                "unruled_ops": unruled,
                "memory_budget": budget,
                "memory_reserve": max(0.0, cluster.device.memory - budget),
                "traced_by": traced_by(cap),
            }
            | ({"layout": layout} if layout else {})
        )
        return p

    # The objective sums communication; the simulator overlaps it: near ties go to the simulator.
    solved.sort(key=lambda ms: ms[1].objective)
    least = solved[0][1].objective
    rivals = [(mesh, sol) for mesh, sol in solved if sol.objective <= least * (1 + MESH_TIE)]
    plans = [finish(mesh, sol) for mesh, sol in rivals]
    scores = [score(p) if score is not None else p.predicted.step_time for p in plans]
    for (mesh, _), s in zip(rivals, scores):
        next(t for t in tried if t["mesh"] == list(mesh))["scored_step"] = s
    k = min(range(len(plans)), key=lambda i: (scores[i], rivals[i][1].objective))
    p = plans[k]
    for note in replication_notes(p, batch_only=True):  # planned anyway: say which axis repeats the work, why
        warnings.warn(f"autopar: {note}", stacklevel=_user_stacklevel())
    return p


def plan_recomputing(
    cap: Captured,
    cluster: Cluster,
    config: PlanConfig,
    *,
    kept: float | None,
    pruned: NotBetter | None = None,
    modes: tuple[str, ...] = ("selective", "full"),
    fewer_layers: bool = True,
    **options: Any,
) -> Plan:
    """``recompute="auto"`` where keeping every activation gave no plan: the lightest of ``modes``
    that fits, in its fewest layers where ``kept`` (the least memory plans keeping every
    activation reach, ``InfeasibleError.smallest``) allows the estimate (``second_look.in_fewer_layers``).
    ``pruned``: why the plan keeping every activation was cut off (``NotBetter``), raised again
    where no mode beats the cutoff either. ``fewer_layers=False``: every layer, ``kept`` recorded
    as ``plan.info["kept_memory"]`` for a later ``fewer_layers_count``. ``options``:
    ``plan_captured``'s."""
    score = options.get("score")

    def attempt(c: PlanConfig) -> Plan:
        return plan_captured(cap, cluster, c, **options)

    for mode in modes:
        try:
            p = attempt(config.replace(recompute=mode))
        except NotBetter as e:
            pruned = e
            continue
        except InfeasibleError:
            if mode == modes[-1] and pruned is None:
                raise
            continue
        if config.recompute_layers is None and kept is not None:
            p.info["kept_memory"] = kept
            # The candidates a 3D-search score played from ``p`` (``pipelined.Player``) copied its
            # info before this figure was known: theirs too, for ``refine.fewer_layers``.
            for c in getattr(score, "played", {}).get(id(p), ()):
                c.plan.info["kept_memory"] = kept
            if fewer_layers:
                p = in_fewer_layers(p, config.replace(recompute=mode), cluster, cap, attempt, score)
        return p
    assert pruned is not None
    raise pruned


def _user_stacklevel() -> int:
    """Stack level of the first frame outside autopar and torch, so a warning points at the user's
    call (``autopar.plan``, ``layouts.megatron``, ``parallelize`` or a script of theirs)."""
    import inspect

    import autopar.cost.comm
    import autopar.graph
    import autopar.passes
    import autopar.runtime.compat

    roots = {
        os.path.dirname(os.path.abspath(m.__file__))
        for m in (autopar.graph, autopar.cost.comm, autopar.passes, autopar.runtime.compat)
    }
    level = 1
    for frame in inspect.stack()[1:]:
        level += 1
        path = os.path.abspath(frame.filename)
        if not any(path.startswith(r + os.sep) for r in roots) and "/torch/" not in path:
            return level - 1
    return 2

"""The planner: a driver over a list of passes (data) that turns a captured model into a Plan.

Pipeline (each stage inspectable, see ``autopar.ir``):

1. ``GRAPH_PASSES`` once: tensor facts, the fused kernels the cost model assumes on a GPU
   cluster, and single-device costs (``annotate_tensors``, ``annotate_fusions``,
   ``annotate_cost``);
2. for each candidate mesh, ``MESH_PASSES``: the strategies of every node on that mesh
   (``annotate_strategies``), a layout's restrictions where one is given, and the solver's input
   (``formulate``), then ``autopar.solver.solve``;
3. keep the mesh with the smallest predicted step time and write the Plan.

Any pass can be turned off by name (``PlanConfig.disable``). Candidate meshes for N devices (when
``config.mesh_shape`` is not given): the 1-D mesh ``(N,)`` and every ``(N/t, t)`` with ``t``
dividing the devices of a node, so the inner (tensor-parallel) axis stays on NVLink.

Determinism: CP-SAT runs with a fixed seed and one worker, so every rank computing the plan gets
the same one; ``autopar.parallelize`` nevertheless plans on rank 0 and broadcasts the JSON.
"""

from __future__ import annotations

import logging
import math
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.fx import Node

from autopar.capture import Captured, traced_by
from autopar.cluster import Cluster
from autopar.config import PlanConfig
from autopar.cost.reshard import edge_cost, grad_reduce_axes, grad_sync_bytes, step_cost
from autopar.display import replication_notes
from autopar.graph import OpFamily, op_family, op_name, tensor_inputs
from autopar.ir import COST, STRATEGIES, TENSOR, NodeStrategies, Strategy
from autopar.mesh import Mesh
from autopar.passes import Pass, PassContext, run_passes
from autopar.passes.annotate import annotate_cost, annotate_tensors
from autopar.passes.chains import annotate_chains
from autopar.passes.formulate import STRATEGY_GRAPH, formulate, parse_fixed
from autopar.passes.fusion import FUSIONS, annotate_fusions, fusion_plan
from autopar.passes.strategies import annotate_strategies, getitem_strategies, unruled_ops, with_follow
from autopar.placement import Replicate, Shard, format_spec
from autopar.planfile import NodePlan, Plan, Predicted, ReshardPlan
from autopar.reshard import StepKind, bucketed_grad_sync, grad_sync_axes, reshard_steps
from autopar.rules.routing import grouped_mm_operands
from autopar.simulate import graph_facts, simulate_captured
from autopar.solver import Cutoff, InfeasibleError, NotBetter, SolverConfig, solve

__all__ = [
    "GRAPH_PASSES",
    "MESH_PASSES",
    "Background",
    "Progress",
    "candidate_meshes",
    "constrain_strategies",
    "plan_captured",
]

log = logging.getLogger("autopar.planner")


@dataclass(frozen=True, slots=True)
class Progress:
    """One step of planning, logged on the ``autopar.planner`` logger as the record's ``progress``
    attribute, so a front end can draw a progress bar (``autopar.cli`` does)."""

    task: str
    """What is solved, e.g. ``"mesh (8, 8)"``."""
    started: bool
    """True when the task starts, False when it ends."""
    done: int
    """Tasks finished so far."""
    total: int
    """Tasks in all."""


def _progress(task: str, started: bool, done: int, total: int) -> None:
    event = Progress(task, started, done, total)
    log.info(
        "%s %s (%d of %d done)",
        "solving" if started else "solved",
        task,
        done,
        total,
        extra={"progress": event},
    )


NodeConstraint = Callable[[Node, Strategy], bool]


@dataclass(frozen=True, slots=True)
class Background:
    """Work for the planning process while its meshes are solved in forked ones: a prefetch of
    what the caller plans next (skipped where the meshes are solved in this process)."""

    work: Callable[[], None]
    eager: bool = False
    """Start every mesh at once and do the work at once: it is long and their work short (the
    export with a symbolic batch beside the whole batch's meshes). Otherwise it waits for a
    worker to be free with no mesh left to start (the tail of the solves, where a core idles)."""


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
    **options: Any,
) -> Plan:
    """Plan an already captured program (``autopar.plan`` captures, then calls this).

    ``config`` (or its fields as keyword ``options``) holds every planning option.
    ``node_constraint``: a layout's restriction on strategies (``autopar.layouts``).
    ``path_cutoff``: seconds the plan's compute path must stay within (``autopar.solver``'s
    constraint (h); the 3D search's bound from a better candidate): ``NotBetter`` when no mesh
    has such a plan. ``background``: work for this process while the meshes are solved in others
    (``Background``).
    """
    config = PlanConfig.build(config, **options)
    if config.recompute == "auto":  # the cheapest recomputation that fits: none, selective, full
        pruned: NotBetter | None = None  # a mode's plans that fit (if any) miss the path cutoff
        for mode in ("none", "selective", "full"):
            try:
                return plan_captured(
                    cap,
                    cluster,
                    config.replace(recompute=mode),
                    node_constraint=node_constraint,
                    layout=layout,
                    path_cutoff=path_cutoff,
                    background=background if mode == "none" else None,
                )
            except NotBetter as e:  # none may fit at all: a lighter footprint may still beat the cutoff
                pruned = e
            except InfeasibleError:
                if mode == "full" and pruned is None:
                    raise
        assert pruned is not None
        raise pruned
    workers = config.workers if config.workers is not None else min(2, os.cpu_count() or 1)
    t_start = time.perf_counter()
    config = config.resolved(cluster.device.memory)
    budget = config.memory_budget
    assert budget is not None
    if config.mesh_shape is not None:
        cluster.validate_mesh(config.mesh_shape)
        meshes = [config.mesh_shape]
    else:
        meshes = candidate_meshes(cluster)
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
        annotate(mesh)
        t_strat = time.perf_counter() - t0
        try:
            sol = solve(
                gm.meta[STRATEGY_GRAPH],
                memory_budget=budget,
                config=SolverConfig(time_limit=config.time_limit),
                cutoff=cutoff,
                path_cutoff=path_cutoff,
                live_cutoff=live,
            )
            return t_strat, sol
        except (InfeasibleError, NotBetter) as e:
            return t_strat, e

    outcomes = _attempt_all(meshes, attempt, workers, background)
    best = None
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
                "optimal": sol.optimal,
                "gap": sol.gap,
                "strategy_time": t_strat,
                "solve_time": sol.solve_time,
                "classes": sol.num_classes,
                "edge_vars": sol.num_edge_vars,
            }
        )
        if best is None or sol.objective < best[1].objective * (1 - 1e-9):
            best = (mesh, sol)
    if best is None and len(errors) < len(meshes):  # some mesh fits, none within the path cutoff
        raise NotBetter(math.inf, path_cutoff)
    if best is None:
        if len(errors) == 1:
            raise errors[0]
        known = [e.smallest for e in errors if e.smallest is not None]
        raise InfeasibleError(
            "no mesh shape fits the memory budget:\n  "
            + "\n  ".join(f"{m}: {e}" for m, e in zip(meshes, errors)),
            smallest=min(known) if known else None,
        )
    mesh, sol = best
    if len(meshes) > 1:  # the winner's strategies again (the plan reads them; not the solver's input)
        annotate(mesh, [p for p in mesh_passes if p is not formulate])
    p = _build_plan(gm, cap, Mesh(mesh, cluster), sol)
    p.recompute = config.recompute
    p.compile = config.compile
    p.fusions = fusion_plan(gm.meta.get(FUSIONS, ()))
    facts = graph_facts(gm)
    p.info.update(
        {
            "optimizer": config.optimizer,
            "param_bytes": facts.param_bytes,
            "first_reader": facts.first_reader,
        }
    )
    sim = simulate_captured(p, gm, cluster)
    p.predicted = replace(p.predicted, step_time=sim.step_time)
    p.info.update(
        {
            "simulated": {
                "compute_and_comm": sim.timeline.busy[0],
                "exposed_grad_sync": sim.timeline.exposed_sync[0],
                "optimizer": sim.optimizer_time,
            },
            "meshes_tried": tried,
            "planning_time": time.perf_counter() - t_start,
            "pass_timings": dict(ctx.timings),
            "cluster_desc": cluster.describe(),
            "unruled_ops": unruled,
            "memory_budget": budget,
            "memory_reserve": max(0.0, cluster.device.memory - budget),
            "traced_by": traced_by(cap),
        }
    )
    if layout:
        p.info["layout"] = layout
    for note in replication_notes(p, batch_only=True):  # planned anyway: say which axis repeats the work, why
        warnings.warn(f"autopar: {note}", stacklevel=_user_stacklevel())
    return p


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


def _cutoff(i: int, objectives: dict[int, float]) -> Cutoff | None:
    """The best finished mesh's objective (``objectives``: mesh index -> objective), for mesh ``i``
    to beat (``autopar.solver.Cutoff``): strictly where that mesh comes earlier in the planner's
    order (it wins a tie), else at most equal, so the winner is the one a full solve of every mesh
    picks."""
    if not objectives:
        return None
    objective, j = min((o, j) for j, o in objectives.items())
    return Cutoff(objective, strict=j < i)


def _objectives(done: dict[int, tuple[float, Any]]) -> dict[int, float]:
    return {j: sol.objective for j, (_, sol) in done.items() if not isinstance(sol, Exception)}


def _attempt_all(
    meshes: list[tuple[int, ...]],
    attempt: Callable,
    workers: int,
    background: Background | None = None,
) -> list[tuple[float, Any]]:
    """Run ``attempt(mesh, cutoff, live)`` for every mesh; with several meshes and workers, in
    forked processes. Each mesh started after another finished gets its objective as a cutoff
    (``_cutoff``): a mesh that cannot win stops when CP-SAT proves it cannot (``NotBetter``).
    A mesh solved beside others also reads their objectives as they finish (``live``, through
    shared memory), so it stops as soon as its bound passes one of them.

    Each candidate mesh is an independent solve (CP-SAT with one worker), so on a machine with
    ``workers`` cores they run side by side. Children are forked (they inherit the annotated graph;
    nothing is pickled but the Solution), which needs the ``fork`` start method (Linux) and a
    process that may fork (not daemonic, no other threads); otherwise, or with ``workers=1``, the
    meshes are solved one after another. The parent then re-annotates
    the winning mesh's strategies, which are deterministic.

    ``background``: work the parent does while the children solve (``Background``: skipped when
    the meshes are solved in this process, where it would only delay them), at once with every
    mesh started (``eager``), or once no mesh waits to start and a worker is free. The children
    publish their objectives themselves, so the live cutoffs work while the parent is busy.
    """
    if (
        workers <= 1
        or len(meshes) <= 1
        or "fork" not in mp.get_all_start_methods()
        or mp.current_process().daemon  # daemonic processes may not have children
        or threading.active_count() > 1  # forking a threaded process (e.g. a live process group) is unsafe
    ):
        done: dict[int, tuple[float, Any]] = {}
        for i, m in enumerate(meshes):
            _progress(f"mesh {m}", True, i, len(meshes))
            done[i] = attempt(m, _cutoff(i, _objectives(done)))
            _progress(f"mesh {m}", False, i + 1, len(meshes))
        return [done[i] for i in range(len(meshes))]
    ctx = mp.get_context("fork")
    results: dict[int, tuple[float, Any]] = {}
    running: list[tuple[int, Any, Any]] = []
    pending = list(enumerate(meshes))
    finished = ctx.Array("d", [math.nan] * len(meshes), lock=False)  # objectives, read by the children

    def child(conn: Any, i: int, mesh: tuple[int, ...], cutoff: Cutoff | None) -> None:
        def live() -> Cutoff | None:
            return _cutoff(i, {j: o for j, o in enumerate(finished) if not math.isnan(o)})

        try:
            t, sol = attempt(mesh, cutoff, live)
            if not isinstance(sol, Exception):
                finished[i] = sol.objective
            conn.send(
                ("ok", t, sol)
                if not isinstance(sol, Exception)
                else ("not_better", t, (sol.cutoff, sol.path_cutoff))
                if isinstance(sol, NotBetter)
                else ("infeasible", t, (str(sol), getattr(sol, "smallest", None)))
            )
        except Exception as exc:  # sent to the parent, which re-raises it
            try:
                conn.send(("error", 0.0, exc))
            except Exception:  # not picklable: send the traceback as text
                conn.send(
                    ("error", 0.0, RuntimeError(f"solving mesh {mesh} failed:\n{traceback.format_exc()}"))
                )
        finally:
            conn.close()

    concurrent = len(meshes) if background is not None and background.eager else workers
    while pending or running:
        while pending and len(running) < concurrent:
            i, mesh = pending.pop(0)
            parent_end, child_end = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=child, args=(child_end, i, mesh, _cutoff(i, _objectives(results))), daemon=True
            )
            proc.start()
            child_end.close()
            running.append((i, proc, parent_end))
            _progress(f"mesh {mesh}", True, len(results), len(meshes))
        if background is not None and (background.eager or (not pending and len(running) < workers)):
            background.work()
            background = None
            continue  # a solve may have ended meanwhile
        # Whichever solve ends first frees its worker (mesh solves differ tenfold in time).
        ready = mp_connection.wait([c for _, _, c in running])
        k = next(j for j, (_, _, c) in enumerate(running) if c in ready)
        i, proc, conn = running.pop(k)
        try:
            status, t, payload = conn.recv()
        except EOFError:
            proc.join()
            raise RuntimeError(f"solving mesh {meshes[i]} crashed (exit code {proc.exitcode})") from None
        proc.join()
        if status == "error":
            for _, other, _ in running:
                other.kill()
            raise payload
        if status == "infeasible":
            payload = InfeasibleError(*payload)
        elif status == "not_better":
            payload = NotBetter(*payload)
        results[i] = (t, payload)
        _progress(f"mesh {meshes[i]}", False, len(results), len(meshes))
    return [results[i] for i in range(len(meshes))]


def axis_names(mesh: tuple[int, ...], gm: torch.fx.GraphModule, choice: dict[str, int]) -> tuple[str, ...]:
    """Name each axis from the strategies the solver chose for the matmuls, weighted by their
    FLOPs: ``tp`` when they split the weights, ``dp`` when they split the batch (dimension 0),
    ``sp`` when they split another activation dimension; an axis where nothing is split is ``rep``.
    Names repeated on several axes are numbered (``dp0``, ``dp1``). An axis along which experts'
    weights are split by expert (a grouped matmul's weight ``S(0)``) is ``ep``, whatever the
    other matmuls do along it (its tokens are data-parallel for them, as in Megatron-LM)."""
    votes = [{"dp": 0.0, "tp": 0.0, "sp": 0.0} for _ in mesh]
    experts = set()
    for n in gm.graph.nodes:
        ns = n.meta.get(STRATEGIES)
        if ns is None or op_family(n) is not OpFamily.MATMUL:
            continue
        s = ns.strategies[choice[n.name]]
        gmm = grouped_mm_operands(n)
        if gmm is not None:
            w_spec = s.inputs[tensor_inputs(n).index(gmm[1])]
            experts |= {
                a for a, p in enumerate(w_spec or ()) if isinstance(p, Shard) and p.dim == 0 and mesh[a] > 1
            }
        flops = n.meta[COST].fwd_flops if COST in n.meta else 1.0
        ins = tensor_inputs(n)
        for a in range(len(mesh)):
            weight_split = any(
                i.meta.get(TENSOR) is not None
                and i.meta[TENSOR].kind == "param"
                and not isinstance(sp[a], Replicate)
                for i, sp in zip(ins, s.inputs)
                if sp is not None
            )
            out = s.outputs[0][a]
            if weight_split:
                votes[a]["tp"] += flops
            elif isinstance(out, Shard) and out.dim == 0:
                votes[a]["dp"] += flops
            elif isinstance(out, Shard):
                votes[a]["sp"] += flops
    names = [max(v, key=v.get) if max(v.values()) > 0 else "rep" for v in votes]
    names = ["ep" if a in experts else name for a, name in enumerate(names)]
    if len(set(names)) != len(names):
        names = [f"{n}{i}" for i, n in enumerate(names)]
    return tuple(names)


def _build_plan(gm: torch.fx.GraphModule, cap: Captured, mesh: Mesh, sol: Any) -> Plan:
    choice = sol.choice
    nodes: list[NodePlan] = []
    chosen: dict[Node, Strategy] = {}
    for n in gm.graph.nodes:
        ns = n.meta.get(STRATEGIES)
        info = n.meta.get(TENSOR)
        if ns is None or info is None:
            continue
        s = ns.strategies[choice[n.name]]
        chosen[n] = s
        nodes.append(
            NodePlan(
                name=n.name,
                op=op_name(n) if n.op == "call_function" else n.op,
                module=info.module,
                kind=info.kind,
                fqn=info.fqn,
                inputs=tuple(None if sp is None else format_spec(sp) for sp in s.inputs),
                input_names=tuple(i.name for i in tensor_inputs(n)),
                outputs=tuple(format_spec(sp) for sp in s.outputs),
                rewrites=tuple(str(r) for r in s.rewrites),
                comms=s.comms,
                split=s.split,
                shape=info.shape,
                compute_time=s.compute_time,
                comm_time=s.comm_time,
                memory=s.memory,
                zero_stage=s.zero_stage,
            )
        )
    reshards: list[ReshardPlan] = []
    comm_bytes = [0.0] * mesh.ndim
    comm_time = sum(s.comm_time for s in chosen.values())
    synced: set[tuple] = set()  # (value, layout, axes) whose gradient all-reduce is charged: once
    for c, s in chosen.items():
        for j, i in enumerate(tensor_inputs(c)):
            if i not in chosen or s.inputs[j] is None:
                continue
            src = chosen[i].outputs[0]  # multi-output ops are read through getitem, one output each
            dst = s.inputs[j]
            info = i.meta[TENSOR]
            grad_axes = grad_sync_axes(s.split, dst, info.requires_grad)
            if src == dst and not grad_axes:
                continue
            val = i.meta["val"] if isinstance(i.meta["val"], torch.Tensor) else None
            if val is None:
                continue
            shape, itemsize = tuple(val.shape), val.element_size()
            steps = reshard_steps(shape, src, dst, mesh.shape)
            stage = chosen[i].zero_stage if info.kind == "param" and info.requires_grad else 0
            sync_axes = grad_reduce_axes(s.split, dst, mesh, steps, stage) if info.requires_grad else ()
            first_sync = (i.name, dst, sync_axes) not in synced
            synced.add((i.name, dst, sync_axes))
            t = edge_cost(
                shape,
                itemsize,
                src,
                dst,
                s.split,
                info.requires_grad,
                mesh,
                bucketed_sync=bucketed_grad_sync(i),
                zero_stage=stage,
                sync_share=1.0 if first_sync else 0.0,
            )
            per_axis = [0.0] * mesh.ndim
            for st in steps:
                b = math.prod(st.out_shape if st.kind == StepKind.ALL_GATHER else st.in_shape) * itemsize
                if step_cost(st, itemsize, mesh) > 0:
                    per_axis[st.axis] += b
            if first_sync:
                for a, b in enumerate(grad_sync_bytes(shape, itemsize, dst, sync_axes, mesh)):
                    per_axis[a] += b
            for a in range(mesh.ndim):
                comm_bytes[a] += per_axis[a]
            comm_time += t
            reshards.append(
                ReshardPlan(
                    producer=i.name,
                    consumer=c.name,
                    src=format_spec(src),
                    dst=format_spec(dst),
                    collectives=tuple(_step_str(st) for st in steps),
                    grad_sync_axes=grad_axes,
                    time=t,
                    bytes_per_axis=tuple(per_axis),
                )
            )
    compute = sum(s.compute_time for s in chosen.values())
    params = {}
    inputs = {}
    for n, s in chosen.items():
        info = n.meta[TENSOR]
        if info.kind == "param":
            params[info.fqn] = format_spec(s.outputs[0])
        elif info.kind == "input":
            inputs[info.fqn] = format_spec(s.outputs[0])
    return Plan(
        mesh_shape=mesh.shape,
        mesh_axes=axis_names(mesh.shape, gm, choice),
        nodes=nodes,
        params=params,
        param_aliases={k: list(v) for k, v in cap.param_aliases.items() if k in params},
        inputs=inputs,
        reshards=reshards,
        predicted=Predicted(
            step_time=compute + comm_time,
            compute_time=compute,
            comm_time=comm_time,
            memory_per_device=sol.memory,
            comm_bytes_per_axis=tuple(comm_bytes),
            optimal=sol.optimal,
            gap=sol.gap,
        ),
        cluster=mesh.cluster.to_dict(),
        fingerprint=cap.fingerprint,
        info={"solver": {"objective": sol.objective, "solve_time": sol.solve_time, **sol.stats}},
    )


def _step_str(st: Any) -> str:
    if st.kind in (StepKind.ALL_REDUCE, StepKind.TO_PARTIAL):
        return f"{st.kind}(axis={st.axis})"
    if st.kind == StepKind.ALL_TO_ALL:
        return f"all_to_all(axis={st.axis}, {st.dim}->{st.dim2})"
    b = f"x{st.blocks}" if st.blocks > 1 else ""
    return f"{st.kind}(axis={st.axis}, dim={st.dim}{b})"

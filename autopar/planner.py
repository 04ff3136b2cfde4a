"""``autopar.plan``: model + example batch + cluster -> Plan.

The pipeline (each stage inspectable, see ``autopar.ir``):

1. ``capture`` the model with ``torch.export`` (once);
2. ``annotate_tensors`` and ``annotate_cost`` (once: costs of the unsharded ops);
3. for each candidate mesh shape: ``annotate_strategies`` then ``solve`` (CP-SAT);
4. keep the mesh with the smallest predicted step time and write the Plan.

Candidate meshes for N devices (when ``mesh_shape`` is not given): the 1-D mesh ``(N,)`` and every
``(N/t, t)`` with ``t`` dividing the devices of a node, so the inner (tensor-parallel) axis stays
on NVLink.

Determinism: CP-SAT runs with a fixed seed and one worker, so every rank computing the plan gets
the same one; ``autopar.parallelize`` nevertheless plans on rank 0 and broadcasts the JSON.
"""

from __future__ import annotations

import difflib
import math
import multiprocessing as mp
import os
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.fx import Node

from autopar.capture import Captured, capture
from autopar.cluster import Cluster
from autopar.ir import STRATEGIES, TENSOR, Strategy
from autopar.passes import PassContext, run_passes
from autopar.passes.annotate import annotate_cost, annotate_tensors, op_name
from autopar.passes.strategies import annotate_strategies
from autopar.placement import Replicate, Shard, Spec, format_spec, parse_spec
from autopar.plan import NodePlan, Plan, Predicted, ReshardPlan
from autopar.reshard import bucketed_grad_sync, edge_cost, reshard_steps, step_cost
from autopar.rules import tensor_inputs, zero_stage_of

__all__ = ["candidate_meshes", "plan", "plan_captured"]

NodeConstraint = Callable[[Node, Strategy], bool]


def candidate_meshes(cluster: Cluster) -> list[tuple[int, ...]]:
    n = cluster.world_size
    out: list[tuple[int, ...]] = [(n,)]
    for t in range(2, cluster.gpus_per_node + 1):
        if cluster.gpus_per_node % t == 0 and n % t == 0 and t < n:
            out.append((n // t, t))
    return out


def plan(
    model: nn.Module,
    example_inputs: Any,
    cluster: Cluster,
    memory_budget: float | None = None,
    mesh_shape: Sequence[int] | None = None,
    fixed: dict[str, Sequence[str] | str] | None = None,
    *,
    optimizer: str = "adamw",
    mixed_precision: bool | None = None,
    zero_stage: int | None = None,
    time_limit: float = 60.0,
) -> Plan:
    """Plan ``model`` on ``cluster``; ``example_inputs`` is one global batch.

    ``memory_budget``: bytes per device (default: the device's memory). ``mesh_shape``: fix the
    mesh instead of trying the candidates. ``fixed``: ``{name: spec}`` for parameters (their
    ``named_parameters`` names) or user inputs (``"input_ids"``, ``"args[0]"``: how a data loader
    shards the batch), e.g. ``{"lm_head.weight": ("S(0)",)}``, honored exactly. ``zero_stage``:
    how parameters stored sharded behave where they are gathered (1, 2 or 3, see
    ``autopar.cost.memory``); by default the solver picks stage 2 or 3 per parameter.
    """
    cap = capture(model, example_inputs)
    if mixed_precision is None:
        mixed_precision = any(p.dtype in (torch.float16, torch.bfloat16) for p in model.parameters())
    return plan_captured(
        cap,
        cluster,
        memory_budget=memory_budget,
        mesh_shape=mesh_shape,
        fixed=fixed,
        optimizer=optimizer,
        mixed_precision=mixed_precision,
        zero_stage=zero_stage,
        time_limit=time_limit,
    )


def _parse_fixed(cap: Captured, fixed: dict[str, Sequence[str] | str] | None, n_axes: int) -> dict[str, Spec]:
    if not fixed:
        return {}
    alias_to_first = {a: first for first, names in cap.param_aliases.items() for a in names}
    known = set(cap.params.values()) | set(cap.inputs.values())
    out = {}
    for name, spec in fixed.items():
        first = alias_to_first.get(name, name)
        if first not in known:
            close = difflib.get_close_matches(name, sorted(cap.params.values()), n=3)
            raise ValueError(
                f"fixed names {name!r}, which is neither a parameter nor an input of the model (inputs: "
                f"{sorted(cap.inputs.values())}; similar parameters: {close})"
            )
        parsed = parse_spec(spec)
        if len(parsed) != n_axes:
            raise ValueError(
                f"fixed spec for {name!r} has {len(parsed)} entries but the mesh has {n_axes} axes; give one "
                f"placement per mesh axis"
            )
        out[first] = parsed
    return out


def plan_captured(
    cap: Captured,
    cluster: Cluster,
    *,
    memory_budget: float | None = None,
    mesh_shape: Sequence[int] | None = None,
    fixed: dict[str, Sequence[str] | str] | None = None,
    node_constraint: NodeConstraint | None = None,
    optimizer: str = "adamw",
    mixed_precision: bool = False,
    zero_stage: int | None = None,
    time_limit: float = 60.0,
    layout: str = "",
    workers: int | None = None,
) -> Plan:
    """``plan`` on an already captured program (used by ``autopar.layouts`` and benchmarks).

    ``workers``: candidate meshes solved side by side (default: up to 2, the cores CP-SAT's
    single-worker solves can use here); ``1`` solves them one after another.
    """
    from autopar.solver import InfeasibleError, SolverConfig, solve

    if workers is None:
        workers = min(2, os.cpu_count() or 1)

    t_start = time.perf_counter()
    budget = float(memory_budget if memory_budget is not None else cluster.device.memory)
    if zero_stage not in (None, 1, 2, 3):
        raise ValueError(f"zero_stage must be 1, 2, 3 or None (solver's choice), got {zero_stage!r}")
    if budget <= 0:
        raise ValueError(f"memory_budget must be positive, got {budget}")
    if mesh_shape is not None:
        meshes = [tuple(int(x) for x in mesh_shape)]
        cluster.validate_mesh(meshes[0])
    else:
        meshes = candidate_meshes(cluster)
    ctx = PassContext(captured=cap, cluster=cluster, optimizer=optimizer, mixed_precision=mixed_precision)
    gm = run_passes(cap.gm, ctx, [annotate_tensors, annotate_cost])
    zero_stages = (2, 3) if zero_stage is None else (zero_stage,)
    for mesh in meshes:  # bad `fixed` entries are reported here, before any solve
        _parse_fixed(cap, fixed, len(mesh))

    def attempt(mesh: tuple[int, ...]) -> tuple[float, Any]:
        """Annotate strategies for ``mesh`` and solve; the Solution or the InfeasibleError."""
        t0 = time.perf_counter()
        mctx = annotate_for_mesh(
            gm, cap, cluster, mesh, optimizer, mixed_precision, zero_stages, node_constraint
        )
        t_strat = time.perf_counter() - t0
        fixed_specs = _parse_fixed(cap, fixed, len(mesh))
        try:
            return t_strat, solve(
                gm, mctx, memory_budget=budget, fixed=fixed_specs, config=SolverConfig(time_limit=time_limit)
            )
        except InfeasibleError as e:
            return t_strat, e

    outcomes = _attempt_all(meshes, attempt, workers)
    best = None
    tried = []
    errors = []
    for mesh, (t_strat, sol) in zip(meshes, outcomes):
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
                "strategy_time": t_strat,
                "solve_time": sol.solve_time,
                "classes": sol.num_classes,
                "edge_vars": sol.num_edge_vars,
            }
        )
        if best is None or sol.objective < best[1].objective * (1 - 1e-9):
            best = (mesh, sol)
    if best is None:
        if len(errors) == 1:
            raise errors[0]
        raise InfeasibleError(
            "no mesh shape fits the memory budget:\n  "
            + "\n  ".join(f"{m}: {e}" for m, e in zip(meshes, errors))
        )
    mesh, sol = best
    if len(meshes) > 1:
        with warnings.catch_warnings():  # already warned for this graph
            warnings.simplefilter("ignore")
            annotate_for_mesh(
                gm, cap, cluster, mesh, optimizer, mixed_precision, zero_stages, node_constraint
            )
    p = _build_plan(gm, cap, cluster, mesh, sol)
    p.info.update(
        {
            "meshes_tried": tried,
            "planning_time": time.perf_counter() - t_start,
            "pass_timings": dict(ctx.timings),
            "cluster_desc": cluster.describe(),
            "unruled_ops": gm.meta.get("autopar.unruled_ops", []),
            "memory_budget": budget,
        }
    )
    if layout:
        p.info["layout"] = layout
    return p


def annotate_for_mesh(
    gm: torch.fx.GraphModule,
    cap: Captured,
    cluster: Cluster,
    mesh: tuple[int, ...],
    optimizer: str,
    mixed_precision: bool,
    zero_stages: tuple[int, ...],
    node_constraint: NodeConstraint | None,
) -> PassContext:
    """Annotate ``gm`` with ``mesh``'s strategies (deterministic, so a solution's indices apply to
    any re-annotation) and drop those ``node_constraint`` forbids; the mesh's pass context."""
    mctx = PassContext(
        captured=cap,
        cluster=cluster,
        mesh_shape=mesh,
        optimizer=optimizer,
        mixed_precision=mixed_precision,
        zero_stages=zero_stages,
    )
    run_passes(gm, mctx, [annotate_strategies])
    if node_constraint is not None:
        _apply_node_constraint(gm, node_constraint)
    return mctx


def _attempt_all(meshes: list[tuple[int, ...]], attempt: Callable, workers: int) -> list[tuple[float, Any]]:
    """Run ``attempt`` for every mesh; with several meshes and workers, in forked processes.

    Each candidate mesh is an independent solve (CP-SAT with one worker), so on a machine with
    ``workers`` cores they run side by side. Children are forked (they inherit the annotated graph;
    nothing is pickled but the Solution), which needs the ``fork`` start method (Linux) and a
    process that may fork (not daemonic, no other threads); otherwise, or with ``workers=1``, the
    meshes are solved one after another. The parent then re-annotates
    the winning mesh's strategies, which are deterministic.
    """
    if (
        workers <= 1
        or len(meshes) <= 1
        or "fork" not in mp.get_all_start_methods()
        or mp.current_process().daemon  # daemonic processes may not have children
        or threading.active_count() > 1  # forking a threaded process (e.g. a live process group) is unsafe
    ):
        return [attempt(m) for m in meshes]
    ctx = mp.get_context("fork")
    results: dict[int, tuple[float, Any]] = {}
    running: list[tuple[int, Any, Any]] = []
    pending = list(enumerate(meshes))

    def child(conn: Any, mesh: tuple[int, ...]) -> None:
        try:
            t, sol = attempt(mesh)
            conn.send(("ok", t, sol) if not isinstance(sol, Exception) else ("infeasible", t, str(sol)))
        except Exception as exc:  # sent to the parent, which re-raises it
            try:
                conn.send(("error", 0.0, exc))
            except Exception:  # not picklable: send the traceback as text
                conn.send(
                    ("error", 0.0, RuntimeError(f"solving mesh {mesh} failed:\n{traceback.format_exc()}"))
                )
        finally:
            conn.close()

    while pending or running:
        while pending and len(running) < workers:
            i, mesh = pending.pop(0)
            parent_end, child_end = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=child, args=(child_end, mesh), daemon=True)
            proc.start()
            child_end.close()
            running.append((i, proc, parent_end))
        i, proc, conn = running.pop(0)
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
        from autopar.solver import InfeasibleError

        results[i] = (t, InfeasibleError(payload) if status == "infeasible" else payload)
    return [results[i] for i in range(len(meshes))]


def _apply_node_constraint(gm: torch.fx.GraphModule, pred: NodeConstraint) -> None:
    """Drop strategies a layout forbids (e.g. Megatron: norms replicated on the tensor axis).

    Leaders keep the strategies ``pred`` accepts (tied nodes keep sharing one tuple, so repeated
    layers stay tied); followers are re-derived against their leader's remaining strategies.
    """
    from dataclasses import replace

    from autopar.ir import NodeStrategies
    from autopar.passes.strategies import _with_follow, getitem_strategies

    memo: dict[tuple[int, str], tuple[Strategy, ...]] = {}
    for n in gm.graph.nodes:
        ns = n.meta.get(STRATEGIES)
        if ns is None:
            continue
        if ns.follows and op_name(n) == "getitem":
            n.meta[STRATEGIES] = getitem_strategies(n)
            continue
        key = (id(ns.strategies), op_name(n))
        if key not in memo:
            memo[key] = tuple(s for s in ns.strategies if pred(n, s)) or ns.strategies
        kept = memo[key]
        if ns.follows:
            n.meta[STRATEGIES] = _with_follow(n, NodeStrategies(kept))
        elif len(kept) != len(ns.strategies):
            n.meta[STRATEGIES] = replace(ns, strategies=kept)


def _axis_names(mesh: tuple[int, ...], gm: torch.fx.GraphModule, choice: dict[str, int]) -> tuple[str, ...]:
    """Name each axis by what the matmuls do along it, weighted by their FLOPs: ``dp`` when they
    split the batch, ``tp`` when they split the weights, ``sp`` when they split the sequence;
    an axis where nothing is split is ``rep``."""
    from autopar.cost.compute import MATMUL_OPS
    from autopar.ir import COST

    votes = [{"dp": 0.0, "tp": 0.0, "sp": 0.0} for _ in mesh]
    for n in gm.graph.nodes:
        ns = n.meta.get(STRATEGIES)
        if ns is None or n.op != "call_function" or op_name(n) not in MATMUL_OPS:
            continue
        s = ns.strategies[choice[n.name]]
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
    if len(set(names)) != len(names):
        names = [f"{n}{i}" for i, n in enumerate(names)]
    return tuple(names)


def _build_plan(
    gm: torch.fx.GraphModule, cap: Captured, cluster: Cluster, mesh: tuple[int, ...], sol
) -> Plan:
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
                rewrites=s.rewrites,
                comms=s.comms,
                split=s.split,
                shape=info.shape,
                compute_time=s.compute_time,
                comm_time=s.comm_time,
                memory=s.memory,
            )
        )
    reshards: list[ReshardPlan] = []
    comm_bytes = [0.0] * len(mesh)
    comm_time = sum(s.comm_time for s in chosen.values())
    for c, s in chosen.items():
        for j, i in enumerate(tensor_inputs(c)):
            if i not in chosen or s.inputs[j] is None:
                continue
            src = chosen[i].outputs[0]  # multi-output ops are read through getitem, one output each
            dst = s.inputs[j]
            info = i.meta[TENSOR]
            grad_axes = tuple(
                a
                for a in range(len(mesh))
                if s.split[a] and isinstance(dst[a], Replicate) and info.requires_grad
            )
            if src == dst and not grad_axes:
                continue
            val = i.meta["val"] if isinstance(i.meta["val"], torch.Tensor) else None
            if val is None:
                continue
            shape, itemsize = tuple(val.shape), val.element_size()
            steps = reshard_steps(shape, src, dst, mesh)
            t = edge_cost(
                shape,
                itemsize,
                src,
                dst,
                s.split,
                info.requires_grad,
                mesh,
                cluster,
                bucketed_sync=bucketed_grad_sync(i),
                zero_stage=zero_stage_of(chosen[i].rewrites)
                if info.kind == "param" and info.requires_grad
                else 0,
            )
            per_axis = [0.0] * len(mesh)
            for st in steps:
                b = math.prod(st.out_shape if st.kind == "all_gather" else st.in_shape) * itemsize
                if step_cost(st, itemsize, mesh, cluster) > 0:
                    per_axis[st.axis] += b
            for a in grad_axes:
                from autopar.placement import local_shape

                per_axis[a] += math.prod(local_shape(shape, dst, mesh)) * itemsize
            for a in range(len(mesh)):
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
    mesh_axes = _axis_names(mesh, gm, choice)
    return Plan(
        mesh_shape=tuple(mesh),
        mesh_axes=mesh_axes,
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
        ),
        cluster=cluster.to_dict(),
        fingerprint=cap.fingerprint,
        info={"solver": {"objective": sol.objective, "solve_time": sol.solve_time, **sol.stats}},
    )


def _step_str(st) -> str:
    if st.kind in ("all_reduce", "to_partial"):
        return f"{st.kind}(axis={st.axis})"
    if st.kind == "all_to_all":
        return f"all_to_all(axis={st.axis}, {st.dim}->{st.dim2})"
    b = f"x{st.blocks}" if st.blocks > 1 else ""
    return f"{st.kind}(axis={st.axis}, dim={st.dim}{b})"

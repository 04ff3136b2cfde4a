"""The Plan record of a solved mesh: each node's chosen strategy, the reshards on its edges, the
gradient synchronization, the mesh axes named by what the matmuls split (``axis_names``), and the
solver's predicted figures.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch.fx import Node

from autopar.capture import Captured
from autopar.cost.reshard_cost import (
    compressed_grad_sync,
    edge_cost,
    grad_reduce_axes,
    grad_sync_bytes,
    scalar_output_cost,
    step_cost,
)
from autopar.grad_compression import GradCompression
from autopar.graph import OpFamily, op_family, op_name, read_by_lookup, returned_scalars, tensor_inputs
from autopar.ir import COST, STRATEGIES, TENSOR, Strategy
from autopar.mesh import Mesh
from autopar.placement import Replicate, Shard, format_spec
from autopar.planfile import NodePlan, Plan, Predicted, ReshardPlan
from autopar.reshard import (
    StepKind,
    broadcast_chain,
    bucketed_grad_sync,
    grad_sync_axes,
    moved_by_reshard,
    reshard_steps,
)
from autopar.rules.routing import grouped_mm_operands

__all__ = ["axis_names", "build_plan"]

_GATHER_OR_SCATTER = (StepKind.ALL_GATHER, StepKind.REDUCE_SCATTER)


def axis_names(mesh: tuple[int, ...], gm: torch.fx.GraphModule, choice: dict[str, int]) -> tuple[str, ...]:
    """Name each axis from the strategies the solver chose for the matmuls and convolutions,
    weighted by their FLOPs: ``tp`` when they split the weights, ``dp`` when they split the
    batch (dimension 0), ``sp`` when they split another activation dimension — ``cp`` when,
    besides, every attention splits its work there (context parallelism: the sequence split
    through attention too, by the queries or, traded for heads, by all-to-all); an axis where
    nothing is split is ``rep``. Names repeated on several axes are numbered (``dp0``,
    ``dp1``). An axis along which experts' weights are split by expert (a grouped matmul's
    weight ``S(0)``) is ``ep``, whatever the other matmuls do along it (its tokens are
    data-parallel for them, as in Megatron-LM)."""
    votes = [{"dp": 0.0, "tp": 0.0, "sp": 0.0} for _ in mesh]
    experts = set()
    attention_split = [True] * len(mesh)
    seen_attention = False
    for n in gm.graph.nodes:
        ns = n.meta.get(STRATEGIES)
        if ns is not None and op_family(n) is OpFamily.ATTENTION:
            seen_attention = True
            split = ns.strategies[choice[n.name]].split
            attention_split = [a and (i < len(split) and split[i]) for i, a in enumerate(attention_split)]
        if ns is None or op_family(n) not in (OpFamily.MATMUL, OpFamily.CONV):
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
    names = ["cp" if n == "sp" and seen_attention and attention_split[a] else n for a, n in enumerate(names)]
    names = ["ep" if a in experts else name for a, name in enumerate(names)]
    if len(set(names)) != len(names):
        names = [f"{n}{i}" for i, n in enumerate(names)]
    return tuple(names)


def build_plan(
    gm: torch.fx.GraphModule, cap: Captured, mesh: Mesh, sol: Any, compression: GradCompression | None = None
) -> Plan:
    """The Plan of the solver's solution ``sol`` for ``gm`` on ``mesh``: each node's strategy, each
    reshard with its seconds and bytes (gradient all-reduces under ``compression``), and the
    predicted step as the solver's objective sums it (the simulator plays it later)."""
    choice = sol.choice
    nodes: list[NodePlan] = []
    chosen: dict[Node, Strategy] = {}
    returned = returned_scalars(gm)
    for n in gm.graph.nodes:
        ns = n.meta.get(STRATEGIES)
        info = n.meta.get(TENSOR)
        if ns is None or info is None:
            continue
        s = ns.strategies[choice[n.name]]
        if n in returned:  # a loss returned whole: its all-reduce is this node's, as the solver charged
            s = dataclasses.replace(
                s, comm_time=s.comm_time + scalar_output_cost(returned[n], s.outputs[0], mesh)
            )
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
                offloaded=s.offloaded,
                recomputed=s.recomputed,
                split_gain=_split_gain(s, ns.strategies, mesh.shape),
            )
        )
    reshards: list[ReshardPlan] = []
    comm_bytes = [0.0] * mesh.ndim
    comm_time = sum(s.comm_time for s in chosen.values())
    synced: set[tuple] = set()  # (value, layout, axes) whose gradient all-reduce is charged: once
    two_level: set[tuple[int, ...]] = set()  # axes whose reductions and gathers run in two levels
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
            shape, steps = moved_by_reshard(
                broadcast_chain(i), shape, src, dst, mesh.shape, reshard_steps(shape, src, dst, mesh.shape)
            )
            stage = chosen[i].zero_stage if info.kind == "param" and info.requires_grad else 0
            sync_axes = grad_reduce_axes(s.split, dst, mesh, steps, stage) if info.requires_grad else ()
            weight_compression = (  # a lookup table's gradient stays exact under PowerSGD
                compression.for_weight(read_by_lookup(i))
                if compression is not None and info.kind == "param"
                else compression
            )
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
                compression=weight_compression,
            )
            squeezed = (
                compressed_grad_sync(
                    shape,
                    itemsize,
                    dst,
                    mesh,
                    sync_axes,
                    weight_compression,
                    steps,
                    stage,
                    bucketed_grad_sync(i),
                )
                if first_sync
                else None
            )
            per_axis = [0.0] * mesh.ndim
            for st in steps:
                b = math.prod(st.out_shape if st.kind == StepKind.ALL_GATHER else st.in_shape) * itemsize
                if step_cost(st, itemsize, mesh) > 0:
                    per_axis[st.axis] += b
                if (st.kind in _GATHER_OR_SCATTER or (st.kind == StepKind.SLICE and info.requires_grad)) and (
                    mesh.two_level(st.axis)
                ):  # its all-gather or reduce-scatter (or its backward's) runs in two levels
                    two_level.add((st.axis,))
            if (
                first_sync
                and bucketed_grad_sync(i)
                and not stage
                and (squeezed is None or weight_compression.method == "bf16")
                and mesh.two_level(sync_axes)
            ):
                two_level.add(tuple(a for a in sync_axes if mesh.shape[a] > 1))
            if squeezed is not None:  # the compressed all-reduces' bytes
                for a in sync_axes:
                    per_axis[a] += squeezed.wire_bytes if mesh.shape[a] > 1 else 0.0
            elif first_sync:
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
                    blocking=squeezed.blocking if squeezed is not None else 0.0,
                )
            )
    compute = sum(s.compute_time for s in chosen.values())
    layout = sum(s.layout_time for s in chosen.values())
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
        compression=compression,
        two_level=tuple(sorted(two_level)),
        info={
            "solver": {
                "objective": sol.objective,
                "memory": sol.memory,
                "solve_time": sol.solve_time,
                **sol.stats,
            }
        }
        | ({"layout_time": layout} if layout > 0 else {}),
    )


def _split_gain(s: Strategy, options: Sequence[Strategy], mesh: tuple[int, ...]) -> tuple[float, ...]:
    """``NodePlan.split_gain``: per axis, among the options that split the other axes as ``s``
    does, one less the fastest splitting this axis over the fastest not splitting it; -1 where
    either is missing (a layout that fixed the node's strategy leaves no rival to compare)."""

    def pattern(t: Strategy, a: int) -> tuple[bool, ...]:
        return tuple(bool(t.split and t.split[b]) for b in range(len(mesh)) if b != a)

    out = []
    for a, n in enumerate(mesh):
        if n <= 1:
            out.append(0.0)
            continue
        mine = pattern(s, a)
        split: list[float] = []
        whole: list[float] = []
        for t in options:
            if pattern(t, a) == mine:
                (split if t.split and t.split[a] else whole).append(t.compute_time)
        if not split or not whole or min(whole) <= 0:
            out.append(-1.0)
        else:
            out.append(max(0.0, 1 - min(split) / min(whole)))
    return tuple(out)


def _step_str(st: Any) -> str:
    if st.kind in (StepKind.ALL_REDUCE, StepKind.TO_PARTIAL):
        return f"{st.kind}(axis={st.axis})"
    if st.kind == StepKind.ALL_TO_ALL:
        blocks = (f"x{st.blocks}" if st.blocks > 1 else "", f"x{st.blocks2}" if st.blocks2 > 1 else "")
        return f"all_to_all(axis={st.axis}, {st.dim}{blocks[0]}->{st.dim2}{blocks[1]})"
    b = f"x{st.blocks}" if st.blocks > 1 else ""
    return f"{st.kind}(axis={st.axis}, dim={st.dim}{b})"

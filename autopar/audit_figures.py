"""The figures the plan audit (``autopar.audit``) draws its findings from, read from the plan
alone: replicated work per mesh axis and stage, ops without a sharding rule, bytes each axis moves
against the bound its layout needs (with the time that bound takes), the model's FLOPs per step and
the device's dense peak. The words (replicated work, bound, MFU) are ``autopar.audit``'s.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from autopar.planfile import NodePlan, Plan

_LAYER_INDEX = re.compile(r"\.\d+(?=\.|$)")
"""A repeated layer's index in a module path (``blocks.3.ln_1`` → ``blocks.*.ln_1``)."""

_MATMULS = frozenset(
    {"linear", "mm", "bmm", "matmul", "addmm", "baddbmm", "_grouped_mm", "grouped_mm", "grouped_mm_fallback"}
)
_LEFT_OPERAND = {"addmm": 1, "baddbmm": 1}
"""Position of the left matrix among a matmul's tensor inputs (0 unless named here)."""
_CONVS = frozenset({"convolution", "conv1d", "conv2d", "conv3d"})
_ATTENTION = frozenset(
    {
        "scaled_dot_product_attention",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
    }
)


@dataclass(frozen=True, slots=True)
class AxisReplication:
    """Replicated work on one mesh axis (see module docstring)."""

    axis: str
    size: int
    share: float
    """Largest over stages of the stage's replicated compute over its compute."""
    stage: int
    """The stage with that share (0 for a plan with one stage)."""
    ops: tuple[tuple[str, float], ...] = ()
    """The largest contributors in that stage, ``("lm_head: linear", share)``, largest first."""


@dataclass(frozen=True, slots=True)
class AxisComm:
    """Communication on one mesh axis against its bound (see module docstring)."""

    axis: str
    size: int
    plan_bytes: float
    """``Predicted.comm_bytes_per_axis`` of the axis."""
    bound_bytes: float
    gradient_bytes: float
    """The bound's gradient part, (a)."""
    bound_time: float
    """Seconds the bound takes at the axis's bandwidth (0 where the plan has no cluster)."""

    @property
    def ratio(self) -> float | None:
        """Plan bytes over bound bytes; None where the bound is zero."""
        return self.plan_bytes / self.bound_bytes if self.bound_bytes > 0 else None


def replicated_work(
    plan: Plan,
    by_name: dict[str, NodePlan],
    stage_of: dict[str, int],
    stage_compute: dict[int, float],
    ruled: frozenset[str],
    groups: list[Any] | None,
    cheap: float,
    floors: list[float] | None = None,
) -> list[AxisReplication]:
    """Replicated work per axis (``autopar.audit``'s module docstring); ``floors``: per axis, the
    seconds of the cheapest collective on it (``collective_floors``): a stage's replicated work on
    an axis whose whole split would save no more than that is not counted, since split work must
    meet the rest of the plan with at least one collective on that axis — and one more for each
    op of the stage, replicated on the axis, whose rows split only with a collective inside it
    (``autopar.rules.norms.SYNCED_WHEN_SPLIT``: a training batch norm synchronizes its
    statistics; kept whole, it needs its input gathered instead). Such an op whose own split
    would save no more than one collective is not counted by itself. What a split saves is the
    fraction the plan records (``NodePlan.split_gain``: by the cost model) of the op's compute,
    else an even split's ``(1 − 1/n)``; an op whose split would save under half of an even
    split's is not counted (kernels too small to fill the device take as long on a piece: a tiny
    model's LM head)."""
    from autopar.cost import comm
    from autopar.rules.norms import SYNCED_WHEN_SPLIT

    itemsize = int(plan.info.get("param_bytes", 4))
    microbatches = plan.pipeline.microbatches if plan.pipeline is not None else 1
    synced = {(r.producer, a) for r in plan.reshards for a in r.grad_sync_axes}
    batched: set[str] = set()  # nodes whose value depends on a user input (plan.nodes is in program order)
    for node in plan.nodes:
        if node.kind == "input" or any(i in batched for i in node.input_names):
            batched.add(node.name)
    out = []
    for a, (axis, n) in enumerate(zip(plan.mesh_axes, plan.mesh_shape)):
        if n <= 1:
            continue
        per_stage: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        gains: dict[int, float] = defaultdict(float)  # per stage, what splitting its counted work saves
        # per stage, replicated ops that split only with a collective
        syncs: dict[int, int] = defaultdict(int)
        for node in plan.nodes:
            if node.kind != "op" or node.op not in ruled or node.name not in batched:
                continue
            if node.split[a] or _placed_on(node, a):
                continue
            if node.op in SYNCED_WHEN_SPLIT:
                syncs[stage_of.get(node.name, 0)] += 1
                if floors is not None and node.compute_time * (1 - 1 / n) <= floors[a]:
                    continue
            if node.compute_time <= cheap:
                continue
            even = 1 - 1 / n  # what an even split saves
            if len(node.split_gain) == len(plan.mesh_shape) and node.split_gain[a] >= 0:  # the cost model's
                if node.split_gain[a] < even / 2:
                    continue  # its kernels do not shorten when split: they never fill the device
                even = node.split_gain[a]
            gain = node.compute_time * even
            shapes = [node.shape] + [by_name[i].shape for i in node.input_names if i in by_name]
            if not any(d >= n and d % n == 0 for s in shapes for d in s):
                continue
            if groups is not None:  # replicated on purpose: splitting adds a weight's gradient reduction
                unreduced = [
                    by_name[i]
                    for i in node.input_names
                    if i in by_name and by_name[i].kind == "param" and (i, a) not in synced
                ]
                added = sum(
                    comm.gradient_all_reduce_cost(
                        _local_numel(p.shape, p.outputs[0], plan.mesh_shape, a) * itemsize, groups[a]
                    )
                    for p in unreduced
                )
                if unreduced and gain * microbatches <= added:
                    continue
            label = f"{_LAYER_INDEX.sub(r'.*', node.module) or '<top>'}: {node.op}"
            per_stage[stage_of.get(node.name, 0)][label] += node.compute_time
            gains[stage_of.get(node.name, 0)] += gain
        best: tuple[float, int, dict[str, float]] = (0.0, 0, {})
        for s, ops in per_stage.items():
            if floors is not None and gains[s] <= floors[a] * (1 + syncs[s]):
                continue  # splitting all of it would not pay for the collectives it needs
            share = sum(ops.values()) / stage_compute[s] if stage_compute[s] > 0 else 0.0
            if share > best[0]:
                best = (share, s, ops)
        share, stage, ops = best
        top = sorted(ops.items(), key=lambda kv: -kv[1])[:3]
        out.append(
            AxisReplication(
                axis=axis,
                size=n,
                share=share,
                stage=stage,
                ops=tuple((name, t / stage_compute[stage]) for name, t in top),
            )
        )
    return out


def _placed_on(node: NodePlan, a: int) -> bool:
    """Whether any input or output of ``node`` is split or partial on axis ``a``."""
    return any(spec is not None and spec[a] != "R" for spec in (*node.inputs, *node.outputs))


def unruled_ops(plan: Plan, ruled: frozenset[str]) -> tuple[list[str], float]:
    names: set[str] = set()
    t = 0.0
    for n in plan.nodes:
        if n.kind == "op" and n.input_names and n.outputs and n.op not in ruled:
            names.add(n.op)
            t += n.compute_time
    return sorted(names), t


def _local_numel(shape: tuple[int, ...], spec: tuple[str, ...], mesh: tuple[int, ...], skip: int) -> float:
    """Elements of one device's piece of a tensor of ``shape`` laid out as ``spec``, ignoring axis
    ``skip`` (whole along it)."""
    pieces = math.prod(n for b, (p, n) in enumerate(zip(spec, mesh)) if b != skip and p.startswith("S"))
    return math.prod(shape) / pieces


def _gathered_repeats(p: NodePlan, collectives: tuple[str, ...], by_name: dict[str, NodePlan]) -> int:
    """How many times ``p`` repeats its input's values where the reshard ``collectives`` gathers
    them before the repeat (``autopar.reshard.BroadcastChain``: grouped-query attention's key-value
    heads, reshape ← expand ← unsqueeze, gathered along another dimension; its gradient is the
    key-value heads' size); 1 elsewhere."""
    e = (
        by_name.get(p.input_names[0])
        if p.op in ("reshape", "view", "_unsafe_view") and p.input_names
        else None
    )
    u = by_name.get(e.input_names[0]) if e is not None and e.op == "expand" and e.input_names else None
    if u is None or u.op != "unsqueeze" or len(u.shape) != len(e.shape) or not collectives:
        return 1
    grown = [d for d, (a, b) in enumerate(zip(u.shape, e.shape)) if a != b]
    if len(grown) != 1 or grown[0] < 1 or u.shape[grown[0]] != 1:
        return 1
    d, times = grown[0], e.shape[grown[0]]
    if tuple(p.shape) != (*u.shape[: d - 1], u.shape[d - 1] * times, *u.shape[d + 1 :]):
        return 1
    gathers = all(c.startswith("all_gather(") and f"dim={d - 1})" not in c for c in collectives)
    return times if gathers else 1


def communication(plan: Plan, by_name: dict[str, NodePlan], groups: list[Any] | None) -> list[AxisComm]:
    mesh = tuple(plan.mesh_shape)
    itemsize = int(plan.info.get("param_bytes", 4))
    grads = [0.0] * len(mesh)
    partial = [0.0] * len(mesh)
    seen: set[tuple[str, int, str]] = set()
    for r in plan.reshards:
        p = by_name.get(r.producer)
        if p is None or not p.outputs:
            continue
        spec = p.outputs[0]
        if p.kind != "input":
            repeats = _gathered_repeats(p, r.collectives, by_name)
            for a in r.grad_sync_axes:
                if mesh[a] > 1 and (r.producer, a, "grad") not in seen:
                    seen.add((r.producer, a, "grad"))
                    grads[a] += _local_numel(p.shape, spec, mesh, a) * itemsize / repeats
        for a, (src, dst) in enumerate(zip(r.src, r.dst)):
            if src == "P" and dst != "P" and mesh[a] > 1 and (r.producer, a, "P") not in seen:
                seen.add((r.producer, a, "P"))
                partial[a] += _local_numel(p.shape, spec, mesh, a) * itemsize
    times = _bound_times(groups, grads, partial)
    recorded = plan.predicted.comm_bytes_per_axis
    return [
        AxisComm(
            axis=axis,
            size=n,
            plan_bytes=float(recorded[a]) if a < len(recorded) else 0.0,
            bound_bytes=grads[a] + partial[a],
            gradient_bytes=grads[a],
            bound_time=times[a],
        )
        for a, (axis, n) in enumerate(zip(plan.mesh_axes, mesh))
        if n > 1
    ]


def _stage_groups(plan: Plan) -> list[Any] | None:
    """Each stage-mesh axis's device group (``autopar.cost.comm.Group``) on the plan's cluster,
    the pipeline axis outside; None where the plan names no usable cluster."""
    if not plan.cluster:
        return None
    from autopar.cluster import Cluster
    from autopar.mesh import Mesh

    try:
        cluster = Cluster.from_dict(plan.cluster)
        pp = plan.pipeline.pp if plan.pipeline is not None else 1
        full = Mesh((pp, *plan.mesh_shape), cluster)
    except (KeyError, TypeError, ValueError):
        return None
    return [full.group(a + 1) for a in range(len(plan.mesh_shape))]


def axis_groups(plan: Plan) -> list[Any] | None:
    """Each stage-mesh axis's device group with no per-message latency (gradients travel in
    buckets); None where the plan names no usable cluster."""
    groups = _stage_groups(plan)
    return None if groups is None else [g.without_latency() for g in groups]


def collective_floors(plan: Plan) -> list[float] | None:
    """Per stage-mesh axis, the seconds of its cheapest collective: an all-reduce of one element,
    latency-bound (``autopar.cost.comm``); None where the plan names no usable cluster."""
    from autopar.cost import comm

    groups = _stage_groups(plan)
    itemsize = int(plan.info.get("param_bytes", 4))
    return None if groups is None else [comm.group_all_reduce_cost(itemsize, g) for g in groups]


def _bound_times(groups: list[Any] | None, grads: list[float], partial: list[float]) -> list[float]:
    """Seconds of the bound per axis: all-reduce of the gradients (one ring, or two levels where
    that is faster), reduce-scatter of the partial sums (one ring, or two levels where that is
    faster), bandwidth only (``autopar.cost.comm``)."""
    if groups is None:
        return [0.0] * len(grads)
    from autopar.cost import comm

    return [
        comm.gradient_all_reduce_cost(grads[a], g)
        + min(
            comm.group_reduce_scatter_cost(partial[a], g), comm.two_level_reduce_scatter_cost(partial[a], g)
        )
        for a, g in enumerate(groups)
    ]


def model_flops(plan: Plan, by_name: dict[str, NodePlan]) -> float:
    """Model FLOPs of one training step (module docstring)."""
    fwd = 0.0
    for n in plan.nodes:
        if n.kind != "op" or not n.input_names:
            continue
        ins = [by_name[i].shape if i in by_name else () for i in n.input_names]
        if n.op in _MATMULS:
            left = ins[_LEFT_OPERAND.get(n.op, 0)] if len(ins) > _LEFT_OPERAND.get(n.op, 0) else ()
            if left:
                fwd += 2 * math.prod(n.shape) * left[-1]
        elif n.op in _CONVS and len(ins) > 1 and len(ins[1]) > 1:
            fwd += 2 * math.prod(n.shape) * math.prod(ins[1][1:])
        elif n.op in _ATTENTION and len(ins) > 1 and len(ins[0]) >= 2 and len(ins[1]) >= 2:
            q, k = ins[0], ins[1]
            fwd += 4 * math.prod(q[:-1]) * k[-2] * q[-1]
    microbatches = plan.pipeline.microbatches if plan.pipeline is not None else 1
    return 3 * fwd * microbatches


def peak_flops(plan: Plan) -> float:
    """One device's dense peak in the plan's dtype; on a mixed cluster (``Cluster.node_groups``)
    the mean over its devices, so that ``devices × peak`` is their sum."""
    cluster = plan.cluster or {}
    groups = cluster.get("node_groups") or [{"device": cluster.get("device") or {}, "nodes": 1}]
    total = sum(g["nodes"] for g in groups)
    return sum(_device_peak(g["device"], plan) * g["nodes"] for g in groups) / total


def _device_peak(device: dict, plan: Plan) -> float:
    peaks = device.get("peak_flops") or {}
    if int(plan.info.get("param_bytes", 4)) == 2:
        return float(peaks.get("bfloat16", peaks.get("float32", 0.0)))
    # float32: the fastest rate it may run at (TF32 tensor cores where the device has them)
    return float(max(peaks.get("float32", 0.0), peaks.get("tfloat32", 0.0)))

"""Costs of reshards (``autopar.reshard``): each step's collective, its backward conjugate, and the
whole producer→consumer edge with gradient synchronization and ZeRO's gathers.

Forward step costs use the NCCL formulas of ``autopar.cost.comm`` on the step's mesh axis
(``Mesh.all_gather_cost`` …); backward conjugates are those of ``autopar.reshard``'s docstring:
all-gather ↔ reduce-scatter (when the gradient arrives partial) or a free slice, slice and
reduce-scatter ↔ all-gather, all-to-all ↔ all-to-all, all-reduce ↔ identity. ZeRO stages follow
Rajbhandari et al. (arXiv 1910.02054 §5); bucketed gradient all-reduces follow PyTorch DDP
(Li et al., VLDB 2020).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from autopar.cost.compression import CompressedSync, GradCompression, compressed_sync
from autopar.mesh import Mesh
from autopar.placement import Replicate, Spec, local_shape
from autopar.reshard import ReshardStep, StepKind, grad_sync_axes, reshard_steps

__all__ = [
    "compressed_grad_sync",
    "edge_cost",
    "grad_reduce_axes",
    "grad_sync_bytes",
    "kept_gather_bytes",
    "reshard_cost",
    "scalar_output_cost",
    "step_backward_cost",
    "step_cost",
]


def _bytes(shape: Sequence[int], itemsize: int) -> float:
    return float(math.prod(shape)) * itemsize


# Forward cost of each step kind: which collective, on the local shape before or after the step.
_FWD = {
    StepKind.ALL_GATHER: (Mesh.all_gather_cost, "out"),
    StepKind.ALL_REDUCE: (Mesh.all_reduce_cost, "in"),
    StepKind.REDUCE_SCATTER: (Mesh.reduce_scatter_cost, "in"),
    StepKind.ALL_TO_ALL: (Mesh.all_to_all_cost, "in"),
}
# Backward conjugate of each step kind (an all-gather's is free unless its gradient arrives
# partial, see ``step_backward_cost``).
_BWD = {
    StepKind.SLICE: (Mesh.all_gather_cost, "in"),
    StepKind.REDUCE_SCATTER: (Mesh.all_gather_cost, "in"),
    StepKind.ALL_TO_ALL: (Mesh.all_to_all_cost, "out"),
}


def _apply(table: dict, step: ReshardStep, itemsize: int, mesh: Mesh) -> float:
    entry = table.get(step.kind)
    if entry is None:
        return 0.0
    fn, which = entry
    return fn(mesh, _bytes(step.out_shape if which == "out" else step.in_shape, itemsize), step.axis)


def step_cost(step: ReshardStep, itemsize: int, mesh: Mesh) -> float:
    """Forward seconds of one step."""
    return _apply(_FWD, step, itemsize, mesh)


def step_backward_cost(step: ReshardStep, itemsize: int, mesh: Mesh, fused_sync: bool) -> float:
    """Backward seconds of the step's conjugate (``fused_sync``: an all-gather whose gradient
    arrives partial becomes a reduce-scatter)."""
    if step.kind == StepKind.ALL_GATHER:
        return mesh.reduce_scatter_cost(_bytes(step.out_shape, itemsize), step.axis) if fused_sync else 0.0
    return _apply(_BWD, step, itemsize, mesh)


def reshard_cost(shape: Sequence[int], itemsize: int, src: Spec, dst: Spec, mesh: Mesh) -> float:
    """Forward seconds to reshard (no backward)."""
    return sum(step_cost(s, itemsize, mesh) for s in reshard_steps(shape, src, dst, mesh.shape))


def scalar_output_cost(itemsize: int, src: Spec, mesh: Mesh) -> float:
    """Seconds to return a scalar output (a loss) laid out as ``src`` whole on every device: the
    per-rank program always returns a scalar replicated (``passes.lower``), so a partial loss is
    all-reduced over each axis it is partial on — a latency-bound collective, one message each
    way, that can cost more than the split loss saves on a small model."""
    target = tuple(Replicate() for _ in mesh.shape)
    if tuple(src) == target:
        return 0.0
    return edge_cost((), itemsize, src, target, tuple(False for _ in mesh.shape), False, mesh)


def edge_cost(
    shape: Sequence[int],
    itemsize: int,
    src: Spec,
    dst: Spec,
    consumer_split: Sequence[bool],
    requires_grad: bool,
    mesh: Mesh,
    bucketed_sync: bool = False,
    zero_stage: int = 0,
    sync_share: float = 1.0,
    steps: Sequence[ReshardStep] | None = None,
    compression: GradCompression | None = None,
) -> float:
    """Forward + backward seconds of a producer→consumer edge, gradient synchronization included.

    ``zero_stage`` (1, 2, 3; 0 for values that are not parameters): how a parameter stored sharded
    behaves where it is gathered (Rajbhandari et al., arXiv 1910.02054 §5): stage 3 frees the
    gathered copy after use and gathers again for backward (all-gathers paid twice); stages 2 and 1 keep it, its gradient
    reduce-scattered — stage 2 every micro-batch, stage 1 once per step from the full gradient it
    accumulates (the paper's ``P_os``, §5.1 and §7.2.1: a reduce-scatter of the gradients and an
    all-gather of the updated weights, the volume of one data-parallel all-reduce; Megatron-LM's
    distributed optimizer, ``docs/source/api-guide/dist_optimizer.md``). When each runs in the
    step is the simulator's (``autopar.simulate.stage_costs``).

    ``bucketed_sync``: the gradient all-reduce is bucketed with others (parameters' gradients,
    as PyTorch DDP does, Li et al., VLDB 2020), so it pays bandwidth but no per-tensor latency.
    A gradient partial on several axes is reduced by one collective over all of them
    (``Mesh.all_reduce_cost(nbytes, axes=...)``: hierarchical across nodes, as NCCL runs it).

    ``sync_share``: the fraction of that all-reduce this edge pays. A value read the same way by
    several consumers (a tied embedding and LM head) has its gradients summed first and
    all-reduced once (``grad_sync_share``), so each of its ``k`` edges pays ``1/k`` of it.

    ``steps``: ``reshard_steps(shape, src, dst, mesh.shape)`` where the caller already has them
    (the solver's formulation costs one reshard under several gradient settings).

    ``compression``: a weight's gradient all-reduce compressed (``autopar.cost.compression``;
    given for weights only), where ``compressed_grad_sync`` says it applies.
    """
    if steps is None:
        steps = reshard_steps(shape, src, dst, mesh.shape)
    fwd = sum(step_cost(s, itemsize, mesh) for s in steps)
    if not requires_grad:
        return fwd
    bwd = 0.0
    last_on_axis = {s.axis: s for s in steps}
    for s in steps:
        fused = s is last_on_axis[s.axis] and s.kind == StepKind.ALL_GATHER and consumer_split[s.axis]
        bwd += step_backward_cost(s, itemsize, mesh, fused)
        if zero_stage == 3 and s.kind == StepKind.ALL_GATHER:
            bwd += step_cost(s, itemsize, mesh)
    axes = grad_reduce_axes(consumer_split, dst, mesh, steps, zero_stage)
    if axes and sync_share > 0:
        squeezed = compressed_grad_sync(
            shape, itemsize, dst, mesh, axes, compression, steps, zero_stage, bucketed_sync
        )
        if squeezed is not None:
            bwd += sync_share * squeezed.time
        else:
            local = _bytes(local_shape(shape, dst, mesh.shape), itemsize)
            bwd += sync_share * mesh.all_reduce_cost(
                local, axes=axes, bucketed=bucketed_sync, two_level=bucketed_sync
            )
    return fwd + bwd


def compressed_grad_sync(
    shape: Sequence[int],
    itemsize: int,
    dst: Spec,
    mesh: Mesh,
    axes: Sequence[int],
    compression: GradCompression | None,
    steps: Sequence[ReshardStep],
    zero_stage: int,
    bucketed_sync: bool,
) -> CompressedSync | None:
    """The compressed all-reduce of a weight's gradient over ``axes``, or ``None`` where it is not
    compressed: no ``compression``, a ZeRO parameter (its gradient is reduce-scattered), or a
    weight resharded on its way to the consumer (its gradient is reduced inside the reshard's
    backward). What is left is the gradient all-reduced where the weight is stored, the one the
    runtime buckets and compresses (``autopar.passes.compress``)."""
    if compression is None or zero_stage or steps or not bucketed_sync or not axes:
        return None
    return compressed_sync(local_shape(shape, dst, mesh.shape), itemsize, compression, mesh, axes)


def grad_reduce_axes(
    consumer_split: Sequence[bool],
    dst: Spec,
    mesh: Mesh,
    steps: Sequence[ReshardStep] | None = None,
    zero_stage: int = 0,
) -> tuple[int, ...]:
    """Mesh axes over which an edge's gradient is all-reduced: those where the consumer splits the
    work while reading the value whole (Megatron-LM's ``f``, ``autopar.reshard.grad_sync_axes``),
    less size-1 axes (a group of one device communicates nothing) and less those fused into an
    all-gather's backward reduce-scatter (its last step on that axis)."""
    last = {s.axis: s for s in steps or ()}
    return tuple(
        a
        for a in grad_sync_axes(consumer_split, dst)
        if mesh.shape[a] > 1 and not (a in last and last[a].kind == StepKind.ALL_GATHER)
    )


def grad_sync_bytes(
    shape: Sequence[int], itemsize: int, dst: Spec, axes: Sequence[int], mesh: Mesh
) -> list[float]:
    """Bytes per mesh axis the gradient all-reduce of an edge moves (its local buffer on every axis
    it spans; 0 on size-1 axes, where nothing is sent)."""
    local = _bytes(local_shape(shape, dst, mesh.shape), itemsize)
    return [local if a in axes and mesh.shape[a] > 1 else 0.0 for a in range(mesh.ndim)]


def kept_gather_bytes(
    shape: Sequence[int],
    itemsize: int,
    src: Spec,
    dst: Spec,
    mesh: Mesh,
    zero_stage: int,
    steps: Sequence[ReshardStep] | None = None,
) -> float:
    """Bytes a ZeRO stage-1/2 parameter's gathered copy (and, stage 1, its full gradient) adds from
    forward to backward where a user gathers it; 0 for stage 3 or when nothing is gathered.

    The parameter's own strategy already counts its shard of weight and gradient
    (``training_state_bytes``), so the gather adds the rest: the full copy less the shard. Per
    parameter over ``N`` devices (ZeRO paper §5, Table 1): stage 2 keeps ``2 + 14/N`` bytes
    (shards 16/N, plus the weight's 2 − 2/N), stage 1 ``4 + 12/N`` (plus the gradient's 2 − 2/N).
    ``steps``: as ``edge_cost``'s.
    """
    if zero_stage not in (1, 2):
        return 0.0
    if steps is None:
        steps = reshard_steps(shape, src, dst, mesh.shape)
    if not any(s.kind == StepKind.ALL_GATHER for s in steps):
        return 0.0
    full = _bytes(local_shape(shape, dst, mesh.shape), itemsize)
    shard = _bytes(local_shape(shape, src, mesh.shape), itemsize)
    return max(0.0, full - shard) * (2 if zero_stage == 1 else 1)

"""Reshards: turning a tensor from one spec into another, as a list of per-axis collectives.

``reshard_steps(shape, src, dst, mesh_shape)`` returns the collectives in the order they run.
The same steps drive the solver's edge costs (``reshard_cost``) and the lowering (each step is one
collective node in the per-rank graph), so what is costed is what runs.

Order matters when two axes shard the same dimension (the first axis takes the outer split):

1. innermost axis first, leave every placement that must change: ``Partial`` by all-reduce (or a
   reduce-scatter straight into the target shard), ``Shard`` by all-gather (or an all-to-all
   straight into another dimension). An inner axis that shards the same dimension as a changing
   outer one is gathered too, and re-sliced in step 2.
2. outermost axis first, enter the target placements from ``Replicate``: a ``Shard`` is a free
   local slice; a ``Partial`` keeps the value on the axis's first device and zeros elsewhere.

Backward (training): every step has a conjugate — all-gather ↔ reduce-scatter (or a free slice
when the gradient arriving is already complete), slice ↔ all-gather, all-reduce ↔ identity,
reduce-scatter ↔ all-gather, all-to-all ↔ all-to-all. A replicated value read by an op whose
work is split along an axis receives a partial gradient there, which is all-reduced (Megatron-LM's
``f``, arXiv 1909.08053 §3); when the value was just all-gathered along that axis the two fuse
into one reduce-scatter in backward (Megatron-LM's sequence parallelism, arXiv 2205.05198 §4.2.2).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from torch.fx import Node

from autopar.cluster import Cluster
from autopar.cost.comm import all_gather_cost, all_reduce_cost, all_to_all_cost, reduce_scatter_cost
from autopar.ir import TENSOR
from autopar.placement import Partial, Replicate, Shard, Spec, local_shape
from autopar.rules import tensor_inputs

__all__ = [
    "ReshardStep",
    "bucketed_grad_sync",
    "edge_cost",
    "kept_gather_bytes",
    "reshard_cost",
    "reshard_steps",
]

R = Replicate()


@dataclass(frozen=True, slots=True)
class ReshardStep:
    """One collective (or local op) on one mesh axis."""

    kind: str
    """``all_gather``, ``slice``, ``all_reduce``, ``reduce_scatter``, ``all_to_all`` or ``to_partial``."""
    axis: int
    dim: int = -1
    """Tensor dimension gathered / sliced / scattered (for all_to_all: the dimension gathered)."""
    blocks: int = 1
    dim2: int = -1
    """all_to_all: the dimension split."""
    in_shape: tuple[int, ...] = ()
    """Local shape before the step."""
    out_shape: tuple[int, ...] = ()
    """Local shape after the step."""


def _local(shape: Sequence[int], spec: list, mesh_shape: Sequence[int]) -> tuple[int, ...]:
    return local_shape(shape, tuple(spec), mesh_shape)


def reshard_steps(shape: Sequence[int], src: Spec, dst: Spec, mesh_shape: Sequence[int]) -> list[ReshardStep]:
    """Collectives that turn a tensor of global ``shape`` laid out as ``src`` into ``dst``."""
    if src == dst:
        return []
    n_axes = len(mesh_shape)
    cur = list(src)
    steps: list[ReshardStep] = []

    def emit(kind: str, axis: int, new: object, **kw: int) -> None:
        before = _local(shape, cur, mesh_shape)
        cur[axis] = new
        steps.append(ReshardStep(kind, axis, in_shape=before, out_shape=_local(shape, cur, mesh_shape), **kw))

    def shards_dim(p: object, d: int) -> bool:
        return isinstance(p, Shard) and p.dim == d

    def gather_inner(axis: int, d: int) -> None:
        for b in range(n_axes - 1, axis, -1):
            if shards_dim(cur[b], d):
                p = cur[b]
                emit("all_gather", b, R, dim=p.dim, blocks=p.blocks)

    # Phase 1: leave placements that must change, innermost axis first.
    for a in range(n_axes - 1, -1, -1):
        if cur[a] == dst[a]:
            continue
        p, q = cur[a], dst[a]
        if isinstance(q, Shard):
            gather_inner(a, q.dim)
        if isinstance(p, Partial):
            others = [b for b in range(n_axes) if b != a]
            if (
                isinstance(q, Shard)
                and q.blocks == 1
                and not any(shards_dim(cur[b], q.dim) or shards_dim(dst[b], q.dim) for b in others)
            ):
                emit("reduce_scatter", a, q, dim=q.dim)
            else:
                emit("all_reduce", a, R)
        elif isinstance(p, Shard):
            gather_inner(a, p.dim)
            others = [b for b in range(n_axes) if b != a]
            if (
                isinstance(q, Shard)
                and q.dim != p.dim
                and p.blocks == 1
                and q.blocks == 1
                and not any(
                    shards_dim(cur[b], d) or shards_dim(dst[b], d) for b in others for d in (p.dim, q.dim)
                )
            ):
                emit("all_to_all", a, q, dim=p.dim, dim2=q.dim)
            else:
                emit("all_gather", a, R, dim=p.dim, blocks=p.blocks)
    # Phase 2: enter target placements from Replicate, outermost axis first.
    for a in range(n_axes):
        if cur[a] == dst[a]:
            continue
        q = dst[a]
        assert isinstance(cur[a], Replicate), (src, dst, cur)
        if isinstance(q, Shard):
            emit("slice", a, q, dim=q.dim, blocks=q.blocks)
        else:
            emit("to_partial", a, q)
    return steps


def _bytes(shape: Sequence[int], itemsize: int) -> float:
    return float(math.prod(shape)) * itemsize


def step_cost(step: ReshardStep, itemsize: int, mesh_shape: Sequence[int], cluster: Cluster) -> float:
    """Forward seconds of one step."""
    n = mesh_shape[step.axis]
    link = cluster.axis_link(tuple(mesh_shape), step.axis)
    if step.kind == "all_gather":
        return all_gather_cost(_bytes(step.out_shape, itemsize), n, link)
    if step.kind == "all_reduce":
        return all_reduce_cost(_bytes(step.in_shape, itemsize), n, link)
    if step.kind == "reduce_scatter":
        return reduce_scatter_cost(_bytes(step.in_shape, itemsize), n, link)
    if step.kind == "all_to_all":
        return all_to_all_cost(_bytes(step.in_shape, itemsize), n, link)
    return 0.0


def step_backward_cost(
    step: ReshardStep, itemsize: int, mesh_shape: Sequence[int], cluster: Cluster, fused_sync: bool
) -> float:
    """Backward seconds of the step's conjugate (``fused_sync``: an all-gather whose gradient
    arrives partial becomes a reduce-scatter)."""
    n = mesh_shape[step.axis]
    link = cluster.axis_link(tuple(mesh_shape), step.axis)
    if step.kind == "all_gather":
        return reduce_scatter_cost(_bytes(step.out_shape, itemsize), n, link) if fused_sync else 0.0
    if step.kind in ("slice", "reduce_scatter"):
        return all_gather_cost(_bytes(step.in_shape, itemsize), n, link)
    if step.kind == "all_to_all":
        return all_to_all_cost(_bytes(step.out_shape, itemsize), n, link)
    return 0.0


def reshard_cost(
    shape: Sequence[int], itemsize: int, src: Spec, dst: Spec, mesh_shape: Sequence[int], cluster: Cluster
) -> float:
    """Forward seconds to reshard (no backward)."""
    return sum(
        step_cost(s, itemsize, mesh_shape, cluster) for s in reshard_steps(shape, src, dst, mesh_shape)
    )


def bucketed_grad_sync(node: Node) -> bool:
    """True when a gradient all-reduce on ``node``'s value can be bucketed like a parameter's.

    That holds for a parameter, and for a value computed from exactly one gradient-carrying input
    that itself qualifies (a cast, view or embedding lookup of one weight, e.g. GPT-2's position
    embedding): its gradient feeds nothing in backward but that parameter's gradient, so, like
    DDP's bucketed gradient all-reduces, nothing waits on it and it pays no per-tensor latency.
    """
    while True:
        info = node.meta.get(TENSOR)
        if info is None:
            return False
        if info.kind == "param":
            return True
        if node.op != "call_function":
            return False
        grads = [
            i for i in tensor_inputs(node) if i.meta.get(TENSOR) is not None and i.meta[TENSOR].requires_grad
        ]
        if len(grads) != 1:
            return False
        node = grads[0]


def edge_cost(
    shape: Sequence[int],
    itemsize: int,
    src: Spec,
    dst: Spec,
    consumer_split: Sequence[bool],
    requires_grad: bool,
    mesh_shape: Sequence[int],
    cluster: Cluster,
    bucketed_sync: bool = False,
    zero_stage: int = 0,
) -> float:
    """Forward + backward seconds of a producer→consumer edge, gradient synchronization included.

    ``zero_stage`` (1, 2, 3; 0 for values that are not parameters): how a parameter stored sharded
    behaves where it is gathered (Rajbhandari et al., arXiv 1910.02054 §5): stage 3 frees the
    gathered copy after use and gathers again for backward (all-gathers paid twice); stage 2 keeps
    it, its gradient reduce-scattered; stage 1 keeps it and all-reduces the full gradient.

    ``bucketed_sync``: the gradient all-reduce is bucketed with others (parameters' gradients,
    as PyTorch DDP does, Li et al., VLDB 2020), so it pays bandwidth but no per-tensor latency.

    Returns ``inf`` when the edge cannot be realized (a replicated value cannot feed a consumer
    that wants it ``Partial`` on an axis where the consumer splits work — it is allowed and free
    otherwise).
    """
    steps = reshard_steps(shape, src, dst, mesh_shape)
    fwd = sum(step_cost(s, itemsize, mesh_shape, cluster) for s in steps)
    if not requires_grad:
        return fwd
    bwd = 0.0
    last_on_axis = {s.axis: s for s in steps}
    fusable = zero_stage != 1
    for s in steps:
        fused = fusable and s is last_on_axis[s.axis] and s.kind == "all_gather" and consumer_split[s.axis]
        bwd += step_backward_cost(s, itemsize, mesh_shape, cluster, fused)
        if zero_stage == 3 and s.kind == "all_gather":
            bwd += step_cost(s, itemsize, mesh_shape, cluster)
    local = local_shape(shape, dst, mesh_shape)
    for a, split in enumerate(consumer_split):
        if split and isinstance(dst[a], Replicate):
            last = last_on_axis.get(a)
            if fusable and last is not None and last.kind == "all_gather":
                continue  # fused into the all-gather's backward reduce-scatter
            link = cluster.axis_link(tuple(mesh_shape), a)
            if bucketed_sync:
                link = replace(
                    link, latency=0.0, measured=tuple((c, m, 0.0, b) for c, m, _, b in link.measured)
                )
            bwd += all_reduce_cost(_bytes(local, itemsize), mesh_shape[a], link)
    return fwd + bwd


def kept_gather_bytes(
    shape: Sequence[int], itemsize: int, src: Spec, dst: Spec, mesh_shape: Sequence[int], zero_stage: int
) -> float:
    """Bytes a ZeRO stage-1/2 parameter's gathered copy (and, stage 1, its full gradient) holds
    from forward to backward where a user gathers it; 0 for stage 3 or when nothing is gathered."""
    if zero_stage not in (1, 2):
        return 0.0
    if not any(s.kind == "all_gather" for s in reshard_steps(shape, src, dst, mesh_shape)):
        return 0.0
    full = _bytes(local_shape(shape, dst, mesh_shape), itemsize)
    return full * (2 if zero_stage == 1 else 1)

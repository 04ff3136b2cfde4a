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

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from torch.fx import Node

from autopar.graph import tensor_inputs
from autopar.ir import TENSOR
from autopar.placement import Partial, Placement, Replicate, Shard, Spec, local_shape

__all__ = [
    "BroadcastChain",
    "ReshardStep",
    "StepKind",
    "broadcast_chain",
    "bucketed_grad_sync",
    "grad_sync_axes",
    "lift_placement",
    "moved_before_broadcast",
    "moved_by_reshard",
    "repeat_stride",
    "reshard_steps",
    "unbroadcast_shape",
]

R = Replicate()


class StepKind(str, enum.Enum):
    """One collective (or local op) of a reshard. Its cost is ``autopar.cost.reshard_cost``'s, its
    differentiable op ``autopar.program.collectives.STEP_OPS``'s: one table each."""

    ALL_GATHER = "all_gather"
    SLICE = "slice"
    ALL_REDUCE = "all_reduce"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_TO_ALL = "all_to_all"
    TO_PARTIAL = "to_partial"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, slots=True)
class ReshardStep:
    """One collective (or local op) on one mesh axis."""

    kind: StepKind
    axis: int
    dim: int = -1
    """Tensor dimension gathered / sliced / scattered (for all_to_all: the dimension gathered)."""
    blocks: int = 1
    dim2: int = -1
    """all_to_all: the dimension split."""
    blocks2: int = 1
    """all_to_all: the blocks of the split it makes (``blocks``: of the one it leaves)."""
    in_shape: tuple[int, ...] = ()
    """Local shape before the step."""
    out_shape: tuple[int, ...] = ()
    """Local shape after the step."""


def _local(shape: Sequence[int], spec: list, mesh_shape: Sequence[int]) -> tuple[int, ...]:
    return local_shape(shape, tuple(spec), mesh_shape)


def _innermost_split(cur: list, dst: Spec, a: int, d: int, others: list[int]) -> bool:
    """Whether axis ``a``'s split of dimension ``d`` would be the innermost one, every other axis
    that splits ``d`` an outer one (``b < a``) that keeps its placement: then a reduce-scatter of the
    local block along ``d`` lands exactly on ``a``'s share (the outer axes' blocks are untouched), as
    Megatron-Core's sequence-parallel reduce-scatter runs inside a context-parallel chunk."""
    for b in others:
        splits = [isinstance(p, Shard) and p.dim == d for p in (cur[b], dst[b])]
        if any(splits) and (b > a or cur[b] != dst[b] or cur[b].blocks != 1):
            return False
    return True


def reshard_steps(shape: Sequence[int], src: Spec, dst: Spec, mesh_shape: Sequence[int]) -> list[ReshardStep]:
    """Collectives that turn a tensor of global ``shape`` laid out as ``src`` into ``dst``."""
    if src == dst:
        return []
    n_axes = len(mesh_shape)
    cur = list(src)
    steps: list[ReshardStep] = []

    def emit(kind: StepKind, axis: int, new: object, **kw: int) -> None:
        before = _local(shape, cur, mesh_shape)
        cur[axis] = new
        steps.append(ReshardStep(kind, axis, in_shape=before, out_shape=_local(shape, cur, mesh_shape), **kw))

    def shards_dim(p: object, d: int) -> bool:
        return isinstance(p, Shard) and p.dim == d

    def gather_inner(axis: int, d: int) -> None:
        for b in range(n_axes - 1, axis, -1):
            if shards_dim(cur[b], d):
                p = cur[b]
                emit(StepKind.ALL_GATHER, b, R, dim=p.dim, blocks=p.blocks)

    # Phase 0: slice first where a split enters from Replicate along a dimension no other axis
    # splits, before or after: the collectives that follow move the slice, not the whole (the
    # reorder of grouped-query keys into a ring's stripes under more tensor-parallel devices than
    # key-value heads moves each device's heads, not all of them). A slice is local either way.
    for a in range(n_axes):
        q = dst[a]
        if (
            cur[a] != q
            and isinstance(cur[a], Replicate)
            and isinstance(q, Shard)
            and not any(shards_dim(p, q.dim) for b in range(n_axes) if b != a for p in (src[b], dst[b]))
        ):
            emit(StepKind.SLICE, a, q, dim=q.dim, blocks=q.blocks)
    # Phase 1: leave placements that must change, innermost axis first.
    for a in range(n_axes - 1, -1, -1):
        if cur[a] == dst[a]:
            continue
        p, q = cur[a], dst[a]
        if isinstance(q, Shard):
            gather_inner(a, q.dim)
        if isinstance(p, Partial):
            others = [b for b in range(n_axes) if b != a]
            if isinstance(q, Shard) and q.blocks == 1 and _innermost_split(cur, dst, a, q.dim, others):
                emit(StepKind.REDUCE_SCATTER, a, q, dim=q.dim)
            else:
                emit(StepKind.ALL_REDUCE, a, R)
        elif isinstance(p, Shard):
            gather_inner(a, p.dim)
            others = [b for b in range(n_axes) if b != a]
            if isinstance(q, Shard) and not any(
                shards_dim(cur[b], d) or shards_dim(dst[b], d) for b in others for d in (p.dim, q.dim)
            ):
                # one split for another — of another dimension, or of the same one in other
                # blocks (contiguous to striped): each device sends each other what it will hold
                emit(StepKind.ALL_TO_ALL, a, q, dim=p.dim, dim2=q.dim, blocks=p.blocks, blocks2=q.blocks)
            else:
                emit(StepKind.ALL_GATHER, a, R, dim=p.dim, blocks=p.blocks)
    # Phase 2: enter target placements from Replicate, outermost axis first.
    for a in range(n_axes):
        if cur[a] == dst[a]:
            continue
        q = dst[a]
        assert isinstance(cur[a], Replicate), (src, dst, cur)
        if isinstance(q, Shard):
            emit(StepKind.SLICE, a, q, dim=q.dim, blocks=q.blocks)
        else:
            emit(StepKind.TO_PARTIAL, a, q)
    return steps


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


def grad_sync_axes(split: Sequence[bool], dst: Spec, requires_grad: bool = True) -> tuple[int, ...]:
    """Axes where a consumer's gradient for an input arriving as ``dst`` is partial: the consumer
    splits its work there (``split``) while reading the input whole (``Replicate``), so the
    gradient must be all-reduced (Megatron-LM's ``f``)."""
    if not requires_grad:
        return ()
    return tuple(a for a, (sp, p) in enumerate(zip(split, dst)) if sp and isinstance(p, Replicate))


@dataclass(frozen=True, slots=True)
class BroadcastChain:
    """``reshape(expand(unsqueeze(x, d + 1)))``: ``x``'s dimension ``d`` repeated ``times`` times in
    place (transformers' ``repeat_kv``, the key-value heads of grouped-query attention). An
    all-gather of the result along any other dimension gathers ``times`` copies of the same
    values: gathering ``x`` — the expand's input — and broadcasting after moves ``times`` fewer
    bytes, forward and backward alike (Megatron-Core gathers the key-value heads across ``cp``
    before they are repeated)."""

    unsqueeze: Node
    expand: Node
    reshape: Node
    dim: int
    """The dimension of the result that holds the repeats (``d``)."""
    times: int


def broadcast_chain(node: Node) -> BroadcastChain | None:
    """The :class:`BroadcastChain` ending at ``node``, or ``None``: each link with one user, the
    ``unsqueeze`` inserting one dimension, the ``expand`` broadcasting only it, the ``reshape``
    merging it into the dimension before it."""
    from autopar.graph import op_name

    if node.op != "call_function" or op_name(node) not in ("reshape", "view", "_unsafe_view"):
        return None
    ex = node.args[0]
    if not isinstance(ex, Node) or ex.op != "call_function" or op_name(ex) != "expand" or len(ex.users) != 1:
        return None
    un = ex.args[0]
    if (
        not isinstance(un, Node)
        or un.op != "call_function"
        or op_name(un) != "unsqueeze"
        or len(un.users) != 1
    ):
        return None
    shapes = [tuple(n.meta["val"].shape) if "val" in n.meta else None for n in (un.args[0], un, ex, node)]
    if any(s is None for s in shapes) or not isinstance(un.args[0], Node):
        return None
    src, uns, exs, out = shapes
    d = int(un.args[1]) % len(uns)
    times = exs[d] if len(exs) == len(uns) else 0
    if (
        d < 1
        or uns[d] != 1
        or times < 2
        or exs[:d] + exs[d + 1 :] != uns[:d] + uns[d + 1 :]
        or out != (*src[: d - 1], src[d - 1] * times, *src[d:])
    ):
        return None
    return BroadcastChain(un, ex, node, d - 1, times)


def moved_before_broadcast(chain: BroadcastChain | None, steps: Sequence[ReshardStep]) -> bool:
    """Whether a reshard of ``chain``'s result by ``steps`` can run on the expand's input instead
    (:class:`BroadcastChain`): every step an all-gather along a dimension other than the repeats'
    (context parallelism's gathered keys and values), or an all-to-all whose two dimensions are
    both other than the repeats' (the reorder of keys and values into a ring's stripes), each
    moving ``times`` copies of the same values after the repeat and one before it."""
    if chain is None or not steps:
        return False
    return all(
        (s.kind == StepKind.ALL_GATHER and s.dim != chain.dim and s.blocks == 1)
        or (s.kind == StepKind.ALL_TO_ALL and chain.dim not in (s.dim, s.dim2))
        for s in steps
    )


def lift_placement(p: Placement, chain: BroadcastChain) -> Placement:
    """A placement of ``chain``'s result as the same split of the expand's input, which has one
    dimension more (the repeats', inserted after ``chain.dim``)."""
    if isinstance(p, Shard) and p.dim > chain.dim:
        return Shard(p.dim + 1, p.blocks)
    return p


def unbroadcast_shape(chain: BroadcastChain) -> tuple[int, ...]:
    """The shape of ``chain``'s result before the repeat (its repeats' dimension ``times`` smaller):
    what a reshard moved before the broadcast carries."""
    out = list(chain.reshape.meta["val"].shape)
    out[chain.dim] //= chain.times
    return tuple(out)


def repeat_stride(chain: BroadcastChain | None, spec: Spec, mesh_shape: Sequence[int]) -> int:
    """The stride between the distinct values a device's piece (``spec``) of ``chain``'s result
    holds along its repeats' dimension: its piece is ``repeat_interleave(piece[::stride], stride)``
    there (grouped-query attention's key-value heads as a ring passes them, once each:
    ``autopar.program.ring_attention``). A piece of ``r`` rows of a dimension repeated ``t`` times
    starts at a multiple of ``r``: it holds ``r / t`` values ``t`` times each where ``t`` divides
    ``r``, one value ``r`` times where ``r`` divides ``t``; 1 elsewhere, without a chain, or where a
    striped split (``Shard(d, blocks > 1)``) of the dimension interleaves the pieces."""
    if chain is None:
        return 1
    if any(isinstance(p, Shard) and p.dim == chain.dim and p.blocks > 1 for p in spec):
        return 1
    rows = local_shape(tuple(chain.reshape.meta["val"].shape), spec, mesh_shape)[chain.dim]
    if rows % chain.times == 0:
        return chain.times
    return rows if chain.times % rows == 0 else 1


def moved_by_reshard(
    chain: BroadcastChain | None,
    shape: tuple[int, ...],
    src: Spec,
    dst: Spec,
    mesh_shape: Sequence[int],
    steps: Sequence[ReshardStep],
) -> tuple[tuple[int, ...], Sequence[ReshardStep]]:
    """The shape a reshard ``steps`` of a value of ``shape`` moves, and its steps: the value's own,
    or, where the value ends a ``chain`` the reshard gathers before its repeat
    (``moved_before_broadcast``), the unrepeated shape and the steps there. The solver's edge
    costs and the plan record both price a reshard through this; the lowering runs the same."""
    if not moved_before_broadcast(chain, steps):
        return shape, steps
    small = unbroadcast_shape(chain)
    return small, reshard_steps(small, src, dst, mesh_shape)

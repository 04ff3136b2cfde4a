"""Differentiable collectives on one mesh axis: the reshard steps of ``autopar.reshard`` as ops.

Each function takes an :class:`AxisGroup` (the process group of one mesh axis, this rank's
coordinate on it, and counters) and a local tensor, and is an ``autograd.Function`` whose
backward is the conjugate collective (Megatron-LM's ``f``/``g`` pairs, arXiv 1909.08053 §3):

==================  =====================================  ======================================
op                  forward                                backward
==================  =====================================  ======================================
``all_gather``      gather shards along ``dim``            slice (or reduce-scatter when
                                                           ``grad_partial``: the consumer splits
                                                           work, Megatron-SP's pairing)
``shard_slice``     keep this rank's piece                 all-gather
``all_reduce``      sum over the axis (``g``)              identity
``reduce_scatter``  sum, keep this rank's piece            all-gather
``all_to_all``      shard moves from ``dim`` to ``dim2``   the reverse all-to-all
``to_partial``      keep on coordinate 0, zero elsewhere   identity
``grad_sync``       identity (``f``)                       all-reduce
==================  =====================================  ======================================

Gradient convention: the gradient of a replicated value is complete and identical on every device
of the axis, of a sharded value the gradient of the local shard, of a partial value complete. An
op that splits work along an axis makes its replicated inputs' gradients partial; ``grad_sync``
(or a ``grad_partial`` all-gather) restores the convention.

``Shard(d, blocks=k)`` is handled by ``blocks``: the local tensor holds one piece of each of ``k``
equal blocks of dimension ``d``.
"""

from __future__ import annotations

import weakref
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives  # registers torch.ops._c10d_functional

from autopar.placement import Spec
from autopar.reshard import ReshardStep, StepKind, reshard_steps

__all__ = [
    "STEP_OPS",
    "AxisGroup",
    "GatheredParams",
    "all_gather",
    "all_gather_param",
    "all_reduce",
    "all_to_all",
    "apply_step",
    "grad_sync",
    "reduce_scatter",
    "reduce_values",
    "run_reshard",
    "shard_slice",
    "step_call",
    "to_partial",
]


@dataclass(eq=False)
class AxisGroup:
    """One mesh axis as this rank sees it, or (``parts``) several axes as one group."""

    axis: int
    name: str
    size: int
    coord: int
    """This rank's index along the axis."""
    group: dist.ProcessGroup | None
    counts: Counter = field(default_factory=Counter)
    """Collectives issued on this axis, by kind and direction ("all_reduce/fwd")."""
    counting: bool = True
    """Count collectives as they run (off while a program is traced: a traced program's
    collectives are counted from its graph each time it runs)."""
    parts: tuple[AxisGroup, ...] = ()
    """Of a group over several mesh axes: the single axes it spans (its collectives are counted
    on each of them)."""
    combined: dict[tuple[int, ...], AxisGroup] = field(default_factory=dict)
    """Groups over several axes of this axis's mesh, by the axes' indices (one dict, shared by the
    mesh's axes): a gradient partial on several axes is all-reduced once over all of them, as
    ``autopar.cost`` prices it, not once per axis (``passes.lower``)."""

    levels: tuple[AxisGroup, AxisGroup] | None = None
    """Where the plan reduces this group's gradients in two levels (``Plan.two_level``): the
    group of its members on this rank's node and the group of the members at this rank's place
    on every node (``passes.two_level``)."""

    def __repr__(self) -> str:
        return f"AxisGroup({self.name}, size={self.size}, coord={self.coord})"

    @property
    def group_name(self) -> str:
        """The process group's name, as functional collectives take it."""
        group = self.group if self.group is not None else dist.group.WORLD
        return group.group_name

    def note(self, kind: str, direction: str) -> None:
        if self.parts:
            for part in self.parts:
                part.note(kind, direction)
        elif self.counting:
            self.counts[f"{kind}/{direction}"] += 1


# ------------------------------------------------------------------------ plain (no autograd)
#
# Each primitive issues one functional collective (``torch.ops._c10d_functional``: out of place,
# asynchronous, traceable by ``make_fx``) and completes it with ``wait_tensor``. Run eagerly, the
# wait follows at once; traced into the per-rank program, issue and wait are separate graph nodes
# that the overlap passes (``autopar.passes.overlap``) move apart.

_fc = torch.ops._c10d_functional


def _wait(t: torch.Tensor) -> torch.Tensor:
    return _fc.wait_tensor(t)


def _gather(x: torch.Tensor, ax: AxisGroup, dim: int, blocks: int, direction: str) -> torch.Tensor:
    ax.note("all_gather", direction)
    n = ax.size
    x = x.contiguous()
    flat = _wait(_fc.all_gather_into_tensor(x.view(-1), n, ax.group_name))
    buf = flat.view(n, *x.shape)
    # buf[r] is rank r's piece; interleave along dim (per block when blocks > 1).
    if blocks == 1:
        return torch.cat(list(buf.unbind(0)), dim=dim)
    shape = list(x.shape)
    m = shape[dim] // blocks
    b = buf.view(n, *shape[:dim], blocks, m, *shape[dim + 1 :])
    b = b.movedim(0, dim + 1)  # [..., blocks, n, m, ...]
    out_shape = [*shape[:dim], blocks * n * m, *shape[dim + 1 :]]
    return b.reshape(out_shape)


def _slice(x: torch.Tensor, ax: AxisGroup, dim: int, blocks: int) -> torch.Tensor:
    n, c = ax.size, ax.coord
    if blocks == 1:
        size = x.shape[dim] // n
        return x.narrow(dim, c * size, size).contiguous()
    shape = list(x.shape)
    per_block = shape[dim] // blocks
    piece = per_block // n
    v = x.reshape(*shape[:dim], blocks, per_block, *shape[dim + 1 :])
    v = v.narrow(dim + 1, c * piece, piece)
    return v.reshape(*shape[:dim], blocks * piece, *shape[dim + 1 :]).contiguous()


def reduce_values(x: torch.Tensor, ax: AxisGroup, direction: str = "fwd", op: str = "sum") -> torch.Tensor:
    """All-reduce with no autograd (``op``: ``"sum"`` or ``"max"``): statistics, counts."""
    ax.note("all_reduce", direction)
    return _wait(_fc.all_reduce(x.contiguous(), op, ax.group_name))


def _reduce_scatter(x: torch.Tensor, ax: AxisGroup, dim: int, blocks: int, direction: str) -> torch.Tensor:
    ax.note("reduce_scatter", direction)
    n = ax.size
    if blocks == 1:
        moved = x.movedim(dim, 0).contiguous()
        out = _wait(_fc.reduce_scatter_tensor(moved, "sum", n, ax.group_name))
        return out.movedim(0, dim).contiguous()
    # Blocked layout: reorder so each rank's pieces are contiguous, then scatter.
    shape = list(x.shape)
    per_block = shape[dim] // blocks
    piece = per_block // n
    v = x.reshape(*shape[:dim], blocks, n, piece, *shape[dim + 1 :]).movedim(dim + 1, 0).contiguous()
    out = _wait(_fc.reduce_scatter_tensor(v, "sum", n, ax.group_name))
    return out.reshape(*shape[:dim], blocks * piece, *shape[dim + 1 :])


def _all_to_all(
    x: torch.Tensor, ax: AxisGroup, dim: int, dim2: int, direction: str, blocks: int = 1, blocks2: int = 1
) -> torch.Tensor:
    """Local ``x`` is sharded on ``dim`` (in ``blocks``); return it sharded on ``dim2`` (in
    ``blocks2``) instead — another dimension, or the same one in other blocks."""
    ax.note("all_to_all", direction)
    n = ax.size
    if blocks == blocks2 == 1 and dim != dim2:
        chunks = torch.stack(list(x.chunk(n, dim=dim2)), 0).contiguous()
        split = [chunks.shape[0] // n] * n
        out = _wait(_fc.all_to_all_single(chunks, split, split, ax.group_name))
        return torch.cat(list(out.unbind(0)), dim=dim)
    return _blocked_all_to_all(x, ax, dim, dim2, blocks, blocks2)


def _held(length: int, blocks: int, n: int, c: int) -> list[int]:
    """Global positions device ``c`` of ``n`` holds along a dimension of ``length`` split in
    ``blocks`` blocks (``Shard(d, blocks)``: one piece of each block), in local order."""
    per_block = length // blocks
    piece = per_block // n
    return [b * per_block + c * piece + i for b in range(blocks) for i in range(piece)]


def _take(x: torch.Tensor, dim: int, index: Sequence[int]) -> torch.Tensor:
    """``x`` at ``index`` along ``dim``, as slices of its consecutive runs (no index tensor)."""
    runs: list[list[int]] = []
    for i in index:
        if runs and runs[-1][1] == i:
            runs[-1][1] = i + 1
        else:
            runs.append([i, i + 1])
    parts = [x.narrow(dim, lo, hi - lo) for lo, hi in runs]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def _regular_all_to_all(
    x: torch.Tensor, ax: AxisGroup, dim: int, dim2: int, blocks: int, blocks2: int
) -> torch.Tensor:
    """``_blocked_all_to_all`` where the pieces fall in a grid (the cases a reshape reaches, any
    number of blocks at one kernel's cost): to another dimension; from contiguous to ``blocks2``
    stripes with ``n | blocks2``; from ``blocks`` stripes with ``n | blocks`` to contiguous."""
    n = ax.size
    shape = list(x.shape)
    if dim != dim2:
        # what device j will hold along dim2 (piece j of each of blocks2 blocks), stacked by j
        m2 = shape[dim2] // (blocks2 * n)
        send = x.unflatten(dim2, (blocks2, n, m2)).movedim(dim2 + 1, 0)
        send = send.flatten(dim2 + 1, dim2 + 2)
    elif blocks == 1:  # contiguous: this device's chunk holds whole blocks, piece j of each for j
        send = x.unflatten(dim, (blocks2 // n, n, shape[dim] * n // blocks2 // n)).movedim(dim + 1, 0)
        send = send.flatten(dim + 1, dim + 2)
    else:  # stripes: block b belongs to chunk b // (blocks / n)
        send = x.unflatten(dim, (n, blocks // n * (shape[dim] // blocks))).movedim(dim, 0)
    send = send.contiguous()
    rows = [send.shape[0] // n] * n
    got = _wait(_fc.all_to_all_single(send, rows, rows, ax.group_name))  # [source, ...]
    if dim != dim2 or (blocks > 1 and blocks2 == 1):
        # interleave: each source's piece of every block of dim (``blocks``), sources in order
        k = blocks if dim != dim2 else blocks // n  # blocks in each source's piece
        piece = got.shape[dim + 1] // k
        out = got.unflatten(dim + 1, (k, piece)).movedim(0, dim + 1)
        return out.flatten(dim, dim + 2).contiguous()
    # contiguous to stripes: source i sent its piece of blocks i·blocks2/n …, in order
    return got.movedim(0, dim).flatten(dim, dim + 1).contiguous()


def _blocked_all_to_all(
    x: torch.Tensor, ax: AxisGroup, dim: int, dim2: int, blocks: int, blocks2: int
) -> torch.Tensor:
    """The all-to-all of ``_all_to_all`` where a split is in blocks: by reshapes where the pieces
    fall in a grid (``_regular_all_to_all``); else, from one split of ``dim`` to another, device
    ``j`` is sent the positions of this device's piece it will hold, and the pieces received are
    put in the order of their global positions."""
    n, c = ax.size, ax.coord
    if dim != dim2 or (blocks == 1 and blocks2 % n == 0) or (blocks2 == 1 and blocks % n == 0):
        return _regular_all_to_all(x, ax, dim, dim2, blocks, blocks2)
    length = x.shape[dim] * n  # along dim, whole
    mine = _held(length, blocks, n, c)
    where = {p: i for i, p in enumerate(mine)}
    wanted = [set(_held(length, blocks2, n, j)) for j in range(n)]
    send_pos = [[p for p in mine if p in wanted[j]] for j in range(n)]
    recv_pos = [[p for p in _held(length, blocks, n, i) if p in wanted[c]] for i in range(n)]
    sends = [_take(x, dim, [where[p] for p in pos]) for pos in send_pos if pos]
    moved = torch.cat([t.movedim(dim, 0) for t in sends], 0).contiguous()
    inner = moved.shape[1:].numel()
    out = _wait(
        _fc.all_to_all_single(
            moved.reshape(-1),
            [len(p) * inner for p in recv_pos],
            [len(p) * inner for p in send_pos],
            ax.group_name,
        )
    )
    got = out.view(-1, *moved.shape[1:])
    arrived = [p for pos in recv_pos for p in pos]
    order = sorted(range(len(arrived)), key=arrived.__getitem__)
    return _take(got, 0, order).movedim(0, dim).contiguous()


# ------------------------------------------------------------------------ autograd Functions


class _Conjugate(torch.autograd.Function):
    """One op of the module docstring's table: ``forward(x)`` runs it, ``conjugate(g)`` the
    collective its backward is (each a plain op above, its axis and dimensions bound)."""

    @staticmethod
    def forward(ctx, x, forward, conjugate):  # type: ignore[override]
        ctx.conjugate = conjugate
        return forward(x)

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        return ctx.conjugate(g), None, None


def _conjugate(
    x: torch.Tensor,
    forward: Callable[[torch.Tensor], torch.Tensor],
    conjugate: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """``forward(x)``, differentiable with ``conjugate`` as its backward where autograd records ``x``."""
    if not _differentiable(x):
        return forward(x)
    return _Conjugate.apply(x, forward, conjugate)


def _identity(g: torch.Tensor) -> torch.Tensor:
    return g


class GatheredParams:
    """ZeRO-3's "free after use": parameters gathered in forward are not kept for backward.

    ``all_gather_param`` registers each gathered parameter here (a weak reference to the full
    tensor, and the local shard it came from). While the program runs under
    ``saved_tensors_hooks(self.pack, self.unpack)``, a tensor autograd wants to save that lives in
    a gathered parameter's storage (the parameter or a view of it, e.g. its transpose) is saved as
    a token holding only the shard; backward gathers it again (``unpack``). Everything else is
    saved as usual. Registrations are cleared after each forward.
    """

    def __init__(self) -> None:
        self.live: list[tuple[weakref.ref, torch.Tensor, AxisGroup, int, int]] = []
        self.used = False

    def register(self, full: torch.Tensor, shard: torch.Tensor, ax: AxisGroup, dim: int, blocks: int) -> None:
        self.live.append((weakref.ref(full), shard, ax, dim, blocks))

    def clear(self) -> None:
        self.live.clear()

    def pack(self, t: torch.Tensor) -> object:
        if not self.live or t.layout != torch.strided:
            return t
        ptr = t.untyped_storage().data_ptr()
        for ref, shard, ax, dim, blocks in self.live:
            full = ref()
            if full is not None and full.untyped_storage().data_ptr() == ptr:
                return _GatheredToken(shard, ax, dim, blocks, t.size(), t.stride(), t.storage_offset())
        return t

    @staticmethod
    def unpack(obj: object) -> torch.Tensor:
        if isinstance(obj, _GatheredToken):
            full = _gather(obj.shard.detach(), obj.ax, obj.dim, obj.blocks, "bwd")
            return full.as_strided(obj.size, obj.stride, obj.offset)
        return obj  # type: ignore[return-value]


@dataclass(frozen=True)
class _GatheredToken:
    shard: torch.Tensor
    ax: AxisGroup
    dim: int
    blocks: int
    size: torch.Size
    stride: tuple[int, ...]
    offset: int


def all_gather_param(
    x: torch.Tensor,
    ax: AxisGroup,
    store: GatheredParams,
    dim: int,
    blocks: int = 1,
    grad_partial: bool = False,
) -> torch.Tensor:
    """``all_gather`` of a parameter shard whose full copy backward re-gathers (ZeRO-3)."""
    full = all_gather(x, ax, dim, blocks, grad_partial)
    if _differentiable(x):
        store.register(full, x, ax, dim, blocks)
    return full


def _differentiable(x: torch.Tensor) -> bool:
    return x.requires_grad and torch.is_grad_enabled()


def all_gather(
    x: torch.Tensor, ax: AxisGroup, dim: int, blocks: int = 1, grad_partial: bool = False
) -> torch.Tensor:
    """Shard(dim) → Replicate along ``ax``."""

    def conjugate(g: torch.Tensor) -> torch.Tensor:
        if grad_partial:  # the consumer splits work: its gradient is partial (module docstring)
            return _reduce_scatter(g, ax, dim, blocks, "bwd")
        return _slice(g, ax, dim, blocks)

    return _conjugate(x, lambda t: _gather(t, ax, dim, blocks, "fwd"), conjugate)


def shard_slice(x: torch.Tensor, ax: AxisGroup, dim: int, blocks: int = 1) -> torch.Tensor:
    """Replicate → Shard(dim) along ``ax`` (no communication forward)."""
    return _conjugate(x, lambda t: _slice(t, ax, dim, blocks), lambda g: _gather(g, ax, dim, blocks, "bwd"))


def all_reduce(x: torch.Tensor, ax: AxisGroup) -> torch.Tensor:
    """Partial → Replicate along ``ax`` (Megatron-LM's ``g``)."""
    return _conjugate(x, lambda t: reduce_values(t, ax, "fwd"), _identity)


def reduce_scatter(x: torch.Tensor, ax: AxisGroup, dim: int, blocks: int = 1) -> torch.Tensor:
    """Partial → Shard(dim) along ``ax``."""
    return _conjugate(
        x, lambda t: _reduce_scatter(t, ax, dim, blocks, "fwd"), lambda g: _gather(g, ax, dim, blocks, "bwd")
    )


def all_to_all(
    x: torch.Tensor, ax: AxisGroup, dim: int, dim2: int, blocks: int = 1, blocks2: int = 1
) -> torch.Tensor:
    """Shard(dim, blocks) → Shard(dim2, blocks2) along ``ax``."""
    return _conjugate(
        x,
        lambda t: _all_to_all(t, ax, dim, dim2, "fwd", blocks, blocks2),
        lambda g: _all_to_all(g, ax, dim2, dim, "bwd", blocks2, blocks),
    )


def to_partial(x: torch.Tensor, ax: AxisGroup) -> torch.Tensor:
    """Replicate → Partial along ``ax``: the value stays on coordinate 0."""
    return _conjugate(x, lambda t: t.clone() if ax.coord == 0 else torch.zeros_like(t), _identity)


def grad_sync(x: torch.Tensor, *axes: AxisGroup) -> torch.Tensor:
    """Identity forward; all-reduce of the gradient over ``axes`` backward (Megatron-LM's ``f``)."""
    if not _differentiable(x):
        return x

    def sync(g: torch.Tensor) -> torch.Tensor:
        for ax in axes:
            g = reduce_values(g, ax, "bwd")
        return g

    return _conjugate(x, lambda t: t.view_as(t), sync)


STEP_OPS: dict[StepKind, tuple[Callable[..., torch.Tensor], tuple[str, ...]]] = {
    StepKind.ALL_GATHER: (all_gather, ("dim", "blocks")),
    StepKind.SLICE: (shard_slice, ("dim", "blocks")),
    StepKind.ALL_REDUCE: (all_reduce, ()),
    StepKind.REDUCE_SCATTER: (reduce_scatter, ("dim", "blocks")),
    StepKind.ALL_TO_ALL: (all_to_all, ("dim", "dim2", "blocks", "blocks2")),
    StepKind.TO_PARTIAL: (to_partial, ()),
}
"""The differentiable op of each reshard step kind (``autopar.reshard.StepKind``) and the step
fields it takes as keyword arguments."""


def step_call(step: ReshardStep, grad_partial: bool = False) -> tuple[Callable[..., torch.Tensor], dict]:
    """The op and keyword arguments that run ``step`` (called as ``fn(x, axis_group, **kwargs)``);
    ``grad_partial`` applies to an all-gather (see ``all_gather``)."""
    fn, fields = STEP_OPS[step.kind]
    kwargs = {f: getattr(step, f) for f in fields}
    if step.kind == StepKind.ALL_GATHER:
        kwargs["grad_partial"] = grad_partial
    return fn, kwargs


def apply_step(x: torch.Tensor, ax: AxisGroup, step: ReshardStep, grad_partial: bool = False) -> torch.Tensor:
    """Run one reshard step on ``x`` along ``ax``."""
    fn, kwargs = step_call(step, grad_partial)
    return fn(x, ax, **kwargs)


def run_reshard(
    x: torch.Tensor, shape: Sequence[int], src: Spec, dst: Spec, axes: Sequence[AxisGroup]
) -> torch.Tensor:
    """Apply ``reshard_steps`` directly (not in a graph), e.g. to gather a full state dict."""
    mesh = tuple(ax.size for ax in axes)
    for st in reshard_steps(tuple(shape), src, dst, mesh):
        x = apply_step(x, axes[st.axis], st)
    return x

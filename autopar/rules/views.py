"""Views and shape ops follow the dimension mapping: ``view``/``reshape``/``expand``/``transpose``/
``permute``/``unsqueeze``/``split``/``cat``/``slice``/``pad``/``roll``/``flip``. A reshape moves a shard only where the
sharded dimension leads its group of merged or split dimensions, so every local piece stays
contiguous."""

from __future__ import annotations

import operator
from collections.abc import Sequence

from torch.fx import Node

from autopar.graph import tensor_outputs
from autopar.ir import Rewrite
from autopar.placement import Shard
from autopar.rules.base import AxisStrategy, P, R, aten, norm_dim, op_key, register, shape_of, with_hints


def _view_groups(
    in_shape: Sequence[int], out_shape: Sequence[int]
) -> list[tuple[list[int], list[int]]] | None:
    """Pair up runs of input and output dims with equal products (the reshape's dim mapping)."""
    groups = []
    i = j = 0
    ni, no = len(in_shape), len(out_shape)
    while i < ni or j < no:
        gi, gj = [], []
        pi = pj = 1
        if i < ni:
            gi.append(i)
            pi *= in_shape[i]
            i += 1
        if j < no:
            gj.append(j)
            pj *= out_shape[j]
            j += 1
        while pi != pj:
            if pi < pj and i < ni:
                gi.append(i)
                pi *= in_shape[i]
                i += 1
            elif pj < pi and j < no:
                gj.append(j)
                pj *= out_shape[j]
                j += 1
            else:
                return None
        groups.append((gi, gj))
    return groups


def view_map(in_shape: Sequence[int], out_shape: Sequence[int]) -> dict[tuple[int, int], int]:
    """``(in_dim, blocks) -> out_dim`` for shards that survive the reshape as contiguous pieces."""
    groups = _view_groups(in_shape, out_shape)
    if groups is None:
        return {}
    mapping = {}
    for gi, gj in groups:
        lead_i = [d for d in gi if in_shape[d] != 1]
        lead_j = [d for d in gj if out_shape[d] != 1]
        if not lead_i or not lead_j:
            continue
        mapping[(lead_i[0], 1)] = lead_j[0]
        if len(lead_i) == 1 and len(lead_j) == 1:
            mapping[(lead_i[0], 0)] = lead_j[0]  # blocks of any count survive a 1:1 dim
    return mapping


def _view_like(node: Node, ins: list[Node], hints: dict) -> list[AxisStrategy]:
    src = node.args[0]
    if not isinstance(src, Node) or not ins:
        return []
    in_shape, out_shape = shape_of(src), shape_of(node)
    mapping = view_map(in_shape, out_shape)
    out = []
    for d in range(len(in_shape)):
        od = mapping.get((d, 1))
        if od is not None:
            out.append(AxisStrategy(tuple(Shard(d) if i is src else R for i in ins), (Shard(od),)))
    for d, k in hints.get(src, ()):
        od = mapping.get((d, 0))
        if od is not None:
            out.append(AxisStrategy(tuple(Shard(d, k) if i is src else R for i in ins), (Shard(od, k),)))
    if len(ins) == 1:
        out.append(AxisStrategy((P,), (P,)))
    return out


register(
    aten.view, aten.reshape, aten._unsafe_view, aten.squeeze, aten.unsqueeze, aten.flatten, aten.unflatten
)(with_hints(_view_like))


@register(aten.expand, aten.broadcast_to)
def _expand(node: Node, ins: list[Node]) -> list[AxisStrategy]:
    src = node.args[0]
    in_shape, out_shape = shape_of(src), shape_of(node)
    off = len(out_shape) - len(in_shape)
    out = []
    for d in range(len(in_shape)):
        if in_shape[d] == out_shape[d + off] and in_shape[d] > 1:
            out.append(AxisStrategy((Shard(d),), (Shard(d + off),)))
    out.append(AxisStrategy((P,), (P,)))
    return out


@with_hints
def _permute_like(node: Node, ins: list[Node], hints: dict) -> list[AxisStrategy]:
    src = node.args[0]
    rank = len(shape_of(src))
    key = op_key(node)
    if key is aten.permute:
        perm = [norm_dim(d, rank) for d in node.args[1]]
    elif key is aten.t:
        perm = [1, 0] if rank == 2 else [0]
    elif key is aten.numpy_T:  # ``x.T``: every dimension reversed
        perm = list(range(rank))[::-1]
    elif key is aten.mT:  # ``x.mT``: the last two swapped
        perm = [*range(rank - 2), rank - 1, rank - 2]
    else:  # transpose, swapaxes, swapdims
        a, b = norm_dim(node.args[1], rank), norm_dim(node.args[2], rank)
        perm = list(range(rank))
        perm[a], perm[b] = perm[b], perm[a]
    inv = {p: i for i, p in enumerate(perm)}
    out = [AxisStrategy((Shard(d),), (Shard(inv[d]),)) for d in range(rank) if shape_of(src)[d] > 1]
    out += [AxisStrategy((Shard(d, k),), (Shard(inv[d], k),)) for d, k in hints.get(src, ())]
    out.append(AxisStrategy((P,), (P,)))
    return out


register(aten.transpose, aten.swapaxes, aten.swapdims, aten.permute, aten.t, aten.numpy_T, aten.mT)(
    _permute_like
)


@register(aten.slice, aten.narrow, aten.select)
def _slice(node: Node, ins: list[Node]) -> list[AxisStrategy]:
    src = node.args[0]
    in_shape = shape_of(src)
    dim = norm_dim(node.args[1] if len(node.args) > 1 else 0, len(in_shape))
    removed = op_key(node) is aten.select
    out = []
    for d in range(len(in_shape)):
        if d == dim or in_shape[d] == 1:
            continue
        od = d - 1 if removed and d > dim else d
        out.append(AxisStrategy(tuple(Shard(d) if i is src else R for i in ins), (Shard(od),)))
    if len(ins) == 1:
        out.append(AxisStrategy((P,), (P,)))
    return out


@with_hints
def _split(node: Node, ins: list[Node], hints: dict) -> list[AxisStrategy]:
    src = node.args[0]
    in_shape = shape_of(src)
    outs = tensor_outputs(node)
    key = op_key(node)
    if key is aten.unbind:
        dim = norm_dim(node.args[1] if len(node.args) > 1 else 0, len(in_shape))
    else:
        dim = norm_dim(node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0), len(in_shape))
    out = []
    for d in range(len(in_shape)):
        if d == dim or in_shape[d] == 1:
            continue
        od = d - 1 if key is aten.unbind and d > dim else d
        out.append(AxisStrategy((Shard(d),), tuple(Shard(od) for _ in outs)))
    sizes = {int(o.shape[dim]) for o in outs} if key is not aten.unbind else set()
    if len(sizes) == 1 and len(outs) > 1:
        # Equal parts along a block-sharded dim: each part comes out plainly sharded.
        out.append(
            AxisStrategy(
                (Shard(dim, len(outs)),), tuple(Shard(dim) for _ in outs), rewrite=Rewrite.SPLIT_LOCAL
            )
        )
    out.append(AxisStrategy((P,), tuple(P for _ in outs)))
    return out


register(aten.split, aten.split_with_sizes, aten.chunk, aten.unbind)(_split)


@register(aten.pad, aten.constant_pad_nd)
def _pad(node: Node, ins: list[Node]) -> list[AxisStrategy]:
    """Padding changes only the padded dimensions: any other one can stay sharded."""
    src = node.args[0]
    rank = len(shape_of(src))
    pads = list(node.args[1]) if len(node.args) > 1 else []
    padded = {rank - 1 - i // 2 for i, p in enumerate(pads) if p}
    return [
        AxisStrategy((Shard(d),), (Shard(d),))
        for d in range(rank)
        if d not in padded and shape_of(src)[d] > 1
    ]


@register(aten.roll, aten.flip)
def _roll(node: Node, ins: list[Node]) -> list[AxisStrategy]:
    """Rolling or flipping moves elements only along its own dimensions: any other one can stay
    split, and a partial sum stays partial (each is a permutation). ``roll`` without dimensions
    rolls the flattened tensor: nothing stays split."""
    src = node.args[0]
    rank = len(shape_of(src))
    if op_key(node) is aten.roll:
        dims = node.args[2] if len(node.args) > 2 else node.kwargs.get("dims", [])
    else:
        dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dims", [])
    dims = [dims] if isinstance(dims, int) else list(dims)
    moved = {norm_dim(d, rank) for d in dims} if dims else set(range(rank))
    out = [
        AxisStrategy((Shard(d),), (Shard(d),)) for d in range(rank) if d not in moved and shape_of(src)[d] > 1
    ]
    out.append(AxisStrategy((P,), (P,)))
    return out


@register(aten.cat, aten.concat, aten.stack)
def _cat(node: Node, ins: list[Node]) -> list[AxisStrategy]:
    out_shape = shape_of(node)
    stack = op_key(node) is aten.stack
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    dim = norm_dim(dim, len(out_shape))
    out = []
    for d in range(len(out_shape)):
        if d == dim or out_shape[d] == 1:
            continue
        ind = d - 1 if stack and d > dim else d
        out.append(AxisStrategy(tuple(Shard(ind) for _ in ins), (Shard(d),)))
    out.append(AxisStrategy(tuple(P for _ in ins), (P,)))
    return out


@register(operator.getitem)
def _getitem(node: Node, ins: list[Node]) -> list[AxisStrategy]:
    # getitem of a multi-output op: placement follows the producer (see passes.strategies).
    return []

"""Routing ops, one at a time.

**Routing ops, one at a time** (``topk``, ``sort``/``argsort``, ``histc``/``bincount``, ``gather``,
``index``, ``index_add``/``scatter_add``/``index_put``, ``repeat``, pooling, grouped matmuls): each
runs split wherever its inputs are split along a dimension it does not route along. Counting over
split rows (``histc``, ``bincount``) gives per-device counts whose sum is the count: ``Partial``;
so does scattering split rows into a tensor with ``accumulate`` (``index_add``).

Mixture-of-experts regions, which these ops build, are found and placed as wholes by
``autopar.rules.moe_regions``.
"""

from __future__ import annotations

import re

import torch
from torch.fx import Node

from autopar.graph import op_name, tensor_outputs
from autopar.placement import Shard
from autopar.rules.base import AxisStrategy, P, R, arg, aten, norm_dim, op_key, register, shape_of

__all__ = ["grouped_mm_operands"]


# ------------------------------------------------------------------------------ routing ops


def _dim_arg(node: Node, name: str, pos: int, default: int, rank: int) -> int:
    d = node.args[pos] if len(node.args) > pos else node.kwargs.get(name, default)
    return norm_dim(d, rank)


@register(aten.topk, aten.sort, aten.argsort)
def _along_routed_dim(node: Node, ins: list[Node]) -> list[AxisStrategy]:
    """Top-k / sort along one dimension: any other dimension stays split."""
    src = node.args[0]
    rank = len(shape_of(src))
    dim = _dim_arg(node, "dim", 2 if op_key(node) is aten.topk else 1, -1, rank)
    n_out = len(tensor_outputs(node))
    return [
        AxisStrategy((Shard(d),), tuple(Shard(d) for _ in range(n_out)))
        for d in range(rank)
        if d != dim and shape_of(src)[d] > 1
    ]


@register(aten.histc, aten.bincount)
def _counts(node: Node, ins: list[Node]) -> list[AxisStrategy]:
    """Counts over split values are per-device counts that sum to the count (``Partial``)."""
    src = node.args[0]
    if len(ins) != 1:  # bincount with weights
        return []
    return [AxisStrategy((Shard(d),), (P,)) for d in range(len(shape_of(src))) if shape_of(src)[d] > 1]


@register(aten.gather)
def _gather(node: Node, ins: list[Node]) -> list[AxisStrategy]:
    x, idx = node.args[0], node.args[2]
    rank = len(shape_of(x))
    dim = norm_dim(node.args[1], rank)
    out = []
    for d in range(rank):
        if d != dim and shape_of(node)[d] > 1 and shape_of(x)[d] == shape_of(idx)[d]:
            out.append(AxisStrategy(tuple(Shard(d) for _ in ins), (Shard(d),)))
    return out


@register(aten.index)
def _index(node: Node, ins: list[Node]) -> list[AxisStrategy]:
    """``x[..., idx, ...]``: advanced indexing by integer index tensors on some dimensions of
    ``x`` (``None`` on the others: ``x[:, :, idx]``). PyTorch's result holds the index tensors'
    broadcast dimensions where the indexed ones were when those are adjacent, first otherwise,
    and ``x``'s other dimensions in order. Split a dimension of ``x`` that is not indexed (its
    place in the result), or the one index tensor's (each device gathers what its indices name,
    from the whole ``x``); ``x`` Partial gives a Partial result."""
    x, indices = node.args[0], node.args[1]
    where = [k for k, i in enumerate(indices) if i is not None]
    idxs = [indices[k] for k in where]
    if not idxs or not all(isinstance(i, Node) for i in idxs) or x in idxs:
        return []
    if any(i.meta["val"].dtype == torch.bool for i in idxs):
        return []
    xr = len(shape_of(x))
    ir = max(len(shape_of(i)) for i in idxs)
    adjacent = where == list(range(where[0], where[-1] + 1))
    first = where[0] if adjacent else 0
    out: list[AxisStrategy] = []
    if len(idxs) == 1:
        idx = idxs[0]
        for d in range(ir):
            if shape_of(idx)[d] > 1:
                out.append(AxisStrategy(tuple(Shard(d) if i is idx else R for i in ins), (Shard(first + d),)))
    kept = [d for d in range(xr) if d not in where]
    for d in kept:
        if shape_of(x)[d] <= 1:
            continue
        if adjacent:
            o = d if d < where[0] else d - len(where) + ir
        else:
            o = ir + kept.index(d)
        out.append(AxisStrategy(tuple(Shard(d) if i is x else R for i in ins), (Shard(o),)))
    out.append(AxisStrategy(tuple(P if i is x else R for i in ins), (P,)))
    return out


@register(
    aten.index_add, aten.index_add_, aten.scatter_add, aten.scatter_add_, aten.index_put, aten.index_put_,
    aten.scatter, aten.scatter_,
)  # fmt: skip
def _scatter(node: Node, ins: list[Node]) -> list[AxisStrategy]:
    """Scatter ``src`` (or one value: ``scatter(self, dim, index, value)``) into ``self`` along a
    dimension: other dimensions split alike; split rows of ``src`` accumulated into a Partial
    ``self`` give a Partial result (each device adds its rows)."""
    key = op_key(node)
    target = node.args[0]
    rank = len(shape_of(target))
    if key in (aten.index_put, aten.index_put_):
        indices = node.args[1]
        if len(indices) != 1 or not isinstance(indices[0], Node):
            return []
        idx, src, dim = indices[0], node.args[2], 0
        accumulate = bool(arg(node, "accumulate", False))
        if not isinstance(src, Node) or len(shape_of(idx)) != 1:
            return []
    else:
        dim = norm_dim(node.args[1], rank)
        idx, src = node.args[2], node.args[3]
        accumulate = key not in (aten.scatter, aten.scatter_)  # scatter writes; it does not add
    value = not isinstance(src, Node)  # scatter(self, dim, index, value): one value written
    if (value and accumulate) or not isinstance(idx, Node) or target is idx or target is src or idx is src:
        return []
    ishape = shape_of(idx)
    sshape = ishape if value else shape_of(src)
    out = []
    for d in range(rank):
        if d == dim or shape_of(target)[d] <= 1 or len(sshape) != rank or sshape[d] != shape_of(target)[d]:
            continue
        if len(ishape) == rank and ishape[d] != shape_of(target)[d]:
            continue
        ip = Shard(d) if len(ishape) == rank else R
        out.append(
            AxisStrategy(
                tuple(Shard(d) if i is target or (i is src and not value) else ip for i in ins), (Shard(d),)
            )
        )
    if accumulate and sshape and sshape[0 if len(ishape) == 1 else dim] > 1:
        sd = dim if len(ishape) == rank else 0
        out.append(
            AxisStrategy(
                tuple(P if i is target else (Shard(sd) if i in (src, idx) else R) for i in ins), (P,)
            )
        )
    return out


@register(aten.repeat_interleave)
def _repeat_interleave(node: Node, ins: list[Node]) -> list[AxisStrategy]:
    """Each row repeated ``r`` times in place: split rows stay contiguous pieces, as do other dims."""
    x = node.args[0]
    if len(ins) != 1 or not isinstance(x, Node):
        return []
    rank = len(shape_of(x))
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")
    if dim is None:
        return []
    return [AxisStrategy((Shard(d),), (Shard(d),)) for d in range(rank) if shape_of(x)[d] > 1]


@register(aten.repeat)
def _repeat(node: Node, ins: list[Node]) -> list[AxisStrategy]:
    x, reps = node.args[0], list(node.args[1])
    rank, off = len(shape_of(x)), len(reps) - len(shape_of(x))
    return [
        AxisStrategy((Shard(d),), (Shard(d + off),))
        for d in range(rank)
        if reps[d + off] == 1 and shape_of(x)[d] > 1
    ]


@register(aten.one_hot)
def _one_hot(node: Node, ins: list[Node]) -> list[AxisStrategy]:
    x = node.args[0]
    return [AxisStrategy((Shard(d),), (Shard(d),)) for d in range(len(shape_of(x))) if shape_of(x)[d] > 1]


@register(
    aten.avg_pool1d, aten.avg_pool2d, aten.avg_pool3d, aten.max_pool1d, aten.max_pool2d, aten.max_pool3d,
    aten.adaptive_avg_pool1d, aten.adaptive_avg_pool2d, aten.adaptive_avg_pool3d,
    aten.adaptive_max_pool1d, aten.adaptive_max_pool2d, aten.max_pool2d_with_indices,
)  # fmt: skip
def _pool(node: Node, ins: list[Node]) -> list[AxisStrategy]:
    """Pooling windows span the spatial dimensions: batch and channels split."""
    x = node.args[0]
    n_out = len(tensor_outputs(node))
    lead = len(shape_of(x)) - (int(op_name(node)[-2]) if op_name(node)[-2].isdigit() else 2)
    return [
        AxisStrategy((Shard(d),), tuple(Shard(d) for _ in range(n_out)))
        for d in range(max(lead, 0))
        if shape_of(x)[d] > 1
    ]


_UPSAMPLE_NAMES = (
    "upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d", "_upsample_nearest_exact1d",
    "_upsample_nearest_exact2d", "_upsample_nearest_exact3d", "upsample_linear1d", "upsample_bilinear2d",
    "_upsample_bilinear2d_aa", "upsample_bicubic2d", "_upsample_bicubic2d_aa", "upsample_trilinear3d",
)  # fmt: skip


@register(*(getattr(aten, n) for n in _UPSAMPLE_NAMES if hasattr(aten, n)))
def _upsample(node: Node, ins: list[Node]) -> list[AxisStrategy]:
    """Interpolation (``F.interpolate``, ``nn.Upsample``) reads neighbours along the trailing
    ``k`` spatial dimensions of its ``k``-d name: the batch and channels before them split, and a
    partial sum stays partial (each output is a fixed weighted sum of inputs)."""
    x = node.args[0]
    spatial = re.search(r"(\d)d", op_name(node))
    lead = len(shape_of(x)) - (int(spatial.group(1)) if spatial else 2)
    out = [AxisStrategy((Shard(d),), (Shard(d),)) for d in range(max(lead, 0)) if shape_of(x)[d] > 1]
    out.append(AxisStrategy((P,), (P,)))
    return out


def grouped_mm_operands(node: Node) -> tuple[Node, Node, Node] | None:
    """``(x [S, K], w [G, K, N], offs [G])`` of a grouped matmul, or None."""
    if op_name(node) not in ("_grouped_mm", "grouped_mm", "grouped_mm_fallback"):
        return None
    x, w = node.args[0], node.args[1]
    offs = node.args[2] if len(node.args) > 2 else node.kwargs.get("offs")
    if not all(isinstance(v, Node) for v in (x, w, offs)):
        return None
    if len(shape_of(x)) != 2 or len(shape_of(w)) != 3:
        return None
    return x, w, offs


def _grouped_mm(node: Node, ins: list[Node]) -> list[AxisStrategy]:
    """Outside a token/expert mode the rows cannot split (their groups are in ``offs``), but the
    output columns (``w`` split on ``N``) or the contracted ``K`` (Partial) can: expert tensor
    parallelism."""
    ops = grouped_mm_operands(node)
    if ops is None:
        return []
    x, w, _ = ops
    _, k = shape_of(x)
    n = shape_of(w)[2]
    out = []
    if n > 1:
        out.append(AxisStrategy(tuple(Shard(2) if i is w else R for i in ins), (Shard(1),)))
    if k > 1:
        out.append(
            AxisStrategy(tuple(Shard(1) if i is x else (Shard(1) if i is w else R) for i in ins), (P,))
        )
    return out


# By name too: custom ops (transformers' ``grouped_mm_fallback``, ``autopar::grouped_mm``) exist
# only once their library is imported.
register(aten._grouped_mm, "grouped_mm", "grouped_mm_fallback")(_grouped_mm)

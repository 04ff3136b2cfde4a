"""Reductions, cumulative ops and softmax: shard any dimension not reduced over; ``sum``/``mean``
over a sharded dimension give ``Partial`` (the mean with a local rewrite)."""

from __future__ import annotations

import torch
from torch.fx import Node

from autopar.ir import Rewrite
from autopar.placement import Shard
from autopar.rules.base import AxisStrategy, P, arg, aten, norm_dim, op_key, register, shape_of

REDUCTIONS = (
    aten.sum,
    aten.mean,
    aten.amax,
    aten.amin,
    aten.var,
    aten.std,
    aten.prod,
    aten.argmax,
    aten.argmin,
    aten.any,
    aten.all,
    aten.logsumexp,
    aten.norm,
)


def _reduced_dims(node: Node, rank: int) -> tuple[set[int], bool]:
    key = op_key(node)
    args = node.args
    if key in REDUCTIONS:
        dims = args[1] if len(args) > 1 else node.kwargs.get("dim")
        keep = args[2] if len(args) > 2 else node.kwargs.get("keepdim", False)
        if dims is None or dims == [] or dims == ():
            return set(range(rank)), bool(keep)
        if isinstance(dims, int):
            dims = [dims]
        return {norm_dim(d, rank) for d in dims}, bool(keep)
    return set(), True


@register(*REDUCTIONS)
def _reduction(node: Node, ins: list[Node]) -> list[AxisStrategy]:
    src = node.args[0]
    if not isinstance(node.meta.get("val"), torch.Tensor):
        return []
    rank = len(shape_of(src))
    reduced, keep = _reduced_dims(node, rank)
    key = op_key(node)
    out = []
    for d in range(rank):
        if shape_of(src)[d] == 1:
            continue
        if d in reduced:
            if key is aten.sum:
                out.append(AxisStrategy((Shard(d),), (P,)))
            elif key is aten.mean:
                out.append(AxisStrategy((Shard(d),), (P,), rewrite=Rewrite.MEAN_PARTIAL))
            continue
        od = d if keep else d - sum(1 for r in reduced if r < d)
        out.append(AxisStrategy((Shard(d),), (Shard(od),)))
    if key in (aten.sum, aten.mean):
        out.append(AxisStrategy((P,), (P,)))
    return out


@register(aten.cumsum, aten.cumprod, aten._softmax, aten.softmax, aten._log_softmax, aten.log_softmax)
def _along_dim(node: Node, ins: list[Node]) -> list[AxisStrategy]:
    src = node.args[0]
    rank = len(shape_of(src))
    dim = norm_dim(node.args[1], rank)
    return [AxisStrategy((Shard(d),), (Shard(d),)) for d in range(rank) if d != dim and shape_of(src)[d] > 1]


@register(aten.diff)
def _diff(node: Node, ins: list[Node]) -> list[AxisStrategy]:
    """``diff(x, n, dim, prepend, append)``: differences along ``dim``, so any other dimension
    splits; ``prepend``/``append`` (tensors shaped as ``x`` but along ``dim``) split alike."""
    src = node.args[0]
    shape = shape_of(src)
    dim = norm_dim(arg(node, "dim", -1), len(shape))
    return [
        AxisStrategy(tuple(Shard(d) for _ in ins), (Shard(d),))
        for d in range(len(shape))
        if d != dim and shape[d] > 1
    ]


@register(aten.max, aten.min)
def _max_min(node: Node, ins: list[Node]) -> list[AxisStrategy]:
    """``max(x, dim)`` / ``min(x, dim)``, the values and their indices along one dimension (GPT-OSS's
    attention sinks): any other dimension stays split. The elementwise ``max(x, y)`` and the
    whole-tensor reduction get no strategy here (they run replicated)."""
    src = node.args[0]
    if len(node.args) < 2 or not isinstance(node.args[1], int) or not isinstance(src, Node):
        return []
    rank = len(shape_of(src))
    dim = norm_dim(node.args[1], rank)
    keep = bool(arg(node, "keepdim", False))
    out = []
    for d in range(rank):
        if d == dim or shape_of(src)[d] <= 1:
            continue
        o = d if keep or d < dim else d - 1
        out.append(AxisStrategy((Shard(d),), (Shard(o), Shard(o))))
    return out

"""Pointwise ops: any dimension of the (broadcast) output, mapped back to each input; ``Partial``
flows through ops that are linear in that input (add/sub of two partials, mul/div by a replicated
factor, casts and copies)."""

from __future__ import annotations

import torch
from torch.fx import Node

from autopar.placement import Shard
from autopar.rules.base import AxisStrategy, P, R, align, aten, op_key, register, shape_of

UNARY = [
    aten.neg,
    aten.tanh,
    aten.silu,
    aten.gelu,
    aten.relu,
    aten.sigmoid,
    aten.exp,
    aten.log,
    aten.rsqrt,
    aten.sqrt,
    aten.abs,
    aten.erf,
    aten.sin,
    aten.cos,
    aten.reciprocal,
    aten.square,
    aten.clamp,
    aten.clamp_min,
    aten.clamp_max,
    aten.hardtanh,
    aten.leaky_relu,
    aten.softplus,
    aten.elu,
    aten.mish,
    aten.hardswish,
    aten.hardsigmoid,
    aten.logical_not,
    aten.bitwise_not,
    aten.dropout,
    aten.native_dropout,
    # Random fills of a tensor's elements (Gumbel or exponential noise of a router, jitter): each
    # device draws its piece, as dropout does.
    aten.uniform_,
    aten.exponential_,
    aten.normal_,
    aten.bernoulli_,
    aten.bernoulli,
    aten.clone,
    aten.lift_fresh_copy,
    aten.fill,
    aten.contiguous,
    aten.alias,
    aten.detach,
    aten.to,
    aten._to_copy,
    aten.type_as,
    aten.zeros_like,
    aten.ones_like,
    aten.full_like,
    aten.empty_like,
    aten.rand_like,
    aten.isnan,
    aten.isinf,
    aten.sign,
    aten.floor,
    aten.ceil,
    aten.round,
    aten.log1p,
    aten.expm1,
    aten.gelu_,
    aten.relu_,
    aten.silu_,
    aten.masked_fill,
    aten.where,
    aten.pow,
    aten.add,
    aten.sub,
    aten.mul,
    aten.div,
    aten.rsub,
    aten.eq,
    aten.ne,
    aten.lt,
    aten.le,
    aten.gt,
    aten.ge,
    aten.__and__,
    aten.__or__,
    aten.bitwise_and,
    aten.bitwise_or,
    aten.logical_and,
    aten.logical_or,
    aten.maximum,
    aten.minimum,
    aten.fmod,
    aten.remainder,
    aten.lerp,
    aten.addcmul,
    aten.addcdiv,
    aten.tril,
    aten.triu,
    aten.floor_divide,
    # In place: the written input keeps its layout (``passes.formulate`` puts no reshard before a
    # write), so these run like their out-of-place forms.
    aten.add_,
    aten.sub_,
    aten.mul_,
    aten.div_,
    aten.masked_fill_,
    aten.clamp_,
    aten.copy_,
    aten.fill_,
    aten.detach_,
]
# Ops linear in each tensor input (so Partial passes through when all tensor inputs are Partial).
_LINEAR_ALL = {aten.neg, aten.clone, aten.contiguous, aten.alias, aten.to, aten._to_copy, aten.add, aten.sub}
# Ops linear in one input given the others replicated (mul by a replicated factor, div by one).
_LINEAR_ONE = {aten.mul: (0, 1), aten.div: (0,)}


@register(*UNARY)
def _pointwise(node: Node, ins: list[Node]) -> list[AxisStrategy]:
    out_shape = shape_of(node) if isinstance(node.meta.get("val"), torch.Tensor) else None
    if out_shape is None:
        return []
    # tril/triu act on the last two dimensions as a pair: they must stay unsharded.
    banned = set()
    if op_key(node) in (aten.tril, aten.triu):
        banned = {len(out_shape) - 1, len(out_shape) - 2}
    rank = len(out_shape)
    strategies = []
    for d in range(rank):
        if out_shape[d] == 1 or d in banned:
            continue
        strategies.append(AxisStrategy(tuple(align(rank, shape_of(i), d) for i in ins), (Shard(d),)))
    key = op_key(node)
    tensor_args = [a for a in node.args if isinstance(a, Node)]
    if (
        ins
        and key in _LINEAR_ALL
        and len(tensor_args) == len([a for a in node.args if not isinstance(a, (torch.dtype, bool))])
        and all(shape_of(i) == out_shape for i in ins)
    ):
        strategies.append(AxisStrategy(tuple(P for _ in ins), (P,)))
    if key in _LINEAR_ONE:
        # mul(a, b): Partial in the one input that is full-size, the other replicated.
        args = node.args
        for pos in _LINEAR_ONE[key]:
            if pos < len(args) and isinstance(args[pos], Node) and args[pos] in ins:
                partial_in = args[pos]
                if shape_of(partial_in) != out_shape:
                    continue
                strategies.append(AxisStrategy(tuple(P if i is partial_in else R for i in ins), (P,)))
    return strategies


@register(aten.new_ones, aten.new_zeros, aten.new_full, aten.new_empty)
def _new_tensor(node: Node, ins: list[Node]) -> list[AxisStrategy]:
    """``x.new_ones(size)`` and its kin read only ``x``'s dtype and device, so ``x`` may arrive in
    any placement; the output, a constant of the given size, is whole (the size argument stays
    global) or split along any dimension (the lowering gives each device its local size)."""
    if len(ins) != 1 or not isinstance(node.meta.get("val"), torch.Tensor):
        return []
    src_shape, out_shape = shape_of(ins[0]), shape_of(node)
    src = [Shard(d) for d in range(len(src_shape)) if src_shape[d] > 1] + [P]
    out = [AxisStrategy((s,), (R,)) for s in src]
    out += [AxisStrategy((R,), (Shard(d),)) for d in range(len(out_shape)) if out_shape[d] > 1]
    # A split input beside an output split the same way (x.new_zeros(x.shape)): no gather first.
    if src_shape == out_shape:
        out += [AxisStrategy((Shard(d),), (Shard(d),)) for d in range(len(out_shape)) if out_shape[d] > 1]
    return out

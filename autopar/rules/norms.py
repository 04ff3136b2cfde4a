"""Normalizations: layer/RMS/group norm shard the leading (non-normalized) dimensions; batch norm
shards channels only (its statistics span the batch)."""

from __future__ import annotations

from torch.fx import Node

from autopar.graph import tensor_outputs
from autopar.placement import Shard
from autopar.rules.base import AxisStrategy, R, aten, op_key, register, shape_of


@register(aten.layer_norm, aten.rms_norm, aten.native_layer_norm, aten.group_norm)
def _layer_norm(node: Node, ins: list[Node]) -> list[AxisStrategy]:
    x = node.args[0]
    rank = len(shape_of(x))
    key = op_key(node)
    if key is aten.group_norm:
        lead = 1
    else:
        lead = rank - len(node.args[1])
    n_out = len(tensor_outputs(node))
    out = []
    for d in range(lead):
        if shape_of(x)[d] > 1:
            outs = (Shard(d), *(Shard(d) for _ in range(n_out - 1)))
            out.append(AxisStrategy(tuple(Shard(d) if i is x else R for i in ins), outs))
    return out


@register(
    aten.batch_norm,
    aten.native_batch_norm,
    aten._native_batch_norm_legit_functional,
    aten._native_batch_norm_legit_no_training,
    aten.instance_norm,
)
def _batch_norm(node: Node, ins: list[Node]) -> list[AxisStrategy]:
    # Batch statistics span the batch: only the channel dimension (1) can be sharded, taking
    # weight, bias and running stats along with it.
    x = node.args[0]
    if len(shape_of(x)) < 2 or shape_of(x)[1] == 1:
        return []
    outs = tensor_outputs(node)
    in_p = tuple(Shard(1) if i is x else Shard(0) for i in ins)
    out_p = tuple(Shard(1) if o.dim() == len(shape_of(x)) else Shard(0) for o in outs)
    return [AxisStrategy(in_p, out_p)]

"""Convolution: shard the batch, the output channels (weight rows), or the input channels
(contracted: output ``Partial``)."""

from __future__ import annotations

from torch.fx import Node

from autopar.placement import Shard
from autopar.rules.base import AxisStrategy, P, R, aten, op_key, register, shape_of


@register(aten.convolution, aten.conv1d, aten.conv2d, aten.conv3d)
def _conv(node: Node, ins: list[Node]) -> list[AxisStrategy]:
    x, w = node.args[0], node.args[1]
    bias = node.args[2] if len(node.args) > 2 and isinstance(node.args[2], Node) else None
    groups = (
        node.args[-1] if op_key(node) is aten.convolution else (node.args[6] if len(node.args) > 6 else 1)
    )
    out = []
    if shape_of(x)[0] > 1:
        out.append(AxisStrategy(tuple(Shard(0) if i is x else R for i in ins), (Shard(0),)))
    if groups == 1:
        # Output channels: weight (and bias) sharded on dim 0. Input channels: contracted -> Partial.
        out.append(AxisStrategy(tuple(R if i is x else Shard(0) for i in ins), (Shard(1),)))
        if bias is None:
            out.append(AxisStrategy(tuple(Shard(1) if i in (x, w) else R for i in ins), (P,)))
    return out

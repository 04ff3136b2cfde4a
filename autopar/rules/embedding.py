"""Embedding: shard the batch (indices), the embedding dimension, or the vocabulary (output
``Partial``: Megatron-LM's vocabulary-parallel embedding, arXiv 1909.08053 §3)."""

from __future__ import annotations

from torch.fx import Node

from autopar.ir import Rewrite
from autopar.placement import Placement, Shard
from autopar.rules.base import AxisStrategy, P, R, aten, register, shape_of


@register(aten.embedding)
def _embedding(node: Node, ins: list[Node]) -> list[AxisStrategy]:
    w, idx = node.args[0], node.args[1]
    if w is idx:
        return []
    irank = len(shape_of(idx))

    def mk(wp: Placement, ip: Placement, op: Placement, rewrite: Rewrite = Rewrite.NONE) -> AxisStrategy:
        return AxisStrategy(tuple(wp if i is w else ip for i in ins), (op,), rewrite=rewrite)

    out = [mk(R, Shard(d), Shard(d)) for d in range(irank) if shape_of(idx)[d] > 1]
    out.append(mk(Shard(1), R, Shard(irank)))
    out.append(mk(Shard(0), R, P, rewrite=Rewrite.VOCAB_PARALLEL_EMBEDDING))
    return out

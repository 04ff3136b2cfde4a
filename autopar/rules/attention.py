"""Attention (SDPA): shard batch or heads; or the queries' sequence with keys/values replicated
(without a causal mask only)."""

from __future__ import annotations

from torch.fx import Node

from autopar.graph import tensor_outputs
from autopar.placement import Replicate, Shard
from autopar.rules.base import AxisStrategy, R, arg, aten, register, shape_of


@register(
    aten.scaled_dot_product_attention,
    aten._scaled_dot_product_flash_attention_for_cpu,
    aten._scaled_dot_product_efficient_attention,
    aten._scaled_dot_product_flash_attention,
)
def _sdpa(node: Node, ins: list[Node]) -> list[AxisStrategy]:
    q, k, v = node.args[0], node.args[1], node.args[2]
    rank = len(shape_of(q))
    outs = tensor_outputs(node)

    def for_dim(d: int, seq_q: bool = False) -> AxisStrategy | None:
        ps = []
        for i in ins:
            sh = shape_of(i)
            off = len(sh) - rank
            if seq_q and i in (k, v):
                ps.append(R)
                continue
            dd = d + off
            ps.append(Shard(dd) if 0 <= dd < len(sh) and sh[dd] > 1 else R)
        if any(i in (q, k, v) and isinstance(p, Replicate) and not seq_q for i, p in zip(ins, ps)):
            return None
        o = tuple(Shard(d) if len(x.shape) == rank else (Shard(d) if d < x.dim() else R) for x in outs)
        return AxisStrategy(tuple(ps), o)

    out = []
    for d in range(rank - 2):  # batch and heads
        if shape_of(q)[d] > 1:
            s = for_dim(d)
            if s is not None:
                out.append(s)
    # Queries' sequence split with keys/values whole: only without a causal mask (a causal mask
    # built from local query positions would be misaligned).
    if shape_of(q)[rank - 2] > 1 and len(outs) == 1 and not arg(node, "is_causal", False):
        s = for_dim(rank - 2, seq_q=True)
        if s is not None:
            out.append(s)
    return out

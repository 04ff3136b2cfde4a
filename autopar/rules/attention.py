"""Attention (SDPA) along one mesh axis: shard the batch or the heads (each device attends with
its own sequences or heads: the heads form is context parallelism's all-to-all form, DeepSpeed
Ulysses, Jacobs et al. arXiv 2309.14509, when the sequence arrives split); or shard the queries'
sequence with the keys and values whole (context parallelism's all-gather form, Megatron-Core's
``cp_comm_type="all_gather"``: the keys and values are all-gathered along the axis before it and
their gradients reduce-scattered after). Under ``is_causal`` the local op must align the mask to
the queries' global positions (``Rewrite.CAUSAL_QUERIES``); an explicit mask is split with the
queries.

**Striped queries.** Split in contiguous chunks, causal attention is unbalanced: the device with
the last queries attends to every key, the first to almost none, and the step waits for the
busiest. Under ``is_causal`` the queries may also be split in ``QUERY_BLOCKS`` blocks, each device
holding one piece of each (``Shard(d, blocks=k)``): every device then holds early and late
positions alike, as Megatron-Core's load-balanced chunks (a sequence cut in ``2 · cp`` chunks,
device ``i`` holding chunks ``i`` and ``2 · cp − 1 − i``) and striped attention (Brandon et al.,
arXiv 2311.09431) balance it. The solver weighs the balance against the reshards into and out of
that layout (``autopar.passes.strategies``: the busiest device's causal share).

**Ring.** Shard the queries, keys and values alike along the sequence and pass the keys and
values around the axis while each device attends its queries to them (context parallelism's
point-to-point form, Megatron-Core's default ``cp_comm_type="p2p"``; ``Rewrite.RING_ATTENTION``,
``autopar.program.ring_attention``): no device ever holds the whole keys and values. Offered for
attention without an explicit mask or dropout over keys as long as the queries; under
``is_causal`` in stripes of one position (striped attention, Brandon et al.: device ``c`` of ``n``
holds positions ``c, c + n, c + 2n, …``), so every step of the ring is one causal kernel, as
balanced as it can be, on every device."""

from __future__ import annotations

from torch.fx import Node

from autopar.graph import tensor_outputs
from autopar.ir import Rewrite
from autopar.placement import Replicate, Shard
from autopar.rules.base import AxisStrategy, R, arg, aten, register, shape_of

RING_SIZES = (2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
"""Ring sizes a causal ring is offered striped for: one position a stripe on ``n`` devices is
``Shard(d, blocks=length / n)``, and which of these fits depends on the axis it runs on."""

QUERY_BLOCKS = 8
"""Blocks of the striped query split (module docstring): the busiest device's share of the causal
work is about ``(k + 1) / (2k)`` of its dense pairs against ``(2n − 1) / (2n)`` for the last of ``n``
contiguous chunks; each piece stays long enough for the kernel's tiles to skip the masked ones
(a sequence of 8192 over 8 devices: pieces of 128 tokens)."""


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

    def for_dim(
        d: int, seq_q: bool = False, rewrite: Rewrite = Rewrite.NONE, blocks: int = 1
    ) -> AxisStrategy | None:
        ps = []
        for i in ins:
            sh = shape_of(i)
            off = len(sh) - rank
            if seq_q and i in (k, v):
                ps.append(R)
                continue
            dd = d + off
            ps.append(Shard(dd, blocks) if 0 <= dd < len(sh) and sh[dd] > 1 else R)
        if any(i in (q, k, v) and isinstance(p, Replicate) and not seq_q for i, p in zip(ins, ps)):
            return None
        o = tuple(
            Shard(d, blocks) if len(x.shape) == rank else (Shard(d, blocks) if d < x.dim() else R)
            for x in outs
        )
        return AxisStrategy(tuple(ps), o, rewrite)

    out = []
    for d in range(rank - 2):  # batch and heads
        if shape_of(q)[d] > 1:
            s = for_dim(d)
            if s is not None:
                out.append(s)
    # Queries' sequence split with keys/values whole. A causal mask is the global one, aligned to
    # this device's query positions by the local op; ``is_causal`` with an explicit mask as well
    # is an error in SDPA itself.
    if shape_of(q)[rank - 2] > 1 and node.target is aten.scaled_dot_product_attention.default:
        causal = bool(arg(node, "is_causal", False))
        s = for_dim(rank - 2, seq_q=True, rewrite=Rewrite.CAUSAL_QUERIES if causal else Rewrite.NONE)
        if s is not None:
            out.append(s)
        # The causal work balanced: the queries in QUERY_BLOCKS blocks, each device one piece of
        # each (module docstring: striped queries).
        if causal and shape_of(q)[rank - 2] % QUERY_BLOCKS == 0:
            s = for_dim(rank - 2, seq_q=True, rewrite=Rewrite.CAUSAL_QUERIES, blocks=QUERY_BLOCKS)
            if s is not None:
                out.append(s)
        # The ring (module docstring): queries, keys and values split alike — contiguous, or
        # under a causal mask in stripes of one position for a ring of n devices (the strategy
        # enumeration keeps the one whose n is the axis's: ``passes.strategies``). Not contiguous
        # under a causal mask: the first device would have nothing to do after its first step.
        no_mask = arg(node, "attn_mask", None) is None and not arg(node, "dropout_p", 0.0)
        length = shape_of(q)[rank - 2]
        if no_mask and shape_of(k)[-2] == length:
            stripes = [length // n for n in RING_SIZES if length % n == 0 and length > n]
            for blocks in stripes if causal else (1,):
                s = for_dim(rank - 2, rewrite=Rewrite.RING_ATTENTION, blocks=blocks)
                if s is not None:
                    out.append(AxisStrategy(s.inputs, s.outputs, s.rewrite, comm="ring_attention"))
    return out

"""Ring attention: context parallelism's point-to-point form (Megatron-Core's
``cp_comm_type="p2p"``; Liu et al., "Ring Attention with Blockwise Transformers", arXiv
2310.01889).

Words:

* **ring** — the ``n`` devices of one mesh axis, each holding its own piece of the queries, keys
  and values along the sequence (one spec for all three). At **step** ``s`` (``0 ≤ s < n``) device
  ``c`` holds the keys and values of its **source** ``(c − s) mod n``, attends its queries to them,
  and meanwhile passes them on to ``c + 1`` (a **shift**: one all-to-all over the axis in which a
  device sends only to its successor, so it is a graph node the overlap passes see). Nothing is
  gathered: a device holds two key-value blocks at a time, not ``n``.
* **partial result** — a step's attention output with the log-sum-exp of its scores per query row
  (``lse``); steps **merge** by ``lse' = logaddexp(lse, lse_s)``, ``out' = e^{lse − lse'}·out +
  e^{lse_s − lse'}·out_s`` (the online softmax of flash attention, over blocks of keys).
* **block plan** — which (query piece, key piece) pairs a step computes under a causal mask: the
  pieces are the global position ranges a spec gives each device (``Shard(d, blocks=k)``: one
  piece of each of ``k`` blocks, ``stripes``). Queries and keys share the spec, so each query
  piece sees a prefix of the source's key pieces whole (a kernel without a mask) and, at step 0,
  its own piece under the causal mask; the rest is skipped, as a causal kernel skips its masked
  tiles. In stripes of one position (striped attention, Brandon et al. arXiv 2311.09431: device
  ``c`` of ``n`` holds positions ``c, c + n, …``) the whole step is one causal kernel
  (``step_plan``): the layout the planner gives a causal ring.

Backward walks the ring again: each step's keys and values travel as in forward, and the gradients
of the keys and values (``dk``, ``dv``) travel with them, each device adding its queries'
contribution, until a last shift returns them to their owners. The per-block kernels take the
merged output and log-sum-exp (flash attention's backward recomputes its probabilities from them),
so a step's gradients are exact parts of the whole.

Kernels: on CPU, ATen's flash kernel for CPU; on CUDA in half precision, FlashAttention
(``aten._scaled_dot_product_flash_attention``); elsewhere (CUDA in fp32, head sizes it refuses)
the same arithmetic in plain ops. The costs: ``autopar.cost.ring_attention``, which prices the
op by its FLOPs: in stripes of several positions a step runs a kernel per query piece and their
merges, launches it does not charge (the planner does not choose that layout for a ring);
``examples/gpu_checks.py --ring`` measures a step on a GPU.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from autopar.program.collectives import AxisGroup, _wait

__all__ = [
    "BlockPlan",
    "QueryBlock",
    "block_plan",
    "play_ring",
    "ring_attention",
    "ring_shift",
    "step_plan",
    "stripes",
]

aten = torch.ops.aten
_fc = torch.ops._c10d_functional

Pieces = Sequence[tuple[int, int]]


@dataclass(frozen=True)
class QueryBlock:
    """One query piece's work at one step, in local row offsets of the device's buffers."""

    q: tuple[int, int]
    """Rows of the device's queries."""
    full: int
    """Rows of the source's keys, from 0, seen whole (no mask)."""
    diagonal: tuple[int, int] | None
    """Rows of the source's keys seen under the causal mask (the piece itself, at step 0)."""


BlockPlan = tuple[QueryBlock, ...]
"""A device's work at one step; empty: nothing of the source's keys is visible."""


def _offsets(pieces: Pieces) -> list[tuple[int, int, int]]:
    """``(local start, global start, global stop)`` of each piece."""
    out, at = [], 0
    for lo, hi in pieces:
        out.append((at, lo, hi))
        at += hi - lo
    return out


def block_plan(q_pieces: Pieces, k_pieces: Pieces, causal: bool) -> BlockPlan:
    """The blocks a device with query pieces ``q_pieces`` computes against a source holding key
    pieces ``k_pieces`` (global ranges, both from one spec: equal sizes, the same grid)."""
    rows = sum(hi - lo for lo, hi in q_pieces)
    keys = sum(hi - lo for lo, hi in k_pieces)
    if not causal:
        return (QueryBlock((0, rows), keys, None),) if rows and keys else ()
    ks = _offsets(k_pieces)
    out = []
    for at, lo, hi in _offsets(q_pieces):
        if hi <= lo:
            continue
        full = 0
        diagonal = None
        for k_at, k_lo, k_hi in ks:
            if k_hi <= lo:
                full = k_at + (k_hi - k_lo)
            elif (k_lo, k_hi) == (lo, hi):
                diagonal = (k_at, k_at + k_hi - k_lo)
            elif k_lo < hi:
                raise ValueError(
                    f"ring attention: query piece {lo}:{hi} and key piece {k_lo}:{k_hi} overlap "
                    "without coinciding; queries, keys and values must share one sequence split"
                )
        if full or diagonal:
            out.append(QueryBlock((at, at + hi - lo), full, diagonal))
    return tuple(out)


def stripes(length: int, blocks: int, n: int, c: int) -> list[tuple[int, int]]:
    """The global ranges device ``c`` of ``n`` holds of a sequence of ``length`` split in
    ``blocks`` stripes (``Shard(d, blocks)``: its piece of every block)."""
    per_block = length // blocks
    m = per_block // n
    return [(b * per_block + c * m, b * per_block + (c + 1) * m) for b in range(blocks)]


def step_plan(length: int, blocks: int, n: int, c: int, src: int, causal: bool) -> BlockPlan:
    """``block_plan`` for device ``c`` against source ``src`` of a striped split. In stripes of one
    position (``length = blocks · n``) one kernel covers the step: query ``t`` (position
    ``t·n + c``) sees key ``u`` (position ``u·n + src``) where ``u ≤ t`` if the source is the device
    or precedes it — causal over all rows — and where ``u < t`` if it follows — causal over rows
    ``1…`` against keys ``…R−1``."""
    rows = length // n
    if causal and blocks > 1 and blocks * n == length:
        if src <= c:
            return (QueryBlock((0, rows), 0, (0, rows)),)
        return (QueryBlock((1, rows), 0, (0, rows - 1)),) if rows > 1 else ()
    return block_plan(stripes(length, blocks, n, c), stripes(length, blocks, n, src), causal)


# ------------------------------------------------------------------------------- block kernels


def _kernel(q: torch.Tensor) -> str:
    """Which kernel a block runs on (module docstring): ``"cpu"``, ``"flash"`` or ``"math"``."""
    if q.device.type == "cpu":
        return "cpu"
    d = q.shape[-1]
    flash = q.device.type in ("cuda", "meta") and q.dtype in (torch.float16, torch.bfloat16)
    return "flash" if flash and d <= 256 and d % 8 == 0 else "math"


def _lse_dtype(q: torch.Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _scale(q: torch.Tensor, scale: float | None) -> float:
    return scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])


def _math_scores(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float) -> torch.Tensor:
    s = torch.matmul(q.to(_lse_dtype(q)), k.to(_lse_dtype(q)).transpose(-1, -2)) * scale
    if causal:
        keep = torch.ones(s.shape[-2], s.shape[-1], dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~keep, float("-inf"))
    return s


def block_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q`` to ``k``/``v`` (same heads; ``causal``: aligned top left, equal lengths)
    and the log-sum-exp of its scores per row, shape ``q.shape[:-1]``."""
    kernel = _kernel(q)
    if kernel == "cpu":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out, lse.to(_lse_dtype(q))
    if kernel == "flash":
        got = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
        return got[0], got[1]
    s = _math_scores(q, k, causal, _scale(q, scale))
    lse = torch.logsumexp(s, -1)
    out = torch.matmul(torch.exp(s - lse.unsqueeze(-1)), v.to(s.dtype)).to(q.dtype)
    return out, lse


def block_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    scale: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of ``q``, ``k``, ``v`` through one block, given the merged output and log-sum-exp
    of the rows (the block's share of the whole softmax)."""
    kernel = _kernel(q)
    if kernel == "cpu":
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse.to(q.dtype if q.dtype == torch.float64 else torch.float32), 0.0, causal,
            scale=scale,
        )  # fmt: skip
    if kernel == "flash":
        seed = torch.empty(2, dtype=torch.uint64, device=q.device)
        offset = torch.empty((), dtype=torch.uint64, device=q.device)
        return aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse.float(), None, None, q.shape[-2], k.shape[-2], 0.0, causal, seed, offset,
            scale=scale,
        )  # fmt: skip
    sc = _scale(q, scale)
    s = _math_scores(q, k, causal, sc)
    p = torch.exp(s - lse.unsqueeze(-1))
    do = dout.to(s.dtype)
    dv = torch.matmul(p.transpose(-1, -2), do)
    dp = torch.matmul(do, v.to(s.dtype).transpose(-1, -2))
    delta = (do * out.to(s.dtype)).sum(-1, keepdim=True)
    ds = p * (dp - delta) * sc
    dq = torch.matmul(ds, k.to(s.dtype))
    dk = torch.matmul(ds.transpose(-1, -2), q.to(s.dtype))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def merge(
    out: torch.Tensor | None, lse: torch.Tensor | None, out_s: torch.Tensor, lse_s: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partial results over disjoint keys as one (module docstring); ``out`` in fp32."""
    out_s = out_s.to(lse_s.dtype)
    if out is None or lse is None:
        return out_s, lse_s
    new = torch.logaddexp(lse, lse_s)
    return (
        out * torch.exp(lse - new).unsqueeze(-1) + out_s * torch.exp(lse_s - new).unsqueeze(-1),
        new,
    )


def _rows(t: torch.Tensor, span: tuple[int, int]) -> torch.Tensor:
    return t[..., span[0] : span[1], :]


def attend_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: BlockPlan, scale: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One step: the device's queries against one source's keys and values as ``plan`` says; rows
    that see nothing get output 0 and log-sum-exp −∞ (they merge as nothing). Built without
    writing into a buffer, so recomputation may run it again (``passes.recompute``)."""
    dt = _lse_dtype(q)
    outs, lses, at = [], [], 0
    rows = q.shape[-2]

    def nothing(n: int) -> None:
        outs.append(q.new_zeros((*q.shape[:-2], n, q.shape[-1]), dtype=dt))
        lses.append(torch.full((*q.shape[:-2], n), float("-inf"), dtype=dt, device=q.device))

    for b in sorted(plan, key=lambda b: b.q):
        if b.q[0] > at:
            nothing(b.q[0] - at)
        qb = _rows(q, b.q)
        o = lb = None
        if b.full:
            o, lb = merge(
                o, lb, *block_forward(qb, _rows(k, (0, b.full)), _rows(v, (0, b.full)), False, scale)
            )
        if b.diagonal is not None:
            kd, vd = _rows(k, b.diagonal), _rows(v, b.diagonal)
            o, lb = merge(o, lb, *block_forward(qb, kd, vd, True, scale))
        assert o is not None and lb is not None
        outs.append(o)
        lses.append(lb)
        at = b.q[1]
    if at < rows:
        nothing(rows - at)
    if len(outs) == 1:
        return outs[0], lses[0]
    return torch.cat(outs, -2), torch.cat(lses, -1)


def attend_step_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    plan: BlockPlan,
    scale: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one step (``attend_step``): ``dq`` of the device's queries, ``dk``/``dv`` of
    the source's keys and values, all fp32 (fp64 for fp64 inputs)."""
    dt = _lse_dtype(q)
    dq = q.new_zeros(q.shape, dtype=dt)
    dk = k.new_zeros(k.shape, dtype=dt)
    dv = v.new_zeros(v.shape, dtype=dt)
    for b in plan:
        args = (_rows(dout, b.q), _rows(q, b.q))
        ob, lb = _rows(out, b.q), lse[..., b.q[0] : b.q[1]]
        spans = ([((0, b.full), False)] if b.full else []) + (
            [(b.diagonal, True)] if b.diagonal is not None else []
        )
        for span, causal in spans:
            g = block_backward(*args, _rows(k, span), _rows(v, span), ob, lb, causal, scale)
            dq[..., b.q[0] : b.q[1], :] += g[0].to(dt)
            dk[..., span[0] : span[1], :] += g[1].to(dt)
            dv[..., span[0] : span[1], :] += g[2].to(dt)
    return dq, dk, dv


# ----------------------------------------------------------------------------------------- ring


def ring_shift(x: torch.Tensor, ax: AxisGroup, direction: str) -> torch.Tensor:
    """``x`` sent to the next device of the axis, the previous device's received: one all-to-all
    in which each device sends to its successor only (issued here, waited for by the caller's
    first use: ``wait_tensor``)."""
    ax.note("all_to_all", direction)
    n, c = ax.size, ax.coord
    rows = x.shape[0]
    send = [rows if r == (c + 1) % n else 0 for r in range(n)]
    recv = [rows if r == (c - 1) % n else 0 for r in range(n)]
    return _fc.all_to_all_single(x.contiguous(), recv, send, ax.group_name)


def _expand_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    return t if t.shape[-3] == heads else t.repeat_interleave(heads // t.shape[-3], dim=-3)


def _fold_heads(g: torch.Tensor, heads: int) -> torch.Tensor:
    if g.shape[-3] == heads:
        return g
    return g.unflatten(-3, (heads, g.shape[-3] // heads)).sum(-3)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ax, plans, scale):  # type: ignore[override]
        n = ax.size
        kv = torch.stack([k, v])
        out = lse = None
        for s in range(n):
            nxt = ring_shift(kv, ax, "fwd") if s < n - 1 else None
            heads = q.shape[-3]
            kk, vv = (_expand_heads(t, heads) for t in kv.unbind(0))
            if plans[s]:
                out, lse = merge(out, lse, *attend_step(q, kk, vv, plans[s], scale))
            if nxt is not None:
                kv = _wait(nxt)
        assert out is not None and lse is not None  # step 0 always sees the device's own keys
        result = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, result, lse)
        ctx.ax, ctx.plans, ctx.scale = ax, plans, scale
        return result

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        ax, plans, scale = ctx.ax, ctx.plans, ctx.scale
        n, heads = ax.size, q.shape[-3]
        dout = dout.contiguous()
        kv = torch.stack([k, v])
        dq = None
        pending = None  # the key-value gradients in flight to the next holder
        for s in range(n):
            nxt = ring_shift(kv, ax, "bwd") if s < n - 1 else None
            kk, vv = (_expand_heads(t, heads) for t in kv.unbind(0))
            step_dkv = torch.zeros_like(kv)
            if plans[s]:
                gq, gk, gv = attend_step_backward(dout, q, kk, vv, out, lse, plans[s], scale)
                dq = gq if dq is None else dq + gq
                step_dkv = torch.stack([_fold_heads(gk, kv.shape[-3]), _fold_heads(gv, kv.shape[-3])]).to(
                    kv.dtype
                )
            # the source's gradients so far (they arrived with its keys) plus this device's share,
            # passed on to the next holder; after the last step that is the owner
            dkv = step_dkv if pending is None else _wait(pending) + step_dkv
            pending = ring_shift(dkv, ax, "bwd")
            if nxt is not None:
                kv = _wait(nxt)
        assert dq is not None and pending is not None
        dkv = _wait(pending)
        dk, dv = dkv.unbind(0)
        return dq.to(q.dtype), dk, dv, None, None, None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ax: AxisGroup,
    blocks: int,
    causal: bool,
    scale: float | None = None,
) -> torch.Tensor:
    """``scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)`` over a sequence
    split along ``ax`` in ``blocks`` stripes (module docstring; ``Shard(seq, blocks)``, queries,
    keys and values alike): ``q``, ``k``, ``v`` are this device's pieces. Keys and values with
    fewer heads than the queries (grouped-query attention) travel unrepeated."""
    n, c = ax.size, ax.coord
    if q.shape[-3] % k.shape[-3]:
        raise ValueError(f"ring attention: {q.shape[-3]} query heads over {k.shape[-3]} key-value heads")
    length = q.shape[-2] * n
    plans = tuple(step_plan(length, blocks, n, c, (c - s) % n, causal) for s in range(n))
    if not all(plans):
        # a step with nothing to compute leaves what arrived unread, and a traced program drops
        # an exchange whose result nothing reads — on this device only: the others would wait
        idle = [s for s, p in enumerate(plans) if not p]
        raise ValueError(
            f"ring attention: device {c} of {n} has nothing to compute at steps {idle} of a sequence of "
            f"{length} in {blocks} block(s); split it in stripes (Shard(seq, blocks={length // n}))"
        )
    return _RingAttention.apply(q, k, v, ax, plans, scale)


def play_ring(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor,
    n: int,
    blocks: int,
    causal: bool,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ring's steps for every device in one process, without collectives (tests, GPU checks):
    whole ``q``, ``k``, ``v`` (batch, heads, sequence, dim) and an output gradient ``dout``, the
    sequence in ``blocks`` stripes over ``n`` devices. Each device's queries meet each source's
    keys as the ring would bring them, the partial results merge, and each step's key gradients are
    added to their owner's. Returns the output and the gradients of ``q``, ``k``, ``v``."""
    heads, kv_heads, length = q.shape[-3], k.shape[-3], q.shape[-2]
    pieces = [stripes(length, blocks, n, c) for c in range(n)]
    rows = [torch.cat([torch.arange(lo, hi, device=q.device) for lo, hi in p]) for p in pieces]
    local = [
        (q[..., r, :], _expand_heads(k[..., r, :], heads), _expand_heads(v[..., r, :], heads)) for r in rows
    ]
    plans = [[step_plan(length, blocks, n, c, (c - s) % n, causal) for s in range(n)] for c in range(n)]
    out = torch.zeros_like(q)
    grads = [torch.zeros_like(t, dtype=_lse_dtype(q)) for t in (q, k, v)]
    for c in range(n):
        o = lse = None
        for s in range(n):
            if plans[c][s]:
                o, lse = merge(o, lse, *attend_step(local[c][0], *local[(c - s) % n][1:], plans[c][s], scale))
        assert o is not None and lse is not None
        mine = o.to(q.dtype)
        out[..., rows[c], :] = mine
        for s in range(n):
            src = (c - s) % n
            if plans[c][s]:
                dq, dk, dv = attend_step_backward(
                    dout[..., rows[c], :], local[c][0], *local[src][1:], mine, lse, plans[c][s], scale
                )
                grads[0][..., rows[c], :] += dq
                grads[1][..., rows[src], :] += _fold_heads(dk, kv_heads)
                grads[2][..., rows[src], :] += _fold_heads(dv, kv_heads)
    return out, *(g.to(t.dtype) for g, t in zip(grads, (q, k, v)))

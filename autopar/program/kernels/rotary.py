"""Rotary position embedding of q and k together: transformers' ``apply_rotary_pos_emb``.

For ``x`` in ``(q, k)`` (``[b, h, s, d]``; q and k may have different head counts, as with
grouped-query attention) and ``cos``/``sin`` broadcastable to ``[b, 1, s, d]``:

    y = x · cos + rotate_half(x) · sin,   rotate_half(x) = cat(−x₂, x₁)

with ``x₁``, ``x₂`` the two halves of the last dim (the non-interleaved, GPT-NeoX/LLaMA layout,
Su et al. 2021, arXiv 2104.09864). Per half:

    y₁ = x₁ c₁ − x₂ s₁,   y₂ = x₂ c₂ + x₁ s₂,

and, since ``rotate_half`` is linear with transpose ``−rotate_half``, the backward is the same
kernel with the signs of the ``sin`` terms swapped and the halves of ``sin`` exchanged:

    dx₁ = dy₁ c₁ + dy₂ s₂,   dx₂ = dy₂ c₂ − dy₁ s₁.

Eager runs five kernels per tensor (a negation, a cat, two products, an add; the slices are
views) and as many backward; fused, one launch reads q, k, cos, sin once and writes both outputs,
each program rotating a tile of (batch, head, position) rows of one tensor. ``cos``/``sin`` are
constants: the backward returns no gradient for them (the fusion pass only fuses when they need
none; position tables never do). q and k are read through their strides (the transposed
``[b, s, h, d]`` projections need no copy) as long as the last dim is contiguous.

Ops: ``autopar::rotary`` ``(q, k, cos, sin, block_size) -> (q_out, k_out)`` and
``autopar::rotary_backward`` ``(dq_out, dk_out, cos, sin, q_dtype, k_dtype, block_size) -> (dq,
dk)``.
"""

import torch
from torch import Tensor

from autopar.program.kernels._launch import HAS_TRITON, backend, num_warps

if HAS_TRITON:
    import triton
    import triton.language as tl

__all__ = ["rotary", "rotary_reference"]

ROTARY_TILE = 2048
"""Elements per half-row tile of one rotary program (rows × half head dim)."""


def _rotate_half(x: Tensor) -> Tensor:
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def rotary_reference(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """The eager composition the fused op replaces (transformers' ``apply_rotary_pos_emb`` after
    its ``unsqueeze``)."""
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _table(t: Tensor, b: int, s: int, d: int) -> tuple[Tensor, int]:
    """``cos``/``sin`` as a contiguous ``[1 or b, s, d]`` table and its batch stride (0 when one
    table serves every batch entry)."""
    if t.dim() == 2:
        t = t.unsqueeze(0)
    elif t.dim() == 4 and t.shape[1] == 1:
        t = t[:, 0]
    else:
        raise ValueError(f"rotary: cos/sin {tuple(t.shape)} must be [s, d], [1, 1, s, d] or [b, 1, s, d]")
    if t.shape[0] not in (1, b) or tuple(t.shape[1:]) != (s, d):
        raise ValueError(f"rotary: cos/sin {tuple(t.shape)} does not broadcast to [{b}, 1, {s}, {d}]")
    t = t.contiguous()
    return t, (s * d if t.shape[0] > 1 else 0)


def _check(q: Tensor, k: Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"rotary: q and k must be [b, h, s, d], got {tuple(q.shape)} and {tuple(k.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]:
        raise ValueError(f"rotary: q {tuple(q.shape)} and k {tuple(k.shape)} differ outside the head dim")
    if q.shape[-1] % 2:
        raise ValueError(f"rotary: the head dim must be even, got {q.shape[-1]}")


# ------------------------------------------------------------------------------ Triton kernels

if HAS_TRITON:

    @triton.jit
    def _rotate_rows(
        X, Y, C, S, first, n_rows, heads, seq, half, sxb, sxh, sxs, cos_batch_stride,
        BACKWARD: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
    ):  # fmt: skip
        """Rows ``[first, first + ROWS)`` of one tensor (row = (batch, head, position))."""
        rows = first + tl.arange(0, ROWS)
        b = rows // (heads * seq)
        h = (rows // seq) % heads
        t = rows % seq
        src = (b * sxb + h * sxh + t * sxs)[:, None]
        dst = (rows * 2 * half)[:, None]
        tab = (b * cos_batch_stride + t * 2 * half)[:, None]
        cols = tl.arange(0, BLOCK)[None, :]
        mask = (rows < n_rows)[:, None] & (cols < half)
        x1 = tl.load(X + src + cols, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(X + src + half + cols, mask=mask, other=0.0).to(tl.float32)
        c1 = tl.load(C + tab + cols, mask=mask, other=0.0).to(tl.float32)
        c2 = tl.load(C + tab + half + cols, mask=mask, other=0.0).to(tl.float32)
        s1 = tl.load(S + tab + cols, mask=mask, other=0.0).to(tl.float32)
        s2 = tl.load(S + tab + half + cols, mask=mask, other=0.0).to(tl.float32)
        if BACKWARD:
            y1 = x1 * c1 + x2 * s2
            y2 = x2 * c2 - x1 * s1
        else:
            y1 = x1 * c1 - x2 * s1
            y2 = x2 * c2 + x1 * s2
        tl.store(Y + dst + cols, y1.to(Y.dtype.element_ty), mask=mask)
        tl.store(Y + dst + half + cols, y2.to(Y.dtype.element_ty), mask=mask)

    @triton.jit
    def _rotary_kernel(
        Q, K, QO, KO, C, S,
        q_rows, k_rows, q_programs, q_heads, k_heads, seq, half,
        sqb, sqh, sqs, skb, skh, sks, cos_batch_stride,
        BACKWARD: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
    ):  # fmt: skip
        """Programs ``[0, q_programs)`` take q's rows, ROWS at a time; the rest k's."""
        pid = tl.program_id(0).to(tl.int64)
        cs = cos_batch_stride
        if pid < q_programs:
            first = pid * ROWS
            _rotate_rows(
                Q, QO, C, S, first, q_rows, q_heads, seq, half, sqb, sqh, sqs, cs, BACKWARD, BLOCK, ROWS
            )
        else:
            first = (pid - q_programs) * ROWS
            _rotate_rows(
                K, KO, C, S, first, k_rows, k_heads, seq, half, skb, skh, sks, cs, BACKWARD, BLOCK, ROWS
            )


def _last_dim_contiguous(x: Tensor) -> Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _rotary_triton(
    q: Tensor,
    k: Tensor,
    cos: Tensor,
    sin: Tensor,
    backward: bool,
    q_dtype: torch.dtype,
    k_dtype: torch.dtype,
    block_size: int,
) -> tuple[Tensor, Tensor]:
    q, k = _last_dim_contiguous(q), _last_dim_contiguous(k)
    b, hq, s, d = q.shape
    hk = k.shape[1]
    c, cstride = _table(cos, b, s, d)
    sn, _ = _table(sin, b, s, d)
    qo = torch.empty(q.shape, dtype=q_dtype, device=q.device)
    ko = torch.empty(k.shape, dtype=k_dtype, device=k.device)
    q_rows, k_rows = b * hq * s, b * hk * s
    block = triton.next_power_of_2(d // 2)
    rows = _rows_per_program(block, block_size)
    q_programs = triton.cdiv(q_rows, rows)
    _rotary_kernel[(q_programs + triton.cdiv(k_rows, rows),)](
        q, k, qo, ko, c, sn, q_rows, k_rows, q_programs, hq, hk, s, d // 2,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2), cstride,
        BACKWARD=backward, BLOCK=block, ROWS=rows, num_warps=num_warps(2 * rows * block),
    )  # fmt: skip
    return qo, ko


def _rows_per_program(block: int, forced: int) -> int:
    """Rows one program rotates: a tile of about ``ROTARY_TILE`` elements per half (a 128-wide
    head is 64 per half: 32 rows), so a program moves enough bytes to be worth launching."""
    if forced > 0:
        if forced & (forced - 1):
            raise ValueError(f"block_size must be a power of two, got {forced}")
        return forced
    return max(1, ROTARY_TILE // block)


# ------------------------------------------------------------- eager fallback (same arithmetic)


def _rotary_eager(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, backward: bool) -> tuple[Tensor, Tensor]:
    if backward:  # the transpose of rotate_half is −rotate_half
        return q * cos - _rotate_half(q * sin), k * cos - _rotate_half(k * sin)
    return rotary_reference(q, k, cos, sin)


def _out_dtype(x: Tensor, cos: Tensor) -> torch.dtype:
    return torch.result_type(x, cos)


# ------------------------------------------------------------------------------ custom ops


@torch.library.custom_op("autopar::rotary", mutates_args=())
def _rotary_op(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, block_size: int = 0) -> tuple[Tensor, Tensor]:
    _check(q, k)
    if backend(q) == "triton" and q.numel() > 0 and k.numel() > 0:
        return _rotary_triton(q, k, cos, sin, False, _out_dtype(q, cos), _out_dtype(k, cos), block_size)
    qo, ko = _rotary_eager(q, k, cos, sin, backward=False)
    return qo.contiguous(), ko.contiguous()


@_rotary_op.register_fake
def _(q, k, cos, sin, block_size=0):
    return q.new_empty(q.shape, dtype=_out_dtype(q, cos)), k.new_empty(k.shape, dtype=_out_dtype(k, cos))


@torch.library.custom_op("autopar::rotary_backward", mutates_args=())
def _rotary_backward_op(
    grad_q: Tensor,
    grad_k: Tensor,
    cos: Tensor,
    sin: Tensor,
    q_dtype: torch.dtype,
    k_dtype: torch.dtype,
    block_size: int = 0,
) -> tuple[Tensor, Tensor]:
    """``(dq, dk)`` in the inputs' dtypes ``q_dtype``, ``k_dtype``."""
    if backend(grad_q) == "triton" and grad_q.numel() > 0 and grad_k.numel() > 0:
        return _rotary_triton(grad_q, grad_k, cos, sin, True, q_dtype, k_dtype, block_size)
    dq, dk = _rotary_eager(grad_q, grad_k, cos, sin, backward=True)
    return dq.to(q_dtype).contiguous(), dk.to(k_dtype).contiguous()


@_rotary_backward_op.register_fake
def _(grad_q, grad_k, cos, sin, q_dtype, k_dtype, block_size=0):
    return grad_q.new_empty(grad_q.shape, dtype=q_dtype), grad_k.new_empty(grad_k.shape, dtype=k_dtype)


def _setup_context(ctx, inputs, output) -> None:
    q, k, cos, sin, block_size = inputs
    ctx.save_for_backward(cos, sin)
    ctx.dtypes = (q.dtype, k.dtype)
    ctx.block_size = block_size


def _backward(ctx, gq, gk):  # an unused output's gradient arrives as zeros (materialised)
    cos, sin = ctx.saved_tensors
    q_dtype, k_dtype = ctx.dtypes
    dq, dk = _rotary_backward_op(gq, gk, cos, sin, q_dtype, k_dtype, ctx.block_size)
    return dq, dk, None, None, None


_rotary_op.register_autograd(_backward, setup_context=_setup_context)


def rotary(
    q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, *, block_size: int | None = None
) -> tuple[Tensor, Tensor]:
    """``(q·cos + rotate_half(q)·sin, k·cos + rotate_half(k)·sin)`` in one fused kernel.

    ``q`` is ``[b, hq, s, d]``, ``k`` ``[b, hk, s, d]`` (``hk`` may differ from ``hq``), ``cos`` and
    ``sin`` are ``[b, 1, s, d]``, ``[1, 1, s, d]`` or ``[s, d]``. Gradients flow to ``q`` and ``k``
    only: ``cos`` and ``sin`` are treated as constants (None gradient, see module docstring).
    ``block_size``: rows (of one head at one position) per program, a power of two."""
    _check(q, k)
    return _rotary_op(q, k, cos, sin, block_size or 0)

"""Residual add + RMSNorm, as transformers' ``LlamaRMSNorm`` computes it, one kernel each way.

LLaMA, Mistral and Qwen2 normalise ``s = x + residual`` by ``rstd = rsqrt(mean(s²) + eps)`` with
the mean taken in float32, cast the normalised row back to the input dtype, then multiply by the
weight (so the output dtype is that of ``weight · s``, as in eager). The fused forward reads
``x``, ``residual`` and ``weight`` once and writes ``out``, ``s`` and the per-row ``rstd``;
backward reads ``dout``, ``ds``, ``s``, ``weight``, ``rstd`` and writes ``dx`` (also the gradient
of ``residual``):

    h = s · rstd,   g = w · dout,
    dx = rstd · (g − h · mean(g · h)) + ds,   dw = Σ_rows dout · cast(h),

where ``cast(h)`` is ``h`` rounded to the input dtype as the forward multiplied it. The weight
gradient is reduced as in ``layer_norm``: per-program fp32 partial rows, summed by torch; wide
rows are walked in blocks as there (two passes forward, two backward).

Ops: ``autopar::add_rms_norm`` ``(x, residual?, weight?, eps, block_size) -> (out, sum, rstd)``
(``sum`` empty without a residual) and ``autopar::add_rms_norm_backward``.
"""

import torch
from torch import Tensor

from autopar.program.kernels import _norm_rows as norm_rows
from autopar.program.kernels._launch import HAS_TRITON, backend

if HAS_TRITON:
    import triton
    import triton.language as tl


__all__ = ["add_rms_norm", "add_rms_norm_reference"]


def add_rms_norm_reference(
    x: Tensor, residual: Tensor | None, weight: Tensor | None, eps: float
) -> tuple[Tensor, Tensor]:
    """The eager composition the fused op replaces: ``add``, then ``LlamaRMSNorm.forward``."""
    s = x + residual if residual is not None else x
    h = s.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    h = h.to(s.dtype)
    return (weight * h if weight is not None else h), s


def _out_dtype(x: Tensor, weight: Tensor | None) -> torch.dtype:
    return torch.result_type(x, weight) if weight is not None else x.dtype


# ------------------------------------------------------------------------------ Triton kernels

if HAS_TRITON:

    @triton.jit
    def _add_rms_norm_fwd_kernel(
        X, R, W, Y, S, RSTD,
        n_cols, eps,
        HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr, BLOCK: tl.constexpr, ONE_BLOCK: tl.constexpr,
    ):  # fmt: skip
        row, X, R, Y, S, cols = norm_rows.forward_row(X, R, Y, S, n_cols, BLOCK)
        if ONE_BLOCK:
            mask = cols < n_cols
            h = norm_rows.residual_stream(X, R, S, cols, mask, HAS_RESIDUAL).to(tl.float32)
            rstd = tl.rsqrt(tl.sum(h * h, axis=0) / n_cols + eps)
            y = norm_rows.weighted(
                (h * rstd).to(X.dtype.element_ty).to(tl.float32), W, cols, mask, HAS_WEIGHT
            )
            tl.store(Y + cols, y.to(Y.dtype.element_ty), mask=mask)
        else:
            acc = tl.zeros([BLOCK], dtype=tl.float32)
            for start in range(0, n_cols, BLOCK):
                c, mask = norm_rows.block_at(start, cols, n_cols)
                h = norm_rows.residual_stream(X, R, S, c, mask, HAS_RESIDUAL).to(tl.float32)
                acc += h * h
            rstd = tl.rsqrt(tl.sum(acc, axis=0) / n_cols + eps)
            for start in range(0, n_cols, BLOCK):
                c, mask = norm_rows.block_at(start, cols, n_cols)
                h = norm_rows.residual_sum(X, R, c, mask, HAS_RESIDUAL).to(tl.float32)
                y = norm_rows.weighted(
                    (h * rstd).to(X.dtype.element_ty).to(tl.float32), W, c, mask, HAS_WEIGHT
                )
                tl.store(Y + c, y.to(Y.dtype.element_ty), mask=mask)
        tl.store(RSTD + row, rstd)

    @triton.jit
    def _add_rms_norm_bwd_kernel(
        DY, DS, S, W, RSTD, DX, DW,
        n_rows, n_cols, rows_per_program,
        HAS_DS: tl.constexpr, HAS_WEIGHT: tl.constexpr, BLOCK: tl.constexpr, ONE_BLOCK: tl.constexpr,
    ):  # fmt: skip
        pid, row_start, row_end, cols = norm_rows.backward_chunk(n_rows, rows_per_program, BLOCK)
        DW += pid * n_cols
        if ONE_BLOCK:
            mask = cols < n_cols
            dw = tl.zeros([BLOCK], dtype=tl.float32)
            for row in range(row_start, row_end):
                base = row * n_cols
                dy = norm_rows.load_f32(DY + base, cols, mask)
                rstd = tl.load(RSTD + row)
                h = norm_rows.load_f32(S + base, cols, mask) * rstd
                # The weight is re-read per row (a cache hit) rather than held: fewer registers.
                g = norm_rows.weighted(dy, W, cols, mask, HAS_WEIGHT)
                c = tl.sum(g * h, axis=0) / n_cols
                norm_rows.store_dx(DX + base, DS + base, cols, mask, rstd * (g - h * c), HAS_DS)
                dw += dy * h.to(S.dtype.element_ty).to(tl.float32)
            norm_rows.store_partial(DW, cols, mask, dw, HAS_WEIGHT)
        else:
            for row in range(row_start, row_end):
                base = row * n_cols
                rstd = tl.load(RSTD + row)
                acc = tl.zeros([BLOCK], dtype=tl.float32)
                for start in range(0, n_cols, BLOCK):
                    c, mask = norm_rows.block_at(start, cols, n_cols)
                    h = norm_rows.load_f32(S + base, c, mask) * rstd
                    g = norm_rows.weighted(norm_rows.load_f32(DY + base, c, mask), W, c, mask, HAS_WEIGHT)
                    acc += g * h
                k = tl.sum(acc, axis=0) / n_cols
                for start in range(0, n_cols, BLOCK):
                    c, mask = norm_rows.block_at(start, cols, n_cols)
                    h = norm_rows.load_f32(S + base, c, mask) * rstd
                    dy = norm_rows.load_f32(DY + base, c, mask)
                    g = norm_rows.weighted(dy, W, c, mask, HAS_WEIGHT)
                    norm_rows.store_dx(DX + base, DS + base, c, mask, rstd * (g - h * k), HAS_DS)
                    norm_rows.add_partial(
                        DW, c, mask, dy * h.to(S.dtype.element_ty).to(tl.float32), HAS_WEIGHT
                    )


def _forward_triton(
    x: Tensor, residual: Tensor | None, weight: Tensor | None, eps: float, block_size: int
) -> tuple[Tensor, Tensor, Tensor]:
    n = x.shape[-1]
    x2, r2, s, s_arg = norm_rows.forward_rows(x, residual)
    rows = x2.shape[0]
    out = torch.empty(x2.shape, dtype=_out_dtype(x, weight), device=x.device)
    rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
    w = weight.contiguous() if weight is not None else x2
    block, one, warps = norm_rows.launch_block(n, block_size, backward=False)
    _add_rms_norm_fwd_kernel[(rows,)](
        x2, r2, w, out, s_arg, rstd, n, eps,
        HAS_RESIDUAL=residual is not None, HAS_WEIGHT=weight is not None,
        BLOCK=block, ONE_BLOCK=one, num_warps=warps,
    )  # fmt: skip
    return out.view(x.shape), norm_rows.stream_output(s, x, residual), rstd.view(x.shape[:-1])


def _backward_triton(
    g: Tensor, g_sum: Tensor | None, s: Tensor, weight: Tensor | None, rstd: Tensor, block_size: int
) -> tuple[Tensor, Tensor]:
    n = s.shape[-1]
    s2, g2, ds, dx, programs, per = norm_rows.backward_rows(g, g_sum, s)
    dw = norm_rows.partial_rows(programs, n, weight, dx)
    w = weight.contiguous() if weight is not None else s2
    block, one, warps = norm_rows.launch_block(n, block_size, backward=True)
    _add_rms_norm_bwd_kernel[(programs,)](
        g2, ds, s2, w, rstd.contiguous(), dx, dw, s2.shape[0], n, per,
        HAS_DS=g_sum is not None, HAS_WEIGHT=weight is not None,
        BLOCK=block, ONE_BLOCK=one, num_warps=warps,
    )  # fmt: skip
    return dx.view(s.shape), norm_rows.summed_partials(dw, weight, s)


# ------------------------------------------------------------- eager fallback (same arithmetic)


def _forward_eager(
    x: Tensor, residual: Tensor | None, weight: Tensor | None, eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    s = x + residual if residual is not None else x
    sf = s.float()
    rstd = torch.rsqrt(sf.pow(2).mean(-1) + eps)
    h = (sf * rstd.unsqueeze(-1)).to(s.dtype)
    out = weight * h if weight is not None else h
    return out, s if residual is not None else x.new_empty(0), rstd


def _backward_eager(
    g: Tensor, g_sum: Tensor | None, s: Tensor, weight: Tensor | None, rstd: Tensor
) -> tuple[Tensor, Tensor]:
    gf = g.float()
    r = rstd.unsqueeze(-1)
    h = s.float() * r
    wg = gf * weight.float() if weight is not None else gf
    dx = r * (wg - h * (wg * h).mean(-1, keepdim=True))
    if g_sum is not None:
        dx = dx + g_sum.float()
    return dx.to(s.dtype), norm_rows.summed_partials(gf * h.to(s.dtype).float(), weight, s)


# ------------------------------------------------------------------------------ custom ops


@torch.library.custom_op("autopar::add_rms_norm", mutates_args=())
def _add_rms_norm_op(
    x: Tensor, residual: Tensor | None, weight: Tensor | None, eps: float, block_size: int = 0
) -> tuple[Tensor, Tensor, Tensor]:
    if backend(x) == "triton" and x.numel() > 0:
        return _forward_triton(x, residual, weight, eps, block_size)
    return tuple(t.contiguous() for t in _forward_eager(x, residual, weight, eps))


@_add_rms_norm_op.register_fake
def _(x, residual, weight, eps, block_size=0):
    out = x.new_empty(x.shape, dtype=_out_dtype(x, weight))
    s = x.new_empty(x.shape) if residual is not None else x.new_empty(0)
    return out, s, x.new_empty(x.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("autopar::add_rms_norm_backward", mutates_args=())
def _add_rms_norm_backward_op(
    grad_out: Tensor,
    grad_sum: Tensor | None,
    s: Tensor,
    weight: Tensor | None,
    rstd: Tensor,
    block_size: int = 0,
) -> tuple[Tensor, Tensor]:
    """``(dx, dweight)``; ``dweight`` is empty where ``weight`` is None."""
    if backend(s) == "triton" and s.numel() > 0:
        return _backward_triton(grad_out, grad_sum, s, weight, rstd, block_size)
    return tuple(t.contiguous() for t in _backward_eager(grad_out, grad_sum, s, weight, rstd))


@_add_rms_norm_backward_op.register_fake
def _(grad_out, grad_sum, s, weight, rstd, block_size=0):
    return s.new_empty(s.shape), weight.new_empty(weight.shape) if weight is not None else s.new_empty(0)


def _setup_context(ctx, inputs, output) -> None:
    x, residual, weight, _eps, block_size = inputs
    _out, s, rstd = output
    ctx.mark_non_differentiable(rstd)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(s if residual is not None else x, weight, rstd)
    ctx.has_residual = residual is not None
    ctx.block_size = block_size


def _backward(ctx, g_out, g_sum, _g_rstd):
    s, weight, rstd = ctx.saved_tensors
    g_sum = g_sum if ctx.has_residual else None
    if g_out is None:  # only the residual stream was used
        return g_sum, g_sum, None, None, None
    dx, dw = _add_rms_norm_backward_op(g_out, g_sum, s, weight, rstd, ctx.block_size)
    return dx, dx if ctx.has_residual else None, dw if weight is not None else None, None, None


_add_rms_norm_op.register_autograd(_backward, setup_context=_setup_context)


def add_rms_norm(
    x: Tensor,
    residual: Tensor | None,
    weight: Tensor | None,
    eps: float,
    *,
    block_size: int | None = None,
) -> tuple[Tensor, Tensor]:
    """``(LlamaRMSNorm(x + residual), x + residual)`` in one fused kernel (see module docstring).

    ``residual`` and ``weight`` may be None; without a residual the second output is ``x``
    itself. The residual stream's gradient is added inside the backward kernel; ``x`` and
    ``residual`` get the same gradient. ``block_size``: see ``add_layer_norm``."""
    x, residual = norm_rows.promote_residual(x, residual)
    out, s, _rstd = _add_rms_norm_op(x, residual, weight, float(eps), block_size or 0)
    return out, s if residual is not None else x

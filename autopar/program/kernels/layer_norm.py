"""Residual add + LayerNorm: ``(layer_norm(x + residual), x + residual)`` as one kernel each way.

The pre-norm transformer block reads the residual stream twice: ``s = x + residual`` feeds the
norm and, later, the next residual add. Eager PyTorch runs the add (read 2, write 1) and the norm
(read 1, write 1, plus statistics); the fused forward reads ``x``, ``residual``, ``weight`` and
``bias`` once and writes ``out``, ``s`` and the per-row ``mean`` and ``rstd`` (Liger-Kernel's
``layer_norm``, the Apex/Megatron fused LayerNorm). Backward reads ``dout``, ``ds`` (the gradient
of the residual stream, added in the same kernel), ``s``, ``weight``, ``mean``, ``rstd`` and writes
``dx`` (which is also the gradient of ``residual``):

    x̂ = (s − mean) · rstd,   g = w · dout,
    dx = rstd · (g − x̂ · mean(g · x̂) − mean(g)) + ds,
    dw = Σ_rows dout · x̂,    db = Σ_rows dout.

Weight and bias gradients are reduced in two steps: each backward program walks a chunk of
consecutive rows and accumulates its partial sums in fp32 registers (one row of a ``[programs,
hidden]`` buffer, ``_launch.row_chunks``), and torch sums the buffer's rows afterwards — a few
hundred rows instead of one per token (Liger-Kernel's scheme). A row wider than one block
(``_launch.ROW_MAX_BLOCK`` forward, ``ROW_MAX_BLOCK_BACKWARD`` backward) is walked in blocks: the
forward in three passes (sum, centred squares, output), the backward in two (the row sums, then
``dx``, adding into the program's partial row in memory instead of registers).

Ops: ``autopar::add_layer_norm`` ``(x, residual?, weight?, bias?, eps, block_size) -> (out, sum,
mean, rstd)`` (``sum`` is empty without a residual: the public function returns ``x`` itself) and
``autopar::add_layer_norm_backward``. Statistics are fp32; ``out`` and ``sum`` have ``x``'s dtype.
"""

from typing import NamedTuple

import torch
from torch import Tensor

from autopar.program.kernels import _norm_rows as norm_rows
from autopar.program.kernels._launch import HAS_TRITON, backend

if HAS_TRITON:
    import triton
    import triton.language as tl


__all__ = ["add_layer_norm", "add_layer_norm_reference"]


class _Saved(NamedTuple):
    """What the forward keeps for the backward (``_setup_context``), in the backward op's order:
    the normalized rows ``s`` (``x + residual``, or ``x`` without a residual), the affine
    parameters, and the per-row fp32 statistics."""

    s: Tensor
    weight: Tensor | None
    bias: Tensor | None
    mean: Tensor
    rstd: Tensor


def add_layer_norm_reference(
    x: Tensor, residual: Tensor | None, weight: Tensor | None, bias: Tensor | None, eps: float
) -> tuple[Tensor, Tensor]:
    """The eager composition the fused op replaces: ``add`` then ``layer_norm`` over the last dim."""
    s = x + residual if residual is not None else x
    return torch.nn.functional.layer_norm(s, (s.shape[-1],), weight, bias, eps), s


# ------------------------------------------------------------------------------ Triton kernels

if HAS_TRITON:

    @triton.jit
    def _add_layer_norm_fwd_kernel(
        X, R, W, B, Y, S, MEAN, RSTD,
        n_cols, eps,
        HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
        BLOCK: tl.constexpr, ONE_BLOCK: tl.constexpr,
    ):  # fmt: skip
        row, X, R, Y, S, cols = norm_rows.forward_row(X, R, Y, S, n_cols, BLOCK)
        if ONE_BLOCK:
            mask = cols < n_cols
            s = norm_rows.residual_stream(X, R, S, cols, mask, HAS_RESIDUAL).to(tl.float32)
            mean = tl.sum(s, axis=0) / n_cols
            d = tl.where(mask, s - mean, 0.0)
            var = tl.sum(d * d, axis=0) / n_cols
            rstd = 1.0 / tl.sqrt(var + eps)
            y = norm_rows.weighted(d * rstd, W, cols, mask, HAS_WEIGHT)
            if HAS_BIAS:
                y = y + norm_rows.load_f32(B, cols, mask)
            tl.store(Y + cols, y.to(Y.dtype.element_ty), mask=mask)
        else:
            # Three walks over the row: the sum (and the residual stream's store), the centred
            # sum of squares, the output. Later walks re-read x and residual (cache hits).
            acc = tl.zeros([BLOCK], dtype=tl.float32)
            for start in range(0, n_cols, BLOCK):
                c, mask = norm_rows.block_at(start, cols, n_cols)
                acc += norm_rows.residual_stream(X, R, S, c, mask, HAS_RESIDUAL).to(tl.float32)
            mean = tl.sum(acc, axis=0) / n_cols
            acc = tl.zeros([BLOCK], dtype=tl.float32)
            for start in range(0, n_cols, BLOCK):
                c, mask = norm_rows.block_at(start, cols, n_cols)
                s = norm_rows.residual_sum(X, R, c, mask, HAS_RESIDUAL).to(tl.float32)
                d = tl.where(mask, s - mean, 0.0)
                acc += d * d
            var = tl.sum(acc, axis=0) / n_cols
            rstd = 1.0 / tl.sqrt(var + eps)
            for start in range(0, n_cols, BLOCK):
                c, mask = norm_rows.block_at(start, cols, n_cols)
                s = norm_rows.residual_sum(X, R, c, mask, HAS_RESIDUAL).to(tl.float32)
                y = norm_rows.weighted((s - mean) * rstd, W, c, mask, HAS_WEIGHT)
                if HAS_BIAS:
                    y = y + norm_rows.load_f32(B, c, mask)
                tl.store(Y + c, y.to(Y.dtype.element_ty), mask=mask)
        tl.store(MEAN + row, mean)
        tl.store(RSTD + row, rstd)

    @triton.jit
    def _add_layer_norm_bwd_kernel(
        DY, DS, S, W, MEAN, RSTD, DX, DW, DB,
        n_rows, n_cols, rows_per_program,
        HAS_DS: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
        BLOCK: tl.constexpr, ONE_BLOCK: tl.constexpr,
    ):  # fmt: skip
        pid, row_start, row_end, cols = norm_rows.backward_chunk(n_rows, rows_per_program, BLOCK)
        DW += pid * n_cols
        DB += pid * n_cols
        if ONE_BLOCK:
            mask = cols < n_cols
            dw = tl.zeros([BLOCK], dtype=tl.float32)
            db = tl.zeros([BLOCK], dtype=tl.float32)
            for row in range(row_start, row_end):
                base = row * n_cols
                s = norm_rows.load_f32(S + base, cols, mask)
                dy = norm_rows.load_f32(DY + base, cols, mask)
                mean = tl.load(MEAN + row)
                rstd = tl.load(RSTD + row)
                xhat = tl.where(mask, (s - mean) * rstd, 0.0)
                # The weight is re-read per row (a cache hit) rather than held: fewer registers.
                g = norm_rows.weighted(dy, W, cols, mask, HAS_WEIGHT)
                c1 = tl.sum(xhat * g, axis=0) / n_cols
                c2 = tl.sum(g, axis=0) / n_cols
                norm_rows.store_dx(DX + base, DS + base, cols, mask, (g - (xhat * c1 + c2)) * rstd, HAS_DS)
                dw += dy * xhat
                db += dy
            norm_rows.store_partial(DW, cols, mask, dw, HAS_WEIGHT)
            norm_rows.store_partial(DB, cols, mask, db, HAS_BIAS)
        else:
            for row in range(row_start, row_end):
                base = row * n_cols
                mean = tl.load(MEAN + row)
                rstd = tl.load(RSTD + row)
                acc1 = tl.zeros([BLOCK], dtype=tl.float32)
                acc2 = tl.zeros([BLOCK], dtype=tl.float32)
                for start in range(0, n_cols, BLOCK):
                    c, mask = norm_rows.block_at(start, cols, n_cols)
                    s = norm_rows.load_f32(S + base, c, mask)
                    g = norm_rows.weighted(norm_rows.load_f32(DY + base, c, mask), W, c, mask, HAS_WEIGHT)
                    xhat = tl.where(mask, (s - mean) * rstd, 0.0)
                    acc1 += xhat * g
                    acc2 += g
                c1 = tl.sum(acc1, axis=0) / n_cols
                c2 = tl.sum(acc2, axis=0) / n_cols
                for start in range(0, n_cols, BLOCK):
                    c, mask = norm_rows.block_at(start, cols, n_cols)
                    s = norm_rows.load_f32(S + base, c, mask)
                    dy = norm_rows.load_f32(DY + base, c, mask)
                    g = norm_rows.weighted(dy, W, c, mask, HAS_WEIGHT)
                    xhat = tl.where(mask, (s - mean) * rstd, 0.0)
                    norm_rows.store_dx(DX + base, DS + base, c, mask, (g - (xhat * c1 + c2)) * rstd, HAS_DS)
                    norm_rows.add_partial(DW, c, mask, dy * xhat, HAS_WEIGHT)
                    norm_rows.add_partial(DB, c, mask, dy, HAS_BIAS)


def _forward_triton(
    x: Tensor,
    residual: Tensor | None,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    block_size: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    n = x.shape[-1]
    x2, r2, s, s_arg = norm_rows.forward_rows(x, residual)
    rows = x2.shape[0]
    out = torch.empty_like(x2)
    mean = torch.empty(rows, dtype=torch.float32, device=x.device)
    rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
    w = weight.contiguous() if weight is not None else x2
    b = bias.contiguous() if bias is not None else x2
    block, one, warps = norm_rows.launch_block(n, block_size, backward=False)
    _add_layer_norm_fwd_kernel[(rows,)](
        x2, r2, w, b, out, s_arg, mean, rstd, n, eps,
        HAS_RESIDUAL=residual is not None, HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None,
        BLOCK=block, ONE_BLOCK=one, num_warps=warps,
    )  # fmt: skip
    lead = x.shape[:-1]
    return out.view(x.shape), norm_rows.stream_output(s, x, residual), mean.view(lead), rstd.view(lead)


def _backward_triton(
    g: Tensor, g_sum: Tensor | None, saved: _Saved, block_size: int
) -> tuple[Tensor, Tensor, Tensor]:
    s, weight, bias, mean, rstd = saved
    n = s.shape[-1]
    s2, g2, ds, dx, programs, per = norm_rows.backward_rows(g, g_sum, s)
    dw = norm_rows.partial_rows(programs, n, weight, dx)
    db = norm_rows.partial_rows(programs, n, bias, dx)
    w = weight.contiguous() if weight is not None else s2
    block, one, warps = norm_rows.launch_block(n, block_size, backward=True)
    _add_layer_norm_bwd_kernel[(programs,)](
        g2, ds, s2, w, mean.contiguous(), rstd.contiguous(), dx, dw, db, s2.shape[0], n, per,
        HAS_DS=g_sum is not None, HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None,
        BLOCK=block, ONE_BLOCK=one, num_warps=warps,
    )  # fmt: skip
    return dx.view(s.shape), norm_rows.summed_partials(dw, weight, s), norm_rows.summed_partials(db, bias, s)


# ------------------------------------------------------------- eager fallback (same arithmetic)


def _forward_eager(
    x: Tensor, residual: Tensor | None, weight: Tensor | None, bias: Tensor | None, eps: float
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    s = x + residual if residual is not None else x
    sf = s.float()
    var, mean = torch.var_mean(sf, dim=-1, correction=0)
    rstd = torch.rsqrt(var + eps)
    y = (sf - mean.unsqueeze(-1)) * rstd.unsqueeze(-1)
    if weight is not None:
        y = y * weight.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype), s if residual is not None else x.new_empty(0), mean, rstd


def _backward_eager(g: Tensor, g_sum: Tensor | None, saved: _Saved) -> tuple[Tensor, Tensor, Tensor]:
    s, weight, bias, mean, rstd = saved
    gf = g.float()
    xhat = (s.float() - mean.unsqueeze(-1)) * rstd.unsqueeze(-1)
    wg = gf * weight.float() if weight is not None else gf
    c1 = (xhat * wg).mean(-1, keepdim=True)
    c2 = wg.mean(-1, keepdim=True)
    dx = (wg - (xhat * c1 + c2)) * rstd.unsqueeze(-1)
    if g_sum is not None:
        dx = dx + g_sum.float()
    return (
        dx.to(s.dtype),
        norm_rows.summed_partials(gf * xhat, weight, s),
        norm_rows.summed_partials(gf, bias, s),
    )


# ------------------------------------------------------------------------------ custom ops


@torch.library.custom_op("autopar::add_layer_norm", mutates_args=())
def _add_layer_norm_op(
    x: Tensor,
    residual: Tensor | None,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    block_size: int = 0,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    if backend(x) == "triton" and x.numel() > 0:
        return _forward_triton(x, residual, weight, bias, eps, block_size)
    return tuple(t.contiguous() for t in _forward_eager(x, residual, weight, bias, eps))


@_add_layer_norm_op.register_fake
def _(x, residual, weight, bias, eps, block_size=0):
    stats = x.new_empty(x.shape[:-1], dtype=torch.float32)
    s = x.new_empty(x.shape) if residual is not None else x.new_empty(0)
    return x.new_empty(x.shape), s, stats, torch.empty_like(stats)


@torch.library.custom_op("autopar::add_layer_norm_backward", mutates_args=())
def _add_layer_norm_backward_op(
    grad_out: Tensor,
    grad_sum: Tensor | None,
    s: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    mean: Tensor,
    rstd: Tensor,
    block_size: int = 0,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dx, dweight, dbias)``; ``dweight``/``dbias`` are empty where ``weight``/``bias`` is None
    (``bias`` is read for its dtype only)."""
    saved = _Saved(s, weight, bias, mean, rstd)
    if backend(s) == "triton" and s.numel() > 0:
        return _backward_triton(grad_out, grad_sum, saved, block_size)
    return tuple(t.contiguous() for t in _backward_eager(grad_out, grad_sum, saved))


@_add_layer_norm_backward_op.register_fake
def _(grad_out, grad_sum, s, weight, bias, mean, rstd, block_size=0):
    dw = weight.new_empty(weight.shape) if weight is not None else s.new_empty(0)
    db = bias.new_empty(bias.shape) if bias is not None else s.new_empty(0)
    return s.new_empty(s.shape), dw, db


def _setup_context(ctx, inputs, output) -> None:
    x, residual, weight, bias, _eps, block_size = inputs
    _out, s, mean, rstd = output
    ctx.mark_non_differentiable(mean, rstd)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(*_Saved(s if residual is not None else x, weight, bias, mean, rstd))
    ctx.has_residual = residual is not None
    ctx.block_size = block_size


def _backward(ctx, g_out, g_sum, _g_mean, _g_rstd):
    saved = _Saved(*ctx.saved_tensors)
    g_sum = g_sum if ctx.has_residual else None
    if g_out is None:  # only the residual stream was used: the norm contributes nothing
        return g_sum, g_sum, None, None, None, None
    dx, dw, db = _add_layer_norm_backward_op(g_out, g_sum, *saved, ctx.block_size)
    return (
        dx,
        dx if ctx.has_residual else None,
        dw if saved.weight is not None else None,
        db if saved.bias is not None else None,
        None,
        None,
    )


_add_layer_norm_op.register_autograd(_backward, setup_context=_setup_context)


def add_layer_norm(
    x: Tensor,
    residual: Tensor | None,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    *,
    block_size: int | None = None,
) -> tuple[Tensor, Tensor]:
    """``(layer_norm(x + residual) over the last dim, x + residual)`` in one fused kernel.

    ``residual``, ``weight`` and ``bias`` may each be None; without a residual the second output
    is ``x`` itself. The gradient arriving at the second output (the residual stream) is added to
    the norm's input gradient inside the backward kernel; ``x`` and ``residual`` get the same
    gradient. ``block_size`` forces the columns per block (a power of two; tests use it to
    exercise the looped path)."""
    x, residual = norm_rows.promote_residual(x, residual)
    out, s, _mean, _rstd = _add_layer_norm_op(x, residual, weight, bias, float(eps), block_size or 0)
    return out, s if residual is not None else x

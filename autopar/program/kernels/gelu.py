"""Bias + GeLU: ``gelu(x + bias, approximate)`` in one pointwise kernel each way.

The MLP's first linear layer adds its bias and the activation follows; fused, the forward reads
``x`` and ``bias`` once and writes ``y`` (eager: the add reads 2 and writes 1, the GeLU reads 1
and writes 1), and backward reads ``dy``, ``x``, ``bias`` and writes ``dx`` — recomputing
``x + bias`` instead of saving it (Megatron-LM's ``bias_gelu``, arXiv 1909.08053; its fused
kernel also recomputes). The bias gradient is ``Σ_rows dx``, summed by torch over the written
``dx`` (a reduction, not a pointwise op).

Both GeLU forms (``torch.nn.functional.gelu``), with ``z = x + bias``:

* ``"none"`` (erf): ``y = z · Φ(z)``, ``Φ(z) = ½(1 + erf(z/√2))``, ``y' = Φ(z) + z · φ(z)``,
  ``φ(z) = exp(−z²/2)/√(2π)``;
* ``"tanh"`` (GPT-2's ``NewGELUActivation``): ``y = ½ z (1 + tanh(u))`` with
  ``u = √(2/π)(z + 0.044715 z³)``, computed as ``z · σ(2u)`` (the same function:
  ``½(1 + tanh u) = σ(2u)``), ``y' = σ + z σ (1 − σ) · 2√(2/π)(1 + 3 · 0.044715 z²)``.

Ops: ``autopar::bias_gelu`` ``(x, bias?, approximate, block_size) -> y`` and
``autopar::bias_gelu_backward`` ``-> (dx, dbias)`` (``dbias`` empty without a bias).
"""

import math

import torch
from torch import Tensor

from autopar.program.kernels._launch import HAS_TRITON, backend, elementwise_block

if HAS_TRITON:
    import triton
    import triton.language as tl

__all__ = ["bias_gelu", "bias_gelu_reference"]

_APPROXIMATE = ("none", "tanh")


def bias_gelu_reference(x: Tensor, bias: Tensor | None, approximate: str = "none") -> Tensor:
    """The eager composition the fused op replaces: ``add`` then ``gelu``."""
    z = x + bias if bias is not None else x
    return torch.nn.functional.gelu(z, approximate=approximate)


# ------------------------------------------------------------------------------ Triton kernels

if HAS_TRITON:

    @triton.jit
    def _gelu_and_derivative(z, TANH: tl.constexpr):
        if TANH:
            k = 0.7978845608028654  # √(2/π)
            u = k * (z + 0.044715 * z * z * z)
            sig = tl.sigmoid(2.0 * u)
            y = z * sig
            dy = sig + z * sig * (1.0 - sig) * 2.0 * k * (1.0 + 3.0 * 0.044715 * z * z)
        else:
            cdf = 0.5 * (1.0 + tl.erf(z * 0.7071067811865476))
            y = z * cdf
            dy = cdf + z * 0.3989422804014327 * tl.exp(-0.5 * z * z)
        return y, dy

    @triton.jit
    def _biased_input(X, B, offs, mask, n_cols, HAS_BIAS: tl.constexpr):
        """``x + bias`` in fp32, rounded to the input dtype first as the eager ``add`` is."""
        x = tl.load(X + offs, mask=mask, other=0.0)
        if HAS_BIAS:
            b = tl.load(B + offs % n_cols, mask=mask, other=0.0)
            x = (x.to(tl.float32) + b.to(tl.float32)).to(X.dtype.element_ty)
        return x.to(tl.float32)

    @triton.jit
    def _bias_gelu_fwd_kernel(
        X, B, Y, n_elements, n_cols, HAS_BIAS: tl.constexpr, TANH: tl.constexpr, BLOCK: tl.constexpr
    ):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n_elements
        z = _biased_input(X, B, offs, mask, n_cols, HAS_BIAS)
        y, _ = _gelu_and_derivative(z, TANH)
        tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)

    @triton.jit
    def _bias_gelu_bwd_kernel(
        DY, X, B, DX, n_elements, n_cols, HAS_BIAS: tl.constexpr, TANH: tl.constexpr, BLOCK: tl.constexpr
    ):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n_elements
        z = _biased_input(X, B, offs, mask, n_cols, HAS_BIAS)
        _, d = _gelu_and_derivative(z, TANH)
        dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + offs, (dy * d).to(DX.dtype.element_ty), mask=mask)


def _check(approximate: str) -> None:
    if approximate not in _APPROXIMATE:
        raise ValueError(f"bias_gelu: approximate must be 'none' or 'tanh', got {approximate!r}")


def _forward_triton(x: Tensor, bias: Tensor | None, approximate: str, block_size: int) -> Tensor:
    xc = x.contiguous()
    y = torch.empty_like(xc)
    n = xc.numel()
    block = elementwise_block(block_size)
    _bias_gelu_fwd_kernel[(triton.cdiv(n, block),)](
        xc, bias.contiguous() if bias is not None else xc, y, n, x.shape[-1],
        HAS_BIAS=bias is not None, TANH=approximate == "tanh", BLOCK=block,
    )  # fmt: skip
    return y


def _backward_triton(
    g: Tensor, x: Tensor, bias: Tensor | None, approximate: str, block_size: int
) -> tuple[Tensor, Tensor]:
    xc = x.contiguous()
    dx = torch.empty_like(xc)
    n = xc.numel()
    block = elementwise_block(block_size)
    _bias_gelu_bwd_kernel[(triton.cdiv(n, block),)](
        g.contiguous(), xc, bias.contiguous() if bias is not None else xc, dx, n, x.shape[-1],
        HAS_BIAS=bias is not None, TANH=approximate == "tanh", BLOCK=block,
    )  # fmt: skip
    return dx, _bias_grad(dx, bias)


def _bias_grad(dx: Tensor, bias: Tensor | None) -> Tensor:
    if bias is None:
        return dx.new_empty(0)
    return dx.reshape(-1, dx.shape[-1]).sum(0, dtype=torch.float32).to(bias.dtype)


# ------------------------------------------------------------- eager fallback (same arithmetic)


def _forward_eager(x: Tensor, bias: Tensor | None, approximate: str) -> Tensor:
    z = x + bias if bias is not None else x
    return torch.nn.functional.gelu(z, approximate=approximate)


def _backward_eager(g: Tensor, x: Tensor, bias: Tensor | None, approximate: str) -> tuple[Tensor, Tensor]:
    z = (x + bias if bias is not None else x).float()
    if approximate == "tanh":
        k = math.sqrt(2.0 / math.pi)
        sig = torch.sigmoid(2.0 * k * (z + 0.044715 * z**3))
        d = sig + z * sig * (1.0 - sig) * 2.0 * k * (1.0 + 3.0 * 0.044715 * z * z)
    else:
        cdf = 0.5 * (1.0 + torch.erf(z * math.sqrt(0.5)))
        d = cdf + z * torch.exp(-0.5 * z * z) / math.sqrt(2.0 * math.pi)
    dx = (g.float() * d).to(x.dtype)
    return dx, _bias_grad(dx, bias)


# ------------------------------------------------------------------------------ custom ops


@torch.library.custom_op("autopar::bias_gelu", mutates_args=())
def _bias_gelu_op(x: Tensor, bias: Tensor | None, approximate: str = "none", block_size: int = 0) -> Tensor:
    _check(approximate)
    if backend(x) == "triton" and x.numel() > 0:
        return _forward_triton(x, bias, approximate, block_size)
    return _forward_eager(x, bias, approximate).contiguous()


@_bias_gelu_op.register_fake
def _(x, bias, approximate="none", block_size=0):
    return x.new_empty(x.shape)


@torch.library.custom_op("autopar::bias_gelu_backward", mutates_args=())
def _bias_gelu_backward_op(
    grad: Tensor, x: Tensor, bias: Tensor | None, approximate: str = "none", block_size: int = 0
) -> tuple[Tensor, Tensor]:
    """``(dx, dbias)``; ``dbias`` is empty where ``bias`` is None."""
    if backend(x) == "triton" and x.numel() > 0:
        return _backward_triton(grad, x, bias, approximate, block_size)
    return tuple(t.contiguous() for t in _backward_eager(grad, x, bias, approximate))


@_bias_gelu_backward_op.register_fake
def _(grad, x, bias, approximate="none", block_size=0):
    return x.new_empty(x.shape), bias.new_empty(bias.shape) if bias is not None else x.new_empty(0)


def _setup_context(ctx, inputs, output) -> None:
    x, bias, approximate, block_size = inputs
    ctx.save_for_backward(x, bias)
    ctx.approximate = approximate
    ctx.block_size = block_size


def _backward(ctx, g):
    x, bias = ctx.saved_tensors
    dx, db = _bias_gelu_backward_op(g, x, bias, ctx.approximate, ctx.block_size)
    return dx, db if bias is not None else None, None, None


_bias_gelu_op.register_autograd(_backward, setup_context=_setup_context)


def bias_gelu(
    x: Tensor, bias: Tensor | None, approximate: str = "none", *, block_size: int | None = None
) -> Tensor:
    """``gelu(x + bias, approximate)`` in one fused kernel; ``bias`` (broadcast over the last dim)
    may be None; ``approximate`` is ``"none"`` (erf) or ``"tanh"``. ``block_size``: elements per
    program (a power of two)."""
    _check(approximate)
    if bias is not None:
        if bias.dim() > x.dim() or bias.numel() != x.shape[-1] or bias.shape[-1] != x.shape[-1]:
            raise ValueError(
                f"bias_gelu: bias {tuple(bias.shape)} is not one value per column of {tuple(x.shape)}"
            )
        bias = bias.reshape(-1)
    if bias is not None and bias.dtype != x.dtype:
        dtype = torch.result_type(x, bias)
        x, bias = x.to(dtype), bias.to(dtype)
    return _bias_gelu_op(x, bias, approximate, block_size or 0)

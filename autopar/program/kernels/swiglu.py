"""SwiGLU: ``silu(gate) · up`` in one pointwise kernel each way (LLaMA's MLP, Shazeer 2020,
arXiv 2002.05202).

Eager runs ``silu`` (read ``gate``, write ``a``) then ``mul`` (read ``a`` and ``up``, write ``y``)
and saves ``a`` for backward; fused, the forward reads ``gate`` and ``up`` once and writes ``y``,
and backward reads ``dy``, ``gate``, ``up`` and writes ``dgate`` and ``dup``, recomputing ``σ``:

    a = gate · σ(gate),   dup = dy · a,   dgate = dy · up · σ(gate) · (1 + gate · (1 − σ(gate))).

``a`` is rounded to the input dtype before the product, as eager's ``silu`` output is.
Ops: ``autopar::swiglu`` ``(gate, up, block_size) -> y`` and ``autopar::swiglu_backward``
``-> (dgate, dup)``.
"""

import torch
from torch import Tensor

from autopar.program.kernels._launch import HAS_TRITON, backend, elementwise_block

if HAS_TRITON:
    import triton
    import triton.language as tl

__all__ = ["swiglu", "swiglu_reference"]


def swiglu_reference(gate: Tensor, up: Tensor) -> Tensor:
    """The eager composition the fused op replaces."""
    return torch.nn.functional.silu(gate) * up


# ------------------------------------------------------------------------------ Triton kernels

if HAS_TRITON:

    @triton.jit
    def _swiglu_fwd_kernel(G, U, Y, n_elements, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n_elements
        g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
        a = (g * tl.sigmoid(g)).to(G.dtype.element_ty).to(tl.float32)
        tl.store(Y + offs, (a * u).to(Y.dtype.element_ty), mask=mask)

    @triton.jit
    def _swiglu_bwd_kernel(DY, G, U, DG, DU, n_elements, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n_elements
        dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
        sig = tl.sigmoid(g)
        a = (g * sig).to(G.dtype.element_ty).to(tl.float32)
        tl.store(DU + offs, (dy * a).to(DU.dtype.element_ty), mask=mask)
        dg = dy * u * sig * (1.0 + g * (1.0 - sig))
        tl.store(DG + offs, dg.to(DG.dtype.element_ty), mask=mask)


def _forward_triton(gate: Tensor, up: Tensor, block_size: int) -> Tensor:
    g, u = gate.contiguous(), up.contiguous()
    y = torch.empty(g.shape, dtype=torch.result_type(gate, up), device=g.device)
    n = g.numel()
    block = elementwise_block(block_size)
    _swiglu_fwd_kernel[(triton.cdiv(n, block),)](g, u, y, n, BLOCK=block)
    return y


def _backward_triton(dy: Tensor, gate: Tensor, up: Tensor, block_size: int) -> tuple[Tensor, Tensor]:
    g, u = gate.contiguous(), up.contiguous()
    dg, du = torch.empty_like(g), torch.empty_like(u)
    n = g.numel()
    block = elementwise_block(block_size)
    _swiglu_bwd_kernel[(triton.cdiv(n, block),)](dy.contiguous(), g, u, dg, du, n, BLOCK=block)
    return dg, du


# ------------------------------------------------------------- eager fallback (same arithmetic)


def _forward_eager(gate: Tensor, up: Tensor) -> Tensor:
    return torch.nn.functional.silu(gate) * up


def _backward_eager(dy: Tensor, gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
    g, dyf = gate.float(), dy.float()
    sig = torch.sigmoid(g)
    a = (g * sig).to(gate.dtype).float()
    du = (dyf * a).to(up.dtype)
    dg = (dyf * up.float() * sig * (1.0 + g * (1.0 - sig))).to(gate.dtype)
    return dg, du


# ------------------------------------------------------------------------------ custom ops


@torch.library.custom_op("autopar::swiglu", mutates_args=())
def _swiglu_op(gate: Tensor, up: Tensor, block_size: int = 0) -> Tensor:
    if backend(gate) == "triton" and gate.numel() > 0:
        return _forward_triton(gate, up, block_size)
    return _forward_eager(gate, up).contiguous()


@_swiglu_op.register_fake
def _(gate, up, block_size=0):
    return gate.new_empty(gate.shape, dtype=torch.result_type(gate, up))


@torch.library.custom_op("autopar::swiglu_backward", mutates_args=())
def _swiglu_backward_op(grad: Tensor, gate: Tensor, up: Tensor, block_size: int = 0) -> tuple[Tensor, Tensor]:
    if backend(gate) == "triton" and gate.numel() > 0:
        return _backward_triton(grad, gate, up, block_size)
    return tuple(t.contiguous() for t in _backward_eager(grad, gate, up))


@_swiglu_backward_op.register_fake
def _(grad, gate, up, block_size=0):
    return gate.new_empty(gate.shape), up.new_empty(up.shape)


def _setup_context(ctx, inputs, output) -> None:
    gate, up, block_size = inputs
    ctx.save_for_backward(gate, up)
    ctx.block_size = block_size


def _backward(ctx, g):
    gate, up = ctx.saved_tensors
    dg, du = _swiglu_backward_op(g, gate, up, ctx.block_size)
    return dg, du, None


_swiglu_op.register_autograd(_backward, setup_context=_setup_context)


def swiglu(gate: Tensor, up: Tensor, *, block_size: int | None = None) -> Tensor:
    """``silu(gate) * up`` in one fused kernel. Inputs of different shapes are broadcast (and
    their gradients summed back) outside the kernel; of different dtypes, promoted first.
    ``block_size``: elements per program (a power of two)."""
    if gate.shape != up.shape:
        gate, up = torch.broadcast_tensors(gate, up)
    if gate.dtype != up.dtype:
        dtype = torch.result_type(gate, up)
        gate, up = gate.to(dtype), up.to(dtype)
    return _swiglu_op(gate, up, block_size or 0)

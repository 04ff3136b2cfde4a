"""What the two residual-norm families (``layer_norm``, ``rms_norm``) share, kernel and host side.

Both read ``s = x + residual`` one row per forward program, store ``s`` as the **residual
stream** (the second output, skipped without a residual) and normalise it; both walk chunks of
consecutive rows per backward program, form ``g = w · dout`` per block, add the residual
stream's gradient ``ds`` into ``dx`` and keep fp32 **partial rows** of the weight (and bias)
gradients, one row of a ``[programs, n]`` buffer per program, which torch sums afterwards
(``_launch.row_chunks``). The helpers here are that scaffolding; each family keeps its own
arithmetic (centring for LayerNorm, the dtype round trip for RMSNorm).

Triton helpers are ``@triton.jit`` functions, inlined into the kernels that call them; host
helpers build the ``rows × n`` views and buffers the kernels take (``_launch.rows_of``).
"""

import torch
from torch import Tensor

from autopar.program.kernels._launch import (
    HAS_TRITON,
    ROW_MAX_BLOCK_BACKWARD,
    num_warps,
    num_warps_backward,
    row_block,
    row_chunks,
    rows_of,
)

if HAS_TRITON:
    import triton
    import triton.language as tl

__all__ = [
    "backward_rows",
    "forward_rows",
    "launch_block",
    "partial_rows",
    "promote_residual",
    "stream_output",
    "summed_partials",
]

if HAS_TRITON:

    @triton.jit
    def load_f32(P, c, mask):
        """One block ``P[c]`` as fp32, zero where masked."""
        return tl.load(P + c, mask=mask, other=0.0).to(tl.float32)

    @triton.jit
    def residual_sum(X, R, c, mask, HAS_RESIDUAL: tl.constexpr):
        """``x + residual`` of one block of a row (the norms' input), rounded to the input dtype
        as the eager ``add`` rounds it."""
        x = tl.load(X + c, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(R + c, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)
        return x

    @triton.jit
    def residual_stream(X, R, S, c, mask, HAS_RESIDUAL: tl.constexpr):
        """``residual_sum`` of one block, also stored to the residual stream ``S`` when there is a
        residual (without one the stream is ``x`` itself and nothing is written)."""
        s = residual_sum(X, R, c, mask, HAS_RESIDUAL)
        if HAS_RESIDUAL:
            tl.store(S + c, s, mask=mask)
        return s

    @triton.jit
    def forward_row(X, R, Y, S, n_cols, BLOCK: tl.constexpr):
        """This forward program's row, the pointers to its start in ``x``, ``residual``, ``out``
        and the residual stream, and the column offsets of one block."""
        row = tl.program_id(0).to(tl.int64)
        start = row * n_cols
        return row, X + start, R + start, Y + start, S + start, tl.arange(0, BLOCK)

    @triton.jit
    def backward_chunk(n_rows, rows_per_program, BLOCK: tl.constexpr):
        """``(program, first row, end row, columns of one block)`` of the consecutive rows this
        backward program walks."""
        pid = tl.program_id(0).to(tl.int64)
        row_start = pid * rows_per_program
        return pid, row_start, tl.minimum(row_start + rows_per_program, n_rows), tl.arange(0, BLOCK)

    @triton.jit
    def block_at(start, cols, n_cols):
        """``(columns, mask)`` of the block of a looped row walk that begins at ``start``."""
        c = start + cols
        return c, c < n_cols

    @triton.jit
    def weighted(v, W, c, mask, HAS_WEIGHT: tl.constexpr):
        """``w · v`` of one block (``v`` itself without a weight)."""
        if HAS_WEIGHT:
            v = v * load_f32(W, c, mask)
        return v

    @triton.jit
    def store_dx(DX, DS, c, mask, dx, HAS_DS: tl.constexpr):
        """Store one block of ``dx`` (fp32) in ``DX``'s dtype, the residual stream's gradient
        ``ds`` added first where there is one."""
        if HAS_DS:
            dx += load_f32(DS, c, mask)
        tl.store(DX + c, dx.to(DX.dtype.element_ty), mask=mask)

    @triton.jit
    def store_partial(P, c, mask, v, HAS_PARAM: tl.constexpr):
        """Write one block of this program's partial row (registers → memory), if the parameter
        exists."""
        if HAS_PARAM:
            tl.store(P + c, v, mask=mask)

    @triton.jit
    def add_partial(P, c, mask, v, HAS_PARAM: tl.constexpr):
        """Add ``v`` into one block of this program's partial row in memory (the looped path;
        no other program writes that row), if the parameter exists."""
        if HAS_PARAM:
            tl.store(P + c, tl.load(P + c, mask=mask, other=0.0) + v, mask=mask)


def launch_block(n: int, forced: int, backward: bool) -> tuple[int, bool, int]:
    """``(block, one_block, num_warps)`` of a norm's row program over ``n`` columns (``forced``:
    the public ``block_size``, see ``_launch.row_block``); backward programs hold more live values,
    so their block is capped lower and they take more warps."""
    if backward:
        block, one = row_block(n, forced, cap=ROW_MAX_BLOCK_BACKWARD)
        return block, one, num_warps_backward(block)
    block, one = row_block(n, forced)
    return block, one, num_warps(block)


def promote_residual(x: Tensor, residual: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """``x`` and ``residual`` in one dtype (their promoted type), as the eager ``add`` computes."""
    if residual is not None and residual.dtype != x.dtype:
        dtype = torch.result_type(x, residual)
        x, residual = x.to(dtype), residual.to(dtype)
    return x, residual


def stream_output(s: Tensor, x: Tensor, residual: Tensor | None) -> Tensor:
    """The residual-stream output of a forward op: ``s`` in ``x``'s shape, or the empty tensor
    that stands for "``x`` itself" without a residual."""
    return s.view(x.shape) if residual is not None else s


def forward_rows(x: Tensor, residual: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(x2, r2, s, s_arg)`` of a norm's forward launch: ``x`` and ``residual`` as ``rows × n``
    (``x2`` again where there is no residual), the residual-stream output (empty without a
    residual, see ``stream_output``) and the pointer the kernel gets for it (``x2``, never
    written, where that output is empty)."""
    x2 = rows_of(x)
    if residual is None:
        return x2, x2, x2.new_empty(0), x2
    s = torch.empty_like(x2)
    return x2, rows_of(residual), s, s


def backward_rows(
    g: Tensor, g_sum: Tensor | None, s: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor, int, int]:
    """``(s2, g2, ds2, dx2, programs, rows_per_program)`` of a norm's backward launch: the saved
    stream, the output gradient and the residual stream's gradient (``g2`` where there is none) as
    ``rows × n``, the ``dx`` buffer, and the chunking of ``_launch.row_chunks``."""
    s2 = rows_of(s)
    g2 = rows_of(g)
    ds = rows_of(g_sum) if g_sum is not None else g2
    programs, per = row_chunks(s2.shape[0], s.device)
    return s2, g2, ds, torch.empty_like(s2), programs, per


def partial_rows(programs: int, n: int, param: Tensor | None, placeholder: Tensor) -> Tensor:
    """The zeroed fp32 ``[programs, n]`` partial-row buffer of ``param``'s gradient, or
    ``placeholder`` (never written) where there is no such parameter."""
    if param is None:
        return placeholder
    return torch.zeros(programs, n, dtype=torch.float32, device=placeholder.device)


def summed_partials(rows: Tensor, param: Tensor | None, like: Tensor) -> Tensor:
    """``param``'s gradient: ``rows`` (``[*, n]``, fp32) summed over its rows in ``param``'s
    dtype; the empty tensor that stands for "none" (on ``like``) where there is no parameter."""
    if param is None:
        return like.new_empty(0)
    return rows.reshape(-1, rows.shape[-1]).sum(0).to(param.dtype)

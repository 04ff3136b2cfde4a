"""Softmax cross-entropy that never materialises the probabilities, and its vocabulary-parallel
form (the classes split over tensor-parallel ranks).

**Forward.** One program per row walks the classes in blocks keeping a running maximum ``m`` and
sum ``l = Σ exp(x − m)`` (the online softmax of Milakov & Gimelshein 2018, arXiv 1805.02867; one
read of the row), and reads the target's logit ``x_t``. Then ``lse = m + log l`` and the loss is
``lse − x_t`` (0 on ``ignore_index`` rows). **Backward** walks the row again:
``dx = dloss · (exp(x − lse) − onehot(t))``, zero on ignored rows.

**Memory.** With ``N`` rows, ``V`` classes and ``b`` bytes per logit (above the logits themselves):

* eager ``F.cross_entropy`` = ``log_softmax`` + ``nll_loss``: the forward allocates the log-
  probabilities, ``N·V·b``, saved for backward; the backward allocates ``nll_loss``'s dense
  gradient (``N·V·b``) and ``log_softmax``'s input gradient (``N·V·b``) while the saved
  log-probabilities are alive: a peak of ``3·N·V·b``;
* fused: the forward allocates ``8N`` bytes (loss and ``lse`` in fp32) and saves the logits (a
  reference to a tensor that exists anyway, no copy) and ``lse``; the backward allocates the
  gradient, ``N·V·b``: a peak of ``N·V·b + 8N``.

At 8192 tokens × 128256 classes in bf16, ``N·V·b`` = 2.1 GB: 6.3 GB eager against 2.1 GB fused.
(Liger-Kernel goes further by writing the gradient into the logits' storage during the forward;
a ``torch.library`` op that mutates nothing cannot.)

**Vocabulary-parallel.** Each rank holds the columns ``[class_start, class_start + V_local)``.
``vocab_parallel_cross_entropy`` computes the same per-row losses as ``_VocabParallelCE`` in
``autopar.program.local_ops`` (Megatron-LM's vocabulary-parallel cross-entropy, arXiv 1909.08053 §3),
in three steps whose all-reduces stay outside the kernels (``reduce_values``, so a traced step
shows them as collective nodes the overlap passes can move):

1. ``autopar::vocab_parallel_cross_entropy_stats`` (one read of the local logits): the local
   ``m_r``, ``l_r = Σ exp(x − m_r)`` and the target logit where this rank owns the target (0
   elsewhere);
2. all-reduce (max) of ``m`` → ``M``; all-reduce (sum) of ``[l_r · exp(m_r − M), x_t]`` — the
   same two all-reduces per axis as ``_VocabParallelCE``;
3. ``autopar::vocab_parallel_cross_entropy``: ``loss = M + log L − x_t`` per row (differentiable;
   its backward, ``autopar::vocab_parallel_cross_entropy_backward``, is the fused backward above
   on the local columns and needs no communication).

Ops: ``autopar::cross_entropy`` ``(logits, target, ignore_index, block_size) -> (loss, lse)`` (per
row, fp32) and ``autopar::cross_entropy_backward``; the three vocabulary-parallel ops above.
"""

from collections.abc import Sequence

import torch
from torch import Tensor

from autopar.program.collectives import AxisGroup, reduce_values
from autopar.program.kernels._launch import CROSS_ENTROPY_MAX_BLOCK, HAS_TRITON, backend, num_warps, row_block

if HAS_TRITON:
    import triton
    import triton.language as tl

__all__ = ["cross_entropy", "cross_entropy_reference", "vocab_parallel_cross_entropy"]

_REDUCTIONS = ("mean", "sum", "none")


def cross_entropy_reference(
    logits: Tensor, target: Tensor, ignore_index: int = -100, reduction: str = "mean"
) -> Tensor:
    """The eager op the fused one replaces."""
    return torch.nn.functional.cross_entropy(logits, target, ignore_index=ignore_index, reduction=reduction)


# ------------------------------------------------------------------------------ Triton kernels

if HAS_TRITON:

    @triton.jit
    def _ce_fwd_kernel(
        X, T, OUT0, OUT1, OUT2,
        n_cols, class_start, ignore_index,
        LOCAL: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        """``LOCAL``: write (max, Σ exp(x − max), target logit or 0); else (loss, lse)."""
        row = tl.program_id(0).to(tl.int64)
        X += row * n_cols
        cols = tl.arange(0, BLOCK)
        m = float("-inf")
        d = 0.0
        for start in range(0, n_cols, BLOCK):
            c = start + cols
            x = tl.load(X + c, mask=c < n_cols, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(x, axis=0))
            # Guards for blocks (or rows) of −inf logits: exp(−inf − (−inf)) would be NaN.
            alpha = tl.where(m_new == float("-inf"), 1.0, tl.exp(m - m_new))
            e = tl.where(x == float("-inf"), 0.0, tl.exp(x - m_new))
            d = d * alpha + tl.sum(e, axis=0)
            m = m_new
        t = tl.load(T + row)
        local = t - class_start
        owned = (local >= 0) & (local < n_cols)
        picked = tl.load(X + tl.where(owned, local, 0)).to(tl.float32)
        picked = tl.where(owned, picked, 0.0)
        if LOCAL:
            tl.store(OUT0 + row, m)
            tl.store(OUT1 + row, d)
            tl.store(OUT2 + row, picked)
        else:
            lse = m + tl.log(d)
            tl.store(OUT0 + row, tl.where(t != ignore_index, lse - picked, 0.0))
            tl.store(OUT1 + row, lse)

    @triton.jit
    def _ce_bwd_kernel(
        DLOSS, X, T, LSE, DX,
        n_cols, class_start, ignore_index,
        BLOCK: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        X += row * n_cols
        DX += row * n_cols
        t = tl.load(T + row)
        g = tl.load(DLOSS + row).to(tl.float32)
        g = tl.where(t != ignore_index, g, 0.0)
        lse = tl.load(LSE + row)
        local = t - class_start
        cols = tl.arange(0, BLOCK)
        for start in range(0, n_cols, BLOCK):
            c = start + cols
            mask = c < n_cols
            x = tl.load(X + c, mask=mask, other=0.0).to(tl.float32)
            grad = g * (tl.exp(x - lse) - tl.where(c == local, 1.0, 0.0))
            tl.store(DX + c, grad.to(DX.dtype.element_ty), mask=mask)


def _ce_block(n_cols: int, block_size: int) -> int:
    return row_block(n_cols, block_size, cap=CROSS_ENTROPY_MAX_BLOCK)[0]


def _stats_triton(
    logits: Tensor, target: Tensor, class_start: int, ignore_index: int, local: bool, block_size: int
) -> tuple[Tensor, ...]:
    x = logits.contiguous()
    t = target.contiguous()
    rows, n = x.shape
    outs = [torch.empty(rows, dtype=torch.float32, device=x.device) for _ in range(3 if local else 2)]
    block = _ce_block(n, block_size)
    _ce_fwd_kernel[(rows,)](
        x, t, outs[0], outs[1], outs[2] if local else outs[1], n, class_start, ignore_index,
        LOCAL=local, BLOCK=block, num_warps=num_warps(block),
    )  # fmt: skip
    return tuple(outs)


def _backward_triton(
    grad: Tensor,
    logits: Tensor,
    target: Tensor,
    lse: Tensor,
    class_start: int,
    ignore_index: int,
    block_size: int,
) -> Tensor:
    x = logits.contiguous()
    rows, n = x.shape
    dx = torch.empty_like(x)
    block = _ce_block(n, block_size)
    _ce_bwd_kernel[(rows,)](
        grad.contiguous(), x, target.contiguous(), lse.contiguous(), dx, n, class_start, ignore_index,
        BLOCK=block, num_warps=num_warps(block),
    )  # fmt: skip
    return dx


# ------------------------------------------------------------- eager fallback (same arithmetic)


def _stats_eager(logits: Tensor, target: Tensor, class_start: int) -> tuple[Tensor, Tensor, Tensor]:
    x = logits.float()
    m = x.max(dim=-1).values
    d = torch.exp(x - m.unsqueeze(-1)).sum(-1)
    local = target - class_start
    owned = (local >= 0) & (local < x.shape[-1])
    picked = x.gather(-1, local.clamp(0, x.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
    return m, d, torch.where(owned, picked, 0.0)


def _backward_eager(
    grad: Tensor, logits: Tensor, target: Tensor, lse: Tensor, class_start: int, ignore_index: int
) -> Tensor:
    g = torch.where(target != ignore_index, grad.float(), 0.0).unsqueeze(-1)
    local = (target - class_start).unsqueeze(-1)
    cols = torch.arange(logits.shape[-1], device=logits.device)
    onehot = (cols == local).float()
    return (g * (torch.exp(logits.float() - lse.unsqueeze(-1)) - onehot)).to(logits.dtype)


def _loss_from_stats(lse: Tensor, picked: Tensor, target: Tensor, ignore_index: int) -> Tensor:
    return torch.where(target != ignore_index, lse - picked, 0.0)


# ---------------------------------------------------------------------- custom ops: one device


@torch.library.custom_op("autopar::cross_entropy", mutates_args=())
def _cross_entropy_op(
    logits: Tensor, target: Tensor, ignore_index: int = -100, block_size: int = 0
) -> tuple[Tensor, Tensor]:
    """``(loss, lse)`` per row in fp32 (loss 0 on ignored rows)."""
    if backend(logits) == "triton" and logits.numel() > 0:
        loss, lse = _stats_triton(logits, target, 0, ignore_index, False, block_size)
        return loss, lse
    m, d, picked = _stats_eager(logits, target, 0)
    lse = m + d.log()
    return _loss_from_stats(lse, picked, target, ignore_index), lse


@_cross_entropy_op.register_fake
def _(logits, target, ignore_index=-100, block_size=0):
    row = logits.new_empty(logits.shape[:-1], dtype=torch.float32)
    return row, torch.empty_like(row)


@torch.library.custom_op("autopar::cross_entropy_backward", mutates_args=())
def _cross_entropy_backward_op(
    grad: Tensor, logits: Tensor, target: Tensor, lse: Tensor, ignore_index: int = -100, block_size: int = 0
) -> Tensor:
    if backend(logits) == "triton" and logits.numel() > 0:
        return _backward_triton(grad, logits, target, lse, 0, ignore_index, block_size)
    return _backward_eager(grad, logits, target, lse, 0, ignore_index)


@_cross_entropy_backward_op.register_fake
def _(grad, logits, target, lse, ignore_index=-100, block_size=0):
    return logits.new_empty(logits.shape)


def _ce_setup_context(ctx, inputs, output) -> None:
    logits, target, ignore_index, block_size = inputs
    _loss, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(logits, target, lse)
    ctx.args = (ignore_index, block_size)


def _ce_backward(ctx, g_loss, _g_lse):
    logits, target, lse = ctx.saved_tensors
    return _cross_entropy_backward_op(g_loss, logits, target, lse, *ctx.args), None, None, None


_cross_entropy_op.register_autograd(_ce_backward, setup_context=_ce_setup_context)


def cross_entropy(
    logits: Tensor,
    target: Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
    *,
    block_size: int | None = None,
) -> Tensor:
    """``F.cross_entropy(logits, target, ignore_index=..., reduction=...)`` for 2-D ``logits``
    ``[N, V]`` and 1-D class indices ``target``, without materialising the probabilities (see the
    module docstring for the memory arithmetic). ``reduction``: ``"mean"`` (over the rows that are
    not ``ignore_index``), ``"sum"`` or ``"none"``. ``block_size``: classes per block (a power of
    two)."""
    if logits.dim() != 2 or target.dim() != 1 or target.shape[0] != logits.shape[0]:
        raise ValueError(
            f"cross_entropy: logits must be [N, V] and target [N], got {tuple(logits.shape)} and {tuple(target.shape)}"
        )
    if reduction not in _REDUCTIONS:
        raise ValueError(f"cross_entropy: reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    loss, _lse = _cross_entropy_op(logits, target, ignore_index, block_size or 0)
    if reduction == "none":
        return loss.to(logits.dtype)
    total = loss.sum()
    if reduction == "sum":
        return total.to(logits.dtype)
    return (total / (target != ignore_index).sum()).to(logits.dtype)


# ------------------------------------------------------------ custom ops: vocabulary-parallel


@torch.library.custom_op("autopar::vocab_parallel_cross_entropy_stats", mutates_args=())
def _vp_stats_op(
    logits: Tensor, target: Tensor, class_start: int, block_size: int = 0
) -> tuple[Tensor, Tensor, Tensor]:
    """Per row, over this rank's classes: ``(max, Σ exp(x − max), target logit or 0)``, fp32."""
    if backend(logits) == "triton" and logits.numel() > 0:
        m, d, picked = _stats_triton(logits, target, class_start, 0, True, block_size)
        return m, d, picked
    return _stats_eager(logits, target, class_start)


@_vp_stats_op.register_fake
def _(logits, target, class_start, block_size=0):
    row = logits.new_empty(logits.shape[:-1], dtype=torch.float32)
    return row, torch.empty_like(row), torch.empty_like(row)


@torch.library.custom_op("autopar::vocab_parallel_cross_entropy", mutates_args=())
def _vp_loss_op(
    logits: Tensor,
    target: Tensor,
    lse: Tensor,
    picked: Tensor,
    class_start: int,
    ignore_index: int = -100,
    block_size: int = 0,
) -> Tensor:
    """Per-row loss from the global statistics (``logits`` is read by the backward only)."""
    return _loss_from_stats(lse, picked, target, ignore_index)


@_vp_loss_op.register_fake
def _(logits, target, lse, picked, class_start, ignore_index=-100, block_size=0):
    return torch.empty_like(lse)


@torch.library.custom_op("autopar::vocab_parallel_cross_entropy_backward", mutates_args=())
def _vp_backward_op(
    grad: Tensor,
    logits: Tensor,
    target: Tensor,
    lse: Tensor,
    class_start: int,
    ignore_index: int = -100,
    block_size: int = 0,
) -> Tensor:
    if backend(logits) == "triton" and logits.numel() > 0:
        return _backward_triton(grad, logits, target, lse, class_start, ignore_index, block_size)
    return _backward_eager(grad, logits, target, lse, class_start, ignore_index)


@_vp_backward_op.register_fake
def _(grad, logits, target, lse, class_start, ignore_index=-100, block_size=0):
    return logits.new_empty(logits.shape)


def _vp_setup_context(ctx, inputs, output) -> None:
    logits, target, lse, _picked, class_start, ignore_index, block_size = inputs
    ctx.save_for_backward(logits, target, lse)
    ctx.args = (class_start, ignore_index, block_size)


def _vp_backward(ctx, g):
    logits, target, lse = ctx.saved_tensors
    return _vp_backward_op(g, logits, target, lse, *ctx.args), None, None, None, None, None, None


_vp_loss_op.register_autograd(_vp_backward, setup_context=_vp_setup_context)


def vocab_parallel_cross_entropy(
    logits: Tensor,
    target: Tensor,
    class_start: int,
    axes: Sequence[AxisGroup],
    ignore_index: int = -100,
    *,
    block_size: int | None = None,
) -> Tensor:
    """Per-row cross-entropy (no reduction, fp32) with the classes split over ``axes``: this rank
    holds the columns ``[class_start, class_start + logits.shape[-1])`` of the full logits.

    The semantics of ``autopar.program.local_ops._VocabParallelCE`` (which ``sharded_cross_entropy``
    calls): ignored rows give 0, the gradient reaches the local logits only, and backward needs
    no communication. Forward issues one max and one sum all-reduce per axis, outside the
    kernels (module docstring). With no axes it is the single-device per-row loss."""
    shape = target.shape
    x = logits.reshape(-1, logits.shape[-1])
    t = target.reshape(-1)
    block = block_size or 0
    with torch.no_grad():
        local_max, sum_exp, picked = _vp_stats_op(x, t, int(class_start), block)
        gmax = local_max
        for ax in axes:
            gmax = reduce_values(gmax, ax, "fwd", op="max")
        # A shard whose logits are all −inf contributes nothing (its Σ is NaN, its max −inf).
        scaled = torch.where(local_max == float("-inf"), 0.0, sum_exp * torch.exp(local_max - gmax))
        both = torch.stack([scaled, picked])
        for ax in axes:
            both = reduce_values(both, ax, "fwd")
        lse = gmax + both[0].log()
        picked = both[1]
    loss = _vp_loss_op(x, t, lse, picked, int(class_start), ignore_index, block)
    return loss.view(shape)

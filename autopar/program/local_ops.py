"""Local ops that differ from the global op because an input is sharded (lowering rewrites).

* ``vocab_parallel_embedding`` — the table is split by rows (vocabulary); each device looks up
  the tokens it owns and zeros the rest, so the output is ``Partial`` (Megatron-LM, arXiv
  1909.08053 §3, "parallel input embedding").
* ``sharded_cross_entropy`` — cross-entropy with rows (tokens) and/or classes (vocabulary) split.
  Rows: each device sums its tokens' losses and divides by the *global* count of counted tokens
  (an all-reduce of counts), so the output is ``Partial`` along those axes. Classes: the
  log-sum-exp and the target logit are assembled with three all-reduces (max, sum of exp, target),
  and the backward needs no communication (Megatron-LM's vocabulary-parallel cross-entropy).
* ``mean_partial`` — a mean over a sharded dimension: the local mean divided by the shard count.
* ``causal_query_attention`` — causal attention of this device's query rows against the whole
  keys and values (context parallelism's all-gather form, Megatron-Core's
  ``cp_comm_type="all_gather"``): query row ``i`` at global position ``pos[i]`` sees keys
  ``0..pos[i]``; each run of the device's rows is one causal kernel over the keys up to it.
* ``sync_batch_norm`` — training batch norm with the batch (or a spatial dimension) split: each
  device's per-channel count, mean and sum of squared deviations (M2) are all-gathered and merged
  (Chan et al.'s pairwise update, as ``torch.nn.SyncBatchNorm`` merges them), so every device
  normalizes with the whole batch's statistics; the gather's backward is a reduce-scatter, the
  statistics' gradient being partial (each device normalizes only its own rows). Or, where the
  devices span nodes, two all-reduces: the sums, then the squared deviations from the global mean.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from autopar.program.collectives import AxisGroup, all_gather, all_reduce, grad_sync, reduce_values

__all__ = [
    "causal_query_attention",
    "mean_partial",
    "sharded_cross_entropy",
    "sharded_nll_loss",
    "sync_batch_norm",
    "vocab_parallel_embedding",
]


def vocab_parallel_embedding(
    weight: torch.Tensor, ids: torch.Tensor, start: int, padding_idx: int = -1
) -> torch.Tensor:
    """Rows ``[start, start + weight.shape[0])`` of the table live here; other ids give zeros.

    ``padding_idx`` is the global row that receives no gradient (``aten.embedding``'s argument,
    -1 for none), as in ``nn.Embedding(..., padding_idx=...)``."""
    rows = weight.shape[0]
    local = ids - start
    mask = (local < 0) | (local >= rows)
    pad = padding_idx - start if padding_idx >= 0 and start <= padding_idx < start + rows else None
    out = torch.nn.functional.embedding(local.masked_fill(mask, 0), weight, padding_idx=pad)
    return out.masked_fill(mask.unsqueeze(-1), 0.0)


def mean_partial(x: torch.Tensor, dims: Sequence[int] | None, keepdim: bool, shards: int) -> torch.Tensor:
    """Local mean over ``dims`` divided by the number of shards of the reduced dims."""
    if dims is None or len(dims) == 0:
        return x.mean() / shards
    return x.mean(dim=list(dims), keepdim=keepdim) / shards


def causal_query_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pieces: Sequence[tuple[int, int]],
    dropout_p: float = 0.0,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """``scaled_dot_product_attention(q, k, v, is_causal=True)`` restricted to the query rows this
    device holds: ``pieces`` are their global ``(start, stop)`` ranges, concatenated in order
    (``autopar.placement.shard_slices``); ``k`` and ``v`` are whole. Each run of adjacent pieces
    attends to the keys up to its last position under a causal mask aligned to the bottom right
    (``torch.nn.attention.bias.causal_lower_right``), so the kernel skips the masked pairs as a
    causal kernel does (``autopar.cost.compute.causal_share``)."""
    from torch._subclasses.fake_tensor import is_fake
    from torch.nn.attention.bias import causal_lower_right

    if is_fake(q) or torch.compiler.is_compiling():  # no tensor subclass there: the same values, masked
        return _masked_query_attention(q, k, v, pieces, dropout_p, scale, enable_gqa)
    runs: list[list[int]] = []
    for lo, hi in pieces:
        if hi <= lo:
            continue
        if runs and runs[-1][1] == lo:
            runs[-1][1] = hi
        else:
            runs.append([lo, hi])
    outs, at = [], 0
    for lo, hi in runs:
        rows = hi - lo
        outs.append(
            torch.nn.functional.scaled_dot_product_attention(
                q[..., at : at + rows, :],
                k[..., :hi, :],
                v[..., :hi, :],
                attn_mask=causal_lower_right(rows, hi),
                dropout_p=dropout_p,
                scale=scale,
                enable_gqa=enable_gqa,
            )
        )
        at += rows
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-2)


def _masked_query_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pieces: Sequence[tuple[int, int]],
    dropout_p: float,
    scale: float | None,
    enable_gqa: bool,
) -> torch.Tensor:
    """``causal_query_attention`` with one explicit mask over the keys up to the last row (the
    kernel reads it, nothing skipped): where a tensor subclass cannot be made (fake tensors, a
    traced program)."""
    pos = torch.cat([torch.arange(lo, hi, device=q.device) for lo, hi in pieces])
    keys = max(hi for _, hi in pieces)
    mask = torch.arange(keys, device=q.device).unsqueeze(0) <= pos.unsqueeze(1)
    return torch.nn.functional.scaled_dot_product_attention(
        q,
        k[..., :keys, :],
        v[..., :keys, :],
        attn_mask=mask,
        dropout_p=dropout_p,
        scale=scale,
        enable_gqa=enable_gqa,
    )


class _VocabParallelCE(torch.autograd.Function):
    """Per-row cross-entropy with the classes split over ``axes`` (no reduction over rows)."""

    @staticmethod
    def forward(ctx, logits, target, start, axes, ignore_index):  # type: ignore[override]
        x = logits.float()
        local_max = x.max(dim=-1).values
        gmax = local_max
        for ax in axes:
            gmax = reduce_values(gmax, ax, "fwd", op="max")
        shifted = x - gmax.unsqueeze(-1)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        n_cls = x.shape[-1]
        local_t = target - start
        owned = (local_t >= 0) & (local_t < n_cls)
        idx = local_t.clamp(0, n_cls - 1)
        picked = shifted.gather(-1, idx.unsqueeze(-1)).squeeze(-1) * owned
        both = torch.stack([sum_exp, picked])
        for ax in axes:
            both = reduce_values(both, ax, "fwd")
        sum_exp, picked = both[0], both[1]
        loss = sum_exp.log() - picked
        valid = target != ignore_index
        loss = loss * valid
        softmax = exp / sum_exp.unsqueeze(-1)
        ctx.save_for_backward(softmax, idx, owned & valid, valid)
        ctx.dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        softmax, idx, owned, valid = ctx.saved_tensors
        grad = softmax * (g * valid).unsqueeze(-1)
        onehot = torch.zeros_like(grad).scatter_(-1, idx.unsqueeze(-1), 1.0) * owned.unsqueeze(-1)
        grad = grad - onehot * g.unsqueeze(-1)
        return grad.to(ctx.dtype), None, None, None, None


def sharded_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: int = 1,
    class_start: int = 0,
    class_axes: Sequence[AxisGroup] = (),
    row_axes: Sequence[AxisGroup] = (),
    fused: bool = False,
    row_copies: int = 1,
) -> torch.Tensor:
    """``aten.cross_entropy_loss`` on local shards (``reduction``: 1 mean, 2 sum; see module doc).
    ``fused``: the fused kernels of ``autopar.program.kernels`` compute the loss (set by the
    fusion pass, ``autopar.passes.fusion``), vocabulary-parallel when the classes are split."""
    if fused:
        from autopar.program import kernels as K

        if class_axes:
            per_row = K.vocab_parallel_cross_entropy(
                logits, target, class_start, tuple(class_axes), ignore_index
            )
            total = per_row.sum().to(logits.dtype)
        else:
            total = K.cross_entropy(logits, target, ignore_index=ignore_index, reduction="sum")
    elif class_axes:
        per_row = _VocabParallelCE.apply(logits, target, class_start, tuple(class_axes), ignore_index)
        total = per_row.sum().to(logits.dtype)
    else:
        total = torch.nn.functional.cross_entropy(logits, target, ignore_index=ignore_index, reduction="sum")
    return _reduce_rows(total, target, ignore_index, reduction, row_axes, row_copies)


def _reduce_rows(
    total: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int,
    reduction: int,
    row_axes: Sequence[AxisGroup],
    row_copies: int = 1,
) -> torch.Tensor:
    """``reduction`` 2 (sum): this device's sum, Partial along ``row_axes``. 1 (mean): divided by
    the number of counted rows over all of them (an all-reduce of the counts, no gradient), times
    ``row_copies``: the rows are split ``row_copies`` ways more, over ranks that run unequal
    numbers of micro-batches (``PipelinePlan.dp_shares``), whose counts are taken as this rank's
    (exact where every micro-batch counts the same rows; else each micro-batch's mean counts
    equally, as under DDP with gradient accumulation)."""
    if reduction == 2:
        return total
    count = (target != ignore_index).sum().to(torch.float32)
    for ax in row_axes:
        count = reduce_values(count, ax, "fwd")
    return total / (count * row_copies).to(total.dtype)


def sharded_nll_loss(
    log_probs: torch.Tensor,
    target: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: int = 1,
    row_axes: Sequence[AxisGroup] = (),
    row_copies: int = 1,
) -> torch.Tensor:
    """``aten.nll_loss`` with rows split (the lowering refuses one with classes split)."""
    total = torch.nn.functional.nll_loss(log_probs, target, ignore_index=ignore_index, reduction="sum")
    return _reduce_rows(total, target, ignore_index, reduction, row_axes, row_copies)


def sync_batch_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    momentum: float,
    eps: float,
    axes: Sequence[AxisGroup],
    form: str = "batch_norm",
    reduce: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """A training batch norm whose rows are split along ``axes`` (see the module docstring).

    ``form`` is the aten op replaced, which fixes what is returned and whether the running
    statistics are written in place: ``batch_norm`` (the output; in place), ``native_batch_norm``
    and ``_native_batch_norm_legit`` (output, mean, inverse standard deviation; in place),
    ``_native_batch_norm_legit_functional`` (those and the new running mean and variance). The
    statistics are fp32 whatever ``x``'s dtype, as the aten kernels accumulate them.
    ``reduce``: merge them in two all-reduces (the sums, then the squared deviations from the
    global mean) instead of one all-gather (``autopar.cost.batch_norm``)."""
    dims = (0, *range(2, x.dim()))
    shape = [1, x.shape[1]] + [1] * (x.dim() - 2)
    xf = x.float()
    n = float(x.numel() // max(x.shape[1], 1))
    if reduce:
        sums = torch.cat([xf.sum(dims), xf.new_full((1,), n)])
        sums = _sum_over(sums, axes)
        total = sums[-1]
        g_mean = sums[:-1] / total
        g_m2 = _sum_over(((xf - g_mean.view(shape)) ** 2).sum(dims), axes)
    else:
        mean = xf.mean(dims) if n else xf.new_zeros(x.shape[1])
        m2 = ((xf - mean.view(shape)) ** 2).sum(dims)
        stats = torch.stack([torch.full_like(mean, n), mean, m2]).unsqueeze(0)  # (1, 3, C)
        for ax in axes:
            stats = all_gather(stats, ax, 0, grad_partial=True)  # (devices so far, 3, C)
        counts, means, m2s = stats.unbind(1)
        total = counts.sum(0)
        g_mean = (counts * means).sum(0) / total
        g_m2 = m2s.sum(0) + (counts * (means - g_mean) ** 2).sum(0)
    var = g_m2 / total
    invstd = torch.rsqrt(var + eps)
    y = (xf - g_mean.view(shape)) * invstd.view(shape)
    if weight is not None:
        y = y * weight.float().view(shape)
    if bias is not None:
        y = y + bias.float().view(shape)
    y = y.to(x.dtype)
    new_mean = new_var = None
    if running_mean is not None and running_var is not None:
        with torch.no_grad():
            unbiased = g_m2.detach() / (total - 1).clamp(min=1)
            new_mean = running_mean * (1 - momentum) + g_mean.detach().to(running_mean.dtype) * momentum
            new_var = running_var * (1 - momentum) + unbiased.to(running_var.dtype) * momentum
            if form != "_native_batch_norm_legit_functional":
                running_mean.copy_(new_mean)
                running_var.copy_(new_var)
    if form == "batch_norm":
        return y
    saved = (g_mean.detach(), invstd.detach())
    if form == "_native_batch_norm_legit_functional":
        return (y, *saved, new_mean, new_var)
    return (y, *saved)


def _sum_over(t: torch.Tensor, axes: Sequence[AxisGroup]) -> torch.Tensor:
    """Sum of ``t`` over the devices of ``axes``, used by each device for its own rows: its
    gradient is partial, so all-reduced backward too (``grad_sync`` after ``all_reduce``)."""
    for ax in axes:
        t = grad_sync(all_reduce(t, ax), ax)
    return t

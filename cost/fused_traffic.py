"""Memory traffic of the fused kernels (``autopar.program.kernels``): one launch reads each input
once and writes each output once, where eager PyTorch runs one kernel per op and re-reads the
intermediate values from device memory (``autopar.cost.op_kernels``).

Words:

* **fused kernel** — one of the kernel families of ``autopar.program.kernels``
  (``autopar.ir.FusionKind``): residual add + LayerNorm, residual add + RMSNorm, bias + GeLU,
  SwiGLU, rotary embedding, softmax cross-entropy. Its forward and backward are each one row (or
  element) kernel, plus the small reductions noted below, all memory-bound: time is
  ``kernel_overhead + bytes / (bandwidth · memory_efficiency)`` per launch
  (``autopar.cost.compute.kernel_time``), the roofline of Williams, Waterman and Patterson (CACM
  2009) with the kernels' FLOPs far below the ridge.
* **rows × width** — a tensor ``[..., width]`` is read as ``rows`` rows (the leading dimensions
  flattened); ``s`` is the activations' bytes per element, ``p`` the parameters'.
* **statistics** — per-row fp32 values a norm or a loss keeps for backward (mean and ``rstd``,
  the log-sum-exp).

Bytes per kernel, each read and write counted once (the kernels' module docstrings derive them):

* **add + LayerNorm** (Apex/Megatron-LM fused LayerNorm, Liger-Kernel ``layer_norm``): forward reads
  ``x``, ``residual`` (``rows·width·s`` each), ``weight``, ``bias`` (``width·p`` each) and writes
  ``out``, the sum (only with a residual) and ``mean``, ``rstd`` (``4·rows`` each); backward reads
  ``dout``, the residual stream's gradient ``ds`` (when the sum is read later), the saved sum,
  ``weight``, ``mean``, ``rstd`` and writes ``dx``; each program accumulates the weight and bias
  gradients of a chunk of rows in fp32 and writes one row of a ``[P, width]`` partial buffer,
  which torch zero-fills before and sums (and casts to ``p`` unless fp32) after: two or three
  small launches per parameter gradient. ``P`` is :data:`PARTIAL_ROWS`
  (``autopar/program/kernels/_launch.row_chunks``: two programs per multiprocessor).
* **add + RMSNorm** (transformers' ``LlamaRMSNorm`` arithmetic; Liger-Kernel ``rms_norm``): as
  LayerNorm with no bias and one statistic (``rstd``).
* **bias + GeLU** (Megatron-LM's ``bias_gelu_impl``): forward reads ``x`` and the bias, writes
  ``out``; backward reads ``dout``, ``x`` and the bias, writes ``dx``, and torch sums ``dx`` over
  rows into the bias gradient (in fp32, then cast). A bias moved out of a ``linear``/``addmm``
  (the fusion pass splits it, as Megatron-LM does) keeps its gradient's reduction charged at the
  GEMM, where ``op_kernels`` charges it: the same read of the pre-activation gradient.
* **SwiGLU** (Liger-Kernel ``swiglu``): forward reads ``gate`` and ``up``, writes ``out``;
  backward reads ``dout``, ``gate``, ``up`` and writes both gradients.
* **rotary** (Liger-Kernel ``rope``, q and k in one launch): forward reads q, k, cos and sin and
  writes both outputs; backward the same with gradients.
* **cross-entropy** (Liger-Kernel ``cross_entropy``; Wijmans et al., arXiv 2411.09009, for what
  not materialising the probabilities saves): see :func:`cross_entropy_kernels`.

Saved for backward (:func:`saved_statistics_bytes`): the norms keep their input (the sum) and
their statistics, GeLU its input, SwiGLU both inputs, rotary its cos and sin, cross-entropy the
logits and one fp32 log-sum-exp per row — never the probabilities (eager keeps the
``[rows, classes]`` log-probabilities).
"""

from __future__ import annotations

import math

from autopar.cost.compute import Kernel, KernelKind, OpKernels
from autopar.ir import FusionKind

__all__ = [
    "PARTIAL_ROWS",
    "add_norm_kernels",
    "bias_gelu_kernels",
    "cross_entropy_kernels",
    "rotary_kernels",
    "rows_and_width",
    "saved_statistics_bytes",
    "swiglu_kernels",
]

PARTIAL_ROWS = 264
"""Rows of a norm's fp32 weight-gradient partial buffer: two programs per multiprocessor of an
H100 (132 SMs; ``autopar/program/kernels/_launch.row_chunks``), fewer when there are fewer rows."""


def _mem(nbytes: float) -> Kernel:
    return Kernel(KernelKind.MEMORY, float(nbytes))


def _param_grad_reduction(rows: int, width: int, param_bytes: int) -> list[Kernel]:
    """Zero-fill the ``[P, width]`` fp32 partial buffer, sum its rows, cast to the parameter's
    dtype (module docstring: add + LayerNorm)."""
    partial = min(rows, PARTIAL_ROWS) * width * 4.0
    ks = [_mem(partial), _mem(partial + width * 4.0)]
    if param_bytes != 4:
        ks.append(_mem(width * (4.0 + param_bytes)))
    return ks


def add_norm_kernels(
    rows: int,
    width: int,
    act_bytes: int,
    param_bytes: int,
    *,
    residual: bool,
    weight: bool,
    bias: bool,
    statistics: int,
    sum_grad: bool,
    grad: bool,
    param_grad: bool,
) -> OpKernels:
    """Residual add + LayerNorm (``statistics=2``: mean and rstd) or + RMSNorm (``statistics=1``)
    over ``rows × width`` (module docstring). ``sum_grad``: the sum is read later, so its gradient
    is read in backward; ``grad``: a gradient flows into the output; ``param_grad``: the weight
    and bias get gradients."""
    act = float(rows) * width * act_bytes
    params = width * param_bytes * (int(weight) + int(bias))
    stats = 4.0 * rows * statistics
    fwd = (_mem(act * (1 + residual) + params + act * (1 + residual) + stats),)
    if not grad:
        return OpKernels(fwd)
    bwd = [_mem(act * (2 + sum_grad) + width * param_bytes * weight + stats + act)]
    if param_grad:
        for present in (weight, bias):
            if present:
                bwd.extend(_param_grad_reduction(rows, width, param_bytes))
    return OpKernels(fwd, tuple(bwd))


def bias_gelu_kernels(
    numel: int, width: int, act_bytes: int, param_bytes: int, *, bias: bool, bias_grad: bool, grad: bool
) -> OpKernels:
    """``gelu(x + bias)`` over ``numel`` elements whose last dimension is ``width`` (module
    docstring). ``bias_grad``: the fused backward reduces the bias gradient (an explicit bias add;
    not a bias split from a GEMM)."""
    act = float(numel) * act_bytes
    b = width * param_bytes if bias else 0.0
    fwd = (_mem(2 * act + b),)
    if not grad:
        return OpKernels(fwd)
    bwd = [_mem(3 * act + b)]
    if bias and bias_grad:  # torch sums dx over rows in fp32, then casts to the bias's dtype
        bwd.append(_mem(act + width * 4.0))
        if param_bytes != 4:
            bwd.append(_mem(width * (4.0 + param_bytes)))
    return OpKernels(fwd, tuple(bwd))


def swiglu_kernels(numel: int, act_bytes: int, *, grad: bool) -> OpKernels:
    """``silu(gate) · up`` over ``numel`` elements: 3 tensors forward, 5 backward."""
    act = float(numel) * act_bytes
    return OpKernels((_mem(3 * act),), (_mem(5 * act),) if grad else ())


def rotary_kernels(q_numel: int, k_numel: int, table_numel: int, act_bytes: int, *, grad: bool) -> OpKernels:
    """Rotary embedding of q and k in one launch, ``table_numel`` elements each of cos and sin."""
    nbytes = 2.0 * (q_numel + k_numel) * act_bytes + 2.0 * table_numel * act_bytes
    return OpKernels((_mem(nbytes),), (_mem(nbytes),) if grad else ())


def cross_entropy_kernels(
    rows: int, classes: int, act_bytes: int, *, grad: bool, vocab_parallel: bool = False, reduced: bool = True
) -> OpKernels:
    """Softmax cross-entropy over ``rows × classes`` logits (this device's classes when
    ``vocab_parallel``), int64 targets (``autopar/program/kernels/cross_entropy.py``).

    Plain: forward one kernel reads the logits once (the online softmax of Milakov and
    Gimelshein, arXiv 1805.02867, as Liger-Kernel runs it) and the targets and writes the loss and
    the log-sum-exp per row (fp32); ``reduced``: torch then sums the rows' losses. Backward one
    kernel reads the logits, targets, log-sum-exp and the loss's gradient per row and writes the
    logits' gradient. Vocabulary-parallel (Megatron-LM, arXiv 1909.08053 §3, the all-reduces
    between the kernels): a statistics kernel reads the local logits once and writes the local
    maximum, sum of exponentials and target logit per row; torch rescales the sums to the global
    maximum after the all-reduce of the maxima (a pass over ``3·rows`` values); a loss kernel
    turns the reduced statistics into the loss and log-sum-exp; backward as plain, on the local
    columns.
    """
    logits = float(rows) * classes * act_bytes
    targets = 8.0 * rows
    if vocab_parallel:
        fwd = [_mem(logits + targets + 12.0 * rows), _mem(24.0 * rows), _mem(20.0 * rows)]
    else:
        fwd = [_mem(logits + targets + 8.0 * rows)]
    if reduced:
        fwd.append(_mem(4.0 * rows + 4.0))
    bwd = (_mem(2 * logits + targets + 8.0 * rows),) if grad else ()
    return OpKernels(tuple(fwd), bwd)


def saved_statistics_bytes(kind: FusionKind, rows: int) -> float:
    """Bytes of per-row statistics a fused op keeps for backward beyond the tensors it reads
    (module docstring): mean and rstd of LayerNorm, rstd of RMSNorm, the log-sum-exp of
    cross-entropy; nothing for the pointwise families."""
    per_row = {FusionKind.ADD_LAYER_NORM: 8.0, FusionKind.ADD_RMS_NORM: 4.0, FusionKind.CROSS_ENTROPY: 4.0}
    return per_row.get(kind, 0.0) * rows


def rows_and_width(shape: tuple[int, ...]) -> tuple[int, int]:
    """``(rows, width)`` of a tensor of ``shape`` read as rows of its last dimension."""
    if not shape:
        return 1, 1
    return max(1, math.prod(shape[:-1])), int(shape[-1])

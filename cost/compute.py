"""Compute time of ops on one device: each op runs as kernels, each kernel timed on a roofline
whose efficiencies depend on the kernel's shape and were measured (``DeviceSpec``).

Words:

* **kernel** — one launch on the device (:class:`Kernel`): a GEMM, a fused attention, or a
  memory-bound pass (elementwise, norm, reduction, copy, cast), with its FLOPs and the bytes it
  reads and writes.
* **op kernels** — what one aten op of the captured (pre-dispatch) graph launches in eager
  PyTorch, forward and backward (``autopar.cost.op_kernels``): a ``linear`` is one GEMM forward and two
  backward (plus a reduction for its bias); ``layer_norm`` one pass forward and two backward; a
  view none.

Kernel time (``kernel_time``): ``kernel_overhead + max(compute, bytes / (bandwidth ·
memory_efficiency))`` — the roofline (Williams, Waterman and Patterson, CACM 2009) with

1. **GEMM** — ``FLOPs / (peak(dtype) · e)``, ``e = e_max · K / (K + K½) · fill``: a GEMM's
   output tiles each run a loop over the reduction length ``K`` with a fixed prologue and epilogue
   (NVIDIA, "Matrix Multiplication Background User's Guide", §2.1 and §3), so efficiency grows with
   ``K`` to a plateau ``e_max``; ``fill = min(1, tiles / SMs)`` (128×128 output tiles) for a GEMM
   too small to occupy the device. A GEMM with few output tiles and a long reduction (the
   weight gradient of a convolution or linear over many rows: channels × channels out, batch ×
   positions reduced) runs its reduction in ``s`` pieces on as many more SMs, the partial tiles
   summed after (split-K: CUTLASS's parallel split-K; stream-K, Osama et al., PPoPP 2023, which
   cuBLAS's and cuDNN's kernels use): ``fill`` counts ``tiles · s`` and ``K½`` applies to ``K/s``,
   ``s`` the power of two that makes the kernel fastest (``split_k``); the partial tiles' fp32
   traffic, ``2·s·m·n·4`` bytes, joins its memory bound. Fitted to measured matmuls by ``autopar.cost.fit``. Wave
   quantization beyond the first wave is not modelled: cuBLAS's Hopper kernels (persistent,
   stream-K) hide it, and the H100 reference shows none (16384×50304×2048 at 69.1 % of peak,
   8192×2048×2048 at 71.2 %).
2. **Attention** as FlashAttention runs it (Dao et al., arXiv 2205.14135 and 2307.08691): the
   s×s score matrix is never written; FLOPs ``4·b·h·s_q·s_k·d`` forward times the fraction of
   (query, key) pairs a causal mask keeps (≈ ½: the kernel skips masked blocks), 2.5× that backward
   (five matmuls against two); ``e = e_max · g(d) · s_k / (s_k + s½)`` with the causal mask
   adding to ``s½``, ``g(d)`` the head-dimension factor of the FlashAttention-2 figures (0.88 at
   d = 64, 1 at 128, 0.80 at 256, interpolated in log d). Its IO (q, k, v, o) bounds it below.
3. **Memory-bound** — bytes at ``memory_bandwidth · memory_efficiency``.

FLOPs (``op_flops``): 2·m·n·k per matmul (2 FLOPs per multiply-add), attention as above,
2·out·(c_in/groups)·kernel for convolution, one per output element otherwise.
``BACKWARD_FLOP_RATIO``: 2× forward for matmul-like ops (one GEMM for each input's gradient, the
3× rule of Kaplan et al. 2020 / Narayanan et al. 2021 for a whole step), 2.5× for attention.

Host time: eager PyTorch issues ops from the CPU (``DeviceSpec.host_overhead`` each); the device
runs them as they arrive, so a step is bound by whichever is slower (``autopar.cost.step``).
"""

from __future__ import annotations

import enum
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from autopar.devices import DeviceSpec
from autopar.graph import OpFamily, op_info

__all__ = [
    "BACKWARD_FLOP_RATIO",
    "Kernel",
    "KernelKind",
    "OpKernels",
    "TensorArg",
    "attention_efficiency",
    "causal_fraction",
    "causal_share",
    "gemm_efficiency",
    "itemsize",
    "kernel_time",
    "memory_time",
    "op_flops",
    "roofline_time",
    "runs_on",
    "split_k",
]

BACKWARD_FLOP_RATIO = {"matmul": 2.0, "attention": 2.5, "other": 1.0}

TILE = 128
"""Output tile edge of a GEMM for the fill term (cuBLAS's common 128×128 / 128×256 tiles)."""

HEAD_DIM_FACTOR = ((64, 0.88), (128, 1.0), (256, 0.80))
"""FlashAttention-2's plateau at head dimension d relative to d = 128 (Shah et al.,
arXiv 2407.08608, Figs. 5-7: forward 324 / 370 TFLOP/s at d = 64 / 128, backward ≈ 0.88×; 298 at
d = 256)."""

_ITEMSIZE = {
    "float64": 8, "float32": 4, "tfloat32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2,
    "int8": 1, "uint8": 1, "bool": 1, "complex64": 8, "complex128": 16, "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}  # fmt: skip


def itemsize(dtype: str) -> int:
    """Bytes per element of a dtype name (``"bfloat16"`` → 2)."""
    key = dtype.replace("torch.", "")
    if key in _ITEMSIZE:
        return _ITEMSIZE[key]
    import torch

    return torch.empty((), dtype=getattr(torch, key)).element_size()


@dataclass(frozen=True, slots=True)
class TensorArg:
    """A tensor an op reads or writes: its shape and dtype, and whether a gradient is computed for
    it (inputs) or flows into it (outputs)."""

    shape: tuple[int, ...]
    dtype: str
    grad: bool = False
    stored: float | None = None
    """Bytes of memory it actually occupies when less than ``numel · itemsize`` (an expanded view
    reads its small source); ``None``: ``numel · itemsize``."""
    channels_last: bool = False
    """Laid out with the channels (dimension 1) innermost (``torch.channels_last``): a
    convolution's input reaches the tensor cores without a transpose (``op_kernels``)."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> float:
        full = float(self.numel * itemsize(self.dtype))
        return full if self.stored is None else min(full, self.stored)


class KernelKind(str, enum.Enum):
    GEMM = "gemm"
    ATTENTION = "attention"
    MEMORY = "memory"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, slots=True)
class Kernel:
    """One kernel launch (see module docstring)."""

    kind: KernelKind
    nbytes: float
    """Bytes read and written."""
    flops: float = 0.0
    dtype: str = "float32"
    m: int = 0
    """GEMM: rows of the output, columns of the output, reduction length, batch."""
    n: int = 0
    k: int = 0
    batch: int = 1
    seq: int = 0
    """Attention: key length; head dimension; causal mask; backward kernel."""
    head_dim: int = 0
    causal: bool = False
    backward: bool = False
    launches: int = 1
    """Kernel launches it stands for (each ``DeviceSpec.kernel_overhead``): 0 for a share of a
    generated kernel launched at another op (``autopar.cost.compiled``)."""
    tensor_cores: str = ""
    """A layout change that runs only where the device has tensor cores for this dtype (its
    ``peak_flops`` names it): a convolution's transposes around a channels-first tensor
    (``op_kernels``); elsewhere no kernel."""


@dataclass(frozen=True, slots=True)
class OpKernels:
    """The kernels of one op: forward, and backward (empty when no gradient flows)."""

    fwd: tuple[Kernel, ...] = ()
    bwd: tuple[Kernel, ...] = ()

    @property
    def fwd_flops(self) -> float:
        return sum(k.flops for k in self.fwd)

    @property
    def bwd_flops(self) -> float:
        return sum(k.flops for k in self.bwd)

    @property
    def fwd_bytes(self) -> float:
        return sum(k.nbytes for k in self.fwd)


# ------------------------------------------------------------------------------- kernel times
def roofline_time(flops: float, nbytes: float, device: DeviceSpec, dtype: str = "float32") -> float:
    """Seconds for ``flops`` FLOPs that move ``nbytes`` bytes on ``device`` at its plateau
    efficiencies (no shape dependence, no kernel overhead)."""
    compute = flops / (device.flops_for(dtype) * device.compute_efficiency)
    memory = nbytes / device.achieved_bandwidth
    return max(compute, memory)


def memory_time(nbytes: float, device: DeviceSpec) -> float:
    """Seconds of a memory-bound kernel moving ``nbytes``."""
    return device.kernel_overhead + nbytes / device.achieved_bandwidth


def gemm_efficiency(m: int, n: int, k: int, device: DeviceSpec, batch: int = 1) -> float:
    """Fraction of peak an ``m×k @ k×n`` GEMM (``batch`` of them) reaches (module docstring, 1),
    its reduction split ``split_k`` ways where its output tiles alone leave SMs idle."""
    return _best_split(m, n, k, device, batch)[1]


def _split_efficiency(m: int, n: int, k: int, device: DeviceSpec, batch: int, splits: int) -> float:
    e = device.compute_efficiency
    if device.matmul_k_half > 0:
        piece = k / splits
        e *= piece / (piece + device.matmul_k_half)
    if device.sm_count > 0:
        tiles = batch * math.ceil(m / TILE) * math.ceil(n / TILE) * splits
        e *= min(1.0, tiles / device.sm_count)
    return e


def split_k(m: int, n: int, k: int, device: DeviceSpec, batch: int = 1) -> int:
    """How many pieces a GEMM's reduction runs in (module docstring, 1): 1 where its output tiles
    fill the device; else the power of two, up to the SMs its tiles leave idle and to pieces of
    one tile's length, that makes it fastest — each piece pays its own prologue and epilogue
    (``K½`` on a shorter ``K``)."""
    return _best_split(m, n, k, device, batch)[0]


def _best_split(m: int, n: int, k: int, device: DeviceSpec, batch: int) -> tuple[int, float]:
    """``(split_k, efficiency at it)``."""
    best = (1, _split_efficiency(m, n, k, device, batch, 1))
    if device.sm_count <= 0:
        return best
    tiles = batch * math.ceil(m / TILE) * math.ceil(n / TILE)
    s = 2
    while tiles * s <= 2 * device.sm_count and k / s >= TILE:
        e = _split_efficiency(m, n, k, device, batch, s)
        if e > best[1]:
            best = (s, e)
        s *= 2
    return best


def _head_dim_factor(d: int) -> float:
    pts = HEAD_DIM_FACTOR
    if d <= pts[0][0]:
        return pts[0][1]
    if d >= pts[-1][0]:
        return pts[-1][1]
    for (d0, f0), (d1, f1) in itertools.pairwise(pts):
        if d0 <= d <= d1:
            w = math.log(d / d0) / math.log(d1 / d0)
            return f0 + w * (f1 - f0)
    return 1.0


def attention_efficiency(seq: int, head_dim: int, causal: bool, backward: bool, device: DeviceSpec) -> float:
    """Fraction of peak a fused attention kernel reaches over ``seq`` keys (module docstring, 2)."""
    fwd = device.attention_efficiency or device.compute_efficiency
    e_max = (device.attention_bwd_efficiency or fwd) if backward else fwd
    half = device.attention_bwd_seq_half if backward else device.attention_seq_half
    if causal:
        half += device.attention_causal_seq_half
    e = e_max * _head_dim_factor(head_dim) if head_dim else e_max
    return e * seq / (seq + half) if half > 0 else e


def runs_on(kernel: Kernel, device: DeviceSpec) -> bool:
    """Whether ``kernel`` runs at all on ``device`` (``Kernel.tensor_cores``)."""
    return not kernel.tensor_cores or kernel.tensor_cores in device.peak_flops


def kernel_time(kernel: Kernel, device: DeviceSpec) -> float:
    """Seconds ``kernel`` takes on ``device`` (module docstring)."""
    if not runs_on(kernel, device):
        return 0.0
    memory = kernel.nbytes / device.achieved_bandwidth
    if kernel.kind is KernelKind.GEMM:
        splits, e = _best_split(kernel.m, kernel.n, kernel.k, device, kernel.batch)
        compute = kernel.flops / (device.flops_for(kernel.dtype) * e)
        if splits > 1:  # the partial tiles, written and read back in fp32
            memory += 2 * splits * kernel.batch * kernel.m * kernel.n * 4 / device.achieved_bandwidth
    elif kernel.kind is KernelKind.ATTENTION:
        e = attention_efficiency(kernel.seq, kernel.head_dim, kernel.causal, kernel.backward, device)
        compute = kernel.flops / (device.flops_for(kernel.dtype) * e)
    else:
        compute = 0.0
    return device.kernel_overhead * kernel.launches + max(compute, memory)


# ------------------------------------------------------------------------------- FLOPs
def causal_fraction(s_q: int, s_k: int) -> float:
    """Fraction of (query, key) pairs a causal mask keeps: query ``i`` sees keys ``0..i``
    (PyTorch's ``is_causal``, top-left aligned)."""
    if s_q <= 0 or s_k <= 0:
        return 0.0
    kept = s_q * (s_q + 1) / 2 if s_q <= s_k else s_k * (s_k + 1) / 2 + (s_q - s_k) * s_k
    return kept / (s_q * s_k)


def causal_share(seq: int, pieces: Sequence[tuple[int, int]]) -> float:
    """Fraction of the (query, key) pairs of one device's query rows — the global position ranges
    ``pieces`` of a causal attention over ``seq`` keys — that the mask keeps, each piece run
    against the keys up to its last position (``autopar.program.local_ops.causal_query_attention``:
    query ``i`` sees keys ``0..i``, the kernel skipping what it masks)."""
    rows = sum(hi - lo for lo, hi in pieces)
    if rows <= 0 or seq <= 0:
        return 0.0
    kept = sum((hi * (hi + 1) - lo * (lo + 1)) / 2 for lo, hi in pieces)
    return kept / (rows * seq)


def op_flops(
    op: str,
    in_shapes: Sequence[Sequence[int]],
    out_shape: Sequence[int],
    groups: int = 1,
    *,
    causal: bool | float = False,
) -> tuple[float, str]:
    """Forward FLOPs of aten op ``op`` (packet name) and its family (a ``BACKWARD_FLOP_RATIO`` key).

    ``in_shapes`` lists the op's tensor arguments in call order; ``causal``: attention under a
    causal mask (the kernel skips the masked half), or the fraction of (query, key) pairs the mask
    keeps where the caller knows it (a device's share of the queries: ``causal_share``).
    """
    out_numel = float(math.prod(out_shape)) if out_shape else 1.0
    family = op_info(op).family
    if family is OpFamily.MATMUL:
        a = in_shapes[1] if op in ("addmm", "baddbmm") else in_shapes[0]
        k = a[-1] if a else 1
        return 2.0 * out_numel * k, "matmul"
    if family is OpFamily.ATTENTION:
        q, k, v = in_shapes[0], in_shapes[1], in_shapes[2]
        batch = math.prod(q[:-2])
        flops = 2.0 * batch * q[-2] * k[-2] * (q[-1] + v[-1])
        if isinstance(causal, float):
            return flops * causal, "attention"
        return flops * (causal_fraction(q[-2], k[-2]) if causal else 1.0), "attention"
    if family is OpFamily.CONV and len(in_shapes) > 1:
        w = in_shapes[1]
        return 2.0 * out_numel * math.prod(w[1:]), "matmul"
    return out_numel, "other"

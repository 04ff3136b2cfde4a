"""Gradient compression of the data-parallel all-reduce: what it sends, what it computes, what
it keeps.

Words:

* **compression** — a lossy change to a weight gradient's data-parallel all-reduce (the sum over
  the ranks that hold the weight whole, ``autopar.reshard.grad_sync_axes``), chosen by the plan
  only where the user allows it (``PlanConfig.allow_compression``). Two methods:

  - ``"bf16"``: the gradient is cast to bfloat16, all-reduced, and cast back (PyTorch's
    ``bf16_compress_hook``, ``torch/distributed/algorithms/ddp_comm_hooks/default_hooks.py``).
    Halves the bytes of an fp32 gradient; a gradient already in 2 bytes is sent as it is.
  - ``"powersgd"``: each matrix-shaped gradient ``M`` (``m × n``: a weight's first dimension by
    the product of the others) is replaced by a rank-``r`` product ``P Qᵀ`` found by one step of
    subspace iteration, warm-started from the last step's ``Q``, with error feedback: what the
    approximation missed is added to the next step's gradient (Vogels, Karimireddy and Jaggi,
    "PowerSGD", NeurIPS 2019, arXiv 1905.13727, Algorithm 1; PyTorch's ``powerSGD_hook``). Two
    all-reduces of ``P`` (``m × r``) and ``Q`` (``n × r``) replace the all-reduce of ``M``. A
    matrix is compressed only where ``(m + n) · r · min_compression_rate < m · n`` (the hook's
    ``_should_compress``); vectors and small matrices are all-reduced as they are.

  - ``"fp8"``: 8-bit quantized reduction with error feedback, in two rounds as ZeRO++'s quantized
    gradients (Wang et al., "ZeRO++", arXiv 2306.10209, §3.3, qgZ) run them: ``M = g + e`` is cut
    into one chunk per rank, each chunk scaled by its largest magnitude onto float8 e4m3's range
    (``FP8_MAX``) and sent to its owner by one all-to-all (a reduce-scatter in 8 bits); the owner
    sums the dequantized chunks in fp32, quantizes the sum again and all-gathers it. What the
    first quantization lost stays as ``e`` (Seide et al., "1-bit SGD", Interspeech 2014, error
    feedback); what the second lost, on the chunk's owner, too — so nothing is lost over the
    steps. A quarter of fp32's bytes, half of bf16's.
  - ``"topk"``: top-k sparsification with error feedback (Stich, Cordonnier and Jaggi,
    "Sparsified SGD with memory", NeurIPS 2018; Lin et al., "Deep Gradient Compression", ICLR
    2018): each rank sends the ``k = ceil(density · n)`` entries of ``M = g + e`` largest in
    magnitude, values and indices, by one all-gather; every rank adds all of them into a zero
    gradient; the unsent entries stay as ``e``.

* **wire bytes** — what the reductions carry, counted as an all-reduce's buffer (an all-reduce is
  a reduce-scatter and an all-gather of it): ``m·n·itemsize`` uncompressed, ``(m + n)·r·4``
  (PowerSGD runs in fp32), ``m·n·2`` (bf16), ``m·n`` (fp8: the all-gathered sum, scales aside),
  ``g·k·8`` (top-k: the all-gathered values and int32 indices of the ``g`` ranks).
* **blocking** — the seconds the compression occupies the device's compute: PowerSGD's three
  skinny matmuls (``P = M Q``, ``Q = Mᵀ P``, ``M̂ = P Qᵀ``: ``2·m·n·r`` flops each), the QR of ``P``
  (``2·m·r²``) and its elementwise passes, memory-bound at ``r ≪ m, n``: ``M = g + e`` (read the
  gradient and the error, write ``M``), one read of ``M`` per matmul, ``M̂`` written, the error
  ``M − M̂/g`` (two reads, a write) and ``M̂`` cast back (a read, a write of the gradient): ten
  fp32 passes over ``m·n`` in all. bf16's two casts read and write the gradient once each. fp8:
  ``M = g + e`` (three passes), the chunks' largest magnitudes (one), quantize and dequantize
  (two), the error written (one), the received chunks summed and the gathered sum dequantized
  (one) — eight. Top-k: ``M`` (three), magnitudes (two), the selection (``torch.topk``, about
  three), the error and the scattered sum (two) — ten. The runtime runs PowerSGD's, fp8's and
  top-k's rounds one after another (``autopar.program.compression``), so their collectives
  block too; bf16's all-reduce overlaps the backward as an uncompressed one does.
* **kept** — bytes a device holds from one step to the next: PowerSGD's fp32 error ``m·n·4`` and
  warm-start ``Q`` ``n·r·4`` per compressed matrix; fp8's and top-k's fp32 error ``m·n·4``; bf16
  keeps nothing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from autopar.grad_compression import METHODS, GradCompression, powersgd_matrix, topk_count

if TYPE_CHECKING:
    from autopar.mesh import Mesh

__all__ = [
    "METHODS",
    "CompressedSync",
    "GradCompression",
    "compressed_sync",
    "powersgd_matrix",
]

_POWERSGD_PASSES = 10.0
"""fp32 passes over ``m·n`` elements one PowerSGD compression makes (module docstring)."""
_FP8_PASSES = 8.0
"""fp32 passes over the gradient one fp8 reduction makes (module docstring)."""
_TOPK_PASSES = 10.0
"""fp32 passes over the gradient one top-k reduction makes (module docstring)."""


@dataclass(frozen=True, slots=True)
class CompressedSync:
    """One gradient's compressed all-reduce (module docstring's words)."""

    wire_bytes: float
    """Bytes the all-reduces carry."""
    overlapped: float
    """Seconds of all-reduce that run beside the backward, on the communication stream."""
    blocking: float
    """Seconds on the device's compute: the compression's own work and, for PowerSGD, its
    all-reduces too (they run in rounds between computations)."""
    kept: float
    """Bytes kept from step to step (error feedback and warm start)."""

    @property
    def time(self) -> float:
        """Seconds in all: what the solver's objective charges."""
        return self.overlapped + self.blocking


def compressed_sync(
    local_shape: Sequence[int], itemsize: int, c: GradCompression, mesh: Mesh, axes: Sequence[int]
) -> CompressedSync:
    """The all-reduce of one weight gradient of ``local_shape`` (``itemsize`` bytes an element)
    over mesh ``axes`` under ``c``, bucketed with the others (no per-tensor latency: the runtime
    compresses a bucket at a time, PowerSGD's ``P`` and ``Q`` of a bucket each in one all-reduce)."""
    numel = float(math.prod(local_shape))
    dev = mesh.cluster.device
    bw = dev.memory_bandwidth * dev.memory_efficiency
    if c.method == "bf16":
        wire = numel * min(itemsize, 2)
        comm = mesh.all_reduce_cost(wire, axes=axes, bucketed=True, two_level=True)
        cast = 0.0 if itemsize <= 2 else numel * 2 * (itemsize + 2) / bw
        return CompressedSync(wire, comm, cast, 0.0)
    if c.method == "fp8":
        comm = mesh.all_reduce_cost(numel, axes=axes, bucketed=True)  # 8-bit reduce-scatter + all-gather
        return CompressedSync(numel, 0.0, _FP8_PASSES * numel * 4 / bw + comm, numel * 4)
    if c.method == "topk":
        ranks = math.prod(mesh.shape[a] for a in axes)
        wire = float(ranks * topk_count(int(numel), c) * 8)
        comm = mesh.all_gather_cost(wire, axes=axes, bucketed=True, two_level=False)
        return CompressedSync(wire, 0.0, _TOPK_PASSES * numel * 4 / bw + comm, numel * 4)
    mn = powersgd_matrix(local_shape, c)
    if mn is None:
        wire = numel * itemsize
        return CompressedSync(wire, mesh.all_reduce_cost(wire, axes=axes, bucketed=True), 0.0, 0.0)
    m, n = mn
    r = c.rank
    wire = float((m + n) * r * 4)
    comm = mesh.all_reduce_cost(float(m * r * 4), axes=axes, bucketed=True) + mesh.all_reduce_cost(
        float(n * r * 4), axes=axes, bucketed=True
    )
    flops = 3 * 2.0 * m * n * r + 2.0 * m * r * r
    peak = dev.flops_for("float32") * dev.compute_efficiency
    compute = max(flops / peak, _POWERSGD_PASSES * numel * 4 / bw)
    # The rounds run one after another on the compute's own time: P's all-reduce waits for M Q,
    # Q's for the QR and Mᵀ P, and the approximation for Q's.
    return CompressedSync(wire, 0.0, compute + comm, float(m * n * 4 + n * r * 4))

"""Triton fused kernels: the memory-bound chains of a transformer step, one kernel each way.

Words:

* **kernel family** — one file here: a fused computation, its Triton forward and backward
  kernels, the eager composition it replaces (``*_reference``, what tests compare against) and
  an eager fallback with the kernels' arithmetic in torch ops. The families: ``layer_norm``
  (residual add + LayerNorm), ``rms_norm`` (residual add + RMSNorm), ``gelu`` (bias + GeLU, erf
  and tanh), ``swiglu``, ``rotary`` (q and k together), ``cross_entropy`` (plain and
  vocabulary-parallel).
* **fused op** — a ``torch.library`` custom op ``autopar::<name>`` (forward) with its backward
  ``autopar::<name>_backward``, each with a fake implementation and joined by
  ``register_autograd``: ``torch.export``, fake-tensor planning and ``make_fx`` (the whole-step
  trace of ``autopar.passes.joint``) see one node per fused forward and one per backward. The
  public functions below call them; all are differentiable.
* **backend** — what a fused op runs for a tensor: ``"triton"`` (its kernels: on a CUDA device
  with Triton importable, or on the CPU under Triton's interpreter, ``TRITON_INTERPRET=1`` set
  before this package is first imported) or ``"eager"`` (the fallback: CPU training without the
  interpreter computes the same values with torch ops).

Kernels compute in fp32 whatever the input dtype (fp32, bf16, fp16) and write outputs in the
input dtype, rounding intermediate values where the eager composition rounds them. The fusion
pass (``autopar.passes.fusion``) finds these chains in a rank's program and calls the functions;
this package never imports the planner.

Public functions (``block_size``, keyword-only, forces the columns or elements per program; tests
use it to exercise the looped paths on small shapes):

* ``add_layer_norm(x, residual, weight, bias, eps) -> (layer_norm(x + residual), x + residual)``
* ``add_rms_norm(x, residual, weight, eps) -> (LlamaRMSNorm(x + residual), x + residual)``
* ``bias_gelu(x, bias, approximate="none") -> gelu(x + bias)``
* ``swiglu(gate, up) -> silu(gate) * up``
* ``rotary(q, k, cos, sin) -> (q·cos + rotate_half(q)·sin, k·cos + rotate_half(k)·sin)``
* ``cross_entropy(logits, target, ignore_index=-100, reduction="mean")``
* ``vocab_parallel_cross_entropy(logits, target, class_start, axes, ignore_index=-100)``
"""

from autopar.program.kernels._launch import available, backend
from autopar.program.kernels.cross_entropy import (
    cross_entropy,
    cross_entropy_reference,
    vocab_parallel_cross_entropy,
)
from autopar.program.kernels.gelu import bias_gelu, bias_gelu_reference
from autopar.program.kernels.layer_norm import add_layer_norm, add_layer_norm_reference
from autopar.program.kernels.rms_norm import add_rms_norm, add_rms_norm_reference
from autopar.program.kernels.rotary import rotary, rotary_reference
from autopar.program.kernels.swiglu import swiglu, swiglu_reference

__all__ = [
    "add_layer_norm",
    "add_layer_norm_reference",
    "add_rms_norm",
    "add_rms_norm_reference",
    "available",
    "backend",
    "bias_gelu",
    "bias_gelu_reference",
    "cross_entropy",
    "cross_entropy_reference",
    "rotary",
    "rotary_reference",
    "swiglu",
    "swiglu_reference",
    "vocab_parallel_cross_entropy",
]

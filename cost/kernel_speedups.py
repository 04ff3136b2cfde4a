"""What each fused kernel (``autopar.program.kernels``) measured against the eager ops it
replaces, and so which kernels a per-rank program uses and the planner costs unless told
otherwise.

**speed-up** — the eager composition's time over the fused kernel's, forward and backward
together, on one GPU at bf16 and at the shapes of a LLaMA-3-8B-sized layer (8192 tokens, hidden
4096, MLP width 14336, vocabulary 128256): ``python examples/bench_kernels.py`` (median of 50
runs after 10 warm-up runs) on one NVIDIA H100 80GB HBM3 with torch 2.11 and Triton 3.6,
2026-11-26. Where a family has two forms, the slower one's figure stands (``bias_gelu``: erf
1.35×, tanh 1.17×).

A kernel measured slower than eager is not used by default: the residual add + LayerNorm kernel
takes 0.754 ms where the eager ``add`` and PyTorch's own fused ``native_layer_norm`` take 0.377 ms
(that eager LayerNorm is already one kernel each way; RMSNorm, written out as six ops in
transformers' models, is not, hence its 3.54×). ``PlanConfig.kernels`` names the kinds to use
instead (``autopar.passes.fusion``: the planner costs what the program runs).
"""

from __future__ import annotations

__all__ = ["SPEEDUPS", "faster_than_eager"]

SPEEDUPS: dict[str, float] = {
    "add_layer_norm": 0.50,
    "add_rms_norm": 3.54,
    "bias_gelu": 1.17,
    "swiglu": 1.52,
    "rotary": 1.37,
    "cross_entropy": 2.50,
}
"""Fused kind (``autopar.ir.FusionKind`` value) -> measured speed-up over eager (module docstring)."""


def faster_than_eager() -> frozenset[str]:
    """The kinds whose kernel measured faster than the eager ops it replaces: the default."""
    return frozenset(kind for kind, speedup in SPEEDUPS.items() if speedup > 1.0)

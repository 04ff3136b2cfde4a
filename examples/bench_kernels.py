"""The fused kernels against eager PyTorch on one GPU: forward + backward time and, for the
cross-entropy, peak memory.

    python examples/bench_kernels.py                  # a CUDA GPU: bf16, transformer-sized shapes
    python examples/bench_kernels.py --runs 100 --json out.json
    python examples/bench_kernels.py --cpu-smoke      # no GPU: tiny shapes under Triton's interpreter

Each case runs the fused function (``autopar.program.kernels``) and the eager composition it
replaces (its ``*_reference``) on the same inputs at bf16, at the shapes of a LLaMA-3-8B-sized
layer: 8192 tokens, hidden 4096 (32 query and 8 key/value heads of 128), MLP width 14336 for
SwiGLU and 4 × 4096 for bias + GeLU, a 128256-class vocabulary for the cross-entropy.

* time — forward and backward (``torch.autograd.grad`` of the outputs against fixed random
  output gradients, so no ``.grad`` accumulation is timed), measured with CUDA events around each
  run; the median of ``--runs`` (≥ 50 by default) runs after ``--warmup`` runs (the first of which
  compiles the Triton kernels);
* speed-up — eager median / fused median (the issue's goal: ≥ 1.5× for each kernel, bar 1.2×);
* peak memory — for the cross-entropy, ``torch.cuda.max_memory_allocated`` during one forward +
  backward above what was allocated before it (the logits and targets): eager allocates the
  log-probabilities and two dense gradients, fused only the logits' gradient (see the module
  docstring of ``autopar/autopar/program/kernels/cross_entropy.py``).

Before timing, each case checks that the fused outputs and gradients agree with eager (bf16
tolerances), so a broken kernel is reported as such rather than timed. The device name and the
torch and Triton versions head the table.

Without CUDA the script refuses (there is nothing to measure) unless ``--cpu-smoke`` is given:
then it sets ``TRITON_INTERPRET=1`` before importing triton and runs every case once on tiny
shapes on the CPU, proving the script's paths run; its times mean nothing.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class Shapes:
    tokens: int
    hidden: int
    q_heads: int
    kv_heads: int
    head_dim: int
    swiglu_width: int
    gelu_width: int
    vocab: int


GPU_SHAPES = Shapes(
    tokens=8192,
    hidden=4096,
    q_heads=32,
    kv_heads=8,
    head_dim=128,
    swiglu_width=14336,
    gelu_width=16384,
    vocab=128256,
)
SMOKE_SHAPES = Shapes(
    tokens=12, hidden=40, q_heads=4, kv_heads=2, head_dim=8, swiglu_width=48, gelu_width=64, vocab=300
)


@dataclass(frozen=True)
class Case:
    name: str
    fused: Callable[..., Any]
    eager: Callable[..., Any]
    inputs: Callable[[], list[Any]]
    """Fresh inputs (tensors that need gradients are leaves with ``requires_grad``)."""
    memory: bool = False
    """Also measure peak memory (the cross-entropy)."""


@dataclass
class Result:
    name: str
    fused_ms: float
    eager_ms: float
    speedup: float
    max_error: float
    fused_peak_mib: float | None = None
    eager_peak_mib: float | None = None


def cases(s: Shapes, device: str, dtype: Any) -> list[Case]:
    import torch

    from autopar.program import kernels as K

    def leaf(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (
            (torch.randn(*shape, device=device, dtype=torch.float32) * scale).to(dtype).requires_grad_(True)
        )

    def const(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=device, dtype=dtype)

    def rope() -> tuple[torch.Tensor, torch.Tensor]:
        inv = 1.0 / (10000 ** (torch.arange(0, s.head_dim, 2).float() / s.head_dim))
        emb = torch.arange(s.tokens).float()[:, None] * inv
        emb = torch.cat([emb, emb], dim=-1)[None, None]  # [1, 1, s, d]
        return const(emb.cos()), const(emb.sin())

    def targets() -> torch.Tensor:
        t = torch.randint(0, s.vocab, (s.tokens,), device=device)
        t[::7] = -100  # some ignored rows (padding)
        return t

    t, h = s.tokens, s.hidden
    return [
        Case(
            "residual add + LayerNorm",
            lambda x, r, w, b: K.add_layer_norm(x, r, w, b, 1e-5),
            lambda x, r, w, b: K.add_layer_norm_reference(x, r, w, b, 1e-5),
            lambda: [leaf(t, h), leaf(t, h), leaf(h), leaf(h)],
        ),
        Case(
            "residual add + RMSNorm",
            lambda x, r, w: K.add_rms_norm(x, r, w, 1e-5),
            lambda x, r, w: K.add_rms_norm_reference(x, r, w, 1e-5),
            lambda: [leaf(t, h), leaf(t, h), leaf(h)],
        ),
        Case(
            "bias + GeLU (erf)",
            lambda x, b: K.bias_gelu(x, b, "none"),
            lambda x, b: K.bias_gelu_reference(x, b, "none"),
            lambda: [leaf(t, s.gelu_width), leaf(s.gelu_width)],
        ),
        Case(
            "bias + GeLU (tanh)",
            lambda x, b: K.bias_gelu(x, b, "tanh"),
            lambda x, b: K.bias_gelu_reference(x, b, "tanh"),
            lambda: [leaf(t, s.gelu_width), leaf(s.gelu_width)],
        ),
        Case(
            "SwiGLU",
            K.swiglu,
            K.swiglu_reference,
            lambda: [leaf(t, s.swiglu_width), leaf(t, s.swiglu_width)],
        ),
        Case(
            "rotary (q and k)",
            K.rotary,
            K.rotary_reference,
            lambda: [
                leaf(1, s.q_heads, t, s.head_dim),
                leaf(1, s.kv_heads, t, s.head_dim),
                *rope(),
            ],
        ),
        Case(
            "cross-entropy",
            lambda x, y: K.cross_entropy(x, y),
            lambda x, y: K.cross_entropy_reference(x, y),
            lambda: [leaf(t, s.vocab, scale=2.0), targets()],
            memory=True,
        ),
    ]


def _outputs(fn: Callable[..., Any], inputs: list[Any]) -> tuple[Any, ...]:
    out = fn(*inputs)
    return out if isinstance(out, tuple) else (out,)


def _fwd_bwd(fn: Callable[..., Any], inputs: list[Any], upstream: tuple[Any, ...]) -> tuple[Any, ...]:
    import torch

    outs = _outputs(fn, inputs)
    leaves = [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]
    return outs + torch.autograd.grad(outs, leaves, upstream)


def _max_error(case: Case, upstream: tuple[Any, ...], inputs: list[Any]) -> float:
    """Largest difference between fused and eager outputs and gradients, relative to eager's
    largest magnitude (so one number reads the same for every case)."""
    fused = _fwd_bwd(case.fused, inputs, upstream)
    eager = _fwd_bwd(case.eager, inputs, upstream)
    worst = 0.0
    for a, b in zip((t.detach() for t in fused), (t.detach() for t in eager)):
        scale = max(float(b.float().abs().max()), 1e-6)
        worst = max(worst, float((a.float() - b.float()).abs().max()) / scale)
    return worst


def _time(
    fn: Callable[..., Any], inputs: list[Any], upstream: tuple[Any, ...], runs: int, warmup: int
) -> float:
    """Median milliseconds of one forward + backward."""
    import torch

    for _ in range(warmup):
        _fwd_bwd(fn, inputs, upstream)
    times = []
    if torch.cuda.is_available() and inputs[0].is_cuda:
        torch.cuda.synchronize()
        for _ in range(runs):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            _fwd_bwd(fn, inputs, upstream)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    else:
        for _ in range(runs):
            t0 = time.perf_counter()
            _fwd_bwd(fn, inputs, upstream)
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _peak_mib(fn: Callable[..., Any], inputs: list[Any], upstream: tuple[Any, ...]) -> float:
    """Peak memory of one forward + backward above what was allocated before it."""
    import torch

    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = _fwd_bwd(fn, inputs, upstream)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return peak / 2**20


def run(case: Case, runs: int, warmup: int, measure_memory: bool) -> Result:
    import torch

    inputs = case.inputs()
    outs = _outputs(case.fused, inputs)
    upstream = tuple(torch.randn_like(o) for o in outs)
    del outs
    err = _max_error(case, upstream, inputs)
    fused = _time(case.fused, inputs, upstream, runs, warmup)
    eager = _time(case.eager, inputs, upstream, runs, warmup)
    res = Result(case.name, fused, eager, eager / fused, err)
    if case.memory and measure_memory:
        res.fused_peak_mib = _peak_mib(case.fused, inputs, upstream)
        res.eager_peak_mib = _peak_mib(case.eager, inputs, upstream)
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=50, help="timed runs per kernel (median reported)")
    p.add_argument("--warmup", type=int, default=10, help="untimed runs first (Triton compiles in the first)")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    p.add_argument("--only", default="", help="run the cases whose name contains this text")
    p.add_argument("--json", default="", help="also write the results to this file")
    p.add_argument(
        "--cpu-smoke", action="store_true", help="no GPU: tiny shapes under Triton's interpreter, a few runs"
    )
    args = p.parse_args()

    if args.cpu_smoke:
        # Before triton is first imported: the jit decorator reads it when the kernels are defined.
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    if args.cpu_smoke:
        device, shapes, runs, warmup = "cpu", SMOKE_SHAPES, 2, 1
    elif torch.cuda.is_available():
        device, shapes, runs, warmup = "cuda", GPU_SHAPES, args.runs, args.warmup
    else:
        sys.exit(
            "bench_kernels: no CUDA device here, so there is nothing to measure. Run it on a GPU machine, "
            "or pass --cpu-smoke to check that the script runs (tiny shapes under Triton's interpreter; "
            "its times mean nothing)."
        )
    if runs < 1:
        sys.exit("bench_kernels: --runs must be at least 1")

    import triton

    from autopar.program import kernels as K

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    probe = torch.zeros(1, device=device)
    if K.backend(probe) != "triton":
        sys.exit(
            f"bench_kernels: the fused ops would run their eager fallback on {device}; nothing to compare"
        )
    torch.manual_seed(0)
    name = (
        torch.cuda.get_device_name() if device == "cuda" else "CPU (Triton interpreter: times mean nothing)"
    )
    print(f"device: {name}")
    print(
        f"torch {torch.__version__}, triton {triton.__version__}, dtype {args.dtype}, shapes {asdict(shapes)}"
    )
    print(f"forward + backward, median of {runs} runs after {warmup} warm-up runs\n")
    header = f"{'kernel':<26} {'fused ms':>10} {'eager ms':>10} {'speed-up':>9} {'rel. err':>9}"
    print(header)
    print("-" * len(header))
    results = []
    for case in cases(shapes, device, dtype):
        if args.only and args.only not in case.name:
            continue
        res = run(case, runs, warmup, measure_memory=device == "cuda")
        results.append(res)
        flag = "" if res.max_error < 0.05 else "   ← fused differs from eager: check the kernel"
        print(
            f"{res.name:<26} {res.fused_ms:>10.3f} {res.eager_ms:>10.3f} {res.speedup:>8.2f}× "
            f"{res.max_error:>9.1e}{flag}"
        )
        if device == "cuda":
            torch.cuda.empty_cache()
    for res in results:
        if res.fused_peak_mib is not None:
            print(
                f"\n{res.name} peak memory above the logits: fused {res.fused_peak_mib:.0f} MiB, "
                f"eager {res.eager_peak_mib:.0f} MiB ({res.eager_peak_mib / max(res.fused_peak_mib, 1e-9):.2f}× less)"
            )
    if results:
        geo = math.exp(statistics.fmean(math.log(r.speedup) for r in results))
        print(f"\ngeometric mean speed-up: {geo:.2f}×")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"device": name, "dtype": args.dtype, "results": [asdict(r) for r in results]}, f, indent=2
            )


if __name__ == "__main__":
    main()

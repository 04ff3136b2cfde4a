"""Gradient compression as a plan choice: what it costs in learning, what it sends, what it gains.

    python examples/compression.py converge [--steps 200] [--ranks 2 4 8] [--warmup 0 20] [--seeds 1 2 3]
                                            [--densities 0.01 0.1]
    python examples/compression.py ethernet [--models llama3-8b gpt3-1.3b:128] [--no-baseline] [--nodes 8]

* ``converge`` — a small GPT (2 layers, width 64) trained data parallel on 4 gloo processes for
  ``--steps`` AdamW steps on a stream of sequences from a fixed random bigram table (two
  successors per token: at best ``ln 2`` nats a token), once reducing its gradients exactly, once
  in bf16, once in fp8 with error feedback, once with top-k at each ``--densities`` and once with
  PowerSGD at each ``--ranks`` and each ``--warmup`` (steps reduced exactly before PowerSGD starts,
  PyTorch's ``start_powerSGD_iter``); then each final model's loss on held-out
  sequences, against the exact run's, and the bytes one rank's collectives carried in the last
  step (counted as they are issued) against the plan's prediction. With several ``--seeds`` (the
  training stream's; the held-out sequences stay the same) every variant trains once per seed and
  the loss is the mean over the seeds, with the spread of each seed's ratio to its own exact run:
  one stream's difference is partly the stream's.
* ``ethernet`` — each model's shape planned for ``--nodes`` nodes × 8 H100 joined by one 400 Gb/s
  Ethernet NIC per node (``Cluster.preset(network="ethernet-400g")``): the best Megatron-LM layout
  for that cluster (``layouts.best_megatron``, every knob tuned; it compresses nothing: Megatron-LM
  has no gradient compression), autopar's plan with exact gradients, the same with every gradient
  all-reduce held to one ring (``Cluster.two_level=False``: no two-level reduction), autopar's plan with compression
  allowed (``allow_compression=True``), and autopar's plan made for the same nodes on InfiniBand
  (one NIC per GPU) as if the network were uniform, run on Ethernet: its layout (mesh, every
  weight's placement, pipeline cut, micro-batches, recomputation) held and played there. Each with
  its simulated step: compute and collectives, exposed gradient reduction, optimizer.

Models (meta device, bf16): ``llama3-8b`` (``autopar.zoo``, 64 × 8192 tokens a step) and
``gpt3-1.3b`` (``autopar.models.GPT`` with GPT-3's 1.3B shape, Brown et al. 2020 Table 2.1: 24
layers, width 2048, 16 heads; 512 × 2048 tokens, its published batch of 1M tokens); ``name:B``
plans ``B`` sequences a step instead.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

import autopar

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


# ----------------------------------------------------------------------------------- converge


def converge(
    steps: int, ranks: list[int], warmups: list[int], seeds: list[int], densities: list[float]
) -> None:
    from test_compression import _bigram_batches, _gpt, _train, held_out_loss

    from autopar.runtime.launch import spawn

    model, data = _gpt(), _bigram_batches(1, seed=1)
    cluster = autopar.Cluster.local(4)
    variants: dict[str, dict[str, Any]] = {"exact": {}, "bf16": {"compression": "bf16"}}
    for r in ranks:
        for w in warmups:
            name = f"powersgd rank {r}" + (f", warmup {w}" if w else "")
            variants[name] = {"compression": "powersgd", "compression_rank": r, "compression_warmup": w}
    variants["fp8"] = {"compression": "fp8"}
    for d in densities:
        variants[f"top-k {d * 100:g} %"] = {"compression": "topk", "compression_density": d}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plans = {
            k: autopar.layouts.megatron(model, data[0], cluster, tp=1, **kw) for k, kw in variants.items()
        }
    t0 = time.perf_counter()
    runs = [spawn(_train, 4, plans, steps, seed, timeout=3600)[0] for seed in seeds]
    print(f"4 gloo processes, {steps} AdamW steps, training stream seed{'s' if len(seeds) > 1 else ''} "
          f"{', '.join(map(str, seeds))} ({time.perf_counter() - t0:.0f} s)")  # fmt: skip
    print(f"{'reduction':<28} {'held-out loss':>13} {'vs exact':>9} {'per seed':>22} {'bytes measured':>15} "
          f"{'predicted':>10} {'ratio':>6}")  # fmt: skip
    losses = [{name: held_out_loss(run["state"]) for name, run in out.items()} for out in runs]
    exact = sum(ls["exact"] for ls in losses) / len(losses)
    for name in plans:
        loss = sum(ls[name] for ls in losses) / len(losses)
        each = " ".join(f"{100 * (ls[name] / ls['exact'] - 1):+.1f}" for ls in losses)
        predicted = plans[name].predicted.comm_bytes_per_axis[0]
        sent = runs[0][name]["bytes"][-1]
        print(
            f"{name:<28} {loss:>13.4f} {100 * (loss / exact - 1):>+8.1f}% {each:>22} {sent:>15,} "
            f"{predicted:>10,.0f} {sent / predicted:>6.3f}"
        )


# ----------------------------------------------------------------------------------- ethernet


def _workload(spec: str) -> tuple[torch.nn.Module, Any]:
    """``name`` or ``name:batch`` (sequences a step; default the module docstring's)."""
    name, _, b = spec.partition(":")
    if name == "llama3-8b":
        from autopar import zoo

        w = zoo.load("llama3-8b", batch=int(b or 64), seq=8192)
        return w.model, w.example_inputs
    if name == "gpt3-1.3b":
        from autopar.models import GPT, GPTConfig

        with torch.device("meta"):
            model = GPT(GPTConfig(n_layer=24, n_head=16, n_embd=2048, vocab_size=51200, block_size=2048))
            model = model.to(torch.bfloat16)
        ids = torch.empty(int(b or 512), 2048, dtype=torch.long, device="meta")
        return model, (ids, ids.clone())
    raise SystemExit(f"unknown model {name!r}")


def _row(label: str, plan: Any, t: float) -> str:
    sim = plan.info.get("simulated", {})
    pipe = plan.pipeline
    layout = f"mesh {dict(zip(plan.mesh_axes, plan.mesh_shape))}"
    if pipe is not None:
        layout += f", pp {pipe.pp} × {pipe.microbatches} mb"
    if plan.recompute != "none":
        layout += f", recompute {plan.recompute}"
    if plan.compression is not None:
        layout += f", {plan.compression.describe()}"
    tried = plan.info.get("compression_tried")
    if tried:
        layout += "; compression tried: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in tried.items())
    return (
        f"  {label:<34} {plan.predicted.step_time * 1e3:>9.1f} ms  compute+coll "
        f"{sim.get('compute_and_comm', 0) * 1e3:>7.1f}  exposed reduction {sim.get('exposed_grad_sync', 0) * 1e3:>7.1f}"
        f"  optimizer {sim.get('optimizer', 0) * 1e3:>5.1f}  [{layout}; planned in {t:.0f} s]"
    )


def held(plan: Any, model: Any, inputs: Any, cluster: Any) -> Any:
    """``plan``'s whole layout (mesh, every weight's placement, pipeline cut, micro-batches,
    schedule, recomputation) played on ``cluster``."""
    pipe = plan.pipeline
    fixed = {k: tuple(v) for k, v in plan.params.items()}
    kw: dict[str, Any] = {
        "mesh_shape": tuple(plan.mesh_shape),
        "fixed": fixed,
        "recompute": plan.recompute,
        "pp": pipe.pp if pipe is not None else 1,
        "microbatches": pipe.microbatches if pipe is not None else 1,
    }
    if pipe is not None:
        kw.update(schedule=pipe.schedule, virtual=pipe.virtual, stage_of=dict(pipe.stage_of))
    return autopar.plan(model, inputs, cluster, **kw)


def planned(candidates: list[tuple[str, Any]], row: Any) -> dict[str, Any]:
    """Each ``(label, make plan)`` planned, warnings silenced, its ``row(label, plan, seconds)``
    printed as it comes."""
    rows: dict[str, Any] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for label, fn in candidates:
            t0 = time.perf_counter()
            rows[label] = fn()
            print(row(label, rows[label], time.perf_counter() - t0), flush=True)
    return rows


def _compare(name: str, eth: Any, ib: Any, baseline: bool) -> None:
    """One model's rows (module docstring)."""
    model, inputs = _workload(name)
    print(f"\n{name}")
    candidates = [
        ("autopar, exact gradients", lambda: autopar.plan(model, inputs, eth)),
        (
            "autopar, exact, one-ring reductions",
            lambda: autopar.plan(model, inputs, replace(eth, two_level=False)),
        ),
        ("autopar, compression allowed", lambda: autopar.plan(model, inputs, eth, allow_compression=True)),
        (
            "autopar planned for InfiniBand",
            lambda: held(autopar.plan(model, inputs, ib), model, inputs, eth),
        ),
    ]
    if baseline:
        candidates.append(
            ("best Megatron-LM layout", lambda: autopar.layouts.best_megatron(model, inputs, eth))
        )
    rows = planned(candidates, _row)
    best = rows["autopar, compression allowed"].predicted.step_time
    for label, plan in rows.items():
        print(f"  compression allowed vs {label}: {plan.predicted.step_time / best:.3f}×")


def ethernet(models: list[str], baseline: bool, nodes: int = 8) -> None:
    eth = autopar.Cluster.preset("H100-SXM", gpus_per_node=8, nodes=nodes, network="ethernet-400g")
    ib = autopar.Cluster.preset("H100-SXM", gpus_per_node=8, nodes=nodes)
    print(f"cluster: {eth.describe()}")
    for name in models:
        _compare(name, eth, ib, baseline)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    c = sub.add_parser("converge")
    c.add_argument("--steps", type=int, default=200)
    c.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    c.add_argument("--warmup", type=int, nargs="+", default=[0])
    c.add_argument("--seeds", type=int, nargs="+", default=[1])
    c.add_argument("--densities", type=float, nargs="+", default=[0.01], help="top-k's shares sent")
    e = sub.add_parser("ethernet")
    e.add_argument("--models", nargs="+", default=["llama3-8b", "gpt3-1.3b"])
    e.add_argument("--no-baseline", action="store_true", help="skip best_megatron (slow)")
    e.add_argument("--nodes", type=int, default=8, help="nodes of 8 H100, one 400 Gb/s NIC each")
    args = p.parse_args()
    if args.what == "converge":
        converge(args.steps, args.ranks, args.warmup, args.seeds, args.densities)
    else:
        ethernet(args.models, not args.no_baseline, args.nodes)


if __name__ == "__main__":
    main()

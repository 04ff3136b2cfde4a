"""Plans for a cluster of two GPU generations: what knowing the difference is worth.

    python examples/heterogeneous.py [--models gpt3-1.3b llama3-8b] [--groups A100-80GB:4 H100-SXM:4]
                                     [--no-baseline]

The cluster is ``--groups`` (default four nodes of 8 × A100-80GB, then four of 8 × H100-SXM,
``autopar.Cluster.mixed``), one InfiniBand HDR NIC per GPU. For each model:

* **best Megatron-LM layout** (``layouts.best_megatron``, every knob tuned): Megatron-LM knows one
  device kind, so its stages hold equal layer counts and its data-parallel ranks equal shares;
  played on the mixed cluster, each pipeline rank on its own devices;
* **autopar as if uniform**: autopar's plan made for the same nodes as if every one were the
  ``--as-if`` kind (default each kind of the cluster in turn), its layout (mesh, every weight's
  placement, pipeline cut, micro-batches, schedule, recomputation) held and played on the mixed
  cluster (``PlanConfig.stage_of`` holds the cut);
* **autopar**: the plan made for the mixed cluster (``autopar.pipelined``: each pipeline rank on
  its own devices, the cut balanced on them; or one stage whose data-parallel replicas run
  unequal shares of the micro-batches, ``autopar.dp_shares``).

Each with its simulated step (compute and collectives, pipeline bubble, exposed gradient
reduction, optimizer) and the pipeline's stage sizes (repeated layers per stage).

Models (meta device, bf16): ``llama3-8b`` (``autopar.zoo``, 64 × 8192 tokens a step),
``gpt3-1.3b`` (``autopar.models.GPT``, GPT-3's 1.3B shape: 24 layers, width 2048, 16 heads;
512 × 2048 tokens). ``name:B`` plans ``B`` sequences a step instead.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import autopar

sys.path.insert(0, str(Path(__file__).resolve().parent))

from compression import _workload, held, planned  # the same model shapes and helpers


def _layers(plan: Any) -> str:
    """Repeated layers per stage (``"8 | 16"``), from the stage each layer's first op runs in."""
    pipe = plan.pipeline
    if pipe is None:
        return "one stage"
    first: dict[str, int] = {}
    for n in plan.nodes:
        parts = n.module.split(".")
        idx = next((i for i, p in enumerate(parts) if p.isdigit()), None)
        if idx is None or n.name not in pipe.stage_of:
            continue
        first.setdefault(".".join(parts[: idx + 1]), pipe.stage_of[n.name] % pipe.pp)
    per = Counter(first.values())
    return " | ".join(str(per[r]) for r in range(pipe.pp)) + " layers per pipeline rank"


def _row(label: str, plan: Any, t: float) -> str:
    sim = plan.info.get("simulated", {})
    pipe = plan.pipeline
    layout = f"mesh {dict(zip(plan.mesh_axes, plan.mesh_shape))}"
    if pipe is not None:
        layout += f", pp {pipe.pp} × {pipe.microbatches} mb {pipe.schedule}" + (
            f" v={pipe.virtual}" if pipe.virtual > 1 else ""
        )
    if pipe is not None and pipe.dp_shares:
        runs = sorted(set(pipe.dp_shares))
        layout += f", unequal data-parallel shares {':'.join(map(str, runs))} of {sum(pipe.dp_shares)} micro-batches"
    if plan.recompute != "none":
        layout += f", recompute {plan.recompute}"
    return (
        f"  {label:<34} {plan.predicted.step_time * 1e3:>9.1f} ms  compute+coll "
        f"{sim.get('compute_and_comm', 0) * 1e3:>7.1f}  bubble {sim.get('bubble_fraction', 0) * 100:>4.1f} %"
        f"  exposed reduction {sim.get('exposed_grad_sync', 0) * 1e3:>6.1f}  optimizer {sim.get('optimizer', 0) * 1e3:>5.1f}"
        f"\n  {'':<34} [{layout}; {_layers(plan)}; planned in {t:.0f} s]"
    )


def compare(name: str, cluster: Any, as_if: list[str], baseline: bool) -> None:
    model, inputs = _workload(name)
    print(f"\n{name}")
    candidates = [("autopar", lambda: autopar.plan(model, inputs, cluster))]
    for kind in as_if:
        candidates.append(
            (
                f"autopar as if all {kind}",
                lambda kind=kind: held(
                    autopar.plan(model, inputs, cluster.uniform(kind)), model, inputs, cluster
                ),
            )
        )
    if baseline:
        candidates.append(
            ("best Megatron-LM layout", lambda: autopar.layouts.best_megatron(model, inputs, cluster))
        )
    rows = planned(candidates, _row)
    best = rows["autopar"].predicted.step_time
    for label, plan in rows.items():
        if label != "autopar":
            print(f"  autopar vs {label}: {plan.predicted.step_time / best:.3f}×")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["gpt3-1.3b", "llama3-8b"])
    p.add_argument(
        "--groups", nargs="+", default=["A100-80GB:4", "H100-SXM:4"], help="PRESET:NODES, in rank order"
    )
    p.add_argument(
        "--as-if", nargs="*", default=None, help="uniform kinds to plan as (default: each group's)"
    )
    p.add_argument("--no-baseline", action="store_true", help="skip best_megatron (slow)")
    args = p.parse_args()
    groups = [(g.split(":")[0], int(g.split(":")[1])) for g in args.groups]
    cluster = autopar.Cluster.mixed(groups)
    print(f"cluster: {cluster.describe()}")
    as_if = args.as_if if args.as_if is not None else list(dict.fromkeys(k for k, _ in groups))
    for name in args.models:
        compare(name, cluster, as_if, not args.no_baseline)


if __name__ == "__main__":
    main()

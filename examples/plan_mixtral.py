"""Plan Mixtral-8x7B (transformers' ``MixtralForCausalLM``, built on the meta device) for 8 nodes ×
8 H100 and compare autopar's plan with Megatron-LM's layouts with expert parallelism.

* **autopar** — ``autopar.plan`` with its full search: meshes, placements, ZeRO, expert
  parallelism, pipelines as the planner searches them by default (``pp="auto"``: one stage, and
  pipelines of whole nodes), ``recompute="auto"`` (the lightest that fits).
* **best Megatron** — ``autopar.layouts.best_megatron``: Megatron-LM's knobs (tp, pp, ep,
  micro-batch size, schedule, sequence parallelism, recomputation, distributed optimizer) tuned
  as its guides tune them, each candidate a Megatron layout planned and simulated.
* **rule of thumb** — tp = 8 inside a node, ep = 8 across the nodes, the rest data-parallel
  (sequence parallelism and the distributed optimizer on, the lightest recomputation that fits).
* **Megatron-LM's script** — the setting of ``examples/mixtral/train_mixtral_8x7b_distributed.sh``
  in Megatron-LM: tp = 1, pp = 4, ep = 8, micro-batch size 1, the distributed optimizer.

One global batch is 64 sequences of 4096 tokens, bf16 with AdamW (fp32 master weights and moments).
A layout that does not fit is printed with the reason. ``--quick`` holds ``best_megatron``'s
micro-batch size at 1 (Megatron-LM's Mixtral setting) to shorten the search.

    python examples/plan_mixtral.py [--layers 32] [--batch 64] [--seq 4096] [--nodes 8] [--quick]
"""

from __future__ import annotations

import argparse
import time
import warnings
from collections.abc import Callable

import torch

import autopar
from autopar.solver import InfeasibleError


def build(layers: int, batch: int, seq: int):
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(
        num_hidden_layers=layers,
        hidden_size=4096,
        intermediate_size=14336,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=32000,
        num_local_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=seq,
        use_cache=False,
        dtype=torch.bfloat16,
    )
    with torch.device("meta"):
        model = MixtralForCausalLM(cfg).to(torch.bfloat16)
    ids = torch.empty(batch, seq, dtype=torch.long, device="meta")
    return model, {"input_ids": ids, "labels": ids.clone()}


def layout(plan: autopar.Plan) -> str:
    """Mesh, pipeline and recomputation of a plan, in one line."""
    mesh = " × ".join(f"{a}={n}" for a, n in zip(plan.mesh_axes, plan.mesh_shape))
    pipe = plan.pipeline
    stages = (
        f"pp={pipe.pp} ({pipe.schedule}{f', v={pipe.virtual}' if pipe.virtual > 1 else ''}, "
        f"{pipe.microbatches} micro-batches)"
        if pipe is not None and pipe.pp > 1
        else "pp=1"
    )
    return f"{mesh}, {stages}, recompute={plan.recompute}"


def where_the_time_goes(plan: autopar.Plan) -> str:
    """The simulated step taken apart, and the bytes each mesh axis moves."""
    p, sim = plan.predicted, plan.info.get("simulated", {})
    parts = [f"compute {p.compute_time:.3f} s", f"comm {p.comm_time:.3f} s (solver's sums)"]
    if "bubble_fraction" in sim:
        parts.append(f"pipeline bubble {sim['bubble_fraction']:.0%}")
    parts.append(f"exposed gradient sync {sim.get('exposed_grad_sync', 0.0):.3f} s")
    parts.append(f"optimizer {sim.get('optimizer', 0.0):.3f} s")
    comm = ", ".join(f"{a} {b / 2**30:.1f} GiB" for a, b in zip(plan.mesh_axes, p.comm_bytes_per_axis))
    return "; ".join(parts) + f"; moved per step: {comm}"


def show(name: str, plan: autopar.Plan | None, why: str, seconds: float) -> None:
    if plan is None:
        print(f"{name:<22} does not fit: {why}  [{seconds:.0f} s]")
        return
    p = plan.predicted
    print(
        f"{name:<22} step {p.step_time:6.3f} s  memory {p.memory_per_device / 2**30:5.1f} GiB  "
        f"{plan.info.get('layout', 'auto')}  [{seconds:.0f} s]"
    )
    print(f"{'':<22} {layout(plan)}")
    print(f"{'':<22} {where_the_time_goes(plan)}")


def attempt(make: Callable[[], autopar.Plan]) -> tuple[autopar.Plan | None, str, float]:
    """``make()``'s plan, or ``None`` and why it does not fit; and the seconds planning took."""
    t0 = time.perf_counter()
    try:
        return make(), "", time.perf_counter() - t0
    except (InfeasibleError, ValueError) as e:
        return None, " ".join(str(e).split())[:300], time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--nodes", type=int, default=8)
    ap.add_argument("--quick", action="store_true", help="best_megatron with micro-batch size 1 only")
    args = ap.parse_args()
    warnings.simplefilter("ignore")  # ops without a sharding rule (diff, new_ones): noted in print(plan)
    t_all = time.perf_counter()
    cluster = autopar.Cluster.preset("H100-SXM", gpus_per_node=8, nodes=args.nodes)
    model, batch = build(args.layers, args.batch, args.seq)
    print(
        f"Mixtral-8x7B shape, {args.layers} layers, batch {args.batch} × {args.seq}, on {cluster.describe()}\n"
    )
    world = cluster.world_size
    knobs = {"microbatch_size": 1} if args.quick else {}
    plans = {
        "autopar": attempt(lambda: autopar.plan(model, batch, cluster, recompute="auto")),
        "best Megatron": attempt(lambda: autopar.layouts.best_megatron(model, batch, cluster, **knobs)),
        "rule of thumb": attempt(
            lambda: autopar.layouts.megatron(
                model,
                batch,
                cluster,
                tp=8,
                ep=8,
                sequence_parallel=True,
                distributed_optimizer=True,
                recompute="auto",
            )
        ),
        "Megatron-LM's script": attempt(
            lambda: autopar.layouts.megatron(
                model,
                batch,
                cluster,
                tp=1,
                ep=8,
                pp=4,
                microbatches=args.batch // (world // 4),
                sequence_parallel=False,
                distributed_optimizer=True,
                recompute="auto",
            )
        ),
    }
    for name, (plan, why, seconds) in plans.items():
        show(name, plan, why, seconds)
    auto, best = plans["autopar"][0], plans["best Megatron"][0]
    if best is not None:
        c = best.info["megatron_candidates"]
        planned = sum(1 for t in c if not t.get("skipped"))
        print(
            f"\nbest_megatron planned {planned} candidates ({sum(1 for t in c if t.get('feasible'))} fit) and "
            f"skipped {len(c) - planned} by its pruning rules, in {best.info['megatron_search_time']:.0f} s:"
        )
        for t in c:
            if not t.get("skipped"):
                knobs = " ".join(
                    f"{k}={t[k]}" for k in ("tp", "pp", "ep", "mbs", "schedule", "sp", "recompute")
                )
                got = f"{t['step_time']:.3f} s" if t["feasible"] else f"does not fit ({t['why'][:80]})"
                print(f"  {knobs} distributed_optimizer={t['distributed_optimizer']}: {got}")
    print()
    for name, (plan, _, _) in plans.items():
        if name != "autopar" and plan is not None and auto is not None:
            ratio = plan.predicted.step_time / auto.predicted.step_time
            than = f"{ratio:.2f}× faster than" if ratio >= 1 else f"{1 / ratio:.2f}× slower than"
            print(f"autopar's predicted step is {than} {name}'s")
    for name, plan in (("autopar", auto), ("best Megatron", best)):
        if plan is not None:
            print(f"\n===== {name} =====")
            print(plan.table(max_rows=12))
    print(f"\nwhole run: {time.perf_counter() - t_all:.0f} s")


if __name__ == "__main__":
    main()

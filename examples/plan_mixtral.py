"""Plan Mixtral-8x7B (transformers' ``MixtralForCausalLM``, built on the meta device) for 8 nodes ×
8 H100, and compare with Megatron-LM's layouts with expert parallelism.

The baseline is the best of ``layouts.megatron(tp, ep)`` over tensor-parallel sizes 1, 2, 4, 8 and
expert-parallel sizes 1, 2, 4, 8 (dividing the data-parallel size), each a point of the same
search space with Megatron-LM's rules fixed: its weights used where they lie, experts split over
``ep`` and not over ``tp`` (expert tensor parallel size 1). One global batch is 64 × 4096 tokens.

    python examples/plan_mixtral.py [--layers 32] [--batch 64] [--seq 4096]
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch

import autopar


def build(layers: int, batch: int, seq: int):
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(
        num_hidden_layers=layers, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=32000, num_local_experts=8, num_experts_per_tok=2,
        max_position_embeddings=seq, use_cache=False, dtype=torch.bfloat16,
    )  # fmt: skip
    with torch.device("meta"):
        model = MixtralForCausalLM(cfg).to(torch.bfloat16)
    ids = torch.empty(batch, seq, dtype=torch.long, device="meta")
    return model, {"input_ids": ids, "labels": ids.clone()}


def line(name: str, plan: autopar.Plan) -> str:
    mesh = " × ".join(f"{a}={n}" for a, n in zip(plan.mesh_axes, plan.mesh_shape))
    p = plan.predicted
    return (
        f"{name:<30} {mesh:<18} step {p.step_time:7.3f} s (compute {p.compute_time:6.3f}, comm {p.comm_time:6.3f})"
        f"  memory {p.memory_per_device / 2**30:6.1f} GiB"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq", type=int, default=4096)
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    cluster = autopar.Cluster.preset("H100-SXM", gpus_per_node=8, nodes=8)
    model, batch = build(args.layers, args.batch, args.seq)
    cap = autopar.capture(model, batch)
    t0 = time.perf_counter()
    auto = autopar.planner.plan_captured(cap, cluster)
    print(line("autopar", auto), f"  planned in {time.perf_counter() - t0:.0f} s")
    best = None
    for tp in (1, 2, 4, 8):
        for ep in (1, 2, 4, 8):
            if (64 // tp) % ep:
                continue
            try:
                meg = autopar.layouts.megatron(model, batch, cluster, tp=tp, ep=ep, captured=cap)
            except autopar.solver.InfeasibleError:
                print(f"megatron(tp={tp}, ep={ep}): does not fit")
                continue
            print(line(f"megatron(tp={tp}, ep={ep})", meg))
            if best is None or meg.predicted.step_time < best.predicted.step_time:
                best = meg
    print(line("best Megatron", best))
    print(
        f"autopar / best Megatron with expert parallelism: {best.predicted.step_time / auto.predicted.step_time:.2f}× faster"
    )
    print(auto.table(max_rows=40))


if __name__ == "__main__":
    main()

"""Benchmark: end-to-end planning time of an 8B LLaMA for 8 nodes × 8 H100.

Capture (torch.export on the meta device) + annotation + solve, as ``autopar.plan`` runs them,
for LLaMA-3-8B's shape (32 layers, hidden 4096, 32 heads, 8 KV heads, FFN 14336, vocab 128256),
one global batch of 64 × 8192 tokens. Also times the solve of an 8-layer model to show that
solve time barely grows with depth (repeated layers share decision variables).

    python examples/plan_llama8b.py            # full 8B, plus the 8-layer comparison
    python examples/plan_llama8b.py --layers 8 # one depth only
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch

import autopar
from autopar.capture import capture
from autopar.planner import plan_captured


def llama(layers: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        num_hidden_layers=layers,
        hidden_size=4096,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=14336,
        vocab_size=128256,
        max_position_embeddings=8192,
        use_cache=False,
        torch_dtype=torch.bfloat16,
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    return model


def run(layers: int, batch: int, seq: int, cluster: autopar.Cluster) -> dict[str, float]:
    t0 = time.perf_counter()
    model = llama(layers)
    ids = torch.empty(batch, seq, dtype=torch.long, device="meta")
    t1 = time.perf_counter()
    cap = capture(model, {"input_ids": ids, "labels": ids.clone()})
    t2 = time.perf_counter()
    plan = plan_captured(cap, cluster, mixed_precision=True)
    t3 = time.perf_counter()
    solve = sum(m.get("solve_time", 0.0) for m in plan.info["meshes_tried"])
    strat = sum(m.get("strategy_time", 0.0) for m in plan.info["meshes_tried"])
    return {
        "nodes": len(cap.graph.nodes),
        "build": t1 - t0,
        "capture": t2 - t1,
        "plan": t3 - t2,
        "strategies": strat,
        "solve": solve,
        "total": t3 - t1,
        "plan_obj": plan,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, nargs="*", default=[32, 8])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--nodes", type=int, default=8)
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    cluster = autopar.Cluster.preset("H100-SXM", gpus_per_node=8, nodes=args.nodes)
    print(f"cluster: {cluster.describe()}; batch {args.batch} × {args.seq} tokens")
    results = {}
    for layers in args.layers:
        r = run(layers, args.batch, args.seq, cluster)
        results[layers] = r
        plan = r["plan_obj"]
        print(
            f"LLaMA {layers} layers: {r['nodes']} nodes | capture {r['capture']:.2f} s | annotate+solve "
            f"{r['plan']:.2f} s (strategies {r['strategies']:.2f} s, CP-SAT {r['solve']:.2f} s over "
            f"{len(plan.info['meshes_tried'])} meshes) | end-to-end {r['total']:.2f} s"
        )
        print("  " + plan.summary().replace("\n", "\n  "))
        for m in plan.info["meshes_tried"]:
            if m["feasible"]:
                print(
                    f"    mesh {m['mesh']}: predicted {m['objective'] * 1e3:.1f} ms, solve {m['solve_time']:.2f} s, "
                    f"{m['classes']} classes, {m['edge_vars']} edge variables, {'optimal' if m['optimal'] else 'feasible'}"
                )
            else:
                print(f"    mesh {m['mesh']}: {'slower (pruned)' if m.get('pruned') else 'infeasible'}")
    if 32 in results and 8 in results:
        print(
            f"solve time 8 layers {results[8]['solve']:.2f} s vs 32 layers {results[32]['solve']:.2f} s "
            f"(×{results[32]['solve'] / max(results[8]['solve'], 1e-9):.2f} for 4× the depth)"
        )


if __name__ == "__main__":
    main()

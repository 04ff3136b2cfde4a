"""Benchmark: planning time of an 8B LLaMA for 8 nodes × 8 H100.

LLaMA-3-8B's shape (32 layers, hidden 4096, 32 heads, 8 KV heads, FFN 14336, vocab 128256) on the
meta device, one global batch of 64 × 8192 tokens.

* default: capture (torch.export) + annotation + solve of the one-stage plan (``plan_captured``),
  and the same for an 8-layer model, to show that solve time barely grows with depth (repeated
  layers share decision variables);
* ``--search``: the whole 3D search as ``autopar.plan`` (and the ``autopar plan`` command) runs
  it, in bf16 and in fp32: every candidate tried, pruned or skipped, and the time of each phase.
  The figure of record is the command itself, which also counts starting Python and importing
  transformers: ``time autopar plan llama3-8b --cluster H100-SXM --nodes 8 --batch 64 --seq 8192
  --dtype bf16 -q`` (and ``--dtype fp32``).

    python examples/plan_llama8b.py            # full 8B, plus the 8-layer comparison
    python examples/plan_llama8b.py --layers 8 # one depth only
    python examples/plan_llama8b.py --search   # the 3D search, bf16 and fp32
    python examples/plan_llama8b.py --microbatch   # one micro-batch graph, two ways

* ``--microbatch``: the graph of one of 8 micro-batches read from the model cut to one layer of each kind
  (``autopar.cut_export``) against specialising an export of all 32 layers with a symbolic batch,
  each timed after the whole batch's capture, and whether both give the same graph (fingerprint).
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch

import autopar
from autopar.capture import capture
from autopar.config import PlanConfig
from autopar.display import solver_status
from autopar.plan_search import plan_model
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


def search(dtype: torch.dtype, batch: int, seq: int, cluster: autopar.Cluster) -> None:
    """The whole 3D search (``autopar.plan``), each phase timed from the planner's log."""
    import logging

    t0 = time.perf_counter()
    model = llama(32).to(dtype)
    ids = torch.empty(batch, seq, dtype=torch.long, device="meta")
    t1 = time.perf_counter()
    cap = capture(model, {"input_ids": ids, "labels": ids.clone()})
    t2 = time.perf_counter()
    events: list[tuple[float, str]] = []

    class Timed(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            progress = getattr(record, "progress", None)
            if progress is not None and not progress.started:
                events.append((time.perf_counter() - t2, progress.task))

    handler = Timed()
    logger = logging.getLogger("autopar.planner")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        plan = plan_model(
            model, {"input_ids": ids, "labels": ids.clone()}, cluster, PlanConfig(), captured=cap
        )
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    t3 = time.perf_counter()
    pipe = plan.pipeline
    layout = f"pp={pipe.pp} m={pipe.microbatches} {pipe.schedule}, " if pipe else ""
    print(
        f"{str(dtype).replace('torch.', '')}: build {t1 - t0:.2f} s | capture {t2 - t1:.2f} s | 3D search "
        f"{t3 - t2:.2f} s | plan: {layout}mesh {plan.mesh_shape} {plan.mesh_axes}, step "
        f"{plan.predicted.step_time * 1e3:.1f} ms"
    )
    for row in plan.info["pipeline_candidates"]:
        what = (
            f"{row['step_time'] * 1e3:.1f} ms"
            if "step_time" in row
            else f"pruned: {row['pruned']}"
            if "pruned" in row
            else f"skipped: {row['skipped']}"
        )
        name = row.get("candidate") or f"pp={row['pp']}" + (
            f" m={row['microbatches']}" if "microbatches" in row else ""
        )
        print(f"    {name}: {what}")
    print(f"    meshes solved (end times, s): {', '.join(f'{task} {t:.1f}' for t, task in events)}")


def microbatch(layers: int, batch: int, seq: int, m: int = 8) -> None:
    """``--microbatch`` (module docstring)."""
    from autopar.microbatch import MicrobatchCaptures

    model = llama(layers)
    ids = torch.empty(batch, seq, dtype=torch.long, device="meta")
    inputs = {"input_ids": ids, "labels": ids.clone()}
    t0 = time.perf_counter()
    whole = capture(model, inputs)
    t1 = time.perf_counter()
    cut = MicrobatchCaptures(model, inputs, whole=whole)
    got = cut(m)
    t2 = time.perf_counter()
    symbolic = MicrobatchCaptures(model, inputs, whole=whole)
    symbolic.cut_failure = "not asked (the comparison)"
    want = symbolic(m)
    t3 = time.perf_counter()
    print(
        f"LLaMA {layers} layers, batch {batch} x {seq}, one of {m} micro-batches: capture {t1 - t0:.2f} s | "
        f"from the cut model {t2 - t1:.2f} s ({cut.cut_failure or 'cut model used'}) | from the whole "
        f"model's symbolic export {t3 - t2:.2f} s | same graph: {got.fingerprint == want.fingerprint}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, nargs="*", default=[32, 8])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--nodes", type=int, default=8)
    ap.add_argument("--search", action="store_true", help="the whole 3D search, in bf16 and fp32")
    ap.add_argument(
        "--microbatch",
        action="store_true",
        help="one micro-batch graph, from the cut model and from all layers",
    )
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    cluster = autopar.Cluster.preset("H100-SXM", gpus_per_node=8, nodes=args.nodes)
    print(f"cluster: {cluster.describe()}; batch {args.batch} × {args.seq} tokens")
    if args.microbatch:
        microbatch(args.layers[0], args.batch, args.seq)
        return
    if args.search:
        for dtype in (torch.bfloat16, torch.float32):
            search(dtype, args.batch, args.seq, cluster)
        return
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
                status = solver_status(m["optimal"], m.get("gap", 0.0))
                print(
                    f"    mesh {m['mesh']}: predicted {m['objective'] * 1e3:.1f} ms, solve {m['solve_time']:.2f} s, "
                    f"{m['classes']} classes, {m['edge_vars']} edge variables, {status}"
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

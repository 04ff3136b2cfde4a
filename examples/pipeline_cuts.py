"""Stage cuts of a model whose depth is not uniform: autopar's cost-balanced cuts against
Megatron-LM's equal layer counts, on the same stage plan, side by side.

    python examples/pipeline_cuts.py [--vocab 128000] [--hidden 512] [--layers 8] [--pp 4]

The model is ``autopar.models.GPT`` with a vocabulary large next to its hidden size, so its LM
head costs as much as several layers; Megatron-LM puts the head on the last stage on top of its
``L / pp`` layers (``passes.stages.layer_cuts``), autopar balances the stages' forward + backward
time (``passes.stages.stage_cuts``). Printed: each stage's layers and predicted compute, and the
simulated step of both (1F1B, 8 micro-batches, one A100 node).
"""

from __future__ import annotations

import argparse
import warnings

import torch

import autopar
from autopar.capture import capture, microbatch_inputs, normalize_inputs
from autopar.config import PlanConfig
from autopar.graph import outer_instance
from autopar.ir import TENSOR
from autopar.models import GPT, GPTConfig
from autopar.pipelined import pipelined_candidates, stage_cluster
from autopar.planner import plan_captured


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=128000)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=8)
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=args.layers, n_head=8, n_embd=args.hidden, vocab_size=args.vocab,
                              block_size=1024))  # fmt: skip
    ids = torch.empty(4 * args.microbatches, 1024, dtype=torch.long, device="meta")
    cluster = autopar.Cluster.preset("A100-80GB", gpus_per_node=8, nodes=1)
    a, kw = normalize_inputs((ids, ids))
    cap = capture(model, microbatch_inputs(a, kw, args.microbatches))
    config = PlanConfig(schedule="1f1b")
    spmd = plan_captured(cap, stage_cluster(cluster, args.pp), config.replace(memory_budget=1e12))
    budget = config.budget(cluster.device.memory)
    print(f"GPT {args.layers} layers, hidden {args.hidden}, vocabulary {args.vocab}; pp={args.pp}, "
          f"{args.microbatches} micro-batches, 1F1B, {cluster.describe()}")  # fmt: skip
    times = {}
    for name, by_layers in (("equal layer counts (Megatron-LM)", True), ("cost-balanced (autopar)", False)):
        (cand,) = pipelined_candidates(spmd, cap.gm, cluster, config, args.pp, args.microbatches, budget,
                                       by_layers=by_layers)  # fmt: skip
        pipe = cand.plan.pipeline
        per: list[set[str]] = [set() for _ in range(args.pp)]
        for n in cap.gm.graph.nodes:
            s, info = pipe.stage_of.get(n.name), n.meta.get(TENSOR)
            if s is not None and info is not None and info.module.startswith("blocks."):
                per[s].add(outer_instance(info.module))
        print(f"{name}: step {cand.step_time * 1e3:.1f} ms, bubble {pipe.bubble_fraction:.1%}")
        for s, c in enumerate(pipe.stage_costs):
            blocks = sorted(per[s], key=lambda b: int(b.split(".")[1]))
            where = f"{blocks[0]}–{blocks[-1].split('.')[1]}" if blocks else "no layer"
            extra = " + embeddings" if s == 0 else " + LM head" if s == args.pp - 1 else ""
            work = (c["forward"] + c["backward_input"] + c["backward_weight"]) * 1e3
            print(f"  stage {s}: {where:<14}{extra:<13} {work:8.2f} ms per micro-batch")
        times[name] = cand.step_time
    eq, bal = times.values()
    print(f"cost-balanced / equal layers: {bal / eq:.3f} (predicted step time)")


if __name__ == "__main__":
    main()

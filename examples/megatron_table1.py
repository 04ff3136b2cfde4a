"""Megatron-LM's Table 1 (Narayanan et al., SC'21: GPT from 1.7B to 1T parameters on up to 3072
A100s), predicted: for each row, the best Megatron-LM layout at the paper's tensor and pipeline
sizes with full recomputation (micro-batch size and schedule tuned, as the paper tuned them:
``autopar.layouts.best_megatron``), its simulated step turned into TFLOP/s per GPU with the paper's
FLOP count, against the published figure; and with ``--autopar``, autopar's own plan beside it.

    python examples/megatron_table1.py                  # every row (minutes: each row is planned)
    python examples/megatron_table1.py --rows 1 2 5     # some rows (1-based, the CSV's order)
    python examples/megatron_table1.py --rows 1 --autopar

FLOPs per step (the paper's §5.1, with recomputation): ``96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h))``.
The model is ``autopar.models.GPT`` with the row's shape, vocabulary 51200 and sequence 2048 in
bf16 on the meta device, written as Megatron-LM's GPT of 2021 ran (``attention="math"``: the
scores materialised, softmax and dropout on them — FlashAttention came a year later — and dropout
0.1 on the attention probabilities and the residual branches, as in GPT-3); the cluster
``Cluster.preset("A100-80GB", gpus_per_node=8, nodes=gpus/8)`` (DGX A100: one 200 Gb/s NIC per
GPU).
"""

from __future__ import annotations

import argparse
import csv
import time
import warnings

import torch

import autopar
from autopar.models import GPT, GPTConfig
from autopar.reference import data_path

CSV = data_path("megatron_gpt_weak_scaling.csv")
SEQ, VOCAB = 2048, 51200


def rows() -> list[dict[str, str]]:
    with open(CSV) as f:
        return list(csv.DictReader(line for line in f if not line.startswith("#")))


def megatron_flops(batch: int, seq: int, layers: int, hidden: int, vocab: int) -> float:
    return 96 * batch * seq * layers * hidden**2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))


def row_setup(r: dict[str, str]) -> tuple[torch.nn.Module, tuple, autopar.Cluster]:
    """Row ``r``'s model (meta device, bf16), one global batch and cluster (module docstring)."""
    layers, hidden, heads = int(r["layers"]), int(r["hidden"]), int(r["heads"])
    with torch.device("meta"):
        cfg = GPTConfig(n_layer=layers, n_head=heads, n_embd=hidden, block_size=SEQ, vocab_size=VOCAB,
                        attention="math", dropout=0.1)  # fmt: skip
        model = GPT(cfg).to(torch.bfloat16)
    ids = torch.empty(int(r["batch"]), SEQ, dtype=torch.long, device="meta")
    cluster = autopar.Cluster.preset("A100-80GB", gpus_per_node=8, nodes=int(r["gpus"]) // 8)
    return model, (ids, ids), cluster


def megatron_row(r: dict[str, str]) -> tuple[autopar.Plan, float]:
    """Megatron-LM's own layout for row ``r`` in the paper's setting (§5): the row's tp and pp,
    full recomputation in every layer, no sequence parallelism (Korthikanti et al. came a year
    later) and no distributed optimizer (data-parallel gradients all-reduced); micro-batch size
    and schedule tuned, as the paper tuned them. The plan and its predicted TFLOP/s per GPU."""
    model, inputs, cluster = row_setup(r)
    plan = autopar.layouts.best_megatron(model, inputs, cluster, tp=int(r["tp"]), pp=int(r["pp"]), recompute="full",
                                         recompute_num_layers=None, sequence_parallel=False,
                                         distributed_optimizer=False)  # fmt: skip
    flops = megatron_flops(int(r["batch"]), SEQ, int(r["layers"]), int(r["hidden"]), VOCAB)
    return plan, flops / (plan.predicted.step_time * int(r["gpus"])) / 1e12


def _where(plan: autopar.Plan) -> str:
    """The layout of ``plan`` in a few words: pipeline, micro-batches, schedule and mesh."""
    mesh = " × ".join(f"{a}={n}" for a, n in zip(plan.mesh_axes, plan.mesh_shape))
    pipe = plan.pipeline
    return (f"pp={pipe.pp} m={pipe.microbatches} {pipe.schedule} " if pipe else "") + mesh


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="*", help="1-based rows of the table (default: all)")
    ap.add_argument("--autopar", action="store_true", help="also plan with autopar.plan and print the ratio")
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    table = rows()
    picked = args.rows or list(range(1, len(table) + 1))
    print(f"{'row':>3} {'params':>7} {'gpus':>5} {'tp':>3} {'pp':>3} {'layout found':<44} "
          f"{'pred TF/s':>9} {'paper':>6} {'error':>7} {'plan s':>7}" + ("  megatron/autopar" if args.autopar else ""))  # fmt: skip
    for i in picked:
        r = table[i - 1]
        head = f"{i:>3} {r['params_b']:>6}B {int(r['gpus']):>5} {int(r['tp']):>3} {int(r['pp']):>3}"
        t0 = time.perf_counter()
        try:
            plan, pred = megatron_row(r)
        except autopar.solver.InfeasibleError as e:
            line = f"{head} does not fit: {str(e).splitlines()[0][:80]}"
            if args.autopar:  # autopar may still find a layout: its predicted TFLOP/s by the same count
                model, inputs, cluster = row_setup(r)
                try:
                    auto = autopar.plan(model, inputs, cluster, recompute="auto")
                    flops = megatron_flops(int(r["batch"]), SEQ, int(r["layers"]), int(r["hidden"]), VOCAB)
                    tf = flops / (auto.predicted.step_time * int(r["gpus"])) / 1e12
                    line += f"  (autopar: {_where(auto)}, {auto.recompute}: {tf:.1f} TF/s)"
                except autopar.solver.InfeasibleError as e2:
                    line += f"  (autopar: none fits either: {str(e2).splitlines()[0][:80]})"
            print(line, flush=True)
            continue
        took = time.perf_counter() - t0
        paper = float(r["tflops_per_gpu"])
        layout = plan.info.get("layout", "")[:44]
        line = (f"{head} {layout:<44} {pred:>9.1f} {paper:>6.0f} {(pred / paper - 1) * 100:>+6.1f}% "
                f"{took:>7.1f}")  # fmt: skip
        if args.autopar:
            model, inputs, cluster = row_setup(r)
            auto = autopar.plan(model, inputs, cluster, recompute="auto")
            line += f"  {plan.predicted.step_time / auto.predicted.step_time:>6.3f}x (autopar: {_where(auto)}, {auto.recompute})"
        print(line, flush=True)


if __name__ == "__main__":
    main()

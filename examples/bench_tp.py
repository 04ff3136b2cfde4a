"""Benchmark: autopar's generated Megatron-layout module vs PyTorch's own tensor parallelism.

Both run the same LLaMA (transformers' ``LlamaForCausalLM``, random weights) with the same
Megatron-LM layout on 2 gloo processes with one thread each:

* **autopar** — ``autopar.layouts.megatron(model, batch, Cluster.local(2), tp=2)`` lowered by
  ``autopar.parallelize`` to a per-rank program with explicit collectives;
* **PyTorch TP** — ``torch.distributed.tensor.parallel.parallelize_module`` with
  ``ColwiseParallel`` on q/k/v/gate/up, ``RowwiseParallel`` on o/down, a vocabulary-parallel
  embedding (``RowwiseParallel(input_layouts=Replicate())``) and a column-parallel LM head whose
  logits are gathered (``ColwiseParallel(output_layouts=Replicate())``), as torchtitan writes it.

A training step is forward + backward + AdamW step. The two modules are stepped alternately in
the same processes (side by side, same machine state), after warm-up; the script prints the
median step time of each over the timed steps (rank 0's clock, after a barrier), their ratio,
and the losses of the first step of both (they must agree).

    python examples/bench_tp.py                 # default size
    python examples/bench_tp.py --hidden 512 --layers 4 --steps 30
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch


def build(args: argparse.Namespace) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        num_hidden_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads // 2,
        intermediate_size=args.hidden * 3,
        vocab_size=args.vocab,
        max_position_embeddings=args.seq,
        use_cache=False,
    )
    model = LlamaForCausalLM(cfg)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq))
    return model, {"input_ids": ids, "labels": ids.clone()}


def torch_tp(model: torch.nn.Module, world: int) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (world,))
    plan = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
    }
    for i in range(len(model.model.layers)):
        p = f"model.layers.{i}"
        for name in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
        ):
            plan[f"{p}.{name}"] = ColwiseParallel()
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            plan[f"{p}.{name}"] = RowwiseParallel()
    return parallelize_module(model, mesh, plan)


def worker(rank: int, world: int, args: argparse.Namespace) -> dict[str, object]:
    os.environ["TRANSFORMERS_VERBOSITY"] = "error"
    import torch.distributed as dist

    import autopar

    cluster = autopar.Cluster.local(world)
    model, batch = build(args)
    plan = autopar.layouts.megatron(model, batch, cluster, tp=world)
    ours = autopar.parallelize(model, cluster, batch, plan=plan)
    ref_model, _ = build(args)
    theirs = torch_tp(ref_model, world)
    runs = {
        "autopar": (ours, torch.optim.AdamW(ours.parameters(), lr=1e-4)),
        "pytorch_tp": (theirs, torch.optim.AdamW(theirs.parameters(), lr=1e-4)),
    }
    times: dict[str, list[float]] = {k: [] for k in runs}
    first_loss: dict[str, float] = {}
    for step in range(args.warmup + args.steps):
        for name, (module, opt) in runs.items():
            dist.barrier()
            t0 = time.perf_counter()
            loss = module(**batch)["loss"]
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            dist.barrier()
            dt = time.perf_counter() - t0
            if step == 0:
                first_loss[name] = float(loss.detach())
            if step >= args.warmup:
                times[name].append(dt)
    return {"times": times, "first_loss": first_loss}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    from autopar.runtime.launch import spawn

    res = spawn(worker, 2, args, timeout=1800, threads=1)[0]
    t = res["times"]
    med = {k: statistics.median(v) for k, v in t.items()}
    print(
        f"LLaMA {args.layers} layers, hidden {args.hidden}, {args.heads} heads, vocab {args.vocab}, "
        f"batch {args.batch} x {args.seq}; 2 gloo processes x 1 thread; tp=2 Megatron layout"
    )
    print(
        f"first-step loss: autopar {res['first_loss']['autopar']:.6f}  pytorch_tp {res['first_loss']['pytorch_tp']:.6f}"
    )
    for k in t:
        print(
            f"{k:>11}: median step {med[k] * 1e3:8.2f} ms over {len(t[k])} steps (min {min(t[k]) * 1e3:.2f}, max {max(t[k]) * 1e3:.2f})"
        )
    print(f"ratio autopar / pytorch_tp = {med['autopar'] / med['pytorch_tp']:.3f}")


if __name__ == "__main__":
    main()

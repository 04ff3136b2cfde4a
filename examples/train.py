"""Train a GPT with autopar on any number of processes: local, torchrun on one node or several.

    python examples/train.py --local 4                      # spawn 4 local gloo processes
    torchrun --nproc_per_node=4 examples/train.py           # one node (NCCL on GPUs, gloo on CPU)
    torchrun --nnodes=2 --nproc_per_node=8 --node_rank=$NODE_RANK \\
        --rdzv_backend=c10d --rdzv_endpoint=$HEAD_NODE:29500 \\
        examples/train.py --cluster H100-SXM --layers 12 --hidden 768 --heads 12   # several nodes

Every rank builds the same model (same seed), calls ``autopar.parallelize`` (rank 0 plans and
broadcasts the plan; ``--plan plan.json`` uses a saved one instead) and trains on the same global
batch; rank 0 prints the plan and the loss. ``--save-plan`` writes the plan as JSON.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

import autopar
from autopar.models import GPT, GPTConfig


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--local", type=int, default=0, help="spawn this many local gloo processes instead of torchrun"
    )
    ap.add_argument("--cluster", default="", help="GPU preset (Cluster.presets()); default: local processes")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--plan", default="", help="run this saved plan instead of planning")
    ap.add_argument("--save-plan", default="", help="write the plan used to this JSON file")
    return ap.parse_args()


def train(rank: int, world: int, args: argparse.Namespace) -> list[float]:
    cuda = torch.cuda.is_available() and not args.local
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if args.cluster:
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        cluster = autopar.Cluster.preset(args.cluster, gpus_per_node=per_node, nodes=world // per_node)
    else:
        cluster = autopar.Cluster.local(world)
    torch.manual_seed(0)
    cfg = GPTConfig(
        n_layer=args.layers, n_head=args.heads, n_embd=args.hidden, vocab_size=args.vocab, block_size=args.seq
    )
    model = GPT(cfg)
    idx = torch.randint(0, args.vocab, (args.batch, args.seq))
    batch = (idx, torch.roll(idx, -1, dims=1))
    plan = autopar.Plan.load(args.plan) if args.plan else None
    pm = autopar.parallelize(model, cluster, batch, plan=plan)
    if rank == 0:
        print(pm.plan.summary())
        if args.save_plan:
            pm.plan.save(args.save_plan)
    opt = torch.optim.AdamW(pm.parameters(), lr=3e-3)
    losses = []
    for step in range(args.steps):
        t0 = time.perf_counter()
        loss = pm(*batch)
        opt.zero_grad()
        loss.backward()
        pm.clip_grad_norm_(1.0)
        opt.step()
        losses.append(loss.item())
        if rank == 0:
            print(f"step {step}: loss {losses[-1]:.6f}  ({(time.perf_counter() - t0) * 1e3:.1f} ms)")
    return losses


def main() -> None:
    args = parse()
    if args.local:
        from autopar.runtime.launch import spawn

        spawn(train, args.local, args, timeout=1800)
        return
    import torch.distributed as dist

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    try:
        train(dist.get_rank(), dist.get_world_size(), args)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

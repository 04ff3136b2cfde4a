"""``autopar train``: train a model under a plan on ``--local N`` spawned gloo processes, or as one
rank under torchrun (the process group from torchrun's environment); each rank runs
``autopar.commands.train_loop.train_rank``. Ranks that fail are reported in one line per distinct
error."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from autopar.commands.console import Console
from autopar.commands.options import (
    CommandHelp,
    UsageError,
    add_command,
    assignments,
    model_args,
    positive_int,
)
from autopar.commands.train_loop import TrainJob, train_rank


class RankFailure(RuntimeError):
    """Ranks of ``autopar train`` failed; the message has each distinct error once."""


HELP = CommandHelp(
    summary="train a model under a plan on local processes or under torchrun",
    description="""
        Every rank builds the same model (seeded), rank 0 plans (or --plan loads one) and
        broadcasts it, and all ranks train on the same random global batch; rank 0 prints the
        plan and the loss of every step.
    """,
    examples="""
        autopar train gpt-tiny --local 4
        autopar train gpt-tiny --local 2 --plan plan.json --steps 10 --record run.json
        torchrun --nproc_per_node=8 -m autopar train gpt2 --cluster H100-SXM --batch 16 --seq 1024
    """,
)
"""What ``autopar train --help`` says."""


def add_parser(subs: Any) -> None:
    """Add ``autopar train`` to the subcommands ``subs``."""
    p = add_command(subs, "train", HELP)
    model_args(p, dtype="fp32")
    p.add_argument(
        "--local", type=positive_int, help="spawn this many local gloo processes (else: under torchrun)"
    )
    p.add_argument("--cluster", default="",
                   help="device preset, or a profile JSON (default: local processes, or the GPUs under torchrun)")  # fmt: skip
    p.add_argument("--plan", help="run this saved plan instead of planning")
    p.add_argument("--save-plan", help="write the plan used to this JSON file")
    p.add_argument("--steps", type=positive_int, default=5, help="training steps (default 5)")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default 3e-3)")
    p.add_argument(
        "--record", metavar="RUN", help="write step times and losses to this JSON file (for autopar report)"
    )
    p.add_argument(
        "--timeout", type=float, default=600.0, help="seconds before a local run is stopped (default 600)"
    )
    p.add_argument("--no-verify", action="store_true", help="load a plan file edited by hand")
    p.add_argument(
        "--compile", action="store_true", help="compile the step programs with Inductor (slower start)"
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace, console: Console) -> int:
    """Run ``autopar train``; returns the exit status."""
    job = TrainJob(model=args.model, batch=args.batch, seq=args.seq, dtype=args.dtype, layers=args.layers,
                    overrides=assignments(args.set, "--set"), cluster=args.cluster, plan=args.plan or "",
                    verify=not args.no_verify, save_plan=args.save_plan or "", steps=args.steps, lr=args.lr,
                    debug=bool(getattr(args, "debug", False)), compile=args.compile)  # fmt: skip
    if args.local:
        from autopar.runtime.launch import spawn

        results = spawn(train_rank, args.local, job, timeout=args.timeout)
    elif "WORLD_SIZE" in os.environ and "RANK" in os.environ:  # under torchrun: this process is one rank
        import torch
        import torch.distributed as dist

        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        try:
            result = train_rank(dist.get_rank(), dist.get_world_size(), job)
        finally:
            dist.destroy_process_group()
        if result.get("error"):
            raise RankFailure(f"rank {os.environ['RANK']}: {result['error']}")
        results = [result] if os.environ["RANK"] == "0" else []
    else:
        raise UsageError(
            "train needs --local N (spawn N local processes) or torchrun "
            "(torchrun --nproc_per_node=8 -m autopar train ...)"
        )
    errors: dict[str, list[int]] = {}
    for rank, r in enumerate(results):
        if r.get("error"):
            errors.setdefault(r["error"], []).append(rank)
    if errors:
        every = len(results)
        parts = [f"{'every rank' if len(ranks) == every else 'rank' + ('s ' if len(ranks) > 1 else ' ') + ','.join(map(str, ranks))}: {msg}"
                 for msg, ranks in errors.items()]  # fmt: skip
        raise RankFailure("; ".join(parts))
    if results and args.record:
        Path(args.record).write_text(json.dumps(results[0]["record"], indent=1))
        print(f"wrote {args.record}")
    return 0

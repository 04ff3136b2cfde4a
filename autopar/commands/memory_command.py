"""``autopar memory``: memory per device of a Megatron-style dp × tp × pp layout under each ZeRO
stage and recomputation mode (``autopar.estimate``), before anything is planned or launched."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from autopar.commands.console import Console
from autopar.commands.loading import build_cluster, build_workload, capture_workload
from autopar.commands.options import (
    CommandHelp,
    UsageError,
    add_command,
    cluster_args,
    fraction,
    model_args,
    positive_int,
)
from autopar.display import fmt_bytes, fmt_count

_STATE_DTYPES = {"auto": None, "fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
"""``--optimizer-state-dtype`` choices -> ``MemorySetup.optimizer_state_dtype``."""


HELP = CommandHelp(
    summary="estimate memory per device under each ZeRO stage and recomputation",
    description="""
        Memory per device before launch: parameters, gradients, optimizer state (each ZeRO stage)
        and saved activations (each recomputation mode) per pipeline stage of a Megatron-style
        dp × tp × pp layout (autopar.estimate), against the default budget.
    """,
    examples="""
        autopar memory llama3-8b --batch 8 --seq 8192                # 8 × H100, data parallel
        autopar memory llama3-70b --nodes 8 --tp 8 --pp 4 --batch 64 --seq 4096 --microbatches 16
        autopar memory gpt3-175b --cluster A100-80GB --nodes 128 --tp 8 --pp 16 --batch 1536 --seq 2048 --recompute full
    """,
)
"""What ``autopar memory --help`` says."""


def add_parser(subs: Any) -> None:
    """Add ``autopar memory`` to the subcommands ``subs``."""
    p = add_command(subs, "memory", HELP)
    model_args(p)
    cluster_args(p)
    g = p.add_argument_group("layout")
    g.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel size (default 1)")
    g.add_argument("--pp", type=positive_int, default=1, help="pipeline stages (default 1)")
    g.add_argument("--dp", type=positive_int, help="data-parallel size (default: devices / (tp × pp))")
    g.add_argument("--microbatches", type=positive_int, help="micro-batches per step (default pp)")
    g.add_argument(
        "--schedule", choices=("1f1b", "gpipe"), default="1f1b", help="pipeline schedule (default 1f1b)"
    )
    g.add_argument("--sequence-parallel", action="store_true", help="Megatron-LM sequence parallelism")
    g.add_argument(
        "--zero", choices=("0", "1", "2", "3", "all"), default="all", help="ZeRO stage (default all)"
    )
    g.add_argument("--recompute", choices=("none", "selective", "full", "all"), default="all",
                   help="activation recomputation (default all)")  # fmt: skip
    g.add_argument("--optimizer", default="adamw", help="optimizer (default adamw)")
    g.add_argument("--optimizer-state-dtype", choices=tuple(_STATE_DTYPES), default="auto",
                   help="dtype of the optimizer's moments: bf16 gives ZeRO's 12 / 5 / 3.25 / 1.5 bytes per "
                   "parameter at 8 devices (default auto: fp32 under mixed precision)")  # fmt: skip
    g.add_argument(
        "--memory-reserve", type=fraction, help="fraction of device memory kept free (default 10%%)"
    )
    g.add_argument("--figure", metavar="FILE", help="write the estimate as a picture (.png or .svg)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace, console: Console) -> int:
    """Run ``autopar memory``; returns the exit status."""
    from autopar.config import PlanConfig
    from autopar.estimate import RECOMPUTE, ZERO_STAGES, MemorySetup, estimate_memory, format_estimates

    cluster = build_cluster(args)
    world = cluster.world_size
    dp = args.dp if args.dp is not None else world // (args.tp * args.pp)
    if dp * args.tp * args.pp != world:
        raise UsageError(
            f"dp({dp}) × tp({args.tp}) × pp({args.pp}) = {dp * args.tp * args.pp} ≠ {world} devices "
            f"({args.nodes} node(s) × {args.gpus_per_node})"
        )
    w = build_workload(args, args.model, devices=dp)
    cap = capture_workload(console, w)
    zeros = ZERO_STAGES if args.zero == "all" else (int(args.zero),)
    modes = RECOMPUTE if args.recompute == "all" else (args.recompute,)
    estimates = {}
    with console.step("estimating"):
        for z in zeros:
            for r in modes:
                setup = MemorySetup(dp=dp, tp=args.tp, pp=args.pp, microbatches=args.microbatches, zero_stage=z,
                                    recompute=r, sequence_parallel=args.sequence_parallel, schedule=args.schedule,
                                    optimizer=args.optimizer,
                                    optimizer_state_dtype=_STATE_DTYPES[args.optimizer_state_dtype])  # fmt: skip
                estimates[(z, r)] = estimate_memory(cap, cluster, setup)
    config = PlanConfig.build(memory_reserve=args.memory_reserve)
    budget = config.budget(cluster.device.memory)
    e = next(iter(estimates.values()))
    state = f"{args.optimizer} state" + (
        f" in {args.optimizer_state_dtype}" if args.optimizer_state_dtype != "auto" else ""
    )
    precision = (f"{args.dtype} weights with fp32 master weights and {state}" if e.mixed_precision
                 else f"{args.dtype} weights and {state}")  # fmt: skip
    print(f"model: {w.description or w.name}; {fmt_count(e.num_params)} parameters; {precision}")
    print(f"batch {w.batch}" + (f" × {w.seq}" if w.seq else "") + f"; layout dp={dp} × tp={args.tp} × pp={args.pp}"
          f", {e.setup.num_microbatches} micro-batch(es) of {e.micro_batch} per step")  # fmt: skip
    print(f"cluster: {cluster.describe()}; budget {fmt_bytes(budget)} per device "
          f"({fmt_bytes(cluster.device.memory)} less {config.memory_reserve:.0%} reserve)")  # fmt: skip
    print()
    print(format_estimates(estimates, budget))
    if args.figure:
        from autopar import viz

        print(f"\nwrote {viz.memory_estimate(estimates, Path(args.figure), budget=budget)}")
    return 0

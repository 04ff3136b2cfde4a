"""``autopar plan``: capture a model, plan it on a cluster, print the plan and save it (with how
the model was built, so ``compare`` and ``report`` can rebuild it)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from autopar.commands.console import Console
from autopar.commands.loading import build_cluster, build_workload, capture_workload, plan_config
from autopar.commands.options import (
    CommandHelp,
    add_command,
    cluster_args,
    model_args,
    planning_args,
)
from autopar.display import fmt_count

HELP = CommandHelp(
    summary="plan a model on a cluster and print (and save) the plan",
    examples="""
        autopar plan llama3-8b --cluster H100-SXM --nodes 8 --batch 64 --seq 8192 -o plan.json
        autopar plan gpt2 --gpus-per-node 8 --batch 32 --mesh 4x2 --figures out/
        autopar plan config.json --batch 16 --seq 2048 --memory-budget 60GiB
        autopar plan mymodels:build --cluster local --gpus-per-node 4
    """,
)
"""What ``autopar plan --help`` says."""


def add_parser(subs: Any) -> None:
    """Add ``autopar plan`` to the subcommands ``subs``."""
    p = add_command(subs, "plan", HELP)
    model_args(p)
    cluster_args(p)
    planning_args(p)
    g = p.add_argument_group("output files")
    g.add_argument("-o", "--output", help="write the plan to this JSON file")
    g.add_argument("--figures", metavar="DIR", help="write the plan's pictures (PNG) to this directory")
    g.add_argument("--full", action="store_true", help="also print every module's placements")
    p.set_defaults(func=run)


def run(args: argparse.Namespace, console: Console) -> int:
    """Run ``autopar plan``; returns the exit status."""
    from autopar.audit import record
    from autopar.search import plan_model

    cluster = build_cluster(args)
    config = plan_config(args)
    w = build_workload(args, args.model, devices=cluster.world_size)
    cap = capture_workload(console, w)
    t0 = time.perf_counter()
    with console.planning():
        plan = plan_model(w.model, w.example_inputs, cluster, config, captured=cap)
    plan.info["workload"] = w.info
    record(plan, warn=False)  # saved with the plan; print(plan) below shows its findings
    print(f"model: {w.description or w.name}; {fmt_count(w.num_params)} parameters, {w.info['dtype']}; "
          f"batch {w.batch}" + (f" × {w.seq}" if w.seq else ""))  # fmt: skip
    print(plan)
    if args.full:
        print()
        print(plan.table(full=True))
    print(f"\nplanned in {time.perf_counter() - t0:.1f} s")
    if args.output:
        plan.save(args.output)
        print(f"wrote {args.output}")
    if args.figures:
        from autopar import viz

        for path in viz.plan_figures(plan, Path(args.figures)):
            print(f"wrote {path}")
    return 0

"""``autopar compare``: plan A beside a baseline (``autopar.commands.baselines``) as text, an HTML
report or a side-by-side picture."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from autopar.commands.baselines import baseline
from autopar.commands.console import Console
from autopar.commands.loading import load_plan
from autopar.commands.options import (
    CommandHelp,
    add_command,
    model_args,
)

HELP = CommandHelp(
    summary="compare a plan with another plan or a Megatron-LM layout",
    description="""
        Compare plan A with B: a plan file, megatron:KEY=VALUE,... (the keywords of
        autopar.layouts.megatron: tp, dp, sequence_parallel, ...) or best-megatron (the fastest
        Megatron-LM layout that fits). Layouts are planned for the model A was made for (recorded
        by autopar plan), on A's cluster; --model and its options name another.
    """,
    examples="""
        autopar compare plan.json other.json
        autopar compare plan.json megatron:tp=8
        autopar compare plan.json megatron:tp=4,dp=2,sequence_parallel=true --figure cmp.png
        autopar compare plan.json best-megatron
        autopar compare plan.json other.json --report compare.html
    """,
)
"""What ``autopar compare --help`` says."""


def add_parser(subs: Any) -> None:
    """Add ``autopar compare`` to the subcommands ``subs``."""
    p = add_command(subs, "compare", HELP)
    p.add_argument("a", metavar="A", help="a plan file")
    p.add_argument("b", metavar="B", help="a plan file, megatron:tp=8,... or best-megatron")
    p.add_argument("--model", help="MODEL to build for a layout baseline (default: the one A records)")
    model_args(p, required=False)
    p.add_argument("--figure", metavar="FILE", help="write the side-by-side picture (.png or .svg)")
    p.add_argument(
        "--report", metavar="FILE", help="write an HTML report of both plans (steps drawn per rank)"
    )
    p.add_argument("-o", "--output", help="write B's plan to this JSON file")
    p.add_argument("--no-verify", action="store_true", help="load plan files edited by hand")
    p.set_defaults(func=run)


def run(args: argparse.Namespace, console: Console) -> int:
    """Run ``autopar compare``; returns the exit status."""
    from autopar.report import compare

    a = load_plan(args.a, args)
    b = baseline(args.b, a, args, console)
    names = (Path(args.a).name, args.b if not args.b.endswith(".json") else Path(args.b).name)
    print(compare(a, b, names=names))
    if args.report:
        from autopar.report import html_report

        with console.step("drawing the report"):
            path = html_report(a, Path(args.report), baseline=b, baseline_name=names[1], plan_name=names[0])
        print(f"wrote {path}")
    if args.output:
        b.save(args.output)
        print(f"wrote {args.output}")
    if args.figure:
        from autopar import viz

        print(f"wrote {viz.compare_plans(a, b, Path(args.figure), names=(Path(args.a).stem, args.b))}")
    return 0

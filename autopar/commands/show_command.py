"""``autopar show``: print a saved plan (audited again), its module table, its nodes or its pictures."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from autopar.commands.console import Console
from autopar.commands.loading import load_plan
from autopar.commands.options import (
    CommandHelp,
    add_command,
)

HELP = CommandHelp(
    summary="print a saved plan",
    examples="""
        autopar show plan.json
        autopar show plan.json --full
        autopar show plan.json --nodes
        autopar show plan.json --figures out/ --format svg
    """,
)
"""What ``autopar show --help`` says."""


def add_parser(subs: Any) -> None:
    """Add ``autopar show`` to the subcommands ``subs``."""
    p = add_command(subs, "show", HELP)
    p.add_argument("plan", metavar="PLAN", help="a plan file (autopar plan -o)")
    p.add_argument("--full", action="store_true", help="every module with its ops' placements")
    p.add_argument("--nodes", action="store_true", help="every graph node with its specs (autopar.explain)")
    p.add_argument("--figures", metavar="DIR", help="write the plan's pictures to this directory")
    p.add_argument("--format", choices=("png", "svg"), default="png", help="picture format (default png)")
    p.add_argument("--no-verify", action="store_true", help="load a plan file edited by hand")
    p.set_defaults(func=run)


def run(args: argparse.Namespace, console: Console) -> int:
    """Run ``autopar show``; returns the exit status."""
    from autopar.audit import record

    plan = load_plan(args.plan, args)
    record(plan, warn=False)  # audited again: the file may have been edited since it was planned
    if args.nodes:
        from autopar.report import explain

        print(explain(plan))
    elif args.full:
        print(plan.summary())
        print()
        print(plan.table(full=True))
    else:
        print(plan)
    if args.figures:
        from autopar import viz

        for path in viz.plan_figures(plan, Path(args.figures), fmt=args.format):
            print(f"wrote {path}")
    return 0

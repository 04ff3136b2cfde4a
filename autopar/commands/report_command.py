"""``autopar report``: a self-contained HTML report of a plan, beside a baseline or a measured run."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from autopar.commands.console import Console
from autopar.commands.loading import load_plan
from autopar.commands.options import (
    CommandHelp,
    add_command,
)

HELP = CommandHelp(
    summary="write a self-contained HTML report of a plan",
    examples="""
        autopar report plan.json -o report.html
        autopar report plan.json -o report.html --baseline megatron:tp=8
        autopar report plan.json -o report.html --measured run.json   # from autopar train --record
    """,
)
"""What ``autopar report --help`` says."""


def add_parser(subs: Any) -> None:
    """Add ``autopar report`` to the subcommands ``subs``."""
    p = add_command(subs, "report", HELP)
    p.add_argument("plan", metavar="PLAN", help="a plan file")
    p.add_argument("-o", "--output", required=True, help="the HTML file to write")
    p.add_argument(
        "--baseline", help="plan file, megatron:... or best-megatron to compare with (default: none)"
    )
    p.add_argument(
        "--measured",
        metavar="RUN",
        help="a run record (autopar train --record) to set against the prediction",
    )
    p.add_argument("--no-verify", action="store_true", help="load plan files edited by hand")
    p.set_defaults(func=run)


def run(args: argparse.Namespace, console: Console) -> int:
    """Run ``autopar report``; returns the exit status."""
    from autopar.report import html_report

    plan = load_plan(args.plan, args)
    baseline = None
    if args.baseline:
        ns = argparse.Namespace(**{**vars(args), "a": args.plan, "model": None, "batch": None, "seq": None,
                                   "dtype": "bf16", "layers": None, "set": None})  # fmt: skip
        baseline = baseline(args.baseline, plan, ns, console)
    measured = None
    if args.measured:
        try:
            measured = json.loads(Path(args.measured).read_text())
        except FileNotFoundError:
            raise FileNotFoundError(
                f"{args.measured}: no such run record (write one with autopar train --record)"
            ) from None
        except json.JSONDecodeError as e:
            raise ValueError(f"{args.measured}: not a run record (JSON error at line {e.lineno})") from None
    with console.step("drawing the report"):
        path = html_report(plan, Path(args.output), baseline=baseline, baseline_name=args.baseline or "",
                           measured=measured)  # fmt: skip
    print(f"wrote {path}")
    return 0

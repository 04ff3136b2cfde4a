"""``autopar simulate``: a plan's training step event by event, drawn as text per pipeline rank."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from autopar.commands.console import Console
from autopar.commands.loading import load_plan
from autopar.commands.options import (
    CommandHelp,
    UsageError,
    add_command,
    positive_int,
)

HELP = CommandHelp(
    summary="simulate a plan's training step event by event",
    description="""
        Prints the step per pipeline rank, then draws it as text: a row of forward,
        backward and weight-gradient passes per rank (one character per time slot) with their
        micro-batches, sends and collectives, and the time inside one repeated layer.
    """,
    examples="""
        autopar simulate plan.json
        autopar simulate plan.json --gantt step.png
    """,
)
"""What ``autopar simulate --help`` says."""


def add_parser(subs: Any) -> None:
    """Add ``autopar simulate`` to the subcommands ``subs``."""
    p = add_command(subs, "simulate", HELP)
    p.add_argument("plan", metavar="PLAN", help="a plan file")
    p.add_argument("--width", type=positive_int, default=100, help="time slots per row (default 100)")
    p.add_argument("--gantt", metavar="FILE", help="write the step as a Gantt chart (.png or .svg)")
    p.add_argument("--no-verify", action="store_true", help="load a plan file edited by hand")
    p.set_defaults(func=run)


def run(args: argparse.Namespace, console: Console) -> int:
    """Run ``autopar simulate``; returns the exit status."""
    import autopar

    plan = load_plan(args.plan, args)
    simulate = getattr(autopar, "simulate", None)
    if simulate is None:
        raise UsageError("this version of autopar has no whole-step simulator (autopar.simulate) yet")
    from autopar.layer_breakdown import layer_breakdown
    from autopar.step_draw import timeline_text
    from autopar.step_trace import step_trace

    timeline = simulate(plan)
    print(timeline.summary())
    print(timeline_text(step_trace(plan, timeline), width=args.width))
    breakdown = layer_breakdown(plan)
    if breakdown is not None:
        print(breakdown)
    if args.gantt:
        from autopar import viz

        print(f"wrote {viz.gantt(timeline, Path(args.gantt))}")
    return 0

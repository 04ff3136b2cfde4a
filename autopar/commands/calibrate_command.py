"""``autopar calibrate``: measure this machine's compute and collective costs into a cluster profile."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from autopar.commands.console import Console
from autopar.commands.options import (
    CommandHelp,
    add_command,
    positive_int,
)

HELP = CommandHelp(
    summary="measure this machine's compute and collective costs into a profile",
    examples="""
        autopar calibrate --local 4 -o local4.json
        autopar plan gpt-tiny --cluster local4.json
    """,
)
"""What ``autopar calibrate --help`` says."""


def add_parser(subs: Any) -> None:
    """Add ``autopar calibrate`` to the subcommands ``subs``."""
    p = add_command(subs, "calibrate", HELP)
    p.add_argument("--local", type=positive_int, default=2, help="local processes to measure (default 2)")
    p.add_argument("-o", "--output", help="write the profile (a cluster JSON) to this file")
    p.set_defaults(func=run)


def run(args: argparse.Namespace, console: Console) -> int:
    """Run ``autopar calibrate``; returns the exit status."""
    from autopar.api import measure_local

    with console.step(f"measuring {args.local} local processes"):
        cluster = measure_local(args.local)
    d = cluster.device
    print(f"measured {cluster.describe()}")
    print(
        f"  compute {d.flops_for('float32') / 1e9:.1f} GFLOP/s per process, memory {d.memory_bandwidth / 1e9:.1f} GB/s"
    )
    for kind, fit in sorted(cluster.extra.get("measured", {}).items()):
        beta = fit["beta_s_per_byte"]
        bw = (
            f"{1 / beta / 1e9:.2f} GB/s"
            if beta > 0
            else "bandwidth not resolved (time did not grow with size)"
        )
        print(f"  {kind} over {args.local}: α = {fit['alpha_s'] * 1e6:.0f} µs, {bw}")
    if args.output:
        Path(args.output).write_text(
            json.dumps({"cluster": cluster.to_dict(), "measured": cluster.extra}, indent=1)
        )
        print(f"wrote {args.output} (use it with --cluster {args.output})")
    return 0

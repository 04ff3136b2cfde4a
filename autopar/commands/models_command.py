"""``autopar models``: the built-in models and the cluster presets."""

from __future__ import annotations

import argparse
from typing import Any

from autopar.commands.console import Console
from autopar.commands.options import (
    CommandHelp,
    add_command,
)

HELP = CommandHelp(
    summary="list the built-in models and cluster presets",
    examples="""
        autopar models
        autopar models --clusters
    """,
)
"""What ``autopar models --help`` says."""


def add_parser(subs: Any) -> None:
    """Add ``autopar models`` to the subcommands ``subs``."""
    p = add_command(subs, "models", HELP)
    p.add_argument("--clusters", action="store_true", help="list the cluster presets only")
    p.set_defaults(func=run)


def run(args: argparse.Namespace, console: Console) -> int:
    """Run ``autopar models``; returns the exit status."""
    from autopar.cluster import Cluster
    from autopar.zoo import ZOO

    if not args.clusters:
        print("built-in models (autopar plan MODEL; also a transformers config.json, or module:factory):")
        for s in ZOO.values():
            print(f"  {s.name:<14} {s.summary}" + ("" if s.source == "autopar" else "  [transformers]"))
        print()
    print(
        "cluster presets (--cluster NAME; also 'local', a profile from autopar calibrate, "
        "or node groups such as A100-80GB:4,H100-SXM:4):"
    )
    for name in Cluster.presets():
        print(f"  {name:<14} {Cluster.preset(name, gpus_per_node=8).describe()}")
    return 0

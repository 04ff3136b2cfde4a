"""``autopar export``: a plan as Megatron-LM, torchtitan or DeepSpeed configuration
(``autopar.export``), what the engine cannot express, and both predicted steps."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from autopar.commands.baselines import plan_megatron, rebuild_workload
from autopar.commands.console import Console, one_line
from autopar.commands.loading import load_plan
from autopar.commands.options import (
    CommandHelp,
    add_command,
    model_args,
)

HELP = CommandHelp(
    summary="write a plan as Megatron-LM, torchtitan or DeepSpeed configuration",
    description="""
        The engine's configuration for the nearest layout it can express (autopar.export): Megatron-LM
        arguments, a torchtitan TOML job file's sections or a DeepSpeed JSON; then what autopar's plan
        does that the engine cannot, and both predicted steps: the plan's, and the exported layout's,
        planned with autopar.layouts.megatron for the model the plan records (or --model).
    """,
    examples="""
        autopar export plan.json --to megatron
        autopar export plan.json --to torchtitan -o parallelism.toml
        autopar export plan.json --to deepspeed -o ds_config.json
    """,
)
"""What ``autopar export --help`` says."""


def add_parser(subs: Any) -> None:
    """Add ``autopar export`` to the subcommands ``subs``."""
    p = add_command(subs, "export", HELP)
    p.add_argument("plan", metavar="PLAN", help="a plan file")
    p.add_argument("--to", required=True, choices=("megatron", "torchtitan", "deepspeed"), help="the engine")
    p.add_argument("-o", "--output", help="write the configuration to this file (else it is printed)")
    p.add_argument("--model", help="MODEL to plan the exported layout with (default: the one PLAN records)")
    model_args(p, required=False)
    p.add_argument("--no-predict", action="store_true", help="do not plan the exported layout")
    p.add_argument("--no-verify", action="store_true", help="load a plan file edited by hand")
    p.set_defaults(func=run)


def run(args: argparse.Namespace, console: Console) -> int:
    """Run ``autopar export``; returns the exit status."""
    from autopar.export import ENGINE_NAMES, export, prediction_text, weight_differences
    from autopar.solver import InfeasibleError

    plan = load_plan(args.plan, args)
    ex = export(plan, args.to)
    if args.output:
        Path(args.output).write_text(ex.text)
        print(f"wrote {args.output}")
    else:
        print(ex.text)
    notes = list(ex.notes)
    exported: Any = "--no-predict"
    if not args.no_predict:
        if args.model is None and "workload" not in plan.info:
            exported = (
                "the plan does not record its model (plans written by autopar plan do); name it with --model"
            )
        else:
            knobs = ex.layout.megatron_knobs()
            w, cluster, options = rebuild_workload(f"export --to {args.to}", plan, args)
            try:
                exported = plan_megatron(f"the exported layout ({ex.layout.describe()})", knobs, w, cluster,
                                          options, console)  # fmt: skip
            except (InfeasibleError, ValueError) as e:  # the layout's answer, not a failure of the command
                exported = one_line(e)
            else:
                differ = weight_differences(plan, exported)
                notes += [differ] if differ else []
    engine = ENGINE_NAMES[args.to]
    print(f"{engine} layout: {ex.layout.describe()}")
    if notes:
        print(
            "notes (what autopar's plan does that the layout does not, and what the configuration leaves out):"
        )
    for note in notes:
        print(f"  - {note}")
    print(prediction_text(plan, exported))
    return 0

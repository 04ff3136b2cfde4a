"""The ``autopar`` command: plan, read, compare, estimate and run parallel training from a shell.

    autopar plan llama3-8b --cluster H100-SXM --nodes 8 --batch 64 --seq 8192 -o plan.json
    autopar show plan.json
    autopar compare plan.json megatron:tp=8
    autopar export plan.json --to megatron
    autopar memory llama3-8b --gpus-per-node 8 --batch 8 --seq 8192
    autopar report plan.json -o report.html
    autopar train gpt-tiny --local 4

Every subcommand has ``--help`` with examples. MODEL is a built-in name, a transformers config
file or ``module:factory`` (``autopar.zoo``); ``autopar models`` lists the built-in ones. A
command that fails on bad input exits with status 1 and one line on stderr saying what was wrong
(``--debug`` shows the traceback instead); a usage error exits with status 2. Long work (capture,
each candidate mesh the planner solves) shows progress on stderr when it is a terminal, never
under ``--quiet``.

Words: a **plan file** is ``Plan.save``'s JSON; ``autopar plan`` also records in it how the
model was built (``plan.info["workload"]``), so ``compare`` and ``report`` can rebuild the model
for a baseline layout. A **baseline** is a plan file, ``megatron:tp=8,dp=2,...`` (the keywords of
``autopar.layouts.megatron``) or ``best-megatron`` (``autopar.layouts.best_megatron``).

Each command is a module of ``autopar.commands`` (``plan_command``, ``train_command``, …) with
``add_parser(subs)`` and ``run(args, console)``; this module assembles the parser from them and
runs the one named.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from collections.abc import Sequence

from autopar.commands import (
    calibrate_command,
    compare_command,
    export_command,
    memory_command,
    models_command,
    plan_command,
    report_command,
    show_command,
    simulate_command,
    train_command,
)
from autopar.commands.console import PROG, Console, one_line, show_warning
from autopar.commands.options import Parser, UsageError
from autopar.commands.train_command import RankFailure

__all__ = ["build_parser", "entry", "main"]

COMMANDS = (plan_command, show_command, compare_command, export_command, simulate_command, memory_command,
            calibrate_command, report_command, train_command, models_command)  # fmt: skip
"""The subcommands, in the order ``autopar --help`` lists them."""


def build_parser() -> argparse.ArgumentParser:
    """The ``autopar`` argument parser (every subcommand with its ``--help`` and examples)."""
    parser = Parser(
        prog=PROG,
        description="autopar: plan, inspect and run parallel training of PyTorch models.",
        epilog=(
            "examples:\n"
            "  autopar plan llama3-8b --cluster H100-SXM --nodes 8 --batch 64 --seq 8192 -o plan.json\n"
            "  autopar show plan.json\n"
            "  autopar compare plan.json megatron:tp=8\n"
            "  autopar export plan.json --to torchtitan\n"
            "  autopar memory llama3-8b --batch 8 --seq 8192\n"
            "  autopar report plan.json -o report.html\n"
            "  autopar train gpt-tiny --local 4\n"
            "\nrun 'autopar COMMAND --help' for a command's options"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quiet", "-q", action="store_true", help="no progress output")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    subs = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    for command in COMMANDS:
        command.add_parser(subs)
    return parser


_USER_ERRORS = (ValueError, TypeError, KeyError, FileNotFoundError, IsADirectoryError, PermissionError)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``autopar`` command line; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    console = Console(quiet=bool(getattr(args, "quiet", False)))
    debug = bool(getattr(args, "debug", False))
    with warnings.catch_warnings():
        warnings.showwarning = show_warning
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        try:
            return args.func(args, console)
        except KeyboardInterrupt:
            sys.stderr.write(f"{PROG} {args.command}: interrupted\n")
            return 130
        except Exception as exc:
            if debug:
                raise
            from autopar.capture import CaptureError
            from autopar.solver import InfeasibleError
            from autopar.zoo import ZooError

            known = (*_USER_ERRORS, UsageError, CaptureError, InfeasibleError, ZooError, RankFailure)
            hint = (
                ""
                if isinstance(exc, known)
                else f" ({type(exc).__name__}; rerun with --debug for the traceback)"
            )
            sys.stderr.write(f"{PROG} {args.command}: error: {one_line(exc)}{hint}\n")
            return 1


_NO_TEARDOWN = frozenset({"plan"})
"""Commands after which the ``autopar`` process exits without tearing the interpreter down: the
captured graphs, strategies and solver inputs of a large model are millions of objects, and
freeing them one by one at exit took 1.7 s after planning LLaMA-3-8B. Their output is written and
flushed by then, and they leave no process, file or process group to clean up."""


def entry() -> None:
    """The ``autopar`` console script: ``main``, then exit with its status."""
    code = main()
    argv = sys.argv[1:]
    if argv and argv[0] in _NO_TEARDOWN:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    raise SystemExit(code)


if __name__ == "__main__":
    entry()

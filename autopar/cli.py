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
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import logging
import os
import re
import sys
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autopar.display import fmt_bytes, fmt_count

__all__ = ["main"]

PROG = "autopar"


class UsageError(ValueError):
    """A command line that cannot mean anything: the message says what would."""


class _Parser(argparse.ArgumentParser):
    """argparse, with a usage error printed as one line (and the command's ``--help`` named)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"{self.prog}: error: {message} (see {self.prog} --help)\n")
        raise SystemExit(2)


# ------------------------------------------------------------------------------------ output
@dataclass(slots=True)
class _Console:
    """Where progress goes: stderr, only when it is a terminal and ``--quiet`` was not given."""

    quiet: bool

    @property
    def interactive(self) -> bool:
        return not self.quiet and sys.stderr.isatty()

    @contextlib.contextmanager
    def step(self, what: str) -> Iterator[None]:
        """``what …`` then ``what: 2.3 s`` on stderr around a piece of work."""
        t0 = time.perf_counter()
        if self.interactive:
            sys.stderr.write(f"{what} …\r")
            sys.stderr.flush()
        yield
        if self.interactive:
            sys.stderr.write(f"\x1b[2K{what}: {time.perf_counter() - t0:.1f} s\n")

    @contextlib.contextmanager
    def planning(self) -> Iterator[None]:
        """A progress bar over the planner's candidate meshes (``autopar.planner.Progress``)."""
        handler = _ProgressBar(enabled=self.interactive)
        logger = logging.getLogger("autopar.planner")
        old_level, old_propagate = logger.level, logger.propagate
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False  # progress records are for the bar, not for the user's log
        try:
            yield
        finally:
            logger.removeHandler(handler)
            logger.setLevel(old_level)
            logger.propagate = old_propagate
            handler.close_bar()


class _ProgressBar(logging.Handler):
    """Draws ``autopar.planner.Progress`` records as a tqdm bar: which meshes are being solved,
    how many remain, the time so far."""

    def __init__(self, enabled: bool) -> None:
        super().__init__(logging.INFO)
        self.enabled = enabled
        self.bar: Any = None
        self.running: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        ev = getattr(record, "progress", None)
        if ev is None or not self.enabled:
            return
        if (
            self.bar is None
            or self.bar.total != ev.total
            or (ev.started and ev.done == 0 and self.bar.n == self.bar.total)
        ):
            self.close_bar()
            from tqdm import tqdm

            self.bar = tqdm(
                total=ev.total, desc="planning", unit="mesh", file=sys.stderr, leave=False, dynamic_ncols=True
            )
        if ev.started:
            self.running.append(ev.task)
        else:
            if ev.task in self.running:
                self.running.remove(ev.task)
            self.bar.update(ev.done - self.bar.n)
        self.bar.set_postfix_str(("solving " + ", ".join(self.running)) if self.running else "")

    def close_bar(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        self.running = []


def _show_warning(
    message: Any, category: type, filename: str, lineno: int, file: Any = None, line: Any = None
) -> None:
    text = str(message)
    text = text.removeprefix("autopar: ")
    sys.stderr.write(f"{PROG}: warning: {text}\n")


# ------------------------------------------------------------------------------------ parsing
def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


_SIZE = re.compile(r"^\s*([0-9.eE+]+)\s*(B|KB|MB|GB|TB|KiB|MiB|GiB|TiB)?\s*$")
_UNITS = {None: 1, "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12,
          "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}  # fmt: skip


def _pp(text: str) -> int | str:
    if text in ("auto", "search"):
        return text
    return _positive_int(text)


def _size(text: str) -> float:
    """``70GiB``, ``75e9``, ``80 GB`` → bytes."""
    m = _SIZE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"expected a size such as 70GiB or 75e9 (bytes), got {text!r}")
    return float(m.group(1)) * _UNITS[m.group(2)]


def _fraction(text: str) -> float:
    """``10%`` or ``0.1``."""
    try:
        v = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction such as 10% or 0.1, got {text!r}") from None
    return v


def _mesh(text: str) -> tuple[int, ...]:
    """``8x8``, ``8,8`` or ``64``."""
    parts = re.split(r"[x×,]", text.strip())
    try:
        shape = tuple(int(p) for p in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a mesh such as 8x8 or 64, got {text!r}") from None
    if any(n < 1 for n in shape):
        raise argparse.ArgumentTypeError(f"mesh axes must be positive, got {text!r}")
    return shape


def _value(text: str) -> Any:
    """A configuration value: JSON (numbers, true/false, lists) or else the text itself."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _assignments(items: Sequence[str] | None, what: str) -> dict[str, Any]:
    out = {}
    for item in items or ():
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise UsageError(f"{what} takes KEY=VALUE, got {item!r}")
        out[key.strip()] = _value(value.strip())
    return out


def _common(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("output")
    g.add_argument("--quiet", "-q", action="store_true", default=argparse.SUPPRESS, help="no progress output")
    g.add_argument(
        "--debug", action="store_true", default=argparse.SUPPRESS, help="show the traceback of an error"
    )


def _model_args(p: argparse.ArgumentParser, *, dtype: str = "bf16", required: bool = True) -> None:
    if required:
        p.add_argument(
            "model", metavar="MODEL", help="built-in name (autopar models), config.json, or module:factory"
        )
    g = p.add_argument_group("model and batch")
    g.add_argument("--batch", type=_positive_int, help="global batch in sequences (default: one per device)")
    g.add_argument(
        "--seq", type=_positive_int, help="tokens per sequence (image side for vit; default: the model's)"
    )
    g.add_argument(
        "--dtype", choices=("bf16", "fp16", "fp32"), default=dtype, help=f"parameter dtype (default {dtype})"
    )
    g.add_argument("--layers", type=_positive_int, help="build the model with this many layers")
    g.add_argument(
        "--set", action="append", metavar="KEY=VALUE", help="override a configuration field (repeatable)"
    )


def _cluster_args(p: argparse.ArgumentParser, *, default: str = "H100-SXM") -> None:
    g = p.add_argument_group("cluster")
    g.add_argument("--cluster", default=default,
                   help=f"device preset (autopar models --clusters), 'local' (processes here) or a profile JSON "
                        f"from autopar calibrate (default {default})")  # fmt: skip
    g.add_argument("--nodes", type=_positive_int, default=1, help="nodes (default 1)")
    g.add_argument("--gpus-per-node", type=_positive_int, default=8, help="devices per node (default 8)")


def _planning_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("planning")
    g.add_argument("--mesh", type=_mesh, help="fix the device mesh, e.g. 8x8 (default: try the candidates)")
    g.add_argument("--memory-budget", type=_size, help="bytes per device the plan may use, e.g. 70GiB")
    g.add_argument("--memory-reserve", type=_fraction,
                   help="fraction of device memory the default budget leaves free (default 10%%)")  # fmt: skip
    g.add_argument(
        "--zero-stage", type=int, choices=(1, 2, 3), help="force a ZeRO stage (default: solver's choice)"
    )
    g.add_argument("--optimizer", default=None, help="optimizer whose state is counted (default adamw)")
    g.add_argument("--time-limit", type=float, help="seconds the solver may spend per mesh (default 60)")
    g.add_argument("--workers", type=_positive_int, help="meshes solved side by side (default 2)")
    g.add_argument("--fixed", action="append", metavar="NAME=SPEC",
                   help="fix a parameter's or input's placement, e.g. lm_head.weight=S(0),R (repeatable)")  # fmt: skip
    g.add_argument("--pp", type=_pp, help="pipeline ranks: a number, 'auto' (default: pipelines of whole nodes "
                   "where the cluster has several) or 'search' (every size)")  # fmt: skip
    g.add_argument(
        "--microbatches", type=_positive_int, help="micro-batches of a pipelined plan (default searched)"
    )
    g.add_argument("--schedule", choices=("gpipe", "1f1b", "interleaved", "zb-h1"),
                   help="pipeline schedule (default searched)")  # fmt: skip
    g.add_argument("--recompute", choices=("none", "selective", "full", "auto"),
                   help="activation recomputation (default none; auto: the cheapest that fits)")  # fmt: skip


def _sub(subs: Any, name: str, summary: str, examples: str, description: str = "") -> argparse.ArgumentParser:
    p = subs.add_parser(
        name,
        help=summary,
        description=(description or summary),
        epilog="examples:\n" + examples,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _common(p)
    return p


def build_parser() -> argparse.ArgumentParser:
    """The ``autopar`` argument parser (every subcommand with its ``--help`` and examples)."""
    parser = _Parser(
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
    subs = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    p = _sub(subs, "plan", "plan a model on a cluster and print (and save) the plan",
             "  autopar plan llama3-8b --cluster H100-SXM --nodes 8 --batch 64 --seq 8192 -o plan.json\n"
             "  autopar plan gpt2 --gpus-per-node 8 --batch 32 --mesh 4x2 --figures out/\n"
             "  autopar plan config.json --batch 16 --seq 2048 --memory-budget 60GiB\n"
             "  autopar plan mymodels:build --cluster local --gpus-per-node 4")  # fmt: skip
    _model_args(p)
    _cluster_args(p)
    _planning_args(p)
    g = p.add_argument_group("output files")
    g.add_argument("-o", "--output", help="write the plan to this JSON file")
    g.add_argument("--figures", metavar="DIR", help="write the plan's pictures (PNG) to this directory")
    g.add_argument("--full", action="store_true", help="also print every module's placements")
    p.set_defaults(func=_cmd_plan)

    p = _sub(subs, "show", "print a saved plan",
             "  autopar show plan.json\n  autopar show plan.json --full\n  autopar show plan.json --nodes\n"
             "  autopar show plan.json --figures out/ --format svg")  # fmt: skip
    p.add_argument("plan", metavar="PLAN", help="a plan file (autopar plan -o)")
    p.add_argument("--full", action="store_true", help="every module with its ops' placements")
    p.add_argument("--nodes", action="store_true", help="every graph node with its specs (autopar.explain)")
    p.add_argument("--figures", metavar="DIR", help="write the plan's pictures to this directory")
    p.add_argument("--format", choices=("png", "svg"), default="png", help="picture format (default png)")
    p.add_argument("--no-verify", action="store_true", help="load a plan file edited by hand")
    p.set_defaults(func=_cmd_show)

    p = _sub(subs, "compare", "compare a plan with another plan or a Megatron-LM layout",
             "  autopar compare plan.json other.json\n"
             "  autopar compare plan.json megatron:tp=8\n"
             "  autopar compare plan.json megatron:tp=4,dp=2,sequence_parallel=true --figure cmp.png\n"
             "  autopar compare plan.json best-megatron\n"
             "  autopar compare plan.json other.json --report compare.html",
             "Compare plan A with B: a plan file, megatron:KEY=VALUE,... (the keywords of\n"
             "autopar.layouts.megatron: tp, dp, sequence_parallel, ...) or best-megatron (the fastest\n"
             "Megatron-LM layout that fits). Layouts are planned for the model A was made for (recorded\n"
             "by autopar plan), on A's cluster; --model and its options name another.")  # fmt: skip
    p.add_argument("a", metavar="A", help="a plan file")
    p.add_argument("b", metavar="B", help="a plan file, megatron:tp=8,... or best-megatron")
    p.add_argument("--model", help="MODEL to build for a layout baseline (default: the one A records)")
    _model_args(p, required=False)
    p.add_argument("--figure", metavar="FILE", help="write the side-by-side picture (.png or .svg)")
    p.add_argument(
        "--report", metavar="FILE", help="write an HTML report of both plans (steps drawn per rank)"
    )
    p.add_argument("-o", "--output", help="write B's plan to this JSON file")
    p.add_argument("--no-verify", action="store_true", help="load plan files edited by hand")
    p.set_defaults(func=_cmd_compare)

    p = _sub(subs, "export", "write a plan as Megatron-LM, torchtitan or DeepSpeed configuration",
             "  autopar export plan.json --to megatron\n"
             "  autopar export plan.json --to torchtitan -o parallelism.toml\n"
             "  autopar export plan.json --to deepspeed -o ds_config.json",
             "The engine's configuration for the nearest layout it can express (autopar.export): Megatron-LM\n"
             "arguments, a torchtitan TOML job file's sections or a DeepSpeed JSON; then what autopar's plan\n"
             "does that the engine cannot, and both predicted steps: the plan's, and the exported layout's,\n"
             "planned with autopar.layouts.megatron for the model the plan records (or --model).")  # fmt: skip
    p.add_argument("plan", metavar="PLAN", help="a plan file")
    p.add_argument("--to", required=True, choices=("megatron", "torchtitan", "deepspeed"), help="the engine")
    p.add_argument("-o", "--output", help="write the configuration to this file (else it is printed)")
    p.add_argument("--model", help="MODEL to plan the exported layout with (default: the one PLAN records)")
    _model_args(p, required=False)
    p.add_argument("--no-predict", action="store_true", help="do not plan the exported layout")
    p.add_argument("--no-verify", action="store_true", help="load a plan file edited by hand")
    p.set_defaults(func=_cmd_export)

    p = _sub(subs, "simulate", "simulate a plan's training step event by event",
             "  autopar simulate plan.json\n  autopar simulate plan.json --gantt step.png",
             "Prints the step per pipeline rank, then draws it as text: a row of forward,\n"
             "backward and weight-gradient passes per rank (one character per time slot) with their\n"
             "micro-batches, sends and collectives, and the time inside one repeated layer.")  # fmt: skip
    p.add_argument("plan", metavar="PLAN", help="a plan file")
    p.add_argument("--width", type=_positive_int, default=100, help="time slots per row (default 100)")
    p.add_argument("--gantt", metavar="FILE", help="write the step as a Gantt chart (.png or .svg)")
    p.add_argument("--no-verify", action="store_true", help="load a plan file edited by hand")
    p.set_defaults(func=_cmd_simulate)

    p = _sub(subs, "memory", "estimate memory per device under each ZeRO stage and recomputation",
             "  autopar memory llama3-8b --batch 8 --seq 8192                # 8 × H100, data parallel\n"
             "  autopar memory llama3-70b --nodes 8 --tp 8 --pp 4 --batch 64 --seq 4096 --microbatches 16\n"
             "  autopar memory gpt3-175b --cluster A100-80GB --nodes 128 --tp 8 --pp 16 --batch 1536 --seq 2048 --recompute full",
             "Memory per device before launch: parameters, gradients, optimizer state (each ZeRO stage)\n"
             "and saved activations (each recomputation mode) per pipeline stage of a Megatron-style\n"
             "dp × tp × pp layout (autopar.estimate), against the default budget.")  # fmt: skip
    _model_args(p)
    _cluster_args(p)
    g = p.add_argument_group("layout")
    g.add_argument("--tp", type=_positive_int, default=1, help="tensor-parallel size (default 1)")
    g.add_argument("--pp", type=_positive_int, default=1, help="pipeline stages (default 1)")
    g.add_argument("--dp", type=_positive_int, help="data-parallel size (default: devices / (tp × pp))")
    g.add_argument("--microbatches", type=_positive_int, help="micro-batches per step (default pp)")
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
        "--memory-reserve", type=_fraction, help="fraction of device memory kept free (default 10%%)"
    )
    g.add_argument("--figure", metavar="FILE", help="write the estimate as a picture (.png or .svg)")
    p.set_defaults(func=_cmd_memory)

    p = _sub(subs, "calibrate", "measure this machine's compute and collective costs into a profile",
             "  autopar calibrate --local 4 -o local4.json\n  autopar plan gpt-tiny --cluster local4.json")  # fmt: skip
    p.add_argument("--local", type=_positive_int, default=2, help="local processes to measure (default 2)")
    p.add_argument("-o", "--output", help="write the profile (a cluster JSON) to this file")
    p.set_defaults(func=_cmd_calibrate)

    p = _sub(subs, "report", "write a self-contained HTML report of a plan",
             "  autopar report plan.json -o report.html\n"
             "  autopar report plan.json -o report.html --baseline megatron:tp=8\n"
             "  autopar report plan.json -o report.html --measured run.json   # from autopar train --record")  # fmt: skip
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
    p.set_defaults(func=_cmd_report)

    p = _sub(subs, "train", "train a model under a plan on local processes or under torchrun",
             "  autopar train gpt-tiny --local 4\n"
             "  autopar train gpt-tiny --local 2 --plan plan.json --steps 10 --record run.json\n"
             "  torchrun --nproc_per_node=8 -m autopar train gpt2 --cluster H100-SXM --batch 16 --seq 1024",
             "Every rank builds the same model (seeded), rank 0 plans (or --plan loads one) and\n"
             "broadcasts it, and all ranks train on the same random global batch; rank 0 prints the\n"
             "plan and the loss of every step.")  # fmt: skip
    _model_args(p, dtype="fp32")
    p.add_argument(
        "--local", type=_positive_int, help="spawn this many local gloo processes (else: under torchrun)"
    )
    p.add_argument("--cluster", default="",
                   help="device preset, or a profile JSON (default: local processes, or the GPUs under torchrun)")  # fmt: skip
    p.add_argument("--plan", help="run this saved plan instead of planning")
    p.add_argument("--save-plan", help="write the plan used to this JSON file")
    p.add_argument("--steps", type=_positive_int, default=5, help="training steps (default 5)")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default 3e-3)")
    p.add_argument(
        "--record", metavar="RUN", help="write step times and losses to this JSON file (for autopar report)"
    )
    p.add_argument(
        "--timeout", type=float, default=600.0, help="seconds before a local run is stopped (default 600)"
    )
    p.add_argument("--no-verify", action="store_true", help="load a plan file edited by hand")
    p.add_argument(
        "--compile", action="store_true", help="compile the step programs with Inductor (slower start)"
    )
    p.set_defaults(func=_cmd_train)

    p = _sub(subs, "models", "list the built-in models and cluster presets",
             "  autopar models\n  autopar models --clusters")  # fmt: skip
    p.add_argument("--clusters", action="store_true", help="list the cluster presets only")
    p.set_defaults(func=_cmd_models)
    return parser


# ------------------------------------------------------------------------------------ helpers
def _workload(args: argparse.Namespace, model: str, *, devices: int, device: str = "meta") -> Any:
    from autopar import zoo

    batch = args.batch or devices
    return zoo.load(model, batch=batch, seq=args.seq, dtype=args.dtype, device=device, layers=args.layers,
                    overrides=_assignments(args.set, "--set"))  # fmt: skip


def _cluster(args: argparse.Namespace, name: str | None = None) -> Any:
    from autopar.cluster import Cluster

    name = name if name is not None else args.cluster
    n = args.nodes * args.gpus_per_node
    if name == "local":
        return Cluster.local(n)
    if name.endswith(".json") or os.sep in name:
        path = Path(name)
        if not path.exists():
            raise FileNotFoundError(
                f"{name}: no such cluster profile (write one with autopar calibrate -o {name})"
            )
        try:
            d = json.loads(path.read_text())
            return Cluster.from_dict(d.get("cluster", d))
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{name}: not a cluster profile ({type(e).__name__}: {e})") from None
    return Cluster.preset(name, gpus_per_node=args.gpus_per_node, nodes=args.nodes)


def _config(args: argparse.Namespace) -> Any:
    from autopar.config import PlanConfig

    fixed = {}
    for item in args.fixed or ():
        name, eq, spec = item.partition("=")
        if not eq:
            raise UsageError(
                f"--fixed takes NAME=SPEC (one placement per mesh axis, e.g. lm_head.weight=S(0),R), got {item!r}"
            )
        fixed[name] = tuple(p.strip() for p in re.split(r",(?![^(]*\))", spec))
    return PlanConfig.build(
        mesh_shape=args.mesh, memory_budget=args.memory_budget, memory_reserve=args.memory_reserve,
        zero_stage=args.zero_stage, optimizer=args.optimizer, time_limit=args.time_limit, workers=args.workers,
        fixed=fixed or None, pp=getattr(args, "pp", None), microbatches=getattr(args, "microbatches", None),
        schedule=getattr(args, "schedule", None), recompute=getattr(args, "recompute", None),
    )  # fmt: skip


def _load_plan(path: str, args: argparse.Namespace) -> Any:
    from autopar.planfile import Plan

    return Plan.load(path, verify=not getattr(args, "no_verify", False))


def _capture(console: _Console, w: Any) -> Any:
    from autopar.capture import capture

    with console.step(f"capturing {w.name} (batch {w.batch}" + (f" × {w.seq})" if w.seq else ")")):
        return capture(w.model, w.example_inputs)


def _baseline(spec: str, a: Any, args: argparse.Namespace, console: _Console) -> Any:
    """Plan B of a comparison: a plan file, ``megatron:k=v,...`` or ``best-megatron``."""
    from autopar import layouts

    if spec not in ("best-megatron",) and not spec.startswith("megatron:") and spec != "megatron":
        return _load_plan(spec, args)
    w, cluster, options = _rebuild(spec, a, args)
    if spec == "best-megatron":
        best = getattr(layouts, "best_megatron", None)
        if best is None:
            raise UsageError(
                "best-megatron is not in this version of autopar yet; compare with megatron:tp=N instead"
            )
        from autopar.config import PlanConfig

        with console.planning():
            return best(w.model, w.example_inputs, cluster, config=PlanConfig.build(None, **options))
    knobs = _megatron_knobs(spec.partition(":")[2], cluster)
    return _plan_megatron(spec, knobs, w, cluster, options, console)


def _rebuild(what: str, a: Any, args: argparse.Namespace) -> tuple[Any, Any, dict[str, Any]]:
    """What a layout planned beside plan ``a`` needs: the model ``a`` was made for (rebuilt from
    its record, or ``--model`` and its options), ``a``'s cluster and its planning options (the
    memory budget). ``what`` names the layout in the error when neither names the model."""
    from autopar.cluster import Cluster

    model = getattr(args, "model", None)
    recorded = a.info.get("workload")
    if model is None and recorded is None:
        raise UsageError(
            f"{what} needs the model: {args.a if hasattr(args, 'a') else 'the plan'} does not record how it was built "
            f"(plans written by autopar plan do); name it with --model MODEL and its --batch/--seq"
        )
    if model is None:
        w_args = argparse.Namespace(**{**vars(args), "batch": recorded["batch"], "seq": recorded["seq"],
                                       "dtype": _dtype_name(recorded["dtype"]), "layers": recorded["layers"],
                                       "set": [f"{k}={json.dumps(v)}" for k, v in recorded["overrides"].items()]})  # fmt: skip
        model = recorded["model"]
    else:
        w_args = args
    cluster = Cluster.from_dict(a.cluster)
    w = _workload(w_args, model, devices=cluster.world_size)
    budget = a.info.get("memory_budget")
    return w, cluster, ({"memory_budget": budget} if budget else {})


def _plan_megatron(
    label: str, knobs: dict[str, Any], w: Any, cluster: Any, options: dict[str, Any], console: _Console
) -> Any:
    """``autopar.layouts.megatron(**knobs)`` for workload ``w``, recording ``w`` in the plan. A
    pipelined or accumulated layout is captured per micro-batch by ``megatron`` itself: the whole
    batch's capture would make every micro-batch the whole batch."""
    from autopar import layouts

    pipelined = int(knobs.get("pp") or 1) > 1 or int(knobs.get("microbatches") or 1) > 1
    cap = None if pipelined else _capture(console, w)
    with console.planning(), console.step(f"planning {label}"):
        plan = layouts.megatron(w.model, w.example_inputs, cluster, captured=cap, **knobs, **options)
    plan.info["workload"] = w.info
    return plan


_KNOB_ALIASES = {"sp": "sequence_parallel", "m": "microbatches", "vp": "virtual", "v": "virtual"}


def _megatron_knobs(text: str, cluster: Any) -> dict[str, Any]:
    """``tp=8,dp=2,sp=true`` → keyword arguments of ``autopar.layouts.megatron``."""
    from autopar import layouts

    params = inspect.signature(layouts.megatron).parameters
    accepted = [
        n
        for n, p in params.items()
        if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
        and n not in ("model", "example_inputs", "cluster")
    ]
    accepted += [
        n
        for n, p in params.items()
        if p.kind is inspect.Parameter.KEYWORD_ONLY and n not in ("config", "captured")
    ]
    accepted.append("recompute")  # a PlanConfig field, which ``megatron`` takes among its options
    knobs = _assignments([t for t in text.split(",") if t.strip()], "megatron:")
    out = {}
    for key, value in knobs.items():
        name = _KNOB_ALIASES.get(key, key)
        if name not in accepted:
            raise UsageError(f"megatron: unknown knob {key!r}; knobs: {', '.join(accepted)}")
        out[name] = value
    if "tp" not in out:
        out["tp"] = min(cluster.gpus_per_node, cluster.world_size)
    return out


def _dtype_name(text: str) -> str:
    return {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(text, text)


def _figures(plan: Any, directory: str, fmt: str = "png") -> list[Path]:
    from autopar import viz

    return viz.plan_figures(plan, Path(directory), fmt=fmt)


# ------------------------------------------------------------------------------------ commands
def _cmd_plan(args: argparse.Namespace, console: _Console) -> int:
    from autopar.audit import record
    from autopar.search import plan_model

    cluster = _cluster(args)
    config = _config(args)
    w = _workload(args, args.model, devices=cluster.world_size)
    cap = _capture(console, w)
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
        for path in _figures(plan, args.figures):
            print(f"wrote {path}")
    return 0


def _cmd_show(args: argparse.Namespace, console: _Console) -> int:
    from autopar.audit import record

    plan = _load_plan(args.plan, args)
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
        for path in _figures(plan, args.figures, args.format):
            print(f"wrote {path}")
    return 0


def _cmd_compare(args: argparse.Namespace, console: _Console) -> int:
    from autopar.report import compare

    a = _load_plan(args.a, args)
    b = _baseline(args.b, a, args, console)
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


def _cmd_export(args: argparse.Namespace, console: _Console) -> int:
    from autopar.export import ENGINE_NAMES, export, prediction_text, weight_differences
    from autopar.solver import InfeasibleError

    plan = _load_plan(args.plan, args)
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
            w, cluster, options = _rebuild(f"export --to {args.to}", plan, args)
            try:
                exported = _plan_megatron(f"the exported layout ({ex.layout.describe()})", knobs, w, cluster,
                                          options, console)  # fmt: skip
            except (InfeasibleError, ValueError) as e:  # the layout's answer, not a failure of the command
                exported = _one_line(e)
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


def _cmd_simulate(args: argparse.Namespace, console: _Console) -> int:
    import autopar

    plan = _load_plan(args.plan, args)
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


_STATE_DTYPES = {"auto": None, "fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
"""``--optimizer-state-dtype`` choices -> ``MemorySetup.optimizer_state_dtype``."""


def _cmd_memory(args: argparse.Namespace, console: _Console) -> int:
    from autopar.config import PlanConfig
    from autopar.estimate import RECOMPUTE, ZERO_STAGES, MemorySetup, estimate_memory, format_estimates

    cluster = _cluster(args)
    world = cluster.world_size
    dp = args.dp if args.dp is not None else world // (args.tp * args.pp)
    if dp * args.tp * args.pp != world:
        raise UsageError(
            f"dp({dp}) × tp({args.tp}) × pp({args.pp}) = {dp * args.tp * args.pp} ≠ {world} devices "
            f"({args.nodes} node(s) × {args.gpus_per_node})"
        )
    w = _workload(args, args.model, devices=dp)
    cap = _capture(console, w)
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


def _cmd_calibrate(args: argparse.Namespace, console: _Console) -> int:
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


def _cmd_report(args: argparse.Namespace, console: _Console) -> int:
    from autopar.report import html_report

    plan = _load_plan(args.plan, args)
    baseline = None
    if args.baseline:
        ns = argparse.Namespace(**{**vars(args), "a": args.plan, "model": None, "batch": None, "seq": None,
                                   "dtype": "bf16", "layers": None, "set": None})  # fmt: skip
        baseline = _baseline(args.baseline, plan, ns, console)
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


def _cmd_models(args: argparse.Namespace, console: _Console) -> int:
    from autopar.cluster import Cluster
    from autopar.zoo import ZOO

    if not args.clusters:
        print("built-in models (autopar plan MODEL; also a transformers config.json, or module:factory):")
        for s in ZOO.values():
            print(f"  {s.name:<14} {s.summary}" + ("" if s.source == "autopar" else "  [transformers]"))
        print()
    print("cluster presets (--cluster NAME; also 'local', or a profile from autopar calibrate):")
    for name in Cluster.presets():
        print(f"  {name:<14} {Cluster.preset(name, gpus_per_node=8).describe()}")
    return 0


# ------------------------------------------------------------------------------------ train
@dataclass(frozen=True, kw_only=True, slots=True)
class _TrainJob:
    """What every rank of ``autopar train`` needs (picklable: sent to spawned processes)."""

    model: str
    batch: int | None
    seq: int | None
    dtype: str
    layers: int | None
    overrides: dict[str, Any]
    cluster: str
    plan: str
    verify: bool
    save_plan: str
    steps: int
    lr: float
    debug: bool
    compile: bool = False


def _cmd_train(args: argparse.Namespace, console: _Console) -> int:
    job = _TrainJob(model=args.model, batch=args.batch, seq=args.seq, dtype=args.dtype, layers=args.layers,
                    overrides=_assignments(args.set, "--set"), cluster=args.cluster, plan=args.plan or "",
                    verify=not args.no_verify, save_plan=args.save_plan or "", steps=args.steps, lr=args.lr,
                    debug=bool(getattr(args, "debug", False)), compile=args.compile)  # fmt: skip
    if args.local:
        from autopar.runtime.launch import spawn

        results = spawn(train_rank, args.local, job, timeout=args.timeout)
    elif "WORLD_SIZE" in os.environ and "RANK" in os.environ:  # under torchrun: this process is one rank
        import torch
        import torch.distributed as dist

        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        try:
            result = train_rank(dist.get_rank(), dist.get_world_size(), job)
        finally:
            dist.destroy_process_group()
        if result.get("error"):
            raise _RankFailure(f"rank {os.environ['RANK']}: {result['error']}")
        results = [result] if os.environ["RANK"] == "0" else []
    else:
        raise UsageError(
            "train needs --local N (spawn N local processes) or torchrun "
            "(torchrun --nproc_per_node=8 -m autopar train ...)"
        )
    errors: dict[str, list[int]] = {}
    for rank, r in enumerate(results):
        if r.get("error"):
            errors.setdefault(r["error"], []).append(rank)
    if errors:
        every = len(results)
        parts = [f"{'every rank' if len(ranks) == every else 'rank' + ('s ' if len(ranks) > 1 else ' ') + ','.join(map(str, ranks))}: {msg}"
                 for msg, ranks in errors.items()]  # fmt: skip
        raise _RankFailure("; ".join(parts))
    if results and args.record:
        Path(args.record).write_text(json.dumps(results[0]["record"], indent=1))
        print(f"wrote {args.record}")
    return 0


class _RankFailure(RuntimeError):
    """Ranks of ``autopar train`` failed; the message has each distinct error once."""


def train_rank(rank: int, world: int, job: _TrainJob) -> dict[str, Any]:
    """One rank of ``autopar train``: build, parallelize (plan on rank 0 or load ``job.plan``),
    train; returns the run record (rank 0) or the error as one line, so the launcher reports every
    rank's failure in one line each instead of nested tracebacks."""
    with warnings.catch_warnings():
        # Every rank runs the same code and would print the same warnings: rank 0 prints them.
        warnings.showwarning = _show_warning if rank == 0 else _drop_warning
        try:
            return _train(rank, world, job)
        except Exception as exc:
            if job.debug:
                raise
            return {"error": _one_line(exc)}


def _drop_warning(*args: Any, **kwargs: Any) -> None:
    """``warnings.showwarning`` of ranks other than 0."""


def _train(rank: int, world: int, job: _TrainJob) -> dict[str, Any]:
    import statistics

    import torch

    import autopar
    from autopar import zoo
    from autopar.cluster import Cluster

    cuda = torch.cuda.is_available() and not job.cluster.startswith("local") and job.cluster != ""
    if cuda:  # parameters are materialized on this rank's GPU by parallelize (NCCL backend)
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if job.cluster in ("", "local"):
        cluster = Cluster.local(world)
    else:
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        ns = argparse.Namespace(
            cluster=job.cluster, nodes=max(1, world // per_node), gpus_per_node=min(per_node, world)
        )
        cluster = _cluster(ns)
    plan = autopar.Plan.load(job.plan, verify=job.verify) if job.plan else None
    w = zoo.load(job.model, batch=job.batch or world, seq=job.seq, dtype=job.dtype, device="cpu", layers=job.layers,
                 overrides=job.overrides)  # fmt: skip
    model, inputs = w.model, w.example_inputs
    pm = autopar.parallelize(model, cluster, inputs, plan=plan, compile=job.compile or None)
    if rank == 0:
        print(f"model: {w.description or w.name}; {fmt_count(w.num_params)} parameters; batch {w.batch}"
              + (f" × {w.seq}" if w.seq else "") + f"; {world} processes")  # fmt: skip
        print(pm.plan)
        if pm.compiled is not None:
            print(f"step programs: {pm.compiled}")
        if job.save_plan:
            pm.plan.save(job.save_plan)
            print(f"wrote {job.save_plan}")
    opt = torch.optim.AdamW(pm.parameters(), lr=job.lr)
    losses, times = [], []
    args, kwargs = (inputs, {}) if isinstance(inputs, tuple) else ((), inputs)
    for step in range(job.steps):
        t0 = time.perf_counter()
        out = pm(*args, **kwargs)
        loss = out if isinstance(out, torch.Tensor) else out["loss"]
        opt.zero_grad()
        loss.backward()
        pm.clip_grad_norm_(1.0)
        opt.step()
        losses.append(float(loss.detach()))
        times.append(time.perf_counter() - t0)
        if rank == 0:
            print(f"step {step}: loss {losses[-1]:.6f}  ({times[-1] * 1e3:.1f} ms)")
    record = {
        "model": w.info, "world": world, "fingerprint": pm.plan.fingerprint, "mesh": list(pm.plan.mesh_shape),
        "axes": list(pm.plan.mesh_axes), "cluster": cluster.describe(), "losses": losses, "step_times": times,
        "median_step_time": statistics.median(times[1:] if len(times) > 1 else times),
        "predicted_step_time": pm.plan.predicted.step_time,
        "predicted_memory_per_device": pm.plan.predicted.memory_per_device,
    }  # fmt: skip
    if pm.compiled is not None:
        record["compiled"] = pm.compiled.compiled
        record["compile_seconds"] = pm.compiled.seconds
    if cuda:
        record["peak_memory_per_device"] = torch.cuda.max_memory_allocated()
    return {"record": record}


# ------------------------------------------------------------------------------------ main
_USER_ERRORS = (ValueError, TypeError, KeyError, FileNotFoundError, IsADirectoryError, PermissionError)


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    if isinstance(exc, KeyError) and len(exc.args) == 1:
        text = str(exc.args[0])
    return text


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``autopar`` command line; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    console = _Console(quiet=bool(getattr(args, "quiet", False)))
    debug = bool(getattr(args, "debug", False))
    with warnings.catch_warnings():
        warnings.showwarning = _show_warning
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

            known = (*_USER_ERRORS, UsageError, CaptureError, InfeasibleError, ZooError, _RankFailure)
            hint = (
                ""
                if isinstance(exc, known)
                else f" ({type(exc).__name__}; rerun with --debug for the traceback)"
            )
            sys.stderr.write(f"{PROG} {args.command}: error: {_one_line(exc)}{hint}\n")
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

"""The ``autopar`` command line's words: the parser class, the value types of its options (sizes,
fractions, meshes, ``KEY=VALUE`` settings) and the option groups several commands share (model
and batch, cluster, planning).

A **usage error** is a command line that cannot mean anything: argparse's own exit with status 2,
or ``UsageError`` raised by a command once it has read its arguments (status 1, one line).
"""

from __future__ import annotations

import argparse
import inspect
import json
import re
import sys
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from autopar.grad_compression import METHODS


class UsageError(ValueError):
    """A command line that cannot mean anything: the message says what would."""


class Parser(argparse.ArgumentParser):
    """argparse, with a usage error printed as one line (and the command's ``--help`` named)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"{self.prog}: error: {message} (see {self.prog} --help)\n")
        raise SystemExit(2)


def positive_int(text: str) -> int:
    """An option value that must be a whole number ≥ 1."""
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


def node_counts(text: str) -> list[int]:
    """``8`` or ``4,8,16``: the node counts ``autopar plan`` plans the workload on, each once."""
    counts = [positive_int(t.strip()) for t in text.split(",")]
    if len(set(counts)) != len(counts):
        raise argparse.ArgumentTypeError(f"each node count once, got {text!r}")
    return counts


def _pp(text: str) -> int | str:
    if text in ("auto", "search"):
        return text
    return positive_int(text)


def _size(text: str) -> float:
    """``70GiB``, ``75e9``, ``80 GB`` → bytes."""
    m = _SIZE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"expected a size such as 70GiB or 75e9 (bytes), got {text!r}")
    return float(m.group(1)) * _UNITS[m.group(2)]


def fraction(text: str) -> float:
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


def assignments(items: Sequence[str] | None, what: str) -> dict[str, Any]:
    """``KEY=VALUE`` items (of option ``what``) as a dict, each value read as JSON where it is."""
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


def model_args(p: argparse.ArgumentParser, *, dtype: str = "bf16", required: bool = True) -> None:
    """MODEL and the options that build its workload (``loading.build_workload``)."""
    if required:
        p.add_argument(
            "model", metavar="MODEL", help="built-in name (autopar models), config.json, or module:factory"
        )
    g = p.add_argument_group("model and batch")
    g.add_argument("--batch", type=positive_int, help="global batch in sequences (default: one per device)")
    g.add_argument(
        "--seq", type=positive_int, help="tokens per sequence (image side for vit; default: the model's)"
    )
    g.add_argument(
        "--dtype", choices=("bf16", "fp16", "fp32"), default=dtype, help=f"parameter dtype (default {dtype})"
    )
    g.add_argument("--layers", type=positive_int, help="build the model with this many layers")
    g.add_argument(
        "--set", action="append", metavar="KEY=VALUE", help="override a configuration field (repeatable)"
    )


def cluster_args(
    p: argparse.ArgumentParser, *, default: str = "H100-SXM", several_nodes: bool = False
) -> None:
    """The options that name the cluster (``loading.build_cluster``); ``several_nodes``: ``--nodes``
    takes a comma-separated list of node counts (``node_counts``)."""
    g = p.add_argument_group("cluster")
    g.add_argument("--cluster", default=default,
                   help=f"device preset (autopar models --clusters), 'local' (processes here), a profile JSON "
                        f"from autopar calibrate, or a mixed cluster's node groups, KIND:NODES,... (a kind: a preset or profile) "
                        f"(A100-80GB:4,H100-SXM:4; --nodes is then theirs) (default {default})")  # fmt: skip
    if several_nodes:
        g.add_argument("--nodes", type=node_counts, default=[1],
                       help="nodes, or several counts to plan the workload on each, e.g. 4,8,16 (default 1)")  # fmt: skip
    else:
        g.add_argument("--nodes", type=positive_int, default=1, help="nodes (default 1)")
    g.add_argument("--gpus-per-node", type=positive_int, default=8, help="devices per node (default 8)")
    g.add_argument("--network", choices=("infiniband", "ethernet-400g", "ethernet-200g", "ethernet-100g"),
                   help="the network between nodes (default: the preset's InfiniBand, one NIC per GPU; "
                        "ethernet-*: one NIC per node, a cloud cluster)")  # fmt: skip
    g.add_argument("--nodes-per-rack", type=positive_int,
                   help="nodes under one top-of-rack switch (default: all under one switch)")  # fmt: skip
    g.add_argument("--spine-oversubscription", type=float, default=1.0,
                   help="rack NIC bandwidth ÷ rack uplink bandwidth, e.g. 2 for 2:1 (default 1: non-blocking)")  # fmt: skip


def planning_args(p: argparse.ArgumentParser) -> None:
    """The planner's options (``loading.plan_config``)."""
    g = p.add_argument_group("planning")
    g.add_argument("--mesh", type=_mesh, help="fix the device mesh, e.g. 8x8 (default: try the candidates)")
    g.add_argument("--memory-budget", type=_size, help="bytes per device the plan may use, e.g. 70GiB")
    g.add_argument("--memory-reserve", type=fraction,
                   help="fraction of device memory the default budget leaves free (default 10%%)")  # fmt: skip
    g.add_argument(
        "--zero-stage", type=int, choices=(1, 2, 3), help="force a ZeRO stage (default: solver's choice)"
    )
    g.add_argument("--optimizer", default=None, help="optimizer whose state is counted (default adamw)")
    g.add_argument("--time-limit", type=float, help="seconds the solver may spend per mesh (default 60)")
    g.add_argument("--relative-gap", type=fraction,
                   help="how close to its optimum each mesh's plan is proven, e.g. 1%% (default 0.5%%)")  # fmt: skip
    g.add_argument("--workers", type=positive_int, help="meshes solved side by side (default 2)")
    g.add_argument("--fixed", action="append", metavar="NAME=SPEC",
                   help="fix a parameter's or input's placement, e.g. lm_head.weight=S(0),R (repeatable)")  # fmt: skip
    g.add_argument("--pp", type=_pp, help="pipeline ranks: a number, 'auto' (default: pipelines of whole nodes "
                   "where the cluster has several) or 'search' (every size)")  # fmt: skip
    g.add_argument(
        "--microbatches", type=positive_int, help="micro-batches of a pipelined plan (default searched)"
    )
    g.add_argument("--schedule", choices=("gpipe", "1f1b", "interleaved", "zb-h1"),
                   help="pipeline schedule (default searched)")  # fmt: skip
    g.add_argument("--recompute", choices=("none", "selective", "full", "ops", "auto"),
                   help="activation recomputation: ops = the solver picks which activations, one by one "
                        "(default auto: the lightest that fits, then per activation where memory binds)")  # fmt: skip
    g.add_argument("--allow-compression", action="store_true", default=None,
                   help="let the plan compress the data-parallel gradient all-reduces (lossy: PowerSGD, top-k, "
                        "fp8 or bf16) where that plays faster")  # fmt: skip
    g.add_argument("--compression", choices=METHODS,
                   help="compress every data-parallel gradient all-reduce this way (lossy)")  # fmt: skip
    g.add_argument("--offload-optimizer", choices=("auto", "on", "off"),
                   help="optimizer state and master weights in host memory, the step on the host (ZeRO-Offload); "
                        "default auto: only where nothing fits without it")  # fmt: skip


@dataclass(frozen=True, kw_only=True, slots=True)
class CommandHelp:
    """What a command's ``--help`` says. ``description`` and ``examples`` are written as indented
    triple-quoted blocks; their common indentation is removed (``inspect.cleandoc``)."""

    summary: str
    """One line: the command's entry in ``autopar --help`` (and its description if it has none)."""
    examples: str
    """Command lines, one a line, shown under ``examples:``."""
    description: str = ""
    """Paragraphs shown under the usage line."""


def add_command(subs: Any, name: str, text: CommandHelp) -> argparse.ArgumentParser:
    """Add command ``name`` to ``subs`` with its ``text`` (summary, description and examples, shown
    by its ``--help``) and the output options every command takes."""
    examples = textwrap.indent(inspect.cleandoc(text.examples), "  ")
    p = subs.add_parser(
        name,
        help=text.summary,
        description=(inspect.cleandoc(text.description) or text.summary),
        epilog="examples:\n" + examples,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _common(p)
    return p

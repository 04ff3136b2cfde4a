"""Reading Megatron-LM's command line back: ``parse_megatron_args`` turns the parallelism, batch
and recomputation arguments of a ``pretrain_gpt.py`` line (``autopar export --to megatron`` writes
them, ``autopar.export.megatron_args``) into the keywords of ``autopar.layouts.megatron``, so a
published or hand-written Megatron-LM run can be planned and compared with autopar's plan.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from typing import Any

__all__ = ["CP_FORMS", "parse_megatron_args"]


CP_FORMS = {"allgather": "all_gather", "a2a": "a2a", "p2p": "p2p"}
"""Megatron-Core's ``--cp-comm-type`` values autopar plans, as ``layouts.megatron``'s
``cp_comm_type`` names them (its hierarchical ``a2a+p2p`` is not planned)."""

_MEGATRON_FLAGS = {
    "--sequence-parallel",
    "--use-distributed-optimizer",
    "--recompute-activations",
    "--optimizer-cpu-offload",
    "--use-precision-aware-optimizer",
    "--cpu-offloading",
}
"""Megatron-LM flags that take no value (among those ``parse_megatron_args`` reads)."""


def parse_megatron_args(argv: Sequence[str] | str, world_size: int | None = None) -> dict[str, Any]:
    """The keywords of ``autopar.layouts.megatron`` that Megatron-LM arguments describe.

    ``argv`` is a list of arguments or a command line (``torchrun … pretrain_gpt.py --tensor-…``;
    backslash-newlines and ``#`` comment lines are dropped). The world size is ``torchrun``'s
    ``--nnodes`` × ``--nproc-per-node`` when the line has them, else ``world_size``. Arguments
    that do not set a parallelism, batch or recomputation knob are ignored. Reads
    ``--tensor-model-parallel-size``, ``--pipeline-model-parallel-size``,
    ``--num-layers-per-virtual-pipeline-stage`` (with ``--num-layers``) or
    ``--num-virtual-stages-per-pipeline-rank`` / ``--virtual-pipeline-model-parallel-size``,
    ``--sequence-parallel``, ``--expert-model-parallel-size``, ``--micro-batch-size``,
    ``--global-batch-size``, ``--recompute-granularity`` / ``--recompute-activations`` (with
    ``--recompute-method`` and ``--recompute-num-layers`` for full: uniform with 1 layer, or block;
    for selective ``--recompute-modules core_attn``, Megatron's default, and no other module)
    ``--use-distributed-optimizer``, ``--optimizer-cpu-offload`` (with
    ``--optimizer-offload-fraction`` 1: autopar offloads all of the state or none) and
    ``--cpu-offloading-num-layers`` (activation offload)."""
    if isinstance(argv, str):
        text = "\n".join(line for line in argv.splitlines() if not line.lstrip().startswith("#"))
        argv = shlex.split(text.replace("\\\n", " "))
    values: dict[str, str] = {}
    flags: set[str] = set()
    items = list(argv)
    i = 0
    while i < len(items):
        tok = items[i]
        i += 1
        if not tok.startswith("--"):
            continue
        key, eq, val = tok.partition("=")
        key = key.replace("_", "-")
        if eq:
            values[key] = val
        elif key in _MEGATRON_FLAGS or i >= len(items) or items[i].startswith("--"):
            flags.add(key)
        else:
            values[key] = items[i]
            i += 1
            if key in ("--recompute-modules", "--cp-comm-type"):  # a list: every value up to the next flag
                while i < len(items) and not items[i].startswith("--"):
                    values[key] += " " + items[i]
                    i += 1

    def number(key: str, default: int | None = None) -> int | None:
        if key not in values:
            return default
        try:
            v = int(values[key])
        except ValueError:
            raise ValueError(f"{key} takes a positive integer, got {values[key]!r}") from None
        if v < 1:
            raise ValueError(f"{key} takes a positive integer, got {v}")
        return v

    nodes, per_node = number("--nnodes"), number("--nproc-per-node")
    world = nodes * per_node if nodes and per_node else world_size
    if world is None:
        raise ValueError(
            "the world size is not in the arguments: give torchrun's --nnodes and --nproc-per-node, or world_size"
        )
    tp = number("--tensor-model-parallel-size", 1)
    pp = number("--pipeline-model-parallel-size", 1)
    cp = number("--context-parallel-size", 1)
    if world % (tp * pp * cp):
        sizes = f"tp({tp}) × pp({pp})" + (f" × cp({cp})" if cp > 1 else "")
        raise ValueError(f"{sizes} = {tp * pp * cp} does not divide the world size {world}")
    dp = world // (tp * pp * cp)
    cp_forms = values.get("--cp-comm-type", "p2p").split() if cp > 1 else []
    unplanned = sorted(set(cp_forms) - set(CP_FORMS))
    if unplanned:
        raise ValueError(
            f"--cp-comm-type {' '.join(cp_forms)}: autopar plans context parallelism's p2p (ring), allgather and "
            f"a2a forms, not {', '.join(unplanned)}: give one of those"
        )
    if len(set(cp_forms)) > 1:
        raise ValueError(
            f"--cp-comm-type {' '.join(cp_forms)}: autopar.layouts.megatron holds one form for every layer; give one "
            "(or plan with autopar.plan, which picks per layer)"
        )
    virtual = number("--num-virtual-stages-per-pipeline-rank") or number(
        "--virtual-pipeline-model-parallel-size"
    )
    per_vstage = number("--num-layers-per-virtual-pipeline-stage")
    if virtual is None and per_vstage is not None:
        layers = number("--num-layers")
        if layers is None:
            raise ValueError(
                "--num-layers-per-virtual-pipeline-stage needs --num-layers to give the virtual stages"
            )
        if layers % (pp * per_vstage):
            raise ValueError(
                f"--num-layers {layers} is not a multiple of pp({pp}) × --num-layers-per-virtual-pipeline-stage "
                f"({per_vstage})"
            )
        virtual = layers // (pp * per_vstage)
    virtual = virtual or 1
    mbs = number("--micro-batch-size", 1)
    batch = number("--global-batch-size", mbs * dp)
    if batch % (mbs * dp):
        raise ValueError(
            f"--global-batch-size {batch} is not a multiple of --micro-batch-size ({mbs}) × data-parallel size ({dp})"
        )
    granularity = values.get(
        "--recompute-granularity", "selective" if "--recompute-activations" in flags else "none"
    )
    if granularity not in ("none", "selective", "full"):
        raise ValueError(f"--recompute-granularity takes selective or full, got {granularity!r}")
    modules = values.get("--recompute-modules", "core_attn").replace(",", " ").split()
    if granularity == "selective" and set(modules) != {"core_attn"}:
        raise ValueError(
            f"--recompute-modules {' '.join(modules)}: autopar.layouts.megatron plans Megatron's selective "
            f"recomputation of the attention core (core_attn) only; plan the run with autopar.plan(recompute='ops'), "
            f"which chooses per activation"
        )
    full = granularity == "full"  # Megatron-LM reads the method and layer count for full only
    method = values.get("--recompute-method", "uniform") if full else None
    num_layers = number("--recompute-num-layers", 1) if full else None
    if method not in (None, "uniform", "block"):
        raise ValueError(f"--recompute-method takes uniform or block, got {method!r}")
    if method == "uniform" and num_layers != 1:
        raise ValueError(
            f"--recompute-method uniform with --recompute-num-layers {num_layers} checkpoints groups of "
            f"{num_layers} layers, which autopar does not express: give --recompute-num-layers 1, or the "
            f"block method (the first N layers of each stage)"
        )
    offload = "--optimizer-cpu-offload" in flags
    fraction = values.get("--optimizer-offload-fraction", "1.0")
    try:
        whole = float(fraction) == 1.0
    except ValueError:
        raise ValueError(f"--optimizer-offload-fraction takes a number in [0, 1], got {fraction!r}") from None
    if offload and not whole:
        raise ValueError(
            f"--optimizer-offload-fraction {fraction} offloads part of the optimizer state, which autopar does not "
            "express: give 1.0 (all of it on the host) or leave out --optimizer-cpu-offload"
        )
    offload_layers = (
        number("--cpu-offloading-num-layers")
        if "--cpu-offloading" in flags or ("--cpu-offloading-num-layers" in values)
        else None
    )
    return {
        **({"offload_optimizer": True} if offload else {}),
        **({"offload_activations": offload_layers} if offload_layers else {}),
        "tp": tp,
        "dp": dp,
        "sequence_parallel": "--sequence-parallel" in flags,
        "ep": number("--expert-model-parallel-size", 1),
        **({"cp": cp, "cp_comm_type": CP_FORMS[cp_forms[0]]} if cp > 1 else {}),
        "pp": pp,
        "microbatches": batch // (mbs * dp),
        "schedule": "interleaved" if virtual > 1 else "1f1b",
        "virtual": virtual,
        "distributed_optimizer": "--use-distributed-optimizer" in flags,
        "recompute": granularity,
        "recompute_num_layers": num_layers if method == "block" else None,
    }

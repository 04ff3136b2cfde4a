"""What a command's arguments name, built: the model and its example batch (a **workload**,
``autopar.zoo``), the cluster (a preset, ``local`` or a calibrated profile), the planning
configuration, a saved plan, and the model's capture."""

from __future__ import annotations

import argparse
import json
import os
import re
from pathlib import Path
from typing import Any

from autopar.commands.console import Console
from autopar.commands.options import UsageError, assignments


def build_workload(args: argparse.Namespace, model: str, *, devices: int, device: str = "meta") -> Any:
    """The workload ``--batch``/``--seq``/``--dtype``/``--layers``/``--set`` describe for ``model``
    (the batch defaults to one sequence per device)."""
    from autopar import zoo

    batch = args.batch or devices
    return zoo.load(model, batch=batch, seq=args.seq, dtype=args.dtype, device=device, layers=args.layers,
                    overrides=assignments(args.set, "--set"))  # fmt: skip


def build_cluster(args: argparse.Namespace, name: str | None = None) -> Any:
    """The cluster ``--cluster`` (or ``name``), ``--nodes`` and ``--gpus-per-node`` name; a mixed
    cluster's ``--cluster`` names its groups and their nodes (``A100-80GB:4,H100-SXM:4``)."""
    from autopar.cluster import Cluster

    name = name if name is not None else args.cluster
    n = args.nodes * args.gpus_per_node
    if name == "local":
        return Cluster.local(n)
    if ":" in name:  # a mixed cluster: KIND:NODES,... (a kind: a preset or a profile JSON)
        groups = []
        for part in name.split(","):
            kind, _, count = part.rpartition(":")
            if not kind or not count.strip().isdigit() or int(count) < 1:
                raise ValueError(
                    f"--cluster {name!r}: a mixed cluster is KIND:NODES,KIND:NODES, a kind a preset or a "
                    f"profile JSON (e.g. A100-80GB:4,H100-SXM:4), got {part!r}"
                )
            one = build_cluster(args, kind.strip()) if kind.strip().endswith(".json") else kind.strip()
            groups.append((one, int(count)))
        held = sum(count for _, count in groups)
        if args.nodes not in (1, held):
            raise ValueError(
                f"--nodes {args.nodes}, but the node groups of --cluster {name!r} hold {held} nodes: "
                "drop --nodes (a mixed cluster's groups give its nodes)"
            )
        return Cluster.mixed(
            groups,
            gpus_per_node=args.gpus_per_node,
            network=getattr(args, "network", None),
            nodes_per_rack=getattr(args, "nodes_per_rack", None),
            spine_oversubscription=getattr(args, "spine_oversubscription", 1.0),
        )
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
    return Cluster.preset(
        name,
        gpus_per_node=args.gpus_per_node,
        nodes=args.nodes,
        network=getattr(args, "network", None),
        nodes_per_rack=getattr(args, "nodes_per_rack", None),
        spine_oversubscription=getattr(args, "spine_oversubscription", 1.0),
    )


def plan_config(args: argparse.Namespace) -> Any:
    """The ``PlanConfig`` of the planning options (``options.planning_args``)."""
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
        relative_gap=getattr(args, "relative_gap", None),
        fixed=fixed or None, pp=getattr(args, "pp", None), microbatches=getattr(args, "microbatches", None),
        schedule=getattr(args, "schedule", None), recompute=getattr(args, "recompute", None),
        allow_compression=getattr(args, "allow_compression", None), compression=getattr(args, "compression", None),
        offload_optimizer={"on": True, "off": False}.get(getattr(args, "offload_optimizer", None) or "auto"),
    )  # fmt: skip


def load_plan(path: str, args: argparse.Namespace) -> Any:
    """The plan file at ``path``, verified unless ``--no-verify``."""
    from autopar.planfile import Plan

    return Plan.load(path, verify=not getattr(args, "no_verify", False))


def capture_workload(console: Console, w: Any) -> Any:
    """``autopar.capture`` of workload ``w``, with its time on the console."""
    from autopar.capture import capture

    with console.step(f"capturing {w.name} (batch {w.batch}" + (f" × {w.seq})" if w.seq else ")")):
        return capture(w.model, w.example_inputs)

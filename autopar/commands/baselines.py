"""The other side of a comparison (``compare``, ``report --baseline``, ``export``'s prediction):
a **baseline** is a plan file, ``megatron:tp=8,dp=2,...`` (the keywords of
``autopar.layouts.megatron``) or ``best-megatron`` (``autopar.layouts.best_megatron``). A layout
is planned for the model plan A records it was made for (``plan.info["workload"]``), on A's
cluster, unless ``--model`` names another."""

from __future__ import annotations

import argparse
import inspect
import json
from typing import Any

from autopar.commands.console import Console
from autopar.commands.loading import build_workload, capture_workload, load_plan
from autopar.commands.options import UsageError, assignments


def baseline(spec: str, a: Any, args: argparse.Namespace, console: Console) -> Any:
    """Plan B of a comparison: a plan file, ``megatron:k=v,...`` or ``best-megatron``."""
    from autopar import layouts

    if spec not in ("best-megatron",) and not spec.startswith("megatron:") and spec != "megatron":
        return load_plan(spec, args)
    w, cluster, options = rebuild_workload(spec, a, args)
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
    return plan_megatron(spec, knobs, w, cluster, options, console)


def rebuild_workload(what: str, a: Any, args: argparse.Namespace) -> tuple[Any, Any, dict[str, Any]]:
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
    w = build_workload(w_args, model, devices=cluster.world_size)
    budget = a.info.get("memory_budget")
    return w, cluster, ({"memory_budget": budget} if budget else {})


def plan_megatron(
    label: str, knobs: dict[str, Any], w: Any, cluster: Any, options: dict[str, Any], console: Console
) -> Any:
    """``autopar.layouts.megatron(**knobs)`` for workload ``w``, recording ``w`` in the plan. A
    pipelined or accumulated layout is captured per micro-batch by ``megatron`` itself: the whole
    batch's capture would make every micro-batch the whole batch."""
    from autopar import layouts

    pipelined = int(knobs.get("pp") or 1) > 1 or int(knobs.get("microbatches") or 1) > 1
    cap = None if pipelined else capture_workload(console, w)
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
    knobs = assignments([t for t in text.split(",") if t.strip()], "megatron:")
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

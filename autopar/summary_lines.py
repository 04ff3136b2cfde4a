"""The plan summary's optional lines: one function per feature a plan may carry — unequal
data-parallel shares on a mixed cluster, pipeline ranks on their device kinds, offload, gradient
compression, per-activation recomputation, the layers recomputed — each returning its text, or an
empty string where the plan does not carry it. ``autopar.display.plan_summary`` prints them.

Like ``autopar.display``, this module reads only the Plan record (typed here as ``Any``: a Plan
prints itself through these modules, so they sit below ``autopar.planfile``)."""

from __future__ import annotations

from collections import Counter
from typing import Any

from autopar.text_units import fmt_bytes, fmt_time

__all__ = [
    "compression_text",
    "offload_text",
    "per_activation_text",
    "pipeline_devices",
    "recomputed_where",
    "shares_text",
]

PlanRecord = Any
"""An ``autopar.planfile.Plan`` (see ``autopar.display.PlanRecord``)."""


def shares_text(plan: PlanRecord) -> str:
    """``"8 replicas on A100-80GB run 1 micro-batch each, 8 on H100-SXM run 3 (32 in all)"``: the
    unequal data-parallel shares of a plan (``PipelinePlan.dp_shares``), runs of equal replicas
    together, each with its device kind where the cluster is known."""
    from autopar.cluster import Cluster

    pipe = plan.pipeline
    shares = pipe.dp_shares
    parts = Cluster.from_dict(plan.cluster).replicas(len(shares)) if plan.cluster else None
    kinds = [c.device.name for c in parts] if parts else [""] * len(shares)
    runs: list[list] = []
    for k, kind in zip(shares, kinds):
        if runs and runs[-1][1:] == [k, kind]:
            runs[-1][0] += 1
        else:
            runs.append([1, k, kind])
    out = []
    for i, (n, k, kind) in enumerate(runs):
        who = f"{n} replica{'s' if n > 1 else ''}" if i == 0 else str(n)
        where = f" on {kind}" if kind else ""
        what = (
            f"run{'s' if n == 1 and i == 0 else ''} {k} micro-batch{'es' if k > 1 else ''}"
            if i == 0
            else f"run {k}"
        )
        out.append(f"{who}{where} {what}" + (" each" if i == 0 and n > 1 else ""))
    return ", ".join(out) + f" ({sum(shares)} in all, each replica on its own devices)"


def pipeline_devices(plan: Any) -> str:
    """``"; ranks on A100-80GB, H100-SXM"``: each pipeline rank's device kind where the plan's
    cluster mixes kinds (``Cluster.node_groups``), else ``""``."""
    if not (plan.cluster or {}).get("node_groups") or plan.pipeline is None or plan.pipeline.dp_shares:
        return ""  # with unequal shares each replica's own devices are named (``shares_text``)
    from autopar.cluster import Cluster

    cluster, pp = Cluster.from_dict(plan.cluster), plan.pipeline.pp
    if not cluster.mixed_kinds:
        return ""
    return "; ranks on " + ", ".join(cluster.pipeline_part(pp, r).device.name for r in range(pp))


def offload_text(plan: Any) -> str:
    """The plan's offload (``Plan.offload_optimizer``, ``Plan.offload_layers``): what it moves to
    the host, what it frees on the device, what it costs, and why the search chose it."""
    f = plan.info.get("offload") or {}
    parts = []
    if plan.offload_optimizer:
        text = "optimizer offloaded to the host (ZeRO-Offload): the optimizer state and master weights in host memory"
        if "to_host" in f:
            text += (
                f", {fmt_bytes(f['device_bytes_saved'])} freed per device; the step costs {fmt_time(f['to_host'])} "
                f"gradients out + {fmt_time(f['host_step'])} update on the host + {fmt_time(f['to_device'])} weights back"
            )
        parts.append(text)
    if plan.offload_layers:
        layers = plan.offload_layers
        text = (
            f"activations of {len(layers)} layer{'s' if len(layers) > 1 else ''} ({layers[0]}"
            f"{' … ' + layers[-1] if len(layers) > 1 else ''}) copied to the host as the forward makes them and "
            "fetched back a layer ahead"
        )
        if "activation_bytes_per_microbatch" in f:
            text += f", {fmt_bytes(f['activation_bytes_per_microbatch'])} each way a micro-batch"
        parts.append(text)
    text = "; ".join(parts)
    if "host_bytes_per_device" in f:
        text += (
            f"; host holds {fmt_bytes(f['host_bytes_per_device'])} per device ({fmt_bytes(f['host_bytes_per_node'])} "
            f"of the node's {fmt_bytes(f['host_memory'])})"
        )
    reason = plan.info.get("offload_reason")
    if reason:
        text += f"; chosen because {reason}"
    return text


def compression_text(plan: Any) -> str:
    """The plan's gradient compression (``Plan.compression``), or that exact reduction was kept,
    with each method's step the search played (``info["compression_tried"]``)."""
    c = getattr(plan, "compression", None)
    tried = plan.info.get("compression_tried") or {}
    head = (
        f"gradient compression (lossy): {c.describe()} on the data-parallel weight-gradient all-reduces"
        if c is not None
        else "gradient compression allowed, none chosen: gradients reduced exactly"
    )
    if tried:
        head += "; steps played: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in tried.items())
    return head


def per_activation_text(plan: Any) -> str:
    """What a per-activation plan recomputes (``plan.info["per_activation"]``, ``passes.recompute_ops``):
    ``2 of 9 candidate activations per layer (silu, mul) in 2 layers, 64.0 KiB a micro-batch freed
    for 0.011 ms``, and the step of what ``"auto"`` had before (``info["per_activation_tried"]``)."""
    s = plan.info.get("per_activation") or {}
    ops = list(s.get("per_layer", []))
    names = ", ".join(f"{k} ×{v}" if v > 1 else k for k, v in Counter(ops).items())
    text = (
        f"{len(ops)} of {s.get('candidates', len(ops))} candidate activations per layer ({names}) in "
        f"{s.get('layers', 0)} layers, {fmt_bytes(s.get('freed', 0.0))} a micro-batch freed for "
        f"{s.get('extra', 0.0) * 1e3:.3f} ms of forward again"
    )
    tried = plan.info.get("per_activation_tried") or {}
    if "without_step" in tried:
        text += f"; {tried['step'] * 1e3:.1f} ms a step, {tried['without_step'] * 1e3:.1f} ms with {tried['without']}"
    return text


def recomputed_where(plan: Any) -> str:
    """Which repeated layers recompute (``Plan.recompute_layers``: all, or ``in 5 layers: h.0 … h.4``),
    and the step of the other count the search tried (``info["recompute_layers_tried"]``)."""
    layers, tried = plan.recompute_layers, plan.info.get("recompute_layers_tried") or {}
    if layers is None:
        where, other = "in every repeated layer", f"the first {tried.get('layers')} of {tried.get('of')}"
        steps = (tried.get("every_layer_step"), tried.get("step"))
    else:
        shown = ", ".join(layers) if len(layers) <= 3 else f"{layers[0]} … {layers[-1]}"
        where = f"in {len(layers)} repeated layer{'s' if len(layers) > 1 else ''}: {shown}; the others keep theirs"
        other, steps = f"all {tried.get('of')}", (tried.get("step"), tried.get("every_layer_step"))
    if None in steps:
        return where
    return f"{where} ({steps[0] * 1e3:.1f} ms a step; {other}: {steps[1] * 1e3:.1f} ms)"

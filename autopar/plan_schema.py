"""What a plan file must hold, checked before a Plan is built from it (``Plan.load``,
``Plan.from_dict``): every field's presence and form, named with what it should be, and the
checksum that tells a file autopar wrote from one edited by hand.

Words:

* **plan file** — a Plan's JSON form (``Plan.to_dict``), with a ``checksum`` beside it.
* **checksum** — a hash of the JSON contents independent of key order and formatting
  (:func:`checksum`); a file whose contents no longer match it was edited after autopar wrote it.
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any

from autopar.grad_compression import GradCompression
from autopar.placement import parse_spec

__all__ = ["checksum", "validate"]


def checksum(d: dict[str, Any]) -> str:
    """A hash of a plan's JSON contents, independent of key order and formatting."""
    canonical = json.dumps(json.loads(json.dumps(d)), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def validate(d: dict[str, Any]) -> None:
    """Check a plan's JSON form field by field (``Plan.from_dict``); raise ``ValueError`` naming
    the field and what it should be."""

    def fail(field: str, want: str, got: Any) -> None:
        raise ValueError(f"plan field {field!r} must be {want}, got {got!r}"[:400])

    def ints(field: str, v: Any, least: int = 1) -> None:
        if (
            not isinstance(v, (list, tuple))
            or not v
            or any(not isinstance(x, int) or isinstance(x, bool) or x < least for x in v)
        ):
            fail(field, f"a non-empty list of integers >= {least}", v)

    for key in (
        "mesh_shape",
        "mesh_axes",
        "nodes",
        "params",
        "inputs",
        "reshards",
        "predicted",
        "cluster",
        "fingerprint",
    ):
        if key not in d:
            raise ValueError(f"not a plan file (no field {key!r})")
    ints("mesh_shape", d["mesh_shape"])
    ndim = len(d["mesh_shape"])
    axes = d["mesh_axes"]
    if (
        not isinstance(axes, (list, tuple))
        or len(axes) != ndim
        or not all(isinstance(a, str) and a for a in axes)
    ):
        fail("mesh_axes", f"{ndim} axis names (one per mesh_shape entry)", axes)

    def spec(field: str, v: Any) -> None:
        if not isinstance(v, (list, tuple)) or len(v) != ndim or not all(isinstance(p, str) for p in v):
            fail(field, f"a list of {ndim} placements (one per mesh axis)", v)
        try:
            parse_spec(tuple(v))
        except ValueError as e:
            fail(field, f"valid placements ({e})", v)

    if not isinstance(d["nodes"], (list, tuple)):
        fail("nodes", "a list", type(d["nodes"]).__name__)
    for i, n in enumerate(d["nodes"]):
        if not isinstance(n, dict) or not isinstance(n.get("name"), str):
            fail(f"nodes[{i}]", "an object with a 'name'", n)
        for j, o in enumerate(n.get("outputs", [])):
            spec(f"nodes[{i}] ({n['name']}).outputs[{j}]", o)
        for j, o in enumerate(n.get("inputs", [])):
            if o is not None:
                spec(f"nodes[{i}] ({n['name']}).inputs[{j}]", o)
        for f in ("compute_time", "comm_time", "memory"):
            v = n.get(f, 0.0)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
                fail(f"nodes[{i}] ({n['name']}).{f}", "a finite number >= 0", v)
    for table in ("params", "inputs"):
        if not isinstance(d[table], dict):
            fail(table, "an object", type(d[table]).__name__)
        for k, v in d[table].items():
            spec(f"{table}[{k!r}]", v)
    pred = d["predicted"]
    if not isinstance(pred, dict):
        fail("predicted", "an object", pred)
    for f in ("step_time", "compute_time", "comm_time", "memory_per_device"):
        v = pred.get(f)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
            fail(f"predicted.{f}", "a finite number >= 0", v)
    if d.get("recompute", "none") not in ("none", "selective", "full", "ops"):
        fail("recompute", "'none', 'selective', 'full' or 'ops'", d.get("recompute"))
    layers = d.get("recompute_layers")
    if layers is not None and (not isinstance(layers, list) or not all(isinstance(x, str) for x in layers)):
        fail("recompute_layers", "a list of layer instance names", layers)
    off = d.get("offload_layers", [])
    if not isinstance(off, list) or not all(isinstance(x, str) for x in off):
        fail("offload_layers", "a list of layer instance names", off)
    for flag in ("compile", "offload_optimizer"):
        if not isinstance(d.get(flag, False), bool):
            fail(flag, "true or false", d.get(flag))
    comp = d.get("compression")
    if comp is not None:
        if not isinstance(comp, dict) or "method" not in comp:
            fail("compression", "an object with a 'method'", comp)
        try:
            GradCompression.from_dict(comp)
        except (TypeError, ValueError) as e:
            fail("compression", f"a valid compression ({e})", comp)
    two = d.get("two_level", [])
    ndim = len(d.get("mesh_shape", []))
    if not isinstance(two, list) or not all(
        isinstance(a, list)
        and a
        and all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < ndim for x in a)
        for a in two
    ):
        fail("two_level", f"a list of lists of mesh axis indices (0 … {ndim - 1})", two)
    fusions = d.get("fusions", [])
    if not isinstance(fusions, list):
        fail("fusions", "a list", type(fusions).__name__)
    from autopar.ir import FusionKind

    kinds = [str(k) for k in FusionKind]
    for i, f in enumerate(fusions):
        if not isinstance(f, dict) or f.get("kind") not in kinds:
            fail(
                f"fusions[{i}].kind",
                f"one of {', '.join(kinds)}",
                f.get("kind") if isinstance(f, dict) else f,
            )
        members = f.get("members")
        if (
            not isinstance(members, (list, tuple))
            or not members
            or not all(isinstance(m, str) for m in members)
        ):
            fail(f"fusions[{i}].members", "a non-empty list of node names", members)
        if f.get("anchor") not in members:
            fail(f"fusions[{i}].anchor", "one of its members", f.get("anchor"))
    pipe = d.get("pipeline")
    if pipe:
        from autopar.schedule import SCHEDULES

        for f in ("pp", "microbatches", "virtual"):
            ints(f"pipeline.{f}", [pipe.get(f, 1)])
        if pipe.get("schedule") not in SCHEDULES:
            fail("pipeline.schedule", f"one of {', '.join(SCHEDULES)}", pipe.get("schedule"))
        stages = pipe["pp"] * pipe.get("virtual", 1)
        so = pipe.get("stage_of")
        if not isinstance(so, dict) or any(
            not isinstance(v, int) or not 0 <= v < stages for v in so.values()
        ):
            fail("pipeline.stage_of", f"an object of node name -> stage 0…{stages - 1}", str(so)[:80])
        if len(pipe.get("stage_costs", [])) not in (0, stages):
            fail(
                "pipeline.stage_costs", f"{stages} entries (one per stage)", len(pipe.get("stage_costs", []))
            )

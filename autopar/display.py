"""How a Plan and an annotated graph read as text: the one place their printing is decided.

Words:

* **unit** — a row of the summary: a repeated layer (a module path up to its first index,
  ``blocks.3`` or ``model.layers.17``), or a module that is not repeated (its first two path
  components, ``model.embed_tokens``), or a run of top-level ops (``<top>``: the loss, masks).
* **layer class** — units of one repeated container (``blocks.*``); consecutive units of a class
  whose layouts are identical are *folded* into one row, ``blocks.0–31 ×32``, whose times and
  memory are the sums over the folded units. A layer that differs (the first one often receives
  the embedding's partial sum) keeps its own row.
* **execution order** — the order of the units' first ops in the captured graph (a parameter
  belongs to the unit of the module that owns it).

``Plan.summary``, ``Plan.table`` and ``str(plan)`` call :func:`plan_summary`, :func:`plan_table`
and :func:`plan_text`; :func:`layer_rows` returns the same rows as typed records, which the pictures
(``autopar.viz``) and the HTML report (``autopar.report``) draw, so text and pictures agree.
:func:`graph_table` prints an annotated ``torch.fx`` graph (``autopar.explain``), and
:func:`plan_nodes_table` a Plan node by node.

This module reads only data records (the Plan, ``autopar.ir``'s node annotations), so it sits in
the data layer next to them.
"""

from __future__ import annotations

import math
import re
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from autopar.ir import COST, STRATEGIES, TENSOR
from autopar.summary_lines import (
    compression_text,
    offload_text,
    per_activation_text,
    pipeline_devices,
    recomputed_where,
    shares_text,
)
from autopar.text_units import fmt_bytes, fmt_count, fmt_time

if TYPE_CHECKING:
    import torch

PlanRecord = Any
"""An ``autopar.planfile.Plan``. Not imported, even for types: a Plan prints itself through this
module (``Plan.summary``, ``Plan.table``), so this module sits below ``autopar.planfile``."""
NodeRecord = Any
"""An ``autopar.planfile.NodePlan`` (see ``PlanRecord``)."""

__all__ = [
    "LEGEND",
    "LayerRow",
    "fmt_bytes",
    "fmt_count",
    "fmt_time",
    "graph_table",
    "layer_rows",
    "mesh_text",
    "plan_nodes_table",
    "plan_summary",
    "plan_table",
    "plan_text",
    "recomputed_where",
    "replication_notes",
    "weights_text",
]

LEGEND = (
    "legend: specs give one placement per mesh axis ({axes}) · R replicated · S(d) split along "
    "dimension d (xk: k blocks) · P partial sums · ×n: n identical layers folded, times and memory "
    "summed over them · comm: reshards and in-op collectives, forward + backward"
)

_INDEX = re.compile(r"^\d+$")
_HIDDEN_OPS = ("getitem", "_assert_tensor_metadata")


def mesh_text(shape: Sequence[int], axes: Sequence[str]) -> str:
    """``dp=8 × tp=8``."""
    return " × ".join(f"{a}={n}" for a, n in zip(axes, shape))


# ----------------------------------------------------------------------------------- units
def unit_of(module: str) -> tuple[str, str, int | None]:
    """``(unit, layer class, index)`` of a module path (see module docstring).

    ``model.layers.3.mlp.up`` → ``("model.layers.3", "model.layers", 3)``; ``lm_head`` →
    ``("lm_head", "lm_head", None)``; ``""`` → ``("<top>", "<top>", None)``."""
    if not module:
        return "<top>", "<top>", None
    parts = module.split(".")
    for i, p in enumerate(parts):
        if _INDEX.match(p) and i > 0:
            return ".".join(parts[: i + 1]), ".".join(parts[:i]), int(p)
    head = ".".join(parts[:2])
    return head, head, None


@dataclass(slots=True)
class LayerRow:
    """One row of the plan's summary: a unit, or consecutive identical units folded."""

    name: str
    """``blocks.0–31`` when folded, else the unit (``lm_head``, ``<top>``)."""
    layer_class: str
    """The repeated container (``blocks``), or the unit itself."""
    count: int
    """Units folded into the row."""
    compute: float
    """Seconds of compute per step (forward + backward), summed over the folded units."""
    comm: float
    """Seconds of communication per step (reshards into the units' ops and in-op collectives)."""
    comm_per_axis: tuple[float, ...]
    """``comm`` split over the mesh axes (reshards by their bytes per axis, in-op collectives
    equally over the axes that carry them)."""
    memory: float
    """Bytes per device: the units' parameter training state and saved activations."""
    param_memory: float
    """The part of ``memory`` that is training state (parameters, gradients, optimizer state)."""
    weights: dict[tuple[str, ...], list[str]]
    """Parameter spec → parameter names relative to the unit (one unit's worth)."""
    collectives: Counter
    """Collective kind → count, for one unit."""
    modules: list[str] = field(default_factory=list)
    """Every module of the first folded unit, in execution order."""


@dataclass(slots=True)
class _Unit:
    name: str
    layer_class: str
    index: int | None
    compute: float = 0.0
    comm: float = 0.0
    comm_axes: list[float] = field(default_factory=list)
    memory: float = 0.0
    param_memory: float = 0.0
    weights: dict[tuple[str, ...], list[str]] = field(default_factory=dict)
    collectives: Counter = field(default_factory=Counter)
    signature: list[str] = field(default_factory=list)
    modules: list[str] = field(default_factory=list)


def _collective_kinds(r) -> list[str]:
    kinds = [c.split("(")[0] for c in r.collectives]
    if r.grad_sync_axes:
        kinds.append("grad-sync")
    return kinds


def _split_over_axes(time: float, weights: Sequence[float], ndim: int) -> list[float]:
    total = sum(weights)
    if total <= 0:
        return [time / ndim] * ndim if ndim else []
    return [time * w / total for w in weights]


def _units(plan: PlanRecord) -> list[_Unit]:
    """The plan's units in execution order (see module docstring)."""
    ndim = len(plan.mesh_shape)
    by_consumer: dict[str, list] = defaultdict(list)
    for r in plan.distinct_reshards():
        by_consumer[r.consumer].append(r)
    units: dict[str, _Unit] = {}
    order: list[_Unit] = []
    top_run = 0
    last_unit: _Unit | None = None

    def get(module: str, new_top_run: bool) -> _Unit:
        nonlocal top_run
        name, cls, idx = unit_of(module)
        if name == "<top>":
            if new_top_run:
                top_run += 1
            key = f"<top>#{top_run}"
        else:
            key = name
        u = units.get(key)
        if u is None:
            u = units[key] = _Unit(name, cls, idx, comm_axes=[0.0] * ndim)
            order.append(u)
        return u

    params = [n for n in plan.nodes if n.kind in ("param", "buffer")]
    for n in plan.nodes:
        if n.kind not in ("op", "input"):
            continue
        if n.kind == "input":  # the batch: one row before everything it feeds
            if (u := units.get("<inputs>")) is None:
                u = units["<inputs>"] = _Unit("<inputs>", "<inputs>", None, comm_axes=[0.0] * ndim)
                order.insert(0, u)
        else:
            u = get(n.module, new_top_run=(last_unit is None or not last_unit.name.startswith("<top>")))
            last_unit = u
        rel = _relative(n.module, u.name)
        if n.module not in u.modules:
            u.modules.append(n.module)
        u.compute += n.compute_time
        u.memory += n.memory
        u.comm += n.comm_time
        carriers = [1.0 if c else 0.0 for c in n.comms] if any(n.comms) else [1.0] * ndim
        for a, t in enumerate(_split_over_axes(n.comm_time, carriers, ndim)):
            u.comm_axes[a] += t
        reshards = by_consumer.get(n.name, [])
        for r in reshards:
            u.comm += r.time
            for a, t in enumerate(_split_over_axes(r.time, r.bytes_per_axis, ndim)):
                u.comm_axes[a] += t
            u.collectives.update(_collective_kinds(r))
        u.collectives.update(c.split("(")[0] for c in n.comms if c)
        if n.op not in _HIDDEN_OPS:
            coll = ",".join(sorted(k for r in reshards for k in _collective_kinds(r)))
            u.signature.append(
                f"{rel}|{n.op}|{'/'.join(map(','.join, n.outputs))}|{coll}|{','.join(n.comms)}"
            )
    for n in params:
        owner = n.fqn.rsplit(".", 1)[0] if "." in n.fqn else ""
        name, _, _ = unit_of(owner)
        u = units.get(name)
        if u is None:  # a parameter no op of its own module reads (a tied LM head's table)
            u = get(owner, new_top_run=False)
        rel = _relative(n.fqn, u.name)
        u.memory += n.memory
        u.compute += n.compute_time  # a weight's share of the optimizer step (passes.strategies)
        spec = tuple(n.outputs[0]) if n.outputs else ()
        if n.kind == "param":
            u.param_memory += n.memory
            u.weights.setdefault(spec, []).append(rel)
        u.signature.append(f"{rel}|{n.kind}|{','.join(spec)}|{n.zero_stage}")
    return order


def _relative(path: str, unit: str) -> str:
    if unit.startswith("<top>") or not path.startswith(unit):
        return path or "<top>"
    return path[len(unit) :].lstrip(".")


def layer_rows(plan: PlanRecord) -> list[LayerRow]:
    """The plan as summary rows, in execution order, repeated identical layers folded."""
    rows: list[LayerRow] = []
    run: list[_Unit] = []

    def flush() -> None:
        if not run:
            return
        first, last = run[0], run[-1]
        name = first.name
        if len(run) > 1:
            name = f"{first.layer_class}.{first.index}–{last.index}"
        ndim = len(first.comm_axes)
        rows.append(
            LayerRow(
                name=name,
                layer_class=first.layer_class,
                count=len(run),
                compute=sum(u.compute for u in run),
                comm=sum(u.comm for u in run),
                comm_per_axis=tuple(sum(u.comm_axes[a] for u in run) for a in range(ndim)),
                memory=sum(u.memory for u in run),
                param_memory=sum(u.param_memory for u in run),
                weights=first.weights,
                collectives=first.collectives,
                modules=first.modules,
            )
        )
        run.clear()

    for u in _units(plan):
        if (
            run
            and u.index is not None
            and run[-1].index is not None
            and u.layer_class == run[-1].layer_class
            and u.index == run[-1].index + 1
            and u.signature == run[-1].signature
        ):
            run.append(u)
            continue
        flush()
        run.append(u)
    flush()
    return rows


# ----------------------------------------------------------------------------------- text
def _compress(items: Iterable[str], limit: int = 8) -> str:
    counts = Counter(items)
    parts = [f"{k}×{v}" if v > 1 else k for k, v in counts.items()]
    if len(parts) > limit:
        parts = [*parts[:limit], f"+{len(parts) - limit}"]
    return " ".join(parts)


def weights_text(weights: dict[tuple[str, ...], list[str]]) -> str:
    """``q_proj k_proj: R,S(0) · o_proj: R,S(1)``: parameter names grouped by their spec (a bias
    laid out as its weight goes unsaid)."""
    parts = []
    for spec, names in weights.items():
        short = []
        for name in names:
            base, dot, leaf = name.rpartition(".")
            if leaf == "bias" and f"{base}{dot}weight" in names:
                continue  # a bias laid out as its weight goes unsaid
            short.append(base if leaf == "weight" and base else name)
        parts.append(f"{' '.join(short)}: {','.join(spec)}")
    return " · ".join(parts)


def replication_notes(plan: PlanRecord, *, batch_only: bool = False) -> list[str]:
    """For each mesh axis along which nothing is split (named ``rep``): why, in a sentence — the
    batch does not divide over the axis's devices, or splitting was predicted to cost more than
    it saves — and what to change. ``batch_only``: only the axes the batch does not divide over
    (the input's fault, which the planner warns about; the other case is the solver's choice)."""
    # The batch: the largest leading size among the inputs (a lifted constant is an input too).
    batch = max((n.shape[0] for n in plan.nodes if n.kind == "input" and n.shape), default=None)
    dp = math.prod(n for name, n in zip(plan.mesh_axes, plan.mesh_shape) if name.startswith("dp"))
    notes = []
    for a, (name, size) in enumerate(zip(plan.mesh_axes, plan.mesh_shape)):
        if not name.startswith("rep") or size == 1:
            continue
        head = f"mesh axis {a} ({name}={size}) repeats the same work on its {size} devices"
        if batch is not None and batch % (dp * size):
            local = f"{batch // dp} per data-parallel group" if dp > 1 and batch % dp == 0 else f"{batch}"
            notes.append(
                f"{head}: the batch ({local}) does not divide {size} ways, so the axis cannot be data-parallel; "
                f"use a global batch that is a multiple of {dp * size}, or fewer devices"
            )
        elif not batch_only:
            notes.append(
                f"{head}: splitting the batch or the weights along it was predicted to cost more communication "
                f"than the compute it saves; a larger batch or model, or a faster link, makes splitting pay"
            )
    return notes


def solver_status(optimal: bool, gap: float) -> str:
    """How close to the optimum a solver's plan is (``Predicted.optimal`` and ``.gap``, or a
    ``meshes_tried`` row's): ``optimal``, ``within 0.31 % of optimal`` (stopped at
    ``autopar.solver.SolverConfig.relative_gap``, or by the time limit with CP-SAT's bound that far
    below), or ``best found`` (no bound known)."""
    if optimal:
        return "optimal"
    # A gap under 0.01 % still shows as a bound (not as 0.00 %, which reads as proven).
    return f"within {max(gap * 100, 0.01):.2f} % of optimal" if gap > 0 else "best found"


def plan_summary(plan: PlanRecord) -> str:
    """The plan's totals: mesh, step time, memory against the budget, communication per axis,
    stages and schedule where the plan has them, ZeRO stages, notes (see module docstring)."""
    p = plan.predicted
    info = plan.info
    comm = ", ".join(f"{a}: {fmt_bytes(b)}" for a, b in zip(plan.mesh_axes, p.comm_bytes_per_axis))
    lines = [
        f"Plan on mesh {mesh_text(plan.mesh_shape, plan.mesh_axes)}  ({info.get('cluster_desc', '')})",
        f"  predicted step time {fmt_time(p.step_time)}   ({solver_status(p.optimal, p.gap)}; "
        f"solver's sum: compute {fmt_time(p.compute_time)} + communication {fmt_time(p.comm_time)})",
    ]
    sim = info.get("simulated")
    if sim:
        parts = [f"compute and collectives {fmt_time(sim.get('compute_and_comm', 0.0))}"]
        if "bubble_fraction" in sim:
            parts.append(f"pipeline bubble {sim['bubble_fraction'] * 100:.1f}%")
        parts.append(f"exposed gradient reduction {fmt_time(sim.get('exposed_grad_sync', 0.0))}")
        waiting = p.step_time - sum(
            sim.get(k, 0.0) for k in ("compute_and_comm", "exposed_grad_sync", "optimizer")
        )
        if "bubble_fraction" not in sim and waiting > 0.01 * p.step_time:  # the rest: the ZeRO gathers' wait
            parts.append(f"waiting on parameter gathers {fmt_time(waiting)}")
        parts.append(f"optimizer {fmt_time(sim.get('optimizer', 0.0))}")
        lines.append("  simulated step: " + ", ".join(parts))
    pipe = plan.pipeline
    if pipe is not None:
        counts = Counter(pipe.stage_of.values())
        lines.append(
            f"  pipeline: {pipe.pp} ranks × the stage mesh, {pipe.num_stages} stages "
            f"({', '.join(str(counts[s]) for s in range(pipe.num_stages))} ops), {pipe.microbatches} micro-batches, "
            f"schedule {pipe.schedule}{f' (v={pipe.virtual})' if pipe.virtual > 1 else ''}; peak memory per rank "
            + ", ".join(fmt_bytes(b) for b in pipe.peak_memory)
            + pipeline_devices(plan)
        )
        if pipe.dp_shares:
            axis = plan.mesh_axes[0] if plan.mesh_axes else "the first axis"
            lines.append(f"  unequal data-parallel shares over {axis}: {shares_text(plan)}")
    if plan.recompute == "ops":
        lines.append(f"  recomputation: ops ({per_activation_text(plan)})")
    elif plan.recompute != "none":
        lines.append(f"  recomputation: {plan.recompute} ({recomputed_where(plan)})")
    fused = plan.fusion_counts()
    if fused:
        lines.append(
            "  fused kernels assumed (autopar.program.kernels): "
            + ", ".join(f"{kind} ×{n}" for kind, n in fused.items())
        )
    if getattr(plan, "compression", None) is not None or info.get("compression_tried"):
        lines.append("  " + compression_text(plan))
    if getattr(plan, "two_level", ()):
        sets = ", ".join(" × ".join(plan.mesh_axes[a] for a in axes) for axes in plan.two_level)
        lines.append(
            f"  gradient all-reduce over {sets} in two levels (reduce-scatter on each node, all-reduce across "
            "the nodes, all-gather on each node), and its reduce-scatters and all-gathers (on each node "
            "and across): faster than one ring where the nodes' NICs are slow beside their links inside"
        )
    if getattr(plan, "offload_optimizer", False) or getattr(plan, "offload_layers", ()):
        lines.append("  " + offload_text(plan))
    if plan.compile:
        lines.append("  compiled by Inductor: the step's memory-bound chains costed as one kernel each")
    budget = info.get("memory_budget")
    mem = f"  memory per device {fmt_bytes(p.memory_per_device)}"
    if budget:
        mem += f" of {fmt_bytes(budget)} budget"
        reserve = info.get("memory_reserve")
        if reserve:
            mem += f" (device memory less {fmt_bytes(reserve)} reserved)"
    lines.append(f"{mem}; communication per step {comm}")
    zero = Counter(plan.zero_stages().values())
    if zero:
        lines.append(
            "  ZeRO: "
            + ", ".join(f"stage {s} on {k} parameter{'s' if k > 1 else ''}" for s, k in sorted(zero.items()))
        )
    if "layout" in info:
        lines.append(f"  layout: {info['layout']}")
    tried = info.get("meshes_tried") or []
    if len(tried) > 1:
        lines.append(
            "  meshes tried: "
            + ", ".join(
                f"{tuple(m['mesh'])} {fmt_time(m['objective'])}"
                if m.get("feasible")
                else f"{tuple(m['mesh'])} slower (pruned)"
                if m.get("pruned")
                else f"{tuple(m['mesh'])} —"
                for m in tried
            )
        )
    for note in [*info.get("notes", ()), *replication_notes(plan)]:
        lines.append(f"  note: {note}")
    # The plan audit (``autopar.audit``, a layer above this one) as the planner stored it: its
    # figures and findings, one line each (``autopar show`` audits a loaded plan again first).
    stored = info.get("audit")
    if isinstance(stored, dict):
        lines += [f"  {line}" for line in stored.get("lines", ())]
    return "\n".join(lines)


def plan_table(plan: PlanRecord, max_rows: int | None = None, full: bool = False) -> str:
    """The plan's rows in execution order: layer classes folded (``full=False``), or every module
    with its ops' placements and collectives (``full=True``). ``max_rows`` cuts the list."""
    if full:
        return _full_table(plan, max_rows)
    rows = layer_rows(plan)
    width = max([len(r.name) for r in rows] + [6])
    width = min(width, 44)
    lines = [
        f"{'layer':<{width}} {'×n':>4} {'compute':>10} {'comm':>10} {'memory':>10}  weights (spec per mesh axis) · collectives per layer"
    ]
    for i, r in enumerate(rows):
        if max_rows is not None and i >= max_rows:
            lines.append(f"... {len(rows) - max_rows} more rows")
            break
        count = f"×{r.count}" if r.count > 1 else ""
        colls = _compress(k for k, v in r.collectives.items() for _ in range(v))
        detail = weights_text(r.weights)
        if colls:
            detail = f"{detail}  [{colls}]" if detail else f"[{colls}]"
        lines.append(
            f"{r.name[:width]:<{width}} {count:>4} {fmt_time(r.compute):>10} {fmt_time(r.comm):>10} "
            f"{fmt_bytes(r.memory):>10}  {detail}"
        )
    return "\n".join(lines)


def _full_table(plan: PlanRecord, max_rows: int | None) -> str:
    """Every module, execution order: its ops with their output specs, compute, communication."""
    comm_by_consumer: dict[str, float] = defaultdict(float)
    coll_by_consumer: dict[str, list[str]] = defaultdict(list)
    for r in plan.distinct_reshards():
        comm_by_consumer[r.consumer] += r.time
        coll_by_consumer[r.consumer].extend(_collective_kinds(r))
    rows: dict[str, dict] = {}

    def row(mod: str) -> dict:
        if mod not in rows:
            rows[mod] = {"params": [], "ops": [], "compute": 0.0, "comm": 0.0, "colls": []}
        return rows[mod]

    for n in plan.nodes:
        if n.kind != "op":
            continue
        r = row(n.module)
        if n.op not in _HIDDEN_OPS:
            r["ops"].append(f"{n.op}→{','.join(n.outputs[0])}" if n.outputs else n.op)
        r["compute"] += n.compute_time
        r["comm"] += comm_by_consumer.get(n.name, 0.0) + n.comm_time
        r["colls"].extend(coll_by_consumer.get(n.name, []))
    for n in plan.nodes:
        if n.kind == "param":
            owner = n.fqn.rsplit(".", 1)[0] if "." in n.fqn else ""
            row(owner)["params"].append(f"{n.fqn.rsplit('.', 1)[-1]}:{','.join(n.outputs[0])}")
    lines = [f"{'module':<40} {'compute':>10} {'comm':>10}  placements / collectives"]
    for i, (mod, r) in enumerate(rows.items()):
        if max_rows is not None and i >= max_rows:
            lines.append(f"... {len(rows) - max_rows} more modules")
            break
        ops = _compress(r["params"] + r["ops"])
        colls = _compress(r["colls"])
        lines.append(
            f"{(mod or '<top>')[:40]:<40} {fmt_time(r['compute']):>10} {fmt_time(r['comm']):>10}  {ops}"
            + (f"  [{colls}]" if colls else "")
        )
    return "\n".join(lines)


def plan_text(plan: PlanRecord) -> str:
    """``str(plan)``: the summary, the legend and the folded table."""
    return "\n".join(
        [plan_summary(plan), LEGEND.format(axes=", ".join(plan.mesh_axes)), "", plan_table(plan)]
    )


def plan_nodes_table(plan: PlanRecord, max_rows: int | None = None) -> str:
    """The plan node by node (``autopar.explain(plan)``): op, module, global shape, input specs →
    output spec, per-axis rewrites, compute, in-op and reshard communication, memory, ZeRO stage."""
    comm_in: dict[str, float] = defaultdict(float)
    for r in plan.distinct_reshards():
        comm_in[r.consumer] += r.time
    header = (
        f"{'node':<28} {'op':<24} {'module':<40} {'shape':<20} {'inputs → output':<34} "
        f"{'compute':>9} {'comm':>9} {'memory':>10} notes"
    )
    lines = [header]
    for i, n in enumerate(plan.nodes):
        if max_rows is not None and i >= max_rows:
            lines.append(f"... {len(plan.nodes) - max_rows} more nodes")
            break
        ins = " ".join(",".join(s) if s is not None else "-" for s in n.inputs)
        outs = " ".join(",".join(s) for s in n.outputs)
        flow = f"{ins} → {outs}" if ins else outs
        notes = [r for r in n.rewrites if r]
        if n.zero_stage:
            notes.append(f"ZeRO-{n.zero_stage}")
        notes += [c for c in n.comms if c]
        module = n.fqn if n.kind != "op" else n.module
        lines.append(
            f"{n.name[:28]:<28} {n.op[:24]:<24} {module[:40]:<40} {str(list(n.shape))[:20]:<20} {flow[:34]:<34} "
            f"{fmt_time(n.compute_time):>9} {fmt_time(n.comm_time + comm_in.get(n.name, 0.0)):>9} "
            f"{fmt_bytes(n.memory):>10} {' '.join(notes)}"
        )
    return "\n".join(lines)


def graph_table(gm: torch.fx.GraphModule, max_rows: int | None = None, title: str = "") -> str:
    """An annotated graph, one line per node: op, module, shape and dtype, forward/backward FLOPs,
    roofline time, saved bytes, and the number of strategies (with the node it follows). Missing
    annotations print as ``-``."""
    lines = [title] if title else []
    lines.append(
        f"{'node':<28} {'op':<30} {'module':<32} {'shape':<22} {'GFLOP f/b':>13} {'time':>9} {'saved':>10} strategies"
    )
    nodes = list(gm.graph.nodes)
    for i, n in enumerate(nodes):
        if max_rows is not None and i >= max_rows:
            lines.append(f"... {len(nodes) - max_rows} more nodes")
            break
        info, cost, strat = n.meta.get(TENSOR), n.meta.get(COST), n.meta.get(STRATEGIES)
        op = str(n.target) if n.op == "call_function" else n.op
        shape = f"{list(info.shape)} {info.dtype}" if info is not None else "-"
        module = (info.fqn or info.module) if info is not None else "-"
        flops = f"{cost.fwd_flops / 1e9:.2f}/{cost.bwd_flops / 1e9:.2f}" if cost is not None else "-"
        t = fmt_time(cost.fwd_time + cost.bwd_time) if cost is not None else "-"
        saved = fmt_bytes(cost.saved_bytes) if cost is not None else "-"
        st = (
            "-"
            if strat is None
            else f"{len(strat.strategies)}" + (f" (follows {strat.follows})" if strat.follows else "")
        )
        lines.append(
            f"{n.name[:28]:<28} {op[:30]:<30} {module[:32]:<32} {shape[:22]:<22} {flops:>13} {t:>9} {saved:>10} {st}"
        )
    return "\n".join(lines)


def param_count(nodes: Iterable[NodeRecord]) -> int:
    """Elements of the plan's parameters (each counted once)."""
    return sum(math.prod(n.shape) for n in nodes if n.kind == "param")

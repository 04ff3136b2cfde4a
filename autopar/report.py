"""Reports a person reads: ``explain`` (a graph or a plan as a table), ``compare`` (two plans side
by side) and ``html_report`` (one self-contained HTML file with the pictures of ``autopar.viz``).

Words:

* **fresh capture** — ``autopar.capture(model, inputs)`` before any pass ran: ``explain`` runs the
  annotation passes on it (tensor facts and single-device costs on ``cluster``'s device; with a
  ``mesh``, also the strategies the solver would choose from), so every column has a value.
* **comparison** — two plans of the same model and batch, each a column: predicted step time,
  compute, communication, memory per device, bytes per mesh axis, and their ratios.
* **report** — an HTML page with no external resource (images are embedded as ``data:`` URIs, the
  style is inline, the simulated step is inline SVG: ``autopar.step_draw``), so it opens offline
  and can be mailed as one file.
* **the step per rank** — the plan's simulated step drawn per pipeline rank (passes with their
  micro-batches, idle, sends, collectives, the optimizer step), memory over the step per rank and
  the time inside one repeated layer; with a baseline, both plans' steps on one time scale.
"""

from __future__ import annotations

import base64
import html
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from autopar import display
from autopar.capture import Captured, capture
from autopar.cluster import Cluster
from autopar.ir import COST, TENSOR
from autopar.planfile import Plan

__all__ = ["Comparison", "compare", "explain", "html_report"]

DEFAULT_DEVICE = "H100-SXM"
"""The device ``explain`` costs a fresh capture on when no cluster is given."""


def explain(
    obj: Any,
    example_inputs: Any = None,
    *,
    cluster: Cluster | None = None,
    mesh: Sequence[int] | None = None,
    max_rows: int | None = None,
) -> str:
    """Print any stage as a table (see module docstring).

    ``obj`` is a ``Plan`` (every node: its specs, rewrites, times, memory), a ``Captured`` (the
    graph, annotated as needed), a model with ``example_inputs`` (captured first), or an
    annotated ``torch.fx.GraphModule``. ``cluster`` (default one ``H100-SXM``) prices the ops;
    ``mesh`` (e.g. ``(8,)``) adds the number of strategies each node has on that mesh.
    """
    if isinstance(obj, Plan):
        return display.plan_summary(obj) + "\n\n" + display.plan_nodes_table(obj, max_rows=max_rows)
    if isinstance(obj, torch.nn.Module) and not isinstance(obj, torch.fx.GraphModule):
        if example_inputs is None:
            raise TypeError("explain(model, example_inputs): a model needs one example batch to be captured")
        obj = capture(obj, example_inputs)
    if isinstance(obj, Captured):
        if cluster is None:
            n = math.prod(mesh) if mesh is not None else 1
            cluster = Cluster.preset(DEFAULT_DEVICE, gpus_per_node=min(n, 8), nodes=-(-n // 8))
        _annotate(obj, cluster, mesh)
        where = f"costs on one {cluster.device.name}"
        if mesh is not None:
            where += f", strategies on mesh {tuple(mesh)}"
        return display.graph_table(obj.gm, max_rows=max_rows, title=f"captured graph ({where})")
    if isinstance(obj, torch.fx.GraphModule):
        annotated = any(TENSOR in n.meta or COST in n.meta for n in obj.graph.nodes)
        title = (
            ""
            if annotated
            else "not annotated: pass autopar.capture(...)'s result (or the model and its inputs) to annotate"
        )
        return display.graph_table(obj, max_rows=max_rows, title=title)
    raise TypeError(
        f"explain takes a Plan, a Captured, a model with example inputs or a GraphModule; got {type(obj).__name__}"
    )


def _annotate(cap: Captured, cluster: Cluster, mesh: Sequence[int] | None) -> None:
    from autopar.mesh import Mesh
    from autopar.passes import PassContext, run_passes
    from autopar.passes.strategies import annotate_strategies
    from autopar.planner import GRAPH_PASSES, detect_mixed_precision

    mixed = detect_mixed_precision(cap)
    ctx = PassContext(captured=cap, cluster=cluster, mixed_precision=mixed)
    run_passes(cap.gm, ctx, GRAPH_PASSES)
    if mesh is not None:
        m = Mesh(tuple(mesh), cluster)
        run_passes(
            cap.gm,
            PassContext(captured=cap, cluster=cluster, mesh=m, mixed_precision=mixed),
            [annotate_strategies],
        )


# ----------------------------------------------------------------------------------- compare
@dataclass(frozen=True, slots=True)
class Comparison:
    """Two plans of one model side by side (``str()`` is the table ``autopar compare`` prints)."""

    a: Plan
    b: Plan
    names: tuple[str, str]

    @property
    def same_program(self) -> bool:
        """Both plans were made for the same captured graph (model and batch shapes)."""
        return self.a.fingerprint == self.b.fingerprint

    def rows(self) -> list[tuple[str, str, str, str]]:
        """``(quantity, A, B, B / A)`` for the totals."""
        a, b = self.a.predicted, self.b.predicted

        def ratio(x: float, y: float) -> str:
            return f"×{y / x:.2f}" if x > 0 else "-"

        def comm(p: Plan) -> str:
            return ", ".join(
                f"{ax} {display.fmt_bytes(v)}" for ax, v in zip(p.mesh_axes, p.predicted.comm_bytes_per_axis)
            )

        return [
            ("mesh", display.mesh_text(self.a.mesh_shape, self.a.mesh_axes), display.mesh_text(self.b.mesh_shape, self.b.mesh_axes), ""),
            ("layout", self.a.info.get("layout", "autopar"), self.b.info.get("layout", "autopar"), ""),
            ("step time", display.fmt_time(a.step_time), display.fmt_time(b.step_time), ratio(a.step_time, b.step_time)),
            ("  compute", display.fmt_time(a.compute_time), display.fmt_time(b.compute_time), ratio(a.compute_time, b.compute_time)),
            ("  communication", display.fmt_time(a.comm_time), display.fmt_time(b.comm_time), ratio(a.comm_time, b.comm_time)),
            ("memory per device", display.fmt_bytes(a.memory_per_device), display.fmt_bytes(b.memory_per_device),
             ratio(a.memory_per_device, b.memory_per_device)),
            ("bytes per step", comm(self.a), comm(self.b),
             ratio(sum(a.comm_bytes_per_axis), sum(b.comm_bytes_per_axis))),
        ]  # fmt: skip

    def layer_rows(self) -> list[tuple[str, float, float]]:
        """``(layer class, A's time, B's time)`` (compute + communication, summed over the class's
        layers) in A's execution order, when both plans are of the same program."""
        if not self.same_program:
            return []

        def by_class(plan: Plan) -> dict[str, float]:
            out: dict[str, float] = {}
            for r in display.layer_rows(plan):
                count = sum(x.count for x in display.layer_rows(plan) if x.layer_class == r.layer_class)
                key = f"{r.layer_class}.* ×{count}" if r.name != r.layer_class else r.layer_class
                out[key] = out.get(key, 0.0) + r.compute + r.comm
            return out

        ta, tb = by_class(self.a), by_class(self.b)
        return [(k, v, tb.get(k, float("nan"))) for k, v in ta.items()]

    def verdict(self) -> str:
        """One sentence: which plan is predicted faster, by how much, and whether both fit."""
        ta, tb = self.a.predicted.step_time, self.b.predicted.step_time
        if math.isclose(ta, tb, rel_tol=1e-3):
            return f"{self.names[0]} and {self.names[1]} are predicted equally fast"
        fast, slow, tf, ts = (*self.names, ta, tb) if ta < tb else (self.names[1], self.names[0], tb, ta)
        return f"{fast} is predicted {ts / tf:.2f}× faster than {slow} ({display.fmt_time(tf)} vs {display.fmt_time(ts)} per step)"

    def __str__(self) -> str:
        w = max(len(self.names[0]), len(self.names[1]), 26)
        lines = [f"{'':<20} {self.names[0][:w]:<{w}} {self.names[1][:w]:<{w}} B / A"]
        for q, x, y, r in self.rows():
            lines.append(f"{q:<20} {x[:w]:<{w}} {y[:w]:<{w}} {r}")
        rows = self.layer_rows()
        if rows:
            lines += ["", f"{'per layer (compute + comm)':<32} {'A':>10} {'B':>10}  B / A"]
            for name, x, y in rows:
                lines.append(
                    f"{name[:32]:<32} {display.fmt_time(x):>10} {display.fmt_time(y) if y == y else '-':>10}  "
                    + (f"×{y / x:.2f}" if x > 0 and y == y else "")
                )
        elif not self.same_program:
            wa, wb = self.a.info.get("workload"), self.b.info.get("workload")
            if wa is not None and wa == wb:
                lines += ["", "note: the plans cut the same workload into different micro-batches: layer by layer "
                          "they are not compared"]  # fmt: skip
            else:
                lines += ["", "note: the plans are for different programs (model or batch shapes differ)"]
        lines += ["", self.verdict()]
        return "\n".join(lines)


def compare(a: Plan, b: Plan, names: Sequence[str] = ("A", "B")) -> Comparison:
    """Plans ``a`` and ``b`` side by side (see :class:`Comparison`)."""
    return Comparison(a, b, (str(names[0]), str(names[1])))


# ----------------------------------------------------------------------------------- html
_CSS = """
body{font:14px/1.45 system-ui,-apple-system,'Segoe UI',sans-serif;margin:2em auto;max-width:1100px;color:#222;padding:0 1em}
h1{font-size:1.5em} h2{font-size:1.15em;margin-top:2em;border-bottom:1px solid #ddd}
pre{background:#f6f8fa;padding:.8em;white-space:pre-wrap;font-size:12px}
table{border-collapse:collapse;font-size:12px} td,th{border:1px solid #ddd;padding:3px 8px;text-align:right}
td:first-child,th:first-child,td.text{text-align:left} img{max-width:100%;border:1px solid #eee;margin:.5em 0}
.good{color:#1a7f37}.bad{color:#cf222e} .muted{color:#777}
"""

_SELF_CHECK = """
window.addEventListener('load', function () {
  var imgs = Array.prototype.slice.call(document.images);
  var ok = imgs.filter(function (i) { return i.complete && i.naturalWidth > 0; }).length;
  document.body.setAttribute('data-images', imgs.length);
  document.body.setAttribute('data-images-ok', ok);
  // The drawn steps (inline SVG): how many, and where the first one lies on the page.
  var steps = document.querySelectorAll('svg.timeline');
  document.body.setAttribute('data-timelines', steps.length);
  if (steps.length) {
    var r = steps[0].getBoundingClientRect();
    document.body.setAttribute('data-timeline-box', [r.left + window.scrollX, r.top + window.scrollY,
      r.width, r.height].map(Math.round).join(','));
    document.body.setAttribute('data-timeline-bars', steps[0].querySelectorAll('rect.bar').length);
  }
  if (ok < imgs.length) {
    var p = document.createElement('p'); p.className = 'bad';
    p.textContent = (imgs.length - ok) + ' picture(s) could not be decoded';
    document.body.insertBefore(p, document.body.firstChild);
  }
});
"""


def _img(path: Path, alt: str) -> str:
    data = base64.b64encode(path.read_bytes()).decode()
    mime = "image/svg+xml" if path.suffix == ".svg" else "image/png"
    return f'<img alt="{html.escape(alt)}" src="data:{mime};base64,{data}">'


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def html_report(
    plan: Plan,
    path: Path,
    *,
    baseline: Plan | None = None,
    baseline_name: str = "",
    plan_name: str = "this plan",
    measured: dict[str, Any] | None = None,
    timeline: Any = None,
) -> Path:
    """Write one self-contained HTML file (see module docstring) about ``plan``: the model, the
    cluster, the plan's summary, its simulated step per rank (module docstring), pictures, the
    per-layer table, the comparison with ``baseline`` (e.g. ``autopar.layouts.best_megatron``'s
    plan; both steps drawn on one scale, the plan named ``plan_name`` there), the simulated step's
    Gantt chart when a ``timeline`` is given, and prediction against ``measured`` (an ``autopar
    train --record`` run record). Returns ``path``."""
    import tempfile

    from autopar import viz

    path = Path(path)
    sections: list[tuple[str, str, str]] = []  # (id, title, body html)
    workload = plan.info.get("workload") or {}
    model_rows = [(k, "" if v is None else str(v)) for k, v in workload.items() if v not in (None, {}, [])]
    n_params = display.param_count(plan.nodes)
    model_rows.append(
        ("parameters", f"{n_params / 1e9:.3g}B" if n_params >= 1e8 else f"{n_params / 1e6:.3g}M")
    )
    model_rows.append(("graph fingerprint", plan.fingerprint))
    sections.append(("model", "Model", _table(("", ""), model_rows)))
    cluster_desc = plan.info.get("cluster_desc", "")
    c = plan.cluster
    cluster_rows = [
        ("cluster", cluster_desc),
        ("devices", f"{c.get('nodes', '?')} node(s) × {c.get('gpus_per_node', '?')}"),
    ]
    if plan.info.get("memory_budget"):
        cluster_rows.append(("memory budget per device", display.fmt_bytes(plan.info["memory_budget"])))
    sections.append(("cluster", "Cluster", _table(("", ""), cluster_rows)))
    summary = display.plan_summary(plan) + "\n" + display.LEGEND.format(axes=", ".join(plan.mesh_axes))
    sections.append(("plan", "Plan", f"<pre>{html.escape(summary)}</pre>"))
    sections.append(("step", "The step per rank", _step_html(plan)))
    sections.append(("audit", "Audit", _audit_section(plan)))
    with tempfile.TemporaryDirectory() as tmp:
        figs = viz.plan_figures(plan, Path(tmp))
        pics = "".join(_img(f, f.stem.replace("_", " ")) for f in figs)
        if timeline is not None:
            pics += _img(viz.gantt(timeline, Path(tmp) / "gantt.png"), "pipeline schedule")
        sections.append(("pictures", "Where time and memory go", pics))
        rows = display.layer_rows(plan)
        table_rows = [
            (r.name, f"×{r.count}" if r.count > 1 else "", display.fmt_time(r.compute), display.fmt_time(r.comm),
             *(display.fmt_time(t) for t in r.comm_per_axis), display.fmt_bytes(r.memory),
             display.weights_text(r.weights))
            for r in rows
        ]  # fmt: skip
        header = (
            "layer",
            "×n",
            "compute",
            "comm",
            *(f"comm {a}" for a in plan.mesh_axes),
            "memory",
            "weights",
        )
        sections.append(("layers", "Per layer", _table(header, table_rows)))
        if baseline is not None:
            cmp = compare(plan, baseline, names=(plan_name, baseline_name or "baseline"))
            body = _table(("", plan_name, baseline_name or "baseline", "baseline / plan"), cmp.rows())
            body += f"<p>{html.escape(cmp.verdict())}</p>"
            body += _img(
                viz.compare_plans(plan, baseline, Path(tmp) / "compare.png", names=cmp.names), "comparison"
            )
            body += _step_pair_html((plan, baseline), cmp.names)
            sections.append(("comparison", f"Comparison with {baseline_name or 'the baseline'}", body))
    if measured is not None:
        sections.append(("measured", "Prediction and measurement", _measured(plan, measured)))
    tried = plan.info.get("meshes_tried") or []
    if tried:
        trows = [(str(tuple(m["mesh"])), display.fmt_time(m["objective"]) if m.get("feasible") else "slower (pruned)" if m.get("pruned") else "does not fit",
                  display.solver_status(m.get("optimal", False), m.get("gap", 0.0)) if m.get("feasible") else "",
                  f"{m.get('solve_time', 0):.2f} s") for m in tried]  # fmt: skip
        planning = f"<p>planned in {plan.info.get('planning_time', 0):.1f} s</p>" + _table(
            ("mesh", "predicted step", "", "solve time"), trows
        )
        sections.append(("planning", "Meshes tried", planning))
    nav = " · ".join(f'<a href="#{i}">{html.escape(t)}</a>' for i, t, _ in sections)
    body = "".join(f'<section id="{i}"><h2>{html.escape(t)}</h2>{b}</section>' for i, t, b in sections)
    devices = (
        f"{c.get('nodes', 1) * c.get('gpus_per_node', 1)} × {c.get('device', {}).get('name', 'devices')}"
    )
    title = f"autopar plan: {workload.get('model', 'a model')} on {devices}"
    doc = (
        f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
        f"<style>{_CSS}</style><script>{_SELF_CHECK}</script></head><body>"
        f'<h1>{html.escape(title)}</h1><p class="muted">written by autopar on {time.strftime("%Y-%m-%d %H:%M")}; '
        f"self-contained (no network needed)</p><nav>{nav}</nav>{body}</body></html>"
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(doc, encoding="utf-8")
    return path


def _step_html(plan: Plan, *, name: str = "", scales: dict[str, float] | None = None) -> str:
    """The simulated step of ``plan`` drawn per pipeline rank (``autopar.step_draw``): the timeline,
    memory over the step and the time inside one repeated layer; ``scales`` (``time``, ``memory``,
    ``part``: each axis's top) put two plans on one scale."""
    from autopar.layer_breakdown import layer_breakdown
    from autopar.step_draw import breakdown_svg, memory_svg, timeline_svg
    from autopar.step_trace import step_trace

    p = plan.pipeline
    if p is not None and not p.stage_costs:
        return (
            '<p class="muted">the plan records no stage costs to simulate (planned by an older autopar)</p>'
        )
    trace = step_trace(plan)
    pipeline = (
        f"{len(trace.tracks)} pipeline ranks, schedule {trace.schedule}"
        + (f" (v={trace.virtual})" if trace.virtual > 1 else "")
        + f", {trace.microbatches} micro-batches"
        if p is not None
        else "one pipeline rank (no pipeline)"
    )
    caption = (
        f"<p>{html.escape(name + ': ' if name else '')}{html.escape(pipeline)}; each row stands for its "
        f"{html.escape(trace.devices)}, which run the same program. Simulated step "
        f"{display.fmt_time(trace.step_time)}; pipeline bubble {trace.bubble_fraction:.1%} of the "
        f"{display.fmt_time(trace.compute_end)} of passes (drawn idle: {trace.idle_share():.1%}).</p>"
    )
    scales = scales or {}
    body = caption + timeline_svg(trace, time_max=scales.get("time"), title=name)
    body += memory_svg(
        trace,
        time_max=scales.get("time"),
        memory_max=scales.get("memory"),
        budget=plan.info.get("memory_budget"),
    )
    b = layer_breakdown(plan)
    if b is not None:
        body += breakdown_svg(b, time_max=scales.get("part"))
    return body


def _step_pair_html(plans: Sequence[Plan], names: Sequence[str]) -> str:
    """Both plans' steps, one above the other on one time scale (and one scale for their layers)."""
    from autopar.layer_breakdown import layer_breakdown
    from autopar.simulate import simulate

    sims = [simulate(p) for p in plans if p.pipeline is None or p.pipeline.stage_costs]
    parts = [b for b in map(layer_breakdown, plans) if b is not None]
    scales = {
        "time": max((s.step_time for s in sims), default=0.0),
        "memory": max((m for s in sims for m in s.timeline.peak_memory), default=0.0),
        "part": max((x.time for b in parts for x in b.parts), default=0.0),
    }
    return "".join(
        f'<div class="step-of" data-plan="{html.escape(n)}">'
        + _step_html(p, name=n, scales={k: v for k, v in scales.items() if v > 0})
        + "</div>"
        for p, n in zip(plans, names)
    )


def _audit_section(plan: Plan) -> str:
    """The plan audit (``autopar.audit``): its figures, then one row per finding."""
    from autopar.audit import audit

    a = audit(plan)
    rows = [(f.severity, f.kind.replace("_", " "), f"{f.share * 100:.1f} %", f.message) for f in a.findings]
    body = f"<p>{html.escape(a.figures())}</p>"
    return body + (_table(("severity", "what", "share", "finding"), rows) if rows else "<p>no findings</p>")


def _measured(plan: Plan, run: dict[str, Any]) -> str:
    """Predicted against measured step time (and memory, when the run recorded it)."""
    rows = []
    if run.get("fingerprint") and run["fingerprint"] != plan.fingerprint:
        warn = (
            '<p class="bad">the run was of a different program than this plan (graph fingerprints differ)</p>'
        )
    else:
        warn = ""
    pred, meas = plan.predicted.step_time, run.get("median_step_time")
    if meas:
        err = (pred - meas) / meas
        rows.append(("step time (median)", display.fmt_time(pred), display.fmt_time(meas), f"{err:+.0%}"))
    peak = run.get("peak_memory_per_device")
    if peak:
        pm = plan.predicted.memory_per_device
        rows.append(
            (
                "memory per device (peak)",
                display.fmt_bytes(pm),
                display.fmt_bytes(peak),
                f"{(pm - peak) / peak:+.0%}",
            )
        )
    where = f"<p>run: {html.escape(str(run.get('world', '?')))} processes on {html.escape(str(run.get('cluster', '')))}, " \
            f"{len(run.get('step_times', []))} steps</p>"  # fmt: skip
    return warn + where + _table(("", "predicted", "measured", "error"), rows)

"""Pictures of plans (matplotlib, written as PNG or SVG files): where the step's time goes per layer,
memory per device by kind, a memory estimate under each ZeRO stage and recomputation, two plans side
by side, and a pipeline step as a Gantt chart.

Every picture draws records other modules compute — ``autopar.display.layer_rows`` (the rows
``print(plan)`` shows), ``autopar.estimate.MemoryEstimate``, the simulator's ``Timeline`` — so a
picture and the text beside it cannot disagree. Each function takes the output ``path`` (its suffix
picks the format) and returns it. matplotlib is an optional dependency (``pip install
'autopar[report]'``); it is drawn with the non-interactive Agg backend, so no display is needed.

Colours: compute is grey; communication takes one colour per mesh axis, the same in every picture.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autopar.display import fmt_bytes, layer_rows, mesh_text

if TYPE_CHECKING:
    from autopar.estimate import MemoryEstimate
    from autopar.planfile import Plan

__all__ = ["compare_plans", "gantt", "memory_estimate", "memory_per_layer", "plan_figures", "time_per_layer"]

COMPUTE = "#8c8c8c"
AXIS_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd")
STATE = ("#4c72b0", "#55a868", "#c44e52")
"""Parameters, gradients, optimizer state."""
ACTIVATIONS = "#dd8452"


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise ImportError(
            "autopar's pictures need matplotlib: pip install matplotlib  (in a checkout: pip install -e '.[report]')"
        ) from None
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fmt = path.suffix.lstrip(".").lower() or "png"
    if fmt not in ("png", "svg", "pdf"):
        raise ValueError(f"{path}: pictures are written as .png, .svg or .pdf")
    import matplotlib

    with matplotlib.rc_context({"svg.fonttype": "none"}):  # SVG text stays text: searchable, selectable
        fig.savefig(path, format=fmt, dpi=110, bbox_inches="tight")
    _pyplot().close(fig)
    return path


def _time_scale(seconds: float) -> tuple[float, str]:
    if seconds >= 1:
        return 1.0, "s"
    if seconds >= 1e-3:
        return 1e3, "ms"
    return 1e6, "µs"


def _byte_scale(b: float) -> tuple[float, str]:
    for unit, f in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if b >= f:
            return 1.0 / f, unit
    return 1.0, "B"


def time_per_layer(plan: Plan, path: Path) -> Path:
    """Horizontal bars, one per summary row in execution order: compute, then the communication of
    each mesh axis stacked after it (times summed over folded layers, as ``print(plan)`` shows)."""
    plt = _pyplot()
    rows = layer_rows(plan)
    scale, unit = _time_scale(max((r.compute + r.comm for r in rows), default=0.0))
    fig, ax = plt.subplots(figsize=(9, 0.35 * len(rows) + 1.6))
    y = list(range(len(rows)))[::-1]
    left = [r.compute * scale for r in rows]
    ax.barh(y, left, color=COMPUTE, label="compute")
    for a, name in enumerate(plan.mesh_axes):
        widths = [r.comm_per_axis[a] * scale for r in rows]
        ax.barh(
            y, widths, left=left, color=AXIS_COLOURS[a % len(AXIS_COLOURS)], label=f"communication on {name}"
        )
        left = [x + w for x, w in zip(left, widths)]
    ax.set_yticks(y, [f"{r.name} ×{r.count}" if r.count > 1 else r.name for r in rows], fontsize=8)
    ax.set_xlabel(f"time per step ({unit}, forward + backward)")
    p = plan.predicted
    ax.set_title(f"where the step goes — mesh {mesh_text(plan.mesh_shape, plan.mesh_axes)}, "
                 f"predicted {p.step_time * scale:.3g} {unit}", fontsize=10)  # fmt: skip
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(axis="x", alpha=0.3)
    return _save(fig, path)


def memory_per_layer(plan: Plan, path: Path) -> Path:
    """Horizontal bars per summary row: training state (parameters, gradients, optimizer state) and
    saved activations on one device, with the plan's total against its budget in the title."""
    plt = _pyplot()
    rows = layer_rows(plan)
    scale, unit = _byte_scale(max((r.memory for r in rows), default=0.0))
    fig, ax = plt.subplots(figsize=(9, 0.35 * len(rows) + 1.6))
    y = list(range(len(rows)))[::-1]
    state = [r.param_memory * scale for r in rows]
    acts = [(r.memory - r.param_memory) * scale for r in rows]
    ax.barh(y, state, color=STATE[0], label="training state (parameters, gradients, optimizer)")
    ax.barh(y, acts, left=state, color=ACTIVATIONS, label="saved activations")
    ax.set_yticks(y, [f"{r.name} ×{r.count}" if r.count > 1 else r.name for r in rows], fontsize=8)
    ax.set_xlabel(f"memory per device ({unit})")
    budget = plan.info.get("memory_budget")
    total = fmt_bytes(plan.predicted.memory_per_device)
    ax.set_title(
        f"memory per device: {total}" + (f" of a {fmt_bytes(budget)} budget" if budget else ""), fontsize=10
    )
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(axis="x", alpha=0.3)
    return _save(fig, path)


def memory_estimate(
    estimates: dict[tuple[int, str], MemoryEstimate], path: Path, *, budget: float | None = None
) -> Path:
    """Stacked bars of the worst stage's memory per device for each (ZeRO stage, recomputation):
    parameters, gradients, optimizer state, activations; the budget as a line."""
    plt = _pyplot()
    keys = list(estimates)
    peaks = [estimates[k].peak for k in keys]
    scale, unit = _byte_scale(max(max(p.total for p in peaks), budget or 0.0))
    fig, ax = plt.subplots(figsize=(max(6.0, 0.7 * len(keys) + 2), 4.2))
    x = list(range(len(keys)))
    bottom = [0.0] * len(keys)
    for label, colour, part in (
        ("parameters", STATE[0], lambda p: p.parameters),
        ("gradients", STATE[1], lambda p: p.gradients),
        ("optimizer state", STATE[2], lambda p: p.optimizer),
        ("activations", ACTIVATIONS, lambda p: p.activations),
    ):
        h = [part(p) * scale for p in peaks]
        ax.bar(x, h, bottom=bottom, color=colour, label=label)
        bottom = [b + v for b, v in zip(bottom, h)]
    if budget:
        ax.axhline(
            budget * scale, color="black", linestyle="--", linewidth=1, label=f"budget {fmt_bytes(budget)}"
        )
    names = {0: "DDP", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}
    ax.set_xticks(x, [f"{names[z]}\n{r}" for z, r in keys], fontsize=8)
    ax.set_ylabel(f"memory per device ({unit})")
    ax.set_title("memory per device by ZeRO stage and recomputation (worst pipeline stage)", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    return _save(fig, path)


def compare_plans(a: Plan, b: Plan, path: Path, names: Sequence[str] = ("A", "B")) -> Path:
    """Two plans side by side: the step time (compute and communication per mesh axis) and the
    memory per device of each; below, the time of every summary row of both when they plan the same
    program."""
    plt = _pyplot()
    same = a.fingerprint == b.fingerprint
    fig = plt.figure(figsize=(11, 7.5 if same else 3.8))
    grid = fig.add_gridspec(2 if same else 1, 2, height_ratios=[1, 1.6] if same else [1])
    ax_t, ax_m = fig.add_subplot(grid[0, 0]), fig.add_subplot(grid[0, 1])
    plans = (a, b)
    scale, unit = _time_scale(max(p.predicted.step_time for p in plans))
    labels = [f"{n}\n{mesh_text(p.mesh_shape, p.mesh_axes)}" for n, p in zip(names, plans)]
    for i, p in enumerate(plans):
        rows = layer_rows(p)
        left = p.predicted.compute_time * scale
        ax_t.barh(i, left, color=COMPUTE, label="compute" if i == 0 else None)
        for k, axis in enumerate(p.mesh_axes):
            w = sum(r.comm_per_axis[k] for r in rows) * scale
            ax_t.barh(i, w, left=left, color=AXIS_COLOURS[k % len(AXIS_COLOURS)], label=f"comm {axis}")
            left += w
        ax_t.text(left, i, f" {p.predicted.step_time * scale:.3g} {unit}", va="center", fontsize=8)
    ax_t.set_yticks([0, 1], labels, fontsize=8)
    ax_t.invert_yaxis()
    ax_t.set_xlabel(f"predicted step time ({unit})")
    handles, texts = ax_t.get_legend_handles_labels()
    unique = dict(zip(texts, handles))
    ax_t.legend(unique.values(), unique.keys(), fontsize=7, loc="lower right")
    mscale, munit = _byte_scale(max(p.predicted.memory_per_device for p in plans))
    for i, p in enumerate(plans):
        rows = layer_rows(p)
        state = sum(r.param_memory for r in rows) * mscale
        acts = p.predicted.memory_per_device * mscale - state
        ax_m.barh(i, state, color=STATE[0], label="training state" if i == 0 else None)
        ax_m.barh(i, max(acts, 0.0), left=state, color=ACTIVATIONS, label="activations" if i == 0 else None)
        ax_m.text(
            state + max(acts, 0.0), i, f" {fmt_bytes(p.predicted.memory_per_device)}", va="center", fontsize=8
        )
    ax_m.set_yticks([0, 1], labels, fontsize=8)
    ax_m.invert_yaxis()
    ax_m.set_xlabel(f"memory per device ({munit})")
    ax_m.legend(fontsize=7, loc="lower right")
    if same:
        ax = fig.add_subplot(grid[1, :])
        ra = {r.name: r for r in layer_rows(a)}
        rb = {r.name: r for r in layer_rows(b)}
        order = list(ra) + [n for n in rb if n not in ra]
        rs, ru = _time_scale(max([r.compute + r.comm for r in (*ra.values(), *rb.values())] or [0.0]))
        x = list(range(len(order)))
        for j, (rows, name) in enumerate(((ra, names[0]), (rb, names[1]))):
            comp = [rows[n].compute * rs if n in rows else 0.0 for n in order]
            comm = [rows[n].comm * rs if n in rows else 0.0 for n in order]
            xs = [v + (j - 0.5) * 0.4 for v in x]
            ax.bar(
                xs,
                comp,
                width=0.4,
                color=COMPUTE,
                edgecolor="black" if j else "none",
                label=f"{name} compute",
            )
            ax.bar(xs, comm, width=0.4, bottom=comp, color=AXIS_COLOURS[j], label=f"{name} communication")
        ax.set_xticks(x, order, rotation=45, ha="right", fontsize=7)
        ax.set_ylabel(f"time per step ({ru})")
        ax.set_title("per layer (left bar: " + names[0] + ", right bar: " + names[1] + ")", fontsize=9)
        ax.legend(fontsize=7)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(f"{names[0]} vs {names[1]}", fontsize=10)
    fig.tight_layout()
    return _save(fig, path)


def gantt(timeline: Any, path: Path) -> Path:
    """The simulator's ``Timeline`` as a Gantt chart: one lane per device group (pipeline stage and
    stream), one box per event coloured by its kind, time along the x axis."""
    plt = _pyplot()
    events = list(timeline.events)
    if not events:
        raise ValueError("the timeline has no events to draw")
    lanes = sorted({e.lane for e in events}, key=str)
    kinds = sorted({e.kind for e in events}, key=str)
    palette = {
        k: AXIS_COLOURS[i % len(AXIS_COLOURS)] if k not in ("forward", "backward") else None
        for i, k in enumerate(kinds)
    }
    palette.update({"forward": "#4c72b0", "backward": "#c44e52"})
    end = max(e.end for e in events)
    scale, unit = _time_scale(end)
    fig, ax = plt.subplots(figsize=(11, 0.5 * len(lanes) + 1.6))
    for e in events:
        y = lanes.index(e.lane)
        ax.broken_barh([(e.start * scale, (e.end - e.start) * scale)], (y - 0.4, 0.8), facecolors=palette.get(e.kind) or COMPUTE,
                       edgecolor="white", linewidth=0.3)  # fmt: skip
        label = getattr(e, "label", "")
        if label and (e.end - e.start) / end > 0.02:
            ax.text(
                (e.start + e.end) / 2 * scale,
                y,
                str(label),
                ha="center",
                va="center",
                fontsize=6,
                color="white",
            )
    ax.set_yticks(range(len(lanes)), [str(lane) for lane in lanes], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(f"time ({unit})")
    from matplotlib.patches import Patch

    ax.legend([Patch(color=palette.get(k) or COMPUTE) for k in kinds], kinds, fontsize=7, loc="upper right")
    ax.set_title(f"one training step: {end * scale:.3g} {unit}", fontsize=10)
    return _save(fig, path)


def plan_figures(plan: Plan, directory: Path, *, fmt: str = "png") -> list[Path]:
    """The plan's pictures in ``directory``: ``time_per_layer.<fmt>`` and ``memory_per_layer.<fmt>``."""
    directory = Path(directory)
    return [
        time_per_layer(plan, directory / f"time_per_layer.{fmt}"),
        memory_per_layer(plan, directory / f"memory_per_layer.{fmt}"),
    ]

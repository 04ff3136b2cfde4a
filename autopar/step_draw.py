"""Drawings of a simulated step (``autopar.step_trace``) and of one layer's time
(``autopar.layer_breakdown``): inline SVG for the HTML report, text for the terminal.

The SVG is written by hand — rectangles, lines and text, no script, no external font or style — so
the report stays one file that opens offline, and every drawn bar carries what it is as
attributes a test (or a person's browser tools) can read: ``class="bar F"``, ``data-rank``,
``data-stage``, ``data-mb`` (micro-batch), ``data-chunk``, and a ``<title>`` tooltip with its
times.

Words (``autopar.step_trace`` defines the kinds of bar):

* **lane** — a track's row: ``compute`` (tall), ``p2p`` and ``coll`` (thin, beside the compute on
  communication streams).
* **time scale** — the x axis, from 0 to ``time_max`` (the step's time by default; the longer
  of two steps when two plans are drawn one above the other, so they compare at a glance).
* **column** — in the text drawing, one character of ``step_time / width`` seconds; a bar takes
  the columns its start and end round to, and a pass, send or collective too short for one still
  takes one, so it shows.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence

from autopar.display import fmt_bytes, fmt_time
from autopar.layer_breakdown import LayerBreakdown
from autopar.step_trace import BAR_KINDS, KIND_NAMES, PASSES, Bar, StepTrace

__all__ = ["COLOURS", "breakdown_svg", "memory_svg", "timeline_svg", "timeline_text"]

COLOURS = {k: b.colour for k, b in BAR_KINDS.items()}
"""Bar kind -> fill colour (``autopar.step_trace.BAR_KINDS``)."""

RANK_COLOURS = ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860", "#da8bc3", "#8c8c8c")
PART_COLOURS = {
    "attention": "#4c72b0",
    "MLP": "#dd8452",
    "norms": "#55a868",
    "other": "#8c8c8c",
    "collectives": "#c44e52",
    "gradient reduction": "#9467bd",
    "optimizer step": "#bcbd22",
}

_WIDTH = 1000
_LEFT = 120
_RIGHT = 16
_PLOT = _WIDTH - _LEFT - _RIGHT
_FONT = "font-family:system-ui,-apple-system,'Segoe UI',sans-serif"


def _shade(colour: str, amount: float) -> str:
    """``colour`` moved ``amount`` (0…1) of the way to white."""
    r, g, b = (int(colour[i : i + 2], 16) for i in (1, 3, 5))
    return "#" + "".join(f"{round(c + (255 - c) * amount):02x}" for c in (r, g, b))


def _fill(bar: Bar, virtual: int) -> str:
    base = COLOURS[bar.kind]
    if bar.kind in PASSES and bar.chunk > 0 and virtual > 1:
        return _shade(base, 0.45 * bar.chunk / (virtual - 1))
    return base


def _ticks(time_max: float) -> tuple[list[float], float, str]:
    """Round tick times over ``[0, time_max]`` and the unit they are labelled in."""
    scale, unit = (1.0, "s") if time_max >= 1 else (1e3, "ms") if time_max >= 1e-3 else (1e6, "µs")
    span = time_max * scale
    raw = span / 8 if span > 0 else 1.0
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    ticks = [i * step / scale for i in range(int(span / step) + 1)]
    return ticks, scale, unit


def _num(x: float) -> str:
    return f"{x:.2f}".rstrip("0").rstrip(".")


def _axis(time_max: float, top: float, bottom: float) -> list[str]:
    """Tick labels above ``top`` and light grid lines from ``top`` to ``bottom``."""
    ticks, scale, unit = _ticks(time_max)
    out = []
    for t in ticks:
        x = _LEFT + t / time_max * _PLOT
        out.append(
            f'<line x1="{x:.2f}" y1="{top}" x2="{x:.2f}" y2="{bottom}" stroke="#ddd" stroke-width="0.6"/>'
        )
        out.append(
            f'<text x="{x:.2f}" y="{top - 4}" font-size="10" text-anchor="middle" fill="#555">'
            f"{_num(t * scale)} {unit}</text>"
        )
    return out


def _rect(bar: Bar, rank: int, x0: float, y: float, h: float, time_max: float, virtual: int) -> str:
    x = x0 + bar.start / time_max * _PLOT
    w = max((bar.end - bar.start) / time_max * _PLOT, 0.0)
    attrs = f'class="bar {bar.kind}" data-rank="{rank}" data-start="{bar.start:.9g}" data-end="{bar.end:.9g}"'
    what = KIND_NAMES[bar.kind]
    if bar.stage is not None:
        attrs += f' data-stage="{bar.stage}" data-mb="{bar.microbatch}" data-chunk="{bar.chunk}"'
        what += f", stage {bar.stage}, micro-batch {bar.microbatch}"
    if bar.peer is not None:
        attrs += f' data-peer="{bar.peer}"'
        what += f" ({'to' if bar.kind == 'send' else 'from'} rank {bar.peer})"
    tip = f"{what}: {fmt_time(bar.start)} – {fmt_time(bar.end)} ({fmt_time(bar.end - bar.start)})"
    # Sends, receives and collectives too short to see are drawn one pixel wide.
    shown = w if bar.kind in ("idle", "wait", *PASSES, "optimizer") else max(w, 1.0)
    return (
        f'<rect {attrs} x="{x:.3f}" y="{y:.2f}" width="{shown:.3f}" height="{h}" fill="{_fill(bar, virtual)}">'
        f"<title>{html.escape(tip)}</title></rect>"
    )


def _legend(kinds: Sequence[str], y: float, extra: str = "") -> tuple[list[str], float]:
    """Swatches for ``kinds`` in rows from ``y``; returns the SVG and the height used."""
    out, x, row = [], float(_LEFT), 0
    for k in kinds:
        label = KIND_NAMES[k]
        w = 22 + 5.6 * len(label)
        if x + w > _WIDTH - _RIGHT:
            x, row = float(_LEFT), row + 1
        yy = y + row * 16
        out.append(f'<rect x="{x:.1f}" y="{yy}" width="12" height="10" fill="{COLOURS[k]}"/>')
        out.append(
            f'<text x="{x + 16:.1f}" y="{yy + 9}" font-size="10" fill="#333">{html.escape(label)}</text>'
        )
        x += w
    if extra:
        row += 1
        out.append(
            f'<text x="{_LEFT}" y="{y + row * 16 + 9}" font-size="10" fill="#555">{html.escape(extra)}</text>'
        )
    return out, (row + 1) * 16


def timeline_svg(trace: StepTrace, *, time_max: float | None = None, title: str = "") -> str:
    """The step as inline SVG: one block per pipeline rank — its compute lane (passes labelled with
    their micro-batch, idle gaps, wait, optimizer), its sends and receives, its collectives — on one
    time axis, the compute makespan dashed, a legend below (module docstring)."""
    time_max = time_max or trace.step_time or 1.0
    lane, thin, block = 22, 6, 48
    top = 40 if title else 24
    pp = len(trace.tracks)
    bottom = top + pp * block
    out = _axis(time_max, top, bottom - 8)
    for t in trace.tracks:
        y = top + t.rank * block + 4
        out.append(f'<g class="rank" data-rank="{t.rank}">')
        out.append(f'<text x="8" y="{y + 15}" font-size="12" fill="#222">rank {t.rank}</text>')
        out.append(
            f'<text x="{_LEFT - 6}" y="{y + lane + 7}" font-size="8" fill="#777" text-anchor="end">p2p</text>'
        )
        out.append(
            f'<text x="{_LEFT - 6}" y="{y + lane + thin + 9}" font-size="8" fill="#777" text-anchor="end">coll</text>'
        )
        for bar in t.compute:
            out.append(_rect(bar, t.rank, _LEFT, y, lane, time_max, trace.virtual))
            w = (bar.end - bar.start) / time_max * _PLOT
            if bar.kind in PASSES and w >= 8:
                x = _LEFT + (bar.start + bar.end) / 2 / time_max * _PLOT
                out.append(
                    f'<text class="mb" x="{x:.2f}" y="{y + 15}" font-size="10" fill="#fff" '
                    f'text-anchor="middle">{bar.microbatch}</text>'
                )
        for bar in t.p2p:  # sends in the upper half of the lane, receives in the lower
            half = thin / 2
            yy = y + lane + 2 + (half if bar.kind == "recv" else 0)
            out.append(_rect(bar, t.rank, _LEFT, yy, half, time_max, trace.virtual))
        for bar in t.collectives:
            out.append(_rect(bar, t.rank, _LEFT, y + lane + thin + 4, thin, time_max, trace.virtual))
        out.append("</g>")
    xe = _LEFT + trace.compute_end / time_max * _PLOT
    out.append(
        f'<line x1="{xe:.2f}" y1="{top}" x2="{xe:.2f}" y2="{bottom - 8}" stroke="#333" '
        f'stroke-dasharray="3,3" stroke-width="0.8"><title>the step\'s last pass ends</title></line>'
    )
    present = [
        k
        for k in KIND_NAMES
        if any(b.kind == k for t in trace.tracks for b in (*t.compute, *t.p2p, *t.collectives))
    ]
    extra = (
        f"paler: a rank's later model chunks (interleaved, v={trace.virtual}); numbers: micro-batches"
        if trace.virtual > 1
        else "numbers: micro-batches"
    )
    legend, lh = _legend(present, bottom + 6, extra)
    out += legend
    height = bottom + 6 + lh + 4
    head = (
        f'<text x="8" y="16" font-size="13" font-weight="600" fill="#222">{html.escape(title)}</text>'
        if title
        else ""
    )
    label = f"the simulated step per pipeline rank: {fmt_time(trace.step_time)}, bubble {trace.bubble_fraction:.1%}"
    return (
        f'<svg class="timeline" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {_WIDTH} {height}" '
        f'width="100%" role="img" aria-label="{html.escape(label)}" data-ranks="{pp}" '
        f'data-step-time="{trace.step_time:.9g}" data-compute-end="{trace.compute_end:.9g}" '
        f'data-bubble-fraction="{trace.bubble_fraction:.9g}" style="{_FONT};background:#fff">'
        f"<title>{html.escape(label)}</title>{head}{''.join(out)}</svg>"
    )


def memory_svg(
    trace: StepTrace,
    *,
    time_max: float | None = None,
    memory_max: float | None = None,
    budget: float | None = None,
) -> str:
    """Each rank's memory over the step as a step line on the timeline's time axis (static state,
    plus activations from a forward until its weight gradient), its peak in the legend; the
    ``budget`` as a dashed line when it is within twice the highest peak. ``memory_max``: the top
    of the bytes axis (default: the highest peak), to draw two plans on one scale."""
    time_max = time_max or trace.step_time or 1.0
    top, height = 20, 150
    peak = max(memory_max or 0.0, max((t.peak_memory for t in trace.tracks), default=0.0))
    show_budget = bool(budget) and budget <= 2 * peak
    ymax = max(peak, budget if show_budget else 0.0) * 1.08 or 1.0

    def yof(b: float) -> float:
        return top + height - b / ymax * height

    out = _axis(time_max, top, top + height)
    for frac in (0.0, 0.5, 1.0):
        b = ymax / 1.08 * frac
        out.append(
            f'<text x="{_LEFT - 6}" y="{yof(b) + 3:.1f}" font-size="9" fill="#555" text-anchor="end">'
            f"{fmt_bytes(b)}</text>"
        )
    out.append(
        f'<line x1="{_LEFT}" y1="{top + height}" x2="{_WIDTH - _RIGHT}" y2="{top + height}" stroke="#999"/>'
    )
    if show_budget:
        y = yof(budget)
        out.append(
            f'<line x1="{_LEFT}" y1="{y:.1f}" x2="{_WIDTH - _RIGHT}" y2="{y:.1f}" stroke="#000" stroke-dasharray="5,3"/>'
        )
        out.append(
            f'<text x="{_WIDTH - _RIGHT}" y="{y - 3:.1f}" font-size="9" text-anchor="end">budget {fmt_bytes(budget)}</text>'
        )
    legend = []
    for i, t in enumerate(trace.tracks):
        colour = RANK_COLOURS[i % len(RANK_COLOURS)]
        pts = list(t.memory) or [(0.0, 0.0)]
        d = f"M{_LEFT} {yof(pts[0][1]):.2f}"
        for time, b in pts[1:]:
            d += f" H{_LEFT + time / time_max * _PLOT:.2f} V{yof(b):.2f}"
        d += f" H{_LEFT + trace.step_time / time_max * _PLOT:.2f}"
        out.append(
            f'<path class="memory" data-rank="{t.rank}" data-peak="{t.peak_memory:.0f}" d="{d}" fill="none" '
            f'stroke="{colour}" stroke-width="1.4"><title>rank {t.rank}: peak {fmt_bytes(t.peak_memory)}</title></path>'
        )
        x = _LEFT + i * 150
        legend.append(f'<rect x="{x}" y="{top + height + 12}" width="12" height="3" fill="{colour}"/>')
        legend.append(
            f'<text x="{x + 16}" y="{top + height + 17}" font-size="10">rank {t.rank}: peak {fmt_bytes(t.peak_memory)}</text>'
        )
    out += legend
    out.append(f'<text x="8" y="{top + height / 2}" font-size="11" fill="#333">memory</text>')
    total = top + height + 26
    return (
        f'<svg class="memory-timeline" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {_WIDTH} {total}" '
        f'width="100%" role="img" aria-label="memory per pipeline rank over the step" style="{_FONT};background:#fff">'
        f"{''.join(out)}</svg>"
    )


def _clip(text: str, n: int) -> str:
    return text if len(text) <= n else text[: n - 1] + "…"


def breakdown_svg(b: LayerBreakdown, *, time_max: float | None = None) -> str:
    """One bar per part of the layer (``autopar.layer_breakdown``) with its time and share."""
    time_max = time_max or max((p.time for p in b.parts), default=0.0) or 1.0
    row, top, left = 22, 26, 150
    plot = _WIDTH - left - 330
    out = [
        f'<text x="8" y="16" font-size="12" fill="#222">inside one {html.escape(b.layer_class)} layer '
        f"({html.escape(b.layer)}, ×{b.count}): forward + backward per {b.per}, {fmt_time(b.total)}</text>"
    ]
    for i, p in enumerate(b.parts):
        y = top + i * row
        w = p.time / time_max * plot
        share = p.time / b.total if b.total > 0 else 0.0
        tip = f"{p.name}: {fmt_time(p.time)} ({share:.1%}) — {', '.join(p.of)}"
        out.append(
            f'<text x="{left - 8}" y="{y + 14}" font-size="11" text-anchor="end">{html.escape(p.name)}</text>'
        )
        out.append(
            f'<rect class="part" data-part="{html.escape(p.name)}" data-time="{p.time:.9g}" x="{left}" y="{y + 3}" '
            f'width="{max(w, 1.0):.2f}" height="{row - 6}" fill="{PART_COLOURS.get(p.name, "#8c8c8c")}">'
            f"<title>{html.escape(tip)}</title></rect>"
        )
        out.append(
            f'<text x="{left + max(w, 1.0) + 6:.2f}" y="{y + 14}" font-size="10" fill="#333">'
            f"{fmt_time(p.time)} · {share:.1%} · {html.escape(_clip(', '.join(p.of), 48))}</text>"
        )
    height = top + len(b.parts) * row + 6
    return (
        f'<svg class="layer-breakdown" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {_WIDTH} {height}" '
        f'width="100%" role="img" aria-label="time inside one layer by part" style="{_FONT};background:#fff">'
        f"{''.join(out)}</svg>"
    )


# ----------------------------------------------------------------------------------- text
_CHARS = {"F": "F", "B": "B", "W": "W", "idle": ".", "wait": "~", "optimizer": "O"}
_DIGITS = "0123456789abcdefghijklmnopqrstuvwxyz"


def _columns(bar: Bar, dt: float, width: int, at_least_one: bool) -> range:
    a, b = round(bar.start / dt), round(bar.end / dt)
    if b <= a and at_least_one:
        b = a + 1
    return range(min(a, width), min(b, width))


def timeline_text(trace: StepTrace, width: int = 100) -> str:
    """The step as text: per pipeline rank a line of passes (one character per column of
    ``step_time / width`` seconds), the micro-batch of each pass under its first column, and lines
    of its sends/receives and collectives; a time axis above and a legend below."""
    dt = (trace.step_time or 1.0) / width
    pad = 10
    lines = [
        f"timeline: {fmt_time(trace.step_time)} in {width} columns of {fmt_time(dt)}; one row per pipeline rank, "
        f"each standing for its {trace.devices}, which run the same program",
    ]
    _, scale, unit = _ticks(trace.step_time)
    axis, marks = [" "] * (width + 1), [" "] * (width + 1)
    for k in range(5):
        col = round(k * width / 4)
        label = f"{_num(k * trace.step_time / 4 * scale)} {unit}"
        start = 0 if k == 0 else width + 1 - len(label) if k == 4 else col - len(label) // 2
        axis[start : start + len(label)] = label
        marks[col] = "|"
    lines += [" " * pad + "".join(axis).rstrip(), " " * pad + "".join(marks)]
    comm_kinds = {"reduce": "R", "gather": "G"}
    for t in trace.tracks:
        row, mbs = [" "] * width, [" "] * width
        for bar in t.compute:
            ch = _CHARS[bar.kind]
            if bar.kind in PASSES and bar.chunk > 0:
                ch = ch.lower()
            cols = _columns(bar, dt, width, at_least_one=bar.kind in PASSES and bar.end > bar.start)
            for c in cols:
                if bar.kind in PASSES or row[c] == " ":
                    row[c] = ch
            if bar.kind in PASSES and len(cols) and bar.microbatch is not None:
                c = next((c for c in cols if mbs[c] == " "), None)
                if c is not None:
                    mbs[c] = _DIGITS[bar.microbatch % len(_DIGITS)]
        lines.append(f"{f'rank {t.rank}':<{pad}}{''.join(row)}")
        lines.append(f"{'  mb':<{pad}}{''.join(mbs).rstrip()}")
        if t.p2p:
            p2p = [" "] * width
            for bar in t.p2p:
                ch = ">" if bar.kind == "send" else "<"
                for c in _columns(bar, dt, width, at_least_one=True):
                    p2p[c] = ch if p2p[c] in (" ", ch) else "x"
            lines.append(f"{'  p2p':<{pad}}{''.join(p2p).rstrip()}")
        if t.collectives:
            coll = [" "] * width
            for bar in t.collectives:
                ch = comm_kinds[bar.kind]
                for c in _columns(bar, dt, width, at_least_one=True):
                    coll[c] = ch if coll[c] in (" ", ch) else "X"
            lines.append(f"{'  coll':<{pad}}{''.join(coll).rstrip()}")
    chunks = (
        f"; lower case: a rank's later model chunks (interleaved, v={trace.virtual})"
        if trace.virtual > 1
        else ""
    )
    lines += [
        "legend: F forward, B backward (input gradient), W backward (weight gradient)" + chunks + ";",
        f"        . idle (the pipeline bubble: {trace.bubble_fraction:.1%} of the {fmt_time(trace.compute_end)} "
        f"until the last pass ends, {trace.microbatches} micro-batch(es)), ~ waiting for the step's last gradient "
        "reduction or a slower optimizer step, O optimizer step;",
        "        mb: the micro-batch of each pass, one character under its first column (0-9, then a-z)"
        + (";" if any(t.p2p or t.collectives for t in trace.tracks) else ""),
    ]
    comm = []
    if any(t.p2p for t in trace.tracks):
        comm.append("p2p: > send, < receive, x both")
    if any(t.collectives for t in trace.tracks):
        comm.append("coll: R gradient reduction, G parameter gather, X both")
    if comm:
        lines.append(
            f"        {'; '.join(comm)} (a transfer or collective shorter than a column still takes one)"
        )
    return "\n".join(lines)

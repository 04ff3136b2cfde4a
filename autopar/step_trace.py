"""The simulated step as per-rank tracks to draw (``autopar.step_draw`` draws them as SVG for the
report and as text for ``autopar simulate``).

The simulator (``autopar.simulate``, ``autopar.cost.timeline.play``) already plays every rank's
actions in time; this module only arranges what it recorded, it computes no cost.

Words:

* **track** — one pipeline rank's step, from 0 to the step's end, in three lanes: ``compute``
  (its forward ``F``, input-gradient ``B`` and weight-gradient ``W`` passes, the idle gaps between
  them, the wait for the step's last gradient reduction, its optimizer step), ``p2p`` (what it
  sends to and receives from its neighbouring pipeline ranks: activations forward, input
  gradients backward) and ``collectives`` (its weights' gradient reduction over the
  data-parallel axes, ZeRO-1/2 parameter gathers) — the last two on communication streams beside
  the compute.
* **bar** — one interval of a lane: its kind, start and end seconds and, for a pass, the stage,
  micro-batch and model chunk it belongs to (the chunk: which of a rank's ``v`` stages under the
  interleaved schedule, ``stage // pp``).
* **compute makespan** — when the step's last ``F``/``B``/``W`` ends. **Idle** bars are the gaps
  of a compute lane before it: exactly the simulator's pipeline bubble
  (``Timeline.bubble_fraction``, ``plan.info["simulated"]["bubble_fraction"]``), so the drawn
  idle share is that number. After it a rank **waits** for the step's last gradient reduction,
  then runs its **optimizer** step, as ``simulate`` charges it (the step's time is the last
  reduction's end plus the slowest rank's optimizer step); the time it then waits for slower
  ranks' optimizer steps is waiting too.
* **rank class** — the devices that run one pipeline rank's program. Every data- and
  tensor-parallel device of a stage runs the same per-rank program on its own shard (SPMD), so
  the simulator plays one device per pipeline rank and a track stands for all of its devices
  (``devices`` says how many and along which axes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

from autopar.cluster import Cluster
from autopar.display import mesh_text
from autopar.planfile import Plan
from autopar.simulate import StepSimulation, optimizer_time, simulate

__all__ = ["BAR_KINDS", "KIND_NAMES", "Bar", "BarKind", "RankTrack", "StepTrace", "step_trace"]


class BarKind(NamedTuple):
    """One kind of bar (module docstring): what it is, for legends, and its fill colour in the
    drawings (``autopar.step_draw``; a later model chunk's passes are drawn lighter)."""

    what: str
    colour: str


BAR_KINDS = {
    "F": BarKind("forward", "#4c72b0"),
    "B": BarKind("backward (input gradient)", "#c44e52"),
    "W": BarKind("backward (weight gradient)", "#55a868"),
    "idle": BarKind("idle (pipeline bubble)", "#ececec"),
    "wait": BarKind(
        "waiting for the step's last gradient reduction or another rank's optimizer step", "#f2d479"
    ),
    "optimizer": BarKind("optimizer step", "#8172b3"),
    "send": BarKind("send to a neighbouring pipeline rank", "#dd8452"),
    "recv": BarKind("receive from a neighbouring pipeline rank", "#3a9bb5"),
    "reduce": BarKind("gradient reduction (data parallel)", "#9467bd"),
    "gather": BarKind("parameter gather (ZeRO)", "#2ca02c"),
}
"""Bar kind -> what it is and how it is drawn: the one table of the kinds."""
KIND_NAMES = {k: b.what for k, b in BAR_KINDS.items()}
"""Bar kind -> what it is, for legends."""

PASSES = ("F", "B", "W")


@dataclass(frozen=True, slots=True)
class Bar:
    """One interval of a lane (module docstring)."""

    kind: str
    """A key of ``KIND_NAMES``."""
    start: float
    end: float
    stage: int | None = None
    microbatch: int | None = None
    chunk: int = 0
    """Which of the rank's model chunks (interleaved schedule), 0 otherwise."""
    peer: int | None = None
    """The other pipeline rank of a send or receive."""

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass(frozen=True, slots=True)
class RankTrack:
    """One pipeline rank's step (module docstring)."""

    rank: int
    compute: tuple[Bar, ...]
    """Passes, idle, wait and optimizer bars, in time order, covering ``[0, step end]``."""
    p2p: tuple[Bar, ...]
    """Sends and receives, by start."""
    collectives: tuple[Bar, ...]
    """Gradient reductions and parameter gathers, by start."""
    memory: tuple[tuple[float, float], ...]
    """``(time, bytes from then on)``: static state at 0, then activations kept and freed."""
    peak_memory: float


@dataclass(frozen=True, slots=True)
class StepTrace:
    """A plan's simulated step as one track per pipeline rank (module docstring)."""

    tracks: tuple[RankTrack, ...]
    step_time: float
    compute_end: float
    """The compute makespan: the last ``F``/``B``/``W``'s end."""
    bubble_fraction: float
    """The simulator's mean idle share of the compute makespan."""
    schedule: str
    microbatches: int
    virtual: int
    devices: str
    """What one track stands for, e.g. ``"2 devices (dp=2 × tp=1)"``."""

    def idle_share(self) -> float:
        """The idle bars' share of ``pp`` × the compute makespan (the bubble as drawn)."""
        if self.compute_end <= 0 or not self.tracks:
            return 0.0
        idle = sum(b.duration for t in self.tracks for b in t.compute if b.kind == "idle")
        return idle / (len(self.tracks) * self.compute_end)


def _compute_lane(passes: list[Bar], last: float, reduced: float, optimizer: float, step: float) -> list[Bar]:
    """The passes with the gaps before ``last`` as idle, then wait until ``reduced``, the optimizer
    step, and wait until ``step``."""
    out: list[Bar] = []
    t = 0.0
    for b in sorted(passes, key=lambda b: b.start):
        if b.start > t:
            out.append(Bar("idle", t, b.start))
        out.append(b)
        t = max(t, b.end)
    if last > t:
        out.append(Bar("idle", t, last))
        t = last
    if reduced > t:
        out.append(Bar("wait", t, reduced))
        t = reduced
    if optimizer > 0:
        out.append(Bar("optimizer", t, t + optimizer))
        t += optimizer
    if step > t:
        out.append(Bar("wait", t, step))
    return out


def step_trace(plan: Plan, sim: StepSimulation | None = None) -> StepTrace:
    """``plan``'s step (``sim``, or ``autopar.simulate(plan)``) as one track per pipeline rank."""

    sim = sim if sim is not None else simulate(plan)
    tl = sim.timeline
    pp = len(tl.busy)
    p = plan.pipeline
    virtual = p.virtual if p is not None else 1
    last = max((e for _, _, e in tl.events.values()), default=0.0)
    reduced = max(tl.end, default=last)
    passes: list[list[Bar]] = [[] for _ in range(pp)]
    for (kind, stage, mb), (r, s, e) in tl.events.items():
        passes[r].append(Bar(kind, s, e, stage, mb, stage // pp))
    if p is not None:  # each rank's own optimizer step (the simulator charges the slowest)
        cluster = Cluster.from_dict(plan.cluster)
        opt = [optimizer_time(plan, cluster, range(r, p.num_stages, p.pp)) for r in range(pp)]
    else:
        opt = [sim.optimizer_time] * pp
    p2p: list[list[Bar]] = [[] for _ in range(pp)]
    for src, dst, s, e, (_, stage, mb) in tl.transfers:
        p2p[src].append(Bar("send", s, e, stage, mb, stage // pp, peer=dst))
        p2p[dst].append(Bar("recv", s, e, stage, mb, stage // pp, peer=src))
    coll: list[list[Bar]] = [[] for _ in range(pp)]
    for kind, records in (("reduce", tl.comm), ("gather", tl.gathers)):
        for r, s, e in records:
            coll[r].append(Bar(kind, s, e))
    memory: list[list[tuple[float, float]]] = [[] for _ in range(pp)]
    for r, t, b in sorted(tl.memory, key=lambda m: m[1]):
        memory[r].append((t, b))
    tracks = tuple(
        RankTrack(
            rank=r,
            compute=tuple(_compute_lane(passes[r], last, reduced, opt[r], sim.step_time)),
            p2p=tuple(sorted(p2p[r], key=lambda b: b.start)),
            collectives=tuple(sorted(coll[r], key=lambda b: b.start)),
            memory=tuple(memory[r]),
            peak_memory=tl.peak_memory[r],
        )
        for r in range(pp)
    )
    n = math.prod(plan.mesh_shape)
    devices = f"{n} device{'s' if n != 1 else ''} ({mesh_text(plan.mesh_shape, plan.mesh_axes)})"
    return StepTrace(
        tracks=tracks,
        step_time=sim.step_time,
        compute_end=last,
        bubble_fraction=sim.bubble_fraction,
        schedule=p.schedule if p is not None else "none",
        microbatches=sim.microbatches,
        virtual=virtual,
        devices=devices,
    )

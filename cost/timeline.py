"""The whole pipelined step in time: each rank's actions (``autopar.schedule``) played out with
their durations and the transfers between stages.

Words:

* **stage costs** — per stage and micro-batch: ``forward``, ``backward_input`` (``B``) and
  ``backward_weight`` (``W``) seconds of compute; ``send`` seconds to move the stage's boundary
  values to the next stage (its gradients take the same time back); ``activation`` bytes kept from
  ``F`` until ``W``; ``static`` bytes (weights, gradients, optimizer state); ``grad_sync``
  seconds of the data-parallel reduction of the step's weight gradients (once per step), and
  ``microbatch_sync`` seconds of the reductions every micro-batch runs (a ZeRO parameter's
  gradient reduce-scatter: its full gradient is not kept between micro-batches), and
  ``param_gather`` seconds of the all-gather that brings back the whole weights of ZeRO-1/2
  parameters once per step after the optimizer updated their shards, and ``sync_compute``
  seconds the step's gradient reduction takes on the compute itself (compression,
  ``autopar.cost.compression``), added to the stage's last ``W``.
* **play** — an action starts when its rank is free and its inputs have arrived: ``F(s, i)`` after
  ``F(s−1, i)`` plus the transfer (none when both stages are on one rank), ``B(s, i)`` after its
  ``F`` and ``B(s+1, i)`` plus the transfer, ``W(s, i)`` after its ``B``. Sends are asynchronous
  (``isend``): they cost the sender nothing, the receiver waits for them. This is the discrete
  event simulation Megatron-LM's and the zero-bubble paper's bubble formulas summarise: for
  ``p`` equal stages 1F1B idles ``(p − 1)·(f + b + w)`` per rank, the bubble fraction
  ``(p − 1)/m`` of Narayanan et al. (arXiv 2104.04473 §2.2.1), and interleaving divides it by
  ``v``.
* **gradient reduction** — the runtime sums a stage's weight gradients over its micro-batches
  and reduces them over the data-parallel axes once, inside the stage's last ``W`` (PyTorch DDP's
  ``no_sync``, Megatron-LM's gradient accumulation; ``autopar.passes.stage_cut.defer_reductions``),
  and a ZeRO parameter's gradient inside every ``W``; both in ``sync_chunks`` buckets issued as the
  backward produces them (PyTorch DDP's bucketing, Li et al., VLDB 2020), on a communication
  stream that runs beside the compute: a ``W``'s reduction starts no earlier than the ``W`` and
  the communication stream is free, and its last bucket no earlier than the ``W`` ends. Where
  the ``W`` directly follows its ``B`` on the rank (every schedule but zero-bubble's deferred
  ``W``), the backward as a whole produces the gradients, so the reduction may start with the
  ``B`` (Megatron-LM's ``--overlap-grad-reduce`` launches each bucket as soon as its gradients are
  ready during the last micro-batch's backward). The rank's step ends when both its compute and
  its communication stream are done.
* **parameter gather** — ZeRO-1/2 weights are gathered once per step after the optimizer step
  (Megatron-LM's distributed optimizer); with ``--overlap-param-gather`` the gather of the next
  step runs beside the first forward, bucket by bucket in the order the forward reads them, so
  the first ``F`` on a rank ends no earlier than the gather plus its last bucket's share of the
  ``F`` (the steady state of one step to the next).
* **ZeRO-3 gathers** — a weight stored sharded is gathered for each micro-batch's forward, again
  for its backward, and its gradient reduce-scattered (``cost.reshard_cost.edge_cost``: three
  equal volumes). The backward's two run with the gradient reduction above; the forward's on the
  same communication stream beside the ``F``, prefetched a layer ahead (FSDP's forward prefetch,
  ``passes.overlap.prefetch_params``), so the ``F`` ends no earlier than its last gather plus its
  last layer's share of the ``F`` (``sync_chunks``). Without overlap the ``F`` waits for them.
* **bubble** — a rank's idle time before its last action ends: the step's makespan less its busy
  time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from autopar.schedule import Action, stage_rank

__all__ = ["GRADIENT_BUCKETS", "Event", "StageCost", "Timeline", "play"]

GRADIENT_BUCKETS = 8
"""A stage's gradient reduction is issued in at least this many buckets (one per gradient where
it has fewer): the runtime caps each bucket at a ``1/GRADIENT_BUCKETS`` share of the reduction as
well as at DDP's 25 MiB (``passes.overlap.bucket_gradients``), so the last bucket — the part of
the reduction that cannot overlap the backward — is at most that share (``sync_chunks``). A
reduction of 13 MB in one 25 MiB bucket starts only when the backward ends; measured on two
emulated nodes joined by a 50 MB/s link (``examples/local_fidelity.py --slow-link``), the step
was 1.6× the one predicted with ``GRADIENT_BUCKETS`` chunks."""

KIND_NAMES = {"F": "forward", "B": "backward (input gradient)", "W": "backward (weight gradient)"}


@dataclass(frozen=True, slots=True)
class Event:
    """One interval of the played step, for drawing: ``lane`` (``"rank 0"``, ``"rank 0 comm"``,
    ``"rank 0 p2p"``), ``kind`` (forward, backward…, gradient reduction, parameter gather, send,
    optimizer), seconds, and a short label (``"s1 mb3"``: stage and micro-batch)."""

    lane: str
    kind: str
    start: float
    end: float
    label: str = ""


@dataclass(frozen=True, kw_only=True, slots=True)
class StageCost:
    """One stage's costs per micro-batch (module docstring)."""

    forward: float
    backward_input: float
    backward_weight: float
    send: float = 0.0
    activation: float = 0.0
    static: float = 0.0
    grad_sync: float = 0.0
    microbatch_sync: float = 0.0
    forward_gather: float = 0.0
    """ZeRO-3 weights gathered for one micro-batch's forward (each ``F``; module docstring)."""
    sync_chunks: int = 1
    """Buckets the reduction is issued in (at most ``GRADIENT_BUCKETS``: beyond it the last
    bucket's share is counted as ``1/GRADIENT_BUCKETS``, an upper bound)."""
    param_gather: float = 0.0
    sync_compute: float = 0.0


@dataclass
class Timeline:
    """The played schedule: when each action ran, per rank busy, idle and peak memory."""

    events: dict[Action, tuple[int, float, float]] = field(default_factory=dict)
    """Action -> (rank, start, end) seconds."""
    busy: list[float] = field(default_factory=list)
    end: list[float] = field(default_factory=list)
    """When each rank's step ends (its last action, then its exposed gradient reduction)."""
    exposed_sync: list[float] = field(default_factory=list)
    peak_memory: list[float] = field(default_factory=list)
    comm: list[tuple[int, float, float]] = field(default_factory=list)
    """Gradient reductions as ``(rank, start, end)`` on the ranks' communication streams."""
    gathers: list[tuple[int, float, float]] = field(default_factory=list)
    """ZeRO-1/2 parameter gathers as ``(rank, start, end)`` on the communication streams."""
    transfers: list[tuple[int, int, float, float, Action]] = field(default_factory=list)
    """Sends between pipeline ranks as ``(source rank, destination rank, start, arrival, action
    waiting for it)``: a forward's activations to the next stage, a backward's input gradient to
    the previous one."""
    memory: list[tuple[int, float, float]] = field(default_factory=list)
    """Each rank's memory over the step as ``(rank, time, bytes from then on)``: its static bytes
    at 0, a stage's activations added when its ``F`` starts and freed when its ``W`` ends."""

    def event_list(self) -> list[Event]:
        """Every action, gradient reduction, parameter gather and send between ranks as an
        :class:`Event` (``autopar.viz.gantt``)."""
        out = [
            Event(f"rank {r}", KIND_NAMES[k], s, e, f"s{st} mb{mb}")
            for (k, st, mb), (r, s, e) in sorted(self.events.items(), key=lambda kv: kv[1][1])
        ]
        out += [Event(f"rank {r} comm", "gradient reduction", s, e) for r, s, e in self.comm]
        out += [Event(f"rank {r} comm", "parameter gather", s, e) for r, s, e in self.gathers]
        out += [
            Event(f"rank {src} p2p", "send", s, e, f"to {dst}: s{st} mb{mb}")
            for src, dst, s, e, (_, st, mb) in self.transfers
        ]
        return out

    @property
    def step_time(self) -> float:
        return max(self.end) if self.end else 0.0

    @property
    def bubble(self) -> list[float]:
        """Idle seconds of each rank before its compute ends."""
        last = max((e for _, _, e in self.events.values()), default=0.0)
        return [last - b for b in self.busy]

    def bubble_fraction(self) -> float:
        """Mean idle share of the compute makespan."""
        last = max((e for _, _, e in self.events.values()), default=0.0)
        return sum(self.bubble) / (len(self.busy) * last) if last > 0 else 0.0

    def format(self, width: int = 72) -> str:
        """One text row per rank: ``F``/``B``/``W`` blocks and ``.`` for idle, to scale."""
        last = max((e for _, _, e in self.events.values()), default=0.0) or 1.0
        rows = []
        for r in range(len(self.busy)):
            line = ["."] * width
            for (kind, _, _), (rr, s, e) in self.events.items():
                if rr != r:
                    continue
                a, b = int(s / last * width), max(int(s / last * width) + 1, int(e / last * width))
                for x in range(a, min(b, width)):
                    line[x] = kind
            rows.append(f"rank {r}: {''.join(line)}")
        return "\n".join(rows)


def play(actions: Sequence[Sequence[Action]], stages: Sequence[StageCost], overlap: bool = True) -> Timeline:
    """Play ``actions`` (one list per pipeline rank) with ``stages``' costs (module docstring).
    ``overlap=False``: gradient reductions take the compute's own time (a rank blocks for them
    after its ``W``; ``Cluster.overlap_comm``). Raises ``ValueError`` if the schedule deadlocks."""
    pp = len(actions)
    n = len(stages)
    done: dict[Action, float] = {}
    tl = Timeline(busy=[0.0] * pp)
    free = [0.0] * pp
    pos = [0] * pp
    mem = [stages_static(stages, r, pp) for r in range(pp)]
    peak = list(mem)
    comm = [0.0] * pp  # when each rank's communication stream is free
    blocked = [0.0] * pp  # reductions a rank waited for without overlap
    last_w = {(r, a[1]): i for r in range(pp) for i, a in enumerate(actions[r]) if a[0] == "W"}
    # ZeRO-1/2 weights gathered once per step, beside the rank's first forward (module docstring).
    gather = [sum(stages[s].param_gather for s in range(r, n, pp)) for r in range(pp)]
    chunks_of = [max((stages[s].sync_chunks for s in range(r, n, pp)), default=1) for r in range(pp)]
    for r in range(pp):
        tl.memory.append((r, 0.0, mem[r]))
        if gather[r] > 0:
            comm[r] = gather[r]
            tl.gathers.append((r, 0.0, gather[r]))

    def arrival(dep: Action, same_rank: bool, transfer: float) -> float | None:
        t = done.get(dep)
        if t is None:
            return None
        return t if same_rank else t + transfer

    def ready_at(a: Action, r: int) -> float | None:
        kind, s, i = a
        if kind == "F":
            if s == 0:
                return 0.0
            return arrival(("F", s - 1, i), stage_rank(s - 1, pp) == r, stages[s - 1].send)
        if kind == "B":
            f = done.get(("F", s, i))
            if f is None:
                return None
            if s == n - 1:
                return f
            g = arrival(("B", s + 1, i), stage_rank(s + 1, pp) == r, stages[s].send)
            return None if g is None else max(f, g)
        return done.get(("B", s, i))

    progressed = True
    while progressed:
        progressed = False
        for r in range(pp):
            while pos[r] < len(actions[r]):
                a = actions[r][pos[r]]
                t = ready_at(a, r)
                if t is None:
                    break
                kind, s, _ = a
                c = stages[s]
                dur = c.forward if kind == "F" else c.backward_input if kind == "B" else c.backward_weight
                if kind == "W" and last_w[(r, s)] == pos[r]:  # the step's compressed reductions
                    dur += c.sync_compute
                start = max(free[r], t)
                end = start + dur
                if kind == "F" and c.forward_gather > 0:  # ZeRO-3's gathers (module docstring)
                    if overlap:
                        begin = max(comm[r], start)
                        comm[r] = begin + c.forward_gather
                        tl.comm.append((r, begin, comm[r]))
                        end = max(end, comm[r] + dur / max(1, c.sync_chunks))
                    else:
                        tl.comm.append((r, end, end + c.forward_gather))
                        end += c.forward_gather
                        blocked[r] += c.forward_gather
                if kind == "F" and pos[r] == 0 and gather[r] > 0:  # waits for its last bucket
                    end = max(end, gather[r] + dur / chunks_of[r])
                tl.events[a] = (r, start, end)
                _record_transfer(tl, a, r, done, stages, pp)
                done[a] = end
                free[r] = end
                tl.busy[r] += dur
                pos[r] += 1
                progressed = True
                if kind == "F":
                    mem[r] += c.activation
                    peak[r] = max(peak[r], mem[r])
                    tl.memory.append((r, start, mem[r]))
                elif kind == "W":
                    mem[r] -= c.activation
                    tl.memory.append((r, end, mem[r]))
                    sync = c.microbatch_sync + (c.grad_sync if last_w[(r, s)] == pos[r] - 1 else 0.0)
                    if sync > 0 and not overlap:  # on the compute's own cores: the rank waits
                        free[r] = end + sync
                        blocked[r] += sync
                        tl.comm.append((r, end, end + sync))
                    elif sync > 0:
                        last = sync / max(1, c.sync_chunks)
                        prev = actions[r][pos[r] - 2] if pos[r] >= 2 else None
                        produced = tl.events[prev][1] if prev == ("B", s, a[2]) else start
                        begin = max(comm[r], produced)
                        comm[r] = max(begin + sync, end + last)
                        tl.comm.append((r, comm[r] - sync, comm[r]))
    stuck = [(r, actions[r][pos[r]]) for r in range(pp) if pos[r] < len(actions[r])]
    if stuck:
        raise ValueError(f"the schedule deadlocks: ranks wait forever at {stuck}")
    for r in range(pp):
        exposed = max(0.0, comm[r] - free[r])
        tl.exposed_sync.append(exposed + blocked[r])
        tl.end.append(free[r] + exposed)
    tl.peak_memory = peak
    return tl


def _record_transfer(
    tl: Timeline, a: Action, r: int, done: dict[Action, float], stages: Sequence[StageCost], pp: int
) -> None:
    """Record the send ``a`` waited for when its input came from another rank (``play``'s
    ``ready_at``: the same dependencies and transfer times)."""
    kind, s, i = a
    if kind == "F" and s > 0:
        src, dep, dur = stage_rank(s - 1, pp), ("F", s - 1, i), stages[s - 1].send
    elif kind == "B" and s < len(stages) - 1:
        src, dep, dur = stage_rank(s + 1, pp), ("B", s + 1, i), stages[s].send
    else:
        return
    if src != r and dur > 0:
        tl.transfers.append((src, r, done[dep], done[dep] + dur, a))


def stages_static(stages: Sequence[StageCost], rank: int, pp: int) -> float:
    """Static bytes (weights, gradients, optimizer state) of the stages ``rank`` holds."""
    return sum(stages[s].static for s in range(rank, len(stages), pp))

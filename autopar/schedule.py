"""Pipeline schedules as data: the order in which each pipeline rank runs its actions.

Words:

* **stage** — one contiguous part of the model, ``0 … S−1`` in forward order. With ``v`` virtual
  stages per rank (interleaved schedules) there are ``S = p · v`` stages and rank ``r`` of ``p``
  holds stages ``r, r + p, …, r + (v−1)·p`` (Megatron-LM's interleaved assignment, Narayanan et
  al., SC'21, arXiv 2104.04473 §2.2.2); otherwise ``S = p`` and rank ``r`` holds stage ``r``.
* **action** — ``(kind, stage, microbatch)``. ``F``: the stage's forward for one micro-batch;
  ``B``: its backward for the gradients of the values it received (what the previous stage waits
  for); ``W``: its backward for the parameters' gradients. Schedules other than zero-bubble run
  ``W`` right after its ``B``; zero-bubble ones place it later, into the bubble (Qi et al.,
  "Zero Bubble Pipeline Parallelism", ICLR 2024).
* **schedule** — one list of actions per pipeline rank. The runtime executes exactly these lists
  (``autopar.runtime.pipeline_runner``) and the simulator times exactly these lists
  (``autopar.cost.timeline``), so prediction and execution cannot disagree on the order.

Schedules:

* ``gpipe`` — every forward, then every backward (Huang et al., 2019): ``m`` micro-batches of
  activations in flight.
* ``1f1b`` — ``p − r − 1`` warm-up forwards, then one forward and one backward alternately, then the
  remaining backwards (PipeDream-Flush; Narayanan et al., 2021): at most ``p − r`` in flight.
* ``interleaved`` — 1F1B over ``v`` virtual stages per rank, micro-batches in groups of ``p``
  (Megatron-LM's interleaved schedule): the bubble shrinks by ``v``; needs ``m`` a multiple of
  ``p``.
* ``zb-h1`` — 1F1B with ``B`` and ``W`` apart: a rank sends its input gradient as soon as ``B`` is
  done, keeps up to ``min(r, p − r − 1)`` weight-gradient passes pending in the steady state (so no
  rank holds more activations than 1F1B's first) and runs one after each backward in the
  cool-down, where 1F1B idles (ZB-H1: 1F1B's peak memory, a smaller bubble).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "SCHEDULES",
    "Action",
    "format_schedule",
    "make_schedule",
    "max_in_flight",
    "stage_rank",
    "validate_schedule",
]

Action = tuple[str, int, int]
"""``(kind, stage, microbatch)``, kind ``"F"``, ``"B"`` or ``"W"``."""

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")


def stage_rank(stage: int, pp: int) -> int:
    """The pipeline rank holding ``stage`` (module docstring)."""
    return stage % pp


def _gpipe(pp: int, m: int) -> list[list[Action]]:
    out = []
    for r in range(pp):
        acts: list[Action] = [("F", r, i) for i in range(m)]
        for i in range(m):
            acts += [("B", r, i), ("W", r, i)]
        out.append(acts)
    return out


def _one_f_one_b(pp: int, m: int, defer_w: bool) -> list[list[Action]]:
    out = []
    for r in range(pp):
        warm = min(pp - r - 1, m)
        # Weight passes left pending (zero-bubble H1): at most r, so that no rank keeps more
        # micro-batches' activations than 1F1B's first rank (pp).
        keep = min(pp - r - 1, r) if defer_w else 0
        acts: list[Action] = [("F", r, i) for i in range(warm)]
        pending: list[int] = []

        def backward(
            i: int, r: int = r, acts: list[Action] = acts, pending: list[int] = pending, keep: int = keep
        ) -> None:
            acts.append(("B", r, i))
            pending.append(i)
            while len(pending) > keep:
                acts.append(("W", r, pending.pop(0)))

        for i in range(m - warm):
            acts.append(("F", r, warm + i))
            backward(i)
        for i in range(m - warm, m):
            backward(i)
            if defer_w and pending:  # cool-down: a pending weight pass after each backward
                acts.append(("W", r, pending.pop(0)))
        acts += [("W", r, i) for i in pending]
        out.append(acts)
    return out


def _interleaved(pp: int, m: int, v: int) -> list[list[Action]]:
    """Megatron-LM's interleaved 1F1B (``schedules.py``, forward_backward_pipelining_with_
    interleaving): virtual micro-batch ``k`` of rank ``r`` is micro-batch ``(k // (p·v))·p + k % p``
    on model chunk ``(k // p) % v`` (backward: the chunks in reverse)."""
    if m % pp:
        raise ValueError(
            f"the interleaved schedule takes micro-batches in groups of pp: {m} micro-batches is not a "
            f"multiple of pp={pp}; use {((m + pp - 1) // pp) * pp} (or another schedule)"
        )
    total = m * v

    def fwd(k: int, r: int) -> Action:
        chunk = (k // pp) % v
        return ("F", chunk * pp + r, (k // (pp * v)) * pp + k % pp)

    def bwd(k: int, r: int) -> Action:
        chunk = v - 1 - (k // pp) % v
        return ("B", chunk * pp + r, (k // (pp * v)) * pp + k % pp)

    out = []
    for r in range(pp):
        warm = total if m == pp else min((pp - r - 1) * 2 + (v - 1) * pp, total)
        acts: list[Action] = [fwd(k, r) for k in range(warm)]
        for k in range(total - warm):
            acts.append(fwd(warm + k, r))
            b = bwd(k, r)
            acts += [b, ("W", b[1], b[2])]
        for k in range(total - warm, total):
            b = bwd(k, r)
            acts += [b, ("W", b[1], b[2])]
        out.append(acts)
    return out


def make_schedule(name: str, pp: int, microbatches: int, v: int = 1) -> list[list[Action]]:
    """The actions of every pipeline rank (index = rank) for schedule ``name`` (one of
    ``SCHEDULES``; module docstring) over ``pp`` ranks, ``microbatches`` micro-batches and ``v``
    stages per rank (``v > 1`` only with ``interleaved``)."""
    if pp < 1 or microbatches < 1 or v < 1:
        raise ValueError(
            f"pp, microbatches and v must be >= 1, got pp={pp}, microbatches={microbatches}, v={v}"
        )
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; known: {', '.join(SCHEDULES)}")
    if v > 1 and name != "interleaved":
        raise ValueError(f"v={v} stages per rank needs the 'interleaved' schedule, not {name!r}")
    if name == "gpipe":
        acts = _gpipe(pp, microbatches)
    elif name == "1f1b":
        acts = _one_f_one_b(pp, microbatches, defer_w=False)
    elif name == "zb-h1":
        acts = _one_f_one_b(pp, microbatches, defer_w=True)
    else:
        acts = _interleaved(pp, microbatches, v)
    validate_schedule(acts, pp, microbatches, v)
    return acts


def validate_schedule(actions: Sequence[Sequence[Action]], pp: int, microbatches: int, v: int = 1) -> None:
    """Raise ``ValueError`` unless every rank runs ``F``, ``B`` and ``W`` once for each of its
    stages and micro-batches, ``B`` after its ``F`` and ``W`` after its ``B``, and the ranks can run
    their lists to the end when each waits for what it receives (no deadlock)."""
    if len(actions) != pp:
        raise ValueError(
            f"a schedule needs one action list per pipeline rank: {len(actions)} lists for pp={pp}"
        )
    stages = pp * v
    for r, acts in enumerate(actions):
        want = {(k, s, i) for k in "FBW" for s in range(r, stages, pp) for i in range(microbatches)}
        got = list(acts)
        if len(got) != len(set(got)) or set(got) != want:
            missing = sorted(want - set(got))[:4]
            extra = sorted(set(got) - want)[:4]
            raise ValueError(f"rank {r}'s schedule is not one F, B and W per stage and micro-batch: "
                             f"missing {missing}, unexpected {extra}")  # fmt: skip
    # Walk all ranks together: an action is ready when what it needs has run.
    done: set[Action] = set()
    pos = [0] * pp

    def ready(a: Action) -> bool:
        kind, s, i = a
        if kind == "F":
            return s == 0 or ("F", s - 1, i) in done
        if kind == "B":
            return ("F", s, i) in done and (s == stages - 1 or ("B", s + 1, i) in done)
        return ("B", s, i) in done

    progressed = True
    while progressed:
        progressed = False
        for r in range(pp):
            while pos[r] < len(actions[r]) and ready(actions[r][pos[r]]):
                done.add(actions[r][pos[r]])
                pos[r] += 1
                progressed = True
    stuck = [(r, actions[r][pos[r]]) for r in range(pp) if pos[r] < len(actions[r])]
    if stuck:
        raise ValueError(f"the schedule deadlocks: ranks wait forever at {stuck}")


def max_in_flight(actions: Sequence[Action]) -> int:
    """The most micro-batches whose forward activations one rank keeps at once (``F`` done, its
    ``W`` not yet): the factor on a stage's activation memory."""
    live = peak = 0
    for kind, _, _ in actions:
        if kind == "F":
            live += 1
            peak = max(peak, live)
        elif kind == "W":
            live -= 1
    return peak


def format_schedule(actions: Sequence[Sequence[Action]]) -> str:
    """One line per rank, e.g. ``rank 0: F0.0 F0.1 B0.0 W0.0 …`` (kind, stage.micro-batch)."""
    return "\n".join(
        f"rank {r}: " + " ".join(f"{k}{s}.{i}" for k, s, i in acts) for r, acts in enumerate(actions)
    )

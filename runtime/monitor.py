"""Bounded waiting and failures that name their cause.

Words:

* **collective timeout** — how long a collective on autopar's process groups (one per mesh axis)
  may wait for its peers before it fails (``parallelize(..., timeout=)``, default
  ``DEFAULT_TIMEOUT``; torch's own default is 30 minutes). A frozen peer therefore costs at most
  this long, under any launcher.
* **note** — when a rank fails inside a training step it writes what happened (its error and the
  collective it was waiting in) to the process group's store under ``autopar/failed/<rank>``
  before raising. A rank that fails afterwards because a peer stopped (a timeout, or gloo's
  "Connection closed by peer") reads the notes, waits a short grace period for the others', and
  raises an error that names the rank that failed first — or, when a rank wrote nothing, the rank
  that stopped without reporting (killed, or frozen). A rank that refuses its inputs writes its
  note as it raises, before user code can catch the error, and says so in the input agreement
  every rank takes part in before running (``ParallelModule._agree``): the others read the note
  at once (``peer_errors``) and raise, instead of waiting in a collective it will never join.
* **waiting** — every wait of a step program goes through :meth:`StepMonitor.wait`, which records
  which collective the rank is blocked in (and, when timing is on, for how long).
* **release** — a rank whose step program fails (its own error or a peer's) has left the ranks
  out of step: a peer may be blocked in a collective this rank will never join, and catching the
  error does not change that. So after writing its note it releases its process groups
  (:meth:`StepMonitor.step_failed`, ``RankWorld.release``): a blocked peer fails at once with
  "Connection closed by peer", reads the note, and names this rank's error — within ``GRACE``
  seconds, not the collective timeout — and releases its own groups in turn. The module refuses
  to run afterwards. Input errors are not step failures: the input agreement keeps the ranks in
  step, and the module stays usable.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["DEFAULT_TIMEOUT", "CollectiveFailure", "StepMonitor"]

DEFAULT_TIMEOUT = 300.0
"""Seconds a collective on autopar's groups may wait for its peers (torch's default: 1800)."""
GRACE = 3.0
"""Seconds a failing rank waits for the other ranks' notes before naming the cause."""

_fc = torch.ops._c10d_functional


class CollectiveFailure(RuntimeError):
    """A training step failed on this rank because of another rank (named in the message), or
    failed here first (the other ranks' errors name this one)."""


@dataclass
class StepMonitor:
    """One per ParallelModule: the collective this rank waits in, timing, and failure notes."""

    rank: int
    world: int
    timeout: float
    current: str = ""
    """The collective being waited for (``"all_reduce on tp (backward)"``), or "" outside waits."""
    waiting: float = 0.0
    """Seconds blocked in waits since ``start_step`` (counted when ``timing`` is on)."""
    started: float = 0.0
    timing: bool = False
    noted: bool = False
    """A note of this rank's failure is in the store (``note``; removed by ``clear_note``)."""
    release: Callable[[], None] | None = None
    """Releases the module's process groups (``step_failed``; ``RankWorld.release``)."""
    released: str = ""
    """Why the groups were released (the failure, in one line), or "" while they are not."""

    def start_step(self) -> None:
        self.waiting = 0.0
        self.started = time.perf_counter()

    def wait(self, x: torch.Tensor, label: str) -> torch.Tensor:
        """``wait_tensor`` on ``x``, remembering ``label`` while blocked."""
        self.current = label
        if not self.timing:
            y = _fc.wait_tensor(x)
        else:
            t0 = time.perf_counter()
            y = _fc.wait_tensor(x)
            self.waiting += time.perf_counter() - t0
        self.current = ""
        return y

    # ---------------------------------------------------------------------------- failures
    def _store(self) -> dist.Store | None:
        try:
            return dist.distributed_c10d._get_default_store()
        except Exception:  # no process group (single-process tests): nothing to share
            return None

    def fail(self, exc: BaseException, where: str) -> CollectiveFailure | None:
        """Record this rank's failure (a note in the store) and return the error to raise: None
        when the failure is this rank's own (re-raise it unchanged: the other ranks' errors will
        name this rank), a :class:`CollectiveFailure` naming the cause when a peer stopped."""
        waiting_in = self.current or "no collective"
        self.current = ""
        store = self._store()
        caused_by_peer = _looks_like_peer_failure(exc)
        note = {"error": f"{type(exc).__name__}: {_first_line(exc)}", "where": where, "waiting_in": waiting_in,
                "peer": caused_by_peer, "time": time.time()}  # fmt: skip
        if store is None:
            return None
        try:
            store.set(f"autopar/failed/{self.rank}", json.dumps(note))
            self.noted = True
        except Exception:  # the store may be gone with rank 0: report what we know
            if not caused_by_peer:
                return None
            return CollectiveFailure(
                f"rank {self.rank} failed in {where} while waiting in {waiting_in}: {note['error']}"
            )
        if not caused_by_peer:
            return None
        notes = self._collect(store)
        first_own = sorted(
            ((r, n) for r, n in notes.items() if not n["peer"] and r != self.rank),
            key=lambda rn: rn[1]["time"],
        )
        silent = [r for r in range(self.world) if r not in notes]
        if first_own:
            r, n = first_own[0]
            cause = f"rank {r} failed first, in {n['where']}: {n['error']}"
        elif silent:
            cause = (
                f"rank{'s' if len(silent) > 1 else ''} {', '.join(map(str, silent))} stopped without reporting "
                f"(killed, crashed or frozen)"
            )
        else:
            cause = "every rank reports a peer failure (the cause is outside the training step)"
        return CollectiveFailure(
            f"rank {self.rank} stopped in {where} while waiting in {waiting_in}: {cause}. "
            f"(this rank saw: {note['error']})"
        )

    def step_failed(self, exc: BaseException, where: str) -> CollectiveFailure | None:
        """``fail`` for a failure inside a step program, then the release (module docstring)."""
        err = self.fail(exc, where)
        if self.release is not None and not self.released:
            self.released = f"{type(exc).__name__} in {where}: {_first_line(exc)}"
            self.release()
        return err

    def check_usable(self) -> None:
        """Raise if the groups were released: the ranks are out of step, nothing can run."""
        if self.released:
            raise RuntimeError(
                f"this module released its process groups when a training step failed on rank {self.rank} "
                f"({self.released}): the ranks are out of step. Build the module again with autopar.parallelize on "
                f"every rank (load the weights you kept, e.g. from a checkpoint)"
            )

    def note(self, exc: BaseException, where: str) -> None:
        """Publish this rank's own failure now, as it is raised (before user code can catch it):
        the ranks that learn of it in the same collective (``ParallelModule``'s input agreement)
        read it at once, with ``peer_errors``."""
        self.fail(exc, where)

    def clear_note(self) -> None:
        """Remove this rank's note once every rank agreed on a call again (a caught error is
        over), so a later failure is not blamed on it."""
        if not self.noted:
            return
        self.noted = False
        store = self._store()
        try:
            if store is not None:
                store.delete_key(f"autopar/failed/{self.rank}")
        except Exception:  # nothing to clear where the store is gone
            pass

    def peer_errors(self, ranks: list[int]) -> dict[int, str]:
        """``{rank: "ValueError: ..."}``: the notes ``ranks`` published (``note``), waiting up to
        ``GRACE`` seconds for one not there yet; a rank with none reads "no note"."""
        store = self._store()
        notes = self._collect(store, ranks) if store is not None else {}
        return {r: (f"{notes[r]['error']}" if r in notes else "no note") for r in ranks}

    def _collect(self, store: dist.Store, ranks: list[int] | None = None) -> dict[int, dict]:
        """Every rank's note (of ``ranks``), waiting up to ``GRACE`` seconds for those still missing."""
        notes: dict[int, dict] = {}
        want = list(range(self.world)) if ranks is None else list(ranks)
        deadline = time.monotonic() + GRACE
        while True:
            for r in want:
                if r in notes:
                    continue
                key = f"autopar/failed/{r}"
                try:
                    if store.check([key]):
                        notes[r] = json.loads(store.get(key))
                except Exception:
                    return notes
            if len(notes) == len(want) or time.monotonic() > deadline:
                return notes
            time.sleep(0.1)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else ""


_PEER_SIGNS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Timed out",
    "timed out",
    "Timeout",
    "Read error",
    "Write error",
    "Broken pipe",
    "NCCL communicator was aborted",
    "remote process exited",
)


def _looks_like_peer_failure(exc: BaseException) -> bool:
    """An error a rank sees because another rank stopped (gloo/NCCL transport errors, timeouts)."""
    text = str(exc)
    return any(s in text for s in _PEER_SIGNS)

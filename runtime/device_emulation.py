"""An emulated slower device: a process whose every computation takes ``factor`` times as long,
so that local gloo processes can stand for a mixed cluster's slower node group (a plan's unequal
data-parallel shares, ``autopar.dp_shares``, measured against what it predicts).

Words: an **op** is one ATen call as the dispatcher sees it (``TorchDispatchMode``); a
**collective** is one of ``torch.ops._c10d_functional`` (issue or wait) or a ``torch.distributed``
call, which this leaves alone — a link is not a core, and the other ranks' pace is theirs. After
each other op the process owes ``(factor − 1)`` times the op's own time; it sleeps once it owes a
millisecond (the sleep's own overshoot is counted against the debt), so the stretch is spread over
the step as a slower device's kernels would be, not piled at its end.

Not emulated: a slower device's collectives' own compute (the reduction inside an all-reduce),
and the dispatcher's cost of timing each op (a few microseconds an op, the same on every rank
that emulates, none on a rank that does not).
"""

from __future__ import annotations

import time
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["SlowDevice"]

_GRAIN = 1e-3
"""Seconds of debt the process sleeps off at once (shorter sleeps overshoot by as much)."""


class SlowDevice(TorchDispatchMode):
    """Every op but the collectives run under it takes ``factor`` times as long (module
    docstring); ``slept``: seconds slept so far."""

    def __init__(self, factor: float) -> None:
        super().__init__()
        if not factor >= 1:
            raise ValueError(f"SlowDevice: factor must be ≥ 1 (how many times slower), got {factor!r}")
        self.factor = float(factor)
        self.debt = 0.0
        self.slept = 0.0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func.namespace in ("_c10d_functional", "c10d"):
            return func(*args, **(kwargs or {}))
        t0 = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        self.debt += (self.factor - 1.0) * (time.perf_counter() - t0)
        if self.debt >= _GRAIN:
            t1 = time.perf_counter()
            time.sleep(self.debt)
            took = time.perf_counter() - t1
            self.slept += took
            self.debt -= took
        return out

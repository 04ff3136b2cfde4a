"""What the ``autopar`` command prints besides its results: progress on stderr (a step's time, a
bar over the planner's candidate meshes), warnings as one line each, errors as one line.

Progress is shown only when stderr is a terminal and ``--quiet`` was not given, so piped output
and logs hold results alone.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

PROG = "autopar"
"""The command's name, as it starts every warning and error line."""


@dataclass(slots=True)
class Console:
    """Where progress goes: stderr, only when it is a terminal and ``--quiet`` was not given."""

    quiet: bool

    @property
    def interactive(self) -> bool:
        return not self.quiet and sys.stderr.isatty()

    @contextlib.contextmanager
    def step(self, what: str) -> Iterator[None]:
        """``what …`` then ``what: 2.3 s`` on stderr around a piece of work."""
        t0 = time.perf_counter()
        if self.interactive:
            sys.stderr.write(f"{what} …\r")
            sys.stderr.flush()
        yield
        if self.interactive:
            sys.stderr.write(f"\x1b[2K{what}: {time.perf_counter() - t0:.1f} s\n")

    @contextlib.contextmanager
    def planning(self) -> Iterator[None]:
        """A progress bar over the planner's candidate meshes (``autopar.mesh_pool.Progress``)."""
        handler = ProgressBar(enabled=self.interactive)
        logger = logging.getLogger("autopar.planner")
        old_level, old_propagate = logger.level, logger.propagate
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False  # progress records are for the bar, not for the user's log
        try:
            yield
        finally:
            logger.removeHandler(handler)
            logger.setLevel(old_level)
            logger.propagate = old_propagate
            handler.close_bar()


class ProgressBar(logging.Handler):
    """Draws ``autopar.mesh_pool.Progress`` records as a tqdm bar: which meshes are being solved,
    how many remain, the time so far."""

    def __init__(self, enabled: bool) -> None:
        super().__init__(logging.INFO)
        self.enabled = enabled
        self.bar: Any = None
        self.running: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        ev = getattr(record, "progress", None)
        if ev is None or not self.enabled:
            return
        if (
            self.bar is None
            or self.bar.total != ev.total
            or (ev.started and ev.done == 0 and self.bar.n == self.bar.total)
        ):
            self.close_bar()
            from tqdm import tqdm

            self.bar = tqdm(
                total=ev.total, desc="planning", unit="mesh", file=sys.stderr, leave=False, dynamic_ncols=True
            )
        if ev.started:
            self.running.append(ev.task)
        else:
            if ev.task in self.running:
                self.running.remove(ev.task)
            self.bar.update(ev.done - self.bar.n)
        self.bar.set_postfix_str(("solving " + ", ".join(self.running)) if self.running else "")

    def close_bar(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        self.running = []


def show_warning(
    message: Any, category: type, filename: str, lineno: int, file: Any = None, line: Any = None
) -> None:
    text = str(message)
    text = text.removeprefix("autopar: ")
    sys.stderr.write(f"{PROG}: warning: {text}\n")


def drop_warning(*args: Any, **kwargs: Any) -> None:
    """``warnings.showwarning`` where warnings are not printed (ranks other than 0)."""


def one_line(exc: BaseException) -> str:
    """An error's message on one line (a ``KeyError``'s without its quotes)."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    if isinstance(exc, KeyError) and len(exc.args) == 1:
        text = str(exc.args[0])
    return text

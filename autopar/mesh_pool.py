"""Candidate meshes solved side by side: each mesh's solve in a forked process, the finished
meshes' objectives handed to the others as cutoffs, and the planning process's own work
(``Background``) done meanwhile. Progress is logged on the ``autopar.planner`` logger
(``Progress``), which front ends read to draw a bar.
"""

from __future__ import annotations

import contextlib
import logging
import math
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from autopar.solver import Cutoff, InfeasibleError, NotBetter

__all__ = ["Background", "Progress", "progress", "solve_meshes"]

log = logging.getLogger("autopar.planner")


@dataclass(frozen=True, slots=True)
class Progress:
    """One step of planning, logged on the ``autopar.planner`` logger as the record's ``progress``
    attribute, so a front end can draw a progress bar (``autopar.cli`` does)."""

    task: str
    """What is solved, e.g. ``"mesh (8, 8)"``."""
    started: bool
    """True when the task starts, False when it ends."""
    done: int
    """Tasks finished so far."""
    total: int
    """Tasks in all."""


def progress(task: str, started: bool, done: int, total: int) -> None:
    event = Progress(task, started, done, total)
    log.info(
        "%s %s (%d of %d done)",
        "solving" if started else "solved",
        task,
        done,
        total,
        extra={"progress": event},
    )


@dataclass(frozen=True, slots=True)
class Background:
    """Work for the planning process while its meshes are solved in forked ones: a prefetch of
    what the caller plans next (skipped where the meshes are solved in this process)."""

    work: Callable[[], None]
    eager: bool = False
    """Start every mesh at once and do the work at once: it is long and their work short (the
    export with a symbolic batch beside the whole batch's meshes). Otherwise it waits for a
    worker to be free with no mesh left to start (the tail of the solves, where a core idles)."""


def _cutoff(i: int, objectives: dict[int, float]) -> Cutoff | None:
    """The best finished mesh's objective (``objectives``: mesh index -> objective), for mesh ``i``
    to beat (``autopar.solver.Cutoff``): strictly where that mesh comes earlier in the planner's
    order (it wins a tie), else at most equal; the solver asks a rival to beat it by more than the
    relative gap its solves stop at, so the winner is within that gap of the one a full solve of
    every mesh picks."""
    if not objectives:
        return None
    objective, j = min((o, j) for j, o in objectives.items())
    return Cutoff(objective, strict=j < i)


def _objectives(done: dict[int, tuple[float, Any]]) -> dict[int, float]:
    return {j: sol.objective for j, (_, sol) in done.items() if not isinstance(sol, Exception)}


def _import_solver() -> None:
    """Import CP-SAT's Python module here before forking: each child would otherwise import it
    itself (0.55 s of a core each; twelve children plan LLaMA-3-8B on 64 H100)."""
    with contextlib.suppress(ImportError):  # the children raise the solver's own message
        from ortools.sat.python import cp_model  # noqa: F401


def solve_meshes(
    meshes: list[tuple[int, ...]],
    attempt: Callable,
    workers: int,
    background: Background | None = None,
) -> list[tuple[float, Any]]:
    """Run ``attempt(mesh, cutoff, live)`` for every mesh; with several meshes and workers, in
    forked processes. Each mesh started after another finished gets its objective as a cutoff
    (``_cutoff``): a mesh that cannot win stops when CP-SAT proves it cannot (``NotBetter``).
    A mesh solved beside others also reads their objectives as they finish (``live``, through
    shared memory), so it stops as soon as its bound passes one of them.

    Each candidate mesh is an independent solve (CP-SAT with one worker), so on a machine with
    ``workers`` cores they run side by side. Children are forked (they inherit the annotated graph;
    nothing is pickled but the Solution), which needs the ``fork`` start method (Linux) and a
    process that may fork (not daemonic, no other threads); otherwise, or with ``workers=1``, the
    meshes are solved one after another. The parent then re-annotates
    the winning mesh's strategies, which are deterministic.

    ``background``: work the parent does while the children solve (``Background``: skipped when
    the meshes are solved in this process, where it would only delay them), at once with every
    mesh started (``eager``), or once no mesh waits to start and a worker is free. The children
    publish their objectives themselves, so the live cutoffs work while the parent is busy.
    """
    if (
        workers <= 1
        or len(meshes) <= 1
        or "fork" not in mp.get_all_start_methods()
        or mp.current_process().daemon  # daemonic processes may not have children
        or threading.active_count() > 1  # forking a threaded process (e.g. a live process group) is unsafe
    ):
        done: dict[int, tuple[float, Any]] = {}
        for i, m in enumerate(meshes):
            progress(f"mesh {m}", True, i, len(meshes))
            done[i] = attempt(m, _cutoff(i, _objectives(done)))
            progress(f"mesh {m}", False, i + 1, len(meshes))
        return [done[i] for i in range(len(meshes))]
    _import_solver()
    ctx = mp.get_context("fork")
    results: dict[int, tuple[float, Any]] = {}
    running: list[tuple[int, Any, Any]] = []
    pending = list(enumerate(meshes))
    finished = ctx.Array("d", [math.nan] * len(meshes), lock=False)  # objectives, read by the children

    def child(conn: Any, i: int, mesh: tuple[int, ...], cutoff: Cutoff | None) -> None:
        def live() -> Cutoff | None:
            return _cutoff(i, {j: o for j, o in enumerate(finished) if not math.isnan(o)})

        try:
            t, sol = attempt(mesh, cutoff, live)
            if not isinstance(sol, Exception):
                finished[i] = sol.objective
            conn.send(
                ("ok", t, sol)
                if not isinstance(sol, Exception)
                else ("not_better", t, (sol.cutoff, sol.path_cutoff))
                if isinstance(sol, NotBetter)
                else ("infeasible", t, (str(sol), getattr(sol, "smallest", None)))
            )
        except Exception as exc:  # sent to the parent, which re-raises it
            try:
                conn.send(("error", 0.0, exc))
            except Exception:  # not picklable: send the traceback as text
                conn.send(
                    ("error", 0.0, RuntimeError(f"solving mesh {mesh} failed:\n{traceback.format_exc()}"))
                )
        finally:
            conn.close()

    concurrent = len(meshes) if background is not None and background.eager else workers
    while pending or running:
        while pending and len(running) < concurrent:
            i, mesh = pending.pop(0)
            parent_end, child_end = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=child, args=(child_end, i, mesh, _cutoff(i, _objectives(results))), daemon=True
            )
            proc.start()
            child_end.close()
            running.append((i, proc, parent_end))
            progress(f"mesh {mesh}", True, len(results), len(meshes))
        if background is not None and (background.eager or (not pending and len(running) < workers)):
            background.work()
            background = None
            continue  # a solve may have ended meanwhile
        # Whichever solve ends first frees its worker (mesh solves differ tenfold in time).
        ready = mp_connection.wait([c for _, _, c in running])
        k = next(j for j, (_, _, c) in enumerate(running) if c in ready)
        i, proc, conn = running.pop(k)
        try:
            status, t, payload = conn.recv()
        except EOFError:
            proc.join()
            raise RuntimeError(f"solving mesh {meshes[i]} crashed (exit code {proc.exitcode})") from None
        proc.join()
        if status == "error":
            for _, other, _ in running:
                other.kill()
            raise payload
        if status == "infeasible":
            payload = InfeasibleError(*payload)
        elif status == "not_better":
            payload = NotBetter(*payload)
        results[i] = (t, payload)
        progress(f"mesh {meshes[i]}", False, len(results), len(meshes))
    return [results[i] for i in range(len(meshes))]

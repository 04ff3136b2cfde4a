"""Run a function on N local processes with a gloo process group: ``spawn(fn, world_size)``.

Used by the tests, the demo and the benchmarks to emulate N devices on one machine. Each process
sets one compute thread (so timings are not skewed by oversubscription), joins a gloo group
through a TCP store on a free local port (its collectives time out after ``pg_timeout`` seconds),
runs ``fn(rank, world_size, *args)`` and sends back its return value or its traceback. ``timeout``
bounds the whole run: on expiry every process is killed and ``TimeoutError`` names the ranks that
had not finished, so a crash or deadlock never hangs. When a rank fails, the error names first
the ranks that died without reporting (their signal or exit code: the likely cause), then the
rank whose error arrived first.

Processes start from a fork server (``multiprocessing``'s ``forkserver``, where the platform has
one; else ``spawn``): a clean process, started once per parent process, that imports torch and
autopar — and the heavy libraries the parent has already imported, such as ``transformers``'
model code — before any rank exists, then forks each rank from that state. A rank so starts in
well under a second instead of importing those libraries again (4 s for torch, 5 s more for
``transformers.modeling_utils`` on a 2-core machine), and the parent's own state (threads,
process groups, open files) is never forked. What is preloaded is fixed when the fork server
starts, at the parent's first ``spawn``, and so is what those modules read from the environment
as they are imported; what a rank reads later sees the parent's environment at the call.
"""

from __future__ import annotations

import io
import os
import queue
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

from autopar.runtime.monitor import GRACE

__all__ = ["spawn"]

SETTLE = GRACE + 4.0
"""Seconds ``spawn`` keeps collecting after the first failure: the survivors' errors come after
their grace period (``autopar.runtime.monitor.GRACE``), and they name the cause."""


PRELOAD = ("torch", "torch.distributed", "autopar", "autopar.runtime.launch")
"""Modules the fork server always imports before forking a rank."""

PRELOAD_IF_LOADED = {"transformers": ("transformers.modeling_utils",), "torchvision": ("torchvision",)}
"""Modules it imports too where the parent process has imported the key (its ranks will likely
import them; a parent that never did should not pay for them)."""


def _context(fresh: bool) -> Any:
    """The multiprocessing context ranks start from (module docstring); ``fresh``: ``spawn``."""
    if fresh or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    extra = [m for key, mods in PRELOAD_IF_LOADED.items() if key in sys.modules for m in mods]
    ctx.set_forkserver_preload([*PRELOAD, *extra])
    return ctx


class _ParentFd:
    """One of the parent's file descriptors, sent to a rank as ``multiprocessing`` sends a pipe's
    (``reduction.DupFd``): the rank receives a duplicate of it, whichever start method made it."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple:
        from multiprocessing import reduction

        return (_received_fd, (reduction.DupFd(self.fd),))


def _received_fd(dup: Any) -> int:
    return dup.detach()


def _standard_fds() -> tuple[_ParentFd | None, ...]:
    """The parent's standard output and error as they are now (a test capturing them, a file the
    caller redirected to): the ranks write there, as spawned processes would. ``None`` for one the
    parent has closed; both ``None`` on Windows, where ranks are spawned and inherit them."""
    if sys.platform == "win32":
        return (None, None)
    out = []
    for fd in (1, 2):
        try:
            os.fstat(fd)
        except OSError:
            out.append(None)
        else:
            out.append(_ParentFd(fd))
    return tuple(out)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(
    rank: int,
    world: int,
    port: int,
    threads: int,
    pg_timeout: float,
    env: dict[str, str],
    std: tuple[int | None, ...],
    fn: Callable,
    args: tuple,
    q: Any,
) -> None:
    import faulthandler

    # The parent's environment as it is now (a forked rank inherits the fork server's, as it was
    # when the server started): what ``fn`` reads from it is what a spawned rank would read.
    os.environ.clear()
    os.environ.update(env)
    for target, fd in zip((1, 2), std):  # and its standard output and error (``_standard_fds``)
        if fd is None or fd == target:  # spawn passes a descriptor under its own number
            continue
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os.dup2(fd, target)
        os.close(fd)
    # A native crash (SIGSEGV, SIGABRT) prints this rank's Python stack to the inherited stderr.
    faulthandler.enable()
    try:
        torch.set_num_threads(threads)
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = str(port)
        import datetime

        import torch.distributed as dist

        dist.init_process_group(
            "gloo",
            rank=rank,
            world_size=world,
            init_method=f"tcp://127.0.0.1:{port}",
            timeout=datetime.timedelta(seconds=pg_timeout),
        )
        try:
            result = fn(rank, world, *args)
        finally:
            dist.destroy_process_group()
        buf = io.BytesIO()
        torch.save(result, buf)  # bytes, not shared-memory handles that die with this process
        q.put((rank, "ok", buf.getvalue()))
    except BaseException:  # the traceback goes to the parent, which raises it
        q.put((rank, "error", traceback.format_exc()))


def _exit_reason(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name} (exit code {code})"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


def _failure(errors: dict[int, str], procs: list, results: dict[int, Any], order: list[int]) -> RuntimeError:
    """The error ``spawn`` raises: ranks that died without reporting first, then the reports."""
    silent = [
        r for r, p in enumerate(procs) if r not in errors and r not in results and p.exitcode not in (None, 0)
    ]
    parts = [
        f"spawn: rank {r} died without reporting an error: {_exit_reason(procs[r].exitcode)}" for r in silent
    ]
    for i, r in enumerate(order):
        text = errors[r].rstrip()
        if i == 0:
            parts.append(f"rank {r} failed{' afterwards' if silent else ''}:\n{text}")
        else:
            parts.append(f"rank {r} failed too: {text.splitlines()[-1] if text else ''}")
    return RuntimeError("\n".join(parts))


def spawn(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 300.0,
    threads: int = 1,
    pg_timeout: float = 1800.0,
    settle: float = SETTLE,
    fresh: bool = False,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; return their results by rank.

    ``fn`` must be importable (a module-level function). ``pg_timeout``: seconds a collective of the
    default process group waits for its peers. ``settle``: seconds to keep collecting the other
    ranks' errors after the first failure (they name its cause). ``fresh=True``: every rank starts
    a new interpreter (``spawn``) instead of forking from the preloaded server, so what only
    interpreter start reads (``PYTHONPATH``, ``sitecustomize``) applies as it is now. Raises
    ``RuntimeError`` naming the rank that died or failed (see module docstring), or
    ``TimeoutError`` after ``timeout``.
    """
    ctx = _context(fresh)
    q = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(
            target=_worker,
            args=(r, world_size, port, threads, pg_timeout, dict(os.environ), _standard_fds(), fn, args, q),
            daemon=True,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    order: list[int] = []
    deadline = time.monotonic() + timeout
    settle_until: float | None = None  # after a failure: a moment for the other ranks' fates to show
    try:
        while len(results) + len(errors) < world_size:
            now = time.monotonic()
            if settle_until is not None and now >= settle_until:
                break
            left = deadline - now
            if left <= 0:
                if errors:
                    break
                missing = sorted(set(range(world_size)) - set(results))
                raise TimeoutError(f"spawn: ranks {missing} did not finish within {timeout:.0f} s")
            try:
                rank, status, value = q.get(timeout=min(left, 0.2))
            except queue.Empty:
                dead = [
                    r
                    for r, p in enumerate(procs)
                    if not p.is_alive()
                    and r not in results
                    and r not in errors
                    and p.exitcode not in (0, None)
                ]
                if dead and settle_until is None:
                    settle_until = time.monotonic() + settle
                continue
            if status == "error":
                errors[rank] = value
                order.append(rank)
                if settle_until is None:
                    settle_until = time.monotonic() + settle
                continue
            results[rank] = torch.load(io.BytesIO(value), weights_only=False)
        if errors or len(results) < world_size:
            raise _failure(errors, procs, results, order)
    finally:
        for p in procs:
            if p.is_alive():
                p.join(timeout=5 if len(results) == world_size else 0.1)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world_size)]

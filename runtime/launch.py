"""Run a function on N local processes with a gloo process group: ``spawn(fn, world_size)``.

Used by the tests, the demo and the benchmarks to emulate N devices on one machine. Each process
sets one compute thread (so timings are not skewed by oversubscription), joins a gloo group
through a TCP store on a free local port, runs ``fn(rank, world_size, *args)`` and sends back its
return value or its traceback. ``timeout`` bounds the whole run: on expiry every process is killed
and ``TimeoutError`` names the ranks that had not finished, so a crash or deadlock never hangs.
"""

from __future__ import annotations

import io
import os
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

__all__ = ["spawn"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, threads: int, fn: Callable, args: tuple, q: Any) -> None:
    try:
        torch.set_num_threads(threads)
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = str(port)
        import torch.distributed as dist

        dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}")
        try:
            result = fn(rank, world, *args)
        finally:
            dist.destroy_process_group()
        buf = io.BytesIO()
        torch.save(result, buf)  # bytes, not shared-memory handles that die with this process
        q.put((rank, "ok", buf.getvalue()))
    except BaseException:  # the traceback goes to the parent, which raises it
        q.put((rank, "error", traceback.format_exc()))


def spawn(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 300.0, threads: int = 1
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; return their results by rank.

    ``fn`` must be importable (a module-level function). Raises ``RuntimeError`` with the failing
    rank's traceback, or ``TimeoutError`` after ``timeout`` seconds.
    """
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, threads, fn, args, q), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    import queue
    import time

    deadline = time.monotonic() + timeout
    try:
        while len(results) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(world_size)) - set(results))
                raise TimeoutError(f"spawn: ranks {missing} did not finish within {timeout:.0f} s")
            try:
                rank, status, value = q.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [
                    r
                    for r, p in enumerate(procs)
                    if not p.is_alive() and r not in results and p.exitcode not in (0, None)
                ]
                if dead:
                    raise RuntimeError(
                        f"spawn: rank(s) {dead} died (exit codes {[procs[r].exitcode for r in dead]})"
                    ) from None
                continue
            if status == "error":
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            results[rank] = torch.load(io.BytesIO(value), weights_only=False)
    finally:
        for p in procs:
            if p.is_alive():
                p.join(timeout=5 if len(results) == world_size else 0.1)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world_size)]

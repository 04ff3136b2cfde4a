"""Stress run for issue 22 item 1: two successive ZeRO-3 modules on 4 gloo processes with the
ZeRO-3 prefetch pass (``passes.overlap.prefetch_params``) on, repeated to get a crash rate.

    python examples/stress_zero3_prefetch.py --runs 50              # each run a fresh set of processes
    python examples/stress_zero3_prefetch.py --runs 5 --no-prefetch # the same without the pass
    python examples/stress_zero3_prefetch.py --runs 10 --coalesced  # without the workaround: aborts
    python examples/stress_zero3_prefetch.py --layers 4 --hidden 256 --seq 64   # bench_overlap's GPT
    python examples/stress_zero3_prefetch.py --like-bench --layers 4 --hidden 256 --seq 64 --steps 23

With a layer's gathers in flight at once, torch's gloo backend corrupts the heap now and then
(``malloc(): unaligned tcache chunk detected``) through the functional all-gather's own path;
``gather_into_buffers`` (``passes.gather_buffers``) rewrites every gather on gloo onto the path
that does not. ``--coalesced`` turns that pass off, to see the fault. Every run is a child process (``MALLOC_CHECK_=3``, ``PYTHONFAULTHANDLER=1``, a timeout), so a
heap abort in any rank shows as that run failing with its message; the tally is printed at the end.
One run: plan FSDP for 4 processes, every rank builds two modules from the plan and trains both,
in turn, ``--steps`` steps each. ``--like-bench`` is the run the abort was first seen in,
``examples/bench_overlap.py``'s ZeRO-3 pair: the second module has the overlap passes off, the
steps are timed and separated by a barrier.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from typing import Any

import torch


def model(layers: int, hidden: int, seq: int, batch: int = 8, seed: int = 0) -> tuple[Any, tuple]:
    from autopar.models import GPT, GPTConfig

    torch.manual_seed(seed)
    m = GPT(GPTConfig(n_layer=layers, n_head=4, n_embd=hidden, vocab_size=256, block_size=seq))
    idx = torch.randint(0, 256, (batch, seq))
    return m, (idx, torch.randint(0, 256, (batch, seq)))


OVERLAP_PASSES = ("bucket_gradients", "prefetch_params", "sink_waits")
"""What ``examples/bench_overlap.py`` turns off in its second module (``--like-bench``)."""


def worker(
    rank: int,
    world: int,
    plan_json: str,
    shape: tuple,
    steps: int,
    prefetch: bool,
    like_bench: bool = False,
    coalesced: bool = False,
) -> list[float]:
    """Two ZeRO-3 modules from one plan, trained in turn; returns the losses."""
    import warnings

    import autopar

    warnings.simplefilter("ignore")
    off = ("prefetch_params",) * (not prefetch) + ("gather_into_buffers",) * coalesced
    plan = autopar.Plan.from_dict(json.loads(plan_json))
    cluster = autopar.Cluster.local(world)
    mods = []
    for i in range(2):
        m, inputs = model(*shape)
        disable = tuple({*off, *(OVERLAP_PASSES if like_bench and i == 1 else ())})
        pm = autopar.parallelize(m, cluster, inputs, plan=plan, disable=disable)
        if like_bench:
            pm.step.enable_timing()
        mods.append((pm, torch.optim.AdamW(pm.parameters(), lr=1e-4), inputs))
    losses = []
    for _ in range(steps):
        for pm, opt, inputs in mods:
            if like_bench:
                torch.distributed.barrier()
            loss = pm(*inputs)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    return losses


def one_run(
    world: int, shape: tuple, steps: int, prefetch: bool, like_bench: bool = False, coalesced: bool = False
) -> list[list[float]]:
    import autopar
    from autopar.runtime.launch import spawn

    m, inputs = model(*shape)
    plan = autopar.layouts.fsdp(m, inputs, autopar.Cluster.local(world))
    return spawn(
        worker, world, json.dumps(plan.to_dict()), shape, steps, prefetch, like_bench, coalesced, timeout=600
    )


_HEAP = re.compile(
    r"(malloc\(\)[^\n]*|free\(\)[^\n]*|double free[^\n]*|corrupted[^\n]*|Segmentation fault[^\n]*)"
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--timeout", type=float, default=400)
    ap.add_argument("--no-prefetch", action="store_true")
    ap.add_argument(
        "--coalesced",
        action="store_true",
        help="gathers on the functional op's own path (the workaround off)",
    )
    ap.add_argument("--like-bench", action="store_true", help="the second module without the overlap passes")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    shape = (args.layers, args.hidden, args.seq)
    if args.child:
        res = one_run(args.world, shape, args.steps, not args.no_prefetch, args.like_bench, args.coalesced)
        print("OK", res[0][-2:], flush=True)
        return
    env = dict(os.environ, MALLOC_CHECK_="3", PYTHONFAULTHANDLER="1")
    ok = crashed = timed_out = 0
    for i in range(args.runs):
        t0 = time.perf_counter()
        try:
            p = subprocess.run(
                [sys.executable, __file__, "--child", *sys.argv[1:]],
                env=env, capture_output=True, text=True, timeout=args.timeout,
            )  # fmt: skip
            out = p.stdout + p.stderr
            if p.returncode == 0 and "\nOK" in "\n" + p.stdout:
                ok += 1
                verdict = "ok"
            else:
                crashed += 1
                heap = _HEAP.search(out)
                verdict = (
                    f"FAILED rc={p.returncode}: {heap.group(1) if heap else out.strip().splitlines()[-1:]}"
                )
        except subprocess.TimeoutExpired:
            timed_out += 1
            verdict = "timed out"
        print(f"run {i + 1}/{args.runs}: {verdict} ({time.perf_counter() - t0:.0f} s)", flush=True)
    how = f"prefetch {'off' if args.no_prefetch else 'on'}, gathers {'coalesced' if args.coalesced else 'into buffers'}"
    print(f"{how}: {ok} ok, {crashed} failed, {timed_out} timed out")


if __name__ == "__main__":
    main()

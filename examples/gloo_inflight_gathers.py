"""Issue 22 item 1's reproducer, in plain torch (no autopar): several all-gathers in flight at
once on one gloo process group, as autopar's ZeRO-3 prefetch pass issues a layer's gathers
(``passes.overlap.prefetch_params``), abort the process with glibc's ``malloc(): unaligned tcache
chunk detected`` now and then — heap corruption inside torch's gloo backend, not in autopar's
programs (this script has none).

    python examples/gloo_inflight_gathers.py --runs 10                 # 8 functional gathers in flight
    python examples/gloo_inflight_gathers.py --runs 10 --inflight 1    # one at a time: the control
    python examples/gloo_inflight_gathers.py --runs 10 --mode out      # the functional op's out= form
    python examples/gloo_inflight_gathers.py --runs 10 --mode async_op # dist.all_gather_into_tensor(async_op=True)
    python examples/gloo_inflight_gathers.py --runs 10 --mode lanes    # each gather in flight on its own group

One trial: 4 gloo processes on one group, ``--steps`` times: issue ``--inflight`` functional
``all_gather_into_tensor`` of the shards of a transformer layer's weights (shapes of a 64-wide GPT
layer over 4 ranks) with a small matmul between issues, then wait for them in issue order. Each
trial is a fresh child process; its verdict (ok, or the heap message) and the tally are printed.

Which path aborts. ``_c10d_functional.all_gather_into_tensor`` reaches gloo as
``allgather_into_tensor_coalesced`` (gloo's ``AsyncAllgatherCoalescedWork``, which allocates a flat
output and copies out of it on gloo's worker thread); its ``out=`` form and
``dist.all_gather_into_tensor`` reach it as ``_allgather_base`` (``AsyncAllgatherWork``). Measured
on the 2-core development machine (torch 2.13, gloo, 400 steps, 4 processes):

=====================================================  ====  ============================
what is in flight                                      runs  aborted
=====================================================  ====  ============================
8 functional gathers on one group                      47    11 (heap message or SIGSEGV)
1 functional gather at a time                          4     0
8 through the functional op's ``out=`` form            30    0
8 through ``dist.all_gather_into_tensor(async_op=1)``  28    0
8 functional gathers, each on a group of its own       18    0
=====================================================  ====  ============================

``passes.gather_buffers`` is the workaround autopar builds from this: on gloo every gather is
issued in the ``out=`` form.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import subprocess
import sys
import time

import torch

SHARD_SHAPES = [(48, 64), (48,), (16, 64), (16,), (64, 16), (64,), (4,), (4,)]
"""A layer's weight shards on one of 4 ranks (qkv, its bias, the projection, its bias, norms)."""


def trial(rank: int, inflight: int, steps: int, port: int, mode: str) -> None:
    import torch.distributed as dist

    fc = torch.ops._c10d_functional
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=4)
    span = datetime.timedelta(seconds=60)
    lanes = [dist.new_group([0, 1, 2, 3], timeout=span) for _ in range(inflight if mode == "lanes" else 1)]
    group = lanes[0]
    shards = [torch.randn(s) for s in SHARD_SHAPES]
    x = torch.randn(8, 16, 64)
    for _ in range(steps):
        pending = []
        for i in range(inflight):
            p = shards[i % len(shards)].reshape(-1)
            if mode in ("functional", "lanes"):  # "lanes": each gather in flight on a group of its own
                pending.append(fc.all_gather_into_tensor(p, 4, lanes[i % len(lanes)].group_name))
            elif mode == "out":  # the functional op's out= form: ProcessGroupGloo::_allgather_base
                pending.append(
                    fc.all_gather_into_tensor_out(p, 4, group.group_name, out=torch.empty(4 * p.numel()))
                )
            else:
                out = torch.empty(4 * p.numel())
                pending.append((out, dist.all_gather_into_tensor(out, p, group=group, async_op=True)))
            x = torch.tanh(x @ torch.randn(64, 64) * 0.1)  # compute between issues
        for t in pending:
            if mode in ("functional", "lanes", "out"):
                w = fc.wait_tensor(t)
            else:
                t[1].wait()
                w = t[0]
            x = x + w.sum() * 1e-6
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--inflight", type=int, default=8)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--mode", choices=("functional", "out", "async_op", "lanes"), default="functional")
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)  # the port of one trial
    args = ap.parse_args()
    if args.child:
        import torch.multiprocessing as mp

        mp.spawn(trial, args=(args.inflight, args.steps, args.child, args.mode), nprocs=4)
        print("OK", flush=True)
        return
    tally = {"ok": 0, "heap": 0, "other": 0}
    for i in range(args.runs):
        t0 = time.perf_counter()
        cmd = [sys.executable, __file__, *sys.argv[1:], "--child", str(29400 + (os.getpid() + i) % 500)]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        out = p.stdout + p.stderr
        heap = re.search(r"(malloc\(\)[^\n]*|free\(\)[^\n]*|double free[^\n]*|corrupted[^\n]*)", out)
        kind = "ok" if p.returncode == 0 and "OK" in p.stdout else "heap" if heap else "other"
        tally[kind] += 1
        said = heap.group(1) if heap else (out.strip().splitlines() or [""])[-1][:120]
        print(
            f"run {i + 1}/{args.runs}: {kind}{'' if kind == 'ok' else ': ' + said} ({time.perf_counter() - t0:.0f} s)"
        )
    print(
        f"{args.mode}, {args.inflight} in flight: {tally['ok']} ok, {tally['heap']} heap aborts, {tally['other']} other"
    )


if __name__ == "__main__":
    main()

"""How long each failure takes to end in an error on every rank (issue 11's figures): the fault
workers of ``tests/test_faults.py`` run on gloo processes, each case's message and time printed.

    python examples/fault_times.py

Bad inputs (2 processes): refused on every rank before any collective, the slowest rank's time.
Peer faults (a rank killed, frozen, or carrying on after its own error): how long ``spawn`` took
to return, and how far into the faulty step each survivor stopped (the collective timeout is
``TIMEOUT`` seconds there).
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import test_faults as F  # the workers the tests run

from autopar.runtime.launch import spawn


def main() -> None:
    runs = spawn(F.input_faults_worker, 2, timeout=180)
    print("bad inputs, 2 processes:")
    for case in runs[0]:
        if case != "after":
            took = max(r[case][1] for r in runs)
            print(f"  {case:32s} {took * 1e3:7.1f} ms  {runs[1][case][0][:100]}")
    print(f"peer faults (collective timeout {F.TIMEOUT:.0f} s):")
    for fault, world in (("killed", 3), ("frozen", 3), ("bad shape, caught", 2)):
        t0 = time.perf_counter()
        try:
            spawn(F.peer_faults_worker, world, fault, timeout=90, pg_timeout=30, settle=F.TIMEOUT + 10)
            print(f"  {fault}: no error (unexpected)")
        except RuntimeError as e:
            stops = re.findall(r"stopped ([\d.]+) s into the faulty step", str(e))
            print(f"  {fault:18s} survivors stopped {', '.join(stops)} s into the step; spawn returned after "
                  f"{time.perf_counter() - t0:.1f} s: {str(e).splitlines()[0][:90]}")  # fmt: skip


if __name__ == "__main__":
    main()

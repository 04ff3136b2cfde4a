"""Faults end in a clear error on every rank, within a bounded time (issue 11): never a silent wrong
result, never a hang.

Each worker runs a fault, catches what its rank raised, and returns the message and how long the
failing call took; a rank that dies or freezes returns nothing, and ``spawn`` names it. Collective
timeouts are set short (``TIMEOUT`` seconds) so a frozen peer costs little.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from typing import Any

import _runtime_helpers as H
import pytest
import torch
import torch.distributed as dist

import autopar
from autopar.runtime.launch import spawn
from autopar.runtime.monitor import GRACE

pytestmark = [pytest.mark.distributed, pytest.mark.filterwarnings("ignore:autopar. no sharding rule")]

TIMEOUT = 6.0
"""Collective timeout of the modules under test (seconds)."""
RELEASE_TIMEOUT = 60.0
"""The collective timeout under which a step failure must release its peers in seconds."""
SETTLE = TIMEOUT + GRACE + 3
"""Seconds ``spawn`` keeps collecting after the first failure: a survivor that learns of the fault
only by its collective timing out raises ``TIMEOUT`` and the monitor's ``GRACE`` later (the wait
for the faulty rank's note); 3 s more of margin. A rank that never reports (killed, frozen) makes
``spawn`` wait all of it, so it is not longer than that."""


def _catch(fn: Any) -> tuple[str, float]:
    t0 = time.perf_counter()
    try:
        fn()
    except Exception as exc:  # the error each rank raised, for the test to read
        return f"{type(exc).__name__}: {exc}", time.perf_counter() - t0
    return "", time.perf_counter() - t0


def _step(pm: Any, inputs: Any) -> None:
    loss = H.loss_of(H.call(pm, inputs))
    loss.backward()


def input_faults_worker(rank: int, world: int) -> dict[str, tuple[str, float]]:
    """Bad inputs: every rank raises the same clear error before any collective."""
    H.quiet()
    out = {}
    cluster = autopar.Cluster.local(world)
    model, (ids, targets) = H.build("gpt")
    plan = autopar.layouts.megatron(model, (ids, targets), cluster, tp=world)  # vocabulary-parallel
    pm = autopar.parallelize(model, cluster, (ids, targets), plan=plan, timeout=TIMEOUT)
    bad_ids = ids.clone()
    bad_ids[1, 3] = H.VOCAB + 5
    out["id out of range"] = _catch(lambda: _step(pm, (bad_ids, targets)))
    bad_t = targets.clone()
    bad_t[0, 0] = H.VOCAB
    out["target out of range"] = _catch(lambda: _step(pm, (ids, bad_t)))
    out["wrong dtype"] = _catch(lambda: _step(pm, (ids.to(torch.float32), targets)))
    # Ids and targets of another integer dtype are cast to the plan's, as eager takes int32 ids.
    out["int32 ids"] = (
        str(H.loss_of(H.call(pm, (ids.to(torch.int32), targets.to(torch.int16)))).item()),
        0.0,
    )
    # Different batches on different ranks (each rank its own loader): caught by default.
    mine = (ids + rank) % H.VOCAB
    out["different batches"] = _catch(lambda: _step(pm, (mine, targets)))
    # ... and the same batch shuffled differently on each rank.
    rows = torch.arange(ids.shape[0]).roll(rank)
    out["shuffled batches"] = _catch(lambda: _step(pm, (ids[rows], targets[rows])))
    pm_off = autopar.parallelize(
        model, cluster, (ids, targets), plan=plan, timeout=TIMEOUT, check_inputs=None
    )
    out["check off"] = _catch(lambda: pm_off(mine, targets))
    # Local shards: only rank 1's shard is out of range; every rank stops.
    pm_local = autopar.parallelize(
        model, cluster, (ids, targets), plan=plan, timeout=TIMEOUT, local_inputs=True
    )
    shards = pm_local.shard_inputs(ids, targets)
    local_ids = shards["args[0]"].clone()
    if rank == 1:
        local_ids[0, 0] = -3
    out["one rank's shard out of range"] = _catch(lambda: _step(pm_local, (local_ids, shards["args[1]"])))
    # Still trains after the refused calls: the errors came before any collective.
    out["after"] = (str(H.loss_of(H.call(pm, (ids, targets))).item()), 0.0)
    return out


@pytest.mark.timeout(200)
def test_bad_inputs_raise_the_same_clear_error_on_every_rank():
    runs = spawn(input_faults_worker, 2, timeout=180)
    for rank, r in enumerate(runs):
        msg = r["id out of range"][0]
        assert msg.startswith("IndexError") and str(H.VOCAB + 5) in msg and "embedding table" in msg, (
            rank,
            msg,
        )
        msg = r["target out of range"][0]
        assert msg.startswith("IndexError") and "classes" in msg and str(H.VOCAB) in msg, (rank, msg)
        assert r["wrong dtype"][0].startswith("TypeError") and "float32" in r["wrong dtype"][0]
        for case in ("different batches", "shuffled batches"):
            msg = r[case][0]
            assert msg.startswith("ValueError") and "ranks [1]" in msg and "local_inputs=True" in msg, (
                rank,
                msg,
            )
        assert r["check off"][0] == "", r["check off"]  # opted out: a silent mixture, as documented
        msg = r["one rank's shard out of range"][0]
        if rank == 1:
            assert msg.startswith("IndexError") and "-3" in msg, (rank, msg)
        else:  # rank 0 names rank 1 and its error
            assert msg.startswith("CollectiveFailure") and "rank(s) [1]" in msg and "-3" in msg, (rank, msg)
        for case, (_, took) in r.items():
            assert took < TIMEOUT, (case, took)  # refused before any collective could wait
    model, (ids, targets) = H.build("gpt")
    ref = H.loss_of(H.call(model, (ids, targets))).item()
    assert abs(float(runs[0]["after"][0]) - ref) <= 1e-5 * abs(ref)
    assert abs(float(runs[0]["int32 ids"][0]) - ref) <= 1e-5 * abs(ref)


def peer_faults_worker(rank: int, world: int, fault: str) -> tuple[str, float]:
    """Rank 1 fails in the middle of training (``fault``); the others must stop, naming it."""
    H.quiet()
    cluster = autopar.Cluster.local(world)
    model, inputs = H.build("gpt")
    fixed = {n: ("R",) for n, _ in model.named_parameters()}
    if fault == "pipelined stage error, caught":
        plan = autopar.plan(model, inputs, cluster, pp=2, microbatches=2, schedule="1f1b")
    else:
        plan = autopar.plan(model, inputs, cluster, fixed=fixed, mesh_shape=(world,))
    # A failure inside the step must release the peers at once, not after the collective timeout:
    # that case runs under a timeout far longer than the bound it is held to.
    timeout = RELEASE_TIMEOUT if fault.endswith("error, caught") else TIMEOUT
    pm = autopar.parallelize(model, cluster, inputs, plan=plan, timeout=timeout, local_inputs=True)
    if pm.pipeline is None:
        shards = pm.shard_inputs(*inputs)
        local = (shards["args[0]"], shards["args[1]"])
    else:  # a pipeline takes the global batch on every rank
        local = inputs
    _step(pm, local)  # one good step
    if rank == 1:
        if fault == "killed":
            threading.Timer(0.05, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
        elif fault == "frozen":
            threading.Timer(0.05, lambda: os.kill(os.getpid(), signal.SIGSTOP)).start()
        elif fault.endswith("error, caught"):
            step = pm.step if pm.pipeline is None else pm.pipeline.steps[max(pm.pipeline.steps)]
            program, fails = step.program, "backward" if pm.pipeline is None else "backward_input"

            def failing(kind: str) -> Any:  # this rank's backward program fails as it starts
                if kind != fails:
                    return program(kind)

                def fail(*_: Any) -> Any:
                    raise RuntimeError("injected: rank 1's backward failed")

                return fail

            step.program = failing
            msg, took = _catch(lambda: _step(pm, local))
            again, _ = _catch(lambda: _step(pm, local))  # the module refuses to run out of step
            try:  # ... and the user's code carries on, into a barrier the others never reach
                dist.barrier()
            except Exception as exc:  # rank 0 stopped: say what this rank saw
                raise RuntimeError(f"rank 1 caught [{msg}], then [{again}], then [{exc}]") from exc
            return msg, took
        elif fault == "bad shape, caught":
            msg, took = _catch(lambda: _step(pm, (local[0][:, :-1], local[1])))
            # ... and carries on elsewhere: into a barrier the others never reach.
            dist.barrier()
            return msg, took
    t0 = time.perf_counter()
    for _ in range(200):  # train until the fault stops this rank, then fail with how long it took
        msg, _took = _catch(lambda: _step(pm, local))
        if msg:
            raise RuntimeError(f"{msg} [stopped {time.perf_counter() - t0:.1f} s into the faulty step]")
    return "", time.perf_counter() - t0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fault", ["killed", "frozen"])
def test_a_dead_or_frozen_rank_is_named_by_every_survivor_within_the_timeout(fault):
    t0 = time.perf_counter()
    with pytest.raises(RuntimeError) as info:
        spawn(peer_faults_worker, 3, fault, timeout=90, pg_timeout=30, settle=SETTLE)
    took = time.perf_counter() - t0
    text = str(info.value)
    if fault == "killed":
        assert "rank 1 died without reporting an error: killed by signal SIGKILL" in text, text
    # Both survivors stop with an error naming rank 1, within the collective timeout and a few seconds.
    assert text.count("rank 1 stopped without reporting") >= 1, text
    for survivor in (0, 2):
        assert f"rank {survivor} " in text, text
    assert "CollectiveFailure" in text and "waiting in" in text, text
    # Bounded from the fault on, whatever start-up cost on a loaded machine: each survivor stops
    # within the module's collective timeout, the monitor's grace for notes, and a margin.
    stopped = [float(s) for s in re.findall(r"\[stopped ([0-9.]+) s into", text)]
    assert len(stopped) >= 2 and max(stopped) < TIMEOUT + GRACE + 10, (stopped, text)
    assert took < 90, took


@pytest.mark.timeout(120)
def test_one_ranks_shape_error_caught_and_carried_on_does_not_hang_the_others():
    with pytest.raises(RuntimeError) as info:
        spawn(peer_faults_worker, 2, "bad shape, caught", timeout=90, pg_timeout=20, settle=SETTLE)
    text = str(info.value)
    # Rank 1 published its error as it raised it, in the input agreement rank 0 takes part in: rank 0
    # stops at once naming rank 1's own error (the shape), not a bare "connection closed".
    assert "rank(s) [1] refused their inputs (rank 1: ValueError" in text, text
    assert "shape" in text
    took = float(re.search(r"\[stopped ([0-9.]+) s into", text).group(1))
    assert took < TIMEOUT / 2, took


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "fault, where",
    [
        ("backward error, caught", "the backward program"),
        ("pipelined stage error, caught", "the pipeline schedule"),
    ],
)
def test_a_step_failure_caught_on_one_rank_releases_the_others_at_once(fault: str, where: str) -> None:
    """Rank 1's backward program fails (data parallel; or the last stage's input-gradient program
    of a 2-stage pipeline) and its caller catches the error and carries on: rank 1 releases its
    process groups, so rank 0, blocked in a gradient reduction or a receive rank 1 will never
    join, stops at once (not after the 60 s collective timeout) with an error naming rank 1's;
    rank 1's module then refuses to run."""
    with pytest.raises(RuntimeError) as info:
        spawn(peer_faults_worker, 2, fault, timeout=90, pg_timeout=20, settle=SETTLE)
    text = str(info.value)
    assert f"rank 1 failed first, in {where}: RuntimeError: injected: rank 1's backward failed" in text, text
    assert "CollectiveFailure" in text and "waiting in" in text, text
    took = float(re.search(r"\[stopped ([0-9.]+) s into", text).group(1))
    assert took < RELEASE_TIMEOUT / 6, took
    assert "rank 1 caught [RuntimeError: injected: rank 1's backward failed]" in text, text
    assert (
        "then [RuntimeError: this module released its process groups when a training step failed on rank 1"
        in text
    )

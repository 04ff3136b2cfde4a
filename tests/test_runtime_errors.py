"""Mistakes are reported before any collective runs, on every rank, so nothing hangs: each
distributed case runs on 2 gloo processes under a spawn timeout, and after the errors the process
group still works (a barrier and a training step)."""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import _runtime_helpers as H
import pytest
import torch
import torch.distributed as dist

import autopar
from autopar.runtime.launch import spawn

pytestmark = pytest.mark.filterwarnings("ignore:autopar. no sharding rule")

KIND, WORLD = "gpt2", 2


def test_parallelize_needs_an_initialized_process_group():
    assert not dist.is_initialized()
    model, inputs = H.build(KIND)
    with pytest.raises(RuntimeError, match=r"init_process_group"):
        autopar.parallelize(model, autopar.Cluster.local(WORLD), inputs)


def _error(fn) -> str:
    try:
        fn()
    except Exception as exc:  # the test asserts on the type and the message
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def errors_worker(rank: int, world: int, plans: dict[str, Any]) -> dict[str, Any]:
    H.quiet()
    model, inputs = H.build(KIND)
    cluster = autopar.Cluster.local(world)
    out: dict[str, Any] = {}
    for name in ("mesh 2x2", "mesh 4"):
        out[name] = _error(lambda p=plans[name]: autopar.parallelize(model, cluster, inputs, plan=p))
    out["cluster of 4"] = _error(lambda: autopar.parallelize(model, autopar.Cluster.local(4), inputs))
    out["planning fails"] = _error(lambda: autopar.parallelize(model, cluster, inputs, memory_budget=1.0))

    pm = autopar.parallelize(model, cluster, inputs, plan=plans["megatron"])
    before = Counter(pm.axes[0].counts)
    short = {k: v[:, : H.SEQ // 2].contiguous() for k, v in inputs.items()}
    out["batch shape"] = _error(lambda: pm(**short))
    out["collectives during the bad call"] = dict(Counter(pm.axes[0].counts) - before)

    dist.barrier()
    loss = H.loss_of(pm(**inputs))
    loss.backward()
    out["loss after errors"] = loss.item()
    return out


@pytest.mark.distributed
@pytest.mark.timeout(150)
def test_errors_are_raised_on_every_rank_before_any_collective():
    model, inputs = H.build(KIND)
    plans = {
        "mesh 2x2": autopar.layouts.megatron(model, inputs, autopar.Cluster.local(4), tp=2, dp=2),
        "mesh 4": autopar.layouts.megatron(model, inputs, autopar.Cluster.local(4), tp=4),
        "megatron": autopar.layouts.megatron(model, inputs, autopar.Cluster.local(WORLD), tp=WORLD),
    }
    results = spawn(errors_worker, WORLD, plans, timeout=120)
    with torch.no_grad():
        ref_loss = H.loss_of(model(**inputs)).item()
    for rank, out in enumerate(results):
        where = f"rank {rank}"
        assert out["mesh 2x2"].startswith("ValueError") and "2 × 2 = 4 ≠ world size 2" in out["mesh 2x2"], (
            where
        )
        assert out["mesh 4"].startswith("ValueError") and "= 4" in out["mesh 4"], where
        assert "≠ world size 2" in out["mesh 4"], (where, out["mesh 4"])
        assert out["cluster of 4"].startswith("ValueError") and "4 devices" in out["cluster of 4"], where
        assert "2 ranks" in out["cluster of 4"], (where, out["cluster of 4"])
        # Planning runs on rank 0 only; its failure reaches every rank.
        assert out["planning fails"].startswith("RuntimeError: planning failed on rank 0"), (where, out)
        msg = out["batch shape"]
        assert msg.startswith("ValueError") and "'input_ids'" in msg, (where, msg)
        assert f"({H.BATCH}, {H.SEQ // 2})" in msg and f"({H.BATCH}, {H.SEQ})" in msg, (where, msg)
        assert out["collectives during the bad call"] == {}, where
        assert abs(out["loss after errors"] - ref_loss) <= 1e-5 * ref_loss, where


# ------------------------------------------------------------------ one rank's error, caught


CAUGHT_TIMEOUT = 60.0
"""Collective timeout of the module in the caught-error test: a peer left waiting in a collective
would wait this long, far past the bound the test asserts."""


def caught_error_worker(rank: int, world: int, local: bool) -> tuple[str, float]:
    """Rank 1 is given a batch of the wrong shape, catches autopar's error and blocks (as user code
    that carries on into its own barrier or sleep would); rank 0 steps on and must be stopped at
    once with rank 1's error."""
    H.quiet()
    cluster = autopar.Cluster.local(world)
    model, inputs = H.build("gpt")
    fixed = {n: ("R",) for n, _ in model.named_parameters()}
    plan = autopar.plan(model, inputs, cluster, fixed=fixed, mesh_shape=(world,))
    pm = autopar.parallelize(model, cluster, inputs, plan=plan, timeout=CAUGHT_TIMEOUT, local_inputs=local)
    batch = tuple(pm.shard_inputs(*inputs).values()) if local else inputs
    H.loss_of(H.call(pm, batch)).backward()  # one good step
    t0 = time.perf_counter()
    try:
        if rank == 1:
            H.loss_of(H.call(pm, (batch[0][:, :-1], batch[1]))).backward()
        else:
            for _ in range(20):
                H.loss_of(H.call(pm, batch)).backward()
    except Exception as exc:  # the test reads each rank's error and how long it took
        msg, took = f"{type(exc).__name__}: {exc}", time.perf_counter() - t0
    else:
        msg, took = "no error", time.perf_counter() - t0
    if rank == 1:
        time.sleep(8)  # caught, and blocked elsewhere: rank 0 must not wait for it
    return msg, took


@pytest.mark.distributed
@pytest.mark.timeout(150)
@pytest.mark.parametrize("local", [False, True], ids=["global batch", "local shards"])
def test_an_error_caught_on_one_rank_releases_the_other_at_once(local):
    (msg0, took0), (msg1, _) = spawn(caught_error_worker, WORLD, local, timeout=120)
    assert msg1.startswith("ValueError") and "shape" in msg1, msg1
    assert msg0.startswith("CollectiveFailure"), msg0
    assert "rank(s) [1] refused their inputs (rank 1: ValueError" in msg0 and "shape" in msg0, msg0
    assert took0 < 5.0, took0  # not the collective timeout (60 s): rank 1's error reached rank 0 at once

"""Mistakes are reported before any collective runs, on every rank, so nothing hangs: each
distributed case runs on 2 gloo processes under a spawn timeout, and after the errors the process
group still works (a barrier and a training step)."""

from __future__ import annotations

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

"""Hybrid sharding (HSDP, ``layouts.fsdp(replicate=k)``): parameters sharded inside each of ``k``
groups and replicated across them, the batch split over all, the gradient reduced in two levels
(reduce-scatter inside a group, all-reduce across); on 4 gloo processes as 2 groups of 2 it trains
like one process."""

from __future__ import annotations

import pytest

import autopar


def test_hsdp_shards_inside_groups_and_replicates_across_them():
    from _runtime_helpers import build

    model, inputs = build("gpt")
    plan = autopar.layouts.fsdp(model, inputs, autopar.Cluster.local(4), replicate=2)
    assert plan.mesh_shape == (2, 2) and plan.info["layout"] == "hsdp(replicate=2, shard=2)"
    specs = plan.param_placements()
    assert specs["blocks.0.fc.weight"] == ("R", "S(0)")
    assert set(plan.zero_stages().values()) == {3}
    # The batch is split over both axes: nothing is computed twice.
    assert plan.info["audit"]["lines"] and "replicated work dp0 0.0 %, dp1 0.0 %" in plan.summary()
    # Both levels communicate: gathers and reduce-scatters inside a group, the all-reduce across.
    assert all(b > 0 for b in plan.predicted.comm_bytes_per_axis)
    with pytest.raises(
        ValueError, match=r"fsdp\(replicate=3\): the replica groups must divide the 4 devices"
    ):
        autopar.layouts.fsdp(model, inputs, autopar.Cluster.local(4), replicate=3)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_hsdp_on_two_groups_of_two_trains_like_one_process():
    from _runtime_helpers import build, compare_training, reference, train_worker

    from autopar.runtime.launch import spawn

    model, inputs = build("gpt")
    plan = autopar.layouts.fsdp(model, inputs, autopar.Cluster.local(4), replicate=2)
    out = spawn(train_worker, 4, plan, "sgd")
    ref = reference("gpt", "sgd")
    for r, got in enumerate(out):
        problems = compare_training(ref, (got["losses"], got["state"]), "sgd", f"hsdp rank {r}")
        assert not problems, "\n".join(problems)


def test_the_simulated_parts_of_a_zero3_step_add_up_to_it():
    """A ZeRO-3 plan's forward waits for its weights' gathers over a slow link: the summary names
    that wait, so the simulated step's parts add up to the predicted step."""
    import re
    from dataclasses import replace

    from _runtime_helpers import build

    from autopar.devices import Link

    model, inputs = build("gpt", batch=8)
    c = autopar.Cluster.local(4)
    slow = replace(c, gpus_per_node=2, nodes=2, nics_per_node=1, overlap_comm=True,
                   inter_node=Link(name="slow", bandwidth=5e6, latency=1e-4))  # fmt: skip
    plan = autopar.layouts.fsdp(model, inputs, slow)
    line = next(x for x in plan.summary().splitlines() if "simulated step" in x)
    assert "waiting on parameter gathers" in line
    units = {"s": 1.0, "ms": 1e-3, "µs": 1e-6}
    parts = [float(v) * units[u] for v, u in re.findall(r" ([\d.]+) (s|ms|µs)\b", line)]
    assert sum(parts) == pytest.approx(plan.predicted.step_time, rel=0.01), line

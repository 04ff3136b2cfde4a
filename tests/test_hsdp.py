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

"""Two-level gradient all-reduce (``autopar.cost.comm.two_level_all_reduce_cost``, ``Plan.two_level``,
``passes.two_level``): priced, chosen only where it beats the one collective, recorded in the plan,
and run on 4 gloo processes as two nodes of two (every case in one spawn) — training like one
process, with and without micro-batches (the reduction deferred to the last one)."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

import autopar
from autopar.cost import comm
from autopar.devices import Link
from autopar.mesh import Mesh
from autopar.planfile import Plan

sys.path.insert(0, str(Path(__file__).parent))


BATCH = 8


def _two_nodes(world: int = 4, nic: float = 1e9) -> autopar.Cluster:
    """The local cluster as two nodes of ``world / 2`` devices on a 20 GB/s link, joined by one
    NIC each of ``nic`` bytes/s."""
    c = autopar.Cluster.local(world)
    node = Link(name="node", bandwidth=20e9, latency=1e-5)
    slow = Link(name="NIC", bandwidth=nic, latency=1e-5)
    return replace(c, gpus_per_node=world // 2, nodes=2, intra_node=node, inter_node=slow, nics_per_node=1)


def _dp_plan(cluster: autopar.Cluster, microbatches: int = 1, compression: str | None = None) -> Plan:
    """The small GPT data-parallel over ``cluster``: weights replicated, the batch split."""
    from _runtime_helpers import build, input_paths

    model, inputs = build("gpt", batch=BATCH)
    fixed = {n: ("R",) for n, _ in model.named_parameters()} | {p: ("S(0)",) for p in input_paths(inputs)}
    return autopar.plan(
        model, inputs, cluster, mesh_shape=(cluster.world_size,), fixed=fixed, pp=1,
        microbatches=microbatches, recompute="none", compression=compression,
    )  # fmt: skip


def test_the_two_levels_priced_by_hand():
    nvlink = Link(name="nvlink", bandwidth=450e9, latency=0.0)
    nic = Link(name="nic", bandwidth=50e9, latency=0.0)
    S = 1e9
    # Two nodes of 8, one NIC each (a cloud instance): a node sends 2(N-1)/N·S = S over its NIC in
    # two levels, 2(n-1)/n·S = 1.875 S as one ring; the on-node parts cost 2·(7/8)·S over NVLink.
    g = comm.Group(per_node=8, nodes=2, intra=nvlink, inter=nic, nics=1)
    flat = comm.group_all_reduce_cost(S, g)
    two = comm.two_level_all_reduce_cost(S, g)
    assert flat == pytest.approx(2 * 15 / 16 * S / 50e9)
    assert two == pytest.approx(2 * 7 / 8 * S / 450e9 + 2 * 1 / 2 * (S / 8) / (50e9 / 8))
    assert comm.two_level_pays(g) and two < flat / 1.5
    # A DGX node's eight NICs carry the ring at NVLink's pace: the one collective is faster.
    dgx = replace(g, nics=8)
    assert not comm.two_level_pays(dgx)
    assert comm.two_level_all_reduce_cost(S, dgx) > comm.group_all_reduce_cost(S, dgx)
    # One node, or one member per node: nothing to split.
    assert not comm.two_level_pays(replace(g, nodes=1))
    assert not comm.two_level_pays(replace(g, per_node=1))
    assert comm.two_level_all_reduce_cost(S, replace(g, per_node=1)) == comm.group_all_reduce_cost(
        S, replace(g, per_node=1)
    )


def test_a_mesh_reduces_in_two_levels_only_where_it_pays_and_its_groups_are_even():
    eth = autopar.Cluster.preset("H100-SXM", nodes=2, network="ethernet-400g")
    ib = autopar.Cluster.preset("H100-SXM", nodes=2)
    assert Mesh.full((16,), eth).two_level(0)
    assert not Mesh.full((16,), ib).two_level(0)
    # dp across nodes with tp = 8 inside: one member per node, nothing to split.
    assert not Mesh.full((2, 8), eth).two_level(0)
    # A gradient all-reduce over both axes of (4, 4): 8 members on each node, split.
    assert Mesh.full((4, 4), eth).two_level((0, 1))
    # Bucketed gradient all-reduces are priced in two levels there, other all-reduces are not.
    m = Mesh.full((16,), eth)
    one = m.all_reduce_cost(1e9, 0, bucketed=True)
    assert m.all_reduce_cost(1e9, 0, bucketed=True, two_level=True) < one / 1.5
    # A group of 3 on nodes of 2 has 2 members on one node and 1 on the other: not split.
    assert not replace(eth, gpus_per_node=2, nodes=2).even_span((1, 3), (1,))
    assert replace(eth, gpus_per_node=2, nodes=2).even_span((4,), (0,))


def test_the_plan_records_two_levels_and_prices_them():
    cluster = _two_nodes()
    plan = _dp_plan(cluster)
    assert plan.mesh_axes == ("dp",) and plan.two_level == ((0,),)
    assert Plan.from_dict(plan.to_dict()).two_level == ((0,),)
    assert "gradient all-reduce over dp in two levels" in plan.summary()
    # The cluster can hold it to one collective (a backend that does this itself).
    assert _dp_plan(replace(cluster, two_level=False)).two_level == ()
    # The same plan on nodes whose NICs keep up with the node's link: one collective.
    fast = replace(cluster, inter_node=replace(cluster.inter_node, bandwidth=20e9), nics_per_node=2)
    flat = _dp_plan(fast)
    assert flat.two_level == ()
    # The plan's communication is its weights' gradients reduced in two levels, not in one ring
    # (a tied weight's two gradients are summed first and reduced once), and the loss's
    # all-reduce (the program returns it whole).
    from _runtime_helpers import build

    from autopar.cost.reshard_cost import scalar_output_cost
    from autopar.placement import parse_spec

    model, _ = build("gpt", batch=BATCH)
    grads = sum(p.numel() * 4 for p in model.parameters())
    g = Mesh.full((4,), cluster).group(0).without_latency()
    two, one = comm.two_level_all_reduce_cost(grads, g), comm.group_all_reduce_cost(grads, g)
    loss = next(n for n in plan.nodes if n.op == "cross_entropy_loss")
    assert loss.outputs == (("P",),)
    returned = scalar_output_cost(4, parse_spec(loss.outputs[0]), Mesh.full((4,), cluster))
    assert plan.predicted.comm_time == pytest.approx(two + returned, rel=0.05) and two < one / 1.3
    assert flat.two_level == ()
    # The plan file names only mesh axes.
    bad = plan.to_dict() | {"two_level": [[1]]}
    with pytest.raises(ValueError, match="two_level"):
        Plan.from_dict(bad)


def _worker(rank: int, world: int, plan: Any, optimizer: str) -> dict[str, Any]:
    import warnings

    from _runtime_helpers import build, make_optimizer, train

    from autopar.ir import TWO_LEVEL

    warnings.simplefilter("ignore")
    model, inputs = build("gpt", batch=BATCH)
    pm = autopar.parallelize(model, autopar.Cluster.local(world), inputs, plan=plan)
    losses = train(pm, inputs, make_optimizer(optimizer, pm.parameters()))
    graphs = [pm.step.backward] if pm.step is not None else []
    local = []  # the micro-batches before the last: their gradients are summed, not reduced
    if pm.pipeline is not None:
        for s in pm.pipeline.steps.values():
            graphs.append(s.backward_weight)
            local += [s.backward_weight_local] if s.backward_weight_local is not None else []
    heads = sum(1 for g in graphs for n in g.graph.nodes if n.meta.get(TWO_LEVEL))
    early = sum(1 for g in local for n in g.graph.nodes if "c10d_functional" in str(n.target))
    levels = pm.axes[0].levels
    return {
        "losses": losses,
        "state": pm.full_state_dict(),
        "heads": heads,
        "early": early,
        "deferred": len(local),
        "levels": None if levels is None else [lv.size for lv in levels],
    }


def _reference() -> tuple[list[float], dict[str, Any]]:
    """One process's SGD losses and final state on the same model and batch."""
    from _runtime_helpers import build, make_optimizer, train

    model, inputs = build("gpt", batch=BATCH)
    losses = train(model, inputs, make_optimizer("sgd", model.parameters()))
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.distributed
@pytest.mark.timeout(560)
@pytest.mark.parametrize(("microbatches", "compression"), [(2, None), (1, "bf16")])
def test_two_level_reduction_on_two_nodes_of_two_trains_like_one_process(microbatches, compression, runs):
    from _runtime_helpers import compare_training

    plans, results = runs
    plan = plans[f"dp {microbatches} {compression}"]
    assert plan.two_level == ((0,),) and getattr(plan.compression, "method", None) == compression
    out = [r[f"dp {microbatches} {compression}"] for r in results]
    ref = _reference()
    losses = ref[0]
    for r, got in enumerate(out):
        assert got["levels"] == [2, 2], got["levels"]
        assert got["heads"] > 0, f"rank {r}: no two-level reduction in its program"
        # Under micro-batches the reduction is deferred to the last: the others communicate nothing.
        assert got["deferred"] == (microbatches > 1) and got["early"] == 0, (got["deferred"], got["early"])
        if compression is not None:  # bf16 gradients: the losses follow within bf16's rounding
            assert got["losses"] == pytest.approx(losses, rel=1e-3), (got["losses"], losses)
            continue
        problems = compare_training(ref, (got["losses"], got["state"]), "sgd", f"two-level rank {r}")
        assert not problems, "\n".join(problems)


def test_reduce_scatters_and_all_gathers_in_two_levels_priced_by_hand():
    """On each node then across (a reduce-scatter), across then on each node (an all-gather): a
    node sends ``(N−1)/N · S/p`` per member over its NIC, not ``(n−1)/n · S``."""
    nvlink = Link(name="nvlink", bandwidth=450e9, latency=0.0)
    nic = Link(name="nic", bandwidth=50e9, latency=0.0)
    S = 1e9
    g = comm.Group(per_node=8, nodes=2, intra=nvlink, inter=nic, nics=1)
    for two, flat in (
        (comm.two_level_reduce_scatter_cost(S, g), comm.group_reduce_scatter_cost(S, g)),
        (comm.two_level_all_gather_cost(S, g), comm.group_all_gather_cost(S, g)),
    ):
        assert flat == pytest.approx(15 / 16 * S / 50e9)
        assert two == pytest.approx(7 / 8 * S / 450e9 + 1 / 2 * (S / 8) / (50e9 / 8))
        assert two < flat / 1.5
    # A mesh prices its reduce-scatters and all-gathers so where its gradient reductions run in
    # two levels, with the device copy that reorders the pieces; not otherwise.
    eth = autopar.Cluster.preset("H100-SXM", nodes=2, network="ethernet-400g")
    m = Mesh.full((16,), eth)
    assert m.two_level(0)
    copy = 2 * S / eth.device.achieved_bandwidth + eth.device.kernel_overhead
    assert m.reduce_scatter_cost(S, 0) == pytest.approx(
        comm.two_level_reduce_scatter_cost(S, m.group(0)) + copy
    )
    assert m.all_gather_cost(S, 0) == pytest.approx(comm.two_level_all_gather_cost(S, m.group(0)) + copy)
    assert m.all_gather_cost(S, 0, two_level=False) == pytest.approx(
        comm.group_all_gather_cost(S, m.group(0))
    )
    assert m.reduce_scatter_cost(S, 0) < m.reduce_scatter_cost(S, 0, two_level=False) / 1.5
    ib = Mesh.full((16,), autopar.Cluster.preset("H100-SXM", nodes=2))
    assert ib.reduce_scatter_cost(S, 0) == ib.reduce_scatter_cost(S, 0, two_level=False)


def _zero_plan(cluster: autopar.Cluster, zero_stage: int) -> Plan:
    """The small GPT data-parallel over ``cluster`` with its weights stored sharded (ZeRO): each
    gathered for use, its gradient reduce-scattered."""
    from _runtime_helpers import build, input_paths

    model, inputs = build("gpt", batch=BATCH)
    n = cluster.world_size
    fixed = {k: ("S(0)",) for k, p in model.named_parameters() if p.shape[0] % n == 0}
    fixed |= {p: ("S(0)",) for p in input_paths(inputs)}
    return autopar.plan(
        model, inputs, cluster, mesh_shape=(n,), fixed=fixed, pp=1, microbatches=1, recompute="none",
        zero_stage=zero_stage,
    )  # fmt: skip


def test_a_zero_plan_gathers_and_scatters_in_two_levels_where_that_pays():
    cluster = _two_nodes()
    plan = _zero_plan(cluster, 3)
    assert plan.two_level == ((0,),) and set(plan.zero_stages().values()) == {3}
    assert any(c.startswith("all_gather") for r in plan.reshards for c in r.collectives)
    assert "reduce-scatters and all-gathers" in plan.summary()
    # Held to one collective each on the same cluster, its gathers and scatters are predicted slower.
    ring = _zero_plan(replace(cluster, two_level=False), 3)
    assert ring.two_level == () and set(ring.zero_stages().values()) == {3}
    assert plan.predicted.comm_time < ring.predicted.comm_time / 1.2
    # On nodes whose NICs keep up with the node's link the same plan gathers in one collective.
    fast = replace(cluster, inter_node=replace(cluster.inter_node, bandwidth=20e9), nics_per_node=2)
    assert _zero_plan(fast, 3).two_level == ()


def _zero_worker(rank: int, world: int, plan: Any) -> dict[str, Any]:
    import warnings

    from _runtime_helpers import build, make_optimizer, train

    warnings.simplefilter("ignore")
    model, inputs = build("gpt", batch=BATCH)
    pm = autopar.parallelize(model, autopar.Cluster.local(world), inputs, plan=plan)
    losses = train(pm, inputs, make_optimizer("sgd", pm.parameters()))
    inside, across = pm.axes[0].levels
    by_group: dict[str, int] = {}
    for g in (pm.step.forward, pm.step.backward):
        for n in g.graph.nodes:
            if n.op == "call_function" and (
                "reduce_scatter" in str(n.target) or "all_gather" in str(n.target)
            ):
                group = n.args[-1]
                by_group[group] = by_group.get(group, 0) + 1
    return {
        "losses": losses,
        "state": pm.full_state_dict(),
        "inside": by_group.get(inside.group_name, 0),
        "across": by_group.get(across.group_name, 0),
        "whole": by_group.get(pm.axes[0].group_name, 0),
    }


def _cases_worker(rank: int, world: int, plans: dict[str, Plan]) -> dict[str, dict[str, Any]]:
    """Every case of ``runs`` in one process group: ZeRO plans by ``_zero_worker``, the others by
    ``_worker`` (SGD)."""
    return {
        case: _zero_worker(rank, world, plan)
        if case.startswith("zero")
        else _worker(rank, world, plan, "sgd")
        for case, plan in plans.items()
    }


@pytest.fixture(scope="module")
def runs() -> tuple[dict[str, Plan], list[dict[str, dict[str, Any]]]]:
    """``(plans by case, results by rank)``: the data-parallel plans (2 micro-batches; bf16
    compression) and the ZeRO-3 and ZeRO-2 plans on two nodes of two, trained in one spawn
    (starting 4 processes costs seconds; a plan's training a fraction of that)."""
    from autopar.runtime.launch import spawn

    cluster = _two_nodes()
    plans = {
        "dp 2 None": _dp_plan(cluster, 2, None),
        "dp 1 bf16": _dp_plan(cluster, 1, "bf16"),
        "zero 3": _zero_plan(cluster, 3),
        "zero 2": _zero_plan(cluster, 2),
    }
    return plans, spawn(_cases_worker, 4, plans, timeout=480)


@pytest.mark.distributed
@pytest.mark.timeout(560)
@pytest.mark.parametrize("zero_stage", [3, 2])
def test_two_level_gathers_and_scatters_on_two_nodes_of_two_train_like_one_process(zero_stage, runs):
    from _runtime_helpers import compare_training

    plans, results = runs
    assert plans[f"zero {zero_stage}"].two_level == ((0,),)
    out = [r[f"zero {zero_stage}"] for r in results]
    ref = _reference()
    for r, got in enumerate(out):
        # Every gather and scatter over dp runs as its two levels: none over the whole group.
        assert got["across"] > 0 and got["inside"] >= got["across"] and got["whole"] == 0, got
        problems = compare_training(
            ref, (got["losses"], got["state"]), "sgd", f"two-level ZeRO-{zero_stage} rank {r}"
        )
        assert not problems, "\n".join(problems)


def test_a_scatter_waited_twice_is_rewritten_and_one_with_another_user_is_named(caplog):
    """``passes.two_level``: a reduce-scatter over a two-level group waited for twice becomes the
    two levels (the later wait reads the first); an all-gather whose issue has a user other than
    its wait stays one collective — priced in two levels by the plan, so the pass warns, naming it."""
    import logging
    from types import SimpleNamespace

    import torch
    from torch.fx import Graph, GraphModule

    from autopar.ir import RANK
    from autopar.passes.two_level import two_level_reduce

    fc, aten = torch.ops._c10d_functional, torch.ops.aten
    g = Graph()

    def node(target: Any, args: tuple, val: torch.Tensor) -> Any:
        n = g.call_function(target, args)
        n.meta["val"] = val
        return n

    x = g.placeholder("x")
    x.meta["val"] = torch.empty(8)
    rs = node(fc.reduce_scatter_tensor.default, (x, "sum", 4, "whole"), torch.empty(2))
    first = node(fc.wait_tensor.default, (rs,), torch.empty(2))
    doubled = node(aten.mul.Tensor, (first, 2), torch.empty(2))
    second = node(fc.wait_tensor.default, (rs,), torch.empty(2))
    summed = node(aten.add.Tensor, (doubled, second), torch.empty(2))
    ag = node(fc.all_gather_into_tensor.default, (x, 4, "whole"), torch.empty(32))
    copied = node(aten.clone.default, (ag,), torch.empty(32))
    gathered = node(fc.wait_tensor.default, (ag,), torch.empty(32))
    g.output((summed, gathered, copied))
    gm = GraphModule(torch.nn.Module(), g)
    gm.meta[RANK] = SimpleNamespace(two_level={"whole": ("inside", 2, "across")})
    with caplog.at_level(logging.WARNING, logger="autopar.passes"):
        two_level_reduce(gm, None)
    scatters = [n.args[3] for n in gm.graph.nodes if n.target is fc.reduce_scatter_tensor.default]
    assert scatters == ["inside", "across"], scatters
    reshaped = summed.args[1]
    assert reshaped.target is aten.reshape.default and summed.args[0].args[0] is reshaped, gm.code
    gathers = [n.args[2] for n in gm.graph.nodes if n.target is fc.all_gather_into_tensor.default]
    assert gathers == ["whole"], gathers
    assert "run as one collective" in caplog.text and ag.name in caplog.text, caplog.text

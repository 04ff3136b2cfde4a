"""Mixed clusters (``Cluster.mixed``, ``Cluster.node_groups``): node groups of different device
kinds, validated, described and saved; ranks in lockstep held to the floor device; pipeline ranks
on their own devices, the cut balancing each stage's time on its rank (a faster group gets more
layers), each rank's memory budget its own; a saved plan replays to the step it was planned
with; and on 4 gloo processes (2 "nodes" of 2, the second 4× faster) the unequal cut trains like
one process."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import replace
from typing import Any

import pytest
import torch

import autopar
from autopar.cluster import Cluster, NodeGroup
from autopar.simulate import simulate

pytestmark = pytest.mark.filterwarnings("ignore:autopar")


def test_a_mixed_cluster_is_validated_described_and_saved():
    c = Cluster.mixed([("A100-80GB", 2), ("H100-SXM", 1)])
    assert (c.nodes, c.world_size, c.mixed_kinds) == (3, 24, True)
    # In lockstep every rank is held to the floor: the slowest device, the slowest NVLink and NIC.
    assert c.device.name.startswith("A100-80GB (floor") and c.device.flops_for("bfloat16") == 312e12
    assert (c.intra_node.name, c.inter_node.name) == ("NVLink3", "IB-HDR")
    assert c.speed_spread == pytest.approx(989 / 312)  # H100 over A100, large bf16 matmuls
    assert c.group_of_rank(15).device.name == "A100-80GB" and c.group_of_rank(16).device.name == "H100-SXM"
    h = c.part(16, 8)
    assert (h.device.name, h.intra_node.name, h.node_groups, h.world_size) == ("H100-SXM", "NVLink4", (), 8)
    assert c.part(8, 16).device.name.startswith("A100-80GB (floor")  # spans both kinds
    assert Cluster.from_dict(c.to_dict()) == c
    assert "2 × 8 A100-80GB + 1 × 8 H100-SXM nodes" in c.describe()
    assert c.uniform("H100-SXM").device.name == "H100-SXM" and not c.uniform().node_groups
    # The floor's memory is the smallest of any kind's, whichever is slower.
    small = Cluster.mixed([("H100-SXM", 1), ("A100-40GB", 1)], network="ethernet-400g")
    assert small.device.memory == 40 * 2**30 and small.nics == 1
    # A kind measured (a Cluster, e.g. from a calibration profile) joins as it was measured.
    measured = Cluster.preset("A100-80GB").with_device(name="A100-measured", compute_efficiency=0.6)
    m = Cluster.mixed([(measured, 1), ("H100-SXM", 1)])
    assert m.group_of_rank(0).device.compute_efficiency == 0.6 and m.device.name.startswith("A100-measured")
    # On the command line: KIND:NODES,… (a kind a preset or a profile JSON).
    import argparse

    from autopar.commands.loading import build_cluster

    args = argparse.Namespace(cluster="A100-80GB:2,H100-SXM:1", nodes=1, gpus_per_node=8)
    assert build_cluster(args) == c
    with pytest.raises(ValueError, match="--nodes 2, but the node groups of --cluster"):
        build_cluster(argparse.Namespace(cluster="A100-80GB:2,H100-SXM:1", nodes=2, gpus_per_node=8))
    with pytest.raises(ValueError, match="a mixed cluster is KIND:NODES"):
        build_cluster(argparse.Namespace(cluster="A100-80GB:two", nodes=1, gpus_per_node=8))
    with pytest.raises(ValueError, match=r"node_groups hold 2 \+ 1 = 3 nodes but the cluster has nodes=4"):
        replace(c, nodes=4)
    with pytest.raises(ValueError, match="unknown cluster preset 'B300'"):
        Cluster.mixed([("B300", 1)])
    with pytest.raises(ValueError, match="do not lie within one node of 8"):
        c.part(4, 8)


def test_the_cut_balances_each_stage_on_its_own_devices():
    """``stage_cuts(stage_time=…)``: a node's time depends on the stage it lands in; a second stage
    three times as fast takes more of the model than the even cut gives it, and the two stages'
    times, each on its own devices, end closer than the even cut's."""
    from autopar.ir import COST
    from autopar.models import GPT, GPTConfig
    from autopar.passes import PassContext, run_passes
    from autopar.passes.annotate import annotate_cost, annotate_tensors
    from autopar.passes.stages import stage_cuts

    model = GPT(GPTConfig.tiny(n_layer=6, n_head=4, n_embd=32, vocab_size=64))
    ids = torch.randint(0, 64, (4, 16))
    cap = autopar.capture(model, (ids, ids.clone()))
    ctx = PassContext(captured=cap, cluster=Cluster.local(2), config=autopar.PlanConfig())
    gm = run_passes(cap.gm, ctx, [annotate_tensors, annotate_cost])
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]

    def t(n: Any) -> float:
        c = n.meta.get(COST)
        return float(c.fwd_time + c.bwd_time) if c is not None else 0.0

    def on(n: Any, k: int) -> float:
        return t(n) / (3.0 if k == 1 else 1.0)

    even, fast = stage_cuts(gm, 2, t), stage_cuts(gm, 2, t, stage_time=on)
    first = [sum(1 for n in nodes if cut[n.name] == 0) for cut in (even, fast)]
    assert first[1] < first[0], first

    def spread(cut: dict[str, int]) -> float:
        per = [sum(on(n, k) for n in nodes if cut[n.name] == k) for k in (0, 1)]
        return max(per) / min(per)

    assert spread(fast) < spread(even)


def _meta_gpt(layers: int = 8) -> tuple[torch.nn.Module, Any]:
    from autopar.models import GPT, GPTConfig

    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=layers, n_head=8, n_embd=1024, vocab_size=8192, block_size=1024))
        model = model.to(torch.bfloat16)
    ids = torch.empty(32, 1024, dtype=torch.long, device="meta")
    return model, (ids, ids.clone())


def _layers_per_rank(plan: Any) -> list[int]:
    pipe = plan.pipeline
    first: dict[str, int] = {}
    for n in plan.nodes:
        parts = n.module.split(".")
        if len(parts) > 1 and parts[0] == "blocks" and n.name in pipe.stage_of:
            first.setdefault(parts[1], pipe.stage_of[n.name] % pipe.pp)
    per = Counter(first.values())
    return [per[r] for r in range(pipe.pp)]


def test_pipeline_ranks_run_on_their_own_devices_and_the_faster_gets_more_layers():
    model, inputs = _meta_gpt()
    mixed = Cluster.mixed([("A100-80GB", 1), ("H100-SXM", 1)])
    plan = autopar.plan(model, inputs, mixed, pp=2, microbatches=4, schedule="1f1b")
    held = _layers_per_rank(plan)
    assert held[1] > held[0] and sum(held) == 8, held
    assert "ranks on A100-80GB, H100-SXM" in plan.summary()
    # Each rank busy about as long: the balanced cut, not equal layers.
    costs = plan.pipeline.stage_costs
    busy = [c["forward"] + c["backward_input"] + c["backward_weight"] for c in costs]
    assert max(busy) < 1.3 * min(busy), busy
    # The plan's file replays to the step it was planned with (each rank's costs are stored).
    again = autopar.Plan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert simulate(again).step_time == pytest.approx(plan.predicted.step_time, rel=1e-9)
    # Megatron-LM's equal layers on the same cluster: the A100 rank is the slow one.
    equal = autopar.layouts.megatron(model, inputs, mixed, tp=1, pp=2, microbatches=4)
    assert _layers_per_rank(equal) == [4, 4]
    assert plan.predicted.step_time < 0.85 * equal.predicted.step_time
    # The same layout held on a uniform H100 cluster (its cut given back): the A100 rank is
    # what made it slower, and a plan in lockstep over both kinds runs at the A100's pace.
    h100 = mixed.uniform("H100-SXM")
    uniform = autopar.plan(model, inputs, h100, pp=2, microbatches=4, schedule="1f1b")
    assert _layers_per_rank(uniform)[0] >= held[0]
    one = autopar.plan(model, inputs, mixed, pp=1)
    assert one.predicted.step_time == pytest.approx(
        autopar.plan(model, inputs, mixed.uniform(), pp=1).predicted.step_time, rel=1e-6
    )
    with pytest.raises(ValueError, match="stage_of holds one pipeline's cut: give the pp and microbatches"):
        autopar.PlanConfig(stage_of=plan.pipeline.stage_of)
    # A held cut that is not this graph's says so.
    with pytest.raises(Exception, match="held cut"):
        autopar.plan(model, inputs, mixed, pp=2, microbatches=4, schedule="1f1b", stage_of={"x": 0})


def _local_mixed(speedup: float) -> Cluster:
    """4 local processes as 2 "nodes" of 2, the second ``speedup``× faster."""
    base = Cluster.local(4)
    fast = replace(
        base.device,
        name="cpu-process-fast",
        peak_flops={k: v * speedup for k, v in base.device.peak_flops.items()},
        memory_bandwidth=base.device.memory_bandwidth * speedup,
    )
    groups = (
        NodeGroup(device=base.device, nodes=1, intra_node=base.intra_node),
        NodeGroup(device=fast, nodes=1, intra_node=base.intra_node),
    )
    return replace(base, gpus_per_node=2, nodes=2, node_groups=groups)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_an_unequal_cut_on_a_mixed_cluster_trains_like_one_process():
    from _runtime_helpers import build, compare_training, reference, train_worker

    from autopar.runtime.launch import spawn

    model, inputs = build("gpt")
    plan = autopar.plan(
        model, inputs, _local_mixed(4.0), pp=2, microbatches=2, schedule="1f1b", mesh_shape=(2,)
    )
    even = autopar.plan(
        model, inputs, Cluster.local(4), pp=2, microbatches=2, schedule="1f1b", mesh_shape=(2,)
    )
    ops = Counter(plan.pipeline.stage_of.values())
    assert ops[1] > ops[0] and ops[0] < Counter(even.pipeline.stage_of.values())[0], (
        ops,
        even.pipeline.stage_of,
    )
    out = spawn(train_worker, 4, plan, "sgd")
    ref = reference("gpt", "sgd")
    for r, got in enumerate(out):
        problems = compare_training(ref, (got["losses"], got["state"]), "sgd", f"mixed rank {r}")
        assert not problems, "\n".join(problems)


def test_a_mixed_cluster_whose_device_is_not_its_floor_is_refused():
    mixed = _local_mixed(4.0)
    fast = mixed.node_groups[1].device
    with pytest.raises(ValueError, match="is not the floor of its node groups"):
        replace(mixed, device=fast)

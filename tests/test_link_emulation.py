"""Emulated nodes (``autopar.runtime.link_emulation``): the bytes a crossing collective sends out
of a node, the link's checks, and on 4 gloo processes as two nodes of 2 — only the collectives
that cross the nodes are held back, each node's NIC carries exactly the crossing bytes the plan
counts, two data-parallel groups crossing from one node share its NIC (the step takes at least
both transfers), a pipeline's transfers between the nodes go through the link, and training is
unchanged."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import autopar
from autopar.runtime.link_emulation import SLOTS, EmulatedLink, _SharedTable, emulate_nodes, node_share

pytestmark = pytest.mark.filterwarnings("ignore:autopar")


def test_node_share_is_the_ring_volume_leaving_a_node():
    world = (0, 1, 2, 3)
    assert node_share("all_reduce", 1000, world, 0, 2) == pytest.approx(2 * 3 / 4 * 1000)
    assert node_share("all_gather", 1000, world, 1, 2) == pytest.approx(3 / 4 * 1000)
    assert node_share("reduce_scatter", 1000, (0, 2), 0, 2) == pytest.approx(500)
    # An all-to-all sends each member's off-node part: 2 members × 2/4 of their buffer.
    assert node_share("all_to_all", 1000, world, 0, 2) == pytest.approx(1000)
    assert node_share("all_reduce", 1000, (0, 1), 0, 2) == 0.0  # inside node 0
    assert node_share("all_reduce", 1000, (2, 3, 4, 5), 0, 2) == 0.0  # node 0 is not in it
    assert node_share("broadcast", 1000, world, 1, 2) == 1000  # through each node once
    with pytest.raises(ValueError, match="barrier"):
        node_share("barrier", 1000, world, 0, 2)


def test_an_emulated_link_is_checked_and_refuses_what_it_cannot_slow(tmp_path):
    with pytest.raises(ValueError, match="per_node"):
        EmulatedLink(per_node=0, bandwidth=1e6, state="x")
    with pytest.raises(ValueError, match="bandwidth"):
        EmulatedLink(per_node=2, bandwidth=0.0, state="x")
    with pytest.raises(ValueError, match="state"):
        EmulatedLink(per_node=2, bandwidth=1e6, state="")
    link = EmulatedLink.create(2, 1e6, str(tmp_path))
    assert Path(link.state).stat().st_size == _SharedTable.SIZE
    assert [link.node_of(r) for r in range(5)] == [0, 0, 1, 1, 2]
    with pytest.raises(ValueError, match="traced program"):
        emulate_nodes(SimpleNamespace(pipeline=None, step=None), link)
    with pytest.raises(ValueError, match="compile"):
        emulate_nodes(SimpleNamespace(pipeline=None, step=SimpleNamespace(compiled={"forward": None})), link)
    stages = {0: SimpleNamespace(compiled={"forward": None})}
    with pytest.raises(ValueError, match="compile"):
        emulate_nodes(SimpleNamespace(pipeline=SimpleNamespace(steps=stages), step=None), link)


def test_the_shared_table_frees_slots_so_probe_runs_stay_whole(tmp_path):
    """Charges come and go by the thousand in a step: freeing a slot must keep the entries after
    it in its probe run reachable (no tombstones, no full table)."""
    link = EmulatedLink.create(2, 1e6, str(tmp_path))
    t = _SharedTable(link.state)
    keys = [k * SLOTS + 5 for k in range(1, 6)] + [6, 7]  # five collide on slot 5, then its neighbours
    for k in keys:
        t.arrive(k, 1, {0: 1e6}, 1e6, 0.0)  # each charged: one second on node 0's NIC, queued
    finishes = [t.leave(k, 1) for k in keys[:3]]
    assert finishes == sorted(finishes) and finishes[1] - finishes[0] == pytest.approx(1.0)
    for k in keys[3:]:
        assert t.leave(k, 1) > finishes[-1]  # still found after the holes before them
    for _ in range(3 * SLOTS):  # far more charges than slots, each freed: the table never fills
        t.arrive(keys[0], 2, {}, 1e6, 0.0)
        t.arrive(keys[0], 2, {}, 1e6, 0.0)
        t.leave(keys[0], 2)
        t.leave(keys[0], 2)


BANDWIDTH = 4e6
"""Bytes/s of the emulated NIC: the tiny GPT's crossing reductions take longer than its compute."""


def _model_and_inputs() -> tuple[torch.nn.Module, tuple]:
    from autopar.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig.tiny(n_layer=2, n_head=4, n_embd=64, vocab_size=256))
    g = torch.Generator().manual_seed(0)
    return model, (torch.randint(0, 256, (8, 32), generator=g), torch.randint(0, 256, (8, 32), generator=g))


def _run(rank: int, world: int, plans: dict[str, str], link: EmulatedLink, steps: int) -> dict[str, Any]:
    out = {}
    for name, text in plans.items():
        for emulated in (False, True):
            model, inputs = _model_and_inputs()
            plan = autopar.Plan.from_dict(json.loads(text))
            pm = autopar.parallelize(model, autopar.Cluster.local(world), inputs, plan=plan)
            tally = emulate_nodes(pm, link) if emulated else None
            opt = torch.optim.SGD(pm.parameters(), lr=0.1)
            losses, times = [], []
            for _ in range(steps):
                torch.distributed.barrier()
                t0 = time.perf_counter()
                loss = pm(*inputs)
                opt.zero_grad()
                loss.backward()
                opt.step()
                times.append(time.perf_counter() - t0)
                losses.append(loss.item())
            out[(name, emulated)] = {
                "losses": losses,
                "times": times,
                "tally": (dict(tally.calls), tally.node_bytes, tally.slept) if tally else None,
            }
    return out


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_two_emulated_nodes_hold_back_only_the_crossing_collectives(tmp_path):
    from autopar.runtime.launch import spawn

    world, steps = 4, 4
    model, inputs = _model_and_inputs()
    cluster = autopar.Cluster.local(world)
    batch = {"args[0]": ("S(0)",), "args[1]": ("S(0)",)}
    dp = autopar.plan(
        model, inputs, cluster, mesh_shape=(world,), pp=1,
        fixed={n: ("R",) for n, _ in model.named_parameters()} | batch,
    )  # fmt: skip
    tp2 = autopar.layouts.megatron(model, inputs, cluster, tp=2)  # (dp, tp): tp inside a node
    assert tp2.mesh_axes[-1] == "tp" and tp2.mesh_shape == (2, 2)
    pp = autopar.plan(model, inputs, cluster, pp=2, microbatches=2, schedule="1f1b", fixed=batch)
    plans = {"dp": json.dumps(dp.to_dict()), "tp2": json.dumps(tp2.to_dict()), "pp": json.dumps(pp.to_dict())}
    link = EmulatedLink.create(2, BANDWIDTH, str(tmp_path))
    res = spawn(_run, world, plans, link, steps, timeout=240)

    for name, plan in (("dp", dp), ("tp2", tp2)):
        fast, slow = res[0][(name, False)], res[0][(name, True)]
        # The link changes when the collectives finish, never what they compute.
        assert slow["losses"] == fast["losses"]
        calls, node_bytes, slept = slow["tally"]
        dp_axis = plan.mesh_axes.index("dp")
        grad_bytes = plan.predicted.comm_bytes_per_axis[dp_axis]  # the gradients' all-reduce buffer
        n = plan.mesh_shape[dp_axis]
        # Only the data-parallel reduction crosses the nodes (tp's all-reduces stay inside one).
        assert set(calls) == {"all_reduce"}
        # (to a few bytes: the loss's scalar reductions count as the plan counts them)
        assert node_bytes / steps == pytest.approx(2 * (n - 1) / n * grad_bytes, rel=1e-4)
        assert slept > 0
        # Every rank of a node sends through one NIC: in tp2 both data-parallel groups cross from
        # each node, so a step takes at least both groups' transfers.
        groups_per_node = 2 if name == "tp2" else 1  # tp2: groups {0, 2} and {1, 3}; node 0 is {0, 1}
        wire = groups_per_node * node_bytes / steps / BANDWIDTH
        step = statistics.median(max(r[(name, True)]["times"][i] for r in res) for i in range(1, steps))
        assert step >= 0.95 * wire, (name, step, wire)
    # Two stages, one per node: every transfer crosses. A rank sends one value per micro-batch (the
    # activation forward from stage 0, its gradient back from stage 1); the loss's broadcast and
    # the tied embedding's gradient sum cross too.
    assert res[0][("pp", True)]["losses"] == res[0][("pp", False)]["losses"]
    for r in range(world):
        calls, node_bytes, _ = res[r][("pp", True)]["tally"]
        assert calls == {"p2p": 2 * steps, "broadcast": steps, "all_reduce": steps}, (r, calls)


def test_a_slow_device_stretches_its_ops_and_changes_no_result():
    """``SlowDevice`` (the mixed-cluster emulation of ``examples/local_fidelity.py
    --slow-device``): the same results, and about ``factor − 1`` times the ops' own time slept."""
    from autopar.runtime.device_emulation import SlowDevice

    with pytest.raises(ValueError, match="factor must be ≥ 1"):
        SlowDevice(0.5)
    a = torch.randn(128, 128, generator=torch.Generator().manual_seed(0))

    def work() -> torch.Tensor:
        x = a
        for _ in range(50):
            x = torch.tanh(x @ a)
        return x

    want = work()
    with SlowDevice(3.0):  # the mode's first use sets up dispatch (seconds): not timed
        work()
    # Slept twice the ops' own time, so two thirds of the whole, less the debt still owed. A
    # wall-clock share: on a loaded machine (the suite runs two workers on two cores) a
    # preemption between ops lengthens the whole but not the ops, so the best of three tries.
    shares = []
    for _ in range(3):
        with SlowDevice(3.0) as slow:
            t0 = time.perf_counter()
            got = work()
            took = time.perf_counter() - t0
        assert torch.equal(got, want)
        shares.append((slow.slept + slow.debt) / took)
        if shares[-1] == pytest.approx(2 / 3, rel=0.25):
            break
    assert shares[-1] == pytest.approx(2 / 3, rel=0.25), shares

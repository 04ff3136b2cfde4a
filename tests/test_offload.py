"""Optimizer offload (``PlanConfig.offload_optimizer``): the host in the cluster, the formulas of
``autopar.cost.offload``, the search planning it where nothing fits without it, and the runtime's
``HostOffloadOptimizer`` training equal to one process on gloo (dp, ZeRO, tp and pp = 2 plans)."""

from __future__ import annotations

import warnings

import pytest
import torch

import autopar
from autopar.cluster import Cluster
from autopar.cost.memory import training_state_bytes
from autopar.cost.offload import activation_offload_exposed, host_bytes_per_param, offload_step_time
from autopar.cost.optimizer import plan_settings
from autopar.devices import HostSpec, Link
from autopar.planfile import Plan
from autopar.simulate import optimizer_shard, optimizer_time, simulate
from autopar.solver import InfeasibleError

warnings.filterwarnings("ignore", message="autopar: no sharding rule")


# ----------------------------------------------------------------------------------- unit


def test_the_host_is_validated_and_travels_with_the_cluster():
    h100 = Cluster.preset("H100-SXM", nodes=2)
    assert h100.host is not None and h100.host.link.bandwidth == pytest.approx(0.8 * 63e9)
    assert Cluster.from_dict(h100.to_dict()) == h100
    mixed = Cluster.mixed([("A100-80GB", 1), ("H100-SXM", 1)])
    assert mixed.host.name == "DGX A100 host"  # the slower host plans for both
    assert Cluster.local(4).host is None  # CPU processes: offload frees no memory, never chosen unasked
    local = Cluster.local(4, host=True)
    # a process's share of its host updates as fast as its device does
    assert local.host.optimizer_bandwidth(4) == pytest.approx(local.device.optimizer_bandwidth)
    with pytest.raises(ValueError, match="optimizer_efficiency must be in"):
        HostSpec(
            name="x",
            memory=1,
            memory_bandwidth=1.0,
            link=Link(name="l", bandwidth=1.0, latency=0),
            optimizer_efficiency=2,
        )
    with pytest.raises(ValueError, match="host must be a HostSpec"):
        Cluster(
            device=h100.device,
            gpus_per_node=1,
            intra_node=h100.intra_node,
            inter_node=h100.inter_node,
            host="big",
        )


def test_offload_arithmetic():
    bf16 = plan_settings("adamw", 2)
    # host: fp32 moments 8 + master 4 + fp32 gradient 4 + a bf16 staging buffer 2
    assert host_bytes_per_param(2, bf16) == 18
    assert host_bytes_per_param(4, plan_settings("adamw", 4)) == 16
    # the device keeps weight and gradient only: 2 + 2 of mixed precision's 16 bytes
    assert training_state_bytes(1e9, 2, mixed_precision=True, offload_optimizer=True) == 4e9
    assert training_state_bytes(1e9, 2, mixed_precision=True) == 16e9
    host = Cluster.preset("H100-SXM").host
    t = offload_step_time(1e9, 10, 2, host, 8, bf16)
    # 2 GB over PCIe Gen5 each way; the fused update's 28 bytes + 4 (the fp32 gradient) per
    # element at 1/8 of half the node's 614.4 GB/s
    assert t.to_host == pytest.approx(2e9 / (0.8 * 63e9) + 10 * 10e-6)
    assert t.to_device == t.to_host
    assert t.step == pytest.approx(1e9 * 32 / (614.4e9 * 0.5 / 8))
    assert t.total == pytest.approx(t.to_host + t.step + t.to_device)


def test_activation_copies_cost_what_does_not_fit_under_the_compute():
    link = Link(name="pcie", bandwidth=50e9, latency=10e-6)
    assert activation_offload_exposed(0.0, 1.0, link) == 0.0
    assert activation_offload_exposed(1e9, 1.0, link) == 0.0  # 20 ms of copies under 1 s of compute
    assert activation_offload_exposed(1e9, 5e-3, link) == pytest.approx(10e-6 + 1e9 / 50e9 - 5e-3)


# ------------------------------------------------------------------------------- planning


def _gpt(batch: int = 8, layers: int = 2):
    from autopar.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig.tiny(n_layer=layers, n_head=4, n_embd=64, vocab_size=256))
    ids = torch.randint(0, 256, (batch, 32))
    return model, (ids, torch.randint(0, 256, (batch, 32)))


def test_the_search_offloads_only_where_nothing_fits_without_it():
    model, inputs = _gpt()
    cluster = Cluster.local(2, host=True)
    kw = {"pp": 1, "microbatches": 1}
    on = autopar.plan(model, inputs, cluster, offload_optimizer=True, **kw)
    off = autopar.plan(model, inputs, cluster, offload_optimizer=False, **kw)
    assert on.offload_optimizer and not off.offload_optimizer
    # the state left on the device: AdamW's two fp32 moments per element less
    saved = off.predicted.memory_per_device - on.predicted.memory_per_device
    numel, _ = optimizer_shard(off)
    assert saved >= 0.9 * 8 * numel, (saved, numel)
    # and the optimizer step is the host's: the shard's copies and update (cost.offload)
    numel, tensors = optimizer_shard(on)
    host = offload_step_time(numel, tensors, 4, cluster.host, 2, plan_settings("adamw", 4))
    assert simulate(on, cluster).optimizer_time == pytest.approx(host.total)
    assert optimizer_time(on, cluster) == pytest.approx(host.total)
    # the search's floor for an offloading candidate (``refine.host_step_floor``): an even share
    from autopar.refine import host_step_floor

    assert 0 < host_step_floor(off, cluster) <= host.total * (1 + 1e-9)
    assert on.info["offload"]["host_bytes_per_device"] == pytest.approx(numel * 16)
    assert Plan.from_dict(on.to_dict()).offload_optimizer

    # One device, no recomputation (nothing else can free the state): with a budget between the
    # two, the default (None) plans without, fails, and offloads.
    cluster = Cluster.local(1, host=True)
    kw["recompute"] = "none"
    on = autopar.plan(model, inputs, cluster, offload_optimizer=True, **kw)
    off = autopar.plan(model, inputs, cluster, offload_optimizer=False, **kw)
    budget = (on.predicted.memory_per_device + off.predicted.memory_per_device) / 2
    auto = autopar.plan(model, inputs, cluster, memory_budget=budget, **kw)
    assert auto.offload_optimizer and auto.predicted.memory_per_device <= budget
    assert auto.info["offload_reason"].startswith("without it:")
    text = str(auto)
    assert "optimizer offloaded to the host" in text and "chosen because without it: no " in text, text
    # where it fits, nothing is offloaded
    assert not autopar.plan(model, inputs, cluster, **kw).offload_optimizer
    with pytest.raises(InfeasibleError):
        autopar.plan(model, inputs, cluster, memory_budget=budget, offload_optimizer=False, **kw)


def test_offload_replaces_recomputation_where_that_plays_faster():
    """The search's second look (``refine.offloaded``): where the fastest plan recomputes to fit,
    the same ``(pp, m)`` keeping every activation, with the optimizer state on the host and with
    the activations of every layer but the last on the host; the fastest wins."""
    model, inputs = _gpt(32, layers=4)
    cluster = Cluster.local(1, host=True)
    kw = {"pp": 1, "microbatches": 1, "recompute": "none", "offload_activations": 0}
    on = autopar.plan(model, inputs, cluster, offload_optimizer=True, **kw)
    off = autopar.plan(model, inputs, cluster, offload_optimizer=False, **kw)
    budget = (on.predicted.memory_per_device + off.predicted.memory_per_device) / 2
    plan = autopar.plan(model, inputs, cluster, memory_budget=budget, microbatches=1)  # pp "auto": the search
    tried = plan.info["pipeline_candidates"]
    recomputing = [c["step_time"] for c in tried if "step_time" in c and "offload_optimizer" not in c]
    optimizer = [c for c in tried if c.get("offload_optimizer")]
    activations = [c for c in tried if c.get("offload_activations")]
    assert recomputing and optimizer and activations, tried
    assert activations[0]["offload_activations"] == 3  # every layer but the last
    steps = recomputing + [
        c["step_time"] for c in optimizer + activations if "step_time" in c and "failed" not in c
    ]
    assert plan.predicted.step_time == pytest.approx(min(steps))
    assert plan.recompute == "none" and (plan.offload_optimizer or plan.offload_layers), plan
    assert "every activation fits" in plan.info["offload_reason"]
    # the user's word holds: never offloaded when told not to
    never = autopar.plan(
        model,
        inputs,
        cluster,
        memory_budget=budget,
        microbatches=1,
        offload_optimizer=False,
        offload_activations=0,
    )
    assert not never.offload_optimizer and not never.offload_layers and never.recompute != "none"


def test_offloaded_activations_leave_the_device_and_cost_the_host_link():
    """``offload_activations=k``: the first ``k`` layers' saved activations are charged to the host
    link, one layer's worth stays counted on the device (``cost.offload.ACTIVATION_WINDOW``)."""
    from autopar.simulate import stage_costs

    model, inputs = _gpt(32)
    cluster = Cluster.local(1, host=True)
    kw = {"pp": 1, "microbatches": 1, "recompute": "none", "offload_optimizer": False}
    base = autopar.plan(model, inputs, cluster, offload_activations=0, **kw)
    two = autopar.plan(model, inputs, cluster, offload_activations=2, **kw)
    assert base.offload_layers == () and two.offload_layers == ("blocks.0", "blocks.1")
    sent = sum(n.offloaded for n in two.nodes)
    per_layer = sent / 2
    assert sent > 0 and all(n.offloaded == 0 for n in base.nodes)
    # the two layers' activations leave the device but for one layer's worth
    assert base.predicted.memory_per_device - two.predicted.memory_per_device == pytest.approx(
        per_layer, rel=0.02
    )
    assert Plan.from_dict(two.to_dict()).offload_layers == two.offload_layers
    # over a slow host link, the copies the compute does not hide lengthen forward and backward
    slow = Link(name="slow", bandwidth=1e6, latency=0.0)
    fast, crawl = stage_costs(two, host_link=cluster.host.link)[0], stage_costs(two, host_link=slow)[0]
    assert crawl.forward == pytest.approx(max(fast.forward, sent / 1e6), rel=1e-6)
    with pytest.raises(ValueError, match="no host link was given"):
        stage_costs(two)


def test_the_host_link_bounds_an_activation_offloading_plan_before_it_is_solved():
    """``second_look.activation_copy_floor``: every node at its smallest offloaded strategy, out and
    back over the host link; no plan copies less, and a mesh whose floor exceeds the path cutoff
    (a better plan's step) is pruned before it is formulated, saying why."""
    import dataclasses

    from autopar.capture import capture
    from autopar.config import PlanConfig
    from autopar.planner import plan_captured
    from autopar.second_look import activation_copy_floor
    from autopar.solver import NotBetter

    model, inputs = _gpt(32)
    local = Cluster.local(2, host=True)
    slow = Link(name="slow", bandwidth=1e7, latency=1e-5)
    cluster = Cluster(**{**_fields(local), "host": dataclasses.replace(local.host, link=slow)})
    config = PlanConfig(
        pp=1, microbatches=1, recompute="none", offload_optimizer=False, offload_activations=2
    )
    cap = capture(model, inputs)
    plan = plan_captured(cap, cluster, config)
    floor = activation_copy_floor(cap.gm, cluster)  # the strategies of the plan's mesh, annotated last
    sent = sum(n.offloaded for n in plan.nodes)
    assert 0 < floor <= 2 * (1e-5 + sent / 1e7) * (1 + 1e-9), (floor, sent)
    assert plan.predicted.step_time >= floor
    assert activation_copy_floor(cap.gm, Cluster(**{**_fields(local), "host": None})) == 0.0
    with pytest.raises(NotBetter, match=r"activation copies take at least .* out and back"):
        plan_captured(cap, cluster, config, path_cutoff=floor * 0.99)
    # without offload the same cutoff prunes nothing for the copies
    kept = plan_captured(cap, cluster, config.replace(offload_activations=0), path_cutoff=floor * 0.99)
    assert kept.offload_layers == ()


def test_offload_needs_a_host_that_holds_the_state():
    model, inputs = _gpt()
    cluster = Cluster.local(2, host=True)
    with pytest.raises(ValueError, match="optimizer offload needs the cluster's host"):
        autopar.plan(model, inputs, Cluster(**{**_fields(cluster), "host": None}), offload_optimizer=True)
    small = Cluster(
        **{
            **_fields(cluster),
            "host": HostSpec(name="tiny", memory=1024, memory_bandwidth=1e9, link=cluster.host.link),
        }
    )
    with pytest.raises(InfeasibleError, match=r"host memory per node \(2 devices × .*more than the node's"):
        autopar.plan(model, inputs, small, offload_optimizer=True, pp=1, microbatches=1)


def _fields(c: Cluster) -> dict:
    import dataclasses

    return {f.name: getattr(c, f.name) for f in dataclasses.fields(c)}


def test_a_large_model_on_one_gpu_is_planned_with_its_optimizer_on_the_host():
    """ZeRO-Offload's case: a 2.7 B-parameter GPT does not fit one A100-40GB with its AdamW state
    (16 bytes a parameter: 42 GB), and does with it on the host."""
    from autopar.models import GPT, GPTConfig

    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=32, n_head=32, n_embd=2560, vocab_size=50304, block_size=2048)).to(
            torch.bfloat16
        )
    ids = torch.empty(8, 2048, dtype=torch.long, device="meta")
    cluster = Cluster.preset("A100-40GB", gpus_per_node=1)
    plan = autopar.plan(model, (ids, torch.empty_like(ids)), cluster)
    assert plan.offload_optimizer
    f = plan.info["offload"]
    n = sum(p.numel() for p in model.parameters())
    assert f["host_bytes_per_device"] == pytest.approx(18 * n, rel=0.01)
    assert plan.predicted.memory_per_device <= cluster.device.memory
    # the step pays the host's three phases, and they are what the simulator played as its optimizer
    assert plan.info["simulated"]["optimizer"] == pytest.approx(
        f["to_host"] + f["host_step"] + f["to_device"]
    )
    assert f["device_bytes_saved"] == pytest.approx(12 * n, rel=0.01)  # fp32 moments and master


# -------------------------------------------------------------------------------- runtime


def _offload_worker(rank: int, world: int, plans: list) -> list[dict]:
    from _runtime_helpers import build, call, loss_of, quiet

    from autopar.program.host_copies import to_host
    from autopar.runtime.host_optimizer import HostOffloadOptimizer

    quiet()
    torch.set_num_threads(1)
    out = []
    for what, plan in plans:
        model, inputs = build(what.split()[0])
        pm = autopar.parallelize(model, autopar.Cluster.local(world), inputs, plan=plan)
        opt = pm.optimizer(torch.optim.AdamW, lr=1e-3, eps=1e-6)
        losses = []
        for _ in range(3):
            loss = loss_of(call(pm, inputs))
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        sd = pm.state_dict(optimizer=opt)
        programs = (
            [s.joint for s in pm.pipeline.steps.values()] if pm.pipeline is not None else [pm.step.joint]
        )
        out.append(
            {
                "losses": losses,
                "state": pm.full_state_dict(),
                "host": isinstance(opt, HostOffloadOptimizer),
                "optim_keys": sum(k.startswith("optim.") for k in sd),
                # the activations sent to the host and fetched back (passes.offload_activations)
                "offloaded": sum(
                    n.target is to_host for g in programs for n in g.graph.nodes if n.op == "call_function"
                ),
            }
        )
    return out


@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_offloaded_optimizer_trains_like_one_process():
    from _runtime_helpers import build, compare_training, reference, sharded_specs

    from autopar.runtime.launch import spawn

    cluster = Cluster.local(2, host=True)
    plans = []
    for kind, how in (
        ("gpt", "dp"),
        ("llama", "zero2"),
        ("gpt2", "tp"),
        ("gpt", "pp"),
        ("llama", "act"),
        ("gpt2", "actpp"),
    ):
        model, inputs = build(kind)
        if how == "dp":
            fixed = {n: ("R",) for n, _ in model.named_parameters()}
            p = autopar.plan(model, inputs, cluster, fixed=fixed, mesh_shape=(2,), offload_optimizer=True)
        elif how == "zero2":
            p = autopar.plan(
                model, inputs, cluster, fixed=sharded_specs(model, inputs, 2), mesh_shape=(2,), zero_stage=2,
                offload_optimizer=True,
            )  # fmt: skip
        elif how == "tp":
            p = autopar.layouts.megatron(model, inputs, cluster, tp=2, offload_optimizer=True)
        elif how == "pp":
            p = autopar.plan(model, inputs, cluster, pp=2, microbatches=2, offload_optimizer=True)
            assert p.pipeline is not None and p.pipeline.pp == 2
        elif how == "act":  # activation offload of both layers, the optimizer on the host too
            fixed = {n: ("R",) for n, _ in model.named_parameters()}
            p = autopar.plan(
                model,
                inputs,
                cluster,
                fixed=fixed,
                mesh_shape=(2,),
                offload_activations=2,
                offload_optimizer=True,
            )
        else:  # the first stage's layer offloaded under a pipeline
            p = autopar.plan(
                model, inputs, cluster, pp=2, microbatches=2, offload_activations=1, offload_optimizer=True
            )
            assert p.pipeline is not None and p.pipeline.pp == 2
        assert p.offload_optimizer, how
        assert bool(p.offload_layers) == how.startswith("act"), (how, p.offload_layers)
        plans.append((f"{kind} {how}", p))
    out = spawn(_offload_worker, 2, plans)
    for k, (what, _p) in enumerate(plans):
        ref = reference(what.split()[0], "adamw")
        for r, got in enumerate(out):
            assert got[k]["host"], what
            assert got[k]["optim_keys"] > 0, what  # the checkpoint names the host state by parameter
            # every rank of the dp plan offloads; under the pipeline, the first stage's ranks
            expect = what.endswith("act") or (what.endswith("actpp") and r == 0)
            assert (got[k]["offloaded"] > 0) == expect, (what, r, got[k]["offloaded"])
            problems = compare_training(ref, (got[k]["losses"], got[k]["state"]), "adamw", f"{what} rank {r}")
            assert not problems, "\n".join(problems)

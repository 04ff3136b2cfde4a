"""Expert parallelism (issue 10): mixture-of-experts regions found by structure in transformers'
Mixtral and a plain PyTorch MoE (``examples/moe.py``), planned with the region's mode searched per
mesh axis (replicated, token-parallel, expert-parallel), the all-to-alls costed on the axis's link,
and trained on 2 and 4 gloo processes with the losses and final state of one process; the
all-to-alls each step issues are the ones the plan says."""

from __future__ import annotations

import os
import sys
import warnings

import pytest
import torch
from _runtime_helpers import CollectiveLog, compare_training, make_optimizer, train

import autopar
from autopar.mesh import Mesh
from autopar.rules.moe_regions import moe_regions
from autopar.runtime.launch import spawn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
import moe as example

V = 64


def build(name: str, seed: int = 0):
    """``(model, batch)``: transformers' Mixtral (4 experts, top-2) or the example MoE (8, top-2)."""
    os.environ["TRANSFORMERS_VERBOSITY"] = "error"
    if name == "example":
        return example.tiny(seed)
    torch.manual_seed(seed)
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=32,
        vocab_size=V, num_local_experts=4, num_experts_per_tok=2, use_cache=False,
    )  # fmt: skip
    model = MixtralForCausalLM(cfg)
    ids = torch.randint(0, V, (4, 16))
    return model, {"input_ids": ids, "labels": ids.clone()}


def _plan(name: str, layout: str, world: int) -> autopar.Plan | None:
    model, batch = build(name)
    cluster = autopar.Cluster.local(world)
    if layout == "auto":
        return None
    sizes = {x[:2]: int(x[2:]) for x in layout.split(",")}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return autopar.layouts.megatron(model, batch, cluster, **sizes)


def expected_all_to_alls(plan: autopar.Plan) -> dict[str, int]:
    """All-to-alls per training step the plan says: each grouped matmul that dispatches exchanges
    counts and rows forward and the rows' gradient backward; each that combines, its output rows
    forward and their gradient backward; each all-to-all reshard, once each way."""
    fwd = bwd = 0
    for n in plan.nodes:
        for r in n.rewrites:
            if "dispatch" in r:
                fwd, bwd = fwd + 2, bwd + 1
            if "combine" in r:
                fwd, bwd = fwd + 1, bwd + 1
    for r in plan.reshards:
        k = sum(c.startswith("all_to_all") for c in r.collectives)
        fwd, bwd = fwd + k, bwd + k
    return {"fwd": fwd, "bwd": bwd}


# ------------------------------------------------------------------------------ single process


@pytest.mark.parametrize("name", ["mixtral", "example"])
def test_moe_regions_are_found_by_structure(name):
    model, batch = build(name)
    regions = moe_regions(autopar.capture(model, batch).graph)
    assert len(regions) == 2  # one per layer
    for r in regions:
        assert len(r.experts) == 2 and r.expert_parallel  # gate/up and down grouped matmuls
        assert len(r.exits) == 1
        assert r.experts[0] in r.dispatched and r.experts[1] in r.dispatched


@pytest.mark.parametrize("name", ["mixtral", "example"])
def test_megatron_with_expert_parallelism_names_the_ep_axis(name):
    plan = _plan(name, "tp1,ep2", 2)
    assert plan.mesh_axes == ("ep",) and plan.mesh_shape == (2,)
    placed = plan.param_placements()
    experts = [f for f in placed if f.endswith(("gate_up_proj", "down_proj", "w_gate_up", "w_down"))]
    assert len(experts) == 4 and all(placed[f] == ("S(0)",) for f in experts), placed
    rewrites = [r for n in plan.nodes for r in n.rewrites if r.startswith("expert")]
    assert rewrites == ["expert_dispatch", "expert_combine"] * 2
    four = _plan(name, "tp1,ep2", 4)
    assert four.mesh_axes == ("dp", "ep") and four.mesh_shape == (2, 2)


@pytest.mark.parametrize("name", ["mixtral", "example"])
def test_expert_parallelism_on_three_mesh_axes_with_tensor_or_context_parallelism(name):
    """``megatron(tp=2, ep=2)`` and ``megatron(cp=2, ep=2)`` on 8 devices: three mesh axes, the
    experts split along ep only. The expert weights' held layout (``R, S(0), R``) used to be cut
    from their strategies (``max_strategies``), so tp = 2 × ep = 2 on 8 devices failed."""
    model, batch = build(name)
    cluster = autopar.Cluster.local(8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tp = autopar.layouts.megatron(model, batch, cluster, tp=2, ep=2)
        cp = autopar.layouts.megatron(model, batch, cluster, tp=1, ep=2, cp=2)
    assert tp.mesh_axes == ("dp", "ep", "tp") and tp.mesh_shape == (2, 2, 2)
    assert cp.mesh_axes == ("dp", "ep", "cp") and cp.mesh_shape == (2, 2, 2)
    assert "ep=2, cp=2" in cp.info["layout"]
    for plan in (tp, cp):
        placed = plan.param_placements()
        experts = [f for f in placed if f.endswith(("gate_up_proj", "down_proj", "w_gate_up", "w_down"))]
        assert experts and all(placed[f] == ("R", "S(0)", "R") for f in experts), placed
    # the batch split over the data-parallel ranks (dp and ep), the sequence over cp
    (ids,) = [n for n in cp.nodes if n.kind == "input"][:1]
    assert ids.outputs[0] == ("S(0)", "S(0)", "S(1)"), ids.outputs


def test_small_mixtral_on_8_gpus_runs_its_experts_split_not_replicated(a100x8):
    """The complaint of issue 10: a small Mixtral's 8-GPU plan replicated its router and experts."""
    model, _ = build("mixtral")
    ids = torch.randint(0, V, (64, 256))  # enough tokens that splitting pays for its collectives
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = autopar.plan(model, {"input_ids": ids, "labels": ids.clone()}, a100x8)
    for n in plan.nodes:
        if n.op in ("topk", "sort", "histc", "grouped_mm_fallback"):
            assert any(p != "R" for spec in n.outputs for p in spec), (n.name, n.outputs)


def test_expert_all_to_all_is_costed_on_its_axis_link():
    """Dispatch and combine cost all-to-alls of the rows on the ep axis: inside a node on NVLink,
    across nodes on the network (slower)."""
    from autopar.cost.moe import expert_all_to_all_cost

    cluster = autopar.Cluster.preset("H100-SXM", gpus_per_node=8, nodes=2)
    mesh = Mesh((2, 8), cluster)
    kw = dict(rows_in_bytes=64e6, rows_out_bytes=64e6, dispatch=True, combine=True, num_experts=8)
    inner, outer = expert_all_to_all_cost(mesh, 1, **kw), expert_all_to_all_cost(mesh, 0, **kw)
    assert 0 < inner < outer
    link = mesh.link(1)
    a2a = lambda nbytes: 7 * link.latency + 7 / 8 * nbytes / link.bandwidth  # noqa: E731  (n = 8)
    # counts once; rows in and rows out, each forward and backward
    assert inner == pytest.approx(a2a(8 * 8) + 2 * a2a(64e6) + 2 * a2a(64e6), rel=1e-9)


# ------------------------------------------------------------------------------ 2 and 4 processes

LAYOUTS = {
    2: {"mixtral": ("tp1,ep2", "auto"), "example": ("tp1,ep2", "auto")},
    4: {"mixtral": ("tp1,ep4", "tp2,ep2", "tp1,ep2,cp2"), "example": ("tp1,ep2", "tp1,ep4", "tp2,ep2")},
}
"""The layouts each model trains on 2 and 4 processes. On 4: experts over all four devices and
beside tensor parallelism on both models; beside data parallelism (dp = 2 × ep = 2) on the example,
beside context parallelism on Mixtral (transformers' attention; the example's plain causal SDPA
is split by sequence in ``test_context_parallel``'s models too)."""


def _reference(name: str):
    model, batch = build(name)
    losses = train(model, batch, make_optimizer("adamw", model.parameters()))
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _worker(rank: int, world: int, plans: dict[str, autopar.Plan | None]) -> dict:
    """Each ``name/layout`` of ``plans`` (made once, before the spawn) trained with AdamW."""
    warnings.simplefilter("ignore")
    cluster = autopar.Cluster.local(world)
    out = {}
    built: dict[str, tuple] = {}
    for key, plan in plans.items():
        name = key.split("/")[0]
        if name not in built:  # each model captured once, its layouts built from that
            model, batch = build(name)
            initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
            built[name] = (model, batch, initial, autopar.capture(model, batch))
        model, batch, initial, cap = built[name]
        pm = autopar.parallelize(model, cluster, batch, plan=plan, captured=cap)
        pm.load_full_state_dict(initial)
        with CollectiveLog() as log:
            losses = train(pm, batch, make_optimizer("adamw", pm.parameters()))
        a2a = {d: sum(1 for k, dd, _ in log.calls if k == "all_to_all" and dd == d) for d in ("fwd", "bwd")}
        out[key] = {
            "losses": losses,
            "state": pm.full_state_dict(),
            "captured": pm.step is not None,
            "a2a": a2a,
            "expected": expected_all_to_alls(pm.plan),
            "axes": pm.plan.mesh_axes,
        }
    return out


def _check(world: int) -> None:
    plans = {f"{n}/{lay}": _plan(n, lay, world) for n, lays in LAYOUTS[world].items() for lay in lays}
    results = spawn(_worker, world, plans, timeout=560)[0]
    problems = []
    for name in ("mixtral", "example"):
        ref = _reference(name)
        for layout in LAYOUTS[world][name]:
            r = results[f"{name}/{layout}"]
            what = f"{name}/{layout} on {world}"
            problems += compare_training(ref, (r["losses"], r["state"]), "adamw", what)
            if not r["captured"]:
                problems.append(f"{what}: the whole step was not captured")
            per_step = {d: r["a2a"][d] / 3 for d in ("fwd", "bwd")}
            if per_step != {d: float(v) for d, v in r["expected"].items()}:
                problems.append(f"{what}: all-to-alls per step {per_step}, the plan says {r['expected']}")
            if layout != "auto" and "ep" not in r["axes"]:
                problems.append(f"{what}: mesh axes {r['axes']} name no ep axis")
    assert not problems, "\n".join(problems)


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_expert_parallel_training_matches_one_process_on_2_processes():
    _check(2)


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_expert_parallel_training_matches_one_process_on_4_processes():
    _check(4)

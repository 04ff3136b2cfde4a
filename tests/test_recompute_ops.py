"""Per-activation recomputation (``recompute="ops"``, ``passes.recompute_ops``): the solver chooses,
per activation of a layer, what to keep and what to compute again in backward.

* candidates, by graph structure: SwiGLU's ``silu`` and product and RMSNorm's scaled rows in
  LLaMA, the softmax of GPT-2's eager attention; never a layer's output, never outside a layer;
* plans: under a budget between keeping everything and full recomputation, ``ops`` fits, computes
  less than ``full``, names what it recomputes, and keeps it through JSON; ``"auto"`` takes it
  where it plays faster than what it chose before (and says so);
* runs (2 gloo processes, LLaMA and GPT-2 with eager attention from ``transformers``): losses and
  parameters equal to one process, and the bytes the forward program hands backward fall by what
  the plan predicts.
"""

from __future__ import annotations

from typing import Any

import _runtime_helpers as H
import pytest
import torch

import autopar
from autopar.runtime.launch import spawn

pytestmark = pytest.mark.filterwarnings("ignore:autopar")


build = H.build


def _dp(model: torch.nn.Module, inputs: Any) -> dict[str, Any]:
    """Data parallel over 2 devices, every weight whole: plans differ only in what they recompute."""
    fixed = {n: ("R",) for n, _ in model.named_parameters()} | {k: ("S(0)",) for k in H.input_paths(inputs)}
    return {"pp": 1, "mesh_shape": (2,), "fixed": fixed}


def _plans(kind: str) -> dict[str, autopar.Plan]:
    """``none``, ``full`` and ``ops`` under a budget 40 % of the way from none's memory to full's."""
    model, inputs = build(kind)
    cluster = autopar.Cluster.local(2)
    opts = _dp(model, inputs)
    plans = {m: autopar.plan(model, inputs, cluster, recompute=m, **opts) for m in ("none", "full")}
    mem = {m: p.predicted.memory_per_device for m, p in plans.items()}
    budget = mem["none"] - 0.4 * (mem["none"] - mem["full"])
    plans["ops"] = autopar.plan(model, inputs, cluster, recompute="ops", memory_budget=budget, **opts)
    plans["ops"].info["test_budget"] = budget
    return plans


# ------------------------------------------------------------------------------ single process


def _candidates(kind: str) -> tuple[set[str], Any]:
    from autopar.capture import capture
    from autopar.passes import PassContext, run_passes
    from autopar.passes.recompute_ops import recompute_candidate
    from autopar.planner import GRAPH_PASSES

    model, inputs = build(kind)
    cap = capture(model, inputs)
    run_passes(cap.gm, PassContext(captured=cap, cluster=autopar.Cluster.local(2)), list(GRAPH_PASSES))
    return {n.name for n in cap.gm.graph.nodes if recompute_candidate(n)}, cap.gm.graph


def test_candidates_are_found_by_structure():
    from autopar.graph import op_name, outer_instance
    from autopar.ir import TENSOR

    found, graph = _candidates("llama")
    ops = {op_name(n) for n in graph.nodes if n.name in found}
    assert {"silu", "mul"} <= ops, ops  # SwiGLU's activation and product, RMSNorm's scaled rows
    for n in graph.nodes:
        if n.name not in found:
            continue
        info = n.meta[TENSOR]
        assert "*" in info.layer, n.name  # inside a repeated layer
        inst = outer_instance(info.module)
        # no reader outside its layer: a layer's output is a checkpoint, never a candidate
        assert all(outer_instance(u.meta[TENSOR].module) == inst for u in n.users if TENSOR in u.meta), n.name
    layer_outputs = [
        n
        for n in graph.nodes
        if TENSOR in n.meta
        and "*" in n.meta[TENSOR].layer
        and any(
            TENSOR in u.meta
            and outer_instance(u.meta[TENSOR].module) != outer_instance(n.meta[TENSOR].module)
            for u in n.users
        )
    ]
    assert layer_outputs and not any(n.name in found for n in layer_outputs)
    eager, graph = _candidates("gpt2-eager")
    assert "softmax" in {op_name(n) for n in graph.nodes if n.name in eager}


def test_ops_fits_between_none_and_full_and_computes_less_than_full(tmp_path):
    plans = _plans("llama")
    ops, none, full = plans["ops"], plans["none"], plans["full"]
    budget = ops.info["test_budget"]
    assert ops.recompute == "ops"
    assert ops.predicted.memory_per_device <= budget < none.predicted.memory_per_device
    assert none.predicted.compute_time < ops.predicted.compute_time < full.predicted.compute_time
    chosen = [n for n in ops.nodes if n.recomputed]
    assert chosen and all(n.memory == 0.0 for n in chosen)
    assert not any(n.recomputed for n in none.nodes + full.nodes)
    # what recomputing costs, node by node: its forward again
    kept = {n.name: n for n in none.nodes}
    extra = sum(n.compute_time - kept[n.name].compute_time for n in chosen)
    assert 0 < extra < 0.5 * sum(kept[n.name].compute_time for n in chosen)
    assert "recomputation: ops" in str(ops) and "activations per layer" in str(ops)
    path = tmp_path / "ops.json"
    ops.save(path)
    back = autopar.Plan.load(path)
    assert back.recompute == "ops" and [n.name for n in back.nodes if n.recomputed] == [
        n.name for n in chosen
    ]


def test_auto_takes_per_activation_recomputation_where_it_plays_faster():
    plans = _plans("llama")
    model, inputs = build("llama")
    budget = plans["ops"].info["test_budget"]
    auto = autopar.plan(model, inputs, autopar.Cluster.local(2), recompute="auto", memory_budget=budget,
                        **_dp(model, inputs))  # fmt: skip
    tried = auto.info["per_activation_tried"]
    assert auto.recompute == "ops", tried
    assert tried["step"] < tried["without_step"]
    assert auto.predicted.step_time == pytest.approx(plans["ops"].predicted.step_time, rel=1e-6)
    # nothing binds: auto keeps every activation and does not look again
    free = autopar.plan(model, inputs, autopar.Cluster.local(2), recompute="auto", **_dp(model, inputs))
    assert free.recompute == "none" and "per_activation_tried" not in free.info


def test_ops_is_checked():
    with pytest.raises(ValueError, match="'ops'"):
        autopar.PlanConfig(recompute="op")
    autopar.PlanConfig(recompute="ops", recompute_layers=1)


# ------------------------------------------------------------------------------ distributed


def _saved_bytes(step: Any) -> int:
    """Bytes of activations the forward program hands to backward (its outputs after the model's):
    each storage once (the views of one value several matmuls save are one tensor), the program's
    inputs (parameters a recomputed product reads again) left out."""
    out = next(n for n in reversed(step.forward.graph.nodes) if n.op == "output")
    storages = {}
    for a in out.args[0][step.num_outputs :]:
        v = a.meta.get("val") if hasattr(a, "meta") else None
        if isinstance(v, torch.Tensor) and a.op != "placeholder":
            st = v.untyped_storage()
            storages[st._cdata] = st.nbytes()
    return sum(storages.values())


def worker(rank: int, world: int, plans_by_kind: dict[str, dict[str, Any]]) -> dict[str, Any]:
    H.quiet()
    out: dict[str, Any] = {}
    for kind, plans in plans_by_kind.items():
        model, inputs = build(kind)
        initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
        for name, plan in plans.items():
            pm = autopar.parallelize(model, autopar.Cluster.local(world), inputs, plan=plan)
            pm.load_full_state_dict(initial)
            losses = H.train(pm, inputs, H.make_optimizer("adamw", pm.parameters()))
            out[f"{kind} {name}"] = {"result": (losses, pm.full_state_dict()), "saved": _saved_bytes(pm.step)}
    return out


KINDS = ("llama", "gpt2-eager")
FREED_WITHIN = {"llama": 0.05, "gpt2-eager": 0.25}
"""How close the bytes freed come to the plan's figure. GPT-2's eager attention multiplies 4-D
operands with ``torch.matmul``, which copies a non-contiguous one for its ``bmm`` and saves the
copy: bytes the planner's memory model does not count (it counts the operand), so what
recomputing the attention output's product frees there is off by up to a fifth."""


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_per_activation_recomputation_trains_exactly_and_frees_what_it_predicts():
    plans_by_kind = {k: {m: p for m, p in _plans(k).items() if m in ("none", "ops")} for k in KINDS}
    by_rank = spawn(worker, 2, plans_by_kind, timeout=540)
    problems = []
    for kind in KINDS:
        torch.manual_seed(0)
        ref_model, ref_inputs = build(kind)
        ref = (
            H.train(ref_model, ref_inputs, H.make_optimizer("adamw", ref_model.parameters())),
            {k: v.detach().clone() for k, v in ref_model.state_dict().items()},
        )
        plans = plans_by_kind[kind]
        predicted = plans["none"].predicted.memory_per_device - plans["ops"].predicted.memory_per_device
        for rank, res in enumerate(by_rank):
            for m in ("none", "ops"):
                problems += H.compare_training(
                    ref, res[f"{kind} {m}"]["result"], "adamw", f"{kind} {m} rank {rank}"
                )
            freed = res[f"{kind} none"]["saved"] - res[f"{kind} ops"]["saved"]
            if not abs(freed - predicted) <= FREED_WITHIN[kind] * predicted:
                problems.append(
                    f"{kind} rank {rank}: recomputing frees {freed} bytes, the plan predicts {predicted:.0f}"
                )
    assert not problems, "\n".join(problems)


def test_a_chain_of_unsaved_values_is_recomputed_but_never_through_a_fused_kernel():
    """LLaMA's grouped-query attention repeats the keys and values for SDPA (``repeat_kv``: a copy
    SDPA saves). Recomputing a repeated copy computes again the unsaved values it is made from: for
    the values their projection, for the keys the rotary embedding too. Where fused kernels are
    assumed (a GPU cluster) the rotary embedding is one kernel, not run again by parts: the keys'
    copy is no candidate there, the values' still is."""
    from autopar.capture import capture
    from autopar.graph import OpFamily, op_family
    from autopar.passes import PassContext, run_passes
    from autopar.passes.recompute_ops import _needed, recompute_candidate
    from autopar.planner import GRAPH_PASSES

    model, inputs = build("llama")
    for cluster, keys in (
        (autopar.Cluster.local(2), True),
        (autopar.Cluster.preset("H100-SXM", gpus_per_node=2), False),
    ):
        cap = capture(model, inputs)
        run_passes(cap.gm, PassContext(captured=cap, cluster=cluster), list(GRAPH_PASSES))
        sdpa = next(
            n for n in cap.gm.graph.nodes if n.op == "call_function" and op_family(n) is OpFamily.ATTENTION
        )
        k, v = sdpa.args[1], sdpa.args[2]
        assert recompute_candidate(v), v.name
        chain = {op_family(n) for n in _needed(v, "model.layers.0")}
        assert OpFamily.MATMUL in chain  # the value projection, computed again
        assert recompute_candidate(k) is keys, (cluster, k.name)


def test_the_second_look_solves_only_the_meshes_memory_bound():
    """Recomputing relaxes the memory constraint only: a plan keeping every activation is looked at
    again on the meshes that did not fit or reached 90 % of the budget (``second_look.bound_meshes``),
    not on those solved clear of it or cut off by time; a recomputing plan, on every mesh. And
    ``PlanConfig.meshes`` restricts a solve to the meshes it names."""
    from autopar.second_look import bound_meshes

    plan = _plans("llama")["none"]
    plan.info["meshes_tried"] = [
        {"mesh": [2], "feasible": True, "memory": 95.0},
        {"mesh": [1, 2], "feasible": True, "memory": 50.0},
        {"mesh": [2, 1], "feasible": False},
        {"mesh": [4], "feasible": False, "pruned": "slower"},
    ]
    assert bound_meshes(plan, 100.0) == ((2,), (2, 1))
    plan.recompute = "full"
    assert bound_meshes(plan, 100.0) is None
    with pytest.raises(ValueError, match="meshes must be"):
        autopar.PlanConfig(meshes=((2, 0),))
    model, inputs = build("llama")
    one = autopar.plan(model, inputs, autopar.Cluster.local(4), pp=1, meshes=((4,),), recompute="none")
    assert [t["mesh"] for t in one.info["meshes_tried"]] == [[4]]

"""The Megatron-LM layout: weight roles found by graph structure (not names) on GPT-2's Conv1D
and LLaMA's nn.Linear, the (dp, tp) mesh, and the arithmetic in its errors."""

from __future__ import annotations

import pytest
import torch

import autopar
from autopar.capture import capture
from autopar.layouts import megatron_weight_roles
from autopar.passes import PassContext, run_passes
from autopar.passes.annotate import annotate_tensors

pytestmark = pytest.mark.filterwarnings("ignore:autopar. no sharding rule")


def _roles(model, inputs, cluster):
    cap = capture(model, inputs)
    run_passes(cap.gm, PassContext(captured=cap, cluster=cluster), [annotate_tensors])
    return megatron_weight_roles(cap.gm.graph)


def test_gpt2_roles(make_gpt2, batch, a100x8):
    roles = _roles(make_gpt2(), batch(2, 16, 256), a100x8)
    for layer in (0, 1):
        h = f"transformer.h.{layer}"
        # Conv1D weights are [in, out] (addmm): column-parallel splits dim 1, row-parallel dim 0.
        assert roles[f"{h}.attn.c_attn.weight"] == "col:1"
        assert roles[f"{h}.mlp.c_fc.weight"] == "col:1"
        assert roles[f"{h}.attn.c_proj.weight"] == "row:0"
        assert roles[f"{h}.mlp.c_proj.weight"] == "row:0"
        assert roles[f"{h}.attn.c_attn.bias"] == "col_bias"
        assert roles[f"{h}.mlp.c_proj.bias"] == "row_bias"
    # Tied to lm_head (a column-parallel [vocab, hidden] linear): either way its vocabulary rows split.
    assert roles["transformer.wte.weight"] in ("vocab", "col:0")
    assert "transformer.wpe.weight" not in roles  # indexed by positions: left to the solver


def test_llama_roles(make_llama, batch, a100x8):
    roles = _roles(make_llama(layers=2), batch(2, 16, 256), a100x8)
    for layer in (0, 1):
        p = f"model.layers.{layer}"
        # nn.Linear weights are [out, in] (linear): column-parallel splits dim 0, row-parallel dim 1.
        for name in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
        ):
            assert roles[f"{p}.{name}.weight"] == "col:0", name
        assert roles[f"{p}.self_attn.o_proj.weight"] == "row:1"
        assert roles[f"{p}.mlp.down_proj.weight"] == "row:1"
    assert roles["model.embed_tokens.weight"] == "vocab"
    assert roles["lm_head.weight"] == "col:0"  # vocabulary-parallel output layer


@pytest.mark.timeout(120)
def test_megatron_plan_places_weights_as_megatron_does(make_llama, batch, a100x8):
    plan = autopar.layouts.megatron(
        make_llama(layers=2, heads=8, kv_heads=8), batch(4, 32, 256), a100x8, tp=4
    )
    assert plan.mesh_shape == (2, 4)
    assert plan.info["layout"] == "megatron(tp=4, dp=2)"
    placed = plan.param_placements()
    assert placed["model.layers.0.self_attn.q_proj.weight"] == ("R", "S(0)")
    assert placed["model.layers.1.mlp.down_proj.weight"] == ("R", "S(1)")
    assert placed["model.layers.0.input_layernorm.weight"][1] == "R"
    assert placed["model.embed_tokens.weight"] == ("R", "S(0)")


def test_megatron_data_parallel_ranks_train_on_their_own_sequences_even_over_a_slow_network(make_gpt2, batch):
    """On nodes joined by a slow NIC the solver would rather gather the batch and compute it on
    every rank than reduce the gradients; Megatron-LM cannot: each data-parallel rank reads its
    own sequences, and every weight outside the roles (norms, biases, the position table) is
    replicated there, never ZeRO-sharded without the distributed optimizer."""
    from dataclasses import replace

    from autopar.devices import Link

    c = autopar.Cluster.local(4)
    slow = replace(
        c,
        gpus_per_node=2,
        nodes=2,
        nics_per_node=1,
        inter_node=Link(name="slow", bandwidth=50e6, latency=6e-5),
    )
    plan = autopar.layouts.megatron(make_gpt2(n_layer=2), batch(8, 16, 256), slow, tp=1)
    assert set(plan.inputs.values()) == {("S(0)", "R")}
    assert plan.zero_stages() == {}
    assert "replicated work dp 0.0 %" in plan.summary()
    assert plan.predicted.comm_bytes_per_axis[0] > 0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sp", [False, True], ids=["no sp", "sp"])
def test_megatron_runs_the_whole_rmsnorm_as_megatron_does(make_llama, batch, a100x8, sp):
    """LLaMA's RMSNorm written out (pow, mean, rsqrt, then ``weight * x``): its weight multiply
    (``norm_scales``) runs with the rest of the norm — replicated on the tensor axis, or split
    along the sequence with sequence parallelism — never repeated by every tensor rank of a
    sequence-parallel layout (the audit flagged 4–7 % of the compute so on LLaMA 3.1 70B)."""
    from autopar.layouts.roles import norm_scales

    model, inputs = make_llama(layers=2, heads=8, kv_heads=8), batch(4, 32, 256)
    cap = capture(model, inputs)
    run_passes(cap.gm, PassContext(captured=cap, cluster=a100x8), [annotate_tensors])
    scales = {n.name for n in norm_scales(cap.gm.graph, megatron_weight_roles(cap.gm.graph))}
    assert len(scales) == 5  # two per layer and the final norm
    plan = autopar.layouts.megatron(model, inputs, a100x8, tp=4, sequence_parallel=sp, captured=cap)
    tp = plan.mesh_axes.index("tp")
    for n in plan.nodes:
        if n.name in scales:
            assert n.outputs[0][tp] == ("S(1)" if sp else "R"), (n.name, n.outputs)


def test_fsdp_stores_every_weight_sharded_and_gathers_it_whole_for_use(make_llama, batch, a100x8):
    """ZeRO-3 as FSDP runs it: one data-parallel axis, every parameter stored split along its
    largest dimension that divides, no op reads a shard (each is gathered first), the batch split."""
    from autopar.placement import parse_spec

    model = make_llama(layers=2, heads=8, kv_heads=8)
    plan = autopar.layouts.fsdp(model, batch(8, 32, 256), a100x8)
    assert plan.mesh_shape == (8,) and plan.info["layout"] == "fsdp(dp=8)"
    assert set(plan.zero_stages().values()) == {3}
    shapes = {n: p.shape for n, p in model.named_parameters()}
    for name, spec in plan.param_placements().items():
        d = max(range(len(shapes[name])), key=lambda i: shapes[name][i])
        assert spec == (f"S({d})",), (name, spec)
    assert all(v == ("S(0)",) for v in plan.inputs.values())
    params = {n.name for n in plan.nodes if n.kind == "param"}
    for n in plan.nodes:  # every op reads its weights whole (gathered), never a shard
        for name, spec in zip(n.input_names, n.inputs):
            if name in params and spec is not None:
                assert all(p == "R" for p in spec), (n.name, name, spec)
        assert all(str(p) for p in (parse_spec(s) for s in n.outputs))


def test_megatron_errors_carry_the_arithmetic(make_gpt2, batch, a100x8):
    model, inputs = make_gpt2(), batch(2, 16, 256)
    with pytest.raises(ValueError, match="tp=3 does not divide the world size 8"):
        autopar.layouts.megatron(model, inputs, a100x8, tp=3)
    with pytest.raises(ValueError, match="tp\\(4\\) × dp\\(3\\) = 12 ≠ world size 8"):
        autopar.layouts.megatron(model, inputs, a100x8, tp=4, dp=3)


# ------------------------------------------------------------------------------ mixture of experts

V = 64


def _tiny_mixtral(seed: int = 0):
    """transformers' Mixtral, 2 layers of 4 experts (top-2), and one batch of 4 × 16 tokens."""
    import os

    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    os.environ["TRANSFORMERS_VERBOSITY"] = "error"
    torch.manual_seed(seed)
    cfg = MixtralConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=32,
        vocab_size=V, num_local_experts=4, num_experts_per_tok=2, use_cache=False,
    )  # fmt: skip
    ids = torch.randint(0, V, (4, 16))
    return MixtralForCausalLM(cfg), {"input_ids": ids, "labels": ids.clone()}


@pytest.fixture
def a100x4() -> autopar.Cluster:
    return autopar.Cluster.preset("A100-80GB", gpus_per_node=4, nodes=1)


@pytest.mark.timeout(120)
def test_best_megatron_tries_expert_parallel_sizes_and_returns_the_fastest(a100x4):
    model, batch = _tiny_mixtral()
    best = autopar.layouts.best_megatron(model, batch, a100x4, tp=1, pp=1)
    tried = best.info["megatron_candidates"]
    assert {c["tp"] for c in tried} == {1} and {c["pp"] for c in tried} == {1}  # held
    planned = [c for c in tried if not c.get("skipped")]
    eps = [c["ep"] for c in planned if c["recompute"] == "none"]
    assert eps[:2] == [4, 2]  # largest first: powers of two dividing dp = 4 and the 4 experts
    for ep in {1, 2, 4} - set(eps):  # the sweep stopped: said why
        assert any(c.get("skipped") and c["ep"] == ep and "rule 6" in c["why"] for c in tried), ep
    fastest = min(planned, key=lambda c: c["step_time"] if c["feasible"] else float("inf"))
    assert best.predicted.step_time == pytest.approx(fastest["step_time"], rel=1e-9)
    assert (f", ep={fastest['ep']}" in best.info["layout"]) == (fastest["ep"] > 1)
    # pruning 2: every ep fits without recomputation, so heavier levels are listed as skipped, not planned
    assert {c["recompute"] for c in planned} == {"none"}
    for ep in eps:
        skipped = {c["recompute"] for c in tried if c.get("skipped") and c["ep"] == ep}
        assert {"selective", "full"} <= skipped, (ep, skipped)


@pytest.mark.timeout(120)
def test_best_megatron_holds_a_given_ep(a100x4):
    model, batch = _tiny_mixtral()
    best = autopar.layouts.best_megatron(model, batch, a100x4, ep=2, pp=1, recompute="none")
    tried = best.info["megatron_candidates"]
    assert {c["ep"] for c in tried} == {2}
    assert dict(zip(best.mesh_axes, best.mesh_shape))["ep"] == 2 and ", ep=2" in best.info["layout"]
    planned = [c for c in tried if not c.get("skipped")]
    assert {c["tp"] for c in planned} == {1, 2}
    assert any(c.get("skipped") and c["tp"] == 4 and "ep=2 does not divide dp=1" in c["why"] for c in tried)
    # with tensor parallelism a mixture-of-experts model runs sequence parallelism, as Megatron-LM requires
    assert all(c["sp"] == (c["tp"] > 1) for c in planned)
    fastest = min(c["step_time"] for c in planned if c["feasible"])
    assert best.predicted.step_time == pytest.approx(fastest, rel=1e-9)


def test_best_megatron_does_not_search_ep_on_a_dense_model(make_gpt2, batch, a100x4):
    model, inputs = make_gpt2(), batch(4, 16, 256)
    best = autopar.layouts.best_megatron(model, inputs, a100x4, tp=1, pp=1, recompute="none")
    assert {c["ep"] for c in best.info["megatron_candidates"]} == {1}
    with pytest.raises(ValueError, match="ep=2, but the model has no mixture-of-experts layer"):
        autopar.layouts.best_megatron(model, inputs, a100x4, ep=2)


def test_best_megatron_skips_layouts_whose_training_state_alone_does_not_fit(a100x4):
    """Nothing is solved when no layout's weights, gradients and optimizer state fit; the error
    lists the static memory of each."""
    from autopar.solver import InfeasibleError

    model, batch = _tiny_mixtral()
    with pytest.raises(InfeasibleError, match=r"training state alone [\d.]+ GiB per device > budget"):
        autopar.layouts.best_megatron(model, batch, a100x4, config=autopar.PlanConfig(memory_budget=1024))


def test_megatron_static_bytes_follows_the_zero_accounting():
    from autopar.cost.memory import state_bytes_per_param

    def state(nbytes):  # bf16 parameters, AdamW with fp32 master weights: 2 + 2 + 12 bytes
        return state_bytes_per_param(nbytes, master_weights=True)

    params = [("attn.w", 1000, 2, True), ("moe.experts", 8000, 2, True), ("norm.w", 100, 2, True)]
    roles, experts = {"attn.w": "col:0"}, {"moe.experts": 8}
    one = autopar.layouts.megatron_static_bytes(
        params, roles, experts, tp=2, dp=4, ep=4, pp=1, distributed_optimizer=False, state=state
    )
    assert one == (1000 / 2 + 8000 / 4 + 100) * 16
    sharded = autopar.layouts.megatron_static_bytes(
        params, roles, experts, tp=2, dp=4, ep=4, pp=2, distributed_optimizer=True, state=state
    )
    # gradients and optimizer state over the data-parallel ranks: dp = 4 for dense weights,
    # dp · tp / ep = 2 for the experts; the largest of 2 stages holds at least half
    assert sharded == ((1000 / 2 + 100) * (2 + 14 / 4) + 8000 / 4 * (2 + 14 / 2)) / 2


@pytest.mark.timeout(120)
def test_megatron_with_expert_parallelism_composes_with_a_pipeline(a100x4):
    model, batch = _tiny_mixtral()
    plan = autopar.layouts.megatron(model, batch, a100x4, tp=1, ep=2, pp=2, microbatches=2)
    assert plan.pipeline is not None and (plan.pipeline.pp, plan.pipeline.microbatches) == (2, 2)
    assert plan.mesh_axes == ("ep",) and plan.mesh_shape == (2,)  # each stage: 2 devices, dp = ep = 2
    assert plan.info["layout"].startswith("megatron(pp=2, m=2, 1f1b, tp=1, dp=2, ep=2")
    placed = plan.param_placements()
    experts = [f for f in placed if f.endswith(("gate_up_proj", "down_proj")) and "experts" in f]
    assert len(experts) == 4 and all(placed[f] == ("S(0)",) for f in experts), placed
    rewrites = [r for n in plan.nodes for r in n.rewrites if r.startswith("expert")]
    assert rewrites == ["expert_dispatch", "expert_combine"] * 2
    assert set(plan.pipeline.stage_of.values()) == {0, 1}
    assert autopar.simulate(plan).step_time == pytest.approx(plan.predicted.step_time, rel=1e-6)


@pytest.mark.timeout(120)
def test_distributed_optimizer_splits_the_state_over_each_weights_data_parallel_ranks(a100x4):
    model, batch = _tiny_mixtral()
    plain = autopar.layouts.megatron(model, batch, a100x4, tp=1, ep=2)
    plan = autopar.layouts.megatron(model, batch, a100x4, tp=1, ep=2, distributed_optimizer=True)
    assert plan.mesh_axes == ("dp", "ep") and plan.info["layout"].endswith("ep=2, distributed optimizer)")
    placed, stages = plan.param_placements(), plan.zero_stages()
    gate_up = "model.layers.0.mlp.experts.gate_up_proj"
    assert placed[gate_up][1] == "S(0)" and placed[gate_up][0].startswith("S(")  # experts: ep, then dp
    q = "model.layers.0.self_attn.q_proj.weight"
    assert all(p.startswith("S(") for p in placed[q])  # dense: over dp and ep, both data-parallel for it
    assert stages[q] == 1 and stages[gate_up] == 1  # Megatron: whole gradients, reduce-scattered once a step
    assert plan.predicted.memory_per_device < plain.predicted.memory_per_device


def _distributed_optimizer_worker(rank: int, world: int) -> dict:
    import warnings

    from _runtime_helpers import make_optimizer, train

    warnings.simplefilter("ignore")
    cluster = autopar.Cluster.local(world)
    model, batch = _tiny_mixtral()
    plan = autopar.layouts.megatron(model, batch, cluster, tp=1, ep=2, distributed_optimizer=True)
    pm = autopar.parallelize(model, cluster, batch, plan=plan)
    losses = train(pm, batch, make_optimizer("adamw", pm.parameters()))
    return {"losses": losses, "state": pm.full_state_dict(), "stages": set(pm.plan.zero_stages().values())}


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_distributed_optimizer_layout_trains_like_one_process():
    """Megatron with expert parallelism and the distributed optimizer on 2 gloo processes: dense
    weights' state split over the ep axis (data-parallel for them), experts by expert; 3 AdamW
    steps give the losses and final state of one process."""
    from _runtime_helpers import compare_training, make_optimizer, train

    from autopar.runtime.launch import spawn

    result = spawn(_distributed_optimizer_worker, 2, timeout=280)[0]
    model, batch = _tiny_mixtral()
    ref = train(model, batch, make_optimizer("adamw", model.parameters()))
    ref_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    assert result["stages"] == {1}
    problems = compare_training(
        (ref, ref_state), (result["losses"], result["state"]), "adamw", "ep=2 + dist-opt"
    )
    assert not problems, "\n".join(problems)


# ------------------------------------------------------------------------------ errors naming the knob


def test_megatron_tp_that_does_not_divide_the_hidden_size_names_tp_and_the_sizes():
    """Hidden size 66 under tp=4: the error used to be the solver's "fixed placement ('S(0)',) for
    blocks.0.attn.qkv.weight is not a valid layout of shape (198, 66)"; it names tp and the sizes."""
    import torch

    from autopar.models import GPT, GPTConfig

    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=6, n_embd=66))
    idx = torch.randint(0, 64, (4, 16))
    with pytest.raises(ValueError) as err:
        autopar.layouts.megatron(model, (idx, idx), autopar.Cluster.local(4), tp=4)
    msg = str(err.value)
    assert msg.startswith("megatron(tp=4):"), msg
    assert "blocks.0.attn.qkv.weight (198, 66): dimension 0 = 198, 198 / 4 = 49.5" in msg
    assert "tp must divide all of them: tp in [1, 2]" in msg
    assert "not a valid layout" not in msg
    # The pipelined layout checks the same before planning its stages.
    with pytest.raises(ValueError, match=r"megatron\(tp=2\):"):
        model3 = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=3, n_embd=33))
        autopar.layouts.megatron(model3, (idx, idx), autopar.Cluster.local(4), tp=2, pp=2, microbatches=2)


def test_fixed_placement_on_a_dimension_that_does_not_exist_says_so():
    import torch
    from torch import nn

    model = nn.Sequential(nn.Linear(66, 66))
    x = torch.randn(8, 66)
    with pytest.raises(ValueError) as err:
        autopar.plan(model, (x,), autopar.Cluster.local(2), fixed={"0.weight": ("S(9)",)}, pp=1)
    msg = str(err.value)
    assert "dimension 9 does not exist: shape (66, 66) has dimensions 0..1" in msg
    assert "must divide" not in msg


def test_fixed_placement_that_does_not_divide_gives_the_arithmetic():
    import torch
    from torch import nn

    model = nn.Sequential(nn.Linear(66, 66))
    x = torch.randn(8, 66)
    with pytest.raises(ValueError) as err:
        autopar.plan(
            model, (x,), autopar.Cluster.local(4), fixed={"0.weight": ("S(0)",)}, mesh_shape=(4,), pp=1
        )
    msg = str(err.value)
    assert "cuts dimension 0 (size 66) into 4 pieces, and 66 / 4 = 16.5 is not whole" in msg


def _tight_gpt():
    """A GPT of 8 layers on the meta device and a batch whose activations dominate its memory."""
    import torch

    from autopar.models import GPT, GPTConfig

    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=8, n_head=8, n_embd=512, block_size=1024, vocab_size=8192))
    ids = torch.empty(8, 1024, dtype=torch.long, device="meta")
    return model, (ids, ids.clone())


@pytest.mark.timeout(120)
def test_best_megatron_recomputes_the_fewest_layers_that_fit(a100x4):
    """Between the memory of keeping every activation and of recomputing every layer, Megatron-LM's
    block method (``--recompute-num-layers N``) fits with fewer layers recomputed, and runs faster
    than recomputing all; ``best_megatron`` finds the fewest by bisection."""
    model, inputs = _tight_gpt()
    every = autopar.layouts.megatron(
        model, inputs, a100x4, tp=1, recompute="full", distributed_optimizer=True
    )
    kept = autopar.layouts.megatron(model, inputs, a100x4, tp=1, recompute="none", distributed_optimizer=True)
    budget = (every.predicted.memory_per_device + kept.predicted.memory_per_device) / 2
    config = autopar.PlanConfig(memory_budget=budget)
    best = autopar.layouts.best_megatron(
        model, inputs, a100x4, tp=1, pp=1, cp=1, microbatch_size=2, config=config
    )
    tried = best.info["megatron_candidates"]
    block = {
        c["recompute_num_layers"]: c for c in tried if c.get("recompute_num_layers") and not c.get("skipped")
    }
    fits = sorted(n for n, c in block.items() if c["feasible"])
    assert fits and not any(c["feasible"] for c in tried if c["recompute"] in ("none", "selective")), tried
    n = fits[0]
    assert 1 < n < 8 and not block[n - 1]["feasible"], block  # the fewest: one fewer does not fit
    assert best.recompute == "full" and len(best.recompute_layers) == n
    assert best.predicted.step_time == pytest.approx(block[n]["step_time"], rel=1e-9)
    assert best.predicted.step_time < every.predicted.step_time
    # held: only that N is planned
    held = autopar.layouts.best_megatron(
        model, inputs, a100x4, tp=1, pp=1, cp=1, microbatch_size=2, recompute_num_layers=n + 1, config=config
    )
    planned = [c for c in held.info["megatron_candidates"] if not c.get("skipped")]
    assert {c.get("recompute_num_layers") for c in planned} == {n + 1}
    assert len(held.recompute_layers) == n + 1
    with pytest.raises(ValueError, match="applies to full recomputation"):
        autopar.layouts.best_megatron(model, inputs, a100x4, recompute="selective", recompute_num_layers=2)


def test_megatron_context_parallel_without_tensor_parallel_or_distributed_optimizer(a100x4):
    """``tp=1`` keeps a tensor axis of one device, where weights lie whole: with ``cp`` beside it
    the layout plans (it was refused: a fused QKV weight's column split on that axis had no
    strategy)."""
    model, inputs = _tight_gpt()
    plan = autopar.layouts.megatron(model, inputs, a100x4, tp=1, cp=2, recompute="none")
    assert dict(zip(plan.mesh_axes, plan.mesh_shape)) == {"dp": 2, "cp": 2, "tp": 1}
    assert plan.predicted.step_time > 0


@pytest.mark.timeout(300)
def test_best_megatron_pipelines_past_the_shortest_that_fits_while_it_gets_faster():
    """Rule 5: across two nodes joined by 100 Gb/s Ethernet a 2-layer GPT fits on one stage, but
    its data-parallel gradient reduction crosses the slow link; two stages send only activations
    and win, so an expert (and ``best_megatron``) pipelines though memory does not ask for it."""
    from autopar.models import GPT, GPTConfig

    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=2, n_head=8, n_embd=1024, vocab_size=8192, block_size=1024))
        model = model.to(torch.bfloat16)
    ids = torch.empty(8, 1024, dtype=torch.long, device="meta")
    cluster = autopar.Cluster.preset("H100-SXM", gpus_per_node=1, nodes=2, network="ethernet-100g")
    best = autopar.layouts.best_megatron(
        model, (ids, ids.clone()), cluster, tp=1, recompute="none", sequence_parallel=False,
        distributed_optimizer=False,
    )  # fmt: skip
    planned = [c for c in best.info["megatron_candidates"] if c.get("feasible")]
    one = min(c["step_time"] for c in planned if c["pp"] == 1)
    two = min(c["step_time"] for c in planned if c["pp"] == 2)
    assert two < one and best.pipeline is not None and best.pipeline.pp == 2
    assert best.predicted.step_time == pytest.approx(two, rel=1e-9)

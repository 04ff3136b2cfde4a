"""Plans of real models: every parameter of GPT-2, LLaMA (transformers) and our GPT gets a
placement; repeated layers share decision variables; a plan prints as a readable table."""

from __future__ import annotations

import re

import pytest
import torch

import autopar

# LLaMA's mask construction has ops without a sharding rule; the planner warns that they run replicated.
pytestmark = pytest.mark.filterwarnings("ignore:autopar. no sharding rule")

PLACEMENT = re.compile(r"^(R|S\(\d+\))$")


def _assert_every_parameter_placed(plan: autopar.Plan, model: torch.nn.Module) -> None:
    placements = plan.param_placements()
    names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    assert sorted(placements) == sorted(names)
    for name, spec in placements.items():
        assert isinstance(spec, tuple) and len(spec) == len(plan.mesh_shape), (name, spec)
        assert all(PLACEMENT.match(p) for p in spec), (name, spec)
    # Tied names share one placement.
    for first, aliases in plan.param_aliases.items():
        assert len({placements[a] for a in aliases}) == 1, first


@pytest.mark.timeout(120)
def test_gpt2_every_parameter_placed(make_gpt2, batch, a100x8):
    model = make_gpt2()
    plan = autopar.plan(model, batch(8, 32, 256), a100x8)
    assert plan.mesh_shape in [(8,), (4, 2), (2, 4)]
    assert len(plan.info["meshes_tried"]) == 3  # (8,) and (8/t, t) for t = 2, 4 (t = 8 is the 1-D mesh)
    # The best mesh wins; the step time is the simulator's (compute and collectives, the gradient
    # reduction left exposed after backward, the optimizer step).
    best = min(m["objective"] for m in plan.info["meshes_tried"] if m["feasible"])
    assert plan.info["solver"]["objective"] == pytest.approx(best, rel=1e-6)
    assert plan.predicted.step_time == pytest.approx(sum(plan.info["simulated"].values()), rel=1e-9)
    _assert_every_parameter_placed(plan, model)
    assert plan.param_placements()["lm_head.weight"] == plan.param_placements()["transformer.wte.weight"]


@pytest.mark.timeout(120)
def test_llama_every_parameter_placed(make_llama, batch, a100x8):
    model = make_llama(layers=2, heads=8, kv_heads=8)
    plan = autopar.plan(model, batch(2, 64, 256), a100x8, mesh_shape=(2, 4))
    assert plan.mesh_shape == (2, 4)
    _assert_every_parameter_placed(plan, model)
    # LLaMA's mask construction (diff, new_ones) has sharding rules now: no op runs replicated
    # for want of one.
    assert not plan.info.get("unruled_ops")


@pytest.mark.timeout(120)
def test_our_gpt_every_parameter_placed_on_meta(a100x8):
    from autopar.models import GPT, GPTConfig

    with torch.device("meta"):
        model = GPT(GPTConfig.tiny(n_layer=2, n_embd=64, n_head=4))
    idx = torch.empty(16, 32, dtype=torch.long, device="meta")
    plan = autopar.plan(model, (idx, idx.clone()), a100x8, mesh_shape=(8,))
    _assert_every_parameter_placed(plan, model)
    assert set(plan.inputs) == {"args[0]", "args[1]"}


@pytest.mark.timeout(120)
def test_repeated_layers_share_decision_variables(make_llama, batch, a100x8):
    classes = {}
    plans = {}
    for layers in (2, 4):
        plans[layers] = autopar.plan(make_llama(layers=layers), batch(1, 32, 256), a100x8, mesh_shape=(8,))
        (tried,) = plans[layers].info["meshes_tried"]
        classes[layers] = tried["classes"]
    assert classes[2] == classes[4]
    # ... so every layer of the deeper model is laid out like every other.
    placements = plans[4].param_placements()
    by_position: dict[str, set] = {}
    for name, spec in placements.items():
        if name.startswith("model.layers."):
            by_position.setdefault(re.sub(r"layers\.\d+\.", "layers.*.", name), set()).add(spec)
    assert by_position and all(len(specs) == 1 for specs in by_position.values())
    # the graph is twice as deep, the solver model is not
    nodes2 = len(plans[2].nodes)
    assert len(plans[4].nodes) > 1.5 * nodes2


def test_full_table_shows_modules_placements_and_step_time(gpt2_plan):
    text = gpt2_plan.summary() + "\n" + gpt2_plan.table(full=True)  # print(plan): tests/test_display.py
    assert "predicted step time" in text
    assert re.search(r"predicted step time [\d.]+ (µs|ms|s) .*solver.s sum: compute", text)
    assert "simulated step: compute and collectives" in text
    assert "memory per device" in text
    for module in (
        "transformer.wte",
        "transformer.h.0.attn.c_attn",
        "transformer.h.1.mlp.c_proj",
        "transformer.ln_f",
    ):
        assert re.search(rf"^{re.escape(module)}\s", text, flags=re.M), module
    spec = gpt2_plan.param_placements(detailed=True)["transformer.h.0.attn.c_attn.weight"][0]
    assert f"weight:{spec}" in text
    assert "Plan on mesh" in text and "=8" in text
    short = gpt2_plan.table(max_rows=3, full=True)
    assert "more modules" in short and len(short.splitlines()) < len(text.splitlines())
    assert repr(gpt2_plan).startswith("<autopar.Plan mesh=(8,)")


def test_gpt_attention_written_out_computes_what_sdpa_does_and_costs_its_scores():
    """``GPTConfig(attention="math")`` is Megatron-LM's 2021 attention (scores materialised,
    softmax, dropout): the same values as SDPA, and on a GPU its s × s scores cost memory traffic
    that the fused kernel does not move, so the planned step is slower."""
    from autopar.models import GPT, GPTConfig

    torch.manual_seed(0)
    fused = GPT(GPTConfig.tiny(n_layer=2))
    math_ = GPT(GPTConfig.tiny(n_layer=2, attention="math"))
    math_.load_state_dict(fused.state_dict())
    x = torch.randint(0, 128, (2, 32))
    a, b = fused(x, x), math_(x, x)
    a.backward()
    b.backward()
    assert torch.allclose(a, b, atol=1e-6)
    for (n, p), q in zip(fused.named_parameters(), math_.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-6), n
    with pytest.raises(ValueError, match="attention must be 'sdpa' or 'math'"):
        GPTConfig(attention="flash")
    cluster = autopar.Cluster.preset("A100-80GB", gpus_per_node=8)
    ids = torch.empty(8, 1024, dtype=torch.long, device="meta")
    steps = {}
    for kind in ("sdpa", "math"):
        with torch.device("meta"):
            model = GPT(GPTConfig(n_layer=2, n_head=8, n_embd=512, block_size=1024, attention=kind))
        steps[kind] = autopar.plan(model, (ids, ids), cluster, mesh_shape=(8,)).predicted.step_time
    assert steps["math"] > 1.1 * steps["sdpa"], steps

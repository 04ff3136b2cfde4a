"""The Megatron-LM layout: weight roles found by graph structure (not names) on GPT-2's Conv1D
and LLaMA's nn.Linear, the (dp, tp) mesh, and the arithmetic in its errors."""

from __future__ import annotations

import pytest

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


def test_megatron_errors_carry_the_arithmetic(make_gpt2, batch, a100x8):
    model, inputs = make_gpt2(), batch(2, 16, 256)
    with pytest.raises(ValueError, match="tp=3 does not divide the world size 8"):
        autopar.layouts.megatron(model, inputs, a100x8, tp=3)
    with pytest.raises(ValueError, match="tp\\(4\\) × dp\\(3\\) = 12 ≠ world size 8"):
        autopar.layouts.megatron(model, inputs, a100x8, tp=4, dp=3)

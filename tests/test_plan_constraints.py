"""User constraints: ``fixed={fqn: spec}`` is honored exactly, on 1-D and 2-D meshes, and a spec
that cannot be honored is refused with the reason."""

from __future__ import annotations

import pytest

import autopar

pytestmark = pytest.mark.filterwarnings("ignore:autopar. no sharding rule")


@pytest.mark.timeout(120)
def test_fixed_specs_are_honored_on_a_1d_mesh(make_gpt2, batch, a100x8):
    model, inputs = make_gpt2(), batch(8, 32, 256)
    free = autopar.plan(model, inputs, a100x8, mesh_shape=(8,)).param_placements()
    fixed = {
        "transformer.h.0.mlp.c_fc.weight": ("S(0)",),
        "transformer.h.1.attn.c_attn.weight": "S(1)",  # a bare string is a 1-axis spec
        "lm_head.weight": ("S(1)",),  # tied: named by its second name
        "transformer.h.0.ln_1.weight": ("S(0)",),
    }
    # The constraints must change something, or honoring them proves nothing.
    assert any(free[name] != (spec if isinstance(spec, tuple) else (spec,)) for name, spec in fixed.items())
    placed = autopar.plan(model, inputs, a100x8, mesh_shape=(8,), fixed=fixed).param_placements()
    assert placed["transformer.h.0.mlp.c_fc.weight"] == ("S(0)",)
    assert placed["transformer.h.1.attn.c_attn.weight"] == ("S(1)",)
    assert placed["lm_head.weight"] == placed["transformer.wte.weight"] == ("S(1)",)
    assert placed["transformer.h.0.ln_1.weight"] == ("S(0)",)
    # Fixing one layer's weight does not tie the other layer's to it.
    replicated = autopar.plan(
        model, inputs, a100x8, mesh_shape=(8,), fixed={"transformer.h.0.mlp.c_fc.weight": ("R",)}
    ).param_placements()
    assert replicated["transformer.h.0.mlp.c_fc.weight"] == ("R",)


@pytest.mark.timeout(120)
def test_fixed_specs_are_honored_on_a_2d_mesh(make_gpt2, batch, a100x8):
    model, inputs = make_gpt2(), batch(8, 32, 256)
    fixed = {
        "transformer.h.1.attn.c_attn.weight": ("R", "S(1)"),
        "transformer.h.0.mlp.c_proj.weight": ("S(0)", "R"),
        "transformer.wpe.weight": ("S(1)", "S(0)"),
    }
    plan = autopar.plan(model, inputs, a100x8, mesh_shape=(2, 4), fixed=fixed)
    assert plan.mesh_shape == (2, 4)
    placed = plan.param_placements()
    for name, spec in fixed.items():
        assert placed[name] == spec, name


def test_unknown_name_is_refused_with_the_names_it_could_be(make_gpt2, batch, a100x8):
    with pytest.raises(ValueError) as err:
        autopar.plan(
            make_gpt2(),
            batch(8, 32, 256),
            a100x8,
            mesh_shape=(8,),
            fixed={"transformer.h.9.mlp.c_fc.weight": "R"},
        )
    msg = str(err.value)
    assert "'transformer.h.9.mlp.c_fc.weight'" in msg and "parameter" in msg
    assert "transformer.h.1.mlp.c_fc.weight" in msg  # a similar name it does have
    assert "input_ids" in msg  # fixed may also name inputs


@pytest.mark.timeout(120)
def test_fixed_may_name_an_input(make_gpt2, batch, a100x8):
    plan = autopar.plan(make_gpt2(), batch(64, 32, 256), a100x8, mesh_shape=(8,), fixed={"input_ids": ("R",)})
    assert plan.inputs["input_ids"] == ("R",)


def test_spec_that_cannot_divide_is_refused_with_shape_and_mesh(make_gpt2, batch, a100x8):
    model = make_gpt2(n_positions=60)  # wpe is [60, 64]: 60 rows do not split 8 ways
    with pytest.raises(ValueError) as err:
        autopar.plan(
            model, batch(8, 32, 256), a100x8, mesh_shape=(8,), fixed={"transformer.wpe.weight": ("S(0)",)}
        )
    msg = str(err.value)
    assert "transformer.wpe.weight" in msg and "(60, 64)" in msg and "(8,)" in msg and "divide" in msg


def test_spec_with_the_wrong_number_of_axes_is_refused(make_gpt2, batch, a100x8):
    with pytest.raises(ValueError, match="2 entries but the mesh has 1 axes"):
        autopar.plan(
            make_gpt2(),
            batch(8, 32, 256),
            a100x8,
            mesh_shape=(8,),
            fixed={"transformer.wpe.weight": ("S(0)", "R")},
        )


def test_unparseable_spec_is_refused(make_gpt2, batch, a100x8):
    with pytest.raises(ValueError, match="cannot parse placement 'shard0'"):
        autopar.plan(
            make_gpt2(),
            batch(8, 32, 256),
            a100x8,
            mesh_shape=(8,),
            fixed={"transformer.wpe.weight": "shard0"},
        )


def test_fixed_block_count_must_match_the_weights_split(make_gpt2, batch, a100x8):
    """``S(1)x5`` on GPT-2's fused QKV (split in 3) is refused with the valid layouts, not silently
    turned into ``S(1)x3``; ``S(1)x3`` and plain ``S(1)`` are accepted."""
    model, inputs = make_gpt2(), batch(8, 32, 256)
    name = "transformer.h.0.attn.c_attn.weight"
    with pytest.raises(ValueError, match=r"S\(1\)x5.*valid layouts are .*S\(1\)x3"):
        autopar.plan(model, inputs, a100x8, mesh_shape=(8,), fixed={name: ("S(1)x5",)})
    plan = autopar.plan(model, inputs, a100x8, mesh_shape=(8,), fixed={name: ("S(1)x3",)})
    assert plan.param_placements(detailed=True)[name] == ("S(1)x3",)


@pytest.mark.timeout(120)
def test_mesh_shape_with_a_pipeline_is_the_mesh_inside_a_stage(make_gpt):
    """``pp=2, mesh_shape=(2, 2)`` on 8 devices: two stages of a 2 × 2 mesh, fixed specs on it
    honored (the search used to drop the mesh and refuse the specs for its one-axis meshes); a
    mesh of the wrong size is refused with the arithmetic."""
    import torch

    model = make_gpt(n_layer=2, n_head=4, n_embd=32, vocab_size=64)
    inputs = (torch.randint(0, 64, (8, 16)), torch.randint(0, 64, (8, 16)))
    cluster = autopar.Cluster.local(8)
    fixed = {name: ("R", "R") for name, _ in model.named_parameters()}
    fixed |= {"args[0]": ("S(0)", "S(0)"), "args[1]": ("S(0)", "S(0)")}
    plan = autopar.plan(model, inputs, cluster, pp=2, microbatches=2, mesh_shape=(2, 2), fixed=fixed)
    assert plan.pipeline is not None and plan.pipeline.pp == 2 and plan.mesh_shape == (2, 2)
    assert set(plan.param_placements().values()) == {("R", "R")}
    with pytest.raises(ValueError, match=r"mesh_shape \(8,\) spans 8 devices, .* world / pp = 8 / 2 = 4"):
        autopar.plan(model, inputs, cluster, pp=2, microbatches=2, mesh_shape=(8,))

"""How a Plan prints (``autopar.display``): totals and a one-line legend, rows in execution order,
repeated identical layers folded (``blocks.0–31 ×32``), every module with ``table(full=True)``;
the rows' times add up to the plan's totals."""

from __future__ import annotations

import math
import re

import pytest

import autopar
from autopar.display import layer_rows, unit_of
from autopar.planfile import NodePlan, Plan, Predicted, ReshardPlan


def _param(fqn: str, spec: tuple[str, ...], memory: float = 100.0) -> NodePlan:
    return NodePlan(
        name="p_" + fqn.replace(".", "_"), op="placeholder", module=fqn.rsplit(".", 1)[0], kind="param",
        fqn=fqn, inputs=(), input_names=(), outputs=(spec,), rewrites=("",) * len(spec),
        comms=("",) * len(spec), split=(False,) * len(spec), shape=(4, 4), compute_time=0.0,
        comm_time=0.0, memory=memory,
    )  # fmt: skip


def _op(name: str, module: str, spec: tuple[str, ...], compute: float = 1e-3, comm: float = 0.0) -> NodePlan:
    return NodePlan(
        name=name, op="linear", module=module, kind="op", fqn="", inputs=(spec,), input_names=("x",),
        outputs=(spec,), rewrites=("",) * len(spec), comms=("all_reduce" if comm else "",) + ("",) * (len(spec) - 1),
        split=(True,) * len(spec), shape=(2, 4), compute_time=compute, comm_time=comm, memory=10.0,
    )  # fmt: skip


def synthetic_plan(layer_specs: list[tuple[str, ...]]) -> Plan:
    """An embedding, one block per entry of ``layer_specs`` (its weight's spec), a head and a
    top-level loss; each block's op reads a reshard of 2 ms split 3:1 over the two axes."""
    mesh = (2, 2)
    nodes = [_param("emb.weight", ("R", "R")), _op("embedding", "emb", ("S(0)", "R"))]
    reshards = []
    for i, spec in enumerate(layer_specs):
        nodes.append(_param(f"blocks.{i}.fc.weight", spec))
        nodes.append(_op(f"linear_{i}", f"blocks.{i}.fc", ("S(0)", "R")))
        nodes.append(_op(f"gelu_{i}", f"blocks.{i}", ("S(0)", "R"), comm=1e-3))
        step = ReshardPlan(
            producer=f"p_blocks_{i}_fc_weight", consumer=f"linear_{i}", src=spec, dst=spec,
            collectives=("all_gather(axis=1, dim=0)",), grad_sync_axes=(0,), time=2e-3,
            bytes_per_axis=(300.0, 100.0),
        )  # fmt: skip
        reshards.append(step)
    nodes += [_param("head.weight", ("R", "S(0)")), _op("head", "head", ("S(0)", "S(1)"))]
    nodes.append(_op("loss", "", ("R", "R")))
    compute = sum(n.compute_time for n in nodes)
    comm = sum(n.comm_time for n in nodes) + sum(r.time for r in reshards)
    return Plan(
        mesh_shape=mesh, mesh_axes=("dp", "tp"), nodes=nodes, params={}, param_aliases={}, inputs={},
        reshards=reshards, predicted=Predicted(step_time=compute + comm, compute_time=compute, comm_time=comm,
        memory_per_device=sum(n.memory for n in nodes), comm_bytes_per_axis=(1.0, 2.0), optimal=True),
        cluster={}, fingerprint="x", info={"memory_budget": 2**30, "notes": ["axis rep=2 replicates: because"]},
    )  # fmt: skip


def test_unit_of_names_layers_by_their_first_index():
    assert unit_of("model.layers.3.mlp.up_proj") == ("model.layers.3", "model.layers", 3)
    assert unit_of("encoder.block.11.layer.0.SelfAttention.q") == ("encoder.block.11", "encoder.block", 11)
    assert unit_of("model.embed_tokens") == ("model.embed_tokens", "model.embed_tokens", None)
    assert unit_of("vit.embeddings.patch_embeddings.projection") == ("vit.embeddings",) * 2 + (None,)
    assert unit_of("") == ("<top>", "<top>", None)


def test_identical_consecutive_layers_fold_and_a_different_one_keeps_its_row():
    plan = synthetic_plan([("R", "S(0)")] + [("R", "S(1)")] * 3 + [("R", "R")])
    rows = layer_rows(plan)
    assert [(r.name, r.count) for r in rows] == [
        ("emb", 1), ("blocks.0", 1), ("blocks.1–3", 3), ("blocks.4", 1), ("head", 1), ("<top>", 1),
    ]  # fmt: skip
    folded = rows[2]
    assert folded.compute == pytest.approx(3 * 2e-3) and folded.comm == pytest.approx(3 * 3e-3)
    # 2 ms reshard split 3:1 by bytes; 1 ms in-op all-reduce on axis 0 — per layer, times 3.
    assert folded.comm_per_axis == pytest.approx((3 * (1.5e-3 + 1e-3), 3 * 0.5e-3))
    assert folded.weights == {("R", "S(1)"): ["fc.weight"]}
    assert folded.collectives == {"all_gather": 1, "grad-sync": 1, "all_reduce": 1}
    # The rows account for the whole plan.
    p = plan.predicted
    assert sum(r.compute for r in rows) == pytest.approx(p.compute_time)
    assert sum(r.comm for r in rows) == pytest.approx(p.comm_time)
    assert sum(sum(r.comm_per_axis) for r in rows) == pytest.approx(p.comm_time)
    assert sum(r.memory for r in rows) == pytest.approx(p.memory_per_device)


def test_print_plan_summarises_in_execution_order_with_a_legend():
    plan = synthetic_plan([("R", "S(1)")] * 32)
    text = str(plan)
    lines = text.splitlines()
    assert lines[0].startswith("Plan on mesh dp=2 × tp=2")
    assert "memory per device" in text and "of 1.00 GiB budget" in text
    assert "note: axis rep=2 replicates: because" in text
    legend = [line for line in lines if line.startswith("legend:")]
    assert len(legend) == 1 and "(dp, tp)" in legend[0] and "R replicated" in legend[0]
    table = lines[lines.index("") + 1 :]
    names = [line.split()[0] for line in table[1:]]
    assert names == ["emb", "blocks.0–31", "head", "<top>"]
    assert re.search(r"^blocks\.0–31\s+×32\s", "\n".join(table), flags=re.M)
    assert "fc: R,S(1)" in text
    assert len(lines) < 15


def test_full_table_lists_every_module_in_execution_order():
    plan = synthetic_plan([("R", "S(1)")] * 3)
    full = plan.table(full=True)
    modules = [line.split()[0] for line in full.splitlines()[1:]]
    assert modules == [
        "emb",
        "blocks.0.fc",
        "blocks.0",
        "blocks.1.fc",
        "blocks.1",
        "blocks.2.fc",
        "blocks.2",
        "head",
        "<top>",
    ]
    assert "weight:R,S(1) linear→S(0),R" in full
    assert plan.table(full=True, max_rows=2).splitlines()[-1] == "... 7 more modules"
    assert plan.table(max_rows=1).splitlines()[-1] == "... 3 more rows"


def test_a_real_plan_folds_its_blocks(gpt2_plan):
    text = str(gpt2_plan)
    rows = layer_rows(gpt2_plan)
    blocks = [r for r in rows if r.layer_class == "transformer.h"]
    assert sum(r.count for r in blocks) == 2  # the fixture's two layers, folded or not
    assert any(line.startswith("transformer.h.") for line in text.splitlines())
    p = gpt2_plan.predicted
    assert math.isclose(sum(r.compute for r in rows), p.compute_time, rel_tol=1e-9)
    assert math.isclose(sum(r.comm for r in rows), p.comm_time, rel_tol=1e-9)
    assert math.isclose(sum(r.memory for r in rows), sum(n.memory for n in gpt2_plan.nodes), rel_tol=1e-9)
    assert rows[0].name == "<inputs>"
    assert repr(gpt2_plan).startswith("<autopar.Plan mesh=(8,)")
    assert isinstance(autopar.Plan.from_dict(gpt2_plan.to_dict()).table(), str)


def test_solver_status_says_how_close_to_the_optimum():
    from autopar.display import solver_status

    assert solver_status(True, 0.0) == "optimal"
    assert solver_status(False, 0.0034) == "within 0.34 % of optimal"
    assert solver_status(False, 2e-7) == "within 0.01 % of optimal"  # a bound, never "0.00 %"
    assert solver_status(False, 0.0) == "best found"

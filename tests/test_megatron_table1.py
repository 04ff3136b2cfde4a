"""Megatron-LM's Table 1 (``reference/megatron_gpt_weak_scaling.csv``): Megatron's own layout of a
row, planned and simulated in the paper's setting, predicts the published TFLOP/s per GPU within
15 % (``examples/megatron_table1.py`` prints every row). Two rows here: one stage with gradient
accumulation (row 1) and a pipeline (row 5, pp = 2 with tp = 8)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import megatron_table1 as T


@pytest.mark.parametrize("row", [1, 5])
def test_predicted_throughput_is_within_15_percent_of_the_paper(row):
    r = T.rows()[row - 1]
    plan, predicted = T.megatron_row(r)
    published = float(r["tflops_per_gpu"])
    assert abs(predicted / published - 1) <= 0.15, (row, predicted, published, plan.info.get("layout"))
    assert plan.recompute == "full"
    # The paper's FLOP count (§5.1, with recomputation): 96·B·s·l·h²·(1 + s/6h + V/16lh).
    assert T.megatron_flops(512, 2048, 24, 2304, 51200) == pytest.approx(
        96 * 512 * 2048 * 24 * 2304**2 * (1 + 2048 / (6 * 2304) + 51200 / (16 * 24 * 2304))
    )


@pytest.mark.timeout(300)
def test_accumulated_micro_batches_plan_the_mesh_that_plays_fastest():
    """Row 1 (GPT 1.7B on 32 A100), 4 micro-batches accumulated on one stage. The solver's
    objective sums communication and ranked (16, 2) first (718.9 ms against 725.9 ms for (32,)
    before the optimizer step was in it; within 0.2 % either way now);
    played with its 4 micro-batches, the data-parallel (32,) is faster, its gradient reduction
    hidden under backward: 2.715 s against 2.787 s. The near tie goes to the played step
    (``autopar.planner.MESH_TIE``), and the plan is within 0.2 % of Megatron-LM's own layout of
    the same knobs (dp = 32, 4 micro-batches, distributed optimizer); with ZeRO-1 offered and the
    optimizer step in the solver's objective, no slower than it."""
    import autopar
    from autopar.planner import MESH_TIE

    model, inputs, cluster = T.row_setup(T.rows()[0])
    plan = autopar.plan(model, inputs, cluster, pp=1, microbatches=4)
    tried = {tuple(m["mesh"]): m for m in plan.info["meshes_tried"]}
    # A near tie in the solver's objective (with the optimizer step in it, (32,) is also first there).
    assert abs(tried[(16, 2)]["objective"] / tried[(32,)]["objective"] - 1) < MESH_TIE
    assert plan.mesh_shape == (32,)
    assert tried[(32,)]["scored_step"] < tried[(16, 2)]["scored_step"]
    meg = autopar.layouts.megatron(
        model,
        inputs,
        cluster,
        tp=1,
        pp=1,
        microbatches=4,
        distributed_optimizer=True,
        sequence_parallel=False,
    )
    assert plan.predicted.step_time <= meg.predicted.step_time
    # ZeRO-1 (Megatron's distributed optimizer) offered under accumulation
    # (``autopar.refine.accumulated_zero1``): the large weights keep whole gradients, reduced once a step.
    assert 1 in set(plan.zero_stages().values())

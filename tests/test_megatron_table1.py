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

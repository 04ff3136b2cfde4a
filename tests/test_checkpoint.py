"""Sharded checkpoints (torch.distributed.checkpoint) resume under another plan exactly.

Train 2 AdamW steps under the Megatron layout (tp=2, 2 processes), save model and optimizer state
with DCP; load under a data-parallel plan (2 processes) and under tp=2 × dp=2 (4 processes), train
2 more steps: the losses and the parameters equal 4 uninterrupted steps on one process (the
tolerances of ``_runtime_helpers``). Without the optimizer state, AdamW's moments restart and the
resumed losses differ (the test shows the check can fail).
"""

from __future__ import annotations

import os
from typing import Any

import _runtime_helpers as H
import pytest
import torch

import autopar
from autopar.runtime import checkpoint
from autopar.runtime.launch import spawn

pytestmark = [pytest.mark.distributed, pytest.mark.filterwarnings("ignore:autopar. no sharding rule")]

KIND = "gpt2"  # fused QKV (block-sharded under tensor parallelism), tied LM head


def _plan(layout: str, model: Any, inputs: Any, world: int) -> Any:
    cluster = autopar.Cluster.local(world)
    if layout == "megatron":
        return autopar.layouts.megatron(model, inputs, cluster, tp=2, dp=world // 2)
    fixed = {n: ("R",) for n, _ in model.named_parameters()}
    return autopar.plan(model, inputs, cluster, fixed=fixed, mesh_shape=(world,))


def save_worker(rank: int, world: int, path: str) -> list[float]:
    H.quiet()
    model, inputs = H.build(KIND)
    pm = autopar.parallelize(
        model, autopar.Cluster.local(world), inputs, plan=_plan("megatron", model, inputs, world)
    )
    opt = H.make_optimizer("adamw", pm.parameters())
    losses = H.train(pm, inputs, opt, steps=2)
    checkpoint.save(pm, path, optimizer=opt)
    return losses


def resume_worker(rank: int, world: int, path: str, layout: str, with_optimizer: bool) -> Any:
    H.quiet()
    model, _ = H.build(KIND, seed=1)  # other weights: everything must come from the checkpoint
    _, inputs = H.build(KIND)  # the same batch as the reference
    pm = autopar.parallelize(
        model, autopar.Cluster.local(world), inputs, plan=_plan(layout, model, inputs, world)
    )
    opt = H.make_optimizer("adamw", pm.parameters())
    checkpoint.load(pm, path, optimizer=opt if with_optimizer else None)
    losses = H.train(pm, inputs, opt, steps=2)
    return losses, pm.full_state_dict(), tuple(pm.plan.mesh_shape)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[float]]:
    path = str(tmp_path_factory.mktemp("ckpt") / "step2")
    losses = spawn(save_worker, 2, path, timeout=200)[0]
    assert os.path.exists(os.path.join(path, ".metadata"))
    return path, losses


@pytest.fixture(scope="module")
def reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    return H.reference(KIND, "adamw", steps=4)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("layout", "world"), [("dp", 2), ("megatron", 4)])
def test_resume_under_another_plan_continues_exactly(saved, reference, layout, world):
    path, first = saved
    ref_losses, ref_sd = reference
    assert all(abs(a - b) <= H.LOSS_RTOL * abs(b) for a, b in zip(first, ref_losses[:2])), (first, ref_losses)
    runs = spawn(resume_worker, world, path, layout, True, timeout=250)
    losses, sd, mesh = runs[0]
    assert mesh == ((world,) if layout == "dp" else (2, 2))
    problems = H.compare_training(
        (ref_losses[2:], ref_sd), (losses, sd), "adamw", f"resumed under {layout} on {world}"
    )
    assert not problems, "\n".join(problems)


@pytest.mark.timeout(300)
def test_resuming_without_the_optimizer_state_is_detected(saved, reference):
    path, _ = saved
    ref_losses, _ = reference
    losses, _, _ = spawn(resume_worker, 2, path, "dp", False, timeout=250)[0]
    assert abs(losses[0] - ref_losses[2]) <= H.LOSS_RTOL * abs(ref_losses[2])  # the weights were restored
    assert abs(losses[1] - ref_losses[3]) > H.LOSS_RTOL * abs(ref_losses[3])  # AdamW's moments restarted

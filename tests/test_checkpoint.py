"""Sharded checkpoints (torch.distributed.checkpoint) resume under another plan exactly.

Train 2 AdamW steps under the Megatron layout (tp=2, 2 processes), save model and optimizer state
with DCP; load under a data-parallel plan (2 processes) and under tp=2 × dp=2 (4 processes), train
2 more steps: the losses and the parameters equal 4 uninterrupted steps on one process (the
tolerances of ``_runtime_helpers``). Without the optimizer state, AdamW's moments restart and the
resumed losses differ (the test shows the check can fail). A pipelined module (pp=2 × dp=2 on 4
processes) saves the same way and resumes under dp=2 and under pp=2 on 2 processes.
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


# ------------------------------------------------------------------------------ pipelined modules

PP_KIND = "gpt"  # autopar's GPT: its tied embedding and head sit in the first and the last stage


def _pp_plans(model: Any, inputs: Any) -> dict[str, Any]:
    """pp=2 × dp=2 on 4 processes (the save), dp=2 and pp=2 on 2 (the loads)."""
    batch = {k: ("S(0)",) for k in H.input_paths(inputs)}
    replicated = {n: ("R",) for n, _ in model.named_parameters()}
    return {
        "pp2xdp2": autopar.plan(
            model, inputs, autopar.Cluster.local(4), pp=2, microbatches=2, schedule="1f1b",
            fixed={**batch, **replicated},
        ),
        "dp2": autopar.plan(model, inputs, autopar.Cluster.local(2), fixed=replicated, mesh_shape=(2,), pp=1),
        "pp2": autopar.plan(model, inputs, autopar.Cluster.local(2), pp=2, microbatches=2, schedule="1f1b"),
    }  # fmt: skip


def pp_save_worker(rank: int, world: int, path: str, plan: Any) -> dict[str, Any]:
    H.quiet()
    model, inputs = H.build(PP_KIND)
    pm = autopar.parallelize(model, autopar.Cluster.local(world), inputs, plan=plan)
    opt = H.make_optimizer("adamw", pm.parameters())
    losses = H.train(pm, inputs, opt, steps=2)
    sd = pm.state_dict(optimizer=opt)
    checkpoint.save(pm, path, optimizer=opt)
    pieces = [v.to_local() for k, v in sd.items() if k.startswith(checkpoint.MODEL)]
    return {
        "losses": losses,
        "coord": pm.pipeline.pp.coord,
        "keys": sorted(k for k in sd if k.startswith(checkpoint.MODEL)),
        "held": sum(p.numel() for p in pieces),
    }


def pp_resume_worker(rank: int, world: int, path: str, plan: Any) -> Any:
    H.quiet()
    model, _ = H.build(PP_KIND, seed=1)  # other weights: everything must come from the checkpoint
    _, inputs = H.build(PP_KIND)
    pm = autopar.parallelize(model, autopar.Cluster.local(world), inputs, plan=plan)
    opt = H.make_optimizer("adamw", pm.parameters())
    checkpoint.load(pm, path, optimizer=opt)
    losses = H.train(pm, inputs, opt, steps=2)
    return losses, pm.full_state_dict()


def pp_resume_each_worker(rank: int, world: int, path: str, plans: dict[str, Any]) -> dict[str, Any]:
    """``pp_resume_worker`` under each plan in turn, each from a fresh model: one spawn for all
    (starting processes and importing torch costs seconds, a resume a fraction of that)."""
    return {name: pp_resume_worker(rank, world, path, plan) for name, plan in plans.items()}


def _relative_errors(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per tensor, ``‖got − ref‖ / ‖ref‖``: AdamW turns rounding noise on a near-zero gradient
    into an update of up to ``lr``, so a tensor is compared as a whole, not element by element."""
    assert set(got) == set(ref), set(got) ^ set(ref)
    return {k: ((got[k].double() - ref[k].double()).norm() / ref[k].double().norm()).item() for k in ref}


@pytest.mark.timeout(900)
def test_pipelined_checkpoint_resumes_under_another_pipeline_shape(tmp_path):
    """pp=2 × dp=2 on 4 processes, 2 AdamW steps, saved with DCP (each rank writes its stages'
    pieces, keyed by the model's names; none holds the whole model); loaded under dp=2 and under
    pp=2 on 2 processes, 2 more steps: the losses and parameters of 4 steps on one process."""
    model, inputs = H.build(PP_KIND)
    plans = _pp_plans(model, inputs)
    assert plans["pp2xdp2"].pipeline.pp == 2 and plans["pp2xdp2"].mesh_shape == (2,)
    assert plans["dp2"].pipeline is None and plans["pp2"].pipeline.pp == 2
    ref_losses, ref_sd = H.reference(PP_KIND, "adamw", steps=4)
    total = sum(p.numel() for p in model.parameters())  # tied weights once, as the state dict stores them
    path = str(tmp_path / "pp2xdp2")
    saved = spawn(pp_save_worker, 4, path, plans["pp2xdp2"], timeout=300)
    assert os.path.exists(os.path.join(path, ".metadata"))
    for r in saved:
        assert all(abs(a - b) <= H.LOSS_RTOL * abs(b) for a, b in zip(r["losses"], ref_losses[:2])), r[
            "losses"
        ]
        assert r["held"] < total / 2, (r["held"], total)  # its stage's parameters, halved by dp
    keys = {c: {k for r in saved if r["coord"] == c for k in r["keys"]} for c in (0, 1)}
    assert keys[0] != keys[1] and keys[0] | keys[1] == {
        checkpoint.MODEL + n for n, _ in model.named_parameters()
    }
    resumed = spawn(
        pp_resume_each_worker, 2, path, {name: plans[name] for name in ("dp2", "pp2")}, timeout=300
    )[0]
    for name, (losses, sd) in resumed.items():
        assert all(abs(a - b) <= H.LOSS_RTOL * abs(b) for a, b in zip(losses, ref_losses[2:])), (
            name,
            losses,
            ref_losses[2:],
        )
        errors = _relative_errors(sd, ref_sd)
        worst = max(errors, key=errors.get)
        assert errors[worst] <= 1e-5, (name, worst, errors[worst])

"""ParallelModule's state and utilities for GPT-2 (tied ``lm_head.weight`` included) on 2 gloo
processes (tensor-parallel, data-parallel and ZeRO-3 plans) and on 4 (tp = 2 × dp = 2, ZeRO-3):

* ``load_full_state_dict`` scatters a full state dict into the shards: ``full_state_dict`` gives
  it back exactly, and the module computes what the loaded single-process model computes;
* ``clip_grad_norm_`` returns the global gradient norm ``torch.nn.utils.clip_grad_norm_`` returns
  on the single-process model, and clips the same way;
* ``local_inputs=True`` with each rank passing ``pm.shard_inputs(...)`` gives the loss and the
  gradients of the global batch.

Gradients are read back with public API only: one SGD step with ``lr=1`` and
``full_state_dict`` before minus after.
"""

from __future__ import annotations

from typing import Any

import _runtime_helpers as H
import pytest
import torch

import autopar
from autopar.runtime.launch import spawn

pytestmark = pytest.mark.filterwarnings("ignore:autopar. no sharding rule")

KIND = "gpt2"
LAYOUTS = {2: ("megatron", "dp", "zero3"), 4: ("tp2dp2", "zero3")}
MAX_NORM = 0.05


def _perturbed(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A state dict unlike the initial one (tied weights stay tied: they are one Parameter)."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _grads_by_sgd(pm: Any) -> dict[str, torch.Tensor]:
    """The gradients in ``pm``'s parameters, gathered: one SGD step (lr = 1) and a state diff."""
    before = pm.full_state_dict()
    torch.optim.SGD(pm.parameters(), lr=1.0).step()
    after = pm.full_state_dict()
    pm.load_full_state_dict(before)
    return {k: before[k] - after[k] for k in before}


def state_worker(rank: int, world: int, plans: dict[str, Any]) -> dict[str, dict[str, Any]]:
    H.quiet()
    cluster = autopar.Cluster.local(world)
    out: dict[str, dict[str, Any]] = {}
    cap = autopar.capture(*H.build(KIND))  # one export for every module below (the same structure)
    for mode, plan in plans.items():
        model, inputs = H.build(KIND)
        res: dict[str, Any] = {}
        pm = autopar.parallelize(model, cluster, inputs, plan=plan, captured=cap)

        # local inputs: each rank passes its shard of the global batch
        local_pm = autopar.parallelize(model, cluster, inputs, plan=pm.plan, local_inputs=True, captured=cap)
        shards = pm.shard_inputs(**inputs)
        res["input_specs"] = dict(pm.input_specs)
        res["shard_shapes"] = {k: tuple(v.shape) for k, v in shards.items()}
        loss = H.loss_of(pm(**inputs))
        loss.backward()
        local_loss = H.loss_of(local_pm(**shards))
        local_loss.backward()
        res["loss"], res["local_loss"] = loss.item(), local_loss.item()
        res["grads"], res["local_grads"] = _grads_by_sgd(pm), _grads_by_sgd(local_pm)

        # clip_grad_norm_ after one backward (the gradients of the step above)
        res["norm"] = pm.clip_grad_norm_(MAX_NORM).item()
        res["clipped"] = _grads_by_sgd(pm)

        # load_full_state_dict / full_state_dict
        loaded = _perturbed(model)
        pm.load_full_state_dict(loaded)
        res["round_trip"] = pm.full_state_dict()
        res["loaded"] = loaded
        with torch.no_grad():
            res["loaded_loss"] = H.loss_of(pm(**inputs)).item()
            res["loaded_ref_loss"] = H.loss_of(model(**inputs)).item()
        out[mode] = res
    return out


@pytest.fixture(scope="module", params=sorted(LAYOUTS), ids=lambda w: f"{w} processes")
def state_runs(request: pytest.FixtureRequest) -> list[dict[str, dict[str, Any]]]:
    world = request.param
    model, inputs = H.build(KIND)
    plans = {mode: H.make_plan(mode, model, inputs, world) for mode in LAYOUTS[world]}
    return spawn(state_worker, world, plans, timeout=150)


def _reference() -> tuple[float, dict[str, torch.Tensor], float, dict[str, torch.Tensor]]:
    """Single process: loss, gradients by state-dict key, clip norm, clipped gradients."""
    model, inputs = H.build(KIND)
    loss = H.loss_of(model(**inputs))
    loss.backward()
    named = dict(model.named_parameters(remove_duplicate=False))
    grads = {k: named[k].grad.clone() for k in model.state_dict()}
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item()
    clipped = {k: named[k].grad.clone() for k in model.state_dict()}
    return loss.item(), grads, norm, clipped


def _assert_grads(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert set(got) == set(want), what
    for k in want:
        torch.testing.assert_close(
            got[k], want[k], rtol=1e-4, atol=1e-7, msg=lambda m, k=k: f"{what}, {k}: {m}"
        )


@pytest.mark.distributed
@pytest.mark.timeout(200)
def test_load_full_state_dict_round_trips_and_computes_like_the_loaded_model(state_runs):
    for rank, run in enumerate(state_runs):
        for mode, res in run.items():
            loaded, back = res["loaded"], res["round_trip"]
            assert list(back) == list(loaded), f"rank {rank} {mode}: keys differ"
            assert "lm_head.weight" in back
            for k in loaded:
                assert torch.equal(back[k], loaded[k]), f"rank {rank} {mode}: {k} did not round-trip"
            assert abs(res["loaded_loss"] - res["loaded_ref_loss"]) <= 1e-5 * abs(res["loaded_ref_loss"]), (
                rank, mode, res["loaded_loss"], res["loaded_ref_loss"],
            )  # fmt: skip


@pytest.mark.distributed
@pytest.mark.timeout(200)
def test_clip_grad_norm_matches_torch_on_one_process(state_runs):
    _, grads, ref_norm, clipped = _reference()
    assert ref_norm > MAX_NORM, "the test must actually clip"
    for rank, run in enumerate(state_runs):
        for mode, res in run.items():
            assert abs(res["norm"] - ref_norm) <= 1e-5 * ref_norm, (rank, mode, res["norm"], ref_norm)
            _assert_grads(res["grads"], grads, f"rank {rank} {mode} gradients")
            _assert_grads(res["clipped"], clipped, f"rank {rank} {mode} clipped gradients")


@pytest.mark.distributed
@pytest.mark.timeout(200)
def test_local_inputs_give_the_global_batchs_loss_and_gradients(state_runs):
    ref_loss = _reference()[0]
    for rank, run in enumerate(state_runs):
        for mode, res in run.items():
            assert abs(res["loss"] - ref_loss) <= 1e-5 * ref_loss
            assert abs(res["local_loss"] - res["loss"]) <= 1e-6 * res["loss"], (rank, mode)
            _assert_grads(res["local_grads"], res["grads"], f"rank {rank} {mode} local_inputs")
    # The data-parallel axis splits the batch; each rank passes its rows.
    split = {"dp": (("S(0)",), 2), "tp2dp2": (("S(0)", "R"), 2)}
    for mode, (spec, dp) in split.items():
        if mode in state_runs[0]:
            assert state_runs[0][mode]["input_specs"]["input_ids"] == spec
            assert state_runs[0][mode]["shard_shapes"]["input_ids"] == (H.BATCH // dp, H.SEQ)

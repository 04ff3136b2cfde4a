"""Sharded checkpoints (torch.distributed.checkpoint) resume under another plan exactly.

Train 2 AdamW steps under the Megatron layout (tp=2, 2 processes), save model and optimizer state
with DCP; load under a data-parallel plan (2 processes) and under tp=2 × dp=2 (4 processes), train
2 more steps: the losses and the parameters equal 4 uninterrupted steps on one process (the
tolerances of ``_runtime_helpers``). Without the optimizer state, AdamW's moments restart and the
resumed losses differ (the test shows the check can fail). A pipelined module (pp=2 × dp=2 on 4
processes) saves the same way and resumes under dp=2 and under pp=2 on 2 processes.

Every plan is made once, here, and every case runs in one of three spawns, in the order the
checkpoints need (starting processes and importing torch costs seconds, a case a fraction of
that): the Megatron save on 2 processes; the tp=2 × dp=2 resume and the pipelined save on 4; the
resumes on 2. The tests read the results (``runs``), each asserting its own case.
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

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.filterwarnings("ignore:autopar. no sharding rule"),
    pytest.mark.filterwarnings("ignore:autopar. the plan audit"),  # the plans are made here, not per rank
]

KIND = "gpt2"  # fused QKV (block-sharded under tensor parallelism), tied LM head
PP_KIND = "gpt"  # autopar's GPT: its tied embedding and head sit in the first and the last stage


def _plans() -> dict[str, Any]:
    """Every plan of the module, by name: ``KIND`` under Megatron (tp=2 on 2, tp=2 × dp=2 on 4) and
    data parallelism (dp=2); ``PP_KIND`` under pp=2 × dp=2 on 4 processes (the save), dp=2 and
    pp=2 on 2 (the loads)."""
    model, inputs = H.build(KIND)
    replicated = {n: ("R",) for n, _ in model.named_parameters()}
    pp_model, pp_inputs = H.build(PP_KIND)
    batch = {k: ("S(0)",) for k in H.input_paths(pp_inputs)}
    pp_replicated = {n: ("R",) for n, _ in pp_model.named_parameters()}
    two, four = autopar.Cluster.local(2), autopar.Cluster.local(4)
    return {
        "megatron 2": autopar.layouts.megatron(model, inputs, two, tp=2, dp=1),
        "megatron 4": autopar.layouts.megatron(model, inputs, four, tp=2, dp=2),
        "dp 2": autopar.plan(model, inputs, two, fixed=replicated, mesh_shape=(2,)),
        "dp 2 offload": autopar.plan(
            model, inputs, autopar.Cluster.local(2, host=True), fixed=replicated, mesh_shape=(2,), offload_optimizer=True
        ),
        "pp2xdp2": autopar.plan(
            pp_model, pp_inputs, four, pp=2, microbatches=2, schedule="1f1b", fixed={**batch, **pp_replicated},
        ),
        "pp dp2": autopar.plan(pp_model, pp_inputs, two, fixed=pp_replicated, mesh_shape=(2,), pp=1),
        "pp2": autopar.plan(pp_model, pp_inputs, two, pp=2, microbatches=2, schedule="1f1b"),
    }  # fmt: skip


def save(rank: int, world: int, path: str, plan: Any) -> list[float]:
    """``KIND`` trained 2 AdamW steps under ``plan``, saved with its optimizer to ``path``."""
    model, inputs = H.build(KIND)
    pm = autopar.parallelize(model, autopar.Cluster.local(world), inputs, plan=plan)
    opt = H.make_optimizer("adamw", pm.parameters())
    losses = H.train(pm, inputs, opt, steps=2)
    checkpoint.save(pm, path, optimizer=opt)
    return losses


def resume(rank: int, world: int, kind: str, path: str, plan: Any, with_optimizer: bool = True) -> Any:
    """``kind`` built with other weights (everything must come from the checkpoint), loaded from
    ``path`` under ``plan`` and trained 2 more steps on the reference's batch; the optimizer the
    plan trains with (``pm.optimizer``: on the host where it offloads it)."""
    model, _ = H.build(kind, seed=1)
    _, inputs = H.build(kind)
    pm = autopar.parallelize(model, autopar.Cluster.local(world), inputs, plan=plan)
    opt = pm.optimizer(torch.optim.AdamW, lr=1e-3, eps=1e-6)  # H.make_optimizer's AdamW
    checkpoint.load(pm, path, optimizer=opt if with_optimizer else None)
    losses = H.train(pm, inputs, opt, steps=2)
    return losses, pm.full_state_dict(), tuple(pm.plan.mesh_shape)


def pp_save(rank: int, world: int, path: str, plan: Any) -> dict[str, Any]:
    """``PP_KIND`` trained 2 AdamW steps under the pipelined ``plan`` and saved: its losses, its
    pipeline coordinate, and the model keys and elements this rank's state dict holds."""
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


CASES = {"save": save, "resume": resume, "pp_save": pp_save}


def cases_worker(rank: int, world: int, cases: list[tuple[str, str, tuple]]) -> dict[str, Any]:
    """Run each ``(name, case, args)`` in turn in one process group: ``CASES[case](rank, world,
    *args)``, its result under ``name``; a failure names the case."""
    H.quiet()
    out = {}
    for name, case, args in cases:
        try:
            out[name] = CASES[case](rank, world, *args)
        except Exception as e:
            raise RuntimeError(f"checkpoint case {name!r} failed on rank {rank} of {world}") from e
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every case's per-rank results by name, from three spawns in the order the checkpoints need."""
    plans = _plans()
    tmp = tmp_path_factory.mktemp("ckpt")
    step2, pp = str(tmp / "step2"), str(tmp / "pp2xdp2")
    out = {"plans": plans}
    out |= _by_name(spawn(cases_worker, 2, [("save", "save", (step2, plans["megatron 2"]))], timeout=200))
    assert os.path.exists(os.path.join(step2, ".metadata"))
    four = [
        ("megatron 4", "resume", (KIND, step2, plans["megatron 4"])),
        ("pp save", "pp_save", (pp, plans["pp2xdp2"])),
    ]
    out |= _by_name(spawn(cases_worker, 4, four, timeout=400))
    assert os.path.exists(os.path.join(pp, ".metadata"))
    two = [
        ("dp 2", "resume", (KIND, step2, plans["dp 2"])),
        ("dp 2 without the optimizer", "resume", (KIND, step2, plans["dp 2"], False)),
        ("dp 2 offload", "resume", (KIND, step2, plans["dp 2 offload"])),
        ("pp dp2", "resume", (PP_KIND, pp, plans["pp dp2"])),
        ("pp2", "resume", (PP_KIND, pp, plans["pp2"])),
    ]
    out |= _by_name(spawn(cases_worker, 2, two, timeout=400))
    return out


def _by_name(results: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """Per-rank results (one dict of cases per rank) as one list by rank per case."""
    return {name: [r[name] for r in results] for name in results[0]}


@pytest.fixture(scope="module")
def reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    return H.reference(KIND, "adamw", steps=4)


@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    ("name", "mesh"), [("dp 2", (2,)), ("megatron 4", (2, 2)), ("dp 2 offload", (2,))]
)  # the last with the optimizer on the host (runtime.host_optimizer): its moments loaded into the host state
def test_resume_under_another_plan_continues_exactly(runs, reference, name, mesh):
    first = runs["save"][0]
    ref_losses, ref_sd = reference
    assert all(abs(a - b) <= H.LOSS_RTOL * abs(b) for a, b in zip(first, ref_losses[:2])), (first, ref_losses)
    losses, sd, got_mesh = runs[name][0]
    assert got_mesh == mesh
    problems = H.compare_training((ref_losses[2:], ref_sd), (losses, sd), "adamw", f"resumed under {name}")
    assert not problems, "\n".join(problems)


@pytest.mark.timeout(900)
def test_resuming_without_the_optimizer_state_is_detected(runs, reference):
    ref_losses, _ = reference
    losses, _, _ = runs["dp 2 without the optimizer"][0]
    assert abs(losses[0] - ref_losses[2]) <= H.LOSS_RTOL * abs(ref_losses[2])  # the weights were restored
    assert abs(losses[1] - ref_losses[3]) > H.LOSS_RTOL * abs(ref_losses[3])  # AdamW's moments restarted


# ------------------------------------------------------------------------------ pipelined modules


def _relative_errors(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per tensor, ``‖got − ref‖ / ‖ref‖``: AdamW turns rounding noise on a near-zero gradient
    into an update of up to ``lr``, so a tensor is compared as a whole, not element by element."""
    assert set(got) == set(ref), set(got) ^ set(ref)
    return {k: ((got[k].double() - ref[k].double()).norm() / ref[k].double().norm()).item() for k in ref}


@pytest.mark.timeout(900)
def test_pipelined_checkpoint_resumes_under_another_pipeline_shape(runs):
    """pp=2 × dp=2 on 4 processes, 2 AdamW steps, saved with DCP (each rank writes its stages'
    pieces, keyed by the model's names; none holds the whole model); loaded under dp=2 and under
    pp=2 on 2 processes, 2 more steps: the losses and parameters of 4 steps on one process."""
    plans = runs["plans"]
    assert plans["pp2xdp2"].pipeline.pp == 2 and plans["pp2xdp2"].mesh_shape == (2,)
    assert plans["pp dp2"].pipeline is None and plans["pp2"].pipeline.pp == 2
    model, _ = H.build(PP_KIND)
    ref_losses, ref_sd = H.reference(PP_KIND, "adamw", steps=4)
    total = sum(p.numel() for p in model.parameters())  # tied weights once, as the state dict stores them
    saved = runs["pp save"]
    for r in saved:
        assert all(abs(a - b) <= H.LOSS_RTOL * abs(b) for a, b in zip(r["losses"], ref_losses[:2])), r[
            "losses"
        ]
        assert r["held"] < total / 2, (r["held"], total)  # its stage's parameters, halved by dp
    keys = {c: {k for r in saved if r["coord"] == c for k in r["keys"]} for c in (0, 1)}
    assert keys[0] != keys[1] and keys[0] | keys[1] == {
        checkpoint.MODEL + n for n, _ in model.named_parameters()
    }
    for name in ("pp dp2", "pp2"):
        losses, sd, _ = runs[name][0]
        assert all(abs(a - b) <= H.LOSS_RTOL * abs(b) for a, b in zip(losses, ref_losses[2:])), (
            name,
            losses,
            ref_losses[2:],
        )
        errors = _relative_errors(sd, ref_sd)
        worst = max(errors, key=errors.get)
        assert errors[worst] <= 1e-5, (name, worst, errors[worst])

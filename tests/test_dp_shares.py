"""Unequal data-parallel shares (``autopar.dp_shares``, ``PipelinePlan.dp_shares``): the min-max
assignment, the record's checks, the planner giving a faster node group more micro-batches where
nothing ties the replicas together inside a micro-batch (and saying why not where something
does), the simulator replaying it, and on 4 gloo processes (2 "nodes" of 2, the second 3×
faster) training equal to one process with the shares unequal."""

from __future__ import annotations

import dataclasses
import itertools
import json
from typing import Any

import pytest
import torch

import autopar
from autopar.dp_shares import balance, share_blockers
from autopar.planfile import PipelinePlan, Plan
from autopar.simulate import simulate

pytestmark = pytest.mark.filterwarnings("ignore:autopar")

VOCAB, BATCH = 512, 16


def _model(seed: int = 0, vocab: int = VOCAB, kind: str = "llama") -> tuple[torch.nn.Module, Any]:
    """A tiny LLaMA (or, ``kind="gpt"``, ``autopar.models.GPT`` with learned positions) whose
    logits are large enough that the loss is split by rows (not gathered)."""
    from _runtime_helpers import build

    return build(kind, seed, vocab=vocab, batch=BATCH)


def _mixed() -> autopar.Cluster:
    from test_heterogeneous import _local_mixed

    return _local_mixed(3.0)


def test_balance_is_the_min_max_assignment():
    for times in ([1.0, 3.0], [1.0, 1.0, 2.5], [0.3, 0.7, 0.7, 1.9]):
        for total in range(len(times), 13):
            got = balance(times, total)
            assert sum(got) == total and min(got) >= 1
            best = min(
                max(k * t for k, t in zip(ks, times))
                for ks in itertools.product(range(1, total + 1), repeat=len(times))
                if sum(ks) == total
            )
            assert max(k * t for k, t in zip(got, times)) == pytest.approx(best)
    assert balance([1.0, 3.0], 8) == (6, 2)  # the 3× faster replica gets 3× the micro-batches
    with pytest.raises(ValueError, match="cannot give each of 3 replicas one"):
        balance([1.0, 1.0, 1.0], 2)
    with pytest.raises(ValueError, match="must be positive"):
        balance([1.0, 0.0], 4)


def test_the_record_checks_its_shares_and_round_trips():
    base = {"pp": 1, "microbatches": 4, "schedule": "1f1b", "virtual": 1, "stage_of": {"a": 0}}
    p = PipelinePlan(
        **base,
        dp_shares=(2, 6),
        replica_costs=({"forward": 1.0, "backward_input": 1.0, "backward_weight": 1.0},) * 2,
    )
    assert PipelinePlan.from_dict(json.loads(json.dumps(p.to_dict()))) == p
    assert (p.microbatches_at(0), p.microbatches_at(1)) == (2, 6)
    assert [len(a) for a in p.actions(1)] == [18]  # F, B, W of each of its 6 micro-batches
    with pytest.raises(ValueError, match=r"sum to microbatches × 2 = 4 × 2 = 8 \(they sum to 7\)"):
        PipelinePlan(**base, dp_shares=(1, 6))
    with pytest.raises(ValueError, match="one stage"):
        PipelinePlan(**{**base, "pp": 2}, dp_shares=(2, 6))
    with pytest.raises(ValueError, match="needs the first axis's coordinate"):
        p.actions()
    with pytest.raises(ValueError, match="only with dp_shares"):
        PipelinePlan(**base, replica_costs=({},))


def test_replicas_are_runs_of_one_device_kind():
    mixed = _mixed()
    parts = mixed.replicas(2)
    assert parts is not None and [c.device.name for c in parts] == ["cpu-process", "cpu-process-fast"]
    assert [c.device.name for c in mixed.replicas(4) or []] == ["cpu-process"] * 2 + ["cpu-process-fast"] * 2
    assert mixed.replicas(3) is None and mixed.replicas(1) is None


def test_the_faster_group_gets_more_micro_batches_and_the_step_replays():
    model, inputs = _model()
    mixed = _mixed()
    plan = autopar.plan(model, inputs, mixed, pp=1, microbatches=4, mesh_shape=(2, 2))
    pipe = plan.pipeline
    assert pipe is not None and pipe.dp_shares[1] > pipe.dp_shares[0] and sum(pipe.dp_shares) == 8, pipe
    assert share_blockers(plan) == []
    # The saved plan replays to the step it was chosen by, and beats equal shares held to the floor.
    again = Plan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert simulate(again).step_time == pytest.approx(plan.predicted.step_time, rel=1e-9)
    # Without each replica's own costs, every replica plays the stage's (the floor's): the largest
    # share is then the slowest.
    bare = dataclasses.replace(plan, pipeline=dataclasses.replace(pipe, replica_costs=()))
    assert simulate(bare).microbatches == max(pipe.dp_shares)
    assert simulate(bare).step_time > plan.predicted.step_time
    equal = autopar.plan(model, inputs, mixed.uniform(), pp=1, microbatches=4, mesh_shape=(2, 2))
    assert plan.predicted.step_time < 0.8 * equal.predicted.step_time
    assert "8 in all" in plan.summary() and "cpu-process-fast run" in plan.summary()
    # An engine's layout cannot say it: the export notes what it drops.
    from autopar.export import export

    assert any("unequal shares" in n for n in export(plan, "megatron").notes)


def test_the_search_tries_unequal_shares_on_a_mixed_cluster():
    model, inputs = _model()
    plan = autopar.plan(model, inputs, _mixed(), mesh_shape=(2, 2))  # pp="auto": the whole batch fits
    tried = plan.info["pipeline_candidates"]
    shared = [t for t in tried if "shares" in t.get("candidate", "")]
    assert shared and all(t["pp"] == 1 and t["microbatches"] > 1 for t in shared), tried
    # Each shares candidate beats its own equal-shares candidate, held to the floor.
    for t in shared:
        equal = next(u for u in tried if u.get("candidate") == t["candidate"].split(" shares")[0])
        assert t["step_time"] < equal["step_time"]
    assert plan.predicted.step_time <= min(t["step_time"] for t in shared) * (1 + 1e-9)


def test_a_plan_that_ties_the_replicas_together_is_planned_again_keeping_them_apart(caplog):
    model, inputs = _model(vocab=64)  # small logits: the solver gathers them over the first axis
    tied = autopar.plan(model, inputs, _mixed().uniform(), pp=1, microbatches=4, mesh_shape=(4,))
    why = share_blockers(tied)
    assert any("over the first axis in every micro-batch" in w for w in why), why
    with caplog.at_level("INFO", logger="autopar.planner"):
        plan = autopar.plan(model, inputs, _mixed(), pp=1, microbatches=4, mesh_shape=(4,))
    assert "no unequal data-parallel shares" in caplog.text  # the first stage plan, as the solver chose
    # Planned again with PlanConfig.replicas_first: nothing crosses the first axis in a micro-batch.
    pipe = plan.pipeline
    assert pipe is not None and len(set(pipe.dp_shares)) > 1, pipe
    assert share_blockers(plan) == []
    assert all(not c.startswith("all_gather") for r in plan.reshards for c in r.collectives if "axis=0" in c)
    with pytest.raises(ValueError, match="replicas_first is True or False"):
        autopar.PlanConfig(replicas_first="yes")


def _shares_worker(rank: int, world: int, plans: list[tuple[str, Any]]) -> list[dict[str, Any]]:
    import warnings

    from _runtime_helpers import call, loss_of, make_optimizer, train

    warnings.simplefilter("ignore")
    out = []
    for kind, plan in plans:
        model, inputs = _model(kind=kind.split(":")[0], vocab=int(kind.split(":")[1]))
        pm = autopar.parallelize(model, autopar.Cluster.local(world), inputs, plan=plan)
        with torch.no_grad():  # evaluation runs the rank's share too, the loss summed over replicas
            first = loss_of(call(pm, inputs)).item()
        losses = train(pm, inputs, make_optimizer("sgd", pm.parameters()))
        out.append(
            {
                "first": first,
                "losses": losses,
                "state": pm.full_state_dict(),
                "ran": pm.pipeline.microbatches,
                "report": pm.report(),
                "outputs_kept": pm.pipeline.last["outputs_kept"],
            }
        )
    return out


@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_unequal_shares_train_like_one_process():
    from _runtime_helpers import compare_training, make_optimizer, train

    from autopar.runtime.launch import spawn

    # LLaMA on two meshes; the GPT's position-embedding gradient is reduced at its weight, once
    # a step (``passes.param_syncs``), so it does not tie the replicas either.
    plans = []
    # LLaMA with a small vocabulary is planned a second time keeping the first axis to replicas
    # (``PlanConfig.replicas_first``): that plan must run too.
    for kind, mesh in (("llama:512", (2, 2)), ("llama:512", (4,)), ("gpt:512", (4,)), ("llama:64", (2, 2))):
        model, inputs = _model(kind=kind.split(":")[0], vocab=int(kind.split(":")[1]))
        plans.append((kind, autopar.plan(model, inputs, _mixed(), pp=1, microbatches=4, mesh_shape=mesh)))
    for _, p in plans:
        assert p.pipeline is not None and len(set(p.pipeline.dp_shares)) > 1, p.pipeline
    refs = {}
    for kind in ("llama:512", "gpt:512", "llama:64"):
        ref_model, inputs = _model(kind=kind.split(":")[0], vocab=int(kind.split(":")[1]))
        losses = train(ref_model, inputs, make_optimizer("sgd", ref_model.parameters()))
        refs[kind] = (losses, ref_model.state_dict())
    out = spawn(_shares_worker, 4, plans)
    for k, (kind, p) in enumerate(plans):
        ref = refs[kind]
        shares = p.pipeline.dp_shares
        size = 4 // len(shares)
        for r, got in enumerate(out):
            assert got[k]["ran"] == shares[r // size]  # each rank ran its replica's share
            assert f"{shares[r // size]} micro-batches" in got[k]["report"]  # and is predicted as its own
            assert got[k]["first"] == pytest.approx(ref[0][0], rel=1e-5)
            # The logits LLaMA returns beside its loss are not kept to the step's end: only the losses.
            assert got[k]["outputs_kept"] <= 4 * shares[r // size], got[k]["outputs_kept"]
            problems = compare_training(
                ref, (got[k]["losses"], got[k]["state"]), "sgd", f"{kind} shares {shares} rank {r}"
            )
            assert not problems, "\n".join(problems)

"""Unequal data-parallel shares (``autopar.dp_shares``, ``PipelinePlan.dp_shares``): the min-max
assignment, the record's checks, the planner giving a faster node group more micro-batches where
nothing ties the replicas together inside a micro-batch (and saying why not where something
does), the simulator replaying it, and on 4 gloo processes (2 "nodes" of 2, the second 3×
faster) training equal to one process with the shares unequal."""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest
import torch

import autopar
from autopar.dp_shares import balance, replica_clusters, share_blockers
from autopar.planfile import PipelinePlan, Plan
from autopar.simulate import simulate

pytestmark = pytest.mark.filterwarnings("ignore:autopar")

VOCAB, BATCH, SEQ = 512, 16, 16


def _model(seed: int = 0, vocab: int = VOCAB) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """A tiny LLaMA whose logits are large enough that the loss is split by rows (not gathered)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, vocab_size=vocab, max_position_embeddings=32, use_cache=False,
        bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    model = LlamaForCausalLM(cfg)
    ids = torch.randint(0, vocab, (BATCH, SEQ))
    return model, {"input_ids": ids, "labels": torch.randint(0, vocab, (BATCH, SEQ))}


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
    parts = replica_clusters(mixed, 2)
    assert parts is not None and [c.device.name for c in parts] == ["cpu-process", "cpu-process-fast"]
    assert [c.device.name for c in replica_clusters(mixed, 4) or []] == ["cpu-process"] * 2 + [
        "cpu-process-fast"
    ] * 2
    assert replica_clusters(mixed, 3) is None and replica_clusters(mixed, 1) is None


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
    equal = autopar.plan(model, inputs, mixed.uniform(), pp=1, microbatches=4, mesh_shape=(2, 2))
    assert plan.predicted.step_time < 0.8 * equal.predicted.step_time
    assert "shares" in plan.summary()


def test_a_plan_that_ties_the_replicas_together_keeps_equal_shares_and_says_why(caplog):
    model, inputs = _model(vocab=64)  # small logits: the solver gathers them over the first axis
    with caplog.at_level("INFO", logger="autopar.planner"):
        plan = autopar.plan(model, inputs, _mixed(), pp=1, microbatches=4, mesh_shape=(4,))
    assert plan.pipeline is not None and plan.pipeline.dp_shares == ()
    why = share_blockers(plan)
    assert any("over the first axis in every micro-batch" in w for w in why), why
    assert "no unequal data-parallel shares" in caplog.text


def _shares_worker(rank: int, world: int, plans: list[Any]) -> list[dict[str, Any]]:
    import warnings

    from _runtime_helpers import make_optimizer, train

    warnings.simplefilter("ignore")
    out = []
    for plan in plans:
        model, inputs = _model()
        pm = autopar.parallelize(model, autopar.Cluster.local(world), inputs, plan=plan)
        losses = train(pm, inputs, make_optimizer("sgd", pm.parameters()))
        out.append({"losses": losses, "state": pm.full_state_dict(), "ran": pm.pipeline.microbatches})
    return out


@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_unequal_shares_train_like_one_process():
    from _runtime_helpers import compare_training, make_optimizer, train

    from autopar.runtime.launch import spawn

    model, inputs = _model()
    plans = [
        autopar.plan(model, inputs, _mixed(), pp=1, microbatches=4, mesh_shape=mesh)
        for mesh in ((2, 2), (4,))
    ]
    for p in plans:
        assert p.pipeline is not None and len(set(p.pipeline.dp_shares)) > 1, p.pipeline
    ref_model, _ = _model()
    ref = (train(ref_model, inputs, make_optimizer("sgd", ref_model.parameters())), ref_model.state_dict())
    out = spawn(_shares_worker, 4, plans)
    for k, p in enumerate(plans):
        shares = p.pipeline.dp_shares
        size = 4 // len(shares)
        for r, got in enumerate(out):
            assert got[k]["ran"] == shares[r // size]  # each rank ran its replica's share
            problems = compare_training(
                ref, (got[k]["losses"], got[k]["state"]), "sgd", f"shares {shares} rank {r}"
            )
            assert not problems, "\n".join(problems)

"""Collective counts follow the plan, and for one transformer block under the Megatron layout
they are Megatron-LM's (Shoeybi et al., arXiv 1909.08053, §3; Korthikanti et al., arXiv
2205.05198, §4.2.2), counted on the tensor-parallel axis (``pm.axes[0].counts``) over one training
step and, with their sizes, by ``_runtime_helpers.CollectiveLog``:

* tensor parallelism: two all-reduces forward (``g`` after the attention and MLP output
  projections) and two backward (``f`` before the QKV and MLP input projections);
* sequence parallelism: each all-reduce becomes a reduce-scatter / all-gather pair — two of each
  forward, two of each backward — and no activation is all-reduced. What remains all-reduced: the
  scalar loss forward (the sequence-split mean), and backward the gradients of the LayerNorm
  weights and biases, which are replicated but read by sequence-split LayerNorms (Megatron-LM
  all-reduces them too); ours go in one bucket (``autopar.runtime.buckets``).

The layout fixes the weights; the solver places activations by cost. For activations of a few
KiB latency dominates, and the cheapest sequence-parallel plan keeps the residual stream
``Partial`` (one all-reduce instead of a reduce-scatter + all-gather); for larger ones plain tensor
parallelism splits the residual add between a reduce-scatter and an all-gather (the same bytes as
the all-reduce, half the add). Each case therefore uses a size where Megatron's pattern is the
optimum of the cost model, and the test also checks the plan says so.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import _runtime_helpers as H
import pytest
import torch

import autopar
from autopar.runtime.launch import spawn

TP = 2
CASES = {"tensor parallel": ((2, 8, 32), False), "sequence parallel": ((8, 64, 64), True)}


def counts_worker(
    rank: int, world: int, cases: list[tuple[str, tuple[int, int, int], Any]]
) -> dict[str, Any]:
    """One SGD step (lr = 1) of ``OneBlock`` per case: the collectives it issued, its loss, and the
    gradients (initial minus updated weights, gathered with ``full_state_dict``)."""
    H.quiet()
    out = {}
    for name, shape, plan in cases:
        model, inputs = H.build_block(*shape)
        initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
        pm = autopar.parallelize(model, autopar.Cluster.local(world), inputs, plan=plan)
        opt = torch.optim.SGD(pm.parameters(), lr=1.0)
        before = Counter(pm.axes[0].counts)
        with H.CollectiveLog() as log:
            loss = pm(*inputs)
            loss.backward()
        counts = Counter(pm.axes[0].counts)
        counts.subtract(before)
        opt.step()
        after = pm.full_state_dict()
        out[name] = {
            "counts": {k: v for k, v in counts.items() if v},
            "log": [tuple(c) for c in log.calls],
            "loss": loss.item(),
            "grads": {k: initial[k] - after[k] for k in initial},
            "axis": pm.axes[0].name,
        }
    return out


def _plan_collectives(plan: autopar.Plan) -> Counter:
    """Forward collectives the plan lists between ops (``slice``/``to_partial`` are local)."""
    kinds = Counter(c.split("(")[0] for r in plan.reshards for c in r.collectives)
    return Counter({k: v for k, v in kinds.items() if k not in ("slice", "to_partial")})


@pytest.fixture(scope="module")
def block_runs() -> dict[str, Any]:
    cluster = autopar.Cluster.local(TP)
    cases, plans = [], {}
    for name, (shape, sp) in CASES.items():
        model, inputs = H.build_block(*shape)
        plans[name] = autopar.layouts.megatron(model, inputs, cluster, tp=TP, sequence_parallel=sp)
        cases.append((name, shape, plans[name]))
    runs = spawn(counts_worker, TP, cases, timeout=150)
    assert runs[0].keys() == runs[1].keys()
    return {"plans": plans, "runs": runs}


def _reference(shape: tuple[int, int, int]) -> tuple[float, dict[str, torch.Tensor]]:
    model, inputs = H.build_block(*shape)
    loss = model(*inputs)
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.distributed
@pytest.mark.timeout(200)
@pytest.mark.parametrize("name", list(CASES))
def test_block_step_is_exact(block_runs, name):
    ref_loss, ref_grads = _reference(CASES[name][0])
    for rank, run in enumerate(block_runs["runs"]):
        got = run[name]
        assert abs(got["loss"] - ref_loss) <= 1e-5 * abs(ref_loss), (rank, got["loss"], ref_loss)
        for k, g in ref_grads.items():
            torch.testing.assert_close(
                got["grads"][k], g, rtol=1e-4, atol=1e-6, msg=lambda m, k=k, r=rank: f"rank {r} {k}: {m}"
            )


@pytest.mark.distributed
@pytest.mark.timeout(200)
def test_tensor_parallel_block_all_reduces_twice_forward_and_twice_backward(block_runs):
    (b, t, c), _ = CASES["tensor parallel"]
    plan = block_runs["plans"]["tensor parallel"]
    assert _plan_collectives(plan) == Counter({"all_reduce": 2}), plan.reshards
    for rank, run in enumerate(block_runs["runs"]):
        got = run["tensor parallel"]
        assert got["axis"] == "tp"
        assert got["counts"] == {"all_reduce/fwd": 2, "all_reduce/bwd": 2}, f"rank {rank}: {got['counts']}"
        # All four move a whole activation [B, T, C] (g forward, f backward).
        assert sorted(got["log"]) == sorted(
            [("all_reduce", "fwd", b * t * c)] * 2 + [("all_reduce", "bwd", b * t * c)] * 2
        )


@pytest.mark.distributed
@pytest.mark.timeout(200)
def test_sequence_parallel_block_pairs_reduce_scatter_with_all_gather(block_runs):
    (b, t, c), _ = CASES["sequence parallel"]
    activation = b * t * c
    plan = block_runs["plans"]["sequence parallel"]
    assert _plan_collectives(plan) == Counter({"reduce_scatter": 2, "all_gather": 2}), plan.reshards
    ln_params = 4 * c  # ln_1 and ln_2, weight and bias
    for rank, run in enumerate(block_runs["runs"]):
        got = run["sequence parallel"]
        counts, log = got["counts"], got["log"]
        for kind in ("reduce_scatter", "all_gather"):
            for direction in ("fwd", "bwd"):
                assert counts.get(f"{kind}/{direction}") == 2, f"rank {rank}: {counts}"
        # Activations are scattered whole and gathered from halves (the sequence split over TP).
        assert H.count_calls(log, "reduce_scatter", "fwd", activation) == 2
        assert H.count_calls(log, "all_gather", "fwd", activation // TP) == 2
        # No activation is all-reduced: forward only the scalar loss ...
        assert [n for k, d, n in log if k == "all_reduce" and d == "fwd"] == [1], log
        # ... backward only the LayerNorm parameters' gradients (bucketed), 4·C elements in all.
        bwd = [n for k, d, n in log if k == "all_reduce" and d == "bwd"]
        assert sum(bwd) == ln_params and max(bwd) <= ln_params, f"rank {rank}: backward all-reduces {bwd}"
        assert counts.get("all_reduce/fwd") == 1 and counts.get("all_reduce/bwd") == len(bwd)
        assert set(counts) == {
            f"{k}/{d}" for k in ("reduce_scatter", "all_gather", "all_reduce") for d in ("fwd", "bwd")
        }


def fan_out_worker(rank: int, world: int, plan: autopar.Plan) -> dict[str, int]:
    """One forward and backward of the one-layer LLaMA under ``plan``: the collectives issued on
    the tensor axis."""
    from conftest import llama, lm_batch

    H.quiet()
    torch.manual_seed(0)
    model, inputs = llama(layers=1, hidden=64, heads=4, kv_heads=2, vocab_size=64), lm_batch(2, 64, 64)
    # the step's collectives only: returning the logits whole is the caller's gather, not the plan's
    pm = autopar.parallelize(model, autopar.Cluster.local(world), inputs, plan=plan, gather_outputs=False)
    before = Counter(pm.axes[0].counts)
    pm(**inputs).loss.backward()
    counts = Counter(pm.axes[0].counts)
    counts.subtract(before)
    return {k: v for k, v in counts.items() if v}


@pytest.mark.distributed
@pytest.mark.timeout(200)
def test_a_value_read_by_several_projections_is_gathered_once_as_the_simulator_charges():
    """LLaMA's q, k and v projections (and gate and up) read one norm output, which sequence
    parallelism splits: the plan lists an all-gather on each of those edges, the rank program runs
    one per value (``passes.lower`` memoizes it), and the simulator charges what the program runs
    (``Plan.distinct_reshards``): its forward all-gathers are the program's."""
    from conftest import llama, lm_batch

    torch.manual_seed(0)
    model, inputs = llama(layers=1, hidden=64, heads=4, kv_heads=2, vocab_size=64), lm_batch(2, 64, 64)
    plan = autopar.layouts.megatron(model, inputs, autopar.Cluster.local(TP), tp=TP, sequence_parallel=True)

    def gathers(reshards: list) -> int:
        return sum(c.startswith("all_gather") for r in reshards for c in r.collectives)

    listed, distinct = gathers(plan.reshards), gathers(plan.distinct_reshards())
    assert listed >= distinct + 3, (listed, distinct)  # q, k, v: two more; gate, up: one more
    # Without sequence parallelism the readers' edges carry no collective, only shares of one
    # gradient all-reduce (Megatron-LM's f, ``grad_sync_share``): every one is kept.
    plain = autopar.layouts.megatron(model, inputs, autopar.Cluster.local(TP), tp=TP)
    assert plain.distinct_reshards() == plain.reshards
    counts = spawn(fan_out_worker, TP, plan, timeout=150)
    for rank, got in enumerate(counts):
        assert got.get("all_gather/fwd", 0) == distinct, f"rank {rank}: {got}, the plan's distinct {distinct}"

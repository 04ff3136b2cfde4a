"""What the search finds: sharding when memory forces it (and at least Megatron-LM's speed), pure
data parallelism when memory is ample and the batch is large, and an infeasible budget explained."""

from __future__ import annotations

import itertools
import math
import re
from typing import Any

import pytest
import torch

import autopar
from autopar.solver import InfeasibleError

pytestmark = pytest.mark.filterwarnings("ignore:autopar. no sharding rule")


@pytest.mark.timeout(180)
def test_one_sequence_on_eight_devices_shards_the_weights_and_matches_megatron(make_gpt2, batch, a100x8):
    """The issue's acceptance test: GPT-2 with one sequence on a 1-D mesh of 8 and a memory budget
    just above the fully sharded size.

    Budget: on one device the plan holds everything, so its predicted memory is the whole training
    state (16 B/param, fp32 AdamW) plus every saved activation; fully sharded over 8 devices that is
    1/8 of it. The budget is 5% above that, but never below what the Megatron-LM layout needs, so
    Megatron's plan is itself feasible and the comparison is fair. The fp32 model's matmuls run on
    TF32 tensor cores (``float32_matmul_precision="high"``), the rate the test was written for: on
    the plain FP32 units compute is 8× dearer and sharding the state over dp (ZeRO) wins instead.
    """
    tf32 = {"float32_matmul_precision": "high"}
    model = make_gpt2(n_layer=2, n_embd=256, n_head=8, vocab_size=512, n_positions=128)
    inputs = batch(1, 128, 512)
    megatron = autopar.layouts.megatron(model, inputs, a100x8, tp=8, **tf32)
    assert megatron.mesh_shape == (8,)

    one_device = autopar.Cluster.preset("A100-80GB", gpus_per_node=1, nodes=1)
    everything = autopar.plan(model, inputs, one_device, **tf32).predicted.memory_per_device
    n_params = sum(p.numel() for p in model.parameters())
    assert everything > 16 * n_params  # training state plus activations
    fully_sharded = everything / 8
    budget = max(megatron.predicted.memory_per_device, 1.05 * fully_sharded)

    # Ample memory would leave this tiny model replicated: the budget is what forces sharding.
    free = autopar.plan(model, inputs, a100x8, mesh_shape=(8,), **tf32)
    assert free.predicted.memory_per_device > budget

    plan = autopar.plan(model, inputs, a100x8, memory_budget=budget, mesh_shape=(8,), **tf32)
    assert plan.predicted.memory_per_device <= budget
    assert plan.sharded_fraction() >= 0.9, plan.param_placements()
    assert plan.predicted.step_time <= megatron.predicted.step_time * (1 + 1e-9)
    assert plan.mesh_axes == ("tp",)


@pytest.mark.timeout(120)
def test_large_batch_with_ample_memory_is_pure_data_parallel(make_gpt2, batch, a100x8):
    model = make_gpt2()
    plan = autopar.plan(model, batch(512, 64, 256), a100x8, mesh_shape=(8,))
    assert plan.mesh_axes == ("dp",)
    not_replicated = {k: v for k, v in plan.param_placements().items() if v != ("R",)}
    assert not_replicated == {}
    assert plan.inputs["input_ids"] == ("S(0)",)
    # Data parallelism communicates only gradients: one bucketed all-reduce per parameter.
    assert all(
        r.grad_sync_axes == (0,) and not r.collectives for r in plan.reshards if r.producer.startswith("p_")
    )


@pytest.mark.timeout(120)
def test_our_gpt_large_batch_is_data_parallel_with_targets_split(make_gpt, a100x8):
    model = make_gpt(n_layer=2, n_embd=64, n_head=4, vocab_size=128, block_size=64)
    idx = torch.randint(0, 128, (512, 64))
    plan = autopar.plan(model, (idx, idx.clone()), a100x8, mesh_shape=(8,))
    assert plan.mesh_axes == ("dp",)
    assert set(plan.param_placements().values()) == {("R",)}
    assert plan.inputs == {"args[0]": ("S(0)",), "args[1]": ("S(0)",)}


@pytest.mark.timeout(120)
def test_infeasible_budget_reports_the_smallest_reachable_memory(make_gpt2, batch, a100x8):
    model = make_gpt2()
    inputs = batch(8, 32, 256)
    with pytest.raises(InfeasibleError) as err:
        autopar.plan(model, inputs, a100x8, memory_budget=1024, mesh_shape=(8,))
    msg = str(err.value)
    assert "1.00 KiB" in msg
    m = re.search(r"smallest reachable is ([\d.]+) (B|KiB|MiB|GiB) per device", msg)
    assert m, msg
    assert "more devices" in msg and "larger memory_budget" in msg
    smallest = float(m.group(1)) * {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[m.group(2)]
    assert smallest > 1024
    # It is a true lower bound: just under it nothing fits; every feasible plan needs at least it.
    with pytest.raises(InfeasibleError):
        autopar.plan(model, inputs, a100x8, memory_budget=0.99 * smallest, mesh_shape=(8,))
    roomy = autopar.plan(model, inputs, a100x8, memory_budget=4 * smallest, mesh_shape=(8,))
    assert roomy.predicted.memory_per_device >= smallest * (1 - 1e-2)


def test_infeasible_on_every_candidate_mesh_lists_each(make_gpt, a100x8):
    idx = torch.randint(0, 128, (8, 32))
    with pytest.raises(InfeasibleError) as err:
        autopar.plan(make_gpt(), (idx, idx.clone()), a100x8, memory_budget=1024)
    msg = str(err.value)
    assert "no mesh shape fits" in msg
    for mesh in ("(8,)", "(4, 2)", "(2, 4)"):
        assert mesh in msg


def test_bad_arguments_are_rejected_with_the_reason(make_gpt, a100x8):
    idx = torch.randint(0, 128, (8, 32))
    with pytest.raises(ValueError, match="4 × 3 = 12 ≠ world size 8"):
        autopar.plan(make_gpt(), (idx, idx.clone()), a100x8, mesh_shape=(4, 3))
    with pytest.raises(ValueError, match="memory_budget must be positive"):
        autopar.plan(make_gpt(), (idx, idx.clone()), a100x8, memory_budget=0)
    for gap in (-0.1, 1.0, float("nan"), True):
        with pytest.raises(ValueError, match=r"relative_gap must be a fraction in \[0, 1\)"):
            autopar.plan(make_gpt(), (idx, idx.clone()), a100x8, relative_gap=gap)
    with pytest.raises(ValueError, match=r"screen_gap must lie in \[relative_gap, 1\) = \[0.005, 1\)"):
        autopar.plan(make_gpt(), (idx, idx.clone()), a100x8, screen_gap=0.001)


class _TwoUsers(torch.nn.Module):
    """``relu`` has one user (follows its matmul); ``mul`` is read by a matmul and an add."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(32, 32)
        self.b = torch.nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = torch.relu(self.a(x)) * 2.0
        return (self.b(t) + t).sum()


def test_only_a_one_user_op_follows_its_producer(a100x8):
    """A cheap op whose choice is tied to its producer's (Alpa's follow) moves a reshard past
    itself: with one user that reshard is paid once, with two it would be paid on each edge."""
    from autopar.capture import capture
    from autopar.config import PlanConfig
    from autopar.ir import STRATEGIES
    from autopar.mesh import Mesh
    from autopar.models import GPT, GPTConfig
    from autopar.passes import PassContext, run_passes
    from autopar.planner import GRAPH_PASSES, MESH_PASSES

    cap = capture(_TwoUsers(), torch.randn(16, 32))
    cfg = PlanConfig(mesh_shape=(4, 2))
    gm = run_passes(
        cap.gm, PassContext(captured=cap, cluster=a100x8, config=cfg, mixed_precision=False), GRAPH_PASSES
    )
    run_passes(
        gm, PassContext(captured=cap, cluster=a100x8, config=cfg, mesh=Mesh((4, 2), a100x8)), MESH_PASSES
    )
    follows = {n.name: n.meta[STRATEGIES].follows for n in gm.graph.nodes if STRATEGIES in n.meta}
    assert not follows["mul"]  # read by linear_1 and add: keeps its own variables
    # One-user ops still follow: a GPT's views and casts.
    model = GPT(GPTConfig.tiny())
    ids = torch.randint(0, 128, (8, 32))
    cap = capture(model, (ids, ids.clone()))
    gm = run_passes(
        cap.gm, PassContext(captured=cap, cluster=a100x8, config=cfg, mixed_precision=False), GRAPH_PASSES
    )
    run_passes(
        gm, PassContext(captured=cap, cluster=a100x8, config=cfg, mesh=Mesh((4, 2), a100x8)), MESH_PASSES
    )
    followers = [n for n in gm.graph.nodes if STRATEGIES in n.meta and n.meta[STRATEGIES].follows]
    assert followers and all(len(n.users) == 1 for n in followers)


@pytest.mark.timeout(120)
def test_more_strategies_never_give_a_slower_optimum(make_llama, batch):
    """The solver's optimum over a node's 64 cheapest strategies is at most its optimum over the
    16 cheapest (a superset). Following producers regardless broke this: 0.889 s against 0.682 s on
    this LLaMA, the cast of the residual stream tied to the embedding's layout."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(num_hidden_layers=2, hidden_size=256, num_attention_heads=8, num_key_value_heads=2,
                      intermediate_size=512, vocab_size=1024, max_position_embeddings=512, use_cache=False)  # fmt: skip
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    ids = torch.empty(32, 512, dtype=torch.long, device="meta")
    cap = autopar.capture(model, {"input_ids": ids, "labels": ids.clone()})
    cluster = autopar.Cluster.preset("H100-SXM", gpus_per_node=8, nodes=2)
    from autopar.planner import plan_captured

    objective = {
        k: plan_captured(cap, cluster, mesh_shape=(4, 4), workers=1, max_strategies=k).info["meshes_tried"][
            0
        ]["objective"]
        for k in (16, 64)
    }
    assert objective[64] <= objective[16] * (1 + 1e-9), objective


def _tiny_gpt_capture(make_gpt: Any) -> Any:
    """The tiny GPT captured on a batch of 8 × 32."""
    ids = torch.randint(0, 128, (8, 32))
    return autopar.capture(make_gpt(), (ids, ids.clone()))


def _formulated(cap: Any, cluster: autopar.Cluster, cfg: Any) -> Any:
    """``cap``'s graph through the planner's graph and mesh passes on ``cfg.mesh_shape``: the
    solver's input in ``gm.meta[STRATEGY_GRAPH]``."""
    from autopar.mesh import Mesh
    from autopar.passes import PassContext, run_passes
    from autopar.planner import GRAPH_PASSES, MESH_PASSES

    ctx = PassContext(captured=cap, cluster=cluster, config=cfg, mixed_precision=False)
    gm = run_passes(cap.gm, ctx, GRAPH_PASSES)
    mesh = Mesh(cfg.mesh_shape, cluster)
    return run_passes(gm, PassContext(captured=cap, cluster=cluster, config=cfg, mesh=mesh), MESH_PASSES)


def test_activations_count_once_per_micro_batch_in_flight(make_gpt, a100x8):
    """``activations_in_flight=k`` multiplies the solver's activation and input memory by k and
    leaves the training state alone (a pipeline rank holds k micro-batches, one copy of weights)."""
    from autopar.config import PlanConfig
    from autopar.ir import TENSOR
    from autopar.passes.formulate import STRATEGY_GRAPH

    cap = _tiny_gpt_capture(make_gpt)
    memory = {}
    for k in (1, 3):
        gm = _formulated(cap, a100x8, PlanConfig(mesh_shape=(8,), activations_in_flight=k))
        memory[k] = {d.name: list(d.memory) for d in gm.meta[STRATEGY_GRAPH].decisions}
        kinds = {n.name: (n.op, n.meta[TENSOR].kind if n.meta.get(TENSOR) else None) for n in gm.graph.nodes}
    static = [
        n for n, (op, kind) in kinds.items() if op == "placeholder" and kind == "param" and n in memory[1]
    ]
    saved = [n for n in memory[1] if kinds[n][0] == "call_function" and max(memory[1][n]) > 0]
    assert static and saved
    for n in static:
        assert memory[3][n] == memory[1][n]
    for n in saved:
        assert memory[3][n] == pytest.approx([3 * m for m in memory[1][n]])
    with pytest.raises(ValueError, match="activations_in_flight"):
        PlanConfig(activations_in_flight=0)


def test_a_micro_batch_pays_its_share_of_the_step_gradient_all_reduce(make_gpt, a100x8):
    """``microbatches_per_sync=m``: a data-parallel weight (read as it is stored, no gather) pays
    ``1/m`` of its gradient all-reduce on the graph of one of ``m`` micro-batches — the reduction
    runs once per step, as the simulator charges it; every other edge cost is unchanged."""
    from autopar.config import PlanConfig
    from autopar.passes.formulate import STRATEGY_GRAPH

    cap = _tiny_gpt_capture(make_gpt)
    graphs = {
        k: _formulated(cap, a100x8, PlanConfig(mesh_shape=(8,), microbatches_per_sync=k)).meta[STRATEGY_GRAPH]
        for k in (1, 4)
    }
    params = set(cap.params)
    divided = kept = 0  # a weight's entries: its all-reduce alone (divided), or a gather (kept)
    for e1, e4 in zip(graphs[1].edges, graphs[4].edges, strict=True):
        weight = graphs[1].decisions[e1.src].members[0] in params
        for row1, row4 in zip(e1.cost, e4.cost, strict=True):
            for c1, c4 in zip(row1, row4, strict=True):
                if not math.isfinite(c1) or c1 == 0:
                    continue
                if not weight:
                    assert c4 == pytest.approx(c1)
                elif c4 == pytest.approx(c1 / 4):
                    divided += 1
                else:
                    assert c4 == pytest.approx(c1)
                    kept += 1
    assert divided and kept
    with pytest.raises(ValueError, match="microbatches_per_sync"):
        PlanConfig(microbatches_per_sync=0)


@pytest.mark.timeout(300)
def test_auto_pipeline_search_stops_after_slower_pipeline_sizes(make_gpt):
    """Under ``pp="auto"`` the step is taken as unimodal in pp: two pipeline sizes slower than the
    best plan, or one ``FAR_SLOWER`` times slower, end the search; ``pp="search"`` would try
    them all."""
    from autopar.search import FAR_SLOWER

    model = make_gpt(n_layer=16)  # seams enough for 16 stages
    ids = torch.randint(0, 128, (64, 32))
    cluster = autopar.Cluster.preset("A100-80GB", gpus_per_node=1, nodes=32)
    plan = autopar.plan(model, (ids, ids.clone()), cluster, workers=1)
    rows = plan.info["pipeline_candidates"]
    planned = sorted({r["pp"] for r in rows if "step_time" in r})
    skipped = sorted({r["pp"] for r in rows if "skipped" in r and "microbatches" not in r})
    assert skipped and max(planned) < min(skipped), rows
    # A screened candidate's step counts less its gap, the least its refined step would be
    # (``autopar.search``: screening).
    step = {
        pp: min(
            r["step_time"] * (1 - r.get("screened_gap", 0.0))
            for r in rows
            if r["pp"] == pp and "step_time" in r
        )
        for pp in planned
    }

    def best_before(pp: int) -> float:
        return min(step[q] for q in planned if q < pp)

    last = planned[-1]
    far = step[last] > FAR_SLOWER * best_before(last)
    two = len(planned) >= 3 and all(step[pp] > best_before(pp) for pp in planned[-2:])
    assert far or two, step
    # Sizes before the last ended nothing: none far slower, no two slower in a row.
    for a, b in itertools.pairwise(planned[1:-1]):
        assert not (step[a] > best_before(a) and step[b] > best_before(b)), step
    assert all(step[pp] <= FAR_SLOWER * best_before(pp) for pp in planned[1:-1]), step


def test_a_pipeline_that_does_not_fit_is_tried_with_smaller_micro_batches():
    """The next count divides the batch, at least doubles, and is a multiple of pp where one is."""
    from autopar.search import _more_microbatches

    assert _more_microbatches(2160, 16, 16) == 48  # 2160 = 48 · 45; 32 does not divide it
    assert _more_microbatches(2160, 16, 48) == 144  # Megatron-LM's count for this row (dp=15, mbs=1)
    assert _more_microbatches(96, 4, 8) == 16
    assert _more_microbatches(90, 4, 10) == 30  # no multiple of 4 divides 90: any divisor
    assert _more_microbatches(64, 2, 64) is None


def test_smaller_micro_batches_are_tried_while_they_shrink_the_memory():
    """After an infeasible count, the next is tried while the smallest memory reached falls by
    ``ESCALATE_SHRINK``; at most two counts where the figure is missing."""
    from autopar.search import ESCALATE_SHRINK, _escalates

    assert _escalates(None, 90e9, 0)  # the first infeasible count: nothing to compare
    assert _escalates(100e9, 90e9, 3)  # activations still shrink: go on, however many were added
    assert not _escalates(100e9, 100e9 * (1 - ESCALATE_SHRINK / 2), 1)  # the static state is what is left
    assert not _escalates(None, None, 2)


def test_accumulation_goes_past_eight_micro_batches_when_fewer_do_not_fit(make_gpt):
    """A one-stage plan whose batch fits only in 16 micro-batches or more is found under the
    defaults (NVIDIA's LLaMA 3.1 8B recipe on 8 H100 accumulates 32): the first counts (2, 4, 8)
    do not fit, smaller micro-batches are tried while they shrink the memory."""
    model = make_gpt(n_layer=2)
    ids = torch.randint(0, 128, (64, 32))
    cluster = autopar.Cluster.preset("A100-80GB", gpus_per_node=2, nodes=1)
    common = dict(mesh_shape=(2,), recompute="none", workers=1)
    m8, m16 = (
        autopar.plan(model, (ids, ids.clone()), cluster, microbatches=m, **common).predicted.memory_per_device
        for m in (8, 16)
    )
    assert m16 < m8
    plan = autopar.plan(model, (ids, ids.clone()), cluster, memory_budget=(m8 + m16) / 2, **common)
    assert plan.pipeline is not None and plan.pipeline.pp == 1 and plan.pipeline.microbatches >= 16
    rows = plan.info["pipeline_candidates"]
    assert [r["microbatches"] for r in rows if r.get("pp") == 1 and "microbatches" in r][-1] == 16, rows


def test_accumulation_is_tried_when_the_whole_batch_needs_recomputation(make_gpt):
    """``recompute="auto"``: where the whole batch fits only by recomputing, accumulating smaller
    micro-batches may fit without it (Megatron Table 1's small rows), so the search tries that
    too and keeps the faster."""
    model = make_gpt(n_layer=2)
    ids = torch.randint(0, 128, (64, 32))
    cluster = autopar.Cluster.preset("A100-80GB", gpus_per_node=2, nodes=1)
    whole = autopar.plan(model, (ids, ids.clone()), cluster, pp=1, mesh_shape=(2,), workers=1)
    budget = 0.75 * whole.predicted.memory_per_device
    plan = autopar.plan(model, (ids, ids.clone()), cluster, memory_budget=budget, mesh_shape=(2,), workers=1)
    rows = plan.info["pipeline_candidates"]
    one_stage = next(r for r in rows if r["pp"] == 1 and "microbatches" not in r)
    accumulated = [r for r in rows if r["pp"] == 1 and r.get("microbatches", 1) > 1 and "step_time" in r]
    assert accumulated, rows
    assert one_stage["step_time"]
    # The fastest, its recomputation then tried in fewer layers (``autopar.refine.fewer_layers``).
    assert plan.predicted.step_time == min(r["step_time"] for r in rows if "step_time" in r)


def test_the_default_recomputes_where_a_plan_fits_only_so(make_gpt):
    """``recompute="auto"`` is the default: a whole batch that fits one stage only by recomputing
    is planned recomputing (the lightest mode that fits), where ``"none"`` finds no plan; a batch
    that fits as it is keeps every activation."""
    model = make_gpt(n_layer=2)
    ids = torch.randint(0, 128, (64, 32))
    cluster = autopar.Cluster.preset("A100-80GB", gpus_per_node=2, nodes=1)
    common = dict(pp=1, microbatches=1, mesh_shape=(2,), workers=1)
    ample = autopar.plan(model, (ids, ids.clone()), cluster, **common)
    assert ample.recompute == "none"
    budget = 0.75 * ample.predicted.memory_per_device
    with pytest.raises(InfeasibleError):
        autopar.plan(model, (ids, ids.clone()), cluster, memory_budget=budget, recompute="none", **common)
    tight = autopar.plan(model, (ids, ids.clone()), cluster, memory_budget=budget, **common)
    assert tight.recompute in ("selective", "full", "ops") and tight.predicted.memory_per_device <= budget
    assert tight.predicted.step_time > ample.predicted.step_time


def test_a_cutoff_keeps_plans_that_beat_it_and_refuses_the_rest():
    """``solve(cutoff=…)``: a hand-built two-decision program whose optimum is 3 s (strategy 1 then
    strategy 0, the edge between them costing 1 s). A cutoff above it gives the same plan; one
    below, or equal to it when strict, is ``NotBetter``; equal and not strict keeps it (the
    planner's tie goes to the earlier mesh). Those hold when solving exactly; at the default
    relative gap (0.5 %) a cutoff the optimum beats by less than the gap is ``NotBetter`` too."""
    from functools import partial

    from autopar.solver import Cutoff, NotBetter, SolverConfig
    from autopar.solver import solve as solve_at_gap
    from autopar.strategy_graph import Decision, Edge, StrategyGraph

    a = Decision("a", ("a",), unary=[3.0, 1.0], memory=[0.0, 0.0], allowed=[True, True])
    b = Decision("b", ("b",), unary=[1.0, 4.0], memory=[0.0, 0.0], allowed=[True, True])
    e = Edge(0, 1, ((0,), (1,)), ((0,), (1,)), cost=[[0.0, 0.5], [1.0, 0.0]], memory=[[0.0, 0.0], [0.0, 0.0]])
    g = StrategyGraph([a, b], [e], {"a": (0, (0, 1)), "b": (1, (0, 1))}, (2,))
    solve = partial(solve_at_gap, config=SolverConfig(relative_gap=0.0))
    best = solve(g, memory_budget=1.0)
    assert best.objective == pytest.approx(3.0) and best.choice == {"a": 1, "b": 0}
    assert solve(g, memory_budget=1.0, cutoff=Cutoff(3.5)).choice == best.choice
    assert solve(g, memory_budget=1.0, cutoff=Cutoff(3.0, strict=False)).objective == pytest.approx(3.0)
    for cut in (Cutoff(3.0), Cutoff(2.9, strict=False)):
        with pytest.raises(NotBetter):
            solve(g, memory_budget=1.0, cutoff=cut)
    with pytest.raises(NotBetter):
        solve_at_gap(g, memory_budget=1.0, cutoff=Cutoff(3.01))
    assert solve_at_gap(g, memory_budget=1.0, cutoff=Cutoff(3.02)).choice == best.choice


@pytest.mark.timeout(300)
def test_meshes_that_cannot_win_are_pruned_and_the_winner_is_unchanged(make_llama, batch):
    """The planner gives each mesh solved after another the best objective so far as a cutoff. The
    plan is the one solving every mesh in full gives: the same least objective, the winner the
    fastest simulated step among the meshes within ``MESH_TIE`` of it, and each mesh pruned more
    than ``MESH_TIE`` less the gap slower on its own."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from autopar.planner import plan_captured

    cfg = LlamaConfig(num_hidden_layers=2, hidden_size=256, num_attention_heads=8, num_key_value_heads=2,
                      intermediate_size=512, vocab_size=1024, max_position_embeddings=512, use_cache=False)  # fmt: skip
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    ids = torch.empty(4, 512, dtype=torch.long, device="meta")  # 4 sequences: tensor parallelism pays
    cap = autopar.capture(model, {"input_ids": ids, "labels": ids.clone()})
    cluster = autopar.Cluster.preset("H100-SXM", gpus_per_node=8, nodes=2)
    plan = plan_captured(cap, cluster, workers=1)
    tried = plan.info["meshes_tried"]
    alone = {
        tuple(m["mesh"]): plan_captured(cap, cluster, mesh_shape=tuple(m["mesh"]), workers=1).info["solver"][
            "objective"
        ]
        for m in tried
    }
    from autopar.planner import MESH_TIE

    assert any(m.get("pruned") for m in tried), tried
    least = min(m["objective"] for m in tried if m.get("feasible"))
    assert least == pytest.approx(min(alone.values()), rel=1e-12)
    rivals = {tuple(m["mesh"]): m["scored_step"] for m in tried if "scored_step" in m}
    assert rivals == {
        tuple(m["mesh"]): pytest.approx(m["scored_step"])
        for m in tried
        if m.get("feasible") and m["objective"] <= least * (1 + MESH_TIE)
    }
    assert plan.mesh_shape == min(rivals, key=rivals.get)
    assert plan.predicted.step_time == pytest.approx(min(rivals.values()), rel=1e-12)
    gap = autopar.PlanConfig().relative_gap
    for m in tried:
        if m.get("pruned"):
            assert alone[tuple(m["mesh"])] >= least * (1 + MESH_TIE - gap) * (1 - 1e-9)


@pytest.mark.timeout(120)
def test_near_tie_meshes_are_ranked_by_the_callers_score(make_gpt, a100x8, monkeypatch):
    """Meshes whose objectives lie within ``MESH_TIE`` of the least are finished as plans and ranked
    by ``score`` (the 3D search plays each one's micro-batches and schedules): the plan is the one
    the score prefers, each rival's score is recorded, and a mesh outside the tie is not scored."""
    import autopar.planner as planner

    cap = _tiny_gpt_capture(make_gpt)
    alone = planner.plan_captured(cap, a100x8, workers=1)
    objectives = {tuple(m["mesh"]): m["objective"] for m in alone.info["meshes_tried"] if m.get("feasible")}
    monkeypatch.setattr(planner, "MESH_TIE", 100.0)  # every mesh a rival
    everyone = planner.plan_captured(cap, a100x8, workers=1)
    steps = {tuple(m["mesh"]): m["scored_step"] for m in everyone.info["meshes_tried"] if "scored_step" in m}
    assert len(steps) >= 2 and everyone.predicted.step_time == min(steps.values())
    assert everyone.mesh_shape == min(steps, key=steps.get)
    slowest = max(steps, key=lambda k: steps[k])
    seen: list[tuple[int, ...]] = []

    def score(p: autopar.Plan) -> float:
        seen.append(tuple(p.mesh_shape))
        return 0.0 if tuple(p.mesh_shape) == slowest else 1.0

    picked = planner.plan_captured(cap, a100x8, workers=1, score=score)
    assert picked.mesh_shape == slowest and sorted(seen) == sorted(steps)
    monkeypatch.setattr(planner, "MESH_TIE", 0.0)  # only the least objective: nothing else is scored
    seen.clear()
    one = planner.plan_captured(cap, a100x8, workers=1, score=score)
    assert seen == [one.mesh_shape] and objectives[one.mesh_shape] == min(objectives.values())

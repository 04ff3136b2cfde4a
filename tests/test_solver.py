"""The sharding ILP's solver on hand-built strategy graphs, checked against brute force.

Pure tests: ``StrategyGraph.tree_bound`` never exceeds the optimum and is exact on a tree; the
compute-path cutoff (constraint (h)) and a live cutoff refuse exactly the programs they should;
a program whose decisions alone exceed the budget is infeasible before CP-SAT; the gap a plan
was stopped at is reported. Then on a captured model: the bound the 3D search prunes pipelined
candidates with holds for every candidate it plans (a rank is busy at least ``m/pp`` of the
compute path).
"""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

import autopar
from autopar.capture import Captured
from autopar.solver import Cutoff, InfeasibleError, NotBetter, SolverConfig, solve
from autopar.strategy_graph import Decision, Edge, StrategyGraph

pytestmark = pytest.mark.filterwarnings("ignore:autopar")


def _random_graph(rng: random.Random, n: int, extra_edges: int, weights: int = 0) -> StrategyGraph:
    """``n`` decisions (the first ``weights`` of them a parameter's), a random spanning tree of
    edges plus ``extra_edges`` more (cycles), random non-negative costs and memory, and groups
    that merge some strategies as an edge sees them."""
    decisions = []
    for i in range(n):
        k = rng.randint(2, 4)
        decisions.append(
            Decision(
                name=f"d{i}",
                members=(f"d{i}",),
                unary=[rng.uniform(0, 1) for _ in range(k)],
                memory=[float(rng.randint(0, 100)) for _ in range(k)],
                allowed=[True] * k,
                weight=i < weights,
            )
        )
    pairs = [(rng.randrange(0, i), i) for i in range(1, n)]
    pairs += [tuple(sorted(rng.sample(range(n), 2))) for _ in range(extra_edges)]
    edges = []
    for a, b in pairs:
        if rng.random() < 0.5 and not decisions[b].weight:
            a, b = b, a  # either direction, but nothing feeds a parameter
        if decisions[b].weight:
            a, b = b, a

        def groups(size: int) -> tuple[tuple[int, ...], ...]:
            cut = rng.randint(1, size)  # strategies [0, cut) in one group, the rest one each
            return (tuple(range(cut)), *((k,) for k in range(cut, size)))

        g, h = groups(decisions[a].size), groups(decisions[b].size)
        cost = [[rng.choice([0.0, rng.uniform(0, 1)]) for _ in h] for _ in g]
        edges.append(Edge(a, b, g, h, cost=cost, memory=[[0.0] * len(h) for _ in g]))
    return StrategyGraph(
        decisions, edges, {d.name: (i, tuple(range(d.size))) for i, d in enumerate(decisions)}, (2,)
    )


def _brute(graph: StrategyGraph) -> list[tuple[float, float, float]]:
    """(objective, compute path, memory) of every assignment."""
    out = []
    for picked in itertools.product(*(range(d.size) for d in graph.decisions)):
        obj = path = mem = 0.0
        for d, k in zip(graph.decisions, picked):
            obj += d.unary[k]
            path += 0.0 if d.weight else d.unary[k]
            mem += d.memory[k]
        for e in graph.edges:
            g = next(i for i, ks in enumerate(e.src_groups) if picked[e.src] in ks)
            h = next(i for i, ks in enumerate(e.dst_groups) if picked[e.dst] in ks)
            obj += e.cost[g][h]
            path += 0.0 if graph.decisions[e.src].weight else e.cost[g][h]
        out.append((obj, path, mem))
    return out


@pytest.mark.parametrize("seed", range(12))
def test_the_tree_bound_never_exceeds_the_optimum_and_is_exact_on_a_tree(seed):
    rng = random.Random(seed)
    tree = _random_graph(rng, 6, extra_edges=0, weights=1)
    every = _brute(tree)
    assert tree.tree_bound() == pytest.approx(min(o for o, _, _ in every), rel=1e-12)
    assert tree.tree_bound(path_only=True) == pytest.approx(min(p for _, p, _ in every), rel=1e-12)
    loopy = _random_graph(rng, 6, extra_edges=4, weights=1)
    every = _brute(loopy)
    assert loopy.tree_bound() <= min(o for o, _, _ in every) + 1e-12
    assert loopy.tree_bound(path_only=True) <= min(p for _, p, _ in every) + 1e-12
    # Under a memory budget the optimum only rises: still a bound.
    budget = sorted(m for _, _, m in every)[len(every) // 4]
    assert loopy.tree_bound() <= min(o for o, _, m in every if m <= budget) + 1e-12


@pytest.mark.parametrize("seed", range(6))
def test_the_solver_meets_brute_force_and_its_cutoffs_refuse_exactly_what_they_should(seed):
    """The optimum under the memory budget; a compute-path cutoff just under the least path of
    the plans that fit is ``NotBetter``, just over it gives a plan within it; an objective cutoff
    as well, given up front or as a live cutoff that appears while CP-SAT runs."""
    rng = random.Random(100 + seed)
    graph = _random_graph(rng, 6, extra_edges=3, weights=2)
    every = _brute(graph)
    budget = sorted(m for _, _, m in every)[len(every) // 3]
    exact = SolverConfig(relative_gap=0.0)
    best = min(o for o, _, m in every if m <= budget)
    sol = solve(graph, memory_budget=budget, config=exact)
    assert sol.objective == pytest.approx(best, abs=1e-9) and sol.optimal and sol.gap == 0.0
    shortest = min(p for _, p, m in every if m <= budget)
    with pytest.raises(NotBetter):
        solve(graph, memory_budget=budget, config=exact, path_cutoff=shortest * (1 - 1e-3))
    within = solve(graph, memory_budget=budget, config=exact, path_cutoff=shortest * (1 + 1e-3))
    assert within.objective >= best - 1e-9
    with pytest.raises(NotBetter):
        solve(graph, memory_budget=budget, config=exact, cutoff=Cutoff(best * (1 - 1e-3)))
    with pytest.raises(NotBetter):
        solve(graph, memory_budget=budget, config=exact, live_cutoff=lambda: Cutoff(best * (1 - 1e-3)))
    again = solve(graph, memory_budget=budget, config=exact, live_cutoff=lambda: None)
    assert again.objective == pytest.approx(best, abs=1e-9)


def test_a_solve_stopped_by_its_work_limit_before_any_plan_meets_the_cutoffs_is_not_better():
    """``SolverConfig.work_limit`` (CP-SAT's deterministic time, the same on every machine): a
    solve it stops before a plan beating the cutoffs is found ends ``NotBetter`` and says so; the
    same solve with no limit finds the plan, so the limit, not the cutoff, ended it. A solve the
    limit does not reach is unchanged."""
    rng = random.Random(7)
    graph = _random_graph(rng, 40, extra_edges=60, weights=4)
    budget = 0.6 * sum(max(d.memory) for d in graph.decisions)
    free = solve(graph, memory_budget=budget)
    cut = Cutoff(free.objective * 1.01)
    assert solve(graph, memory_budget=budget, cutoff=cut).objective == pytest.approx(free.objective, rel=0.01)
    with pytest.raises(NotBetter, match=r"found within 1e-09 units of CP-SAT's work"):
        solve(graph, memory_budget=budget, config=SolverConfig(work_limit=1e-9), cutoff=cut)
    roomy = solve(graph, memory_budget=budget, config=SolverConfig(work_limit=100.0), cutoff=cut)
    assert roomy.objective == free.objective and roomy.choice == free.choice
    with pytest.raises(
        ValueError, match=r"work_limit must be a positive number of CP-SAT's work units or None, got 0"
    ):
        autopar.PlanConfig(work_limit=0)
    # The per-activation second looks cap a caller's limit, never loosen it.
    from autopar.second_look import PER_ACTIVATION_WORK, look_work

    assert look_work(autopar.PlanConfig()) == PER_ACTIVATION_WORK
    assert look_work(autopar.PlanConfig(work_limit=1.0)) == 1.0
    assert look_work(autopar.PlanConfig(work_limit=100.0)) == PER_ACTIVATION_WORK


@pytest.mark.parametrize("seed", range(4))
def test_a_cutoff_is_beaten_only_by_more_than_the_relative_gap(seed):
    """Under ``relative_gap`` g a candidate whose optimum lies within g under the cutoff cannot
    improve the plan by more than the precision the solves stop at: ``NotBetter``, up front or
    live; one that beats the cutoff by more gives a plan below ``(1 − g) ×`` the cutoff."""
    rng = random.Random(200 + seed)
    graph = _random_graph(rng, 6, extra_edges=3, weights=2)
    every = _brute(graph)
    budget = sorted(m for _, _, m in every)[len(every) // 3]
    best = min(o for o, _, m in every if m <= budget)
    gapped = SolverConfig(relative_gap=0.05)
    for live in (False, True):
        near = Cutoff(best * 1.02)
        kw = {"live_cutoff": lambda c=near: c} if live else {"cutoff": near}
        with pytest.raises(NotBetter):
            solve(graph, memory_budget=budget, config=gapped, **kw)
        far = Cutoff(best * 1.10)
        kw = {"live_cutoff": lambda c=far: c} if live else {"cutoff": far}
        won = solve(graph, memory_budget=budget, config=gapped, **kw)
        assert won.objective <= best * 1.10 * 0.95 + 1e-9
    # Stopping at the coarse gap while cutoffs keep a fine one (the 3D search's screening).
    screening = SolverConfig(relative_gap=0.05, cutoff_gap=0.0)
    won = solve(graph, memory_budget=budget, config=screening, cutoff=Cutoff(best * 1.02))
    assert won.objective < best * 1.02


def test_decisions_over_the_budget_are_infeasible_before_any_edge_is_costed():
    rng = random.Random(7)
    graph = _random_graph(rng, 5, extra_edges=2)
    least = graph.min_memory()
    with pytest.raises(InfeasibleError) as err:
        solve(graph, memory_budget=0.99 * least)
    assert err.value.smallest == pytest.approx(least)
    incomplete = StrategyGraph(graph.decisions, [], graph.node_choice, graph.mesh_shape, complete=False)
    with pytest.raises(InfeasibleError):
        solve(incomplete, memory_budget=0.99 * least)
    with pytest.raises(ValueError, match="formulate it again"):
        solve(incomplete, memory_budget=2 * least)


@pytest.mark.timeout(300)
def test_a_formulation_over_the_budget_leaves_its_edges_out(make_gpt, a100x8):
    """``formulate`` under a budget its decisions alone exceed keeps no edge (``complete`` is
    False), and the planner reports the same smallest memory as with every edge costed."""
    from autopar.planner import plan_captured

    ids = torch.randint(0, 128, (8, 32))
    cap = autopar.capture(make_gpt(), (ids, ids.clone()))
    roomy = plan_captured(cap, a100x8, mesh_shape=(8,), workers=1)
    assert _complete(cap)
    with pytest.raises(InfeasibleError) as err:
        plan_captured(cap, a100x8, mesh_shape=(8,), memory_budget=1024, workers=1)
    assert not _complete(cap)
    assert 0 < err.value.smallest <= roomy.predicted.memory_per_device


def _complete(cap: Captured) -> bool:
    from autopar.passes.formulate import STRATEGY_GRAPH

    return cap.gm.meta[STRATEGY_GRAPH].complete


@pytest.mark.timeout(600)
def test_the_pipeline_pruning_bound_holds_for_every_candidate_planned():
    """Every pipelined candidate the search plans (its step simulated) keeps a stage plan whose
    compute path is at most ``step · pp / m``: re-solved with that path cutoff it is not
    ``NotBetter``. So the search, which prunes candidates whose path exceeds
    ``FAR_SLOWER · best · pp / m``, never prunes one that could be as fast as the best."""
    from autopar.config import PlanConfig
    from autopar.microbatch import MicrobatchCaptures
    from autopar.models import GPT, GPTConfig
    from autopar.pipelined import stage_cluster
    from autopar.planner import plan_captured

    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=4, n_head=8, n_embd=256, vocab_size=4096, block_size=256))
    ids = torch.empty(32, 256, dtype=torch.long, device="meta")
    cluster = autopar.Cluster.preset("A100-80GB", gpus_per_node=4, nodes=2)
    plan = autopar.plan(model, (ids, ids.clone()), cluster, pp="search", workers=1)
    graphs = MicrobatchCaptures(model, (ids, ids.clone()))
    config = PlanConfig.build(None, workers=1)
    budget = config.budget(cluster.device.memory)
    fastest: dict[tuple[int, int, int], float] = {}  # (pp, m, micro-batches in flight) -> step
    for row in plan.info["pipeline_candidates"]:
        if "step_time" in row and "microbatches" in row:
            pp, m = row["pp"], row["microbatches"]
            key = (pp, m, m if row["candidate"].endswith("gpipe") else min(pp, m))
            fastest[key] = min(fastest.get(key, math.inf), row["step_time"])
    assert len({(pp, m) for pp, m, _ in fastest}) >= 3, plan.info["pipeline_candidates"]
    for (pp, m, in_flight), step in fastest.items():
        stage = config.replace(
            pp=1, memory_budget=budget * pp, activations_in_flight=in_flight, microbatches_per_sync=m
        )
        plan_captured(graphs(m), stage_cluster(cluster, pp), stage, path_cutoff=step * pp / m * (1 + 1e-9))
    assert math.isfinite(plan.predicted.step_time)

r"""The sharding ILP, solved with OR-Tools CP-SAT (the formulation of Alpa's intra-operator pass,
Zheng et al., OSDI 2022 §4.2, and XLA's auto-sharding).

The input is a ``StrategyGraph`` (``autopar.strategy_graph``, built by ``passes.formulate``):
*decisions* ``c`` — a leader node with the nodes that follow it, merged with the same position of
every repeated layer — each with strategies ``k ∈ K_c``; *edges* ``(a, b)`` between decisions,
each with a cost matrix ``C_ab[g, h]`` indexed by the producer's output-spec group ``g`` and the
consumer's (input-spec, split) group ``h``. ``solve`` is a pure function of that record: it reads
no graph, so it is unit-tested on hand-built instances, and ``str(graph)`` prints the program.

Variables
    s_{c,k} ∈ {0,1}            class c runs strategy k
    e_{ab,gh} ∈ {0,1}          edge a→b carries producer group g into consumer group h

Objective (predicted step time, seconds, scaled to integers by one fixed factor and rounded)
    min  Σ_c Σ_k T_{c,k} s_{c,k}  +  Σ_{ab} Σ_{g,h} C_{ab,gh} e_{ab,gh}
    T_{c,k} = forward + backward compute and in-op collectives of every member node;
    C_{ab,gh} = forward reshard + backward conjugate + gradient all-reduce, summed over the
    repeated edges it stands for (``autopar.reshard.edge_cost``).

Constraints
    (a) one strategy per class:                Σ_k s_{c,k} = 1
    (b) edges agree with their producer:      Σ_h e_{ab,gh} = Σ_{k ∈ g} s_{a,k}
    (c) edges agree with their consumer:      Σ_g e_{ab,gh} = Σ_{k ∈ h} s_{b,k}
    (d) memory per device:                    Σ_c Σ_k M_{c,k} s_{c,k} ≤ budget
    (e) user constraints (``fixed``):         s_{c,k} = 0 for k whose parameter spec differs
    (f) impossible edges:                     e_{ab,gh} = 0 where C_{ab,gh} = ∞
    (g) a cutoff (optional):                  objective < another candidate mesh's optimum
        (≤ where that mesh comes later in the planner's order); a mesh that cannot win ends as
        soon as the bound proves it, instead of after proving its own optimum

The marginal form (b)-(c) (rather than linearizing s_a·s_b per pair) is what lets CP-SAT prove
optimality quickly; grouping strategies by the spec they show an edge shrinks it further.
Repeated layers share classes and edges, so the model's size does not grow with depth.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from autopar.strategy_graph import Solution, StrategyGraph

__all__ = ["Cutoff", "InfeasibleError", "NotBetter", "Solution", "SolverConfig", "solve"]

SCALE = 1e12
"""Objective units per second (picoseconds): one fixed factor for every cost term."""


class InfeasibleError(RuntimeError):
    """No strategy assignment fits the memory budget. ``smallest``: the least memory per device
    any plan of the failed candidate reaches (bytes), where known."""

    def __init__(self, message: str, smallest: float | None = None) -> None:
        super().__init__(message)
        self.smallest = smallest

    def __reduce__(self) -> tuple:
        return (InfeasibleError, (str(self), self.smallest))


@dataclass(frozen=True, slots=True)
class Cutoff:
    """Another candidate's objective (seconds) this solve must beat: below it, or where
    ``strict`` is False (the other candidate comes later in the caller's order, which breaks
    ties) at most equal to it. Used only to decide between candidates: a solve that cannot beat it
    ends as soon as CP-SAT proves so (``NotBetter``)."""

    objective: float
    strict: bool = True


class NotBetter(RuntimeError):
    """No plan of this candidate beats the ``Cutoff`` (or none fits the memory budget)."""

    def __init__(self, cutoff: float) -> None:
        super().__init__(f"no plan faster than {cutoff * 1e3:.2f} ms (another candidate's)")
        self.cutoff = cutoff

    def __reduce__(self) -> tuple:
        return (NotBetter, (self.cutoff,))


@dataclass(kw_only=True, slots=True)
class SolverConfig:
    """CP-SAT settings; the defaults reproduce a plan exactly from run to run."""

    time_limit: float = 60.0
    """Seconds CP-SAT may search before returning its best plan."""
    num_workers: int = 1
    """CP-SAT workers; 1 with ``linearization_level=2`` proves optimality fastest on 2 cores."""
    linearization_level: int = 2
    random_seed: int = 0
    presolve: bool = False
    """CP-SAT presolve. Off: on these models (one-hot choices, marginal edge equalities) its
    probing spends more time than it saves (8B LLaMA on a 16×4 mesh: 6.6 s with, 3.5 s without)."""


def solve(
    graph: StrategyGraph,
    *,
    memory_budget: float,
    config: SolverConfig | None = None,
    cutoff: Cutoff | None = None,
) -> Solution:
    """Choose one strategy per decision minimizing predicted step time under ``memory_budget``.
    ``cutoff``: only a plan beating it is wanted (``Cutoff``); ``NotBetter`` when none does."""
    from ortools.sat.python import cp_model

    config = config or SolverConfig()
    t0 = time.perf_counter()
    model = cp_model.CpModel()
    # ---- Variables s[c,k] with (a) one strategy per decision and (e) user constraints.
    s_vars: list[list] = []
    objective = []
    mem_terms = []
    for ci, d in enumerate(graph.decisions):
        vs = [model.NewBoolVar(f"s[{ci},{k}]") for k in range(d.size)]
        s_vars.append(vs)
        model.AddExactlyOne(vs)  # (a)
        for k, (ok, u, m) in enumerate(zip(d.allowed, d.unary, d.memory)):
            if not ok or not math.isfinite(u):  # (e)
                model.Add(vs[k] == 0)
                continue
            if u > 0:
                objective.append(round(u * SCALE) * vs[k])
            if m > 0:
                mem_terms.append(math.ceil(m) * vs[k])
    # ---- Edge variables e[ab,g,h] with (b), (c) and (f).
    n_edge_vars = 0
    for e in graph.edges:
        sa, sb = s_vars[e.src], s_vars[e.dst]
        evars = {}
        for g in range(len(e.src_groups)):
            for h in range(len(e.dst_groups)):
                c = e.cost[g][h]
                if not math.isfinite(c):  # (f)
                    continue
                v = model.NewBoolVar("")
                evars[(g, h)] = v
                if c > 0:
                    objective.append(round(c * SCALE) * v)
                if e.memory[g][h] > 0:
                    mem_terms.append(math.ceil(e.memory[g][h]) * v)
        n_edge_vars += len(evars)
        by_g: list[list] = [[] for _ in e.src_groups]
        by_h: list[list] = [[] for _ in e.dst_groups]
        for (g, h), v in evars.items():
            by_g[g].append(v)
            by_h[h].append(v)
        for g, ks in enumerate(e.src_groups):  # (b)
            model.Add(sum(by_g[g]) == sum(sa[k] for k in ks))
        for h, ls in enumerate(e.dst_groups):  # (c)
            model.Add(sum(by_h[h]) == sum(sb[k] for k in ls))
    model.Add(sum(mem_terms) <= int(memory_budget))  # (d)
    if cutoff is not None:  # in the objective's integer units, as the other solve counted them
        limit = round(cutoff.objective * SCALE)
        model.Add(sum(objective) <= (limit - 1 if cutoff.strict else limit))
    model.Minimize(sum(objective))
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = config.time_limit
    solver.parameters.num_workers = config.num_workers
    solver.parameters.linearization_level = config.linearization_level
    solver.parameters.random_seed = config.random_seed
    solver.parameters.cp_model_presolve = config.presolve
    build_time = time.perf_counter() - t0
    status = solver.Solve(model)
    if status == cp_model.INFEASIBLE and cutoff is not None:
        raise NotBetter(cutoff.objective)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        raise InfeasibleError(
            f"no plan fits {_fmt_bytes(memory_budget)} per device on mesh {graph.mesh_shape}: the smallest "
            f"reachable is {_fmt_bytes(graph.min_memory())} per device (parameters, gradients and optimizer "
            f"state fully sharded, activations sharded as far as shapes allow). Use more devices, a larger "
            f"memory_budget, a smaller batch, or a cheaper optimizer.",
            smallest=graph.min_memory(),
        )
    picked = [next(k for k, v in enumerate(vs) if solver.Value(v)) for vs in s_vars]
    memory = sum(d.memory[k] for d, k in zip(graph.decisions, picked))
    for e in graph.edges:
        g = next(i for i, ks in enumerate(e.src_groups) if picked[e.src] in ks)
        h = next(i for i, ks in enumerate(e.dst_groups) if picked[e.dst] in ks)
        memory += math.ceil(e.memory[g][h]) if e.memory[g][h] > 0 else 0.0
    choice = {name: fmap[picked[ci]] for name, (ci, fmap) in graph.node_choice.items()}
    return Solution(
        choice=choice,
        objective=solver.ObjectiveValue() / SCALE,
        memory=memory,
        optimal=status == cp_model.OPTIMAL,
        solve_time=time.perf_counter() - t0,
        num_classes=len(graph.decisions),
        num_edge_vars=n_edge_vars,
        stats={"build_time": build_time, "cp_sat_time": solver.WallTime()},
    )


def _fmt_bytes(b: float) -> str:
    """Bytes in the largest binary unit that keeps the number readable (1 KiB budgets as well as 80 GiB)."""
    for unit, f in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if b >= f:
            return f"{b / f:.2f} {unit}"
    return f"{b:.0f} B"

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
    (g) a cutoff (optional):                  objective < (1 − gap) · another candidate mesh's
        optimum (≤ where that mesh comes later in the planner's order), gap the relative gap
        every solve stops at (``SolverConfig.relative_gap``): a mesh that cannot win by more than
        the precision its rival was solved to ends as soon as the bound proves it, instead of
        after proving its own optimum. The plan kept is then within about the gap of the best
        over all meshes, as each mesh's own is of its optimum; without the gap, a rival whose
        optimum ties the cutoff (LLaMA-3-8B's pp = 2 stage meshes (16, 2) and (8, 4): 374.52
        and 374.47 ms) is searched to the time limit, its bound creeping up to a cutoff it meets.
    (h) a compute-path cutoff (optional):     Σ_{c ∉ W} Σ_k T_{c,k} s_{c,k} + Σ_{ab: a ∉ W} Σ C_{ab,gh} e_{ab,gh}
                                              ≤ path cutoff, W the weights' decisions
        (``StrategyGraph.path_terms``): the work every micro-batch puts on a device's compute
        stream; the 3D search asks a micro-batch's plan for a path that could still beat its best
        step (``autopar.search``), so a candidate that cannot win ends at the root LP bound

Before CP-SAT: where (d) cannot hold (each decision at its least memory exceeds the budget) the
program is infeasible; where (g) or (h) cannot hold (``StrategyGraph.tree_bound``: the optimum with
the memory constraint and the edges off a spanning tree dropped, exact by dynamic programming, in
milliseconds) it is ``NotBetter``. Most candidates the 3D search rejects end there.

The marginal form (b)-(c) (rather than linearizing s_a·s_b per pair) is what lets CP-SAT prove
optimality quickly; grouping strategies by the spec they show an edge shrinks it further.
Repeated layers share classes and edges, so the model's size does not grow with depth.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
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
    """No plan of this candidate beats the ``Cutoff`` or meets the compute-path cutoff (or none
    fits the memory budget)."""

    def __init__(self, cutoff: float, path_cutoff: float | None = None, why: str | None = None) -> None:
        what = [why] if why else []
        if why is None and math.isfinite(cutoff):
            what.append(f"no plan to rival {cutoff * 1e3:.2f} ms (another candidate's)")
        if why is None and path_cutoff is not None:
            what.append(f"no compute path within {path_cutoff * 1e3:.2f} ms (a better plan's step)")
        super().__init__(" or ".join(what) or "no better plan")
        self.cutoff = cutoff
        self.path_cutoff = path_cutoff
        self.why = why

    def __reduce__(self) -> tuple:
        return (NotBetter, (self.cutoff, self.path_cutoff, self.why))


@dataclass(kw_only=True, slots=True)
class SolverConfig:
    """CP-SAT settings; the defaults reproduce a plan exactly from run to run."""

    time_limit: float = 60.0
    """Seconds CP-SAT may search before returning its best plan."""
    work_limit: float | None = None
    """CP-SAT's deterministic time limit (``max_deterministic_time``): work units counted the same
    on every machine, so a solve it stops ends at the same point from run to run; ``None``: only
    ``time_limit`` bounds the search. Stopped there with no plan beating a cutoff, the solve ends
    ``NotBetter`` (the caller wanted only a better plan)."""
    num_workers: int = 1
    """CP-SAT workers; 1 with ``linearization_level=2`` proves optimality fastest on 2 cores."""
    linearization_level: int = 2
    random_seed: int = 0
    presolve: bool = False
    """CP-SAT presolve. Off: on these models (one-hot choices, marginal edge equalities) its
    probing spends more time than it saves (8B LLaMA on a 16×4 mesh: 6.6 s with, 3.5 s without)."""
    relative_gap: float = 0.005
    """Stop once the plan is proven within this fraction of the optimum (CP-SAT's
    ``relative_gap_limit``; 0 proves optimality). The root LP bound of these programs is within
    about 0.5-1 % of the optimum and CP-SAT's first plan usually within 0.3 %, while closing the
    last fraction of a percent costs most of the time: the 11 stage-mesh solves of LLaMA-3-8B's
    fp32 plan take 44 s to prove optimal and 25 s at 0.5 %, ten of the eleven plans identical and
    one 0.1 % slower (by this program's objective, a model of the step that the simulator then
    refines). ``Solution.gap`` and ``Predicted.gap`` report the gap a plan was stopped at."""
    cutoff_gap: float | None = None
    """How much a plan must beat a cutoff by, as a fraction (constraint (g)); ``None``: the
    ``relative_gap``. The 3D search's screening stops its solves at a coarse gap but keeps the
    configured one here, so a mesh it prunes is one a solve at that gap would prune too (its
    rival's objective, solved coarsely, is no lower than solved finely)."""
    probing_level: int = 0
    """CP-SAT's ``cp_model_probing_level``. 0: no probing of the Booleans when the search starts.
    Probing spends a fixed second of deterministic time on these programs (58 000 Booleans) fixing
    a few hundred of them; without it the root LP starts at once: LLaMA-3-8B's stage programs are
    solved in 0.2-0.9 s instead of 1.0-1.7 s (16 of 24; the hardest, which need search beyond the
    root, slow down, and are mostly meshes another mesh's cutoff ends)."""
    lazy_lp: bool = False
    """CP-SAT's ``add_lp_constraints_lazily``. Off: the whole marginal LP (b)-(c) is in the root
    relaxation from the start. Added lazily, the root LP starts without the edge equalities and
    its bound stays 20 % under the optimum until search has added them; with all of them the root
    bound is within 0.5 % and CP-SAT proves optimality 2-10x sooner (LLaMA-3-8B, 64 H100: the
    (32, 2) mesh 4.6 s -> 2.2 s, fp32 with 2 micro-batches on (16, 4) 20.6 s -> 2.9 s, 23 solves
    of one plan 201 s -> 44 s, every objective the same)."""


def solve(
    graph: StrategyGraph,
    *,
    memory_budget: float,
    config: SolverConfig | None = None,
    cutoff: Cutoff | None = None,
    path_cutoff: float | None = None,
    live_cutoff: Callable[[], Cutoff | None] | None = None,
) -> Solution:
    """Choose one strategy per decision minimizing predicted step time under ``memory_budget``.
    ``cutoff``: only a plan beating it is wanted (``Cutoff``); ``path_cutoff``: seconds the
    compute path may take at most (constraint (h)); ``NotBetter`` when no plan meets them.
    ``live_cutoff``: a cutoff that may appear or tighten while CP-SAT runs (another mesh solved
    beside this one), read each time CP-SAT's lower bound rises: once the bound proves no plan
    beats it, the search stops with ``NotBetter``, as (g) would have ended it."""
    from ortools.sat.python import cp_model

    config = config or SolverConfig()
    cut_gap = config.relative_gap if config.cutoff_gap is None else config.cutoff_gap
    t0 = time.perf_counter()
    if graph.min_memory() > memory_budget:  # (d) cannot hold: no need to ask CP-SAT
        raise _infeasible(graph, memory_budget)
    if not graph.complete:
        raise ValueError(
            f"the strategy graph on mesh {graph.mesh_shape} was formulated without its edges (its decisions "
            f"need {_fmt_bytes(graph.min_memory())}, over the budget it was formulated for), but is solved "
            f"under {_fmt_bytes(memory_budget)}: formulate it again under this budget"
        )
    # (g), (h) cannot hold where a relaxation's optimum already exceeds them: no need either.
    floor = 0.0  # a lower bound of the objective, seconds
    if cutoff is not None or live_cutoff is not None or path_cutoff is not None:
        if path_cutoff is not None and _above(graph.tree_bound(path_only=True), path_cutoff):
            raise NotBetter(cutoff.objective if cutoff is not None else math.inf, path_cutoff)
        floor = graph.tree_bound()
        first = cutoff if cutoff is not None else live_cutoff() if live_cutoff is not None else None
        if first is not None and _above(floor, first.objective * (1 - cut_gap)):
            raise NotBetter(first.objective, path_cutoff)
    model = cp_model.CpModel()
    proto = model.proto  # built directly (variables by index): a third of the time of LinearExpr
    obj_vars: list[int] = []
    obj_coeffs: list[int] = []
    path: list[int] = []  # positions in obj_vars of the compute path's terms, (h)
    mem_vars: list[int] = []
    mem_coeffs: list[int] = []

    def bools(n: int) -> int:
        first = len(proto.variables)
        for _ in range(n):
            proto.variables.add().domain.extend((0, 1))
        return first

    def linear(vars_: list[int], coeffs: list[int], lo: int, hi: int) -> None:
        c = proto.constraints.add().linear
        c.vars.extend(vars_)
        c.coeffs.extend(coeffs)
        c.domain.extend((lo, hi))

    def term(v: int, seconds: float, on_path: bool) -> None:
        if on_path:
            path.append(len(obj_vars))
        obj_vars.append(v)
        obj_coeffs.append(round(seconds * SCALE))

    # ---- Variables s[c,k] with (a) one strategy per decision and (e) user constraints.
    first_s: list[int] = []
    for d in graph.decisions:
        first = bools(d.size)
        first_s.append(first)
        proto.constraints.add().exactly_one.literals.extend(range(first, first + d.size))  # (a)
        for k, (ok, u, m) in enumerate(zip(d.allowed, d.unary, d.memory)):
            if not ok or not math.isfinite(u):  # (e)
                proto.variables[first + k].domain[1] = 0
                continue
            if u > 0:
                term(first + k, u, not d.weight)
            if m > 0:
                mem_vars.append(first + k)
                mem_coeffs.append(math.ceil(m))
    # ---- Edge variables e[ab,g,h] with (b), (c) and (f).
    n_edge_vars = 0
    for e in graph.edges:
        on_path = not graph.decisions[e.src].weight
        by_g: list[list[int]] = [[] for _ in e.src_groups]
        by_h: list[list[int]] = [[] for _ in e.dst_groups]
        for g, (row, mrow) in enumerate(zip(e.cost, e.memory)):
            for h, c in enumerate(row):
                if not math.isfinite(c):  # (f)
                    continue
                v = bools(1)
                by_g[g].append(v)
                by_h[h].append(v)
                if c > 0:
                    term(v, c, on_path)
                if mrow[h] > 0:
                    mem_vars.append(v)
                    mem_coeffs.append(math.ceil(mrow[h]))
        n_edge_vars += sum(len(x) for x in by_g)
        for ends, groups, first in (
            (by_g, e.src_groups, first_s[e.src]),
            (by_h, e.dst_groups, first_s[e.dst]),
        ):
            for vs, ks in zip(ends, groups):  # (b), (c): Σ e − Σ s = 0
                linear(vs + [first + k for k in ks], [1] * len(vs) + [-1] * len(ks), 0, 0)
    linear(mem_vars, mem_coeffs, 0, int(memory_budget))  # (d)
    if cutoff is not None:  # in the objective's integer units, as the other solve counted them
        linear(obj_vars, obj_coeffs, 0, _limit(cutoff, cut_gap))
    if path_cutoff is not None:  # (h)
        linear([obj_vars[i] for i in path], [obj_coeffs[i] for i in path], 0, math.floor(path_cutoff * SCALE))
    proto.objective.vars.extend(obj_vars)
    proto.objective.coeffs.extend(obj_coeffs)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = config.time_limit
    if config.work_limit is not None:
        solver.parameters.max_deterministic_time = config.work_limit
    solver.parameters.num_workers = config.num_workers
    solver.parameters.linearization_level = config.linearization_level
    solver.parameters.random_seed = config.random_seed
    solver.parameters.cp_model_presolve = config.presolve
    solver.parameters.add_lp_constraints_lazily = config.lazy_lp
    solver.parameters.relative_gap_limit = config.relative_gap
    solver.parameters.cp_model_probing_level = config.probing_level
    beaten: list[Cutoff] = []
    watch = None
    if live_cutoff is not None:
        bound = [floor * SCALE * (1 - 1e-6)]  # the lower bound so far, in objective units
        lock = threading.Lock()

        def check() -> None:
            c = live_cutoff()
            if c is None:
                return
            limit = _limit(c, cut_gap)
            with lock:
                if not beaten and bound[0] > limit:  # no objective within (g)
                    beaten.append(c)
                    solver.StopSearch()

        def on_bound(b: float) -> None:
            bound[0] = max(bound[0], b)
            check()

        solver.best_bound_callback = on_bound
        # A cutoff may also arrive while the bound stands still: look every 50 ms.
        done = threading.Event()

        def poll() -> None:
            while not done.wait(0.05):
                check()

        watch = (done, threading.Thread(target=poll, daemon=True))
        watch[1].start()
    build_time = time.perf_counter() - t0
    try:
        status = solver.Solve(model)
    finally:
        if watch is not None:
            watch[0].set()
            watch[1].join()
    if beaten:
        raise NotBetter(beaten[0].objective, path_cutoff)
    if status == cp_model.INFEASIBLE and (cutoff is not None or path_cutoff is not None):
        raise NotBetter(cutoff.objective if cutoff is not None else math.inf, path_cutoff)
    if (
        status == cp_model.UNKNOWN
        and config.work_limit is not None
        and (cutoff is not None or path_cutoff is not None)
    ):
        # stopped by its work limit before finding a plan that meets the cutoffs
        raise NotBetter(
            cutoff.objective if cutoff is not None else math.inf,
            path_cutoff,
            f"no plan beating the cutoffs found within {config.work_limit:g} units of CP-SAT's work",
        )
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        raise _infeasible(graph, memory_budget)
    values = solver.response_proto.solution
    picked = [next(k for k in range(d.size) if values[f + k]) for d, f in zip(graph.decisions, first_s)]
    memory = sum(d.memory[k] for d, k in zip(graph.decisions, picked))
    for e in graph.edges:
        g = next(i for i, ks in enumerate(e.src_groups) if picked[e.src] in ks)
        h = next(i for i, ks in enumerate(e.dst_groups) if picked[e.dst] in ks)
        memory += math.ceil(e.memory[g][h]) if e.memory[g][h] > 0 else 0.0
    choice = {name: fmap[picked[ci]] for name, (ci, fmap) in graph.node_choice.items()}
    objective = solver.ObjectiveValue()
    return Solution(
        choice=choice,
        objective=objective / SCALE,
        memory=memory,
        optimal=status == cp_model.OPTIMAL and objective <= solver.BestObjectiveBound(),
        gap=max(0.0, (objective - solver.BestObjectiveBound()) / objective) if objective > 0 else 0.0,
        solve_time=time.perf_counter() - t0,
        num_classes=len(graph.decisions),
        num_edge_vars=n_edge_vars,
        stats={"build_time": build_time, "cp_sat_time": solver.WallTime()},
    )


def _limit(cutoff: Cutoff, gap: float) -> int:
    """The largest objective (integer units) constraint (g) allows under ``cutoff``: a plan
    must beat the other candidate by more than the relative ``gap`` the solves stop at."""
    limit = round(cutoff.objective * (1 - gap) * SCALE)
    return limit - 1 if cutoff.strict else limit


def _above(bound: float, limit: float) -> bool:
    """``bound`` (a relaxation's optimum, seconds) exceeds ``limit`` beyond the rounding of the
    program's integer costs."""
    return bound * (1 - 1e-6) > limit


def _infeasible(graph: StrategyGraph, memory_budget: float) -> InfeasibleError:
    return InfeasibleError(
        f"no plan fits {_fmt_bytes(memory_budget)} per device on mesh {graph.mesh_shape}: the smallest "
        f"reachable is {_fmt_bytes(graph.min_memory())} per device (parameters, gradients and optimizer "
        f"state fully sharded, activations sharded as far as shapes allow). Use more devices, a larger "
        f"memory_budget, a smaller batch, a cheaper optimizer, or the optimizer state on the host "
        f"(offload_optimizer=True).",
        smallest=graph.min_memory(),
    )


def _fmt_bytes(b: float) -> str:
    """Bytes in the largest binary unit that keeps the number readable (1 KiB budgets as well as 80 GiB)."""
    for unit, f in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if b >= f:
            return f"{b / f:.2f} {unit}"
    return f"{b:.0f} B"

r"""The sharding ILP, solved with OR-Tools CP-SAT (the formulation of Alpa's intra-operator pass,
Zheng et al., OSDI 2022 §4.2, and XLA's auto-sharding).

Graph after reductions (``passes.strategies``): *classes* ``c`` — a leader node with the nodes
that follow it, merged with the same position of every repeated layer — each with strategies
``k ∈ K_c``; *edges* ``(a, b)`` between classes, each with a cost matrix ``C_ab[g, h]`` indexed by
the producer's output-spec group ``g`` and the consumer's (input-spec, split) group ``h``.

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

The marginal form (b)-(c) (rather than linearizing s_a·s_b per pair) is what lets CP-SAT prove
optimality quickly; grouping strategies by the spec they show an edge shrinks it further.
Repeated layers share classes and edges, so the model's size does not grow with depth.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
from torch.fx import GraphModule, Node

from autopar.ir import STRATEGIES, TENSOR, NodeStrategies, Strategy
from autopar.passes import PassContext
from autopar.placement import Replicate, Spec, format_spec
from autopar.reshard import bucketed_grad_sync, edge_cost, kept_gather_bytes
from autopar.rules import tensor_inputs, zero_stage_of

__all__ = ["InfeasibleError", "Solution", "SolverConfig", "solve"]

SCALE = 1e12
"""Objective units per second (picoseconds): one fixed factor for every cost term."""
INF = float("inf")


class InfeasibleError(RuntimeError):
    """No strategy assignment fits the memory budget."""


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


@dataclass
class Solution:
    choice: dict[str, int]
    """node name -> index into its ``NodeStrategies.strategies``."""
    objective: float
    """Predicted step time (seconds) as the ILP counts it."""
    memory: float
    """Predicted bytes per device."""
    optimal: bool
    solve_time: float
    num_classes: int
    num_edge_vars: int
    stats: dict[str, float] = field(default_factory=dict)


@dataclass(eq=False)
class _Class:
    key: object
    leaders: list[Node]
    strategies: tuple[Strategy, ...]
    allowed: list[bool]
    unary: list[float]
    memory: list[float]


def _roots(nodes: list[Node]) -> dict[Node, tuple[Node, tuple[int, ...]]]:
    """For each node, its root leader and the map leader strategy -> node strategy."""
    by_name = {n.name: n for n in nodes}
    roots: dict[Node, tuple[Node, tuple[int, ...]]] = {}
    for n in nodes:  # topological order: producers first
        ns: NodeStrategies = n.meta[STRATEGIES]
        if ns.follows and ns.follows in by_name and by_name[ns.follows] in roots:
            leader, pmap = roots[by_name[ns.follows]]
            roots[n] = (leader, tuple(ns.follow_map[k] for k in pmap))
        else:
            roots[n] = (n, tuple(range(len(ns.strategies))))
    return roots


def _spec_matches(spec: Spec, want: Spec) -> bool:
    """``want`` from ``fixed``: a Shard matches any block count on that dim."""
    if len(spec) != len(want):
        return False
    for p, q in zip(spec, want):
        if type(p) is not type(q):
            return False
        if hasattr(q, "dim") and p.dim != q.dim:
            return False
    return True


def solve(
    gm: GraphModule,
    ctx: PassContext,
    *,
    memory_budget: float,
    fixed: dict[str, Spec] | None = None,
    config: SolverConfig | None = None,
) -> Solution:
    """Choose one strategy per node minimizing predicted step time under ``memory_budget``."""
    from ortools.sat.python import cp_model

    config = config or SolverConfig()
    t0 = time.perf_counter()
    mesh = ctx.mesh_shape
    fixed = fixed or {}
    nodes = [n for n in gm.graph.nodes if STRATEGIES in n.meta]
    roots = _roots(nodes)

    # ---- Classes: leaders tied across repeated layers (same strategy list object, same fixed spec).
    fixed_of: dict[Node, Spec] = {}
    for n in nodes:
        info = n.meta[TENSOR]
        if info.kind in ("param", "input") and info.fqn in fixed:
            fixed_of[n] = fixed[info.fqn]
    classes: dict[object, _Class] = {}
    class_of: dict[Node, _Class] = {}
    for n in nodes:
        leader, _ = roots[n]
        if leader is not n:
            continue
        ns: NodeStrategies = n.meta[STRATEGIES]
        tie = n.meta.get("autopar.tie")
        key = (tie, id(ns.strategies), fixed_of.get(n)) if tie is not None else n.name
        cls = classes.get(key)
        if cls is None:
            k = len(ns.strategies)
            cls = classes[key] = _Class(key, [], ns.strategies, [True] * k, [0.0] * k, [0.0] * k)
        cls.leaders.append(n)
        class_of[n] = cls
        if n in fixed_of:
            want = fixed_of[n]
            for k, s in enumerate(ns.strategies):
                if not _spec_matches(s.outputs[0], want):
                    cls.allowed[k] = False
            if not any(cls.allowed):
                raise ValueError(
                    f"fixed placement {format_spec(want)} for {n.meta[TENSOR].fqn} is not a valid layout of "
                    f"shape {n.meta[TENSOR].shape} on mesh {mesh} (a sharded dimension must divide evenly)"
                )
    # ---- Unary terms: compute + in-op comm + memory of every member.
    for n in nodes:
        leader, fmap = roots[n]
        cls = class_of[leader]
        strategies = n.meta[STRATEGIES].strategies
        for k in range(len(cls.strategies)):
            s = strategies[fmap[k]]
            cls.unary[k] += s.compute_time + s.comm_time
            cls.memory[k] += s.memory
    # ---- Edges, grouped by the spec each side shows.
    edge_cache: dict[tuple, float] = {}
    edges: dict[tuple, dict] = {}
    # Repeated layers repeat their edges: count identical ones, cost each kind once.
    pending: dict[tuple, list] = {}
    for c in list(nodes) + [n for n in gm.graph.nodes if n.op == "output"]:
        if c.op == "output":
            _output_edges(c, roots, class_of, edges, edge_cache, ctx)
            continue
        c_leader, c_map = roots[c]
        c_cls = class_of[c_leader]
        c_strats = c.meta[STRATEGIES].strategies
        for j, i in enumerate(tensor_inputs(c)):
            if i not in roots:
                continue
            i_leader, i_map = roots[i]
            i_cls = class_of[i_leader]
            i_strats = i.meta[STRATEGIES].strategies
            info = i.meta[TENSOR]
            val = i.meta["val"]
            shape, itemsize = tuple(val.shape), val.element_size()
            src_groups = [_src_key(info, i_strats[i_map[k]]) for k in range(len(i_cls.strategies))]
            dst_groups = [_dst_key(c_strats[c_map[k]], j) for k in range(len(c_cls.strategies))]
            bucketed = bucketed_grad_sync(i)

            def cost(
                src_key: tuple, dst: tuple, shape=shape, itemsize=itemsize, rg=info.requires_grad, b=bucketed
            ) -> tuple[float, float]:
                """(seconds, bytes kept) of carrying ``src_key`` into ``dst``."""
                src, stage = src_key
                key = (shape, itemsize, src_key, dst, rg, b)
                v = edge_cache.get(key)
                if v is None:
                    spec, split = dst
                    if spec is None:
                        v = (0.0, 0.0)
                    else:
                        t = edge_cost(
                            shape,
                            itemsize,
                            src,
                            spec,
                            split,
                            rg,
                            mesh,
                            ctx.cluster,
                            bucketed_sync=b,
                            zero_stage=stage,
                        )
                        v = (t, kept_gather_bytes(shape, itemsize, src, spec, mesh, stage))
                    edge_cache[key] = v
                return v

            key = (
                id(i_cls),
                id(c_cls),
                tuple(src_groups),
                tuple(dst_groups),
                shape,
                itemsize,
                info.requires_grad,
                bucketed,
            )
            entry = pending.get(key)
            if entry is None:
                pending[key] = [i_cls, c_cls, src_groups, dst_groups, cost, 1]
            else:
                entry[-1] += 1
    for i_cls, c_cls, src_groups, dst_groups, cost, count in pending.values():
        if i_cls is c_cls:
            for k in range(len(c_cls.strategies)):
                t, m = cost(src_groups[k], dst_groups[k])
                c_cls.unary[k] += t * count
                c_cls.memory[k] += m * count
            continue
        _add_edge(edges, i_cls, c_cls, src_groups, dst_groups, cost, count)
    # ---- Build the CP-SAT model.
    model = cp_model.CpModel()
    s_vars: dict[int, list] = {}
    cls_list = list(classes.values())
    for ci, cls in enumerate(cls_list):
        vs = [model.NewBoolVar(f"s[{ci},{k}]") for k in range(len(cls.strategies))]
        s_vars[id(cls)] = vs
        model.AddExactlyOne(vs)  # (a)
        for k, ok in enumerate(cls.allowed):  # (e)
            if not ok:
                model.Add(vs[k] == 0)
        for k, u in enumerate(cls.unary):
            if not math.isfinite(u):
                model.Add(vs[k] == 0)
    objective = []
    for cls in cls_list:
        for v, u in zip(s_vars[id(cls)], cls.unary):
            if math.isfinite(u) and u > 0:
                objective.append(round(u * SCALE) * v)
    n_edge_vars = 0
    edge_mem_terms = []
    for (a, b, _), e in edges.items():
        sa, sb = s_vars[id(a)], s_vars[id(b)]
        g_members, h_members, matrix, mem = e["g"], e["h"], e["C"], e["M"]
        evars = {}
        for g in range(len(g_members)):
            for h in range(len(h_members)):
                c = matrix[g][h]
                if not math.isfinite(c):
                    continue
                v = model.NewBoolVar("")
                evars[(g, h)] = v
                if c > 0:
                    objective.append(round(c * SCALE) * v)
        n_edge_vars += len(evars)
        for (g, h), v in evars.items():
            if mem[g][h] > 0:
                edge_mem_terms.append((math.ceil(mem[g][h]), v))
        for g, ks in enumerate(g_members):  # (b)
            model.Add(
                sum(evars[(g, h)] for h in range(len(h_members)) if (g, h) in evars) == sum(sa[k] for k in ks)
            )
        for h, ls in enumerate(h_members):  # (c)
            model.Add(
                sum(evars[(g, h)] for g in range(len(g_members)) if (g, h) in evars) == sum(sb[k] for k in ls)
            )
    mem_terms = []
    for cls in cls_list:
        for v, m in zip(s_vars[id(cls)], cls.memory):
            if m > 0:
                mem_terms.append(math.ceil(m) * v)
    budget = int(memory_budget)
    model.Add(sum(mem_terms) + sum(c * v for c, v in edge_mem_terms) <= budget)  # (d)
    model.Minimize(sum(objective))
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = config.time_limit
    solver.parameters.num_workers = config.num_workers
    solver.parameters.linearization_level = config.linearization_level
    solver.parameters.random_seed = config.random_seed
    solver.parameters.cp_model_presolve = config.presolve
    build_time = time.perf_counter() - t0
    status = solver.Solve(model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        min_mem = _min_memory(cls_list)
        raise InfeasibleError(
            f"no plan fits {_fmt_bytes(memory_budget)} per device on mesh {mesh}: the smallest reachable "
            f"is {_fmt_bytes(min_mem)} per device (parameters, gradients and optimizer state fully "
            f"sharded, activations sharded as far as shapes allow). Use more devices, a larger "
            f"memory_budget, a smaller batch, or a cheaper optimizer."
        )
    choice: dict[str, int] = {}
    memory = 0.0
    for cls in cls_list:
        k = next(k for k, v in enumerate(s_vars[id(cls)]) if solver.Value(v))
        memory += cls.memory[k]
        for leader in cls.leaders:
            choice[leader.name] = k
    memory += sum(coef * solver.Value(v) for coef, v in edge_mem_terms)
    for n in nodes:
        leader, fmap = roots[n]
        choice[n.name] = fmap[choice[leader.name]]
    return Solution(
        choice=choice,
        objective=solver.ObjectiveValue() / SCALE,
        memory=memory,
        optimal=status == cp_model.OPTIMAL,
        solve_time=time.perf_counter() - t0,
        num_classes=len(cls_list),
        num_edge_vars=n_edge_vars,
        stats={"build_time": build_time, "cp_sat_time": solver.WallTime()},
    )


def _src_key(info, s: Strategy) -> tuple:
    """What an edge's cost depends on at the producer: its output spec, and for a trainable
    parameter the ZeRO stage it runs with where it is gathered (0 for other values)."""
    stage = zero_stage_of(s.rewrites) if info.kind == "param" and info.requires_grad else 0
    return (s.outputs[0], stage)


def _dst_key(s: Strategy, j: int) -> tuple:
    """What an edge's cost depends on at the consumer: the input spec, and for the axes where that
    spec is Replicate, whether the consumer splits work there (gradient sync)."""
    spec = s.inputs[j]
    if spec is None:
        return (None, ())
    return (spec, tuple(sp and isinstance(p, Replicate) for sp, p in zip(s.split, spec)))


def _add_edge(
    edges: dict, a: _Class, b: _Class, src_groups: list, dst_groups: list, cost, count: int = 1
) -> None:
    g_keys = list(dict.fromkeys(src_groups))
    h_keys = list(dict.fromkeys(dst_groups))
    key = (a, b, (tuple(src_groups), tuple(dst_groups)))
    e = edges.get(key)
    if e is None:
        g_members = [[k for k, s in enumerate(src_groups) if s == g] for g in g_keys]
        h_members = [[k for k, d in enumerate(dst_groups) if d == h] for h in h_keys]
        e = edges[key] = {
            "g": g_members,
            "h": h_members,
            "C": [[0.0] * len(h_keys) for _ in g_keys],
            "M": [[0.0] * len(h_keys) for _ in g_keys],
            "gk": g_keys,
            "hk": h_keys,
        }
    for gi, g in enumerate(e["gk"]):
        for hi, h in enumerate(e["hk"]):
            t, m = cost(g, h)
            e["C"][gi][hi] += t * count
            e["M"][gi][hi] += m * count


def _output_edges(out: Node, roots, class_of, edges, edge_cache, ctx) -> None:
    """Scalar outputs (a loss) must end replicated; larger outputs are returned as laid out."""
    mesh = ctx.mesh_shape
    for i in out.all_input_nodes:
        if i not in roots:
            continue
        val = i.meta.get("val")
        if not isinstance(val, torch.Tensor) or val.dim() > 0:
            continue
        leader, fmap = roots[i]
        cls = class_of[leader]
        strats = i.meta[STRATEGIES].strategies
        target = tuple(Replicate() for _ in mesh)
        for k in range(len(cls.strategies)):
            src = strats[fmap[k]].outputs[0]
            cls.unary[k] += (
                edge_cost(
                    (), val.element_size(), src, target, tuple(False for _ in mesh), False, mesh, ctx.cluster
                )
                if src != target
                else 0.0
            )


def _fmt_bytes(b: float) -> str:
    """Bytes in the largest binary unit that keeps the number readable (1 KiB budgets as well as 80 GiB)."""
    for unit, f in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if b >= f:
            return f"{b / f:.2f} {unit}"
    return f"{b:.0f} B"


def _min_memory(cls_list: list[_Class]) -> float:
    return sum(min((m for m, ok in zip(c.memory, c.allowed) if ok), default=0.0) for c in cls_list)

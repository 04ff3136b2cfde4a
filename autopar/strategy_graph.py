"""The strategy graph: the solver's whole input as one record, and the solver's answer.

Words:

* **decision** — one choice the solver makes: a leader node (with the cheap nodes that follow it)
  merged with the same position of every repeated layer, so repeated layers share one choice.
  Each of its strategies ``k`` has a time ``unary[k]`` (compute and in-op collectives of every
  member, seconds) and a memory ``memory[k]`` (bytes per device).
* **edge** — a producer decision feeding a consumer decision, with a cost matrix ``cost[g][h]``
  over the producer's output-spec *groups* ``g`` and the consumer's (input spec, split) groups
  ``h``: strategies that look the same to the edge share a group, which keeps the program small.
  ``inf`` marks an edge that cannot be realized.

``passes.formulate`` builds a :class:`StrategyGraph` from an annotated graph and a mesh;
``autopar.solver.solve`` turns it into a :class:`Solution`. ``str(graph)`` prints the integer
program in the solver's notation, so a person can read what is being optimized.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = ["Decision", "Edge", "Solution", "StrategyGraph"]


@dataclass(eq=False, slots=True)
class Decision:
    """One solver choice (see module docstring)."""

    name: str
    """The first leader node's name (for printing)."""
    members: tuple[str, ...]
    """Leader nodes that share the choice (repeated layers)."""
    unary: list[float]
    """Seconds per strategy: forward + backward compute and in-op collectives of every member."""
    memory: list[float]
    """Bytes per device per strategy."""
    allowed: list[bool]
    """False where a user constraint (``fixed``) forbids the strategy."""
    labels: tuple[str, ...] = ()
    """Per strategy, its output spec as text (for printing)."""
    weight: bool = False
    """A parameter's decision. What it and its edges cost (gathers for use, gradient reductions)
    the step runs beside the compute (``autopar.simulate``); everything else is on the *compute
    path* every micro-batch walks (:meth:`StrategyGraph.path_terms`)."""

    @property
    def size(self) -> int:
        return len(self.unary)


@dataclass(eq=False, slots=True)
class Edge:
    """A producer decision feeding a consumer decision (see module docstring)."""

    src: int
    """Producer decision index."""
    dst: int
    """Consumer decision index."""
    src_groups: tuple[tuple[int, ...], ...]
    """Producer strategies in each group ``g``."""
    dst_groups: tuple[tuple[int, ...], ...]
    """Consumer strategies in each group ``h``."""
    cost: list[list[float]]
    """``cost[g][h]``: seconds of carrying group ``g`` into group ``h`` (forward reshard, its
    backward conjugate, gradient synchronization), summed over the repeated edges it stands for."""
    memory: list[list[float]]
    """``memory[g][h]``: bytes kept by the edge (a ZeRO-1/2 parameter's gathered copy)."""


@dataclass(eq=False, slots=True)
class StrategyGraph:
    """The solver's input (see module docstring)."""

    decisions: list[Decision]
    edges: list[Edge]
    node_choice: dict[str, tuple[int, tuple[int, ...]]]
    """Node name -> (decision index, map from the decision's strategy to the node's)."""
    mesh_shape: tuple[int, ...]
    complete: bool = True
    """False where ``passes.formulate`` left the edges out: the decisions alone need more memory
    than the budget (``min_memory``), so no plan fits whatever the edges cost."""

    def path_terms(self) -> tuple[list[int], list[int]]:
        """The decisions and edges on the compute path (``Decision.weight``): a plan's compute
        path, summed over its micro-batches and shared among the pipeline ranks, is a lower bound
        of its simulated step (a rank is busy at least its share of it)."""
        on = [i for i, d in enumerate(self.decisions) if not d.weight]
        return on, [j for j, e in enumerate(self.edges) if not self.decisions[e.src].weight]

    def tree_bound(self, *, path_only: bool = False) -> float:
        """A lower bound of the objective (``path_only``: of the compute path, ``path_terms``), in
        seconds, found in milliseconds: the program with its memory constraint and every edge
        outside a maximum spanning forest of the decision graph dropped, solved exactly by dynamic
        programming over the forest (min-sum message passing from the leaves to a root).

        Dropping a constraint or a cost term can only lower the optimum (every time is ≥ 0), so
        the result never exceeds it; the forest keeps the edges whose typical (median) cost is
        largest, so what is dropped is what matters least. On LLaMA-3-8B's stage programs it is
        within 1-10 % of the optimum (exact on 1-D meshes), in about 10 ms where CP-SAT's root LP
        takes a second: enough to prove a candidate far slower than another without CP-SAT
        (``autopar.solver.solve``)."""
        import numpy as np

        n = len(self.decisions)
        unary = [
            np.zeros(d.size)
            if path_only and d.weight
            else np.array([u if ok else math.inf for u, ok in zip(d.unary, d.allowed)], dtype=float)
            for d in self.decisions
        ]
        pair: dict[tuple[int, int], np.ndarray] = {}  # (a, b), a < b -> cost matrix over a's × b's strategies
        weight: dict[tuple[int, int], float] = {}
        for e in self.edges:
            if e.src == e.dst or (path_only and self.decisions[e.src].weight):
                continue
            g_of = np.empty(self.decisions[e.src].size, dtype=int)
            for g, ks in enumerate(e.src_groups):
                g_of[list(ks)] = g
            h_of = np.empty(self.decisions[e.dst].size, dtype=int)
            for h, ls in enumerate(e.dst_groups):
                h_of[list(ls)] = h
            m = np.array(e.cost, dtype=float)[g_of][:, h_of]
            key = (min(e.src, e.dst), max(e.src, e.dst))
            m = m if key[0] == e.src else m.T
            pair[key] = pair[key] + m if key in pair else m  # edges between the same two: summed
            finite = m[np.isfinite(m)]
            weight[key] = weight.get(key, 0.0) + (float(np.median(finite)) if finite.size else 0.0)
        # Kruskal's maximum spanning forest (union-find).
        root = list(range(n))

        def find(x: int) -> int:
            while root[x] != x:
                root[x] = root[root[x]]
                x = root[x]
            return x

        adj: list[list[int]] = [[] for _ in range(n)]
        for a, b in sorted(weight, key=lambda k: -weight[k]):
            ra, rb = find(a), find(b)
            if ra != rb:
                root[ra] = rb
                adj[a].append(b)
                adj[b].append(a)
        # Messages from the leaves up, one tree at a time.
        total, seen = 0.0, [False] * n
        for start in range(n):
            if seen[start]:
                continue
            order, parent, stack = [], {start: -1}, [start]
            seen[start] = True
            while stack:
                v = stack.pop()
                order.append(v)
                for w in adj[v]:
                    if not seen[w]:
                        seen[w] = True
                        parent[w] = v
                        stack.append(w)
            belief = {v: unary[v].copy() for v in order}
            for v in reversed(order):
                p = parent[v]
                if p < 0:
                    continue
                m = pair[(v, p)] if v < p else pair[(p, v)].T  # v's × p's strategies
                belief[p] += np.min(belief[v][:, None] + m, axis=0)
            total += float(np.min(belief[start]))
        return total

    def min_memory(self) -> float:
        """The smallest memory any assignment reaches (each decision at its smallest allowed)."""
        return sum(min((m for m, ok in zip(d.memory, d.allowed) if ok), default=0.0) for d in self.decisions)

    def __str__(self) -> str:
        lines = [
            f"strategy graph on mesh {self.mesh_shape}: {len(self.decisions)} decisions, {len(self.edges)} edges",
            "variables  s[c,k] ∈ {0,1} (decision c runs strategy k);  e[ab,g,h] ∈ {0,1} (edge a→b carries g→h)",
            "minimize   Σ T[c,k]·s[c,k] + Σ C[ab,g,h]·e[ab,g,h]      (seconds)",
            "subject to (a) Σ_k s[c,k] = 1   (b) Σ_h e[ab,g,h] = Σ_{k∈g} s[a,k]   (c) Σ_g e[ab,g,h] = Σ_{k∈h} s[b,k]",
            "           (d) Σ M[c,k]·s[c,k] + Σ M[ab,g,h]·e[ab,g,h] ≤ budget   (e) s[c,k] = 0 where fixed forbids k",
            "           (f) e[ab,g,h] = 0 where C = ∞   (g) objective < cutoff   (h) compute path ≤ its cutoff",
            "",
        ]
        for ci, d in enumerate(self.decisions):
            tied = f" ×{len(d.members)}" if len(d.members) > 1 else ""
            terms = []
            for k in range(d.size):
                label = d.labels[k] if k < len(d.labels) else str(k)
                mark = "" if d.allowed[k] else " (forbidden)"
                terms.append(f"k{k}[{label}] T={d.unary[k] * 1e6:.1f}µs M={d.memory[k] / 2**20:.1f}MiB{mark}")
            lines.append(f"c{ci} {d.name}{tied}: " + "; ".join(terms))
        for e in self.edges:
            finite = [c for row in e.cost for c in row if math.isfinite(c)]
            worst = max(finite) * 1e6 if finite else 0.0
            lines.append(
                f"edge c{e.src}→c{e.dst}: {len(e.src_groups)}×{len(e.dst_groups)} groups, "
                f"cost 0…{worst:.1f}µs"
            )
        return "\n".join(lines)


@dataclass
class Solution:
    """The solver's answer."""

    choice: dict[str, int]
    """Node name -> index into its ``NodeStrategies.strategies``."""
    objective: float
    """Predicted step time (seconds) as the integer program counts it."""
    memory: float
    """Predicted bytes per device."""
    optimal: bool
    """Proven optimal (not only within ``SolverConfig.relative_gap``)."""
    solve_time: float
    num_classes: int
    num_edge_vars: int
    stats: dict[str, float] = field(default_factory=dict)
    gap: float = 0.0
    """How far the objective may be above the optimum, as a fraction of it (CP-SAT's bound)."""

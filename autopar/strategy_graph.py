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
            "           (f) e[ab,g,h] = 0 where C = ∞",
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
    solve_time: float
    num_classes: int
    num_edge_vars: int
    stats: dict[str, float] = field(default_factory=dict)

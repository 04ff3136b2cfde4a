"""The records the per-rank compiler builds and the runtime runs: this rank's whole step
(``RankStep``, built by ``autopar.passes.rank_compiler``), holding its training step as programs
(``StepProgram``) or its pipeline stages' steps (``StageStep``, with the others of its rank:
``RankStages``). They are data: the passes that build them never import the runtime, and the
runtime (``autopar.runtime.module``, ``autopar.runtime.step_runner``,
``autopar.runtime.pipeline_runner``) runs them without re-deriving a decision.

``StepProgram`` holds the three graphs — the joint program (what ``pm.code`` prints), and the
forward and backward programs it was partitioned into — and what binds them: which outputs take a
tangent, which inputs get a gradient. Collectives in these programs are graph nodes, so how many
run per step is read off the graphs (``collective_tally``) and added to each axis's ``counts``
every time a program runs.

With ``parallelize(..., compile=True)`` each program of a record is also compiled by Inductor
(``autopar.passes.compile``): the compiled callables sit beside the graphs in ``compiled``, by
program name, and ``program(name)`` is what the runtime calls — the compiled program where there
is one, else the graph itself. The graphs stay what ``pm.code`` prints and what the collectives are
counted from. ``CompileReport`` records what compilation did on a rank.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.fx import GraphModule

from autopar.program.collectives import AxisGroup

__all__ = [
    "FUNCTIONAL_COLLECTIVES",
    "CollectiveCall",
    "CompileReport",
    "RankStages",
    "RankStep",
    "StageStep",
    "StepProgram",
    "StepTimes",
    "collective_tally",
    "group_names",
    "two_level_groups",
]

_fc = torch.ops._c10d_functional
FUNCTIONAL_COLLECTIVES = {
    _fc.all_reduce.default: "all_reduce",
    _fc.all_gather_into_tensor.default: "all_gather",
    _fc.all_gather_into_tensor_out.default: "all_gather",
    _fc.reduce_scatter_tensor.default: "reduce_scatter",
    _fc.all_to_all_single.default: "all_to_all",
}
"""Collective ops of a traced program and the kind each is counted as."""


@dataclass(frozen=True, slots=True)
class CollectiveCall:
    """One collective node of a program: its kind, mesh axis, direction and size."""

    kind: str
    axis: int
    direction: str
    """``fwd`` (forward program) or ``bwd`` (backward program)."""
    numel: int
    """Elements of its input (an all-gather: the local piece)."""


def collective_tally(gm: GraphModule, axes: Sequence[AxisGroup], direction: str) -> list[CollectiveCall]:
    """Every collective node of ``gm`` in program order (one per axis for a collective over a
    group of several axes, ``AxisGroup.combined``)."""
    by_group = {ax.group_name: (ax.axis,) for ax in axes}
    for ax in _combined(axes):
        by_group[ax.group_name] = tuple(p.axis for p in ax.parts)
    for ax in (*axes, *_combined(axes)):  # a two-level reduction's collectives count on its axes
        for level in ax.levels or ():
            by_group[level.group_name] = by_group[ax.group_name]
    out = []
    for n in gm.graph.nodes:
        kind = FUNCTIONAL_COLLECTIVES.get(n.target) if n.op == "call_function" else None
        if kind is None:
            continue
        group = next((a for a in n.args if isinstance(a, str) and a in by_group), None)
        inp = n.args[0]
        val = inp.meta.get("val") if isinstance(inp, torch.fx.Node) else None
        numel = val.numel() if isinstance(val, torch.Tensor) else 0
        out.extend(CollectiveCall(kind, a, direction, numel) for a in by_group.get(group, (-1,)))
    return out


def _combined(axes: Sequence[AxisGroup]) -> list[AxisGroup]:
    """The groups over several of ``axes``' mesh axes (``AxisGroup.combined``)."""
    return list(axes[0].combined.values()) if axes else []


def group_names(axes: Sequence[AxisGroup]) -> dict[str, str]:
    """Process group name -> axis name, for ``axes``, the groups over several of them and their
    two-level reductions' groups (``AxisGroup.levels``: ``dp/node``, ``dp/across``)."""
    names = {}
    for ax in (*axes, *_combined(axes)):
        names[ax.group_name] = ax.name
        if ax.levels is not None:
            inside, across = ax.levels
            names[inside.group_name], names[across.group_name] = f"{ax.name}/node", f"{ax.name}/across"
    return names


def two_level_groups(axes: Sequence[AxisGroup]) -> dict[str, tuple[str, int, str]]:
    """Process-group name -> ``(on-node group name, its size, across-nodes group name)`` of each of
    ``axes`` (and their groups over several axes) whose gradients the plan reduces in two levels
    (``AxisGroup.levels``)."""
    out = {}
    for ax in (*axes, *_combined(axes)):
        if ax.levels is not None:
            inside, across = ax.levels
            out[ax.group_name] = (inside.group_name, inside.size, across.group_name)
    return out


@dataclass(frozen=True, slots=True)
class StepTimes:
    """Measured on one rank for one training step (forward call to the end of backward)."""

    step: float
    """Seconds from the forward call to the end of the backward program."""
    exposed_comm: float
    """Seconds blocked waiting for collectives (communication not hidden behind compute)."""

    @property
    def compute(self) -> float:
        """The rest: compute, and Python and launch overhead."""
        return self.step - self.exposed_comm


@dataclass(frozen=True, slots=True)
class CompileReport:
    """What ``compile=True`` did on one rank (``ParallelModule.compiled``)."""

    compiled: bool
    """Every program of the rank's step runs compiled; ``False``: all run eagerly (``reason``)."""
    seconds: dict[str, float] = field(default_factory=dict)
    """Seconds Inductor took per program (``"forward"``, ``"stage 1 backward_input"``), on this rank."""
    reason: str = ""
    """Why the programs run eagerly (which rank, which program, the error); empty when compiled."""

    @property
    def total_seconds(self) -> float:
        return sum(self.seconds.values())

    def __str__(self) -> str:
        if not self.compiled:
            return f"eager: {self.reason}"
        each = ", ".join(f"{k} {v:.1f} s" for k, v in self.seconds.items())
        return f"compiled by Inductor in {self.total_seconds:.1f} s ({each})"


@dataclass(eq=False)
class StepProgram:
    """A rank's training step as programs (see module docstring), built by
    the per-rank compiler (``autopar.passes.joint.step_program``). The runtime binds it to this rank before the
    first step (``autopar.runtime.step_runner.bind_step``), which fills ``calls``, ``axes`` and ``monitor``."""

    joint: GraphModule
    """Forward and backward as one graph: ``(primals…, tangents…) -> (outputs…, gradients…)``."""
    forward: GraphModule
    """``primals -> (outputs…, saved…)``."""
    backward: GraphModule
    """``(saved…, tangents…) -> gradients``."""
    num_outputs: int
    grad_primals: tuple[int, ...]
    """Primal indices that receive the backward program's gradients, in order."""
    tangent_outputs: tuple[int, ...]
    """Output indices whose gradients the backward program takes, in order."""
    passes: tuple[str, ...] = ()
    """The rank-program passes that ran, in order (with what each changed, in the log)."""
    calls: dict[str, list[CollectiveCall]] = field(default_factory=dict)
    """Collectives per direction, read off the programs (``collective_tally``) when bound."""
    axes: list[AxisGroup] = field(default_factory=list)
    monitor: Any = None
    """The runtime's ``StepMonitor``, set when bound: every wait goes through it (which
    collective waits; timing; failures)."""
    times: list[StepTimes] = field(default_factory=list)
    """``StepTimes`` of the steps run since ``enable_timing``."""
    compiled: dict[str, Callable[..., Any]] = field(default_factory=dict)
    """``forward``/``backward`` compiled by Inductor (``autopar.passes.compile``), run in place of
    the graphs; empty: the graphs run eagerly."""

    def program(self, name: str) -> Callable[..., Any]:
        """What runs as program ``name``: its compiled form where there is one, else the graph."""
        return self.compiled.get(name) or getattr(self, name)

    def enable_timing(self) -> None:
        """Time every following step (waits timed: a few microseconds each)."""
        assert self.monitor is not None, "bind the step first (autopar.runtime.step_runner.bind_step)"
        self.monitor.timing = True

    def count(self, direction: str) -> None:
        """Add one run of the ``direction`` program's collectives to each axis's ``counts``."""
        for c in self.calls.get(direction, ()):
            if 0 <= c.axis < len(self.axes):
                self.axes[c.axis].counts[f"{c.kind}/{direction}"] += 1


@dataclass
class StageStep:
    """One stage's step as three programs (built by ``passes.stage_cut.stage_step``; run by
    ``autopar.runtime.pipeline_runner.PipelineRunner``).

    ``forward(*primals, *received) -> (*sent, *outputs, *saved)``;
    ``backward_input(*saved[:num_saved_i], *tangents) -> (*received_grads, *passed)``;
    ``backward_weight(*saved[saved_w], *passed) -> param_grads``.

    With several micro-batches and data-parallel weight gradients, ``backward_weight`` runs for
    the stage's last micro-batch only and takes ``num_deferred`` sums after its inputs (the
    earlier micro-batches' unreduced gradients, which it adds in before reducing them once);
    the earlier ones run ``backward_weight_local(*saved[saved_w], *passed) -> (*param_grads,
    *unreduced)``, whose reduced gradients are ``None`` (``passes.stage_cut.defer_reductions``).
    """

    stage: int
    forward: GraphModule
    backward_input: GraphModule
    backward_weight: GraphModule
    joint: GraphModule
    primals: tuple[int, ...]
    """Indices of the whole program's primals this stage reads."""
    received: tuple[str, ...]
    sent: tuple[str, ...]
    producer: dict[str, int]
    readers: dict[str, tuple[int, ...]]
    num_outputs: int
    num_saved_i: int
    saved_w: tuple[int, ...]
    tangent_outputs: tuple[int, ...]
    received_grads: tuple[int, ...]
    param_grads: tuple[int, ...]
    """Positions in ``primals`` whose gradient ``backward_weight`` returns."""
    received_meta: list[tuple[tuple[int, ...], torch.dtype]] = field(default_factory=list)
    """Shape and dtype of each received value (one micro-batch)."""
    backward_weight_local: GraphModule | None = None
    num_deferred: int = 0
    compiled: dict[str, Callable[..., Any]] = field(default_factory=dict)
    """The stage's programs compiled by Inductor (``autopar.passes.compile``), by name; empty: the
    graphs run eagerly."""

    def program(self, name: str) -> Callable[..., Any]:
        """What runs as program ``name``: its compiled form where there is one, else the graph."""
        return self.compiled.get(name) or getattr(self, name)


@dataclass
class RankStages:
    """The pipeline stages one rank holds, and where every stage and weight lives (built by
    the per-rank compiler's stage cut, ``passes.stage_cut``; run by
    ``autopar.runtime.pipeline_runner.PipelineRunner``)."""

    steps: dict[int, StageStep]
    """The stages this rank holds, by stage."""
    stage_coord: dict[int, int]
    """Stage -> the pipeline coordinate holding it (``passes.stage_cut.assign_stages``)."""
    holders: dict[str, list[int]]
    """Parameter or buffer name -> the pipeline coordinates holding it (several: a tied weight,
    whose gradients the runtime sums between them)."""


@dataclass(eq=False)
class RankStep:
    """This rank's step as the per-rank compiler built it (``autopar.passes.rank_compiler``), which
    the runtime runs as it is (``ParallelModule.set_step``): the training step as programs
    (``step``), or the pipeline stages this rank holds (``stages``), or — where neither was built
    (nothing to train, or a backward that could not be traced) — the forward program alone, run
    under autograd."""

    program: GraphModule
    """The lowered forward program, its kernels fused (``pm.forward_code``)."""
    step: StepProgram | None = None
    """The whole training step (a plan without pipeline stages), else ``None``."""
    stages: RankStages | None = None
    """This rank's pipeline stages (a pipelined plan), else ``None``."""
    passes: tuple[str, ...] = ()
    """The compiler's passes that ran, in order (what each did is in the ``autopar.passes`` log)."""
    compiled: CompileReport | None = None
    """What ``compile=True`` did (``None``: not asked for)."""

    @property
    def records(self) -> list[StepProgram | StageStep]:
        """Every program record of the step: the ``StepProgram``, or each held stage's ``StageStep``."""
        if self.stages is not None:
            return list(self.stages.steps.values())
        return [self.step] if self.step is not None else []

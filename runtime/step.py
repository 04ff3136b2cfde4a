"""Running a rank's whole training step: the forward and backward programs split from the joint
program (``autopar.passes.joint``), joined to the user's autograd by one ``autograd.Function``.

``StepProgram`` holds the three graphs — the joint program (what ``pm.code`` prints), and the
forward and backward programs it was partitioned into — and what binds them: which outputs take a
tangent, which inputs get a gradient. ``run_step(step, primals)`` runs the forward program and
returns its outputs; when the user calls ``backward()`` on them, the backward program runs with
the saved values and the incoming gradients, and the parameter gradients it returns flow into
``.grad`` as autograd's own would (accumulating across calls).

Collectives in these programs are graph nodes, so how many run per step is read off the graphs
(``collective_tally``) and added to each axis's ``counts`` every time a program runs.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch.fx import GraphModule

from autopar.runtime.collectives import AxisGroup
from autopar.runtime.monitor import StepMonitor

__all__ = [
    "FUNCTIONAL_COLLECTIVES",
    "StepProgram",
    "StepTimes",
    "collective_tally",
    "group_names",
    "run_step",
]

_fc = torch.ops._c10d_functional
FUNCTIONAL_COLLECTIVES = {
    _fc.all_reduce.default: "all_reduce",
    _fc.all_gather_into_tensor.default: "all_gather",
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
    """Process group name -> axis name, for ``axes`` and the groups over several of them."""
    return {ax.group_name: ax.name for ax in (*axes, *_combined(axes))}


def monitored_wait(x: torch.Tensor, monitor: StepMonitor, label: str) -> torch.Tensor:
    """``wait_tensor`` through the module's monitor (which collective is waiting; timing)."""
    return monitor.wait(x, label)


def _monitor_waits(gm: GraphModule, monitor: StepMonitor, axis_names: dict[str, str], direction: str) -> None:
    """Route every ``wait_tensor`` of ``gm`` through ``monitor``, labelled with its collective."""
    gm._monitor = monitor
    attr = None
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or n.target is not _fc.wait_tensor.default:
            continue
        if attr is None:
            first = next(m for m in gm.graph.nodes if m.op != "placeholder")
            with gm.graph.inserting_before(first), warnings.catch_warnings():
                # ``_monitor`` is a plain attribute (not a module, parameter or buffer), on purpose
                warnings.filterwarnings("ignore", message="Attempted to insert a get_attr Node")
                attr = gm.graph.get_attr("_monitor")
        issue = n.args[0]
        kind = FUNCTIONAL_COLLECTIVES.get(getattr(issue, "target", None), "collective")
        group = next((a for a in getattr(issue, "args", ()) if isinstance(a, str) and a in axis_names), None)
        label = f"{kind} on {axis_names.get(group, 'axis ?')} ({'forward' if direction == 'fwd' else 'backward'}, node {issue.name})"
        n.target = monitored_wait
        n.args = (issue, attr, label)
    gm.recompile()


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


@dataclass(eq=False)
class StepProgram:
    """A rank's training step as programs (see module docstring)."""

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
    """Collectives per direction (filled by ``bind``)."""
    axes: list[AxisGroup] = field(default_factory=list)
    monitor: StepMonitor | None = None
    """Set by ``bind``: every wait goes through it (which collective waits; timing; failures)."""
    times: list[StepTimes] = field(default_factory=list)
    """``StepTimes`` of the steps run since ``enable_timing``."""

    def enable_timing(self) -> None:
        """Time every following step (waits timed: a few microseconds each)."""
        assert self.monitor is not None, "bind the step first"
        self.monitor.timing = True

    def bind(self, axes: Sequence[AxisGroup], monitor: StepMonitor) -> None:
        """Attach this rank's axes (for counting) and monitor (for waits and failures), and tally
        the programs' collectives."""
        self.axes = list(axes)
        self.monitor = monitor
        self.calls = {
            "fwd": collective_tally(self.forward, axes, "fwd"),
            "bwd": collective_tally(self.backward, axes, "bwd"),
        }
        names = group_names(axes)
        _monitor_waits(self.forward, monitor, names, "fwd")
        _monitor_waits(self.backward, monitor, names, "bwd")

    def count(self, direction: str) -> None:
        for c in self.calls.get(direction, ()):
            if 0 <= c.axis < len(self.axes):
                self.axes[c.axis].counts[f"{c.kind}/{direction}"] += 1


class _RunStep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, step: StepProgram, *primals: torch.Tensor):  # type: ignore[override]
        monitor = step.monitor
        monitor.start_step()
        try:
            res = step.forward(*primals)
        except Exception as exc:  # noted for the other ranks; a peer's failure is named (runtime.monitor)
            err = monitor.fail(exc, "the forward program")
            if err is None:
                raise
            raise err from exc
        step.count("fwd")
        outs, saved = res[: step.num_outputs], res[step.num_outputs :]
        ctx.step = step
        ctx.num_primals = len(primals)
        ctx.out_meta = [(o.shape, o.dtype, o.device) if isinstance(o, torch.Tensor) else None for o in outs]
        # Saved sizes (a MoE dispatch's split sizes, read from a tensor) are ints: kept aside.
        ctx.save_for_backward(*[v for v in saved if isinstance(v, torch.Tensor)])
        ctx.saved_other = [(i, v) for i, v in enumerate(saved) if not isinstance(v, torch.Tensor)]
        tangent = set(step.tangent_outputs)
        ctx.mark_non_differentiable(
            *[o for i, o in enumerate(outs) if isinstance(o, torch.Tensor) and i not in tangent]
        )
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grad_outs: torch.Tensor | None):  # type: ignore[override]
        step: StepProgram = ctx.step
        tangents = []
        for i in step.tangent_outputs:
            g = grad_outs[i]
            if g is None:
                shape, dtype, device = ctx.out_meta[i]
                g = torch.zeros(shape, dtype=dtype, device=device)
            tangents.append(g.contiguous())
        monitor = step.monitor
        try:
            saved = list(ctx.saved_tensors)
            for i, v in ctx.saved_other:
                saved.insert(i, v)
            grads = step.backward(*saved, *tangents)
        except Exception as exc:
            err = monitor.fail(exc, "the backward program")
            if err is None:
                raise
            raise err from exc
        step.count("bwd")
        if monitor.timing:
            step.times.append(
                StepTimes(step=time.perf_counter() - monitor.started, exposed_comm=monitor.waiting)
            )
        result: list[torch.Tensor | None] = [None] * ctx.num_primals
        for i, g in zip(step.grad_primals, grads):
            result[i] = g
        return (None, *result)


def run_step(step: StepProgram, primals: Sequence[object]) -> tuple:
    """Run the forward program on ``primals`` under autograd (see module docstring)."""
    return _RunStep.apply(step, *primals)

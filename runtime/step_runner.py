"""Running a rank's whole training step: the forward and backward programs split from the joint
program (a ``StepProgram``, ``autopar.program.records``), joined to the user's autograd by one
``autograd.Function``.

``bind_step(step, axes, monitor)`` attaches this rank's axes and monitor to the step: its
collectives are tallied from the graphs (added to each axis's ``counts`` every time a program
runs) and every wait goes through the monitor. ``run_step(step, primals)`` runs the forward
program and returns its outputs; when the user calls ``backward()`` on them, the backward program
runs with the saved values and the incoming gradients, and the parameter gradients it returns flow
into ``.grad`` as autograd's own would (accumulating across calls).

Where the step was compiled (``parallelize(..., compile=True)``: ``step.compiled``), the compiled
programs run instead of the graphs (``StepProgram.program``). Their waits are Inductor's, not the
monitor's: a failure is still noted for the other ranks, but it names no collective, and
``StepTimes.exposed_comm`` is not measured (NaN).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Sequence

import torch
from torch.fx import GraphModule, Node

from autopar.program.collectives import AxisGroup
from autopar.program.records import (
    FUNCTIONAL_COLLECTIVES,
    StepProgram,
    StepTimes,
    collective_tally,
    group_names,
)
from autopar.runtime.monitor import StepMonitor

__all__ = ["bind_step", "plain_attribute", "run_step"]

_fc = torch.ops._c10d_functional


def monitored_wait(x: torch.Tensor, monitor: StepMonitor, label: str) -> torch.Tensor:
    """``wait_tensor`` through the module's monitor (which collective is waiting; timing)."""
    return monitor.wait(x, label)


def plain_attribute(gm: GraphModule, name: str, value: object) -> Node:
    """Set ``gm.<name> = value`` — a plain attribute (not a module, parameter or buffer), on
    purpose: a runtime object its nodes call with — and return a ``get_attr`` node reading it,
    placed before the program's first computation."""
    setattr(gm, name, value)
    first = next(m for m in gm.graph.nodes if m.op != "placeholder")
    with gm.graph.inserting_before(first), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Attempted to insert a get_attr Node")
        return gm.graph.get_attr(name)


def _monitor_waits(gm: GraphModule, monitor: StepMonitor, axis_names: dict[str, str], direction: str) -> None:
    """Route every ``wait_tensor`` of ``gm`` through ``monitor``, labelled with its collective."""
    attr = None
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or n.target is not _fc.wait_tensor.default:
            continue
        if attr is None:
            attr = plain_attribute(gm, "_monitor", monitor)
        issue = n.args[0]
        kind = FUNCTIONAL_COLLECTIVES.get(getattr(issue, "target", None), "collective")
        group = next((a for a in getattr(issue, "args", ()) if isinstance(a, str) and a in axis_names), None)
        label = f"{kind} on {axis_names.get(group, 'axis ?')} ({'forward' if direction == 'fwd' else 'backward'}, node {issue.name})"
        n.target = monitored_wait
        n.args = (issue, attr, label)
    gm.recompile()


def bind_step(step: StepProgram, axes: Sequence[AxisGroup], monitor: StepMonitor) -> None:
    """Attach this rank's axes (for counting) and monitor (for waits and failures) to ``step``, and
    tally its programs' collectives."""
    step.axes = list(axes)
    step.monitor = monitor
    step.calls = {
        "fwd": collective_tally(step.forward, axes, "fwd"),
        "bwd": collective_tally(step.backward, axes, "bwd"),
    }
    names = group_names(axes)
    _monitor_waits(step.forward, monitor, names, "fwd")
    _monitor_waits(step.backward, monitor, names, "bwd")


class _RunStep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, step: StepProgram, *primals: torch.Tensor):  # type: ignore[override]
        monitor = step.monitor
        monitor.start_step()
        try:
            res = step.program("forward")(*primals)
        except Exception as exc:  # noted for the other ranks; a peer's failure is named (runtime.monitor)
            err = monitor.step_failed(exc, "the forward program")
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
            grads = step.program("backward")(*saved, *tangents)
        except Exception as exc:
            err = monitor.step_failed(exc, "the backward program")
            if err is None:
                raise
            raise err from exc
        step.count("bwd")
        if monitor.timing:
            step.times.append(
                StepTimes(
                    step=time.perf_counter() - monitor.started,
                    exposed_comm=monitor.waiting if not step.compiled else float("nan"),
                )
            )
        result: list[torch.Tensor | None] = [None] * ctx.num_primals
        for i, g in zip(step.grad_primals, grads):
            result[i] = g
        return (None, *result)


def run_step(step: StepProgram, primals: Sequence[object]) -> tuple:
    """Run the forward program on ``primals`` under autograd (see module docstring)."""
    return _RunStep.apply(step, *primals)

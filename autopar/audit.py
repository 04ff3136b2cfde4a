"""The plan audit: a pass over a finished ``Plan`` that says where it wastes the devices it has,
and where its prediction cannot be right. ``audit(plan)`` reads nothing but the plan (no graph, no
solver), so a saved or hand-edited plan is audited as well as a fresh one; ``print(plan)``,
``autopar show`` and the HTML report show it, and ``autopar.plan``, ``layouts.megatron`` and
``layouts.best_megatron`` store it in ``plan.info["audit"]`` (``Audit.to_dict``) and raise one
``AuditWarning`` when it finds something that matters.

Words:

* **stage compute** — the sum of ``NodePlan.compute_time`` over a pipeline stage's nodes
  (``plan.pipeline.stage_of``; the whole plan when it has one stage). Shares of compute are taken
  per stage, because a pipeline runs its stages side by side: the slowest stage sets the step, and
  the last one holds the LM head and the loss.
* **replicated work** — an op that runs whole on every device of a mesh axis of size ``n > 1``
  (``split[a]`` false, every input and output ``R`` on that axis) although it has a sharding rule
  and a dimension of its output or of an input divides ``n`` ways: the axis's devices compute the
  same thing ``n`` times. Splitting it would save up to ``(n − 1)/n`` of its time. Left out: ops
  that cost at most ``CHEAP_KERNELS`` kernel launches (``DeviceSpec.kernel_overhead``: splitting
  does not shorten a launch); a stage's replicated work on an axis that, split all of it, would
  save at most one collective's latency there (an all-reduce of one element: split work meets the
  rest of the plan with at least one collective on the axis — a small model's loss, run whole on
  every device rather than all-reduced from its pieces over a slow local link); work that does not
  depend on the batch (a position embedding's lookup of ``arange``, rotary tables, masks of
  constants: every device needs it whole, so splitting it only adds a gather); and an op
  replicated on purpose, the only reader of a weight whose gradient is then not reduced over the
  axis, where that reduction (bucketed: bandwidth only) would cost more than the split saves (an
  embedding lookup run whole on every data-parallel device instead of all-reducing a large
  vocabulary's gradient). The motivating case: an LLaMA planned with pipeline stages and
  micro-batches ran its LM head and loss replicated over ``dp``, every data-parallel rank
  computing every rank's logits.
* **unruled op** — an op with tensor inputs but no sharding rule (``autopar.rules.base.has_rule_for``):
  it always runs replicated (correct, possibly slower; the planner names them when it plans).
* **communication bound** — per mesh axis, the bytes the plan's layout (its placements and each
  op's strategy) cannot avoid, in the accounting of ``Predicted.comm_bytes_per_axis`` (each
  collective's buffer: an all-reduce or a reduce-scatter counts its input, an all-gather its
  output; one micro-batch's activations, the gradients once): (a) every gradient the plan
  reduces over the axis, once, at its size on the other axes — a parameter's where its readers
  split the batch (replicated, or stored split and gathered for use: ZeRO), an activation's where
  a replicated value is read by split work (the ``f`` of Megatron-LM, Shoeybi et al. 2019, arXiv
  1909.08053, §3: the backward all-reduce of a column-parallel matmul's input); (b) every partial
  sum (an op's output ``P`` on the axis that a reader needs summed) once: a row-parallel
  matmul's output (Megatron-LM's ``g``, the forward all-reduce). Megatron-LM's tensor
  parallelism and plain data parallelism meet the bound; what lies above it is gathers and
  reshuffles. Sequence parallelism (a reduce-scatter and an all-gather for each all-reduce,
  Korthikanti et al. 2022, arXiv 2205.05198, §4.2.2) and ZeRO's gather beside its reduce-scatter
  (Rajbhandari et al. 2020, arXiv 1910.02054, §7) move the same ring volume
  (``autopar.cost.comm``: an all-reduce is a reduce-scatter plus an all-gather) but show as two
  buffers, so they read up to 2× (ZeRO-3, gathering again in backward, 3×). The bound's time is
  its ring volume at the axis's bus bandwidth with no latency, the gradients' all-reduce in two
  levels where that is faster (``autopar.cost.comm.gradient_all_reduce_cost`` and
  ``group_reduce_scatter_cost``).
* **MFU** — model FLOPs utilisation: the model's FLOPs per step over ``step_time × peak × devices``
  (Chowdhery et al. 2022, PaLM, arXiv 2204.02311, App. B). Model FLOPs are summed from the plan's
  nodes: ``2·m·n·k`` per matmul (``linear``, ``mm``, ``bmm``, ``matmul``, ``addmm``,
  ``baddbmm``, grouped expert matmuls, convolutions) and ``4·b·h·s·s_k·d`` per attention (Q·Kᵀ and
  P·V, counted whole even under a causal mask, as PaLM and Megatron-LM count it), times 3 for
  the backward (twice the forward), times the micro-batches of a step. No recomputation is
  counted (it is not model work). The peak is the device's dense peak for the parameters' dtype
  (``plan.info["param_bytes"]``: 2 bytes bf16, else fp32).

Thresholds (each finding says what it measured against):

* ``REPLICATED_WARN`` = 2 % of a stage's compute replicated over one axis. The plans autopar
  makes keep under it (the batch-independent work above is all that repeats on dp); an LM head
  and loss run whole is a tenth or more of the last stage. Megatron-LM's tensor parallelism
  without sequence parallelism repeats its norms, dropouts and residual adds on ``tp`` (the waste
  sequence parallelism removes): 22 % of a 32-layer GPT's compute (hidden 2048) at tp = 8, so the
  warning names it, and ``sequence_parallel=True`` clears it.
* ``UNRULED_WARN`` = 2 % of the step's compute in ops without a rule.
* ``COMM_WARN`` = 4 × the bound on an axis, and the excess worth more than ``COMM_MATERIAL`` = 5 %
  of the step at the axis's bandwidth: sequence parallelism and ZeRO read up to 3× by
  construction (above); beyond 4× something moves data the layout does not need.
* ``LAYOUT_WARN`` = 5 % of the compute in layout changes a library runs around an op
  (``plan.info["layout_time"]``, ``autopar.ir.Strategy.layout_time``): cuDNN transposing the
  channels-first tensors of convolutions on tensor cores, which a model and its images converted
  to channels-last never pay (~30 % of a ResNet-50's step, MosaicML's Composer "Channels Last").
* ``MFU_ERROR`` = 0.9: no training step reaches 90 % of a GPU's dense peak (the calibrated large
  matmul alone plateaus at 0.807 of it on every preset, ``DeviceSpec.compute_efficiency``): above
  it the prediction is a bug, not a result.
"""

from __future__ import annotations

import contextvars
import functools
import warnings
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field, fields, is_dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from autopar.audit_figures import (
    AxisComm,
    AxisReplication,
    axis_groups,
    collective_floors,
    communication,
    model_flops,
    peak_flops,
    replicated_work,
    unruled_ops,
)

if TYPE_CHECKING:
    from autopar.planfile import Plan

__all__ = [
    "Audit",
    "AuditWarning",
    "AxisComm",
    "AxisReplication",
    "Finding",
    "audit",
    "audited",
    "record",
]

REPLICATED_WARN = 0.02
"""Share of a stage's compute replicated over one axis above which the audit warns."""
REPLICATED_NOTE = 0.005
"""Share below which replicated work is not mentioned at all (it is still in the figures)."""
UNRULED_WARN = 0.02
"""Share of the step's compute in ops without a sharding rule above which the audit warns."""
CHEAP_KERNELS = 4
"""Ops costing at most this many kernel launches are left out of replicated work."""
COMM_WARN = 4.0
"""Plan bytes over the bound on an axis above which the audit warns (with ``COMM_MATERIAL``)."""
COMM_MATERIAL = 0.05
"""Share of the step the excess communication must be worth for the audit to warn."""
LAYOUT_WARN = 0.05
"""Share of the compute in layout changes around ops (``plan.info["layout_time"]``) above which
the audit warns."""
MFU_ERROR = 0.9
"""MFU above which the prediction is an error."""

SEVERITIES = ("info", "warning", "error")


def _as_json(value: Any) -> Any:
    """``value`` as JSON data: a record as the dict of its fields, a tuple as a list."""
    if is_dataclass(value):
        return {f.name: _as_json(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, (tuple, list)):
        return [_as_json(v) for v in value]
    return value


class AuditWarning(UserWarning):
    """A plan wastes its devices, or predicts what they cannot do (``autopar.audit``)."""


@dataclass(frozen=True, slots=True)
class Finding:
    """One thing the audit found."""

    severity: str
    """``"info"`` (a figure worth reading), ``"warning"`` (it costs time worth fixing) or
    ``"error"`` (the prediction cannot be right)."""
    kind: str
    """``"replicated_work"``, ``"unruled_ops"``, ``"communication"``, ``"layout"`` or ``"utilization"``."""
    message: str
    share: float = 0.0
    """What the finding measures, as a fraction: of a stage's compute (replicated work), of the
    step's compute (unruled ops, layout changes), of the step (excess communication), of the peak
    (utilisation)."""

    def __str__(self) -> str:
        return f"{self.severity}: {self.message}"


@dataclass(frozen=True, slots=True)
class Audit:
    """What ``audit(plan)`` found: the findings, and the figures they were drawn from."""

    findings: tuple[Finding, ...]
    replicated: tuple[AxisReplication, ...]
    """One per mesh axis of size > 1."""
    unruled: tuple[str, ...]
    """Ops without a sharding rule, by name."""
    unruled_share: float
    """Their share of the step's compute."""
    comm: tuple[AxisComm, ...]
    """One per mesh axis of size > 1."""
    model_flops: float
    """FLOPs of one training step (module docstring: MFU)."""
    peak_flops: float
    """Dense peak FLOP/s of one device in the plan's dtype (0: the plan names no device)."""
    devices: int
    mfu: float | None
    """``model_flops / (step_time · peak_flops · devices)``; None where a figure is missing."""
    time: float = field(default=0.0, compare=False)
    """Seconds the audit took."""

    @property
    def warnings(self) -> tuple[Finding, ...]:
        """Findings of severity warning or error."""
        return tuple(f for f in self.findings if f.severity != "info")

    @property
    def worst(self) -> str:
        """The highest severity found (``"info"`` when nothing is wrong)."""
        return max((f.severity for f in self.findings), key=SEVERITIES.index, default="info")

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON data (lists, no tuples, no NaN), so a plan that stores it round-trips exactly:
        every field but ``time``, and the printed ``lines``."""
        d = _as_json(self)
        del d["time"]
        return {"lines": self.lines(), **d}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Audit:
        return cls(
            findings=tuple(Finding(**f) for f in d["findings"]),
            replicated=tuple(
                AxisReplication(**{**r, "ops": tuple((str(n), float(s)) for n, s in r["ops"])})
                for r in d["replicated"]
            ),
            unruled=tuple(d["unruled"]),
            unruled_share=float(d["unruled_share"]),
            comm=tuple(AxisComm(**c) for c in d["comm"]),
            model_flops=float(d["model_flops"]),
            peak_flops=float(d["peak_flops"]),
            devices=int(d["devices"]),
            mfu=d["mfu"],
        )

    def figures(self) -> str:
        """One line: MFU, the largest replicated share per axis, communication against its bound."""
        from autopar.display import fmt_bytes

        parts = []
        if self.mfu is not None:
            parts.append(
                f"MFU {self.mfu * 100:.1f} % ({_fmt_flops(self.model_flops)} per step on "
                f"{self.devices} × {_fmt_flops(self.peak_flops)}/s)"
            )
        if self.replicated:
            parts.append(
                "replicated work "
                + ", ".join(
                    f"{r.axis} {r.share * 100:.1f} %" + (f" (stage {r.stage})" if r.stage else "")
                    for r in self.replicated
                )
            )
        comm = [c for c in self.comm if c.plan_bytes > 0 or c.bound_bytes > 0]
        if comm:
            parts.append(
                "communication/bound "
                + ", ".join(
                    f"{c.axis} {c.ratio:.2f}×"
                    if c.ratio is not None
                    else f"{c.axis} {fmt_bytes(c.plan_bytes)}/0"
                    for c in comm
                )
            )
        return "audit: " + ("; ".join(parts) if parts else "nothing to measure")

    def lines(self) -> list[str]:
        """The figures, then one line per finding: the text ``print(plan)`` ends with."""
        return [self.figures(), *(f"  {f}" for f in self.findings)]

    def __str__(self) -> str:
        return "\n".join(self.lines())


def _fmt_flops(f: float) -> str:
    for unit, scale in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9)):
        if f >= scale:
            return f"{f / scale:.3g} {unit}"
    return f"{f / 1e6:.3g} MFLOP"


# ------------------------------------------------------------------------------------ the pass
def audit(plan: Plan) -> Audit:
    """Audit ``plan`` (see module docstring): replicated work per axis, ops without a rule,
    communication against its bound, MFU. Reads the plan only."""
    import time

    from autopar.rules.base import rule_names

    t0 = time.perf_counter()
    by_name = {n.name: n for n in plan.nodes}
    stage_of = plan.pipeline.stage_of if plan.pipeline is not None else {}
    kernel = float(((plan.cluster or {}).get("device") or {}).get("kernel_overhead", 0.0))
    findings: list[Finding] = []

    stage_compute: dict[int, float] = defaultdict(float)
    for n in plan.nodes:
        stage_compute[stage_of.get(n.name, 0)] += n.compute_time
    total = sum(stage_compute.values())

    ruled = rule_names()  # importing autopar.rules registers every family's rules
    groups = axis_groups(plan)
    replicated = replicated_work(
        plan,
        by_name,
        stage_of,
        stage_compute,
        ruled,
        groups,
        cheap=CHEAP_KERNELS * kernel,
        floors=collective_floors(plan),
    )
    for r in replicated:
        if r.share < REPLICATED_NOTE:
            continue
        where = f"stage {r.stage}'s compute" if plan.pipeline is not None else "the compute"
        top = ", ".join(f"{name} {s * 100:.1f} %" for name, s in r.ops)
        if r.axis.startswith("tp") and any("norm" in name for name, _ in r.ops):
            top += " (sequence parallelism splits norms and residual adds along the sequence)"
        if r.axis.startswith("rep"):  # the solver split nothing along it; plan_summary's note says why
            top += " (the axis splits nothing: see the note on it)"
        findings.append(
            Finding(
                "warning" if r.share > REPLICATED_WARN and not r.axis.startswith("rep") else "info",
                "replicated_work",
                f"{r.share * 100:.1f} % of {where} runs replicated over {r.axis} ({r.size} devices "
                f"repeat it) although it could be split: {top}",
                r.share,
            )
        )

    unruled, unruled_time = unruled_ops(plan, ruled)
    unruled_share = unruled_time / total if total > 0 else 0.0
    if unruled:
        findings.append(
            Finding(
                "warning" if unruled_share > UNRULED_WARN else "info",
                "unruled_ops",
                f"ops without a sharding rule (run replicated): {', '.join(unruled)} — "
                f"{unruled_share * 100:.1f} % of the compute",
                unruled_share,
            )
        )

    comm = communication(plan, by_name, groups)
    step = plan.predicted.step_time
    for c in comm:
        ratio = c.ratio
        if ratio is None or ratio <= COMM_WARN or step <= 0 or c.bound_time <= 0:
            continue
        excess = c.bound_time * (c.plan_bytes - c.bound_bytes) / c.bound_bytes / step
        if excess > COMM_MATERIAL:
            findings.append(
                Finding(
                    "warning",
                    "communication",
                    f"{c.axis} moves {ratio:.1f}× the bytes its layout needs (gradients and partial sums "
                    f"reduced once); the excess is worth about {excess * 100:.0f} % of the step",
                    excess,
                )
            )

    layout = float(plan.info.get("layout_time", 0.0))
    if total > 0 and layout / total > LAYOUT_WARN:
        findings.append(
            Finding(
                "warning",
                "layout",
                f"{layout / total * 100:.0f} % of the compute is cuDNN transposing channels-first tensors "
                f"around convolutions on tensor cores: convert the model and its inputs to channels-last "
                f"(model.to(memory_format=torch.channels_last), x.to(memory_format=torch.channels_last)) "
                f"and plan again",
                layout / total,
            )
        )

    flops = model_flops(plan, by_name)
    peak = peak_flops(plan)
    devices = plan.world_size
    mfu = flops / (step * peak * devices) if flops > 0 and peak > 0 and step > 0 else None
    if mfu is not None and mfu > MFU_ERROR:
        findings.append(
            Finding(
                "error",
                "utilization",
                f"predicted MFU {mfu * 100:.0f} % of the devices' peak ({_fmt_flops(flops)} in "
                f"{step * 1e3:.3g} ms on {devices} × {_fmt_flops(peak)}/s): above what a device reaches "
                f"({MFU_ERROR * 100:.0f} %), so the prediction is a bug, not a result",
                mfu,
            )
        )
    findings.sort(key=lambda f: -SEVERITIES.index(f.severity))
    return Audit(
        findings=tuple(findings),
        replicated=tuple(replicated),
        unruled=tuple(unruled),
        unruled_share=unruled_share,
        comm=tuple(comm),
        model_flops=flops,
        peak_flops=peak,
        devices=devices,
        mfu=mfu,
        time=time.perf_counter() - t0,
    )


# ------------------------------------------------------------------------------------ the hooks
def record(plan: Plan, *, warn: bool = True, stacklevel: int | None = None) -> Audit:
    """Audit ``plan``, store the result in ``plan.info["audit"]`` (plain data) and, with ``warn``,
    raise one ``AuditWarning`` listing the findings of severity warning or error (ops without a
    rule only where the planner has not named them already: it warns about them as it plans)."""
    result = audit(plan)
    plan.info["audit"] = result.to_dict()
    announced = set(plan.info.get("unruled_ops", ()))  # the planner warned about these by name
    found = [f for f in result.warnings if f.kind != "unruled_ops" or not set(result.unruled) <= announced]
    if warn and found:
        from autopar.planner import _user_stacklevel

        warnings.warn(
            "autopar: the plan audit found\n" + "\n".join(f"  {f}" for f in found),
            AuditWarning,
            stacklevel=stacklevel if stacklevel is not None else _user_stacklevel(),
        )
    return result


_F = TypeVar("_F", bound=Callable[..., Any])
_AUDITING: contextvars.ContextVar[bool] = contextvars.ContextVar("autopar_auditing", default=False)
"""True inside an ``audited`` call: the plans of nested calls (``best_megatron``'s candidates,
a pipelined ``megatron``'s stage plan) are intermediate, and only the outermost is audited."""


def audited(fn: _F) -> _F:
    """Decorate a function that returns a ``Plan`` to the user: the plan it returns is audited
    (``record``), unless it is called inside another audited function, whose result is."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if _AUDITING.get():
            return fn(*args, **kwargs)
        token = _AUDITING.set(True)
        try:
            plan = fn(*args, **kwargs)
        finally:
            _AUDITING.reset(token)
        record(plan)
        return plan

    return wrapper  # type: ignore[return-value]

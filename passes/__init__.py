"""Graph passes: every pass is ``pass(gm, ctx) -> gm``, and a pipeline is a plain list of them.

A pass writes typed records (``autopar.ir``) into ``node.meta`` or returns a changed graph, and
says what it did through ``logging`` (``autopar.passes`` logger) — ``run_passes`` times each pass
and logs the op-count difference before/after, like torchtitan's graph trainer. A pass can be
turned off by name (``disable=("annotate_cost",)``) since the pipeline is data.

The context (``PassContext``) carries what a pass may need beyond the graph: the cluster, the
mesh, the planning options (``PlanConfig``) and the captured program's placeholder roles. It is
passed explicitly, never global.

Planning passes (``annotate``, ``strategies``, ``formulate``) write records the solver reads;
rank-program passes (``lower`` and those after it) build and rewrite this rank's program: the
per-rank compiler (``passes.rank_compiler``) runs them as one list, from the Plan to the step
record the runtime runs.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from autopar.capture import Captured
from autopar.cluster import Cluster
from autopar.config import PlanConfig
from autopar.mesh import Mesh

__all__ = ["Pass", "PassContext", "run_passes", "zero_stages"]

log = logging.getLogger("autopar.passes")


@dataclass(kw_only=True, slots=True)
class PassContext:
    """What passes read besides the graph."""

    captured: Captured
    """The captured program (placeholder roles, parameter names)."""
    cluster: Cluster
    """Devices and links the costs are computed for."""
    config: PlanConfig = field(default_factory=PlanConfig)
    """The planning options."""
    mesh: Mesh | None = None
    """The device mesh strategies are enumerated for (None before a mesh is chosen)."""
    mixed_precision: bool = False
    """``config.mixed_precision`` resolved against the model's parameters."""
    timings: dict[str, float] = field(default_factory=dict)
    """Seconds each pass took, filled by ``run_passes``."""

    def __post_init__(self) -> None:
        # The passes read the memory budget as bytes per device of this cluster's device
        # (``PlanConfig.device_budget``): resolved here where a caller has not already.
        self.config = self.config.resolved(self.cluster.device.memory)


Pass = Callable[[torch.fx.GraphModule, PassContext], torch.fx.GraphModule]


def _op_counts(gm: torch.fx.GraphModule) -> Counter:
    return Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function")


def run_passes(
    gm: torch.fx.GraphModule, ctx: PassContext, passes: Sequence[Pass], disable: Sequence[str] | None = None
) -> torch.fx.GraphModule:
    """Run ``passes`` in order, skipping those named in ``disable`` (default: ``ctx.config.disable``);
    log time and op-count diffs."""
    if disable is None:
        disable = ctx.config.disable
    for p in passes:
        name = getattr(p, "__name__", repr(p))
        if name in disable:
            log.info("pass %s: disabled", name)
            continue
        before = _op_counts(gm) if log.isEnabledFor(logging.DEBUG) else None
        t0 = time.perf_counter()
        gm = p(gm, ctx)
        dt = time.perf_counter() - t0
        ctx.timings[name] = ctx.timings.get(name, 0.0) + dt
        if before is not None:
            after = _op_counts(gm)
            diff = {k: after[k] - before[k] for k in set(before) | set(after) if after[k] != before[k]}
            log.debug("pass %s took %.1f ms; op-count change %s", name, dt * 1e3, diff or "none")
        else:
            log.info("pass %s took %.1f ms", name, dt * 1e3)
    return gm


def zero_stages(config: PlanConfig) -> tuple[int, ...]:
    """ZeRO stages a sharded parameter may run with where it is gathered (``autopar.cost.memory``).

    By default the solver picks per parameter between 2 and 3. On one micro-batch per step stage
    1 is dominated by stage 2 (the same collectives, a full gradient kept). Over ``m``
    micro-batches per gradient synchronization it reduce-scatters and gathers once a step from the
    full gradient it accumulates where stage 2 reduce-scatters every micro-batch
    (``autopar.cost.reshard_cost.edge_cost``; Megatron-LM's distributed optimizer): less volume,
    but only the last micro-batch's backward to hide it under, which the solver's sum cannot
    weigh, so it is offered where asked for (``PlanConfig.zero_stage``: a stage or a tuple) and
    the 3D search asks for it on the accumulated candidates near its fastest (``autopar.refine``),
    keeping what plays faster."""
    if config.zero_stage is None:
        return (2, 3)
    return config.zero_stage if isinstance(config.zero_stage, tuple) else (config.zero_stage,)

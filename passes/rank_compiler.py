"""The per-rank compiler: from a Plan to this rank's step record, as one list of passes.

The list (``RANK_COMPILER``) is data: a tuple of named passes that ``compile_rank`` runs in
order. Any pass can be turned off by name (``PlanConfig.disable``), except the four the step
cannot be built without (``RankPass.required``: naming one is refused). Each is logged on the
``autopar.passes`` logger — at DEBUG its name, the nodes of the graphs it ran on before and after,
and its time; at INFO its time — and timed in ``PassContext.timings``.

1. ``lower`` (required) — the captured global graph → this rank's forward program over local
   shards, collectives as nodes (``passes.lower``).
2. ``propagate_values`` — a fake value (shape, dtype, device) on every node of that program
   (``propagate_fake``), which the kernel matcher and the stage cut read: run for a pipelined
   plan (the cut needs it), and where kernels will be fused.
3. ``cut_stages`` (required) — a pipelined plan's program cut at the plan's stage boundaries, this
   rank's stages kept (``passes.stage_cut``); without a pipeline the whole program is the one
   program compiled. The cut comes before fusion and tracing because both work on one stage at a
   time: no fused kernel and no traced backward spans a stage boundary.
4. ``fuse_kernels`` — fusible groups replaced by fused Triton kernels, where they run
   (``passes.fusion``).
5. ``trace_joint`` (required) — each program traced with its backward into one joint program
   (``passes.joint``). Where a program without pipeline stages cannot be traced (data-dependent
   Python), one warning says why and no step is built: the forward program runs under autograd.
6. the rank-program passes over each joint program (``passes.overlap.RANK_PASSES``):
   ``recompute_layers`` (``passes.recompute``), ``regather_zero3_params``, ``offload_activations``,
   ``bucket_gradients``, ``prefetch_params``, ``sink_waits``, ``gather_into_buffers``
   (``passes.gather_buffers``), ``compress_gradients`` (``passes.compress``).
7. ``split_step`` (required) — each joint program split into the programs the runtime runs: the
   step's forward and backward (``StepProgram``), or a stage's forward, input-gradient and
   weight-gradient programs (``StageStep``).
8. ``compile`` — with ``compile=True``, every program compiled by Inductor, the ranks agreeing on
   the outcome (``passes.compile``).

A pass has one of two signatures, by its kind (``RankPass.kind``):

* **program pass** ``pass(gm, ctx) -> gm`` (``autopar.passes.Pass``): rewrites one program's graph.
  It runs on each program in turn — the forward program, or this rank's stage programs, then
  their joint programs — and reads what it needs beyond the graph from ``gm.meta`` (``RANK``: the
  program's ``RankInfo``) and from ``ctx``.
* **record pass** ``pass(build, ctx) -> build``: makes the programs or the records themselves,
  reading and writing the :class:`RankBuild`, the compiler's work in progress — from what it
  compiles for (:class:`RankTarget`) to the step record it hands the runtime
  (``autopar.program.records.RankStep``).

The programs' collectives run as Python while a program is propagated or traced (on fake tensors):
none of that counts as a step (``uncounted``).
"""

from __future__ import annotations

import functools
import logging
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch.fx import GraphModule

from autopar.ir import RANK, PrimalInfo, RankInfo
from autopar.passes import PassContext
from autopar.passes.collective_nodes import is_issue
from autopar.passes.compile import compile_agreed
from autopar.passes.fusion import fuse_kernels, kernels_run
from autopar.passes.joint import JointProgram, step_program, trace_joint
from autopar.passes.lower import lower
from autopar.passes.overlap import RANK_PASSES
from autopar.passes.stage_cut import (
    StageProgram,
    assign_stages,
    cut_stages,
    differentiable_values,
    stage_holders,
    stage_inputs,
    stage_step,
)
from autopar.planfile import Plan
from autopar.program.collectives import AxisGroup
from autopar.program.records import (
    CompileReport,
    RankStages,
    RankStep,
    StageStep,
    StepProgram,
    group_names,
    two_level_groups,
)

__all__ = [
    "RANK_COMPILER",
    "ProgramUnit",
    "RankBuild",
    "RankPass",
    "RankTarget",
    "compile_rank",
    "propagate_fake",
    "rank_info",
    "recompute_info",
    "uncounted",
]

log = logging.getLogger("autopar.passes")


# ------------------------------------------------------------------------------------ inputs


@dataclass(frozen=True, kw_only=True)
class RankTarget:
    """What the compiler compiles for: this rank's place in the plan and its program's inputs."""

    plan: Plan
    axes: tuple[AxisGroup, ...]
    """The mesh axes inside a pipeline stage (the plan's mesh), as this rank sees them."""
    device: torch.device
    roles: tuple[tuple[str, str], ...]
    """``(kind, name)`` of each input of the program, in order (``ParallelModule.primal_roles``)."""
    examples: tuple[Any, ...]
    """Example values of the program's inputs; only shapes, dtypes and devices are read. This
    rank's shards, and ``(shape, dtype, device)`` for a parameter it does not hold; a pipelined
    plan's are one micro-batch's."""
    trainable: tuple[int, ...]
    """Inputs that are trainable parameters this rank holds: they get gradients."""
    trainable_anywhere: tuple[int, ...] | None = None
    """A pipelined plan: the inputs that are trainable parameters on any rank (so every rank
    decides alike which boundary values carry gradients); ``None``: ``trainable``."""
    pp_coord: int = 0
    """This rank's pipeline coordinate (a pipelined plan)."""
    gather_outputs: bool = True
    compile: bool = False
    """Compile the step with Inductor (the ``compile`` pass)."""
    group: Any = None
    """The process group of every rank, over which they agree on compilation."""
    quiet: tuple[AxisGroup, ...] = ()
    """Every axis of this rank (the pipeline axis too), whose collectives are not counted while
    compiling (``uncounted``); empty: ``axes``."""


# ------------------------------------------------------------------------------------ the build


@dataclass(eq=False)
class ProgramUnit:
    """One program the program passes run on: the rank's whole program, or one of its stages'."""

    gm: GraphModule
    stage: StageProgram | None = None
    """The stage it is (a pipelined plan)."""
    joint: JointProgram | None = None
    """Its trace with the backward (``trace_joint``); ``gm`` is then the joint program."""
    examples: list[Any] = field(default_factory=list)
    """Its inputs' example values, as traced."""

    @property
    def label(self) -> str:
        return f"stage {self.stage.stage}" if self.stage is not None else "rank program"


@dataclass(eq=False)
class RankBuild:
    """The compiler's work in progress, handed from pass to pass (module docstring)."""

    target: RankTarget
    ctx: PassContext
    program: GraphModule | None = None
    """The lowered forward program (``lower``; ``fuse_kernels`` rewrites it in place)."""
    units: list[ProgramUnit] = field(default_factory=list)
    """The programs the program passes run on (none: no step is built)."""
    stage_coord: dict[int, int] = field(default_factory=dict)
    """Stage -> the pipeline coordinate holding it (``cut_stages``)."""
    holders: dict[str, list[int]] = field(default_factory=dict)
    """Parameter or buffer -> the pipeline coordinates whose stages read it (``cut_stages``)."""
    differentiable: set[str] | None = None
    """The values of the program a gradient flows back through (``cut_stages``)."""
    step: StepProgram | None = None
    stages: RankStages | None = None
    compiled: CompileReport | None = None
    ran: list[str] = field(default_factory=list)
    """The passes that ran, in order."""

    @functools.cached_property
    def info(self) -> RankInfo:
        """The whole program's ``RankInfo`` (what the rank-program passes read, ``gm.meta[RANK]``)."""
        return rank_info(self.target, self.ctx)

    def graphs(self) -> list[GraphModule]:
        """The graphs a pass runs on now (for the log's node counts)."""
        if self.units:
            return [u.gm for u in self.units]
        return [self.program] if self.program is not None else [self.ctx.captured.gm]

    def result(self) -> RankStep:
        assert self.program is not None, "the lower pass builds the program"
        return RankStep(
            program=self.program,
            step=self.step,
            stages=self.stages,
            passes=tuple(self.ran),
            compiled=self.compiled,
        )


def rank_info(target: RankTarget, ctx: PassContext) -> RankInfo:
    """The ``RankInfo`` of the whole program: each input's role (a parameter's ZeRO stage), the axes'
    names, and the plan's recomputation (``recompute_info``)."""
    plan = target.plan
    stages = {n.fqn: n.zero_stage for n in plan.nodes if n.kind == "param"}
    return RankInfo(
        primals=tuple(PrimalInfo(kind, key, stages.get(key, 0)) for kind, key in target.roles),
        num_outputs=0,
        axis_names=group_names(target.axes),
        two_level=two_level_groups(target.axes),
        recompute=plan.recompute,
        compression=plan.compression,
        offload_layers=tuple(plan.offload_layers),
        **(
            recompute_info(
                ctx,
                plan.recompute,
                plan.recompute_layers,
                frozenset(n.name for n in plan.nodes if n.recomputed),
            )
            if plan.recompute != "none" or plan.offload_layers
            else {}
        ),
    )


def recompute_info(
    ctx: PassContext, mode: str, layers: tuple[str, ...] | None = None, chosen: frozenset[str] = frozenset()
) -> dict[str, Any]:
    """``RankInfo``'s recomputation fields: captured node name -> the repeated-layer instance it
    runs in (``transformer.h.3``, from the tensor annotations' module paths; activation offload
    reads it too), and the captured nodes ``mode`` recomputes in the instances ``layers``
    (``Plan.recompute_layers``; ``None``: every one) — ``passes.strategies.recomputed``, the rule
    the plan was costed by; under ``"ops"`` the nodes the solver chose (``chosen``:
    ``NodePlan.recomputed``) with the views of their outputs (``passes.recompute_ops``)."""
    from autopar.graph import outer_instance
    from autopar.ir import TENSOR
    from autopar.passes import run_passes
    from autopar.passes.annotate import annotate_tensors
    from autopar.passes.recompute_ops import recomputed_closure
    from autopar.passes.strategies import recomputed

    cap = ctx.captured
    if not any(TENSOR in n.meta for n in cap.gm.graph.nodes):
        run_passes(
            cap.gm, PassContext(captured=cap, cluster=ctx.cluster, config=ctx.config), [annotate_tensors]
        )
    layer_of, sources = {}, set()
    only = frozenset(layers) if layers is not None else None
    for n in cap.gm.graph.nodes:
        info = n.meta.get(TENSOR)
        if info is None or n.op != "call_function":
            continue
        layer_of[n.name] = outer_instance(info.module)
        if recomputed(n, mode, only):
            sources.add(n.name)
    if mode == "ops":
        sources |= recomputed_closure(cap.gm.graph, chosen)
    return {"layer_of": layer_of, "recompute_sources": frozenset(sources)}


@contextmanager
def uncounted(axes: Iterable[AxisGroup]) -> Iterator[None]:
    """While open, the collectives that run on ``axes`` (their Python code, on fake tensors) are not
    counted in ``AxisGroup.counts``: compiling is not a step. Each axis's setting is restored."""
    saved = [(ax, ax.counting) for ax in axes]
    for ax, _ in saved:
        ax.counting = False
    try:
        yield
    finally:
        for ax, was in saved:
            ax.counting = was


def propagate_fake(program: GraphModule, primals: Sequence[object]) -> None:
    """Write a FakeTensor ``meta["val"]`` on every node of ``program`` (the lowered program is
    built by hand: shapes of its values are needed to match kernels, receive stage inputs and trace
    each stage). A primal given as ``(shape, dtype, device)`` stands for a tensor this rank does
    not hold."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake = []
    for p in primals:
        if isinstance(p, torch.Tensor):
            fake.append(mode.from_tensor(p))
        elif isinstance(p, tuple) and len(p) == 3 and isinstance(p[1], torch.dtype):  # (shape, dtype, device)
            with mode:
                fake.append(torch.empty(p[0], dtype=p[1], device=p[2]))
        else:
            fake.append(p)
    FakeTensorProp(program, mode).propagate(*fake)


def _first_line(exc: Exception) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


# ------------------------------------------------------------------------------------ record passes


def lower_program(build: RankBuild, ctx: PassContext) -> RankBuild:
    """``lower``: this rank's forward program (``passes.lower``; the plan was checked before, by
    ``passes.plan_check.check_plan``)."""
    t = build.target
    pipe = t.plan.pipeline
    build.program = lower(
        ctx.captured, t.plan, t.axes, device=t.device, gather_outputs=t.gather_outputs,
        stage_of=pipe.stage_of if pipe is not None else None, certify=False,
    )  # fmt: skip
    build.units = [ProgramUnit(build.program)]
    return build


def propagate_values(build: RankBuild, ctx: PassContext) -> RankBuild:
    """``propagate_values``: fake values on the program's nodes (module docstring), where the
    stage cut or the kernel matcher will read them. Without a pipeline, a program whose values
    cannot be propagated runs unfused, and one warning says why."""
    t = build.target
    program = build.program
    assert program is not None
    pipelined = t.plan.pipeline is not None
    if not pipelined and ("fuse_kernels" in ctx.config.disable or not kernels_run(t.device, ctx.config)):
        return build  # nothing will read them
    try:
        propagate_fake(program, t.examples)
    except Exception as exc:  # unknown shapes: fuse_kernels leaves the program as it is, and says so
        if pipelined:
            raise
        warnings.warn(
            f"autopar: the rank program's shapes could not be propagated ({_first_line(exc)}); its ops run unfused",
            stacklevel=2,
        )
    finally:
        program._gathered_params.clear()  # ZeRO-3 gathers the fake run registered
    return build


def cut_program(build: RankBuild, ctx: PassContext) -> RankBuild:
    """``cut_stages``: a pipelined plan's program cut into its stages, this rank's kept as the
    programs compiled (``passes.stage_cut.cut_stages``); nothing to do without a pipeline."""
    t = build.target
    pipe = t.plan.pipeline
    program = build.program
    if pipe is None or program is None:
        return build
    if any("val" not in n.meta for n in program.graph.nodes if n.op == "placeholder"):
        raise ValueError(
            "cut_stages reads the values of the program's nodes: propagate_values cannot be disabled for a "
            "pipelined plan"
        )
    build.stage_coord = assign_stages(pipe.num_stages, pipe.pp)
    stages = cut_stages(program, pipe.num_stages)
    build.holders = stage_holders(stages, t.roles, build.stage_coord)
    anywhere = t.trainable_anywhere if t.trainable_anywhere is not None else t.trainable
    build.differentiable = differentiable_values(program, anywhere)
    mine = [sp for sp in stages if build.stage_coord[sp.stage] == t.pp_coord]
    for sp in mine:  # the runtime materialized what the stages read (passes.stage_cut.params_held)
        missing = [
            t.roles[i][1]
            for i in sp.primals
            if t.roles[i][0] in ("param", "buffer") and not isinstance(t.examples[i], torch.Tensor)
        ]
        if missing:
            raise RuntimeError(
                f"stage {sp.stage} reads {missing}, which this rank does not hold (report this with the model)"
            )
    build.units = [ProgramUnit(sp.gm, stage=sp) for sp in mine]
    return build


def trace_step(build: RankBuild, ctx: PassContext) -> RankBuild:
    """``trace_joint``: each program traced with its backward (``passes.joint.trace_joint``), its
    ``RankInfo`` on the joint program (``gm.meta[RANK]``)."""
    t = build.target
    for unit in list(build.units):
        if unit.stage is None:
            if not t.trainable:
                log.info("pass trace_joint: nothing to train here: the forward program is the whole step")
                build.units = []
                return build
            examples, grad, info = list(t.examples), list(t.trainable), build.info
            try:
                jp = trace_joint(unit.gm, examples, grad)
            except Exception as exc:  # the step still trains, through autograd: say why, once
                warnings.warn(
                    f"autopar: the backward could not be captured into the per-rank program ({_first_line(exc)}); "
                    f"training runs the forward program under autograd (correct; collectives are not overlapped "
                    f"by the rank-program passes)",
                    stacklevel=2,
                )
                build.units = []
                return build
        else:
            unit.stage.gm = unit.gm  # as the passes before left it
            examples, grad = stage_inputs(unit.stage, t.examples, t.trainable, build.differentiable)
            info = replace(build.info, primals=tuple(build.info.primals[i] for i in unit.stage.primals))
            jp = trace_joint(unit.gm, examples, grad)
        jp.gm.meta[RANK] = info
        unit.joint, unit.examples, unit.gm = jp, examples, jp.gm
    return build


def split_step(build: RankBuild, ctx: PassContext) -> RankBuild:
    """``split_step``: the step records (``passes.joint.step_program``, ``passes.stage_cut.stage_step``),
    each naming the rank-program passes that rewrote its joint program."""
    t = build.target
    ran = tuple(build.ran[build.ran.index("trace_joint") + 1 :]) if "trace_joint" in build.ran else ()
    for unit in build.units:
        assert unit.joint is not None, "trace_joint runs before split_step"
        unit.joint.gm = unit.gm  # as the rank-program passes left it
    pipe = t.plan.pipeline
    if pipe is None:
        if build.units:
            (unit,) = build.units
            build.step = step_program(unit.joint, ran)
        return build
    steps = {}
    for unit in build.units:
        assert unit.stage is not None and unit.joint is not None
        steps[unit.stage.stage] = stage_step(
            unit.stage, unit.joint, unit.examples, build.differentiable, microbatches=pipe.microbatches
        )
    if pipe.dp_shares:
        _check_shares(steps, t.axes)
    build.stages = RankStages(steps=steps, stage_coord=build.stage_coord, holders=build.holders)
    return build


def _check_shares(steps: dict[int, StageStep], axes: Sequence[AxisGroup]) -> None:
    """Unequal data-parallel shares (``PipelinePlan.dp_shares``): ranks along the first axis run
    different numbers of micro-batches, so no program run once per micro-batch may hold a
    collective over that axis — it would wait forever for the ranks that ran out. Raised on every
    rank alike, before the first step (the planner's ``autopar.dp_shares.share_blockers`` keeps
    such plans from being made)."""
    first = axes[0]
    names = {first.group_name} | {g.group_name for key, g in first.combined.items() if 0 in key}
    for s, step in steps.items():
        for kind in ("forward", "backward_input", "backward_weight_local"):
            gm = getattr(step, kind)
            for n in gm.graph.nodes if gm is not None else ():
                if is_issue(n) and any(isinstance(a, str) and a in names for a in n.args):
                    raise ValueError(
                        f"the plan gives the ranks of its first mesh axis ({first.name}) unequal shares of "
                        f"micro-batches, but stage {s}'s {kind} program runs {n.target} over that "
                        "axis every micro-batch; plan again without dp_shares (autopar.dp_shares)"
                    )


def compile_step(build: RankBuild, ctx: PassContext) -> RankBuild:
    """``compile``: with ``compile=True``, every program of the step compiled by Inductor, all ranks
    agreeing on the outcome (``passes.compile.compile_agreed``: all compiled, or all eager)."""
    if build.target.compile:
        build.compiled = compile_agreed(build.result().records, build.target.group)
    return build


# ------------------------------------------------------------------------------------ the list


@dataclass(frozen=True)
class RankPass:
    """One entry of the compiler's list: its name (what ``PlanConfig.disable`` names), the
    function, and its kind — ``"program"``: ``run(gm, ctx) -> gm`` on each program; ``"record"``:
    ``run(build, ctx) -> build`` (module docstring)."""

    name: str
    run: Callable[[Any, PassContext], Any]
    kind: str = "program"
    required: bool = False
    """The step cannot be built without it: disabling it is refused."""


KINDS = ("program", "record")

RANK_COMPILER: tuple[RankPass, ...] = (
    RankPass("lower", lower_program, "record", required=True),
    RankPass("propagate_values", propagate_values, "record"),
    RankPass("cut_stages", cut_program, "record", required=True),
    RankPass("fuse_kernels", fuse_kernels, "program"),
    RankPass("trace_joint", trace_step, "record", required=True),
    *(RankPass(p.__name__, p, "program") for p in RANK_PASSES),
    RankPass("split_step", split_step, "record", required=True),
    RankPass("compile", compile_step, "record"),
)
"""The per-rank compiler's passes, in order (module docstring)."""


def compile_rank(target: RankTarget, ctx: PassContext, passes: Sequence[RankPass] | None = None) -> RankStep:
    """This rank's step record: ``passes`` (default: ``RANK_COMPILER``, as it is when called) run in
    order over a new :class:`RankBuild` for ``target``, skipping those ``ctx.config.disable``
    names, every collective uncounted (module docstring). Raises ``ValueError`` where
    ``ctx.config.disable`` names a required pass."""
    passes = RANK_COMPILER if passes is None else passes
    disable = set(ctx.config.disable)
    refused = [p.name for p in passes if p.required and p.name in disable]
    if refused:
        raise ValueError(
            f"disable={refused}: the per-rank compiler cannot build a step without "
            f"{'it' if len(refused) == 1 else 'them'} (passes that may be disabled: "
            f"{[p.name for p in passes if not p.required]})"
        )
    build = RankBuild(target=target, ctx=ctx)
    with uncounted(target.quiet or target.axes):
        for p in passes:
            if p.name in disable:
                log.info("pass %s: disabled", p.name)
                continue
            build = _run(p, build, ctx)
    return build.result()


def _nodes(graphs: Sequence[GraphModule]) -> int:
    return sum(len(gm.graph.nodes) for gm in graphs)


def _run(p: RankPass, build: RankBuild, ctx: PassContext) -> RankBuild:
    """Run one pass, timed and logged (module docstring)."""
    debug = log.isEnabledFor(logging.DEBUG)
    before = _nodes(build.graphs()) if debug else 0
    t0 = time.perf_counter()
    if p.kind == "program":
        for unit in build.units:
            n0, u0 = (len(unit.gm.graph.nodes), time.perf_counter()) if debug else (0, 0.0)
            unit.gm = p.run(unit.gm, ctx)
            if debug and len(build.units) > 1:
                log.debug(
                    "pass %s on %s: %d -> %d nodes, %.1f ms",
                    p.name, unit.label, n0, len(unit.gm.graph.nodes), (time.perf_counter() - u0) * 1e3,
                )  # fmt: skip
            if unit.joint is None and unit.stage is None:
                build.program = unit.gm  # the forward program, rewritten
    else:
        build = p.run(build, ctx)
    dt = time.perf_counter() - t0
    build.ran.append(p.name)
    ctx.timings[p.name] = ctx.timings.get(p.name, 0.0) + dt
    if debug:
        log.debug("pass %s: %d -> %d nodes, %.1f ms", p.name, before, _nodes(build.graphs()), dt * 1e3)
    else:
        log.info("pass %s took %.1f ms", p.name, dt * 1e3)
    return build

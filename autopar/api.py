"""The user's entry points, composing the layers below: ``plan`` (capture → planner),
``parallelize`` (capture → plan or broadcast → lowering → ``ParallelModule``) and
``measure_local`` (the runtime measures this machine, the cost model is fitted to it).

Every planning option travels as one ``PlanConfig`` (``config=``, or its fields as keyword
arguments), so ``plan`` and ``parallelize`` honor the same options the same way.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

from torch import nn

from autopar.audit import audited
from autopar.capture import capture
from autopar.cluster import Cluster
from autopar.config import PlanConfig
from autopar.planfile import Plan
from autopar.program.records import StepProgram, group_names
from autopar.runtime.module import (
    ParallelModule,
    broadcast_plan,
    check_world,
    device_for_backend,
    mesh_axes,
)
from autopar.runtime.monitor import DEFAULT_TIMEOUT

__all__ = ["measure_local", "parallelize", "plan"]


@audited
def plan(
    model: nn.Module,
    example_inputs: Any,
    cluster: Cluster,
    config: PlanConfig | None = None,
    **options: Any,
) -> Plan:
    """Plan ``model`` on ``cluster``; ``example_inputs`` is one global batch.

    Options (``PlanConfig``'s fields, as ``config=`` or keywords): ``memory_budget`` (bytes per
    device, default the device's memory), ``mesh_shape`` (fix the mesh instead of trying the
    candidates), ``fixed`` (``{name: spec}`` for parameters or user inputs, honored exactly, e.g.
    ``{"lm_head.weight": ("S(0)",)}``), ``optimizer``, ``mixed_precision`` (default: detected from
    the parameters' dtype), ``zero_stage`` (1, 2 or 3; default the solver picks 2 or 3 per
    parameter), ``time_limit``, ``workers``, ``disable`` (pass names).

    The plan is audited (``autopar.audit``): the result in ``plan.info["audit"]``, and one
    ``AuditWarning`` where the plan wastes its devices or predicts what they cannot do.
    """
    from autopar.search import plan_model

    config = PlanConfig.build(config, **options)
    return plan_model(model, example_inputs, cluster, config)


def _warnings_on_rank_zero(fn: Callable[..., ParallelModule]) -> Callable[..., ParallelModule]:
    """Every rank runs the same code and would print the same warnings: show them on rank 0 only."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> ParallelModule:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0:
            return fn(*args, **kwargs)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return fn(*args, **kwargs)

    return wrapper


@_warnings_on_rank_zero
def parallelize(
    model: nn.Module,
    cluster: Cluster,
    example_inputs: Any,
    plan: Plan | None = None,
    *,
    config: PlanConfig | None = None,
    gather_outputs: bool = True,
    local_inputs: bool = False,
    timeout: float = DEFAULT_TIMEOUT,
    check_inputs: str | None = "digest",
    compile: bool | None = None,
    **options: Any,
) -> ParallelModule:
    """This rank's module. Call on every rank after ``torch.distributed.init_process_group``.

    ``example_inputs`` is one global batch of the shapes training will use. ``plan``: a Plan (e.g.
    ``autopar.Plan.load(path)``); without one, rank 0 plans with ``config`` (or the ``PlanConfig``
    fields given as keywords, e.g. ``memory_budget``) and broadcasts the plan, so the other ranks
    never import the solver. ``gather_outputs=False`` returns non-scalar outputs as local shards.
    ``local_inputs=True``: each rank passes its own shard of every input (``pm.input_specs``).
    ``timeout``: seconds a collective may wait for its peers before the step fails with an error
    naming the rank that stopped (``autopar.runtime.monitor``). ``check_inputs="digest"`` (the
    default): before any collective of the model, the ranks agree on every call's inputs in one
    all-gather of four numbers per rank — the same global batch on every rank (a digest of it;
    not compared with ``local_inputs=True``), and no rank that refused its inputs (a rank that
    did stops the others at once, its error in theirs); ``None``: no such collective.
    ``compile=True``: every program of this rank's training step is compiled by Inductor before
    the first step (``autopar.passes.compile``; ``pm.compiled`` says how long each took); where any
    rank cannot compile one, every rank runs the eager programs and one warning says why.
    ``compile=None`` (the default): as the plan says (``Plan.compile``, set by planning with
    ``compile=True``: ``PlanConfig.compile``, whose step the plan's prediction is).
    """
    import torch.distributed as dist

    from autopar.passes.lower import check_plan, lower

    config = PlanConfig.build(config, **options)
    check_world(plan, cluster)
    cap = capture(model, example_inputs)
    if plan is None:
        from autopar.search import plan_model

        if compile:  # the plan predicts the step that will run
            config = config.replace(compile=True)

        # workers=1: solve the candidate meshes in this process. Forking here is unsafe (the process
        # group's threads are running) and impossible under a daemonic launcher (``spawn``).
        plan = broadcast_plan(
            lambda: plan_model(model, example_inputs, cluster, config.replace(workers=1), captured=cap)
        )
    if compile is None:
        compile = plan.compile
    if plan.pipeline is not None:
        return _parallelize_pipeline(
            model, cluster, example_inputs, plan, config, timeout, check_inputs, compile
        )
    check_plan(cap, plan)  # before any process group or collective: every rank refuses the same plan
    device = device_for_backend(dist.get_backend())
    axes, device_mesh, world_group = mesh_axes(plan.mesh_shape, plan.mesh_axes, device, timeout)
    program = lower(cap, plan, axes, device=device, gather_outputs=gather_outputs, certify=False)
    pm = ParallelModule(
        program,
        plan,
        cap,
        axes,
        model,
        device,
        local_inputs=local_inputs,
        device_mesh=device_mesh,
        world_group=world_group,
        timeout=timeout,
        check_inputs=check_inputs,
    )
    step = _capture_step(pm, plan, cluster, config, example_inputs)
    if compile:
        _compile_programs(pm, [step] if step is not None else [])
    if step is not None:
        pm.set_step(step)
    return pm


def _capture_step(
    pm: ParallelModule, plan: Plan, cluster: Cluster, config: PlanConfig, example_inputs: Any
) -> StepProgram | None:
    """Replace the fusible groups of this rank's forward program by fused kernels
    (``autopar.passes.fusion.fuse_kernels``, where they run), then trace the whole training step
    (forward and backward, every collective a node) and run the rank-program passes over it;
    where the backward cannot be traced, the forward program runs under autograd (the
    collectives' backward run as autograd calls them) and one warning names what blocked the
    capture. Returns the step, not yet bound to ``pm`` (``None``: nothing was captured)."""
    import warnings

    from autopar.capture import normalize_inputs
    from autopar.passes import PassContext, run_passes
    from autopar.passes.fusion import fuse_kernels, kernels_run
    from autopar.passes.joint import PrimalInfo, RankInfo, build_step
    from autopar.passes.pipeline import propagate_fake

    args, kwargs = normalize_inputs(example_inputs)
    ctx = PassContext(captured=pm.captured, cluster=cluster, config=config)
    if "fuse_kernels" not in config.disable and kernels_run(pm.device, config):  # the matcher reads shapes
        for ax in pm.axes:
            ax.counting = False  # a run on fake tensors: not a step
        try:
            propagate_fake(pm.program, pm.primal_values(args, kwargs, local_inputs=False, check=False))
        except Exception as exc:  # unknown shapes: fuse_kernels leaves the program as it is, and says so
            warnings.warn(
                f"autopar: the rank program's shapes could not be propagated ({type(exc).__name__}: "
                f"{str(exc).splitlines()[0] if str(exc) else ''}); its ops run unfused",
                stacklevel=3,
            )
        finally:
            pm.program._gathered_params.clear()  # ZeRO-3 gathers the fake run registered
            for ax in pm.axes:
                ax.counting = True
    pm.program = run_passes(pm.program, ctx, [fuse_kernels])
    if not pm.grad_primals():
        return None  # nothing to train: the forward program is the whole step
    stages = {n.fqn: n.zero_stage for n in plan.nodes if n.kind == "param"}
    info = RankInfo(
        primals=tuple(PrimalInfo(kind, key, stages.get(key, 0)) for kind, key in pm.primal_roles()),
        num_outputs=0,
        axis_names=group_names(pm.axes),
        recompute=plan.recompute,
        **(_recompute_info(pm.captured, cluster, config, plan.recompute) if plan.recompute != "none" else {}),
    )
    for ax in pm.axes:
        ax.counting = False  # tracing runs the collectives' Python code once: not a step
    try:
        step = build_step(
            pm.program, pm.primal_values(args, kwargs, local_inputs=False), pm.grad_primals(), info, ctx
        )
    except Exception as exc:  # the step still trains, through autograd: say why, once
        warnings.warn(
            f"autopar: the backward could not be captured into the per-rank program "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); training runs the forward "
            f"program under autograd (correct; collectives are not overlapped by the rank-program passes)",
            stacklevel=3,
        )
        return None
    finally:
        for ax in pm.axes:
            ax.counting = True
    return step


def _compile_programs(pm: ParallelModule, records: list[Any]) -> None:
    """Compile this rank's step programs (``records``: its ``StepProgram`` or its stages'
    ``StageStep``s) with Inductor (``autopar.passes.compile``) and agree with every rank on the
    outcome in one all-gather: all compiled, or — where any rank could not compile, or captured
    no step — all eager, with one warning (rank 0's: ``parallelize`` shows rank 0's warnings)
    naming the first such rank, its program and the error. ``pm.compiled`` records it."""
    import logging

    import torch.distributed as dist

    from autopar.passes.compile import CompileError, compile_records
    from autopar.program.records import CompileReport

    failure, seconds = "", {}
    if not records:
        failure = (
            "no training step was captured as a program (nothing trainable, or a backward that could not be "
            "traced: see the warning before this one)"
        )
    else:
        try:
            seconds = compile_records(records)
        except CompileError as exc:
            failure = str(exc)
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, failure, group=pm.world_group)
    failed = [(r, f) for r, f in enumerate(every) if f]
    if not failed:
        pm.compiled = CompileReport(compiled=True, seconds=seconds)
        logging.getLogger("autopar.runtime").info("compile=True: %s", pm.compiled)
        return
    for record in records:
        record.compiled.clear()
    rank, why = failed[0]
    others = f" (and on rank(s) {[r for r, _ in failed[1:]]})" if len(failed) > 1 else ""
    reason = f"rank {rank}: {why}{others}"
    pm.compiled = CompileReport(compiled=False, seconds=seconds, reason=reason)
    warnings.warn(
        f"autopar: compile=True, but Inductor could not compile the step on {reason}; every rank runs "
        f"the eager programs (correct, not compiled)",
        stacklevel=4,
    )


def _parallelize_pipeline(
    model: nn.Module,
    cluster: Cluster,
    example_inputs: Any,
    plan: Plan,
    config: PlanConfig,
    timeout: float,
    check_inputs: str | None = "digest",
    compile: bool = False,
) -> ParallelModule:
    """This rank's module for a pipelined plan: ``plan``'s mesh is the layout inside a stage (it
    spans ``world / pp`` devices), ``plan.pipeline.stage_of`` maps each captured node to its stage
    (``pp · v`` stages, stage ``s`` on pipeline coordinate ``s mod pp``), and each pipeline rank
    runs its actions of the plan's schedule (``autopar.schedule``). ``example_inputs`` is one
    global batch; the plan was made for one micro-batch of it (the global batch cut in
    ``microbatches`` along dimension 0)."""
    import torch.distributed as dist

    from autopar.capture import microbatch_inputs, normalize_inputs
    from autopar.microbatch import MicrobatchCaptures
    from autopar.passes import PassContext
    from autopar.passes.joint import PrimalInfo, RankInfo
    from autopar.passes.lower import check_plan, lower, program_difference
    from autopar.passes.pipeline import build_pipeline, propagate_fake
    from autopar.runtime.pipeline import build_runner

    pipe = plan.pipeline
    assert pipe is not None
    pp, microbatches, stage_of = pipe.pp, pipe.microbatches, pipe.stage_of
    actions = pipe.actions()
    args, kwargs = normalize_inputs(example_inputs)
    micro = microbatch_inputs(args, kwargs, microbatches)
    world = dist.get_world_size()
    cap = MicrobatchCaptures(model, (args, kwargs))(microbatches)  # as the planner captured it
    if cap.fingerprint != plan.fingerprint:
        raise ValueError(
            "the model captured on one micro-batch of these inputs is not the program the plan was made for "
            f"(its fingerprint differs; {program_difference(plan, cap)}): plan again for this model and "
            "batch shape"
        )
    check_plan(cap, plan)  # before any process group or collective: every rank refuses the same plan
    device = device_for_backend(dist.get_backend())
    axes, device_mesh, world_group = mesh_axes(
        (pp, *plan.mesh_shape), ("pp", *plan.mesh_axes), device, timeout, stage_from=1
    )
    pp_axis, stage_axes = axes[0], axes[1:]
    program = lower(cap, plan, stage_axes, device=device, stage_of=stage_of, certify=False)
    # Which parameters this rank's stages read: from the cut program.
    num_stages = pipe.num_stages
    phs = [n for n in program.graph.nodes if n.op == "placeholder"]
    params_of = [set() for _ in range(pp)]  # the parameters each pipeline rank's stages read
    for n in program.graph.nodes:
        s = n.meta.get("autopar.stage")
        if s is not None:
            params_of[s % pp] |= {i.name for i in n.all_input_nodes if i.name in cap.params}
    empty = [c for c in range(pp) if not params_of[c]]
    if empty:  # the same on every rank: each raises, none waits
        raise ValueError(
            f"pipeline rank(s) {empty} of this plan hold no parameter (their stages read none): "
            f"torch.optim.AdamW(pm.parameters()) would raise 'optimizer got an empty parameter list' there. "
            f"autopar's stage cuts never make such a stage (autopar.passes.stages): plan again, or with fewer "
            f"pipeline stages"
        )
    mine = {s for s in range(num_stages) if s % pp == pp_axis.coord}
    read = {
        i.name for n in program.graph.nodes if n.meta.get("autopar.stage") in mine for i in n.all_input_nodes
    }
    held = {cap.params.get(p.name, cap.buffers.get(p.name)) for p in phs if p.name in read} - {None}
    pm = ParallelModule(
        program, plan, cap, stage_axes, model, device, device_mesh=device_mesh, world_group=world_group,
        timeout=timeout, held=held, check_inputs=check_inputs,
    )  # fmt: skip
    margs, mkwargs = normalize_inputs(micro)
    example = pm.primal_values(margs, mkwargs, local_inputs=False, check=False)
    propagate_fake(program, [p if p is not None else _shape_of_unheld(pm, i) for i, p in enumerate(example)])
    stages = {n.fqn: n.zero_stage for n in plan.nodes if n.kind == "param"}
    info = RankInfo(
        primals=tuple(PrimalInfo(kind, key, stages.get(key, 0)) for kind, key in pm.primal_roles()),
        num_outputs=0,
        axis_names=group_names(stage_axes),
        recompute=plan.recompute,
        **(_recompute_info(cap, cluster, config, plan.recompute) if plan.recompute != "none" else {}),
    )
    ctx = PassContext(captured=cap, cluster=cluster, config=config)
    named = dict(model.named_parameters(remove_duplicate=False))
    trainable_anywhere = [
        i for i, (kind, key) in enumerate(pm.primal_roles()) if kind == "param" and named[key].requires_grad
    ]
    for ax in axes:
        ax.counting = False
    try:
        rank_stages = build_pipeline(
            program, example, pm.primal_roles(), pm.grad_primals(), info, ctx, num_stages=num_stages, pp=pp,
            coord=pp_axis.coord, microbatches=microbatches, trainable_anywhere=trainable_anywhere,
        )  # fmt: skip
        runner = build_runner(
            rank_stages, roles=pm.primal_roles(), trainable=pm.grad_primals(), pp_axis=pp_axis,
            pp_groups=_pp_groups(pp, world), actions=actions[pp_axis.coord], microbatches=microbatches,
            timeout=timeout,
        )  # fmt: skip
    finally:
        for ax in axes:
            ax.counting = True
    if compile:
        _compile_programs(pm, list(rank_stages.steps.values()))
    runner.predicted = _predicted_rank(plan, pp_axis.coord)
    pm.pipeline = runner
    pm.microbatches = microbatches
    return pm


def _predicted_rank(plan: Plan, coord: int) -> dict[str, float]:
    """What ``plan`` predicts for pipeline rank ``coord``'s step, its schedule played by
    ``autopar.cost.timeline`` (``PipelineRunner.predicted``, which ``ParallelModule.report`` prints
    beside the measurement); empty where the plan has no per-stage costs."""
    from autopar.cost.timeline import StageCost, play
    from autopar.schedule import max_in_flight

    pipe = plan.pipeline
    if pipe is None or not pipe.stage_costs:
        return {}
    actions = pipe.actions()
    overlap = Cluster.from_dict(plan.cluster).overlap_comm
    tl = play(actions, [StageCost(**c) for c in pipe.stage_costs], overlap=overlap)
    return {
        "step": tl.step_time,
        "compute": tl.busy[coord],
        "in_flight": float(max_in_flight(actions[coord])),
    }


def measure_local(world_size: int, **options: Any) -> Cluster:
    """A ``Cluster.local(world_size)`` whose compute and collective costs were measured here:
    ``world_size`` local gloo processes probe this machine (``autopar.runtime.calibrate.measure``,
    which takes ``options``: ``sizes``, ``repeats``, ``rounds``, ``timeout``) and the cost model
    is fitted to what they measured (``autopar.cost.calibration.fit_local``). About 12 s for 2
    processes on a 2-core machine; ``autopar calibrate`` writes the result as a profile."""
    from autopar.cost.calibration import fit_local
    from autopar.runtime.calibrate import measure

    return fit_local(measure(world_size, **options))


def _pp_groups(pp: int, world: int) -> list[list[int]]:
    """The global ranks of every pipeline group (the outermost mesh axis), by coordinate."""
    return [[c * (world // pp) + i for c in range(pp)] for i in range(world // pp)]


def _shape_of_unheld(pm: ParallelModule, i: int) -> Any:
    """``(shape, dtype, device)`` of a parameter this rank does not hold (only its shape is read:
    ``propagate_fake`` makes a fake tensor of it, allocating nothing)."""
    from autopar.placement import local_shape

    _, key = pm.primal_roles()[i]
    return (local_shape(pm._shapes[key], pm._specs[key], pm._mesh), pm._dtypes_of[key], pm.device)


def _recompute_info(cap: Any, cluster: Cluster, config: PlanConfig, mode: str) -> dict[str, Any]:
    """``RankInfo``'s recomputation fields: captured node name -> the repeated-layer instance it
    runs in (``transformer.h.3``, from the tensor annotations' module paths), and the captured
    nodes ``mode`` recomputes (``passes.strategies.recomputed``, the rule the plan was costed by)."""
    from autopar.graph import outer_instance
    from autopar.ir import TENSOR
    from autopar.passes import PassContext, run_passes
    from autopar.passes.annotate import annotate_tensors
    from autopar.passes.strategies import recomputed

    if not any(TENSOR in n.meta for n in cap.gm.graph.nodes):
        run_passes(cap.gm, PassContext(captured=cap, cluster=cluster, config=config), [annotate_tensors])
    layer_of, sources = {}, set()
    for n in cap.gm.graph.nodes:
        info = n.meta.get(TENSOR)
        if info is None or n.op != "call_function":
            continue
        layer_of[n.name] = outer_instance(info.module)
        if recomputed(n, mode):
            sources.add(n.name)
    return {"layer_of": layer_of, "recompute_sources": frozenset(sources)}

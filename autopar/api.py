"""The user's entry points, composing the layers below: ``plan`` (capture → planner),
``parallelize`` (capture → plan or broadcast → ``ParallelModule`` → the per-rank compiler's step,
``autopar.passes.rank_compiler``) and
``measure_local`` (the runtime measures this machine, the cost model is fitted to it).

Every planning option travels as one ``PlanConfig`` (``config=``, or its fields as keyword
arguments), so ``plan`` and ``parallelize`` honor the same options the same way.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from autopar.audit import audited
from autopar.capture import Captured, capture
from autopar.cluster import Cluster
from autopar.config import PlanConfig
from autopar.planfile import Plan
from autopar.runtime.module import ParallelModule
from autopar.runtime.monitor import DEFAULT_TIMEOUT
from autopar.runtime.world import RankWorld, broadcast_plan, check_world, device_for_backend, join_mesh

if TYPE_CHECKING:
    from autopar.passes.rank_compiler import RankTarget

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
    the parameters' dtype), ``zero_stage`` (1, 2 or 3, or a tuple the solver picks among per
    parameter; default 2 or 3, and the 3D search tries 1 on its fastest accumulated candidates), ``time_limit``, ``workers``, ``disable`` (pass names).

    The plan is audited (``autopar.audit``): the result in ``plan.info["audit"]``, and one
    ``AuditWarning`` where the plan wastes its devices or predicts what they cannot do.
    """
    from autopar.plan_search import plan_model

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
    captured: Captured | None = None,
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
    ``captured``: ``autopar.capture(model, example_inputs)`` made before, reused instead of
    exporting the model again (parallelizing one model under several plans exports it once); it
    is checked to be a capture of this model's parameters and these inputs' shapes. A pipelined
    plan runs the model captured on one micro-batch, so it reads ``captured`` only to plan.

    The step is built by the per-rank compiler (``autopar.passes.rank_compiler``: lowering, the
    stage cut, fused kernels, the traced step, the rank-program passes, Inductor), a list of passes
    of which ``disable`` (a ``PlanConfig`` field) turns any but the required ones off by name;
    ``pm.passes`` lists those that ran.
    A pipelined plan (``plan.pipeline``): ``plan``'s mesh is the layout inside a stage (it spans
    ``world / pp`` devices), each pipeline rank runs its stages' actions of the plan's schedule
    (``autopar.schedule``), and the plan was made for one micro-batch of ``example_inputs`` (the
    global batch cut in ``microbatches`` along dimension 0).
    """
    import torch.distributed as dist

    from autopar.passes import PassContext
    from autopar.passes.plan_check import check_plan
    from autopar.passes.rank_compiler import compile_rank
    from autopar.passes.stage_cut import params_held

    config = PlanConfig.build(config, **options)
    if captured is not None:
        _check_captured(captured, model, example_inputs)
    check_world(plan, cluster)
    if plan is None:
        if captured is None:
            captured = capture(model, example_inputs)
        plan = _plan_on_rank_zero(
            model, example_inputs, cluster, config.replace(compile=True) if compile else config, captured
        )
    compile = plan.compile if compile is None else compile
    cap, batch = _captured_as_planned(model, example_inputs, plan, captured)
    check_plan(cap, plan)  # before any process group or collective: every rank refuses the same plan
    world = join_mesh(plan, device_for_backend(dist.get_backend()), timeout)
    held = params_held(cap, plan, world.pp.coord if world.pp is not None else 0)
    local = local_inputs and plan.pipeline is None
    pm = ParallelModule(plan, cap, model, world, local, check_inputs=check_inputs, held=held)
    if gather_outputs and plan.pipeline is None:
        _note_gathered_outputs(cap, plan)
    target = _rank_target(pm, plan, model, world, batch, gather_outputs, compile)
    pm.set_step(compile_rank(target, PassContext(captured=cap, cluster=cluster, config=config)))
    if pm.pipeline is not None:
        pm.pipeline.predicted = _predicted_rank(
            plan, world.pp.coord, world.axes[0].coord if world.axes else 0
        )
    return pm


GATHER_NOTE = 0.02
"""``parallelize`` warns where gathering the model's outputs whole (``gather_outputs=True``) costs
more than this share of the plan's predicted step, which does not include it."""


def _note_gathered_outputs(cap: Captured, plan: Plan) -> None:
    """Warn where ``gather_outputs=True`` makes every step gather large outputs (a language model's
    logits) that the plan keeps split: the plan's predicted step is the training step without
    that gather (``autopar.cost.comm``: an all-gather along every axis an output is split on, an
    all-reduce along every axis it is partial on)."""
    from autopar.graph import output_node
    from autopar.mesh import Mesh
    from autopar.placement import Partial, Shard, parse_spec

    try:
        mesh = Mesh(tuple(plan.mesh_shape), Cluster.from_dict(plan.cluster))
    except (KeyError, TypeError, ValueError):
        return
    by_name = {n.name: n for n in plan.nodes}
    seconds, moved, what = 0.0, 0.0, []
    for i, n in enumerate(output_node(cap.gm).all_input_nodes):
        val, node = n.meta.get("val"), by_name.get(n.name)
        if node is None or not node.outputs or not isinstance(val, torch.Tensor) or val.dim() == 0:
            continue
        nbytes = float(val.numel() * val.element_size())
        spec = parse_spec(node.outputs[0])
        gathered = [a for a, p in enumerate(spec) if isinstance(p, Shard) and mesh.shape[a] > 1]
        summed = [a for a, p in enumerate(spec) if isinstance(p, Partial) and mesh.shape[a] > 1]
        if not gathered and not summed:
            continue
        seconds += (mesh.all_gather_cost(nbytes, axes=gathered) if gathered else 0.0) + (
            mesh.all_reduce_cost(nbytes, axes=summed) if summed else 0.0
        )
        moved += nbytes
        what.append(f"output {i} of shape {tuple(val.shape)}")
    step = plan.predicted.step_time
    if step > 0 and seconds > GATHER_NOTE * step:
        warnings.warn(
            f"autopar: gather_outputs=True gathers the model's outputs whole on every rank each step "
            f"({', '.join(what)}: {moved / 2**20:.1f} MiB, about {seconds * 1e3:.2f} ms, "
            f"{seconds / step:.0%} of the plan's predicted {step * 1e3:.2f} ms step, which does not include "
            "it); pass gather_outputs=False to get them as this rank's shards where only the loss is needed",
            stacklevel=3,
        )


def _plan_on_rank_zero(
    model: nn.Module, example_inputs: Any, cluster: Cluster, config: PlanConfig, cap: Any
) -> Plan:
    """Rank 0 plans, every rank gets its plan (``broadcast_plan``). ``workers=1``: the candidate
    meshes are solved in this process. Forking here is unsafe (the process group's threads are
    running) and impossible under a daemonic launcher (``spawn``)."""
    from autopar.plan_search import plan_model

    return broadcast_plan(
        lambda: plan_model(model, example_inputs, cluster, config.replace(workers=1), captured=cap)
    )


def _check_captured(cap: Any, model: nn.Module, example_inputs: Any) -> None:
    """Refuse a ``captured`` that is not this model on these inputs (every rank refuses the same
    one, before any process group or collective)."""
    from autopar.capture import capture_difference, normalize_inputs

    if not isinstance(cap, Captured):
        raise TypeError(
            f"captured must be what autopar.capture(model, example_inputs) returns, got {type(cap).__name__}"
        )
    why = capture_difference(cap, model, *normalize_inputs(example_inputs))
    if why is not None:
        raise ValueError(
            f"captured is not a capture of this model on these example inputs: {why}. Capture again with "
            "autopar.capture(model, example_inputs), or leave captured out"
        )


def _captured_as_planned(
    model: nn.Module, example_inputs: Any, plan: Plan, cap: Captured | None
) -> tuple[Captured, tuple]:
    """The captured program ``plan`` was made for, and the batch the compiler reads shapes from as
    ``(args, kwargs)``: ``cap`` (captured here where not given) and ``example_inputs`` themselves,
    or for a pipelined plan the model captured on one micro-batch (as the planner captured it) and
    that micro-batch."""
    from autopar.capture import microbatch_inputs, normalize_inputs
    from autopar.microbatch import MicrobatchCaptures
    from autopar.passes.plan_check import program_difference

    args, kwargs = normalize_inputs(example_inputs)
    if plan.pipeline is None:
        return (cap if cap is not None else capture(model, (args, kwargs))), (args, kwargs)
    microbatches = plan.pipeline.microbatches
    cap = MicrobatchCaptures(model, (args, kwargs))(microbatches)
    if cap.fingerprint != plan.fingerprint:
        raise ValueError(
            "the model captured on one micro-batch of these inputs is not the program the plan was made for "
            f"(its fingerprint differs; {program_difference(plan, cap)}): plan again for this model and "
            "batch shape"
        )
    return cap, normalize_inputs(microbatch_inputs(args, kwargs, microbatches))


def _rank_target(
    pm: ParallelModule, plan: Plan, model: nn.Module, world: RankWorld, batch: tuple, gather_outputs: bool,
    compile: bool,
) -> RankTarget:  # fmt: skip
    """What the per-rank compiler compiles for (``autopar.passes.rank_compiler.RankTarget``): this
    rank's place, and its program's inputs for ``batch`` (shapes read; a pipelined plan's
    parameters held elsewhere given by shape). Without a pipeline the inputs are checked and
    agreed between the ranks as every call's are."""
    from autopar.passes.rank_compiler import RankTarget

    roles = pm.primal_roles()
    named = dict(model.named_parameters(remove_duplicate=False))
    pipelined = plan.pipeline is not None
    return RankTarget(
        plan=plan,
        axes=tuple(world.axes),
        device=world.device,
        roles=tuple(roles),
        examples=tuple(pm.example_primals(*batch, check=not pipelined)),
        trainable=tuple(pm.grad_primals()),
        trainable_anywhere=tuple(
            i for i, (kind, key) in enumerate(roles) if kind == "param" and named[key].requires_grad
        ),
        pp_coord=world.pp.coord if world.pp is not None else 0,
        # A pipelined step returns the loss alone (``runtime.pipeline_runner``): other outputs (the
        # logits) stay local shards rather than being gathered every micro-batch for nothing.
        gather_outputs=gather_outputs and not pipelined,
        compile=compile,
        group=world.world_group,
        quiet=tuple(world.all_axes),
    )


def _predicted_rank(plan: Plan, coord: int, coord0: int = 0) -> dict[str, float]:
    """What ``plan`` predicts for pipeline rank ``coord``'s step, its schedule played by
    ``autopar.cost.timeline`` (``PipelineRunner.predicted``, which ``ParallelModule.report`` prints
    beside the measurement); empty where the plan has no per-stage costs. ``coord0``: the rank's
    coordinate on the stage mesh's first axis (unequal data-parallel shares)."""
    from autopar.cost.timeline import StageCost, play
    from autopar.schedule import max_in_flight

    pipe = plan.pipeline
    if pipe is None or not pipe.stage_costs:
        return {}
    overlap = Cluster.from_dict(plan.cluster).overlap_comm
    if pipe.dp_shares:  # this rank's replica's own micro-batches and costs
        actions = pipe.actions(coord0)
        own = pipe.replica_costs[coord0] if pipe.replica_costs else pipe.stage_costs[0]
        tl = play(actions, [StageCost(**own)], overlap=overlap)
    else:
        actions = pipe.actions()
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

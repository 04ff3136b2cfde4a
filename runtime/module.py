"""``ParallelModule``: this rank's part of a model, running the step the per-rank compiler built.

``autopar.parallelize`` (``autopar.api``) captures the model, plans on rank 0 where no plan is
given (``autopar.runtime.world.broadcast_plan``), joins the process groups of the plan's mesh
(``autopar.runtime.world.join_mesh``), builds this module — only this rank's shards of the
parameters and buffers are materialized (``autopar.runtime.shards``) — and hands it the record of
this rank's step that the per-rank compiler built (``autopar.passes.rank_compiler``: a
``RankStep``, ``autopar.program.records``), which ``set_step`` binds. This module only executes:
it never imports the planner, the solver, the rules, the passes or the cost model.

The :class:`ParallelModule` takes the same global batch on every rank (or, with
``local_inputs=True``, each rank's shard from a distributed data loader: ``pm.input_specs``
says which) and returns what the model returns. Its ``parameters()`` are the local shards, so any
torch optimizer works; gradients are synchronized inside ``backward()``. ``full_state_dict`` and
``load_full_state_dict`` speak the original model's ``state_dict`` keys. Its jobs are split over:

* ``autopar.runtime.inputs`` — each call's inputs: sharded, checked against the plan, agreed
  between the ranks (``InputChecks``);
* ``autopar.runtime.state`` — full and sharded state dicts, gradient clipping (``ModuleState``);
* this module — the bindings and shards, and ``forward``'s three ways to run a call: a pipelined
  plan's schedule (``autopar.runtime.pipeline_runner``), the captured training step
  (``autopar.runtime.step_runner``), or the forward program under autograd where no step was
  captured (and for calls without gradients).

ZeRO-3 (parameters sharded along the data-parallel axis, gathered just before use, gradients
reduce-scattered) is a plan in which a parameter's spec shards it along an axis where its users
need it replicated: the lowering gathers it at each use. In the captured step, the rank-program
passes gather it again in backward (``autopar.passes.overlap.regather_zero3_params``); run under
autograd, this module's saved-tensor hooks keep only the local shard for backward and gather it
again there. Either way the full parameter is freed after its use. Optimizer state and gradients
follow the parameter's placement. ZeRO-2 plans keep the gathered copy for backward; ZeRO-1 plans
also all-reduce the full gradient before slicing it.

Data-parallel weight gradients are all-reduced in buckets while backward runs
(``autopar.passes.overlap.bucket_gradients``), as PyTorch DDP does.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import nn

from autopar.capture import Captured
from autopar.placement import local_shape
from autopar.planfile import Plan
from autopar.program import collectives as C
from autopar.program.records import CompileReport, RankStep, StepProgram
from autopar.runtime.inputs import InputChecks
from autopar.runtime.monitor import CollectiveFailure, StepMonitor
from autopar.runtime.pipeline_runner import PipelineRunner, build_runner
from autopar.runtime.shards import bind_placeholders, get_path, materialize, set_path
from autopar.runtime.state import ModuleState
from autopar.runtime.step_runner import bind_step, run_step
from autopar.runtime.world import RankWorld

__all__ = ["ParallelModule"]


class ParallelModule(InputChecks, ModuleState, nn.Module):
    """This rank's part of a model under a Plan (see module docstring). Built by
    ``autopar.parallelize``; runs once ``set_step`` has given it its step."""

    def __init__(
        self,
        plan: Plan,
        cap: Captured,
        model: nn.Module,
        world: RankWorld,
        local_inputs: bool = False,
        *,
        check_inputs: str | None = "digest",
        held: set[str] | None = None,
    ) -> None:
        super().__init__()
        self._held = held
        if check_inputs == "hash":  # its former name
            check_inputs = "digest"
        if check_inputs not in (None, "digest"):
            raise ValueError(f"check_inputs must be 'digest' (the default) or None, got {check_inputs!r}")
        self.plan = plan
        self.captured = cap
        self.axes = list(world.axes)
        self.device = world.device
        self.local_inputs = local_inputs
        self._mesh = tuple(plan.mesh_shape)
        self._coord = tuple(ax.coord for ax in world.axes)
        self._in_spec = cap.in_spec
        self._out_spec = cap.out_spec
        b = bind_placeholders(cap, plan)
        self._bindings = b.bindings
        """What each placeholder of the program is bound to, in order (``autopar.runtime.shards``)."""
        self._specs, self._shapes = b.specs, b.shapes
        self._dtypes, self._dtypes_of = b.input_dtypes, b.dtypes_of
        self.index_inputs = dict(cap.index_inputs)
        """User input path -> the ranges its values must lie in (checked every call)."""
        self.check_inputs = check_inputs
        """``"digest"`` (default): before running, the ranks agree on every call's inputs in one small
        all-gather — a digest of the global batch must be the same on every rank, and a rank that
        refused its inputs stops the others at once (``_agree``); ``None``: each rank checks only
        its own inputs, no collective."""
        self.input_specs: dict[str, tuple[str, ...]] = b.input_specs
        """User input path -> spec each rank's input shard has (for ``local_inputs=True``)."""
        self._param_names = [f for f in b.params if self._holds(f)]
        self._buffer_names = [f for f in b.buffers if self._holds(f)]
        self._materialize(model)
        self._constants = dict(cap.constants)
        self._aliases = {a: first for first, names in cap.param_aliases.items() for a in names}
        self._state_keys = list(model.state_dict().keys())
        self.device_mesh = world.device_mesh
        """The ``torch.distributed.DeviceMesh`` over this module's axis groups (DTensor checkpoints)."""
        self.world_group = world.world_group
        """A process group of every rank with this module's collective timeout (input checks).
        ``None`` once released (``autopar.runtime.monitor``: a step failed)."""
        self._world = world
        self.monitor = StepMonitor(
            rank=dist.get_rank() if dist.is_initialized() else 0,
            world=dist.get_world_size() if dist.is_initialized() else 1,
            timeout=world.timeout,
            release=self._release_groups,
        )
        self.microbatches = 1
        """Micro-batches a call's batch is cut into (a pipelined plan; the plan is for one)."""
        self.program: torch.fx.GraphModule | None = None
        """This rank's forward program (``set_step``): what runs, under autograd, where no step was
        captured, and for calls without gradients."""
        self.pipeline: PipelineRunner | None = None
        """This rank's pipeline stages and schedule (a pipelined plan); ``forward`` runs the whole
        schedule and returns the mean loss over micro-batches (``autopar.runtime.pipeline_runner``)."""
        self.step: StepProgram | None = None
        """The whole training step as forward and backward programs (``set_step``); without one,
        the forward program runs under autograd."""
        self.compiled: CompileReport | None = None
        """What ``parallelize(..., compile=True)`` did: programs compiled by Inductor (seconds each),
        or why they run eagerly; ``None`` without ``compile=True``."""
        self.passes: tuple[str, ...] = ()
        """The per-rank compiler's passes that built this rank's step, in order."""

    def _release_groups(self) -> None:
        """Destroy this module's process groups and drop every reference it holds to them
        (``autopar.runtime.monitor``: what a rank whose step failed does for its peers)."""
        self._world.release()
        self.world_group, self.device_mesh = None, None
        if self.pipeline is not None:  # the groups summing tied weights' gradients across stages
            for _, group in self.pipeline.shared:
                with contextlib.suppress(Exception):
                    dist.destroy_process_group(group)
            self.pipeline.shared = []
        gc.collect()  # a group closes its connections when its last reference goes

    # ------------------------------------------------------------------ shards
    def _holds(self, fqn: str) -> bool:
        """Whether this rank holds ``fqn`` (in a pipelined plan: read by one of its stages)."""
        return self._held is None or fqn in self._held

    def _materialize(self, model: nn.Module) -> None:
        """This rank's shards of the parameters and buffers it holds, under ``m.`` (their FQNs)."""
        full_params = dict(model.named_parameters())
        full_buffers = dict(model.named_buffers())
        persistent = set(model.state_dict().keys())
        for fqn in self._param_names:
            full = full_params[fqn]
            local = materialize(full, self._specs[fqn], self._mesh, self._coord, self.device)
            set_path(self, "m." + fqn, nn.Parameter(local, requires_grad=full.requires_grad))
        for fqn in self._buffer_names:
            local = materialize(full_buffers[fqn], self._specs[fqn], self._mesh, self._coord, self.device)
            set_path(self, "m." + fqn, local, buffer=True, persistent=fqn in persistent)

    def primal_roles(self) -> list[tuple[str, str]]:
        """``(kind, name)`` of every program input: ``param``/``buffer`` with its FQN, ``input``
        with its path, ``const`` with its placeholder name."""
        return list(self._bindings)

    def grad_primals(self) -> list[int]:
        """Indices of the program inputs that are trainable parameters this rank holds."""
        return [
            i
            for i, (kind, key) in enumerate(self._bindings)
            if kind == "param" and self._holds(key) and get_path(self, "m." + key).requires_grad
        ]

    def example_primals(self, args: tuple, kwargs: dict, check: bool = True) -> list[Any]:
        """The program's inputs for a batch of global inputs (``primal_values``), a parameter or
        buffer this rank does not hold given as ``(shape, dtype, device)`` of the piece it would
        hold: what the per-rank compiler reads shapes from (it allocates nothing for those)."""
        values = self.primal_values(args, kwargs, local_inputs=False, check=check)
        for i, ((kind, key), v) in enumerate(zip(self._bindings, values)):
            if v is None and kind in ("param", "buffer"):
                shape = local_shape(self._shapes[key], self._specs[key], self._mesh)
                values[i] = (shape, self._dtypes_of[key], self.device)
        return values

    # ------------------------------------------------------------------ the step
    def set_step(self, record: RankStep) -> None:
        """Run this rank's step as ``record`` says (built by the per-rank compiler): its whole
        training step (``StepProgram``, bound to this rank's axes and monitor), its pipeline stages
        (a ``PipelineRunner`` over the plan's schedule), or the forward program alone."""
        self.program = record.program
        self.passes = record.passes
        self.compiled = record.compiled
        if record.stages is not None:
            pipe = self.plan.pipeline
            assert pipe is not None and self._world.pp is not None
            # Unequal data-parallel shares: this rank's count of the plan's micro-batches.
            coord0 = self._coord[0] if pipe.dp_shares else None
            self.pipeline = build_runner(
                record.stages, roles=self.primal_roles(), trainable=self.grad_primals(), pp_axis=self._world.pp,
                pp_groups=self._world.pp_groups(), actions=pipe.actions(coord0)[self._world.pp.coord],
                microbatches=pipe.microbatches_at(coord0 or 0), timeout=self._world.timeout,
                shares=self.axes[0] if pipe.dp_shares else None,
                loss_weight=1.0 / pipe.microbatches if pipe.dp_shares else 0.0,
            )  # fmt: skip
            self.pipeline.monitor = self.monitor
            self.microbatches = pipe.microbatches
        elif record.step is not None:
            bind_step(record.step, self.axes, self.monitor)
            self.step = record.step

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.monitor.check_usable()
        try:
            values = self.primal_values(args, kwargs)
        except CollectiveFailure:  # another rank refused its inputs: its note names it, not this rank
            raise
        except Exception as exc:  # a bad input here: noted, so the other ranks name it
            err = self.monitor.fail(exc, "checking the inputs")
            if err is None:
                raise
            raise err from exc
        if self.pipeline is not None:
            trainable = [values[i] for i in self.pipeline.trainable]
            loss = self.pipeline.loss(values, trainable)
            leaves = [loss] + [None] * (self._out_spec.num_leaves - 1)
            return pytree.tree_unflatten(leaves, self._out_spec)
        if self.step is not None and torch.is_grad_enabled():
            outs = run_step(self.step, values)
            return pytree.tree_unflatten(list(outs), self._out_spec)
        if self.program is None:
            raise RuntimeError(
                "this ParallelModule has no step yet (set_step; autopar.parallelize builds it)"
            )
        gathered: C.GatheredParams = self.program._gathered_params
        try:
            if not gathered.used:
                outs = self.program(*values)
            else:
                try:
                    with torch.autograd.graph.saved_tensors_hooks(gathered.pack, gathered.unpack):
                        outs = self.program(*values)
                finally:
                    gathered.clear()
        except Exception as exc:  # noted for the other ranks; a peer's failure is named (runtime.monitor)
            err = self.monitor.step_failed(exc, "the forward program")
            if err is None:
                raise
            raise err from exc
        return pytree.tree_unflatten(list(outs), self._out_spec)

    @torch.no_grad()
    def report(self) -> str:
        """This rank's last step as measured, beside the plan's prediction for the same rank: the
        step, the compute (stage programs with their collectives), the time spent waiting for
        pipeline transfers, the idle rest, and the micro-batches in flight. A pipelined module
        only (the prediction, ``PipelineRunner.predicted``, is the plan's schedule played by
        ``autopar.cost.timeline`` when the module was built)."""
        if self.pipeline is None or self.plan.pipeline is None:
            raise RuntimeError("report() describes a pipelined module; this module runs one stage")
        return self.pipeline.report(self.plan.pipeline.schedule)

    @property
    def code(self) -> str:
        """This rank's program as Python, each collective (issue and wait) on its own line: the
        whole training step (forward and backward) when it was captured, else the forward."""
        return self.step.joint.code if self.step is not None else self.forward_code

    @property
    def forward_code(self) -> str:
        """The lowered forward program (before the backward was traced into it)."""
        if self.program is None:
            raise RuntimeError("this ParallelModule has no program yet (set_step)")
        return self.program.code

"""``ParallelModule``: this rank's part of a model, running the rank's program built from a Plan.

``autopar.parallelize`` (``autopar.api``) captures the model, plans on rank 0 where no plan is
given (``broadcast_plan``), builds one process group per mesh axis (``mesh_axes``), lowers the
plan to this rank's program (``autopar.passes``) and wraps it here; only this rank's shards of the
parameters and buffers are materialized. This module only executes: it never imports the planner,
the solver or the rules.

The :class:`ParallelModule` takes the same global batch on every rank (or, with
``local_inputs=True``, each rank's shard from a distributed data loader: ``pm.input_specs``
says which) and returns what the model returns. Its ``parameters()`` are the local shards, so any
torch optimizer works; gradients are synchronized inside ``backward()``. ``full_state_dict`` and
``load_full_state_dict`` speak the original model's ``state_dict`` keys.

ZeRO-3 (parameters sharded along the data-parallel axis, gathered just before use, gradients
reduce-scattered) is a plan in which a parameter's spec shards it along an axis where its users
need it replicated: the lowering gathers it at each use, and this module's saved-tensor hooks keep
only the local shard for backward and gather it again there, so the full parameter is freed after
its use. Optimizer state and gradients follow the parameter's placement. ZeRO-2 plans keep the
gathered copy for backward; ZeRO-1 plans also all-reduce the full gradient before slicing it.

Data-parallel weight gradients are all-reduced in buckets while backward runs
(``autopar.runtime.buckets``), as PyTorch DDP does.
"""

from __future__ import annotations

import datetime
import itertools
import json
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import nn

from autopar.capture import Captured, input_paths
from autopar.cluster import Cluster, mesh_arithmetic
from autopar.placement import Replicate, Shard, Spec, local_shape, parse_spec, shard_slices
from autopar.planfile import Plan
from autopar.program import collectives as C
from autopar.program.collectives import AxisGroup, run_reshard
from autopar.program.records import CompileReport, StepProgram
from autopar.runtime.compat import all_gather_into
from autopar.runtime.monitor import DEFAULT_TIMEOUT, CollectiveFailure, StepMonitor
from autopar.runtime.pipeline import PipelineRunner
from autopar.runtime.step import bind_step, run_step

__all__ = [
    "ParallelModule",
    "broadcast_plan",
    "check_world",
    "device_for_backend",
    "local_shard",
    "mesh_axes",
]


def local_shard(
    full: torch.Tensor, spec: Spec, mesh_shape: Sequence[int], coord: Sequence[int]
) -> torch.Tensor:
    """This rank's piece of ``full`` under ``spec`` (blocks concatenated); ``full`` itself when
    ``spec`` shards nothing, else a new contiguous tensor."""
    if all(not isinstance(p, Shard) for p in spec):
        return full
    ranges = shard_slices(tuple(full.shape), spec, mesh_shape, coord)
    out = full
    for d, rs in enumerate(ranges):
        if len(rs) == 1 and rs[0] == (0, full.shape[d]):
            continue
        out = torch.cat([out.narrow(d, lo, hi - lo) for lo, hi in rs], dim=d)
    return out.contiguous()


def _set_path(
    root: nn.Module, fqn: str, value: torch.Tensor, *, buffer: bool = False, persistent: bool = True
) -> None:
    *path, last = fqn.split(".")
    mod = root
    for part in path:
        if part not in mod._modules:
            mod.add_module(part, nn.Module())
        mod = mod._modules[part]
    if buffer:
        mod.register_buffer(last, value, persistent=persistent)
    else:
        mod.register_parameter(last, value)  # type: ignore[arg-type]


def _integer_ids(got: torch.dtype, planned: torch.dtype) -> bool:
    """Whether an input of dtype ``got`` is taken for one planned as ``planned``: both integer
    (not bool). Ids and targets of any integer dtype are cast to the dtype the program was captured
    with (int32 ids fed to a plan made with int64 ones), as eager PyTorch's index ops take int32
    and int64 alike; a narrowing cast is checked to lose nothing."""
    ints = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
    return got in ints and planned in ints


_CHUNK = 256
"""Words summed together by ``batch_digest`` before the position-weighted sum."""
_SMALL = 1 << 20
"""Bytes up to which ``batch_digest`` concatenates tensors and digests them as one."""


def batch_digest(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Three int64 words that differ, but for a vanishing chance, between batches that differ:
    the tensors' bytes (small ones concatenated, each large one by itself) read as 32-bit
    integers, zero-padded to whole chunks of ``_CHUNK``; the sum of every word, of every chunk's
    sum weighted by the chunk's position, and of every word weighted by its position in its chunk
    (so reordered rows or tokens differ too), folded over the pieces in order. Integer sums wrap
    exactly whatever the order of summation, so the digest of one batch is the same on every
    rank whatever its threads or kernels; it is computed where the tensors lie (two reductions
    over the batch: about 90 ms for a 150 MB image batch on one CPU core, well under a
    millisecond on a GPU, some 20 small ops for a batch of token ids)."""
    raws = [x.detach().contiguous().reshape(-1).view(torch.uint8) for x in tensors]
    small = [r for r in raws if r.numel() <= _SMALL]
    if len(small) > 1 and len({r.device for r in small}) == 1:  # one digest for the small ones
        raws = [torch.cat(small)] + [r for r in raws if r.numel() > _SMALL]
    acc: torch.Tensor | None = None
    for raw in raws:
        n = raw.numel()
        pad = -n % (4 * _CHUNK)
        if pad:  # a copy: only where the bytes are not whole chunks (a few KB of ids, say)
            raw = torch.cat([raw, raw.new_zeros(pad)])
        chunks = raw.view(torch.int32).view(-1, _CHUNK)
        rows = chunks.sum(1, dtype=torch.int32).to(torch.int64)
        columns = chunks.sum(0, dtype=torch.int32).to(torch.int64)
        where = torch.arange(1, rows.numel() + _CHUNK + 1, device=raw.device)
        d = torch.stack(
            [rows.sum() + n, (rows * where[: rows.numel()]).sum(), (columns * where[:_CHUNK]).sum()]
        )
        acc = d if acc is None else acc * 1_000_003 + d.to(acc.device)
    return acc if acc is not None else torch.zeros(3, dtype=torch.int64)


def _get_path(root: nn.Module, fqn: str) -> torch.Tensor:
    *path, last = fqn.split(".")
    mod = root
    for part in path:
        mod = mod._modules[part]
    return getattr(mod, last)


class ParallelModule(nn.Module):
    """This rank's part of a model under a Plan (see module docstring)."""

    def __init__(
        self,
        program: torch.fx.GraphModule,
        plan: Plan,
        cap: Captured,
        axes: Sequence[AxisGroup],
        model: nn.Module,
        device: torch.device,
        local_inputs: bool = False,
        *,
        device_mesh: Any = None,
        world_group: Any = None,
        timeout: float = DEFAULT_TIMEOUT,
        check_inputs: str | None = "digest",
        held: set[str] | None = None,
    ) -> None:
        super().__init__()
        self._held = held
        if check_inputs == "hash":  # its former name
            check_inputs = "digest"
        if check_inputs not in (None, "digest"):
            raise ValueError(f"check_inputs must be 'digest' (the default) or None, got {check_inputs!r}")
        self.program = program
        self.plan = plan
        self.captured = cap
        self.axes = list(axes)
        self.device = device
        self.local_inputs = local_inputs
        self._mesh = tuple(plan.mesh_shape)
        self._coord = tuple(ax.coord for ax in axes)
        self._in_spec = cap.in_spec
        self._out_spec = cap.out_spec
        by_name = {n.name: n for n in plan.nodes}
        # What each placeholder of the program is bound to, in order.
        self._bindings: list[tuple[str, str]] = []
        self._specs: dict[str, Spec] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._dtypes: dict[str, torch.dtype] = {}
        self._dtypes_of: dict[str, torch.dtype] = {}
        self.index_inputs = dict(cap.index_inputs)
        """User input path -> the ranges its values must lie in (checked every call)."""
        self.check_inputs = check_inputs
        """``"digest"`` (default): before running, the ranks agree on every call's inputs in one small
        all-gather — a digest of the global batch must be the same on every rank, and a rank that
        refused its inputs stops the others at once (``_agree``); ``None``: each rank checks only
        its own inputs, no collective."""
        self.input_specs: dict[str, tuple[str, ...]] = {}
        """User input path -> spec each rank's input shard has (for ``local_inputs=True``)."""
        full_params = dict(model.named_parameters())
        full_buffers = dict(model.named_buffers())
        persistent = set(model.state_dict().keys())
        self._param_names: list[str] = []
        self._buffer_names: list[str] = []
        for node in cap.graph.nodes:
            if node.op != "placeholder":
                continue
            name = node.name
            spec = (
                parse_spec(by_name[name].outputs[0])
                if name in by_name
                else tuple(Replicate() for _ in self._mesh)
            )
            val = node.meta.get("val")
            shape = tuple(val.shape) if isinstance(val, torch.Tensor) else ()
            if isinstance(val, torch.Tensor):
                self._dtypes_of[cap.params.get(name, cap.buffers.get(name, name))] = val.dtype
            if name in cap.params:
                fqn = cap.params[name]
                full = full_params[fqn]
                self._specs[fqn], self._shapes[fqn] = spec, shape
                if fqn not in self._param_names and self._holds(fqn):
                    local = self._materialize(full, spec)
                    _set_path(self, "m." + fqn, nn.Parameter(local, requires_grad=full.requires_grad))
                    self._param_names.append(fqn)
                self._bindings.append(("param", fqn))
            elif name in cap.buffers:
                fqn = cap.buffers[name]
                self._specs[fqn], self._shapes[fqn] = spec, shape
                if fqn not in self._buffer_names and self._holds(fqn):
                    local = self._materialize(full_buffers[fqn], spec)
                    _set_path(self, "m." + fqn, local, buffer=True, persistent=fqn in persistent)
                    self._buffer_names.append(fqn)
                self._bindings.append(("buffer", fqn))
            elif name in cap.inputs:
                path = cap.inputs[name]
                self._specs["input:" + path], self._shapes["input:" + path] = spec, shape
                self.input_specs[path] = tuple(str(p) for p in spec)
                if isinstance(val, torch.Tensor):
                    self._dtypes["input:" + path] = val.dtype
                self._bindings.append(("input", path))
            elif name in cap.constants:
                self._bindings.append(("const", name))
            else:
                raise RuntimeError(f"placeholder {name} is neither parameter, buffer, input nor constant")
        self._constants = dict(cap.constants)
        self._aliases = {a: first for first, names in cap.param_aliases.items() for a in names}
        self._state_keys = list(model.state_dict().keys())
        self.device_mesh = device_mesh
        """The ``torch.distributed.DeviceMesh`` over this module's axis groups (DTensor checkpoints)."""
        self.world_group = world_group
        """A process group of every rank with this module's collective timeout (input checks)."""
        self.monitor = StepMonitor(
            rank=dist.get_rank() if dist.is_initialized() else 0,
            world=dist.get_world_size() if dist.is_initialized() else 1,
            timeout=timeout,
        )
        self.microbatches = 1
        """Micro-batches a call's batch is cut into (a pipelined plan; the plan is for one)."""
        self.pipeline: PipelineRunner | None = None
        """This rank's pipeline stages and schedule (a pipelined plan); ``forward`` runs the whole
        schedule and returns the mean loss over micro-batches (``autopar.runtime.pipeline``)."""
        self.step: StepProgram | None = None
        """The whole training step as forward and backward programs (``set_step``); without one,
        the forward program runs under autograd."""
        self.compiled: CompileReport | None = None
        """What ``parallelize(..., compile=True)`` did: programs compiled by Inductor (seconds each),
        or why they run eagerly; ``None`` without ``compile=True``."""

    # ------------------------------------------------------------------ construction helpers
    def _holds(self, fqn: str) -> bool:
        """Whether this rank holds ``fqn`` (in a pipelined plan: read by one of its stages)."""
        return self._held is None or fqn in self._held

    def _materialize(self, full: torch.Tensor, spec: Spec) -> torch.Tensor:
        if full.device.type == "meta":
            return torch.empty(
                local_shape(tuple(full.shape), spec, self._mesh), dtype=full.dtype, device=self.device
            )
        return local_shard(full.detach(), spec, self._mesh, self._coord).to(self.device).clone()

    # ------------------------------------------------------------------ running
    def shard_inputs(self, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:
        """This rank's shard of each user input of a global batch, keyed by input path."""
        out = {}
        for path, leaf in _leaves_by_path(args, kwargs).items():
            key = "input:" + path
            if key in self._specs and isinstance(leaf, torch.Tensor):
                out[path] = self._input_shard(leaf, self._specs[key])
        return out

    def _input_shard(self, x: torch.Tensor, spec: Spec) -> torch.Tensor:
        """This rank's rows of a global input. With micro-batches, the global batch is cut into
        ``microbatches`` pieces along dimension 0 first and each piece sharded as the plan says
        (the plan was made for one micro-batch), the pieces' shards stacked in order, so that the
        pipeline runner's cut of the local tensor gives each micro-batch's shard — whatever the
        input's spec (a replicated target beside a batch-split input included)."""
        if self.microbatches == 1 or x.dim() == 0:
            return local_shard(x, spec, self._mesh, self._coord)
        pieces = torch.chunk(x, self.microbatches, dim=0)
        return torch.cat([local_shard(p, spec, self._mesh, self._coord) for p in pieces], dim=0)

    def primal_values(
        self, args: tuple, kwargs: dict, local_inputs: bool | None = None, check: bool = True
    ) -> list[Any]:
        """The program's inputs for one call: this rank's parameters and buffers, constants, and
        each user input (cut to this rank's shard unless ``local_inputs``), checked against the plan
        (dtype, shape, index ranges) and, with ``check_inputs`` on, agreed between the ranks
        (``_agree``: the same global batch everywhere, and no rank refused its inputs)."""
        local_inputs = self.local_inputs if local_inputs is None else local_inputs
        leaves = _leaves_by_path(args, kwargs)
        values = []
        problem: Exception | None = None
        try:
            for kind, key in self._bindings:
                if kind in ("param", "buffer"):
                    values.append(_get_path(self, "m." + key) if self._holds(key) else None)
                elif kind == "const":
                    values.append(self._constants[key])
                else:
                    if key not in leaves:
                        raise TypeError(
                            f"this module was built for inputs {sorted(self.input_specs)}; input {key!r} is "
                            f"missing (got {sorted(leaves)})"
                        )
                    x = leaves[key]
                    if isinstance(x, torch.Tensor):
                        self._check_input(key, x, local_inputs)
                        if not local_inputs:
                            x = self._input_shard(x, self._specs["input:" + key])
                        x = x.to(self.device, self._dtypes.get("input:" + key, x.dtype))
                    values.append(x)
            if check and self.index_inputs:
                self._check_indices(leaves)
        except Exception as exc:  # agreed with the other ranks first, then raised here
            if not (check and self._agreeing()):
                raise
            problem = exc
        if check and self._agreeing():
            self._agree(leaves, problem, local_inputs)
        if problem is not None:
            raise problem
        return values

    def _agreeing(self) -> bool:
        return self.check_inputs is not None and dist.is_initialized() and dist.get_world_size() > 1

    def _check_input(self, key: str, x: torch.Tensor, local_inputs: bool) -> None:
        """dtype and shape against the plan (the global batch, or this rank's shard of it; a
        pipelined plan takes ``microbatches`` of the shape it was planned for, along dim 0)."""
        spec, shape = self._specs["input:" + key], self._shapes["input:" + key]
        if self.microbatches > 1 and shape:
            shape = (shape[0] * self.microbatches, *shape[1:])
        dtype = self._dtypes.get("input:" + key)
        if dtype is not None and x.dtype != dtype and not _integer_ids(x.dtype, dtype):
            raise TypeError(
                f"input {key!r} has dtype {x.dtype} but the plan was made for {dtype}; convert it, or plan again"
            )
        if (
            dtype is not None
            and x.dtype != dtype
            and x.numel()
            and torch.iinfo(dtype).bits < torch.iinfo(x.dtype).bits
        ):
            lo, hi = int(x.min()), int(x.max())
            info = torch.iinfo(dtype)
            if lo < info.min or hi > info.max:
                raise TypeError(
                    f"input {key!r} ({x.dtype}) holds values in [{lo}, {hi}], outside {dtype}'s range "
                    f"[{info.min}, {info.max}] that the program was captured with; plan with {x.dtype} inputs"
                )
        if local_inputs:
            want = local_shape(shape, spec, self._mesh)
            if tuple(x.shape) != want:
                raise ValueError(
                    f"input {key!r} has shape {tuple(x.shape)} but this rank's shard of the global batch {shape} "
                    f"laid out {tuple(str(p) for p in spec)} is {want} (pm.shard_inputs cuts a global batch)"
                )
        elif tuple(x.shape) != shape:
            raise ValueError(
                f"input {key!r} has shape {tuple(x.shape)} but the plan was made for the global "
                f"batch shape {shape}; plan again for this shape, or pass local_inputs=True with shards"
            )

    def _check_indices(self, leaves: dict[str, Any]) -> None:
        """Ids and targets in range, as the single-device model requires (a sharded lookup or loss
        would mask them silently). This rank's inputs only: ``_agree`` tells the others."""
        for key, bounds in self.index_inputs.items():
            x = leaves.get(key)
            if not isinstance(x, torch.Tensor) or x.numel() == 0:
                continue
            for b in bounds:
                bad = (x < 0) | (x >= b.bound)
                if b.ignore is not None:
                    bad &= x != b.ignore
                if bool(bad.any()):
                    v = int(x[bad].flatten()[0])
                    allowed = f"0 ≤ id < {b.bound}" + (
                        f" (or {b.ignore}, ignored)" if b.ignore is not None else ""
                    )
                    raise IndexError(
                        f"input {key!r} holds {v}, out of range for {b.what}: {allowed}; the single-device model "
                        f"raises IndexError here"
                    )

    def _agree(self, leaves: dict[str, Any], problem: Exception | None, local_inputs: bool) -> None:
        """The ranks agree on this call's inputs before any collective of the model: one
        all-gather of four int64 words per rank — whether this rank refused its inputs, and a
        digest of its global batch (``batch_digest``; zeros with ``local_inputs``, where each rank
        has its own shard). A rank that refused its inputs published its error first
        (``StepMonitor.note``), so every other rank raises at once naming it
        (:class:`CollectiveFailure`) instead of waiting in the model's first collective for a peer
        that never comes; where the digests differ, every rank raises naming the ranks that were
        given another batch than rank 0 (each rank its own loader, the DDP habit, without
        ``local_inputs=True``, would otherwise train on a silent mixture)."""
        if problem is not None:
            self.monitor.note(problem, "checking the inputs")
        keys = sorted(
            k for k in leaves if "input:" + k in self._specs and isinstance(leaves[k], torch.Tensor)
        )
        digest = (
            batch_digest([leaves[k] for k in keys]).to(self.device)
            if problem is None and not local_inputs
            else torch.zeros(3, dtype=torch.int64, device=self.device)
        )
        mine = torch.empty(1 + digest.numel(), dtype=torch.int64, device=self.device)
        mine[0] = int(problem is not None)
        mine[1:] = digest
        world = dist.get_world_size()
        every = torch.empty(world * mine.numel(), dtype=torch.int64, device=self.device)
        all_gather_into(every, mine, self.world_group)
        every = every.view(world, -1).cpu()
        if problem is not None:
            return  # this rank raises its own error
        refused = [r for r in range(world) if every[r, 0]]
        if refused:
            errors = self.monitor.peer_errors(refused)
            named = "; ".join(f"rank {r}: {e}" for r, e in errors.items())
            raise CollectiveFailure(
                f"rank {dist.get_rank()} stops before any collective of the model: rank(s) {refused} refused "
                f"their inputs ({named}). Every rank checks its inputs and agrees before running, so no rank "
                f"waits for a peer that raised"
            )
        if not local_inputs:
            differ = [r for r in range(world) if not torch.equal(every[r, 1:], every[0, 1:])]
            if differ:
                raise ValueError(
                    f"ranks {differ} were given a different global batch than rank 0 (their digests differ): every "
                    f"rank must pass the same global batch, or pass local_inputs=True to parallelize with each "
                    f"rank's own shard (pm.input_specs says how each input is split; pm.shard_inputs cuts a global "
                    f"batch); check_inputs=None turns this check off"
                )
        self.monitor.clear_note()

    def primal_roles(self) -> list[tuple[str, str]]:
        """``(kind, name)`` of every program input: ``param``/``buffer`` with its FQN, ``input``
        with its path, ``const`` with its placeholder name."""
        return list(self._bindings)

    def grad_primals(self) -> list[int]:
        """Indices of the program inputs that are trainable parameters."""
        return [
            i
            for i, (kind, key) in enumerate(self._bindings)
            if kind == "param" and self._holds(key) and _get_path(self, "m." + key).requires_grad
        ]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
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
            err = self.monitor.fail(exc, "the forward program")
            if err is None:
                raise
            raise err from exc
        return pytree.tree_unflatten(list(outs), self._out_spec)

    # ------------------------------------------------------------------ state
    @torch.no_grad()
    def report(self) -> str:
        """This rank's last step as measured, beside the plan's prediction for the same rank: the
        step, the compute (stage programs with their collectives), the time spent waiting for
        pipeline transfers, the idle rest, and the micro-batches in flight. A pipelined module
        only (the prediction, ``PipelineRunner.predicted``, is the plan's schedule played by
        ``autopar.cost.timeline`` when the module was built)."""
        if self.pipeline is None or self.plan.pipeline is None:
            raise RuntimeError("report() describes a pipelined module; this module runs one stage")
        m = self.pipeline.last
        if not m:
            raise RuntimeError("report(): run a training step first")
        pred = self.pipeline.predicted
        if not pred:
            raise RuntimeError(
                "report(): the plan has no per-stage costs (plan.pipeline.stage_costs) to predict from"
            )
        pipe = self.plan.pipeline
        r = self.pipeline.pp.coord
        rows = [
            ("step", pred["step"], m["step"]),
            ("compute", pred["compute"], m["compute"]),
            ("waiting for transfers + idle", pred["step"] - pred["compute"], m["p2p"] + m["idle"]),
        ]
        lines = [f"pipeline rank {r} of {pipe.pp}, {pipe.schedule}, {pipe.microbatches} micro-batches"]
        lines += [
            f"  {name:<30} predicted {p * 1e3:9.3f} ms   measured {q * 1e3:9.3f} ms" for name, p, q in rows
        ]
        lines.append(
            f"  {'micro-batches in flight':<30} predicted {int(pred['in_flight']):9d}      measured {int(m['in_flight']):9d}"
        )
        return "\n".join(lines)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """What ``model.state_dict()`` returns: full tensors gathered from the shards (every rank)."""
        out: dict[str, torch.Tensor] = {}
        cache: dict[str, torch.Tensor] = {}
        for key in self._state_keys:
            fqn = self._aliases.get(key, key)
            if fqn not in cache:
                if fqn not in self._specs:
                    raise KeyError(f"state_dict key {key!r} is not part of the captured program")
                spec = self._specs[fqn]
                if self.pipeline is None:
                    local = _get_path(self, "m." + fqn).detach()
                    full = run_reshard(
                        local, self._shapes[fqn], spec, tuple(Replicate() for _ in spec), self.axes
                    )
                else:
                    full = self._gather_across_stages(fqn)
                cache[fqn] = full.cpu() if full.device.type != "cpu" else full.clone()
            out[key] = cache[fqn]
        return out

    def _gather_across_stages(self, fqn: str) -> torch.Tensor:
        """A pipelined module's full ``fqn``: gathered in its stage's mesh, then broadcast over the
        pipeline axis from the lowest pipeline coordinate holding it."""
        runner, spec, shape = self.pipeline, self._specs[fqn], self._shapes[fqn]
        stage_axes = self.axes
        holder = min(runner.holders[fqn])
        if self._holds(fqn):
            local = _get_path(self, "m." + fqn).detach()
            full = run_reshard(local, shape, spec, tuple(Replicate() for _ in spec), stage_axes).contiguous()
        else:
            full = torch.empty(shape, dtype=self._dtypes_of[fqn], device=self.device)
        dist.broadcast(full, src=runner.pp_ranks[holder], group=runner.pp.group)
        return full

    @torch.no_grad()
    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor], strict: bool = True) -> None:
        """Scatter a full ``state_dict`` (the original model's keys) into the local shards."""
        missing = [k for k in self._state_keys if k not in state_dict]
        unexpected = [k for k in state_dict if k not in self._state_keys]
        if strict and (missing or unexpected):
            raise KeyError(
                f"load_full_state_dict: missing keys {missing[:5]}, unexpected keys {unexpected[:5]}"
            )
        for key, full in state_dict.items():
            fqn = self._aliases.get(key, key)
            if fqn not in self._specs:
                continue
            if tuple(full.shape) != self._shapes[fqn]:
                raise ValueError(f"{key}: shape {tuple(full.shape)} ≠ model's {self._shapes[fqn]}")
            if not self._holds(fqn):
                continue  # another pipeline stage's
            local = _get_path(self, "m." + fqn)
            local.copy_(local_shard(full.to(local.device), self._specs[fqn], self._mesh, self._coord))

    # ------------------------------------------------------------------ sharded checkpoints (DCP)
    def _state_fqns(self) -> list[str]:
        """Parameters (first names of tied ones) and persistent buffers, in model order."""
        persistent = {self._aliases.get(k, k) for k in self._state_keys}
        return [f for f in self._param_names + self._buffer_names if f in persistent]

    def _local(self, fqn: str) -> torch.Tensor:
        return _get_path(self, "m." + fqn)

    def state_dict(self, *args: Any, optimizer: torch.optim.Optimizer | None = None, **kwargs: Any) -> Any:
        """This rank's part of the model (and ``optimizer``'s state) as DTensors in the checkpoint's
        canonical layout, for ``torch.distributed.checkpoint.save``/``load``: loads under any other
        plan, mesh or world size (``autopar.runtime.checkpoint``). Called with ``nn.Module``'s own
        arguments (``destination``, ``prefix``, as a parent module does), it is ``nn.Module``'s."""
        if args or kwargs:
            return super().state_dict(*args, **kwargs)
        from autopar.runtime import checkpoint

        return checkpoint.state_dict(self, optimizer)

    def load_state_dict(  # type: ignore[override]
        self,
        state_dict: dict[str, Any],
        strict: bool = True,
        assign: bool = False,
        *,
        optimizer: torch.optim.Optimizer | None = None,
    ) -> Any:
        """Load a state from ``pm.state_dict()`` filled by ``torch.distributed.checkpoint.load``
        (reshards to this module's plan; ``optimizer``'s state too). A plain ``nn.Module`` state
        dict (``m.``-prefixed local shards) is loaded as ``nn.Module`` does."""
        from autopar.runtime import checkpoint

        if any(k.startswith(checkpoint.MODEL) for k in state_dict):
            checkpoint.load_state_dict(self, state_dict, optimizer)
            return None
        return super().load_state_dict(state_dict, strict, assign)

    def named_local_parameters(self) -> dict[str, nn.Parameter]:
        return {fqn: _get_path(self, "m." + fqn) for fqn in self._param_names}  # type: ignore[misc]

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip gradients by their global norm over all shards (like ``torch.nn.utils.clip_grad_norm_``)."""
        if norm_type != 2.0:
            raise ValueError("clip_grad_norm_ supports the 2-norm only")
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        grads = []
        for fqn in self._param_names:
            p = _get_path(self, "m." + fqn)
            if p.grad is None:
                continue
            grads.append(p.grad)
            replicas = math.prod(
                n for n, sp in zip(self._mesh, self._specs[fqn]) if not isinstance(sp, Shard)
            )
            total += p.grad.double().pow(2).sum() / replicas
        dist.all_reduce(total)
        norm = total.sqrt()
        coef = max_norm / (norm.item() + 1e-6)
        if coef < 1:
            for g in grads:
                g.mul_(coef)
        return norm.to(torch.float32)

    def set_step(self, step: StepProgram) -> None:
        """Run training steps as ``step``'s programs (built by ``autopar.passes.joint.build_step``)."""
        bind_step(step, self.axes, self.monitor)
        self.step = step

    @property
    def code(self) -> str:
        """This rank's program as Python, each collective (issue and wait) on its own line: the
        whole training step (forward and backward) when it was captured, else the forward."""
        return self.step.joint.code if self.step is not None else self.program.code

    @property
    def forward_code(self) -> str:
        """The lowered forward program (before the backward was traced into it)."""
        return self.program.code


def _leaves_by_path(args: tuple, kwargs: dict) -> dict[str, Any]:
    paths = input_paths(args, kwargs)
    leaves = [
        leaf
        for _, leaf in pytree.tree_flatten_with_path(args)[0]
        if isinstance(leaf, torch.Tensor) or leaf is None or isinstance(leaf, (int, float, bool))
    ] + [
        leaf
        for _, leaf in pytree.tree_flatten_with_path(kwargs)[0]
        if isinstance(leaf, torch.Tensor) or leaf is None or isinstance(leaf, (int, float, bool))
    ]
    return dict(zip(paths, leaves))


def device_for_backend(backend: str) -> torch.device:
    """The device this rank computes on: its CUDA device under NCCL, else the CPU."""
    if backend == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def broadcast_plan(plan_fn: Callable[[], Plan]) -> Plan:
    """Run ``plan_fn`` on rank 0 and broadcast its Plan as JSON (or its error) to every rank, so
    a planning error is raised on every rank and none waits forever."""
    payload: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            payload[0] = ("ok", json.dumps(plan_fn().to_dict()))
        except Exception as exc:  # sent to the other ranks, then re-raised on every rank
            payload[0] = ("error", f"{type(exc).__name__}: {exc}")
    dist.broadcast_object_list(payload, src=0)
    status, body = payload[0]
    if status != "ok":
        raise RuntimeError(f"planning failed on rank 0: {body}")
    return Plan.from_dict(json.loads(body))


def check_world(plan: Plan | None, cluster: Cluster) -> int:
    """The world size, after checking ``torch.distributed`` is up and matches the plan/cluster."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "autopar.parallelize needs torch.distributed: call torch.distributed.init_process_group(...) on every "
            "rank first (or use autopar.runtime.launch.spawn for local processes)"
        )
    world = dist.get_world_size()
    if plan is not None and plan.world_size != world:
        pp = f"{plan.pipeline.pp} pipeline ranks × " if plan.pipeline is not None else ""
        raise ValueError(
            f"plan mesh {pp}{mesh_arithmetic(tuple(plan.mesh_shape))} ≠ world size {world}: run it on "
            f"{plan.world_size} processes, or plan again for {world}"
        )
    if plan is None and cluster.world_size != world:
        raise ValueError(
            f"cluster has {cluster.nodes} × {cluster.gpus_per_node} = {cluster.world_size} devices but the process "
            f"group has {world} ranks"
        )
    return world


def mesh_axes(
    shape: Sequence[int],
    names: Sequence[str],
    device: torch.device,
    timeout: float = DEFAULT_TIMEOUT,
    stage_from: int = 0,
) -> tuple[list[AxisGroup], Any, Any]:
    """This rank's view of every axis of the mesh ``shape`` (named ``names``) — its own process
    group, created with the collective ``timeout`` (seconds), and its coordinate — a
    ``DeviceMesh`` over those groups (for DTensor checkpoints) and a group of all ranks with the
    same timeout (input checks). Every rank must call this (groups are created collectively, in
    the same order everywhere).

    Each set of two or more axes from ``stage_from`` on (the axes inside a pipeline stage), all
    of more than one device, gets a group too (``AxisGroup.combined``, keyed by the axes' indices
    counted from ``stage_from``): a gradient partial on several axes is all-reduced once over
    them."""
    from torch.distributed.device_mesh import DeviceMesh

    shape = tuple(shape)
    rank = dist.get_rank()
    ranks = torch.arange(math.prod(shape)).reshape(shape)
    coord = [int(c) for c in torch.nonzero(ranks == rank)[0]]
    span = datetime.timedelta(seconds=timeout)
    groups = []
    for a, n in enumerate(shape):
        mine = None
        for sub in ranks.movedim(a, -1).reshape(-1, n).tolist():  # every group of axis a
            g = dist.new_group(sub, timeout=span)
            if rank in sub:
                mine = g
        groups.append(mine)
    world_group = dist.new_group(list(range(ranks.numel())), timeout=span)
    mesh = DeviceMesh.from_group(groups, device.type, mesh=ranks, mesh_dim_names=tuple(names))
    axes = [
        AxisGroup(axis=a, name=names[a], size=n, coord=coord[a], group=groups[a]) for a, n in enumerate(shape)
    ]
    combined: dict[tuple[int, ...], AxisGroup] = {}
    wide = [a for a in range(stage_from, len(shape)) if shape[a] > 1]
    for k in range(2, len(wide) + 1):
        for span_axes in itertools.combinations(wide, k):
            others = [a for a in range(len(shape)) if a not in span_axes]
            size = math.prod(shape[a] for a in span_axes)
            mine, at = None, 0
            for sub in ranks.permute(*others, *span_axes).reshape(-1, size).tolist():
                g = dist.new_group(sub, timeout=span)
                if rank in sub:
                    mine, at = g, sub.index(rank)
            parts = tuple(axes[a] for a in span_axes)
            key = tuple(a - stage_from for a in span_axes)
            name = "·".join(names[a] for a in span_axes)
            combined[key] = AxisGroup(axis=-1, name=name, size=size, coord=at, group=mine, parts=parts)
    for ax in axes:
        ax.combined = combined
    return axes, mesh, world_group

"""The inputs of one call: cut to this rank's shard, checked against the plan (dtype, shape, index
ranges), and agreed between the ranks before any collective of the model runs.

``InputChecks`` is ``ParallelModule``'s part that does this (a mixin: it reads the module's
``_bindings``, ``_constants``, ``_specs``, ``_shapes``, ``_dtypes``, ``_mesh``, ``_coord``,
``input_specs``, ``index_inputs``, ``local_inputs``, ``check_inputs``, ``microbatches``,
``monitor``, ``world_group`` and ``device``, and its ``_holds``/``_local`` for the parameters and
buffers).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from autopar.capture import input_paths
from autopar.placement import Replicate, Spec, local_shape
from autopar.runtime.compat import all_gather_into
from autopar.runtime.monitor import CollectiveFailure
from autopar.runtime.shards import local_shard

__all__ = ["InputChecks", "batch_digest", "leaves_by_path"]


def integer_ids(got: torch.dtype, planned: torch.dtype) -> bool:
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


class InputChecks:
    """Cutting, checking and agreeing on a call's inputs (module docstring)."""

    def shard_inputs(self, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:
        """This rank's shard of each user input of a global batch, keyed by input path."""
        out = {}
        for path, leaf in leaves_by_path(args, kwargs).items():
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
        pipe = self.plan.pipeline
        if pipe is not None and pipe.dp_shares:
            # Unequal shares (``PipelinePlan.dp_shares``): the batch cut into the step's micro-batches
            # of one size, a run of consecutive ones for each coordinate of the first axis (which
            # therefore splits nothing further), each laid out over the other axes as planned.
            j, shares = self._coord[0], pipe.dp_shares
            pieces = torch.chunk(x, sum(shares), dim=0)[sum(shares[:j]) : sum(shares[: j + 1])]
            rest = (Replicate(), *spec[1:])
            return torch.cat([local_shard(p, rest, self._mesh, self._coord) for p in pieces], dim=0)
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
        leaves = leaves_by_path(args, kwargs)
        values = []
        problem: Exception | None = None
        try:
            for kind, key in self._bindings:
                if kind in ("param", "buffer"):
                    values.append(self._local(key) if self._holds(key) else None)
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
        if dtype is not None and x.dtype != dtype and not integer_ids(x.dtype, dtype):
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


def leaves_by_path(args: tuple, kwargs: dict) -> dict[str, Any]:
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

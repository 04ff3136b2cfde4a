"""The module's parameters and buffers as state: full state dicts (the original model's keys, full
tensors), sharded DCP state dicts that load under any plan (``autopar.runtime.checkpoint``), the
local parameters, the optimizer the plan trains with (``optimizer``: on the host where it
offloads it), and gradient clipping by the global norm over every shard.

``ModuleState`` is ``ParallelModule``'s part that does this (a mixin: it reads the module's
``_specs``, ``_shapes``, ``_dtypes_of``, ``_mesh``, ``_coord``, ``_aliases``, ``_state_keys``,
``_param_names``, ``_buffer_names``, ``axes``, ``device``, ``pipeline``, ``plan`` and ``_holds``).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from autopar.placement import Replicate, Shard
from autopar.program.collectives import run_reshard
from autopar.runtime.host_optimizer import HostOffloadOptimizer
from autopar.runtime.shards import get_path, local_shard

__all__ = ["ModuleState"]


class ModuleState:
    """State dicts, the local parameters and gradient clipping (module docstring)."""

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
                    local = self._local(fqn).detach()
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
            local = self._local(fqn).detach()
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
            local = self._local(fqn)
            local.copy_(local_shard(full.to(local.device), self._specs[fqn], self._mesh, self._coord))

    # ------------------------------------------------------------------ sharded checkpoints (DCP)
    def _state_fqns(self) -> list[str]:
        """Parameters (first names of tied ones) and persistent buffers, in model order."""
        persistent = {self._aliases.get(k, k) for k in self._state_keys}
        return [f for f in self._param_names + self._buffer_names if f in persistent]

    def _local(self, fqn: str) -> torch.Tensor:
        """This rank's piece of parameter or buffer ``fqn``."""
        return get_path(self, "m." + fqn)

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

    def optimizer(
        self, optimizer_class: type[torch.optim.Optimizer] = torch.optim.AdamW, **kwargs: Any
    ) -> torch.optim.Optimizer:
        """The optimizer this rank trains with under its plan: ``optimizer_class(parameters,
        **kwargs)`` over this rank's shards, or, where the plan offloads the optimizer
        (``Plan.offload_optimizer``: the memory it predicted leaves the state off the device), the
        same class over fp32 copies in host memory, stepped there
        (``autopar.runtime.host_optimizer.HostOffloadOptimizer``)."""
        params = list(self.parameters())  # type: ignore[attr-defined]
        if self.plan.offload_optimizer:  # type: ignore[attr-defined]
            return HostOffloadOptimizer(params, optimizer_class, **kwargs)
        return optimizer_class(params, **kwargs)

    def named_local_parameters(self) -> dict[str, nn.Parameter]:
        return {fqn: self._local(fqn) for fqn in self._param_names}  # type: ignore[misc]

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip gradients by their global norm over all shards (like ``torch.nn.utils.clip_grad_norm_``)."""
        if norm_type != 2.0:
            raise ValueError("clip_grad_norm_ supports the 2-norm only")
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        grads = []
        for fqn in self._param_names:
            p = self._local(fqn)
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

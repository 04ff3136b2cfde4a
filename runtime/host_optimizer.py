"""Optimizer offload at run time: a torch optimizer whose state and master weights live in host
memory and whose step runs on the host's CPU (ZeRO-Offload, Ren et al., arXiv 2101.06840; the
plan's ``Plan.offload_optimizer``, priced by ``autopar.cost.offload``).

Words: a **device parameter** is one of this rank's parameter shards (``ParallelModule``'s
``parameters()``); its **master** is an fp32 copy in host memory the wrapped optimizer updates; a
**staging buffer** is a host tensor of the device parameter's own dtype that copies go through
where that dtype is not fp32 (so the link carries the low-precision bytes, as the cost model
charges, and the CPU does the cast).

One ``step()``, in three phases one after another, as ``autopar.cost.offload`` plays it:

1. each device gradient is copied to the host (pinned buffers and a side stream where CUDA is
   there), then widened to fp32 into the master's ``.grad``;
2. the wrapped optimizer (``optimizer_class``, e.g. ``torch.optim.AdamW``) steps the masters;
3. each master is narrowed to the device dtype and copied back into its device parameter; on CUDA
   the copies run on the side stream and the compute stream waits for them, so the next forward
   reads the new weights without the host blocking.

``param_groups`` and ``state`` are the wrapped optimizer's (learning-rate schedulers work);
``state_dict()``/``load_state_dict()`` are its too. ``device_param`` maps a master back to its
device parameter (``autopar.runtime.checkpoint`` names optimizer state by it). ``last`` holds the
seconds of the last step's three phases (the weights' copy back waited for only with
``synchronize=True``: on CUDA it otherwise runs beside the next forward).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["HostOffloadOptimizer"]


class HostOffloadOptimizer(torch.optim.Optimizer):
    """``optimizer_class(**kwargs)`` over fp32 host copies of ``params`` (module docstring)."""

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        optimizer_class: type[torch.optim.Optimizer] = torch.optim.AdamW,
        *,
        synchronize: bool = False,
        **kwargs: Any,
    ) -> None:
        self.synchronize = synchronize
        """Wait for the weights' copy back at the end of ``step`` (to time it: ``last``)."""
        self.last: dict[str, float] = {}
        """Seconds of the last step's phases: ``to_host``, ``host_step``, ``to_device``."""
        self.device_params = [p for p in params if p.requires_grad]
        if not self.device_params:
            raise ValueError("HostOffloadOptimizer needs at least one parameter that requires a gradient")
        if any(isinstance(p, dict) for p in self.device_params):
            raise ValueError("HostOffloadOptimizer takes parameters, not parameter groups")
        cuda = any(p.is_cuda for p in self.device_params)
        self._stream = torch.cuda.Stream() if cuda else None
        pin = cuda

        def host(like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
            return torch.empty(like.shape, dtype=dtype, device="cpu", pin_memory=pin)

        self.masters: list[torch.Tensor] = []
        self._grads: list[torch.Tensor] = []
        self._staging: list[torch.Tensor | None] = []
        with torch.no_grad():
            for p in self.device_params:
                m = host(p, torch.float32)
                m.copy_(p.detach())
                self.masters.append(m)
                self._grads.append(host(p, torch.float32))
                self._staging.append(None if p.dtype == torch.float32 else host(p, p.dtype))
        self._device_of = {id(m): p for m, p in zip(self.masters, self.device_params)}
        self.inner = optimizer_class(self.masters, **kwargs)
        # torch.optim.Optimizer's own bookkeeping (hooks, the step counter schedulers patch),
        # without its param_groups: those are the wrapped optimizer's.
        self._optimizer_step_pre_hooks: dict = {}
        self._optimizer_step_post_hooks: dict = {}
        self._optimizer_state_dict_pre_hooks: dict = {}
        self._optimizer_state_dict_post_hooks: dict = {}
        self._optimizer_load_state_dict_pre_hooks: dict = {}
        self._optimizer_load_state_dict_post_hooks: dict = {}
        self._zero_grad_profile_name = "Optimizer.zero_grad#HostOffloadOptimizer.zero_grad"
        self.defaults = self.inner.defaults

    # the wrapped optimizer's groups and state, shared (not copied)
    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:
        return self.inner.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.inner.param_groups = value

    @property  # type: ignore[override]
    def state(self) -> Any:
        return self.inner.state

    @state.setter
    def state(self, value: Any) -> None:
        self.inner.state = value

    def device_param(self, master: torch.Tensor) -> torch.Tensor:
        """The device parameter ``master`` is the host copy of."""
        return self._device_of[id(master)]

    @torch.no_grad()
    def masters_from_device(self) -> None:
        """Set every master to its device parameter (after weights were loaded into the module:
        ``autopar.runtime.checkpoint.load_state_dict`` calls it). A checkpoint holds the device
        weights and the optimizer's moments, not the fp32 masters: with bf16 weights the masters
        restart from the bf16 values."""
        for p, m in zip(self.device_params, self.masters):
            m.copy_(p.detach())

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.inner.load_state_dict(state_dict)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.device_params:
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.zero_()

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        if closure is not None:
            raise ValueError("HostOffloadOptimizer.step takes no closure: the loss is computed on the device")
        stream = self._stream
        t0 = time.perf_counter()
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream())
        # 1. gradients to the host
        given = []
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for p, stage, buf in zip(self.device_params, self._staging, self._grads):
                if p.grad is None:
                    given.append(False)
                    continue
                (stage if stage is not None else buf).copy_(p.grad, non_blocking=stream is not None)
                given.append(True)
        if stream is not None:
            stream.synchronize()
        for m, stage, buf, has in zip(self.masters, self._staging, self._grads, given):
            if has:
                if stage is not None:
                    buf.copy_(stage)
                m.grad = buf
        t1 = time.perf_counter()
        # 2. the step on the host
        self.inner.step()
        t2 = time.perf_counter()
        for m, has in zip(self.masters, given):
            if has:
                m.grad = None
        # 3. weights back to the device
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for p, m, stage in zip(self.device_params, self.masters, self._staging):
                if stage is not None:
                    stage.copy_(m)
                    p.copy_(stage, non_blocking=stream is not None)
                else:
                    p.copy_(m, non_blocking=stream is not None)
        if stream is not None:
            torch.cuda.current_stream().wait_stream(stream)
            if self.synchronize:
                stream.synchronize()
        self.last = {"to_host": t1 - t0, "host_step": t2 - t1, "to_device": time.perf_counter() - t2}
        return None

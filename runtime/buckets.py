"""Bucketed, asynchronous gradient all-reduce for replicated weights (the data-parallel sync).

A weight replicated along a mesh axis whose every use splits work along it (data parallelism,
LayerNorm weights under sequence parallelism) needs its gradient all-reduced over that axis. The
lowering does not put a ``grad_sync`` node on such a weight; it lists it, and this module does
what PyTorch DDP does (Li et al., VLDB 2020): gradients are copied into flat buckets as autograd
produces them (a hook on each weight), a bucket's all-reduce is launched asynchronously as soon as
its last gradient arrives — overlapping the rest of backward — and at the end of backward (an
engine callback) every bucket is waited for and its sum added into ``.grad``. Buckets fill in
reverse order of first use, the order backward produces gradients.

The hook hands autograd a zero gradient and the reduced one is added at the end, so ``.grad``
accumulates correctly across several backward passes (gradient accumulation). Gradients are
final when ``loss.backward()`` returns.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from autopar.runtime.collectives import AxisGroup

__all__ = ["GradBuckets"]

BUCKET_BYTES = 25 * 1024 * 1024
"""DDP's default bucket size."""


@dataclass(eq=False)
class _Bucket:
    axes: tuple[AxisGroup, ...]
    params: list[torch.nn.Parameter] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    numel: int = 0
    flat: torch.Tensor | None = None
    arrived: int = 0
    work: object | None = None


class GradBuckets:
    """Gradient buckets of one ParallelModule (see module docstring)."""

    def __init__(
        self,
        params: Sequence[tuple[torch.nn.Parameter, tuple[AxisGroup, ...]]],
        bucket_bytes: int = BUCKET_BYTES,
    ) -> None:
        self.buckets: list[_Bucket] = []
        self._where: dict[int, tuple[_Bucket, int]] = {}
        self._queued = False
        open_by_axes: dict[tuple[int, ...], _Bucket] = {}
        for p, axes in params:
            key = tuple(ax.axis for ax in axes)
            b = open_by_axes.get(key)
            nbytes = p.numel() * p.element_size()
            if (
                b is None
                or (b.params and (b.numel * p.element_size() + nbytes) > bucket_bytes)
                or (b.params and b.params[0].dtype != p.dtype)
            ):
                b = _Bucket(axes=axes)
                self.buckets.append(b)
                open_by_axes[key] = b
            self._where[id(p)] = (b, len(b.params))
            b.params.append(p)
            b.offsets.append(b.numel)
            b.numel += p.numel()
        self._handles = [p.register_hook(self._hook_for(p)) for p, _ in params]

    def _hook_for(self, p: torch.nn.Parameter):
        def hook(grad: torch.Tensor) -> torch.Tensor:
            b, i = self._where[id(p)]
            if b.flat is None:
                b.flat = torch.zeros(b.numel, dtype=grad.dtype, device=grad.device)
            b.flat[b.offsets[i] : b.offsets[i] + grad.numel()].copy_(grad.reshape(-1))
            b.arrived += 1
            if b.arrived == len(b.params):
                self._launch(b)
            if not self._queued:
                self._queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self._finish)
            return torch.zeros_like(grad)

        return hook

    @staticmethod
    def _launch(b: _Bucket) -> None:
        ax = b.axes[0]
        ax.note("all_reduce", "bwd")
        b.work = dist.all_reduce(b.flat, group=ax.group, async_op=True)

    def _finish(self) -> None:
        """End of backward: launch buckets still waiting (unused weights), wait, add into ``.grad``."""
        self._queued = False
        for b in self.buckets:
            if b.arrived == 0:
                continue
            if b.work is None:
                self._launch(b)
        for b in self.buckets:
            if b.arrived == 0:
                continue
            b.work.wait()
            for ax in b.axes[1:]:  # further axes: synchronously, after the first
                ax.note("all_reduce", "bwd")
                dist.all_reduce(b.flat, group=ax.group)
            for p, off in zip(b.params, b.offsets):
                g = b.flat[off : off + p.numel()].view_as(p)
                if p.grad is None:
                    p.grad = g.clone()
                else:
                    p.grad.add_(g)
            b.flat, b.work, b.arrived = None, None, 0

    def remove(self) -> None:
        for h in self._handles:
            h.remove()

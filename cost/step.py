"""One training step on one device, as eager PyTorch runs it: the host issues ops, the device runs
their kernels, memory is allocated and freed as tensors are made and released.

Words:

* **event** — one op as the host issues it (``host`` seconds of Python, dispatcher and autograd
  work) with the device time of the kernels it launches (``device`` seconds); a view launches none.
* **queue** — the host issues events one after another and never waits for the device (no
  synchronisation inside a step); the device runs each event's kernels once they are issued and
  the previous ones are done. So ``device_start[i] = max(device_end[i−1], host_issue[i])`` and the
  step takes ``max(device_end, host_end)``: bound by the device when kernels are long, by the host
  when they are short (the launch-bound regime of small models; Horace He, "Making Deep Learning
  Go Brrrr From First Principles", 2022, "overhead").
* **allocation trace** — the bytes alive after each allocation or release; its maximum is what
  ``torch.cuda.max_memory_allocated`` reports (the caching allocator's rounding to 512-byte blocks
  is ignored).

The graph walk that produces the events and the trace lives in ``autopar.passes.annotate``
(``single_device_step``); this module holds the arithmetic.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["MemoryTrace", "StepEstimate", "eager_time"]


def eager_time(events: Iterable[tuple[float, float]], start: float = 0.0) -> tuple[float, float]:
    """``(device_end, host_end)`` of a queue of ``(host, device)`` events (module docstring),
    starting with both idle at ``start``."""
    host = dev = start
    for h, d in events:
        host += h
        dev = max(dev, host) + d
    return dev, host


class MemoryTrace:
    """Bytes alive on the device as a step allocates and frees them; ``peak`` is their maximum
    (``torch.cuda.max_memory_allocated``) and ``where`` names the allocation that reached it."""

    __slots__ = ("alive", "peak", "where")

    def __init__(self, alive: float = 0.0) -> None:
        self.alive = float(alive)
        self.peak = self.alive
        self.where = "start"

    def alloc(self, nbytes: float, what: str = "") -> None:
        self.alive += nbytes
        if self.alive > self.peak:
            self.peak, self.where = self.alive, what

    def free(self, nbytes: float) -> None:
        self.alive -= nbytes


@dataclass(frozen=True, slots=True)
class StepEstimate:
    """A training step on one device: forward + backward, the optimizer step, peak memory."""

    forward: float
    """Seconds of the forward pass (host and device overlapped as in the queue)."""
    backward: float
    """Seconds of the backward pass after it."""
    optimizer: float
    """Seconds of ``optimizer.step()``."""
    peak_memory: float
    """Bytes: the most alive at once over the step (``torch.cuda.max_memory_allocated``)."""
    peak_at: str
    """Where the peak was reached (``"backward of <node>"``, ``"forward of <node>"``, …)."""
    parameters: float
    """Bytes of parameters (and buffers)."""
    gradients: float
    """Bytes of parameter gradients after backward."""
    optimizer_state: float
    """Bytes of optimizer state (moments, master weights)."""
    activations: float
    """Bytes saved for backward at the end of forward (the loss's included)."""
    kernels: int
    """Kernel launches of forward + backward."""
    device_time: float
    """Seconds the device is busy in forward + backward (the step time if the host kept up)."""
    host_time: float
    """Seconds the host spends issuing forward + backward."""

    @property
    def fwd_bwd(self) -> float:
        """Seconds of forward + backward (``loss.backward()`` returned and synchronised)."""
        return self.forward + self.backward

    @property
    def step_time(self) -> float:
        """Seconds of the whole step: forward, backward and the optimizer."""
        return self.forward + self.backward + self.optimizer

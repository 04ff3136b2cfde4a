"""Activation offload's copies as the per-rank program calls them (``passes.offload_activations``
writes the calls; ``autopar.cost.offload`` prices them).

Words: an activation is **offloaded** when the forward copies it to host memory as soon as it is
made (``to_host``) and backward reads a device copy fetched back (``fetch``, issued a layer ahead)
once it is there (``ready``). The three are separate program nodes so the copies run beside the
compute between them:

* on CUDA each copy runs on a side stream of its device (one per device, made once), into pinned
  host memory and out of it; the caching allocator is told which stream still reads a tensor
  (``record_stream``), and ``ready`` makes the compute stream wait for the fetch's event only where
  the value is first read;
* on a CPU rank (gloo; the tests) host and device are one memory: the copies are plain copies, so
  a program that offloads computes exactly what one that does not computes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Fetched", "OnHost", "fetch", "ready", "to_host"]


@dataclass(frozen=True, slots=True)
class OnHost:
    """A saved activation in host memory: the host tensor, the event its copy out recorded (CUDA;
    ``None`` on a CPU rank) and the device it came from."""

    tensor: torch.Tensor
    event: Any
    device: torch.device


@dataclass(frozen=True, slots=True)
class Fetched:
    """An offloaded activation being copied back: its device tensor and the event that copy
    recorded (``None`` on a CPU rank)."""

    tensor: torch.Tensor
    event: Any


@functools.cache
def _side_stream(index: int) -> Any:
    """The copy stream of CUDA device ``index`` (made once per device and process)."""
    return torch.cuda.Stream(device=index)


def _host_like(x: torch.Tensor, pin: bool) -> torch.Tensor:
    if x.is_non_overlapping_and_dense():
        return torch.empty_strided(x.size(), x.stride(), dtype=x.dtype, device="cpu", pin_memory=pin)
    return torch.empty(x.size(), dtype=x.dtype, device="cpu", pin_memory=pin)


def to_host(x: torch.Tensor) -> OnHost:
    """Start copying ``x`` to host memory (module docstring); the forward goes on meanwhile."""
    if x.device.type != "cuda":
        return OnHost(x.detach().clone(), None, x.device)
    side = _side_stream(x.device.index)
    side.wait_stream(torch.cuda.current_stream(x.device))
    host = _host_like(x, pin=True)
    with torch.cuda.stream(side):
        host.copy_(x.detach(), non_blocking=True)
        event = torch.cuda.Event()
        event.record(side)
    x.record_stream(side)
    return OnHost(host, event, x.device)


def fetch(h: OnHost) -> Fetched:
    """Start copying an offloaded activation back to its device (issued a layer before its use)."""
    if h.event is None:  # a CPU rank: the host copy is the value (nothing reads it after)
        return Fetched(h.tensor, None)
    side = _side_stream(h.device.index)
    with torch.cuda.stream(side):
        side.wait_event(h.event)
        out = torch.empty_strided(h.tensor.size(), h.tensor.stride(), dtype=h.tensor.dtype, device=h.device)
        out.copy_(h.tensor, non_blocking=True)
        event = torch.cuda.Event()
        event.record(side)
    return Fetched(out, event)


def ready(f: Fetched) -> torch.Tensor:
    """The fetched activation, once its copy is done: the compute stream waits for it here."""
    if f.event is None:
        return f.tensor
    current = torch.cuda.current_stream(f.tensor.device)
    current.wait_event(f.event)
    f.tensor.record_stream(current)
    return f.tensor

"""Random ops that can be recomputed: record the generator state before a draw, replay it later.

Activation recomputation (``autopar.passes.recompute``) runs a forward op again in backward. For a
random op (dropout) the second run must draw exactly what the first drew, and must not disturb
the draws of every later random op of the step. As Megatron-LM's full recomputation (its
``CheckpointFunction`` saves and restores the RNG state around the recomputed forward) and
AOTAutograd's functionalized RNG (``torch._prims.rng_prims``: ``run_and_save_rng_state`` /
``run_with_rng_state``) do, the per-rank program then calls two plain functions instead of the op:

* ``run_and_save_rng_state(op, *args, **kwargs) -> (state, out)`` — in forward: the state of the
  generator ``op`` draws from, read just before the draw, and ``op``'s output. One call, so no
  pass can reorder the reading of the state away from the draw.
* ``run_with_rng_state(state, op, *args, **kwargs) -> (state, out)`` — in backward: set the
  generator to ``state``, run ``op`` (the same numbers as in forward), and put the generator
  back to the state it had before the call, so the step's later draws are the ones it would make
  without recomputation. It returns the same pair as the forward call so a copied program can read
  its output the way the forward reads it.

Words: the **generator** of a draw is the one passed as ``generator=`` if any, else the default
generator of the device of the op's tensors (the CPU's, or the current CUDA device's); its
**state** is a CPU byte tensor — the Mersenne Twister's 5056 bytes on a CPU, a Philox seed and
offset (16 bytes) on CUDA — what ``torch.get_rng_state`` / ``torch.cuda.get_rng_state`` return.
The state is what backward keeps in place of a dropout mask: a few kilobytes per op at most,
against a mask of one byte per element of the activation.

``run_and_save_rng_state`` is registered as side-effecting (``torch.fx.node.has_side_effect``):
it advances the generator, so dead-code elimination must keep it even where its outputs go
unused. ``run_with_rng_state`` leaves the generator as it found it and may be removed where unused.
Both are ordinary functions of ``autopar.program``, so a program calling them runs without the
planner (a plan saved as JSON).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.fx
import torch.utils._pytree as pytree

__all__ = ["generator_state", "run_and_save_rng_state", "run_with_rng_state", "set_generator_state"]


def _device_of(args: tuple, kwargs: dict[str, Any]) -> torch.device:
    """The device an op draws on: its ``device=`` argument, else that of its first tensor (CPU when
    it has none)."""
    if kwargs.get("device") is not None:
        return torch.device(kwargs["device"])
    for leaf in pytree.tree_leaves((args, kwargs)):
        if isinstance(leaf, torch.Tensor):
            return leaf.device
    return torch.device("cpu")


def generator_state(args: tuple = (), kwargs: dict[str, Any] | None = None) -> torch.Tensor:
    """The state of the generator a call with ``args``/``kwargs`` draws from (module docstring)."""
    kwargs = kwargs or {}
    gen = kwargs.get("generator")
    if gen is not None:
        return gen.get_state()
    device = _device_of(args, kwargs)
    if device.type == "cpu":
        return torch.get_rng_state()
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    if device.type == "meta":
        return torch.empty(0, dtype=torch.uint8)
    backend = getattr(torch, device.type, None)
    if backend is None or not hasattr(backend, "get_rng_state"):
        raise RuntimeError(
            f"autopar: no random-number generator state for device {device} (a recomputed draw)"
        )
    return backend.get_rng_state(device)


def set_generator_state(state: torch.Tensor, args: tuple = (), kwargs: dict[str, Any] | None = None) -> None:
    """Set the generator a call with ``args``/``kwargs`` draws from to ``state``."""
    kwargs = kwargs or {}
    gen = kwargs.get("generator")
    if gen is not None:
        gen.set_state(state)
        return
    device = _device_of(args, kwargs)
    if device.type == "cpu":
        torch.set_rng_state(state)
    elif device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    elif device.type != "meta":
        getattr(torch, device.type).set_rng_state(state, device)


def run_and_save_rng_state(op: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
    """``(state, op(*args, **kwargs))``: the generator's state just before the draw, and the draw."""
    state = generator_state(args, kwargs)
    return state, op(*args, **kwargs)


def run_with_rng_state(
    state: torch.Tensor, op: Callable[..., Any], *args: Any, **kwargs: Any
) -> tuple[torch.Tensor, Any]:
    """``(state, op(*args, **kwargs))`` drawn from the generator set to ``state``; the generator is
    left as it was before the call."""
    before = generator_state(args, kwargs)
    set_generator_state(state, args, kwargs)
    try:
        out = op(*args, **kwargs)
    finally:
        set_generator_state(before, args, kwargs)
    return state, out


torch.fx.node.has_side_effect(run_and_save_rng_state)

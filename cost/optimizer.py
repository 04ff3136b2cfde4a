"""Time of one ``optimizer.step()``: a memory-bound pass over every parameter and its state, plus
the host's per-tensor bookkeeping.

AdamW reads the weight, its gradient and both moments and writes the weight and the moments back
(Loshchilov and Hutter, arXiv 1711.05101, Algorithm 2); with an fp32 master weight it updates the
master and writes the low-precision weight from it (mixed precision, Micikevicius et al.,
arXiv 1710.03740). PyTorch runs this as

* **fused** (``AdamW(fused=True)``): one kernel per group of tensors, each element read and written
  once: ``grad + 2·moments + (master ? 2·master + weight : 2·weight)`` bytes per parameter;
* **foreach** (the default): ``torch._foreach_*`` passes over whole lists (``_multi_tensor_adam``):
  weight decay (r/w weight), ``lerp`` of the first moment (r m, g, w m), scale and ``addcmul`` of
  the second (r/w v twice, r g), ``sqrt``, ``div`` and ``add`` building the denominator (r v, w d,
  r/w d twice) and ``addcdiv`` into the weight (r w, m, d, w w): ``4·weight + 2·grad + 13·moment``
  bytes per parameter.

SGD with momentum: one pass reading weight, gradient and momentum, writing weight and momentum;
plain SGD reads weight and gradient and writes the weight.

Time: ``bytes / optimizer_bandwidth + tensors · optimizer_overhead`` on the device's figures
(``DeviceSpec.optimizer_bandwidth``: ``memory_bandwidth · optimizer_efficiency``, measured whole
steps: the update reaches less of the bandwidth than a plain elementwise kernel;
``DeviceSpec.optimizer_overhead``: Python's per-tensor work in ``_init_group`` and the step's
bookkeeping, exposed because a step is timed between synchronisations).
"""

from __future__ import annotations

from autopar.cost.memory import OPTIMIZER_MOMENTS
from autopar.devices import DeviceSpec

__all__ = ["optimizer_bytes_per_param", "optimizer_step_time"]


def optimizer_bytes_per_param(
    param_bytes: int,
    *,
    optimizer: str = "adamw",
    state_bytes: int | None = None,
    master_weights: bool = False,
    fused: bool = True,
) -> float:
    """Bytes one parameter element moves in one optimizer step (module docstring)."""
    if optimizer not in OPTIMIZER_MOMENTS:
        raise ValueError(f"unknown optimizer {optimizer!r}; known: {sorted(OPTIMIZER_MOMENTS)}")
    moments = OPTIMIZER_MOMENTS[optimizer]
    s = state_bytes if state_bytes is not None else (4 if master_weights else param_bytes)
    w, g = param_bytes, param_bytes
    if optimizer.startswith("sgd") or fused:
        update = 2 * 4 + w if master_weights else 2 * w  # r/w master and write the weight, or r/w weight
        return g + 2 * moments * s + update
    # foreach AdamW, on the master weight when there is one (then written to the weight)
    master = (2 * 4 + w) if master_weights else 0
    return 4 * (4 if master_weights else w) + 2 * g + 13 * s + master


def optimizer_step_time(
    numel: float,
    tensors: int,
    param_bytes: int,
    device: DeviceSpec,
    *,
    optimizer: str = "adamw",
    state_bytes: int | None = None,
    master_weights: bool = False,
    fused: bool = True,
) -> float:
    """Seconds of one optimizer step over ``numel`` parameter elements in ``tensors`` tensors."""
    per = optimizer_bytes_per_param(
        param_bytes, optimizer=optimizer, state_bytes=state_bytes, master_weights=master_weights, fused=fused
    )
    return numel * per / device.optimizer_bandwidth + tensors * device.optimizer_overhead

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

from dataclasses import dataclass

from autopar.cost.compute import itemsize
from autopar.cost.memory import OPTIMIZER_MOMENTS
from autopar.devices import DeviceSpec

__all__ = ["OptimizerSettings", "optimizer_bytes_per_param", "optimizer_step_time", "plan_settings"]


@dataclass(frozen=True, kw_only=True, slots=True)
class OptimizerSettings:
    """Which optimizer runs and how (module docstring); the defaults are the reference
    measurement's setup (``autopar.reference``)."""

    optimizer: str = "adamw"
    """A key of ``autopar.cost.memory.OPTIMIZER_MOMENTS``."""
    fused: bool = True
    """``AdamW(fused=True)``; ``False``: the foreach implementation."""
    master_weights: bool = False
    """An fp32 master copy of low-precision weights (mixed precision)."""
    state_bytes: int | None = None
    """Bytes per optimizer-moment element; ``None``: ``moment_bytes``' default."""

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZER_MOMENTS:
            raise ValueError(f"unknown optimizer {self.optimizer!r}; known: {sorted(OPTIMIZER_MOMENTS)}")

    def moment_bytes(self, param_bytes: int) -> int:
        """Bytes per element of each optimizer moment: ``state_bytes``, else fp32 (4) with master
        weights and the parameters' own size without (``torch.optim``'s ``zeros_like(param)``)."""
        if self.state_bytes is not None:
            return self.state_bytes
        return 4 if self.master_weights else param_bytes


def plan_settings(optimizer: str, param_bytes: int, state_dtype: str | None = None) -> OptimizerSettings:
    """The settings a plan's step runs with: its optimizer (AdamW where it names one this module
    does not cost), fused, with an fp32 master copy where the parameters are narrower than fp32
    (mixed precision, as ``autopar.runtime`` keeps it) and its moments in ``state_dtype``
    (``PlanConfig.optimizer_state_dtype``; ``None``: ``OptimizerSettings.moment_bytes``' default)."""
    return OptimizerSettings(
        optimizer=optimizer if optimizer in OPTIMIZER_MOMENTS else "adamw",
        master_weights=param_bytes < 4,
        state_bytes=itemsize(state_dtype) if state_dtype else None,
    )


def optimizer_bytes_per_param(param_bytes: int, settings: OptimizerSettings = OptimizerSettings()) -> float:
    """Bytes one parameter element moves in one optimizer step (module docstring)."""
    moments = OPTIMIZER_MOMENTS[settings.optimizer]
    s = settings.moment_bytes(param_bytes)
    w, g = param_bytes, param_bytes
    if settings.optimizer.startswith("sgd") or settings.fused:
        # r/w master and write the weight, or r/w weight
        update = 2 * 4 + w if settings.master_weights else 2 * w
        return g + 2 * moments * s + update
    # foreach AdamW, on the master weight when there is one (then written to the weight)
    master = (2 * 4 + w) if settings.master_weights else 0
    return 4 * (4 if settings.master_weights else w) + 2 * g + 13 * s + master


def optimizer_step_time(
    numel: float,
    tensors: int,
    param_bytes: int,
    device: DeviceSpec,
    settings: OptimizerSettings = OptimizerSettings(),
) -> float:
    """Seconds of one optimizer step over ``numel`` parameter elements in ``tensors`` tensors."""
    per = optimizer_bytes_per_param(param_bytes, settings)
    return numel * per / device.optimizer_bandwidth + tensors * device.optimizer_overhead

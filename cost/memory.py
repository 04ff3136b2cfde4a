"""Memory of training state per device.

Mixed-precision AdamW keeps, per parameter, the fp16/bf16 weight (2 bytes) and gradient (2 bytes)
plus fp32 master weight, first and second moments (12 bytes): 16 bytes per parameter, the
accounting of the ZeRO paper (Rajbhandari et al., arXiv 1910.02054, §3.1). In fp32 training the
weight, gradient and the two moments take 4 bytes each: 16 bytes as well, with no master copy.

ZeRO stages shard parts of this state across the data-parallel devices: stage 1 the optimizer
state, stage 2 also the gradients, stage 3 also the parameters.
"""

from __future__ import annotations

__all__ = ["OPTIMIZER_BYTES_PER_PARAM", "training_state_bytes"]

OPTIMIZER_BYTES_PER_PARAM = {"adamw": 8, "adam": 8, "sgd": 0, "sgd_momentum": 4}
"""Optimizer state in fp32 per parameter (not counting an fp32 master copy)."""


def training_state_bytes(
    numel: float,
    param_bytes: int,
    *,
    optimizer: str = "adamw",
    mixed_precision: bool = False,
    param_shards: int = 1,
    grad_shards: int = 1,
    optimizer_shards: int = 1,
) -> float:
    """Bytes one device holds for ``numel`` parameter elements.

    ``*_shards``: how many ways each part of the state is split (tensor-parallel sharding times the
    ZeRO sharding of that part). Mixed precision adds the fp32 master weight to the optimizer part.
    """
    if optimizer not in OPTIMIZER_BYTES_PER_PARAM:
        raise ValueError(f"unknown optimizer {optimizer!r}; known: {sorted(OPTIMIZER_BYTES_PER_PARAM)}")
    opt = OPTIMIZER_BYTES_PER_PARAM[optimizer] + (4 if mixed_precision else 0)
    return numel * (param_bytes / param_shards + param_bytes / grad_shards + opt / optimizer_shards)

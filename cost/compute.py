"""Compute time of one op on one device: the roofline model.

``time = max(FLOPs / (peak(dtype) · e_c), bytes / (bandwidth · e_m))`` (Williams, Waterman and
Patterson, "Roofline", CACM 2009) with efficiency factors ``e_c``, ``e_m`` from the DeviceSpec.

FLOPs (``op_flops``): 2·m·n·k per matmul (2 FLOPs per multiply-add), 4·b·h·s_q·s_k·d for
attention (the two matmuls QKᵀ and PV), 2·out·(c_in/groups)·kernel for convolution; everything else
one FLOP per output element (elementwise work is memory-bound and the roofline's byte term
dominates).
Backward FLOPs: 2× forward for matmul-like ops (one matmul for each input's gradient, Kaplan et
al. 2020 / Narayanan et al. 2021's 3× rule for a whole step), 2.5× for attention (the
FlashAttention paper's accounting), 1× otherwise; ops without gradients cost nothing backward.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from autopar.cluster import DeviceSpec
from autopar.graph import OpFamily, op_info

__all__ = ["BACKWARD_FLOP_RATIO", "op_flops", "roofline_time"]

BACKWARD_FLOP_RATIO = {"matmul": 2.0, "attention": 2.5, "other": 1.0}


def roofline_time(flops: float, nbytes: float, device: DeviceSpec, dtype: str = "float32") -> float:
    """Seconds for ``flops`` FLOPs that move ``nbytes`` bytes on ``device``."""
    compute = flops / (device.flops_for(dtype) * device.compute_efficiency)
    memory = nbytes / (device.memory_bandwidth * device.memory_efficiency)
    return max(compute, memory)


def op_flops(
    op: str, in_shapes: Sequence[Sequence[int]], out_shape: Sequence[int], groups: int = 1
) -> tuple[float, str]:
    """Forward FLOPs of aten op ``op`` (packet name) and its family (a ``BACKWARD_FLOP_RATIO`` key).

    ``in_shapes`` lists the op's tensor arguments in call order.
    """
    out_numel = float(math.prod(out_shape)) if out_shape else 1.0
    family = op_info(op).family
    if family is OpFamily.MATMUL:
        if op in ("addmm", "baddbmm"):
            a = in_shapes[1]
        else:
            a = in_shapes[0]
        k = a[-1] if a else 1
        return 2.0 * out_numel * k, "matmul"
    if family is OpFamily.ATTENTION:
        q, k = in_shapes[0], in_shapes[1]
        batch = math.prod(q[:-2])
        return 4.0 * batch * q[-2] * k[-2] * q[-1], "attention"
    if family is OpFamily.CONV and len(in_shapes) > 1:
        w = in_shapes[1]
        return 2.0 * out_numel * math.prod(w[1:]), "matmul"
    return out_numel, "other"

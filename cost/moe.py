"""Cost of expert parallelism's all-to-alls on one mesh axis.

A grouped matmul that runs over its device's experts (mode ``E`` of ``autopar.rules.routing``)
exchanges rows with the other devices of its axis (Megatron-LM's ``MoEAlltoAllTokenDispatcher``;
DeepSpeed-MoE, Rajbhandari et al., ICML 2022, §5; GShard, Lepikhin et al. 2020):

* **dispatch** (before the first grouped matmul): one all-to-all of the per-expert counts
  (``n·E_l`` int64 per device: the counts are exchanged first, so the rows' all-to-all is
  dropless), then one of the rows, ``S_l·K`` elements per device; its backward is the reverse
  all-to-all of the rows' gradient;
* **combine** (after the last one): one all-to-all of the output rows, ``S_l·N`` elements per
  device; its backward is the reverse all-to-all of the gradient.

Each all-to-all is ``autopar.cost.comm.all_to_all_cost`` (``(n−1)`` steps of α, ``(n−1)/n`` of the
buffer per device) on the axis's link (``Mesh.all_to_all_cost``). The row volumes assume routing
balanced over the experts — every device sends and receives its share ``S_l`` — which is what an
auxiliary load-balancing loss aims for; a skewed router makes the busiest device slower.
"""

from __future__ import annotations

from autopar.mesh import Mesh

__all__ = ["expert_all_to_all_cost"]

COUNT_BYTES = 8
"""One int64 count per (device, expert) pair."""


def expert_all_to_all_cost(
    mesh: Mesh,
    axis: int,
    *,
    rows_in_bytes: float,
    rows_out_bytes: float,
    dispatch: bool,
    combine: bool,
    num_experts: int,
    requires_grad: bool = True,
) -> float:
    """Forward (and, ``requires_grad``, backward) seconds of a grouped matmul's dispatch and/or
    combine along ``axis``: ``rows_in_bytes`` is this device's input rows (before dispatch),
    ``rows_out_bytes`` its output rows (after combine)."""
    both = 2.0 if requires_grad else 1.0
    t = 0.0
    if dispatch:
        t += mesh.all_to_all_cost(float(COUNT_BYTES * num_experts), axis)
        t += both * mesh.all_to_all_cost(rows_in_bytes, axis)
    if combine:
        t += both * mesh.all_to_all_cost(rows_out_bytes, axis)
    return t

"""The collectives of a synchronized batch norm (``autopar.ir.Rewrite.SYNC_BATCH_NORM``).

A training batch norm whose rows (batch or spatial positions) are split along a mesh axis needs
the statistics of all of them. Each device gathers every device's per-channel count, mean and sum
of squared deviations — three fp32 numbers per channel — and merges them (Chan, Golub and LeVeque,
"Updating formulae and a pairwise algorithm for computing sample variances", 1979), as
``torch.nn.SyncBatchNorm`` does (``torch/nn/modules/_functions.py``: an all-gather of mean,
inverse standard deviation and count forward). The statistics' gradient is partial on each device
(each normalizes only its own rows), so the gather's backward is a reduce-scatter of the same
buffer (``autopar.program.collectives.all_gather`` with ``grad_partial``) where SyncBatchNorm
all-reduces two numbers per channel; both are latency-bound at any channel count models use.

Where rows are split along several axes the gathers run one after another, the buffer growing
by each axis's size (``before``: the devices already gathered).
"""

from __future__ import annotations

from autopar.mesh import Mesh

__all__ = ["STAT_BYTES", "sync_batch_norm_cost"]

STAT_BYTES = 3 * 4
"""Bytes gathered per channel and device: count, mean and M2 in fp32."""


def sync_batch_norm_cost(
    mesh: Mesh, axis: int, channels: int, *, before: int = 1, requires_grad: bool = True
) -> float:
    """Forward (and, ``requires_grad``, backward) seconds of one synchronized batch norm's
    statistics along ``axis``, after gathers over ``before`` devices on earlier axes."""
    nbytes = float(STAT_BYTES * channels * before * mesh.shape[axis])
    t = mesh.all_gather_cost(nbytes, axis)
    if requires_grad:
        t += mesh.reduce_scatter_cost(nbytes, axis)
    return t

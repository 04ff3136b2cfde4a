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

The gather's latency grows with the devices, ``(n − 1)·α`` on NCCL's ring (all-gathers have no
tree): over 256 GPUs on 32 nodes, ResNet-50's 53 batch norms spent 271 ms a step in it. The
other form (``sync_batch_norm_reduce_cost``) all-reduces the per-channel count and sum, then the
squared deviations from the global mean — two passes over the rows, the exact two-pass variance
— each an all-reduce, which NCCL runs as a double binary tree across nodes (``2·log₂ nodes``
latencies; ``autopar.cost.comm.group_all_reduce_cost``); backward, the two sums' gradients are
all-reduced alike. Inside one node the gather is cheaper; the solver takes whichever is.
"""

from __future__ import annotations

from autopar.mesh import Mesh

__all__ = ["STAT_BYTES", "sync_batch_norm_cost", "sync_batch_norm_reduce_cost"]

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


def sync_batch_norm_reduce_cost(mesh: Mesh, axis: int, channels: int, *, requires_grad: bool = True) -> float:
    """Forward (and, ``requires_grad``, backward) seconds of one synchronized batch norm's
    statistics along ``axis`` in two all-reduces: count and sums (``channels + 1`` fp32), then
    squared deviations (``channels`` fp32)."""
    t = mesh.all_reduce_cost(4.0 * (channels + 1), axis) + mesh.all_reduce_cost(4.0 * channels, axis)
    return 2 * t if requires_grad else t

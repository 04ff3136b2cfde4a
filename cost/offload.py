"""Optimizer offload: the optimizer state and master weights kept in host memory, the step run by
the host's CPU (ZeRO-Offload: Ren et al., "ZeRO-Offload: Democratizing Billion-Scale Model
Training", USENIX ATC'21, arXiv 2101.06840, §4).

Words: a device's **shard** is the parameter elements whose optimizer state it owns (all of its
parameters, or ``1/N`` of them under ZeRO over ``N`` data-parallel devices, as ZeRO-Offload
partitions them); the **host link** is the device's PCIe link to host memory
(``autopar.devices.HostSpec.link``).

**Memory.** The device keeps the low-precision weight and its gradient; the host keeps, per shard
element, the optimizer's moments, an fp32 master weight (mixed precision) and an fp32 copy of the
gradient the CPU step reads (ZeRO-Offload §4.1, Fig. 3: "fp32 parameters, gradients and optimizer
states on the CPU"). With AdamW in mixed precision: ``2 + 2`` bytes per element on the device,
``4 + 4 + 4 + 4 = 16`` on the host, plus a 2-byte staging buffer the copies go through
(``host_bytes_per_param``).

**Time** of one step, in three phases one after the other (``offload_step_time``):

1. the shard's gradients copied device → host: ``numel · param_bytes / link.bandwidth``;
2. the optimizer step on the host: a memory-bound pass over the shard, the same bytes per element
   as the fused step on a device (``autopar.cost.optimizer.optimizer_bytes_per_param``: read the
   gradient and the moments, read and write the master, write the low-precision weight), at the
   device's share of the host's bandwidth (``HostSpec.optimizer_bandwidth``: every device of a
   node updates its shard at once on the node's DRAM), plus the fp32 gradient written from the
   copied one (``4`` bytes);
3. the updated low-precision weights copied host → device: ``numel · param_bytes / link.bandwidth``.

**Activation offload** (``Plan.offload_layers``; vDNN, Rhu et al., MICRO'16, arXiv 1602.08124;
Megatron-Core's ``--cpu-offloading-num-layers`` through Transformer Engine): the saved activations
of the first ``k`` repeated layers are copied to host memory as the forward makes them, and back,
one layer ahead, before their backward needs them. The device's peak is where the backward
begins, every activation made: the offloaded layers' are on the host then but for the last one's,
whose copy may still run (``ACTIVATION_WINDOW`` = 1 layer counted; each offloaded value is charged
``1/k`` of its bytes). In the backward, an offloaded layer and the one fetched ahead of it are on
the device while every later layer's activations are already freed: under that peak where at
least two layers keep theirs. The copies of a micro-batch run on the host link beside its
forward (out) and its backward (in), a stream of their own, so a pass is longer only by what does
not fit under its compute (``activation_offload_exposed``: ``max(0, α + bytes / β − compute)``,
the pass's compute as one span: the offloaded layers are the first, their copies overlap the
layers after them). The host keeps the bytes of the micro-batches in flight.

Each copy pays the link's latency once per tensor. DeepSpeed overlaps parts of this — gradients
copied while the backward still runs, the step pipelined over sub-groups of parameters, and the
one-step delayed parameter update (§4.2) that hides the CPU step behind the next forward — and
autopar's runtime (``autopar.runtime.host_optimizer``) does not: the three phases run in turn after the
gradients are reduced, as this module charges them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from autopar.cost.memory import OPTIMIZER_MOMENTS
from autopar.cost.optimizer import OptimizerSettings, optimizer_bytes_per_param
from autopar.devices import HostSpec, Link

if TYPE_CHECKING:
    from autopar.cluster import Cluster

_DEFAULT = OptimizerSettings()

__all__ = [
    "ACTIVATION_WINDOW",
    "OffloadTime",
    "activation_offload_exposed",
    "host_bytes_per_param",
    "host_of",
    "offload_step_time",
]


@dataclass(frozen=True, slots=True)
class OffloadTime:
    """One offloaded optimizer step, by phase (module docstring), in seconds."""

    to_host: float
    """The gradients copied device → host."""
    step: float
    """The optimizer step on the host."""
    to_device: float
    """The updated weights copied host → device."""

    @property
    def total(self) -> float:
        return self.to_host + self.step + self.to_device


ACTIVATION_WINDOW = 1
"""Offloaded layers' worth of saved activations counted on the device at the step's peak (module
docstring): the last offloaded layer's, whose copy out may still run when the forward ends."""


def activation_offload_exposed(nbytes: float, compute: float, link: Link) -> float:
    """Seconds one micro-batch's activation copies in one direction — ``nbytes`` over the host
    ``link`` — add to the ``compute`` seconds of the pass they run beside (module docstring):
    what does not fit under it."""
    if nbytes <= 0:
        return 0.0
    return max(0.0, link.latency + nbytes / link.bandwidth - compute)


def host_of(cluster: Cluster) -> HostSpec:
    """``cluster``'s host; ``ValueError`` saying what to give where it is not described."""
    if cluster.host is None:
        raise ValueError(
            "optimizer offload needs the cluster's host (its memory, DRAM bandwidth and PCIe link): "
            "give Cluster(host=autopar.devices.HostSpec(...)), or use a preset (Cluster.preset), whose "
            "DGX hosts are described; or plan with offload_optimizer=False"
        )
    return cluster.host


def host_bytes_per_param(param_bytes: int, settings: OptimizerSettings) -> float:
    """Host bytes per shard element (module docstring): the moments, an fp32 master weight, an
    fp32 gradient, and, for weights narrower than fp32, a staging buffer of their own dtype the
    copies go through (``autopar.runtime.host_optimizer``: the link carries the narrow bytes)."""
    moments = OPTIMIZER_MOMENTS[settings.optimizer] * settings.moment_bytes(param_bytes)
    return moments + 4 + 4 + (param_bytes if param_bytes != 4 else 0)


def offload_step_time(
    numel: float,
    tensors: int,
    param_bytes: int,
    host: HostSpec,
    devices_per_node: int,
    settings: OptimizerSettings = _DEFAULT,
) -> OffloadTime:
    """One optimizer step of a device whose shard has ``numel`` elements in ``tensors`` tensors of
    ``param_bytes`` bytes each, offloaded to ``host`` shared by ``devices_per_node`` devices."""
    link = host.link
    copy = numel * param_bytes / link.bandwidth + tensors * link.latency
    # the host step: the fused update's bytes on the fp32 master, plus the fp32 gradient written
    host_settings = OptimizerSettings(
        optimizer=settings.optimizer, fused=True, master_weights=True, state_bytes=settings.state_bytes
    )
    per = optimizer_bytes_per_param(param_bytes, host_settings) + 4
    step = numel * per / host.optimizer_bandwidth(devices_per_node)
    return OffloadTime(to_host=copy, step=step, to_device=copy)

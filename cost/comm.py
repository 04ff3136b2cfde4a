"""α-β costs of collectives: on one link, and on a device group that spans nodes as NCCL runs it.

**One link.** A collective over ``n`` devices of a ring on a link with latency α and per-device
bandwidth B costs ``steps·α + volume/B``, with the volumes of NCCL's performance notes
(``nccl-tests/doc/PERFORMANCE.md``, "bus bandwidth"): for a buffer of ``S`` bytes

* all-reduce:      2(n−1) steps, 2(n−1)/n · S bytes per device  (S = the full buffer)
* all-gather:       (n−1) steps,  (n−1)/n · S                    (S = the gathered output)
* reduce-scatter:   (n−1) steps,  (n−1)/n · S                    (S = the full input)
* all-to-all:       (n−1) steps,  (n−1)/n · S                    (S = one device's buffer)
* point-to-point:       1 step,          S

With ``n == 1`` every collective is free. A link with measured costs (``Link.measured``, e.g. gloo
on this machine, whose reduce-scatter is an all-reduce plus a local chunk and so is not ring
shaped) uses ``α + β·S`` from the measurement instead of the formula.

**A group across nodes** (:class:`Group`: ``per_node`` devices on each of ``nodes`` nodes, each
node with ``nics`` network cards). NCCL runs its rings and trees over several channels at once and
gives every GPU the NIC nearest to it (DGX systems carry one NIC per GPU), so a node's share of the
traffic leaves through ``min(per_node, nics)`` NICs in parallel while each GPU still forwards its
own share over NVLink. The other groups of the same mesh axes on the node (``sharing`` of them:
the node's devices in the mesh over ``per_node``) run the same collective at the same time — every
tensor-parallel rank reduces its data-parallel gradient together — so they share the node's NICs:
a group gets ``nic_share = min(per_node, nics / sharing)`` of them. With a NIC per GPU (DGX) that
is ``per_node``, as before; with one 400 Gb/s NIC per node (a cloud instance) and eight
single-member groups per node, an eighth. For the ring volumes above, the busiest resource is
either a GPU's NVLink (carrying the whole per-device volume) or a node's NICs (carrying the same
volume between them):

    bus bandwidth = min(B_intra, nic_share · B_nic)        (nodes > 1)

(NCCL, "Massively Scale Your Deep Learning Training with NCCL 2.4", NVIDIA blog 2019; the
nccl-tests bus-bandwidth notes above: a 2-node DGX A100 all-reduce reaches close to 8 × 25 GB/s).
An all-to-all sends ``(n − per_node)/n · S`` of each device's buffer off-node and shares the
node's NICs among its ``per_node`` devices: per-device bandwidth ``nic_share/per_node · B_nic``. Latency: rings pay one step per device on the slowest hop (``(n−1)·α_inter`` across
nodes); NCCL's all-reduce across nodes uses double binary trees (Sanders, Speck and Träff,
Parallel Computing 2009), ``2(per_node−1)·α_intra + 2⌈log₂ nodes⌉·α_inter``, whichever is less.

A gradient reduced over two mesh axes at once (data parallelism on ``dp × sp``) is one collective
over the product group, not two all-reduces one after the other (``autopar.mesh.Mesh`` builds the
group of any set of axes).

**Two-level all-reduce** (:func:`two_level_all_reduce_cost`; Jia et al., "Highly Scalable Deep
Learning Training System with Mixed-Precision", arXiv 1807.11205, §3.3 "hierarchical all-reduce";
Horovod's ``HOROVOD_HIERARCHICAL_ALLREDUCE``; Cho et al., "BlueConnect", SysML 2019). A group of
``p = per_node`` devices on each of ``N`` nodes reduces ``S`` bytes in three collectives one after
another: a reduce-scatter inside each node (``(p−1)/p · S`` per device over NVLink), an all-reduce
across the nodes of each device's ``S/p`` piece — ``p`` groups of one device per node, which share
the node's NICs with each other and with the ``sharing`` groups beside them — and an all-gather
inside each node. A node then sends ``2(N−1)/N · S`` over its NICs where the one ring over all
``n = p·N`` members sends ``2(n−1)/n · S``: with two nodes half as much, for the price of the two
on-node collectives. That pays where the NICs are much slower than NVLink and few nodes take part
(one 400 Gb/s NIC per node of eight GPUs on two nodes: 1.6×); on a DGX, whose eight NICs match
NVLink, the one ring is faster. :func:`two_level_pays` compares the two bandwidth terms — a
bucketed gradient pays no per-message latency, so the answer does not depend on the buffer's size
— and the plan runs the two-level form on the groups where it pays (``Plan.two_level``;
``autopar.passes.two_level``).

**Two-level reduce-scatter and all-gather** (:func:`two_level_reduce_scatter_cost`,
:func:`two_level_all_gather_cost`; Jia et al.'s hierarchy applied to the two halves of the
all-reduce, as ZeRO++ reduces gradients on the node before across the nodes: Wang et al., arXiv
2306.10209, "qgZ"). The pieces are first reordered so
that the members at one place on every node hold neighbouring pieces (a copy of the buffer on the
device); a reduce-scatter inside each node then leaves each member the node's sum of its place's
pieces, ``S/p`` of them, and a reduce-scatter across the nodes of those ``S/p`` bytes the whole
sum of its own piece — the same piece the one collective gives it. The all-gather runs the other
way round (across, then inside, then the copy back). The bytes each node sends over its NICs fall
as for the all-reduce, ``(N−1)/N · S/p`` per member in place of ``(n−1)/n · S``, so the form pays
on the same groups (``two_level_pays``); a plan that runs a group's gradient reductions in two
levels runs its reduce-scatters and all-gathers so too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from autopar.devices import Link

__all__ = [
    "Group",
    "all_gather_cost",
    "all_reduce_cost",
    "all_to_all_cost",
    "bandwidth_only",
    "gradient_all_reduce_cost",
    "group_all_gather_cost",
    "group_all_reduce_cost",
    "group_all_to_all_cost",
    "group_reduce_scatter_cost",
    "p2p_cost",
    "reduce_scatter_cost",
    "two_level_all_gather_cost",
    "two_level_all_reduce_cost",
    "two_level_pays",
    "two_level_reduce_scatter_cost",
]


def bandwidth_only(link: Link) -> Link:
    """``link`` with no per-message latency (measured α zeroed too): the share of a collective
    fused into a larger one (a gradient bucket) pays bandwidth only."""
    return replace(link, latency=0.0, measured=tuple((c, m, 0.0, b) for c, m, _, b in link.measured))


def _ring(collective: str, nbytes: float, n: int, link: Link, steps: int, volume: float) -> float:
    if n <= 1 or nbytes <= 0:
        return 0.0
    m = link.measured_cost(collective, n)
    if m is not None:
        return m[0] + m[1] * nbytes
    return steps * link.latency + volume * nbytes / link.bandwidth


def all_reduce_cost(nbytes: float, n: int, link: Link) -> float:
    """Ring all-reduce of an ``nbytes`` buffer over ``n`` devices."""
    return _ring("all_reduce", nbytes, n, link, 2 * (n - 1), 2 * (n - 1) / max(n, 1))


def all_gather_cost(nbytes: float, n: int, link: Link) -> float:
    """All-gather producing an ``nbytes`` buffer (each device contributes ``nbytes / n``)."""
    return _ring("all_gather", nbytes, n, link, n - 1, (n - 1) / max(n, 1))


def reduce_scatter_cost(nbytes: float, n: int, link: Link) -> float:
    """Reduce-scatter of an ``nbytes`` input (each device keeps ``nbytes / n``)."""
    return _ring("reduce_scatter", nbytes, n, link, n - 1, (n - 1) / max(n, 1))


def all_to_all_cost(nbytes: float, n: int, link: Link) -> float:
    """All-to-all where each device holds ``nbytes`` and keeps ``1/n`` of it."""
    return _ring("all_to_all", nbytes, n, link, n - 1, (n - 1) / max(n, 1))


def p2p_cost(nbytes: float, link: Link) -> float:
    """One send/recv of ``nbytes``."""
    if nbytes <= 0:
        return 0.0
    return link.latency + nbytes / link.bandwidth


@dataclass(frozen=True, slots=True)
class Group:
    """The devices a collective runs over: ``per_node`` devices on each of ``nodes`` nodes."""

    per_node: int
    nodes: int
    intra: Link
    """The link between devices of one node (NVLink)."""
    inter: Link
    """One NIC between nodes."""
    nics: int
    """NICs per node."""
    sharing: int = 1
    """Groups of the same mesh axes on one node, running the same collective at once (SPMD: every
    tensor-parallel rank all-reduces its data-parallel gradient together): they share the node's
    NICs (module docstring)."""

    def __post_init__(self) -> None:
        if self.per_node < 1 or self.nodes < 1 or self.nics < 1 or self.sharing < 1:
            raise ValueError(f"Group needs per_node, nodes, nics and sharing >= 1, got {self}")

    @property
    def nic_share(self) -> float:
        """NICs of a node this group's traffic leaves through: its members' own NICs, as many as it
        has members there, at most the node's NICs shared evenly among its ``sharing`` groups."""
        return min(float(self.per_node), self.nics / self.sharing)

    @property
    def size(self) -> int:
        return self.per_node * self.nodes

    @property
    def bus_bandwidth(self) -> float:
        """Bytes/s of the ring volume per device (see module docstring)."""
        if self.nodes == 1:
            return self.intra.bandwidth
        nic = self.nic_share * self.inter.bandwidth
        return nic if self.per_node == 1 else min(self.intra.bandwidth, nic)

    @property
    def all_to_all_bandwidth(self) -> float:
        """Bytes/s per device of the off-node part of an all-to-all."""
        if self.nodes == 1:
            return self.intra.bandwidth
        return self.nic_share / self.per_node * self.inter.bandwidth

    def ring_latency(self, steps_per_device: int) -> float:
        """Latency of a ring with ``steps_per_device · (n − 1)`` steps, each on the slowest hop."""
        link = self.intra if self.nodes == 1 else self.inter
        return steps_per_device * (self.size - 1) * link.latency

    def tree_latency(self) -> float:
        """All-reduce latency of NCCL's double binary tree across nodes, chains inside them."""
        return (
            2 * (self.per_node - 1) * self.intra.latency
            + 2 * math.ceil(math.log2(self.nodes)) * self.inter.latency
        )

    def measured(self, collective: str) -> tuple[float, float] | None:
        """``(α, β)`` measured for ``collective`` over this group (single-node groups only)."""
        return self.intra.measured_cost(collective, self.size) if self.nodes == 1 else None

    def without_latency(self) -> Group:
        """The group with no per-message latency (a share of a bucketed collective)."""
        return replace(self, intra=bandwidth_only(self.intra), inter=bandwidth_only(self.inter))


def _group(collective: str, nbytes: float, g: Group, volume: float, latency: float, bw: float) -> float:
    if g.size <= 1 or nbytes <= 0:
        return 0.0
    m = g.measured(collective)
    if m is not None:
        return m[0] + m[1] * nbytes
    return latency + volume * nbytes / bw


def group_all_reduce_cost(nbytes: float, g: Group) -> float:
    """All-reduce of an ``nbytes`` buffer over ``g`` (one hierarchical collective)."""
    n = g.size
    lat = g.ring_latency(2) if g.nodes == 1 else min(g.ring_latency(2), g.tree_latency())
    return _group("all_reduce", nbytes, g, 2 * (n - 1) / n, lat, g.bus_bandwidth)


def group_all_gather_cost(nbytes: float, g: Group) -> float:
    """All-gather producing an ``nbytes`` buffer over ``g``."""
    n = g.size
    return _group("all_gather", nbytes, g, (n - 1) / n, g.ring_latency(1), g.bus_bandwidth)


def group_reduce_scatter_cost(nbytes: float, g: Group) -> float:
    """Reduce-scatter of an ``nbytes`` input over ``g``."""
    n = g.size
    return _group("reduce_scatter", nbytes, g, (n - 1) / n, g.ring_latency(1), g.bus_bandwidth)


def group_all_to_all_cost(nbytes: float, g: Group) -> float:
    """All-to-all of ``nbytes`` per device over ``g``: the on-node part over NVLink, the off-node
    part over the node's NICs, both at once (the slower of the two)."""
    n = g.size
    if g.nodes == 1:
        return _group("all_to_all", nbytes, g, (n - 1) / n, g.ring_latency(1), g.intra.bandwidth)
    if g.size <= 1 or nbytes <= 0:
        return 0.0
    on = (g.per_node - 1) / n * nbytes / g.intra.bandwidth
    off = (n - g.per_node) / n * nbytes / g.all_to_all_bandwidth
    return g.ring_latency(1) + max(on, off)


def _two_level_parts(g: Group) -> tuple[Group, Group]:
    """The on-node group (``per_node`` devices on one node) and the across-nodes group (one device
    on each node; ``per_node`` of them per node beside the ``sharing`` groups) of a two-level
    all-reduce over ``g`` (module docstring)."""
    inside = replace(g, nodes=1, sharing=1)
    across = replace(g, per_node=1, sharing=g.sharing * g.per_node)
    return inside, across


def two_level_all_reduce_cost(nbytes: float, g: Group) -> float:
    """All-reduce of ``nbytes`` over ``g`` in two levels (module docstring): reduce-scatter on each
    node, all-reduce of each ``1/per_node`` piece across the nodes, all-gather on each node."""
    if g.size <= 1 or nbytes <= 0:
        return 0.0
    if g.nodes == 1 or g.per_node == 1:
        return group_all_reduce_cost(nbytes, g)
    inside, across = _two_level_parts(g)
    return (
        group_reduce_scatter_cost(nbytes, inside)
        + group_all_reduce_cost(nbytes / g.per_node, across)
        + group_all_gather_cost(nbytes, inside)
    )


def two_level_reduce_scatter_cost(nbytes: float, g: Group) -> float:
    """Reduce-scatter of an ``nbytes`` input over ``g`` in two levels (module docstring): on each
    node over the pieces laid out place-major (each member's ``1/per_node`` share, the pieces of
    the members at its place on every node), then across the nodes of that share. A node sends
    ``(N−1)/N · S/per_node`` per member over its NICs where the one ring sends ``(n−1)/n · S``.
    The reordering before it is a copy on the device (``autopar.mesh.Mesh``)."""
    if g.size <= 1 or nbytes <= 0:
        return 0.0
    if g.nodes == 1 or g.per_node == 1:
        return group_reduce_scatter_cost(nbytes, g)
    inside, across = _two_level_parts(g)
    return group_reduce_scatter_cost(nbytes, inside) + group_reduce_scatter_cost(nbytes / g.per_node, across)


def two_level_all_gather_cost(nbytes: float, g: Group) -> float:
    """All-gather producing an ``nbytes`` buffer over ``g`` in two levels, the reduce-scatter's
    mirror: across the nodes (``nbytes / per_node``), then on each node."""
    if g.size <= 1 or nbytes <= 0:
        return 0.0
    if g.nodes == 1 or g.per_node == 1:
        return group_all_gather_cost(nbytes, g)
    inside, across = _two_level_parts(g)
    return group_all_gather_cost(nbytes / g.per_node, across) + group_all_gather_cost(nbytes, inside)


def two_level_pays(g: Group) -> bool:
    """Whether a bucketed gradient all-reduce over ``g`` is faster in two levels than as one
    collective: a group over several nodes with several members on each, compared without
    per-message latency (module docstring: the answer holds for every buffer size)."""
    if g.nodes == 1 or g.per_node == 1:
        return False
    flat = g.without_latency()
    unit = 1 << 20
    return two_level_all_reduce_cost(unit, flat) < group_all_reduce_cost(unit, flat)


def gradient_all_reduce_cost(nbytes: float, g: Group) -> float:
    """A gradient all-reduce over ``g`` in the faster of its forms: two levels where that pays
    (``two_level_pays``), else one collective (the least a data-parallel reduction costs)."""
    if two_level_pays(g):
        return two_level_all_reduce_cost(nbytes, g)
    return group_all_reduce_cost(nbytes, g)

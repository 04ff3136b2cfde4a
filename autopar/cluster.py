"""The cluster: devices, nodes and the links between them, as a validated dataclass.

A ``Cluster`` is ``nodes`` machines of ``gpus_per_node`` devices each. Devices inside a node
talk over ``intra_node`` (NVLink), devices on different nodes over ``inter_node`` (InfiniBand,
bandwidth per device), and, where the nodes sit in racks of ``nodes_per_rack`` under a spine
oversubscribed ``spine_oversubscription``:1, groups that span racks at that fraction of it. A device mesh laid over the cluster is row-major with its last axis
innermost, so an axis whose devices all sit in one node uses NVLink; ``Cluster.axis_link`` says
which link an axis of a given mesh uses.

A **mixed** cluster (``Cluster.mixed``) has ``node_groups``: consecutive nodes of different device
kinds (four A100 nodes, then four H100 nodes), each group with its own NVLink. Ranks that work in
lockstep (one SPMD program, every rank waiting at each collective) run at the pace of the slowest
of them, so the cluster's own ``device`` and ``intra_node`` are the **floor**: the slowest group's
device (by large-matmul throughput) with the smallest memory of any group, and the slowest NVLink.
What runs apart — a pipeline rank, its own group of devices (``Cluster.part``) — runs on its own.

Presets carry the vendors' published figures (dense tensor-core peaks, HBM bandwidth, NVLink
per-direction bandwidth, one InfiniBand HCA per GPU as in DGX systems). ``Cluster.local`` describes
processes on this machine talking through gloo; its figures are defaults until measured with
``autopar.measure_local`` (gloo's costs are not NCCL-shaped and must be measured).
"""

from __future__ import annotations

import math
import numbers
import os
from dataclasses import dataclass, field, replace
from typing import Any

from autopar.cluster_profile import PROFILE_VERSION, load_profile, local_host
from autopar.devices import (
    GB,
    PRESETS,
    TB,
    DeviceSpec,
    GiB,
    HostSpec,
    Link,
    check_count,
    known_preset,
    link_from_dict,
    link_to_dict,
    node_network,
)
from autopar.mesh_groups import device_groups, members_per_node, mesh_arithmetic
from autopar.node_groups import NodeGroup, floor_device, matmul_rate

__all__ = [
    "PROFILE_VERSION",
    "Cluster",
    "HostSpec",
    "NodeGroup",
    "load_profile",
    "local_host",
    "mesh_arithmetic",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class Cluster:
    """``nodes`` × ``gpus_per_node`` identical devices."""

    device: DeviceSpec
    """The accelerator every rank runs on."""
    gpus_per_node: int
    """Devices per node (sharing the fast ``intra_node`` link)."""
    nodes: int = 1
    """Number of nodes."""
    intra_node: Link
    """Link between devices of one node."""
    inter_node: Link
    """One network interface (NIC) between nodes: its bandwidth per direction and latency."""
    nics_per_node: int | None = None
    """Inter-node NICs per node, used side by side by a collective that spans nodes (NCCL gives
    each GPU the NIC nearest to it); ``None``: one per GPU, as in DGX systems."""
    nodes_per_rack: int | None = None
    """Nodes under one top-of-rack switch; ``None``: every node under one switch (no spine)."""
    spine_oversubscription: float = 1.0
    """How many times more bandwidth a rack's NICs have than its uplinks to the spine (2.0: a 2:1
    oversubscribed fat tree): a collective whose groups span racks sees the inter-node bandwidth
    divided by it (``axis_link``, ``autopar.mesh.Mesh.group``)."""
    backend: str = "nccl"
    """torch.distributed backend the runtime uses on this cluster (``"gloo"`` for ``Cluster.local``)."""
    overlap_comm: bool = True
    """Communication runs beside compute (GPUs: copy engines and NICs of their own); False where it
    takes the compute's own cores — CPU processes filling the machine, gloo's threads and the
    compute sharing them — so the simulator charges a gradient reduction on the compute's time."""
    two_level: bool = True
    """A gradient all-reduce over several nodes may run in two levels — on each node, across the
    nodes, on each node — where that is faster than one collective
    (``autopar.cost.comm.two_level_pays``; ``Plan.two_level``). False: always one collective."""
    extra: dict[str, Any] = field(default_factory=dict, compare=False)
    """Free-form provenance (e.g. how a local profile was measured)."""
    node_groups: tuple[NodeGroup, ...] = ()
    """Where nodes differ (module docstring: mixed): consecutive groups of nodes in rank order,
    each of one device kind; their node counts add up to ``nodes``. Empty: every node is
    ``device``. Where given, ``device`` and ``intra_node`` are the floor (``Cluster.mixed`` sets
    them)."""
    host: HostSpec | None = None
    """Each node's host — CPU memory, its bandwidth, the PCIe link to each device — where optimizer
    state can be offloaded (``PlanConfig.offload_optimizer``, ``autopar.cost.offload``); the
    presets' DGX hosts, ``None``: not described (offload is not planned)."""

    def __post_init__(self) -> None:
        # A count given as a whole float (8.0, from a JSON file) is taken as the int it is.
        arithmetic = (
            f"world size = nodes({self.nodes}) × gpus_per_node({self.gpus_per_node}): a Cluster needs at "
            "least one device and counts whole devices"
        )
        object.__setattr__(
            self,
            "gpus_per_node",
            check_count(
                "Cluster",
                "gpus_per_node",
                self.gpus_per_node,
                fix=f"{arithmetic}; give the number of devices in one node",
            ),
        )
        object.__setattr__(
            self,
            "nodes",
            check_count(
                "Cluster",
                "nodes",
                self.nodes,
                fix=f"{arithmetic}; give the number of machines",
            ),
        )
        if self.nics_per_node is not None:
            object.__setattr__(
                self,
                "nics_per_node",
                check_count(
                    "Cluster",
                    "nics_per_node",
                    self.nics_per_node,
                    fix="give the inter-node NICs per node, or None for one per GPU",
                ),
            )
        if self.nodes_per_rack is not None:
            object.__setattr__(
                self,
                "nodes_per_rack",
                check_count(
                    "Cluster",
                    "nodes_per_rack",
                    self.nodes_per_rack,
                    fix="give the nodes under one top-of-rack switch, or None for a single switch",
                ),
            )
        o = self.spine_oversubscription
        if isinstance(o, bool) or not isinstance(o, numbers.Real) or not math.isfinite(o) or o < 1:
            raise ValueError(
                f"Cluster: spine_oversubscription must be ≥ 1 (rack NIC bandwidth ÷ rack uplink bandwidth; "
                f"1 for a non-blocking network), got {o!r}"
            )
        for what, v, cls in (
            ("device", self.device, DeviceSpec),
            ("intra_node", self.intra_node, Link),
            ("inter_node", self.inter_node, Link),
        ):
            if not isinstance(v, cls):
                raise ValueError(f"Cluster: {what} must be a {cls.__name__}, got {type(v).__name__}")
        if self.host is not None and not isinstance(self.host, HostSpec):
            raise ValueError(f"Cluster: host must be a HostSpec or None, got {type(self.host).__name__}")
        groups = tuple(self.node_groups)
        object.__setattr__(self, "node_groups", groups)
        if groups:
            if not all(isinstance(g, NodeGroup) for g in groups):
                raise ValueError("Cluster: node_groups must be NodeGroup records (Cluster.mixed builds them)")
            held = sum(g.nodes for g in groups)
            if held != self.nodes:
                raise ValueError(
                    f"Cluster: node_groups hold {' + '.join(str(g.nodes) for g in groups)} = {held} nodes but the "
                    f"cluster has nodes={self.nodes}; give every node to exactly one group"
                )
            # Ranks in lockstep are priced on ``device``: it must be the floor (module docstring).
            slowest = min(groups, key=lambda g: matmul_rate(g.device))
            least = min(g.device.memory for g in groups)
            if (
                matmul_rate(self.device) > matmul_rate(slowest.device) * (1 + 1e-9)
                or self.device.memory > least
            ):
                raise ValueError(
                    f"Cluster: device {self.device.name} ({matmul_rate(self.device) / 1e12:g} TFLOP/s, "
                    f"{self.device.memory / 2**30:g} GiB) is not the floor of its node groups (the slowest, "
                    f"{slowest.device.name}, runs {matmul_rate(slowest.device) / 1e12:g} TFLOP/s; the least memory is "
                    f"{least / 2**30:g} GiB): ranks in lockstep would be priced too fast. Build it with Cluster.mixed, "
                    "or give device=autopar.node_groups.floor_device([each group's device])"
                )

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.nodes

    @property
    def mixed_kinds(self) -> bool:
        """Whether the nodes are of more than one device kind (``node_groups``)."""
        return len({g.device.name for g in self.node_groups}) > 1

    @property
    def speed_spread(self) -> float:
        """How many times faster the fastest device kind runs a large matmul than the floor
        ``device`` (1 for one kind): what bounds on a floor-priced plan are loosened by."""
        if not self.node_groups:
            return 1.0
        return max(matmul_rate(g.device) for g in self.node_groups) / matmul_rate(self.device)

    def group_of_rank(self, rank: int) -> NodeGroup:
        """The node group holding global rank ``rank`` (ranks are node-major)."""
        node = rank // self.gpus_per_node
        for g in self.node_groups or (
            NodeGroup(device=self.device, nodes=self.nodes, intra_node=self.intra_node),
        ):
            if node < g.nodes:
                return g
            node -= g.nodes
        raise ValueError(f"rank {rank} is outside the cluster's {self.world_size} devices")

    def part(self, first: int, count: int) -> Cluster:
        """The ``count`` devices from global rank ``first`` on as a uniform cluster of their own:
        one node of ``count`` devices when they fit in one, else whole nodes; their device kind
        (the floor where they span groups: module docstring). ``ValueError`` when they do not
        cut the nodes evenly."""
        gpn = self.gpus_per_node
        if count <= gpn:
            if gpn % count or first // gpn != (first + count - 1) // gpn:
                raise ValueError(f"devices {first}…{first + count - 1} do not lie within one node of {gpn}")
            shape = {"gpus_per_node": count, "nodes": 1}
        else:
            if count % gpn or first % gpn:
                raise ValueError(f"devices {first}…{first + count - 1} are not whole nodes of {gpn}")
            shape = {"nodes": count // gpn}
        if not self.node_groups:
            return replace(self, **shape)
        groups: list[NodeGroup] = []
        for r in range(first, first + count, min(count, gpn)):
            g = self.group_of_rank(r)
            if not any(g is h for h in groups):
                groups.append(g)
        device = floor_device([g.device for g in groups])
        intra = min((g.intra_node for g in groups), key=lambda link: link.bandwidth)
        return replace(self, **shape, device=device, intra_node=intra, node_groups=())

    def pipeline_part(self, pp: int, rank: int) -> Cluster:
        """Pipeline rank ``rank`` of ``pp``'s own devices (the ``world / pp`` ranks from
        ``rank · world / pp`` on, ``part``), or this cluster where its nodes are of one kind."""
        if not self.mixed_kinds:
            return self
        n = self.world_size // pp
        return self.part(rank * n, n)

    def replicas(self, n: int) -> list[Cluster] | None:
        """The cluster cut into ``n`` runs of consecutive ranks (the replicas of a mesh's first
        axis, ``autopar.dp_shares``), each a cluster of its own (``part``: its device kind);
        ``None`` where ``n`` does not cut it into equal runs of whole nodes or parts of one."""
        if n < 2 or self.world_size % n:
            return None
        size = self.world_size // n
        try:
            return [self.part(j * size, size) for j in range(n)]
        except ValueError:
            return None

    def uniform(self, device: str | DeviceSpec | None = None) -> Cluster:
        """This cluster as if every node were ``device`` (a preset's name, a ``DeviceSpec``; default
        the floor ``device``), with that preset's NVLink where a preset is named."""
        if device is None:
            return replace(self, node_groups=())
        if isinstance(device, str):
            pre = known_preset(device)
            return replace(self, device=pre.device, intra_node=pre.intra_node, node_groups=())
        return replace(self, device=device, node_groups=())

    @classmethod
    def mixed(
        cls,
        groups: list[tuple[str | Cluster, int]] | tuple[tuple[str | Cluster, int], ...],
        gpus_per_node: int = 8,
        *,
        network: str | None = None,
        nics_per_node: int | None = None,
        nodes_per_rack: int | None = None,
        spine_oversubscription: float = 1.0,
    ) -> Cluster:
        """Nodes of several device kinds in one job: ``groups`` = ``[(kind, nodes), …]`` in rank
        order (``[("A100-80GB", 4), ("H100-SXM", 4)]``), ``gpus_per_node`` devices a node. A kind is
        a preset's name or a ``Cluster`` of that kind (its device, NVLink and NIC): one measured
        with ``autopar calibrate`` (``Cluster.from_profile``, ``Cluster.preset(profile=…)``). Between
        nodes: ``network`` (``Cluster.preset``'s), else the slowest kind's NIC, one per GPU.
        ``device`` and ``intra_node`` are the floor (module docstring)."""
        if not groups:
            raise ValueError("Cluster.mixed needs at least one (kind, nodes) group")
        made, nics, hosts = [], [], []
        for item in groups:
            if not (isinstance(item, (tuple, list)) and len(item) == 2):
                raise ValueError(
                    f"Cluster.mixed: each group is (preset name or Cluster, nodes), got {item!r}"
                )
            kind, n = item
            if not isinstance(kind, Cluster):
                kind = cls.preset(kind)
            made.append(NodeGroup(device=kind.device, nodes=n, intra_node=kind.intra_node))
            nics.append(kind.inter_node)
            if kind.host is not None:
                hosts.append(kind.host)
        slowest = min(nics, key=lambda link: link.bandwidth)
        inter, nics_per_node = node_network(network, slowest, nics_per_node)
        return cls(
            device=floor_device([g.device for g in made]),
            gpus_per_node=gpus_per_node,
            nodes=sum(g.nodes for g in made),
            intra_node=min((g.intra_node for g in made), key=lambda link: link.bandwidth),
            inter_node=inter,
            nics_per_node=nics_per_node,
            nodes_per_rack=nodes_per_rack,
            spine_oversubscription=spine_oversubscription,
            node_groups=tuple(made),
            # offload is planned on the slowest host of any group (its smallest memory too)
            host=(
                min(hosts, key=lambda h: (h.link.bandwidth, h.memory_bandwidth, h.memory))
                if len(hosts) == len(made)
                else None
            ),
        )

    @property
    def nics(self) -> int:
        """Inter-node NICs per node (``nics_per_node``, default one per GPU)."""
        return self.nics_per_node if self.nics_per_node is not None else self.gpus_per_node

    @classmethod
    def preset(
        cls,
        name: str,
        gpus_per_node: int = 8,
        nodes: int = 1,
        *,
        nics_per_node: int | None = None,
        profile: str | os.PathLike[str] | dict[str, Any] | None = None,
        network: str | None = None,
        nodes_per_rack: int | None = None,
        spine_oversubscription: float = 1.0,
    ) -> Cluster:
        """A cluster of a known accelerator: one of ``Cluster.presets()``.

        ``network``: the nodes joined by one of ``autopar.devices.NETWORKS`` (``"ethernet-400g"``:
        one 400 Gb/s NIC per node, a cloud cluster) instead of the preset's InfiniBand, one NIC per
        GPU; ``nics_per_node`` given overrides the network's count. ``nodes_per_rack`` and
        ``spine_oversubscription``: racks under an oversubscribed spine (``Cluster``'s fields).

        ``profile``: a profile written by ``autopar.runtime.calibrate`` (a path or the dict): its
        measured device figures replace the preset's (the datasheet peaks stay unless measured),
        its measured links replace the preset's links.
        """
        fields_ = known_preset(name)._asdict()
        fields_["inter_node"], nics_per_node = node_network(network, fields_["inter_node"], nics_per_node)
        cl = cls(
            **fields_,
            gpus_per_node=gpus_per_node,
            nodes=nodes,
            nics_per_node=nics_per_node,
            nodes_per_rack=nodes_per_rack,
            spine_oversubscription=spine_oversubscription,
        )
        return cl.with_profile(profile) if profile is not None else cl

    @staticmethod
    def presets() -> list[str]:
        return sorted(PRESETS)

    def with_profile(self, profile: str | os.PathLike[str] | dict[str, Any]) -> Cluster:
        """This cluster with the figures a calibration profile measured (see ``preset``)."""
        prof = load_profile(profile)
        dev = prof.get("device", {})
        changes = {k: v for k, v in dev.items() if k not in ("name", "memory")}
        peak = dict(self.device.peak_flops)
        peak.update(changes.pop("peak_flops", {}))
        device = replace(self.device, peak_flops=peak, **changes)
        links = prof.get("links", {})
        intra = link_from_dict(links["intra_node"]) if "intra_node" in links else self.intra_node
        inter = link_from_dict(links["inter_node"]) if "inter_node" in links else self.inter_node
        extra = dict(self.extra)
        extra["profile"] = {k: prof[k] for k in ("source", "measured_on") if k in prof}
        return replace(self, device=device, intra_node=intra, inter_node=inter, extra=extra)

    @classmethod
    def from_profile(
        cls,
        profile: str | os.PathLike[str] | dict[str, Any],
        *,
        gpus_per_node: int | None = None,
        nodes: int = 1,
    ) -> Cluster:
        """A cluster of the machine a profile was measured on (``autopar.runtime.calibrate``): its
        device as measured, its links as measured, ``gpus_per_node`` devices per node (default:
        the number measured)."""
        prof = load_profile(profile)
        device = DeviceSpec.from_dict(prof["device"])
        links = prof.get("links", {})
        if "intra_node" not in links:
            raise ValueError(
                "profile has no measured intra_node link; measure one with autopar.runtime.calibrate"
            )
        intra = link_from_dict(links["intra_node"])
        inter = link_from_dict(links["inter_node"]) if "inter_node" in links else intra
        g = gpus_per_node if gpus_per_node is not None else int(prof.get("devices", 1))
        return cls(
            device=device,
            gpus_per_node=g,
            nodes=nodes,
            intra_node=intra,
            inter_node=inter,
            backend=str(prof.get("backend", "nccl")),
            extra={"profile": {k: prof[k] for k in ("source", "measured_on") if k in prof}},
        )

    @classmethod
    def local(
        cls,
        world_size: int,
        *,
        flops: float = 20e9,
        memory_bandwidth: float = 5e9,
        link_bandwidth: float = 1e9,
        link_latency: float = 60e-6,
        memory: int = 4 * GiB,
        overlap_comm: bool | None = None,
        host: bool = False,
    ) -> Cluster:
        """``world_size`` processes on this machine, talking through gloo over shared memory/loopback.

        The defaults are rough figures for one CPU core; ``autopar.measure_local``
        measures them (matmul throughput, gloo all-reduce α and β) and returns a Cluster built
        with the measured numbers. ``overlap_comm`` (default: when the machine has a spare core for
        each process's gloo thread, ``2 · world_size <= os.cpu_count()``): see ``Cluster``.
        ``host``: describe this machine's memory as the processes' host (``local_host``), so plans
        may offload to it — copies within one memory, which free none of it: for running and
        measuring offload's mechanics, never chosen unasked (without it, ``host`` is ``None``).
        """
        if isinstance(world_size, bool) or not isinstance(world_size, numbers.Integral) or world_size < 1:
            raise ValueError(
                f"Cluster.local needs world_size >= 1 (a whole number of processes), got {world_size!r}"
            )
        if overlap_comm is None:
            overlap_comm = 2 * world_size <= (os.cpu_count() or 1)
        dev = DeviceSpec(
            name="cpu-process",
            peak_flops={"float32": flops, "bfloat16": flops / 4, "float16": flops / 4},
            memory_bandwidth=memory_bandwidth,
            memory=memory,
            compute_efficiency=1.0,
            memory_efficiency=1.0,
        )
        link = Link(name="gloo", bandwidth=link_bandwidth, latency=link_latency)
        return cls(
            device=dev,
            gpus_per_node=world_size,
            nodes=1,
            intra_node=link,
            inter_node=link,
            backend="gloo",
            overlap_comm=overlap_comm,
            host=local_host(dev, world_size) if host else None,
        )

    def with_device(self, **changes: Any) -> Cluster:
        return replace(self, device=replace(self.device, **changes))

    def validate_mesh(self, mesh_shape: tuple[int, ...]) -> None:
        """Raise ``ValueError`` with the arithmetic when ``mesh_shape`` does not cover the cluster."""
        if any(isinstance(n, bool) or not isinstance(n, numbers.Integral) for n in mesh_shape):
            raise ValueError(f"mesh_shape {mesh_shape} must be whole numbers of devices per axis")
        if any(n < 1 for n in mesh_shape):
            raise ValueError(f"mesh_shape {mesh_shape} has an axis smaller than 1")
        total = math.prod(mesh_shape)
        if total != self.world_size:
            raise ValueError(
                f"mesh_shape {mesh_arithmetic(mesh_shape)} ≠ world size {self.world_size} "
                f"({self.nodes} node(s) × {self.gpus_per_node} devices)"
            )

    def group_span(self, mesh_shape: tuple[int, ...], axes: tuple[int, ...]) -> tuple[int, int]:
        """``(devices per node, nodes)`` of the device groups mesh axes ``axes`` form together.

        Devices are numbered row-major over the mesh (laid over the first ranks of the cluster),
        node-major over the cluster. For the groups that span the most nodes, the fewest members
        any of their nodes holds: a collective is as slow as its slowest group, and a node's share
        of the inter-node traffic goes through as many NICs as it has members there.
        """
        groups = device_groups(mesh_shape, axes)
        worst = (len(groups[0]), 1)
        for devices in groups:
            per_node = members_per_node(devices, self.gpus_per_node)
            span = (min(per_node.values()), len(per_node))
            if span[1] > worst[1] or (span[1] == worst[1] and span[0] < worst[0]):
                worst = span
        return worst

    def even_span(self, mesh_shape: tuple[int, ...], axes: tuple[int, ...]) -> bool:
        """Whether every group of mesh axes ``axes`` has the same number of members on each node it
        spans (a two-level collective, ``autopar.cost.comm.two_level_all_reduce_cost``, splits
        each group into one group per node and one group per member's place on its node)."""
        return all(
            len(set(members_per_node(devices, self.gpus_per_node).values())) == 1
            for devices in device_groups(mesh_shape, axes)
        )

    def racks_spanned(self, mesh_shape: tuple[int, ...], axes: tuple[int, ...]) -> int:
        """The most racks any group of mesh axes ``axes`` spans (``nodes_per_rack``; 1 without)."""
        if self.nodes_per_rack is None or not axes:
            return 1
        per_rack = self.gpus_per_node * self.nodes_per_rack
        return max(len({d // per_rack for d in devices}) for devices in device_groups(mesh_shape, axes))

    def network_link(self, mesh_shape: tuple[int, ...], axes: tuple[int, ...]) -> Link:
        """The inter-node NIC as the groups of mesh axes ``axes`` see it: slowed by the spine's
        oversubscription where they span racks."""
        if self.spine_oversubscription == 1 or self.racks_spanned(mesh_shape, axes) <= 1:
            return self.inter_node
        return replace(
            self.inter_node,
            name=f"{self.inter_node.name} via {self.spine_oversubscription:g}:1 spine",
            bandwidth=self.inter_node.bandwidth / self.spine_oversubscription,
        )

    def axis_link(self, mesh_shape: tuple[int, ...], axis: int) -> Link:
        """The link that mesh axis ``axis`` uses: NVLink when all its devices share a node, else
        the inter-node NIC (``autopar.mesh.Mesh`` costs collectives over several NICs at once)."""
        if self.group_span(mesh_shape, (axis,))[1] == 1:
            return self.intra_node
        return self.network_link(mesh_shape, (axis,))

    def describe(self) -> str:
        d = self.device
        if self.node_groups:
            kinds = " + ".join(f"{g.nodes} × {self.gpus_per_node} {g.device.name}" for g in self.node_groups)
            return (
                f"{kinds} nodes (in lockstep: {d.name}, {d.memory / GiB:.0f} GiB; "
                f"{self.nics} × {self.inter_node.name} {self.inter_node.bandwidth / GB:.1f} GB/s per node)"
            )
        if self.backend == "gloo":
            return (
                f"{self.world_size} local processes ({d.flops_for('float32') / 1e9:.0f} GFLOP/s fp32 each, "
                f"{self.intra_node.name} {self.intra_node.bandwidth / GB:.1f} GB/s)"
            )
        return (
            f"{self.nodes} node(s) × {self.gpus_per_node} {d.name} "
            f"({d.flops_for('bfloat16') / TB:.0f} TFLOP/s bf16, {d.memory / GiB:.0f} GiB, "
            f"{self.intra_node.name} {self.intra_node.bandwidth / GB:.0f} GB/s, "
            f"{self.nics} × {self.inter_node.name} {self.inter_node.bandwidth / GB:.1f} GB/s per node"
            + (
                f"; {self.nodes_per_rack} nodes a rack, {self.spine_oversubscription:g}:1 spine"
                if self.nodes_per_rack is not None and self.nodes_per_rack < self.nodes
                else ""
            )
            + ")"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "device": self.device.to_dict(),
            "gpus_per_node": self.gpus_per_node,
            "nodes": self.nodes,
            "intra_node": link_to_dict(self.intra_node),
            "inter_node": link_to_dict(self.inter_node),
            "nics_per_node": self.nics_per_node,
            "nodes_per_rack": self.nodes_per_rack,
            "spine_oversubscription": self.spine_oversubscription,
            "backend": self.backend,
            "overlap_comm": self.overlap_comm,
            **({} if self.two_level else {"two_level": False}),
            **({"node_groups": [g.to_dict() for g in self.node_groups]} if self.node_groups else {}),
            **({"host": self.host.to_dict()} if self.host is not None else {}),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Cluster:
        return cls(
            device=DeviceSpec.from_dict(d["device"]),
            gpus_per_node=d["gpus_per_node"],
            nodes=d["nodes"],
            intra_node=link_from_dict(d["intra_node"]),
            inter_node=link_from_dict(d["inter_node"]),
            nics_per_node=d.get("nics_per_node"),
            nodes_per_rack=d.get("nodes_per_rack"),
            spine_oversubscription=d.get("spine_oversubscription", 1.0),
            backend=d.get("backend", "nccl"),
            overlap_comm=d.get("overlap_comm", True),
            two_level=bool(d.get("two_level", True)),
            node_groups=tuple(NodeGroup.from_dict(g) for g in d.get("node_groups", ())),
            host=HostSpec.from_dict(d["host"]) if d.get("host") else None,
        )

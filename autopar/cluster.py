"""The cluster: devices, nodes and the links between them, as a validated dataclass.

A ``Cluster`` is ``nodes`` machines of ``gpus_per_node`` identical devices. Devices inside a node
talk over ``intra_node`` (NVLink), devices on different nodes over ``inter_node`` (InfiniBand,
bandwidth per device). A device mesh laid over the cluster is row-major with its last axis
innermost, so an axis whose devices all sit in one node uses NVLink; ``Cluster.axis_link`` says
which link an axis of a given mesh uses.

Presets carry the vendors' published figures (dense tensor-core peaks, HBM bandwidth, NVLink
per-direction bandwidth, one InfiniBand HCA per GPU as in DGX systems). ``Cluster.local`` describes
processes on this machine talking through gloo; its figures are defaults until measured with
``autopar.runtime.calibrate.measure_local`` (gloo's costs are not NCCL-shaped and must be measured).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

import torch

__all__ = ["Cluster", "DeviceSpec", "Link", "mesh_arithmetic"]

TB = 1e12
GB = 1e9
GiB = 1 << 30


@dataclass(frozen=True, kw_only=True, slots=True)
class DeviceSpec:
    """One accelerator."""

    name: str
    """Marketing name, e.g. ``"A100-80GB"``."""
    peak_flops: dict[str, float]
    """Dense peak FLOP/s per dtype name (``"float32"``, ``"bfloat16"``, ``"float16"``)."""
    memory_bandwidth: float
    """Device memory bandwidth in bytes/s."""
    memory: int
    """Device memory in bytes."""
    compute_efficiency: float = 0.6
    """Fraction of peak FLOP/s that real kernels reach (the roofline's efficiency factor)."""
    memory_efficiency: float = 0.8
    """Fraction of peak memory bandwidth that real kernels reach."""

    def __post_init__(self) -> None:
        if not self.peak_flops or any(v <= 0 for v in self.peak_flops.values()):
            raise ValueError(f"DeviceSpec {self.name!r}: peak_flops must be positive, got {self.peak_flops}")
        if self.memory_bandwidth <= 0 or self.memory <= 0:
            raise ValueError(
                f"DeviceSpec {self.name!r}: memory_bandwidth ({self.memory_bandwidth}) and memory "
                f"({self.memory}) must be positive"
            )
        for what, v in (
            ("compute_efficiency", self.compute_efficiency),
            ("memory_efficiency", self.memory_efficiency),
        ):
            if not 0 < v <= 1:
                raise ValueError(f"DeviceSpec {self.name!r}: {what} must be in (0, 1], got {v}")

    def flops_for(self, dtype: torch.dtype | str) -> float:
        """Peak FLOP/s for ``dtype``; integer and unknown dtypes use the float32 figure."""
        key = str(dtype).replace("torch.", "")
        return self.peak_flops.get(key, self.peak_flops.get("float32", max(self.peak_flops.values())))


@dataclass(frozen=True, kw_only=True, slots=True)
class Link:
    """A link in the α-β model: a transfer of ``S`` bytes takes ``latency + S / bandwidth``."""

    name: str
    bandwidth: float
    """Bytes/s per device, one direction (the NCCL 'bus bandwidth' a ring reaches)."""
    latency: float
    """Seconds per message step (α)."""
    measured: tuple[tuple[str, int, float, float], ...] = ()
    """Measured costs that replace the ring formulas: ``(collective, n, α, β)`` rows meaning a
    ``collective`` over ``n`` devices on an ``S``-byte buffer (sized as in ``autopar.cost.comm``)
    takes ``α + β·S`` seconds. ``autopar.runtime.calibrate.measure_local`` fills it for gloo."""

    def measured_cost(self, collective: str, n: int) -> tuple[float, float] | None:
        """``(α, β)`` measured for ``collective`` over ``n`` devices, if any."""
        for c, m, a, b in self.measured:
            if c == collective and m == n:
                return a, b
        return None

    def __post_init__(self) -> None:
        if self.bandwidth <= 0 or self.latency < 0:
            raise ValueError(
                f"Link {self.name!r}: bandwidth ({self.bandwidth}) must be > 0 and latency ({self.latency}) >= 0"
            )


def _gpu(name: str, bf16: float, fp32: float, bw: float, mem: int) -> DeviceSpec:
    return DeviceSpec(
        name=name,
        peak_flops={"bfloat16": bf16, "float16": bf16, "float32": fp32},
        memory_bandwidth=bw,
        memory=mem,
    )


# Published figures: NVIDIA V100/A100/H100/H200 datasheets (dense, no sparsity). fp32 is the TF32
# tensor-core rate on Ampere and later (PyTorch's default for convolutions; matmuls with
# `torch.backends.cuda.matmul.allow_tf32`), plain FP32 on Volta.
_PRESETS: dict[str, tuple[DeviceSpec, Link, Link]] = {
    "V100-32GB": (
        _gpu("V100-32GB", 125 * TB, 15.7 * TB, 900 * GB, 32 * GiB),
        Link(name="NVLink2", bandwidth=150 * GB, latency=5e-6),
        Link(name="IB-EDR", bandwidth=12.5 * GB, latency=10e-6),
    ),
    "A100-40GB": (
        _gpu("A100-40GB", 312 * TB, 156 * TB, 1555 * GB, 40 * GiB),
        Link(name="NVLink3", bandwidth=300 * GB, latency=5e-6),
        Link(name="IB-HDR", bandwidth=25 * GB, latency=10e-6),
    ),
    "A100-80GB": (
        _gpu("A100-80GB", 312 * TB, 156 * TB, 2039 * GB, 80 * GiB),
        Link(name="NVLink3", bandwidth=300 * GB, latency=5e-6),
        Link(name="IB-HDR", bandwidth=25 * GB, latency=10e-6),
    ),
    "H100-SXM": (
        _gpu("H100-SXM", 989 * TB, 494 * TB, 3350 * GB, 80 * GiB),
        Link(name="NVLink4", bandwidth=450 * GB, latency=4e-6),
        Link(name="IB-NDR", bandwidth=50 * GB, latency=8e-6),
    ),
    "H200": (
        _gpu("H200", 989 * TB, 494 * TB, 4800 * GB, 141 * GB),
        Link(name="NVLink4", bandwidth=450 * GB, latency=4e-6),
        Link(name="IB-NDR", bandwidth=50 * GB, latency=8e-6),
    ),
}


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
    """Link between devices of different nodes (per device)."""
    backend: str = "nccl"
    """torch.distributed backend the runtime uses on this cluster (``"gloo"`` for ``Cluster.local``)."""
    extra: dict[str, Any] = field(default_factory=dict, compare=False)
    """Free-form provenance (e.g. how a local profile was measured)."""

    def __post_init__(self) -> None:
        if self.gpus_per_node < 1 or self.nodes < 1:
            raise ValueError(
                f"Cluster needs at least one device: gpus_per_node={self.gpus_per_node}, nodes={self.nodes}"
            )

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.nodes

    @classmethod
    def preset(cls, name: str, gpus_per_node: int = 8, nodes: int = 1) -> Cluster:
        """A cluster of a known accelerator: one of ``Cluster.presets()``."""
        if name not in _PRESETS:
            raise ValueError(f"unknown cluster preset {name!r}; known presets: {', '.join(sorted(_PRESETS))}")
        dev, intra, inter = _PRESETS[name]
        return cls(device=dev, gpus_per_node=gpus_per_node, nodes=nodes, intra_node=intra, inter_node=inter)

    @staticmethod
    def presets() -> list[str]:
        return sorted(_PRESETS)

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
    ) -> Cluster:
        """``world_size`` processes on this machine, talking through gloo over shared memory/loopback.

        The defaults are rough figures for one CPU core; ``autopar.runtime.calibrate.measure_local``
        measures them (matmul throughput, gloo all-reduce α and β) and returns a Cluster built
        with the measured numbers.
        """
        if world_size < 1:
            raise ValueError(f"Cluster.local needs world_size >= 1, got {world_size}")
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
            device=dev, gpus_per_node=world_size, nodes=1, intra_node=link, inter_node=link, backend="gloo"
        )

    def with_device(self, **changes: Any) -> Cluster:
        return replace(self, device=replace(self.device, **changes))

    def validate_mesh(self, mesh_shape: tuple[int, ...]) -> None:
        """Raise ``ValueError`` with the arithmetic when ``mesh_shape`` does not cover the cluster."""
        if any(n < 1 for n in mesh_shape):
            raise ValueError(f"mesh_shape {mesh_shape} has an axis smaller than 1")
        total = math.prod(mesh_shape)
        if total != self.world_size:
            raise ValueError(
                f"mesh_shape {mesh_arithmetic(mesh_shape)} ≠ world size {self.world_size} "
                f"({self.nodes} node(s) × {self.gpus_per_node} devices)"
            )

    def axis_link(self, mesh_shape: tuple[int, ...], axis: int) -> Link:
        """The link that mesh axis ``axis`` uses: NVLink when all its devices share a node.

        Devices are numbered row-major over the mesh, node-major over the cluster; the devices of
        an axis with size ``n`` and inner extent ``I`` (product of later axes) span ``n·I``
        consecutive ranks, inside one node iff ``n·I ≤ gpus_per_node``.
        """
        inner = math.prod(mesh_shape[axis + 1 :])
        span = mesh_shape[axis] * inner
        if span <= self.gpus_per_node and self.gpus_per_node % span == 0:
            return self.intra_node
        return self.inter_node

    def describe(self) -> str:
        d = self.device
        if self.backend == "gloo":
            return (
                f"{self.world_size} local processes ({d.flops_for('float32') / 1e9:.0f} GFLOP/s fp32 each, "
                f"{self.intra_node.name} {self.intra_node.bandwidth / GB:.1f} GB/s)"
            )
        return (
            f"{self.nodes} node(s) × {self.gpus_per_node} {d.name} "
            f"({d.flops_for('bfloat16') / TB:.0f} TFLOP/s bf16, {d.memory / GiB:.0f} GiB, "
            f"{self.intra_node.name} {self.intra_node.bandwidth / GB:.0f} GB/s, "
            f"{self.inter_node.name} {self.inter_node.bandwidth / GB:.1f} GB/s)"
        )

    def to_dict(self) -> dict[str, Any]:
        d = self.device
        return {
            "device": {
                "name": d.name,
                "peak_flops": dict(d.peak_flops),
                "memory_bandwidth": d.memory_bandwidth,
                "memory": d.memory,
                "compute_efficiency": d.compute_efficiency,
                "memory_efficiency": d.memory_efficiency,
            },
            "gpus_per_node": self.gpus_per_node,
            "nodes": self.nodes,
            "intra_node": _link_dict(self.intra_node),
            "inter_node": _link_dict(self.inter_node),
            "backend": self.backend,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Cluster:
        return cls(
            device=DeviceSpec(**d["device"]),
            gpus_per_node=d["gpus_per_node"],
            nodes=d["nodes"],
            intra_node=_link_from(d["intra_node"]),
            inter_node=_link_from(d["inter_node"]),
            backend=d.get("backend", "nccl"),
        )


def mesh_arithmetic(mesh_shape: tuple[int, ...]) -> str:
    """``"4 × 3 = 12"`` for a 2-D mesh, ``"(16,) = 16 devices"`` for a 1-D one."""
    total = math.prod(mesh_shape)
    if len(mesh_shape) == 1:
        return f"({mesh_shape[0]},) = {total} devices"
    return " × ".join(str(n) for n in mesh_shape) + f" = {total}"


def _link_dict(link: Link) -> dict[str, Any]:
    return {
        "name": link.name,
        "bandwidth": link.bandwidth,
        "latency": link.latency,
        "measured": [list(row) for row in link.measured],
    }


def _link_from(d: dict[str, Any]) -> Link:
    rows = tuple((str(c), int(n), float(a), float(b)) for c, n, a, b in d.get("measured", ()))
    return Link(name=d["name"], bandwidth=d["bandwidth"], latency=d["latency"], measured=rows)

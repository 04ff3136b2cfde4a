"""The cluster: devices, nodes and the links between them, as a validated dataclass.

A ``Cluster`` is ``nodes`` machines of ``gpus_per_node`` identical devices. Devices inside a node
talk over ``intra_node`` (NVLink), devices on different nodes over ``inter_node`` (InfiniBand,
bandwidth per device). A device mesh laid over the cluster is row-major with its last axis
innermost, so an axis whose devices all sit in one node uses NVLink; ``Cluster.axis_link`` says
which link an axis of a given mesh uses.

Presets carry the vendors' published figures (dense tensor-core peaks, HBM bandwidth, NVLink
per-direction bandwidth, one InfiniBand HCA per GPU as in DGX systems). ``Cluster.local`` describes
processes on this machine talking through gloo; its figures are defaults until measured with
``autopar.measure_local`` (gloo's costs are not NCCL-shaped and must be measured).
"""

from __future__ import annotations

import json
import math
import numbers
import os
from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch

__all__ = ["PROFILE_VERSION", "Cluster", "DeviceSpec", "Link", "load_profile", "mesh_arithmetic"]

TB = 1e12
GB = 1e9
GiB = 1 << 30


def _number(owner: str, what: str, value: Any, *, unit: str, fix: str, zero_ok: bool = False) -> None:
    """Raise unless ``value`` is a finite real number > 0 (>= 0 with ``zero_ok``): a NaN or an
    infinity would make every cost it enters NaN, zero or infinite and the plan meaningless."""
    bound = ">= 0" if zero_ok else "> 0"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(
            f"{owner}: {what} must be a number of {unit} {bound}, got {value!r} "
            f"({type(value).__name__}); {fix}"
        )
    if not math.isfinite(value) or value < 0 or (value == 0 and not zero_ok):
        why = (
            "not finite: every cost it enters would be NaN, zero or infinite"
            if not math.isfinite(value)
            else ("negative" if value < 0 else "zero")
        )
        raise ValueError(
            f"{owner}: {what} must be a finite number of {unit} {bound}, got {value} ({why}); {fix}"
        )


def _count(owner: str, what: str, value: Any, *, fix: str) -> int:
    """``value`` as an ``int`` >= 1, or raise: a count of devices or NICs is a whole number."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(
            f"{owner}: {what} must be a whole number >= 1, got {value!r} ({type(value).__name__}); {fix}"
        )
    if not math.isfinite(value) or value != int(value):
        raise ValueError(
            f"{owner}: {what} must be a whole number >= 1, got {value} (not a whole number); {fix}"
        )
    if value < 1:
        raise ValueError(f"{owner}: {what} must be a whole number >= 1, got {value}; {fix}")
    return int(value)


@dataclass(frozen=True, kw_only=True, slots=True)
class DeviceSpec:
    """One accelerator and how fast real kernels run on it (the figures ``autopar.cost.compute``
    turns into seconds; its module docstring gives the formulas and their sources)."""

    name: str
    """Marketing name, e.g. ``"A100-80GB"``."""
    peak_flops: dict[str, float]
    """Dense peak FLOP/s per dtype name (``"float32"``, ``"bfloat16"``, ``"float16"``)."""
    memory_bandwidth: float
    """Device memory bandwidth in bytes/s (datasheet)."""
    memory: int
    """Device memory in bytes."""
    compute_efficiency: float = 0.6
    """Fraction of peak FLOP/s a large matmul reaches: the plateau ``e_max`` of the matmul curve
    ``e(K) = e_max · K / (K + matmul_k_half)``."""
    matmul_k_half: float = 0.0
    """Reduction length ``K`` at which a matmul reaches half of ``compute_efficiency`` (the fixed
    per-output-tile cost of a GEMM's prologue and epilogue, in K-steps); 0: a flat efficiency."""
    sm_count: int = 0
    """Streaming multiprocessors (compute units): a matmul with fewer 128×128 output tiles than
    this leaves units idle; 0: not modelled."""
    memory_efficiency: float = 0.8
    """Fraction of ``memory_bandwidth`` that memory-bound kernels (elementwise, norms, casts,
    reductions, copies, the optimizer update) reach."""
    attention_efficiency: float = 0.0
    """Fraction of peak FLOP/s the fused attention forward kernel reaches on long sequences (head
    dimension 128, no mask); 0: ``compute_efficiency``."""
    attention_bwd_efficiency: float = 0.0
    """The same for the attention backward kernel; 0: ``attention_efficiency``."""
    attention_seq_half: float = 0.0
    """Key length at which the forward attention kernel reaches half its plateau
    (``e(s) = e_max · s / (s + s_half)``)."""
    attention_bwd_seq_half: float = 0.0
    """The same for the backward kernel."""
    attention_causal_seq_half: float = 0.0
    """Added to both ``s_half`` under a causal mask (diagonal blocks half wasted, imbalanced
    work per query block)."""
    kernel_overhead: float = 0.0
    """Seconds every kernel takes beyond its roofline time (launch gap and ramp on the device)."""
    host_overhead: float = 0.0
    """Seconds of host (CPU) time to issue one eager op (Python, dispatcher, autograd); a step
    whose kernels are shorter than this is bound by the host."""
    optimizer_overhead: float = 0.0
    """Host seconds per parameter tensor of one ``optimizer.step()`` (grouping the tensors,
    per-tensor bookkeeping) on top of its memory-bound update."""
    optimizer_efficiency: float = 0.0
    """Fraction of ``memory_bandwidth`` the optimizer's update passes reach (0: ``memory_efficiency``,
    as other memory-bound kernels)."""

    @property
    def optimizer_bandwidth(self) -> float:
        """Bytes/s an ``optimizer.step()`` streams (``optimizer_efficiency``)."""
        return self.memory_bandwidth * (self.optimizer_efficiency or self.memory_efficiency)

    def __post_init__(self) -> None:
        owner = f"DeviceSpec {self.name!r}"
        measure = "use the datasheet figure or measure it with autopar.runtime.calibrate"
        if not isinstance(self.peak_flops, dict) or not self.peak_flops:
            raise ValueError(
                f"{owner}: peak_flops must map dtype names to FLOP/s, e.g. {{'float32': 19.5e12}}, "
                f"got {self.peak_flops!r}"
            )
        for dtype, v in self.peak_flops.items():
            _number(owner, f"peak_flops[{dtype!r}]", v, unit="FLOP/s", fix=measure)
        _number(owner, "memory_bandwidth", self.memory_bandwidth, unit="bytes/s", fix=measure)
        _number(
            owner,
            "memory",
            self.memory,
            unit="bytes",
            fix="give the device's memory in bytes, e.g. 80 * autopar.cluster.GiB",
        )
        for what, v in (
            ("compute_efficiency", self.compute_efficiency),
            ("memory_efficiency", self.memory_efficiency),
        ):
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or not 0 < v <= 1:
                raise ValueError(
                    f"{owner}: {what} must be in (0, 1] (a fraction of the peak), got {v!r}; {measure}"
                )
        for what, v in (
            ("attention_efficiency", self.attention_efficiency),
            ("attention_bwd_efficiency", self.attention_bwd_efficiency),
            ("optimizer_efficiency", self.optimizer_efficiency),
        ):
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or not 0 <= v <= 1:
                raise ValueError(f"{owner}: {what} must be in [0, 1] (0: default), got {v!r}; {measure}")
        for what, unit in (
            ("matmul_k_half", "K-steps"),
            ("sm_count", "compute units"),
            ("attention_seq_half", "keys"),
            ("attention_bwd_seq_half", "keys"),
            ("attention_causal_seq_half", "keys"),
            ("kernel_overhead", "seconds"),
            ("host_overhead", "seconds"),
            ("optimizer_overhead", "seconds"),
        ):
            _number(owner, what, getattr(self, what), unit=unit, fix="0 leaves it unmodelled", zero_ok=True)

    def flops_for(self, dtype: torch.dtype | str) -> float:
        """Peak FLOP/s for ``dtype``; integer and unknown dtypes use the float32 figure."""
        key = str(dtype).replace("torch.", "")
        return self.peak_flops.get(key, self.peak_flops.get("float32", max(self.peak_flops.values())))

    @property
    def achieved_bandwidth(self) -> float:
        """Bytes/s memory-bound kernels reach: ``memory_bandwidth · memory_efficiency``."""
        return self.memory_bandwidth * self.memory_efficiency

    def to_dict(self) -> dict[str, Any]:
        return {
            f.name: (dict(v) if isinstance(v := getattr(self, f.name), dict) else v) for f in fields(self)
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DeviceSpec:
        """Inverse of ``to_dict``; unknown keys are an error (a typo must not pass silently)."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"DeviceSpec: unknown field(s) {unknown}; known: {sorted(known)}")
        return cls(**d)


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
    takes ``α + β·S`` seconds. ``autopar.measure_local`` fills it for gloo."""

    def measured_cost(self, collective: str, n: int) -> tuple[float, float] | None:
        """``(α, β)`` measured for ``collective`` over ``n`` devices, if any."""
        for c, m, a, b in self.measured:
            if c == collective and m == n:
                return a, b
        return None

    def __post_init__(self) -> None:
        owner = f"Link {self.name!r}"
        measure = "use the link's datasheet figure or measure it with autopar.runtime.calibrate"
        _number(owner, "bandwidth", self.bandwidth, unit="bytes/s", fix=measure)
        _number(owner, "latency", self.latency, unit="seconds", fix=measure, zero_ok=True)
        for row in self.measured:
            _collective, n, a, b = row
            where = f"measured row {row!r}"
            _count(owner, f"{where}: devices", n, fix="a row is (collective, devices, α seconds, β s/byte)")
            _number(owner, f"{where}: α", a, unit="seconds", fix="measure again", zero_ok=True)
            _number(owner, f"{where}: β", b, unit="seconds per byte", fix="measure again", zero_ok=True)


# How fast real kernels run, per device generation (DeviceSpec fields; the formulas are
# ``autopar.cost.compute``'s). Sources:
# * matmul curve (compute_efficiency = e_max, matmul_k_half): least-squares fit of
#   ``autopar.cost.fit.fit_matmul_curve`` to the H100-SXM measurements in
#   ``shared/reference/h100_matmul.csv`` (torch.matmul, bf16, PyTorch 2.11): e_max 0.807, K½ 308,
#   every row within 2 %. No reference measurement for the other devices here: they carry the
#   same curve until ``autopar.runtime.calibrate`` measures them.
# * attention (FlashAttention-2, PyTorch's SDPA flash backend): the FA2 series of Shah et al.,
#   "FlashAttention-3", arXiv 2407.08608, Figs. 5-7 (H100-SXM5, bf16): forward plateau 378 TFLOP/s
#   (0.382 of peak) at head dim 128, half of it at 114 keys; backward 330 TFLOP/s (0.334) at 277
#   keys; a causal mask adds ~300 keys to the half-point (its forward: 191 TFLOP/s at 512 keys,
#   335 at 16k). A100: Dao, "FlashAttention-2", arXiv 2307.08691 §4.1: forward up to 73 % of
#   peak, backward up to 63 %.
# * memory_efficiency 0.8 of HBM bandwidth for elementwise/norm/reduction kernels, the per-kernel
#   device overhead (2 µs) and the optimizer's per-tensor host time: fitted with the whole
#   training steps of ``shared/reference/h100_training_steps.csv`` (examples/check_calibration.py
#   prints prediction against measurement); host_overhead (10 µs per eager op: Python, dispatcher
#   and autograd, the ~5-25 µs of CPU work per op PyTorch documents for eager mode) only matters
#   when kernels are shorter than it.
_H100_KERNELS: dict[str, float] = {
    "compute_efficiency": 0.807,
    "matmul_k_half": 308.0,
    "memory_efficiency": 0.8,
    "attention_efficiency": 0.382,
    "attention_bwd_efficiency": 0.334,
    "attention_seq_half": 114.0,
    "attention_bwd_seq_half": 277.0,
    "attention_causal_seq_half": 300.0,
    "kernel_overhead": 2e-6,
    "host_overhead": 10e-6,
    # AdamW(fused=True) on one H100 SXM: six whole-model steps of h100_training_steps.csv (0.36 to
    # 2.7 B parameters, 75 to 293 tensors) fit 2.0 TB/s and 8.7 µs per tensor within ±8 %
    # (relative least squares, 2026-11-26; examples/gpu_checks.py --optimizer sweeps synthetic lists)
    "optimizer_overhead": 8.7e-6,
    "optimizer_efficiency": 0.6,
}
_A100_KERNELS: dict[str, float] = {
    **_H100_KERNELS,
    "attention_efficiency": 0.73,
    "attention_bwd_efficiency": 0.63,
}


def _gpu(
    name: str, bf16: float, tf32: float, fp32: float, bw: float, mem: int, sms: int, kernels: dict[str, float]
) -> DeviceSpec:
    peak = {"bfloat16": bf16, "float16": bf16, "float32": fp32}
    if tf32:
        peak["tfloat32"] = tf32
    return DeviceSpec(
        name=name,
        peak_flops=peak,
        memory_bandwidth=bw,
        memory=mem,
        sm_count=sms,
        **kernels,
    )


# Published figures: NVIDIA V100/A100/H100/H200 datasheets (dense, no sparsity). float32 is the
# plain FP32 rate (CUDA cores): what an fp32 matmul runs at under PyTorch's default
# `torch.get_float32_matmul_precision() == "highest"` (measured on one H100 SXM, 2026-11-26:
# `examples/gpu_checks.py`'s 4-layer fp32 GPT step takes 13.1 ms, 2.5× the TF32-rate prediction);
# tfloat32 is the TF32 tensor-core rate on Ampere and later (convolutions by default,
# `torch.backends.cudnn.allow_tf32`; matmuls under precision "high" or "medium").
# NVLink: per-direction bandwidth
# per GPU (half the datasheet's bidirectional figure). Inter-node: one InfiniBand NIC per GPU, as
# in DGX systems (Megatron-LM, arXiv 2104.04473, Table 1 note: 8 × 200 Gb/s HDR per DGX A100;
# DGX H100: 8 × 400 Gb/s NDR), bandwidth per NIC and direction.
_PRESETS: dict[str, tuple[DeviceSpec, Link, Link]] = {
    "V100-32GB": (
        _gpu("V100-32GB", 125 * TB, 0, 15.7 * TB, 900 * GB, 32 * GiB, 80, _A100_KERNELS),
        Link(name="NVLink2", bandwidth=150 * GB, latency=5e-6),
        Link(name="IB-EDR", bandwidth=12.5 * GB, latency=10e-6),
    ),
    "A100-40GB": (
        _gpu("A100-40GB", 312 * TB, 156 * TB, 19.5 * TB, 1555 * GB, 40 * GiB, 108, _A100_KERNELS),
        Link(name="NVLink3", bandwidth=300 * GB, latency=5e-6),
        Link(name="IB-HDR", bandwidth=25 * GB, latency=10e-6),
    ),
    "A100-80GB": (
        _gpu("A100-80GB", 312 * TB, 156 * TB, 19.5 * TB, 2039 * GB, 80 * GiB, 108, _A100_KERNELS),
        Link(name="NVLink3", bandwidth=300 * GB, latency=5e-6),
        Link(name="IB-HDR", bandwidth=25 * GB, latency=10e-6),
    ),
    "H100-SXM": (
        _gpu("H100-SXM", 989 * TB, 494 * TB, 67 * TB, 3350 * GB, 80 * GiB, 132, _H100_KERNELS),
        Link(name="NVLink4", bandwidth=450 * GB, latency=4e-6),
        Link(name="IB-NDR", bandwidth=50 * GB, latency=8e-6),
    ),
    "H200": (
        _gpu("H200", 989 * TB, 494 * TB, 67 * TB, 4800 * GB, 141 * GB, 132, _H100_KERNELS),
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
    """One network interface (NIC) between nodes: its bandwidth per direction and latency."""
    nics_per_node: int | None = None
    """Inter-node NICs per node, used side by side by a collective that spans nodes (NCCL gives
    each GPU the NIC nearest to it); ``None``: one per GPU, as in DGX systems."""
    backend: str = "nccl"
    """torch.distributed backend the runtime uses on this cluster (``"gloo"`` for ``Cluster.local``)."""
    overlap_comm: bool = True
    """Communication runs beside compute (GPUs: copy engines and NICs of their own); False where it
    takes the compute's own cores — CPU processes filling the machine, gloo's threads and the
    compute sharing them — so the simulator charges a gradient reduction on the compute's time."""
    extra: dict[str, Any] = field(default_factory=dict, compare=False)
    """Free-form provenance (e.g. how a local profile was measured)."""

    def __post_init__(self) -> None:
        # A count given as a whole float (8.0, from a JSON file) is taken as the int it is.
        arithmetic = (
            f"world size = nodes({self.nodes}) × gpus_per_node({self.gpus_per_node}): a Cluster needs at "
            "least one device and counts whole devices"
        )
        object.__setattr__(
            self,
            "gpus_per_node",
            _count(
                "Cluster",
                "gpus_per_node",
                self.gpus_per_node,
                fix=f"{arithmetic}; give the number of devices in one node",
            ),
        )
        object.__setattr__(
            self,
            "nodes",
            _count(
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
                _count(
                    "Cluster",
                    "nics_per_node",
                    self.nics_per_node,
                    fix="give the inter-node NICs per node, or None for one per GPU",
                ),
            )
        for what, v, cls in (
            ("device", self.device, DeviceSpec),
            ("intra_node", self.intra_node, Link),
            ("inter_node", self.inter_node, Link),
        ):
            if not isinstance(v, cls):
                raise ValueError(f"Cluster: {what} must be a {cls.__name__}, got {type(v).__name__}")

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.nodes

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
    ) -> Cluster:
        """A cluster of a known accelerator: one of ``Cluster.presets()``.

        ``profile``: a profile written by ``autopar.runtime.calibrate`` (a path or the dict): its
        measured device figures replace the preset's (the datasheet peaks stay unless measured),
        its measured links replace the preset's links.
        """
        if name not in _PRESETS:
            raise ValueError(f"unknown cluster preset {name!r}; known presets: {', '.join(sorted(_PRESETS))}")
        dev, intra, inter = _PRESETS[name]
        cl = cls(
            device=dev,
            gpus_per_node=gpus_per_node,
            nodes=nodes,
            intra_node=intra,
            inter_node=inter,
            nics_per_node=nics_per_node,
        )
        return cl.with_profile(profile) if profile is not None else cl

    @staticmethod
    def presets() -> list[str]:
        return sorted(_PRESETS)

    def with_profile(self, profile: str | os.PathLike[str] | dict[str, Any]) -> Cluster:
        """This cluster with the figures a calibration profile measured (see ``preset``)."""
        prof = load_profile(profile)
        dev = prof.get("device", {})
        changes = {k: v for k, v in dev.items() if k not in ("name", "memory")}
        peak = dict(self.device.peak_flops)
        peak.update(changes.pop("peak_flops", {}))
        device = replace(self.device, peak_flops=peak, **changes)
        links = prof.get("links", {})
        intra = _link_from(links["intra_node"]) if "intra_node" in links else self.intra_node
        inter = _link_from(links["inter_node"]) if "inter_node" in links else self.inter_node
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
        intra = _link_from(links["intra_node"])
        inter = _link_from(links["inter_node"]) if "inter_node" in links else intra
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
    ) -> Cluster:
        """``world_size`` processes on this machine, talking through gloo over shared memory/loopback.

        The defaults are rough figures for one CPU core; ``autopar.measure_local``
        measures them (matmul throughput, gloo all-reduce α and β) and returns a Cluster built
        with the measured numbers. ``overlap_comm`` (default: when the machine has a spare core for
        each process's gloo thread, ``2 · world_size <= os.cpu_count()``): see ``Cluster``.
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
        shape = tuple(mesh_shape)
        strides = [math.prod(shape[a + 1 :]) for a in range(len(shape))]
        offsets = [0]
        for a in axes:
            offsets = [o + i * strides[a] for o in offsets for i in range(shape[a])]
        others = [a for a in range(len(shape)) if a not in axes]
        bases = [0]
        for a in others:
            bases = [b + i * strides[a] for b in bases for i in range(shape[a])]
        worst = (len(offsets), 1)
        for b in bases:
            per_node: dict[int, int] = {}
            for o in offsets:
                node = (b + o) // self.gpus_per_node
                per_node[node] = per_node.get(node, 0) + 1
            span = (min(per_node.values()), len(per_node))
            if span[1] > worst[1] or (span[1] == worst[1] and span[0] < worst[0]):
                worst = span
        return worst

    def axis_link(self, mesh_shape: tuple[int, ...], axis: int) -> Link:
        """The link that mesh axis ``axis`` uses: NVLink when all its devices share a node, else
        the inter-node NIC (``autopar.mesh.Mesh`` costs collectives over several NICs at once)."""
        return self.intra_node if self.group_span(mesh_shape, (axis,))[1] == 1 else self.inter_node

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
            f"{self.nics} × {self.inter_node.name} {self.inter_node.bandwidth / GB:.1f} GB/s per node)"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "device": self.device.to_dict(),
            "gpus_per_node": self.gpus_per_node,
            "nodes": self.nodes,
            "intra_node": _link_dict(self.intra_node),
            "inter_node": _link_dict(self.inter_node),
            "nics_per_node": self.nics_per_node,
            "backend": self.backend,
            "overlap_comm": self.overlap_comm,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Cluster:
        return cls(
            device=DeviceSpec.from_dict(d["device"]),
            gpus_per_node=d["gpus_per_node"],
            nodes=d["nodes"],
            intra_node=_link_from(d["intra_node"]),
            inter_node=_link_from(d["inter_node"]),
            nics_per_node=d.get("nics_per_node"),
            backend=d.get("backend", "nccl"),
            overlap_comm=d.get("overlap_comm", True),
        )


PROFILE_VERSION = 1
"""Version of the profile JSON ``autopar.runtime.calibrate`` writes and ``load_profile`` reads."""


def load_profile(profile: str | os.PathLike[str] | dict[str, Any]) -> dict[str, Any]:
    """A calibration profile (``autopar.runtime.calibrate``), from a JSON file or as given,
    checked: its version, and that its device figures are ``DeviceSpec`` fields."""
    if isinstance(profile, dict):
        prof = profile
    else:
        with open(profile) as f:
            prof = json.load(f)
    if prof.get("version") != PROFILE_VERSION:
        raise ValueError(
            f"calibration profile version {prof.get('version')!r} is not {PROFILE_VERSION}: measure again "
            "with autopar.runtime.calibrate"
        )
    known = {f.name for f in fields(DeviceSpec)}
    unknown = sorted(set(prof.get("device", {})) - known)
    if unknown:
        raise ValueError(f"calibration profile: unknown device field(s) {unknown}; known: {sorted(known)}")
    return prof


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

"""Devices and links: what one accelerator computes and holds (:class:`DeviceSpec`, with the
kernel-efficiency figures the cost model uses), what a link between two of them carries
(:class:`Link`, α-β with optional measured rows), and the presets' published figures (``PRESETS``:
NVIDIA V100/A100/H100/H200 datasheets, DGX NVLink and InfiniBand). ``autopar.cluster`` lays
devices and links out as nodes.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, fields
from typing import Any, NamedTuple

import torch

__all__ = [
    "NETWORKS",
    "PRESETS",
    "DeviceSpec",
    "HostSpec",
    "Link",
    "Preset",
    "check_count",
    "check_number",
    "known_preset",
    "link_from_dict",
    "link_to_dict",
    "node_network",
]

TB = 1e12
GB = 1e9
GiB = 1 << 30


def check_number(owner: str, what: str, value: Any, *, unit: str, fix: str, zero_ok: bool = False) -> None:
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


def check_count(owner: str, what: str, value: Any, *, fix: str) -> int:
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
            check_number(owner, f"peak_flops[{dtype!r}]", v, unit="FLOP/s", fix=measure)
        check_number(owner, "memory_bandwidth", self.memory_bandwidth, unit="bytes/s", fix=measure)
        check_number(
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
            check_number(
                owner, what, getattr(self, what), unit=unit, fix="0 leaves it unmodelled", zero_ok=True
            )

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
        check_number(owner, "bandwidth", self.bandwidth, unit="bytes/s", fix=measure)
        check_number(owner, "latency", self.latency, unit="seconds", fix=measure, zero_ok=True)
        for row in self.measured:
            _collective, n, a, b = row
            where = f"measured row {row!r}"
            check_count(
                owner, f"{where}: devices", n, fix="a row is (collective, devices, α seconds, β s/byte)"
            )
            check_number(owner, f"{where}: α", a, unit="seconds", fix="measure again", zero_ok=True)
            check_number(owner, f"{where}: β", b, unit="seconds per byte", fix="measure again", zero_ok=True)


@dataclass(frozen=True, kw_only=True, slots=True)
class HostSpec:
    """A node's host: the CPU memory optimizer offload keeps state in, the CPU that updates it, and
    the link each device reaches it over (``autopar.cost.offload`` turns these into seconds).

    The node's devices share ``memory`` and ``memory_bandwidth``; each has its own ``link`` (a
    PCIe x16 slot per GPU in DGX systems)."""

    name: str
    """e.g. ``"DGX H100 host"``."""
    memory: int
    """Host memory of one node in bytes."""
    memory_bandwidth: float
    """The node's DRAM bandwidth in bytes/s (all sockets, datasheet)."""
    link: Link
    """Host↔device link of one device, bandwidth per direction (PCIe)."""
    optimizer_efficiency: float = 0.5
    """Fraction of ``memory_bandwidth`` an optimizer step on the host reaches with every core of
    the node working (a vectorized, multi-threaded memory-bound pass: DeepSpeed's CPU-Adam, Ren et
    al., "ZeRO-Offload", arXiv 2101.06840 §4.2). 0.5 is an assumption until measured."""

    def __post_init__(self) -> None:
        owner = f"HostSpec {self.name!r}"
        check_number(owner, "memory", self.memory, unit="bytes", fix="give the node's host memory in bytes")
        check_number(
            owner,
            "memory_bandwidth",
            self.memory_bandwidth,
            unit="bytes/s",
            fix="give the node's DRAM bandwidth",
        )
        if not isinstance(self.link, Link):
            raise ValueError(
                f"{owner}: link must be a Link (the host↔device PCIe link), got {type(self.link).__name__}"
            )
        v = self.optimizer_efficiency
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or not 0 < v <= 1:
            raise ValueError(
                f"{owner}: optimizer_efficiency must be in (0, 1] (a fraction of memory_bandwidth), got {v!r}"
            )

    def optimizer_bandwidth(self, devices: int) -> float:
        """Bytes/s the host's optimizer step streams for each of ``devices`` devices updating
        their state at once (they share the node's DRAM)."""
        return self.memory_bandwidth * self.optimizer_efficiency / devices

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "memory": self.memory,
            "memory_bandwidth": self.memory_bandwidth,
            "link": link_to_dict(self.link),
            "optimizer_efficiency": self.optimizer_efficiency,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> HostSpec:
        """Inverse of ``to_dict``; unknown keys are an error."""
        unknown = sorted(set(d) - {"name", "memory", "memory_bandwidth", "link", "optimizer_efficiency"})
        if unknown:
            raise ValueError(f"HostSpec: unknown field(s) {unknown}")
        return cls(
            name=d["name"],
            memory=d["memory"],
            memory_bandwidth=d["memory_bandwidth"],
            link=link_from_dict(d["link"]),
            optimizer_efficiency=d.get("optimizer_efficiency", 0.5),
        )


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
_NVLINK2 = Link(name="NVLink2", bandwidth=150 * GB, latency=5e-6)
_NVLINK3 = Link(name="NVLink3", bandwidth=300 * GB, latency=5e-6)
_NVLINK4 = Link(name="NVLink4", bandwidth=450 * GB, latency=4e-6)
_IB_EDR = Link(name="IB-EDR", bandwidth=12.5 * GB, latency=10e-6)
_IB_HDR = Link(name="IB-HDR", bandwidth=25 * GB, latency=10e-6)
_IB_NDR = Link(name="IB-NDR", bandwidth=50 * GB, latency=8e-6)


NETWORKS: dict[str, tuple[Link, int | None]] = {
    "infiniband": (_IB_NDR, None),
    "ethernet-400g": (Link(name="Ethernet-400G", bandwidth=50 * GB, latency=25e-6), 1),
    "ethernet-200g": (Link(name="Ethernet-200G", bandwidth=25 * GB, latency=25e-6), 1),
    "ethernet-100g": (Link(name="Ethernet-100G", bandwidth=12.5 * GB, latency=25e-6), 1),
}
"""Inter-node networks ``Cluster.preset(network=...)`` puts between nodes in place of the preset's
own: the NIC's link and how many a node has (``None``: one per GPU, the preset's InfiniBand as in
DGX systems, at the preset's own rate). The Ethernet ones are a cloud instance's single NIC per
node at its line rate per direction (400, 200, 100 Gb/s); latency 25 µs, NCCL's socket transport
over TCP (tens of µs a message where InfiniBand's verbs take under 10)."""


# Hosts (DGX system datasheets): DGX-1 — 2 × Xeon E5-2698 v4 (4 channels DDR4-2400 each,
# 76.8 GB/s a socket), 512 GB, PCIe Gen3 x16 per GPU (15.75 GB/s a direction); DGX A100 — 2 × EPYC
# 7742 (8 channels DDR4-3200, 204.8 GB/s a socket), 1 TB, PCIe Gen4 x16 (31.5 GB/s); DGX H100 and
# H200 — 2 × Xeon Platinum 8480C (8 channels DDR5-4800, 307.2 GB/s a socket), 2 TB, PCIe Gen5 x16
# (63 GB/s). A pinned host↔device copy reaches about 80 % of the slot's rate (the headers and flow
# control of PCIe's packets); taken as 0.8 × nominal until measured.
_PCIE3 = Link(name="PCIe-Gen3-x16", bandwidth=0.8 * 15.75 * GB, latency=10e-6)
_PCIE4 = Link(name="PCIe-Gen4-x16", bandwidth=0.8 * 31.5 * GB, latency=10e-6)
_PCIE5 = Link(name="PCIe-Gen5-x16", bandwidth=0.8 * 63.0 * GB, latency=10e-6)
_DGX1_HOST = HostSpec(name="DGX-1 host", memory=512 * GiB, memory_bandwidth=2 * 76.8 * GB, link=_PCIE3)
_DGXA100_HOST = HostSpec(
    name="DGX A100 host", memory=1024 * GiB, memory_bandwidth=2 * 204.8 * GB, link=_PCIE4
)
_DGXH100_HOST = HostSpec(
    name="DGX H100 host", memory=2048 * GiB, memory_bandwidth=2 * 307.2 * GB, link=_PCIE5
)


class Preset(NamedTuple):
    """One preset's published figures, named as the ``Cluster`` fields they fill
    (``Cluster.preset``)."""

    device: DeviceSpec
    intra_node: Link
    """The node's GPU interconnect (NVLink)."""
    inter_node: Link
    """One inter-node NIC (InfiniBand)."""
    host: HostSpec | None = None
    """The node's host (CPU memory and the PCIe link to it)."""


PRESETS: dict[str, Preset] = {
    "V100-32GB": Preset(
        _gpu("V100-32GB", 125 * TB, 0, 15.7 * TB, 900 * GB, 32 * GiB, 80, _A100_KERNELS), _NVLINK2, _IB_EDR, _DGX1_HOST
    ),
    "A100-40GB": Preset(
        _gpu("A100-40GB", 312 * TB, 156 * TB, 19.5 * TB, 1555 * GB, 40 * GiB, 108, _A100_KERNELS), _NVLINK3, _IB_HDR, _DGXA100_HOST
    ),
    "A100-80GB": Preset(
        _gpu("A100-80GB", 312 * TB, 156 * TB, 19.5 * TB, 2039 * GB, 80 * GiB, 108, _A100_KERNELS), _NVLINK3, _IB_HDR, _DGXA100_HOST
    ),
    "H100-SXM": Preset(
        _gpu("H100-SXM", 989 * TB, 494 * TB, 67 * TB, 3350 * GB, 80 * GiB, 132, _H100_KERNELS), _NVLINK4, _IB_NDR, _DGXH100_HOST
    ),
    "H200": Preset(
        _gpu("H200", 989 * TB, 494 * TB, 67 * TB, 4800 * GB, 141 * GB, 132, _H100_KERNELS), _NVLINK4, _IB_NDR, _DGXH100_HOST
    ),
}  # fmt: skip


def known_preset(name: str) -> Preset:
    """``PRESETS[name]``, or the error naming the known presets."""
    if name not in PRESETS:
        raise ValueError(f"unknown cluster preset {name!r}; known presets: {', '.join(sorted(PRESETS))}")
    return PRESETS[name]


def node_network(network: str | None, inter: Link, nics_per_node: int | None) -> tuple[Link, int | None]:
    """The NIC and NICs per node between nodes: ``network``'s (``NETWORKS``) in place of the
    preset's ``inter`` (one per GPU) where one is named; ``nics_per_node`` given wins."""
    if network is None:
        return inter, nics_per_node
    if network not in NETWORKS:
        raise ValueError(f"unknown network {network!r}; known networks: {', '.join(sorted(NETWORKS))}")
    link, nics = NETWORKS[network]
    if network == "infiniband":
        return inter, nics_per_node
    return link, nics_per_node if nics_per_node is not None else nics


def link_to_dict(link: Link) -> dict[str, Any]:
    """``link`` as JSON-ready data (``Cluster.to_dict``)."""
    return {
        "name": link.name,
        "bandwidth": link.bandwidth,
        "latency": link.latency,
        "measured": [list(row) for row in link.measured],
    }


def link_from_dict(d: dict[str, Any]) -> Link:
    """The link ``link_to_dict`` wrote."""
    rows = tuple((str(c), int(n), float(a), float(b)) for c, n, a, b in d.get("measured", ()))
    return Link(name=d["name"], bandwidth=d["bandwidth"], latency=d["latency"], measured=rows)

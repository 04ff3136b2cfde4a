"""Fitting the cost model to this machine's measurements: the profile of ``Cluster.local``.

The runtime measures (``autopar.runtime.calibrate.measure``: every rank's compute probes, several
rounds, and the time per call of each collective at several sizes and group sizes); this module
turns those measurements into the cost model's figures, so every formula stays in ``autopar.cost``
(``autopar.measure_local`` does both):

* compute — the roofs are the median rank's matmul FLOP/s and copy bandwidth (median over rounds);
  each probe's time is the slowest rank's (a kernel is as slow as its slowest rank: all ranks
  probe at once, as they train), median over rounds; the device model's efficiencies are each the
  ratio of the model's own time for a probe (``autopar.cost.op_kernels`` at efficiency 1)
  to that time (``_device_fit``), and the per-node and AdamW per-tensor overheads what is left;
* collectives — for every group size, the slowest rank's time per call at each buffer size,
  fitted by least squares to ``α + β·S`` (``autopar.cost.fit.fit_alpha_beta``; where the times do
  not grow with size, a conservative bound: ``_fit_or_bound``); the fits go into
  ``Link.measured``, and the whole world's all-reduce fit sets the ring-formula fallback.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from autopar.cluster import Cluster
from autopar.cost.compute import KernelKind, TensorArg, kernel_time
from autopar.cost.fit import fit_alpha_beta
from autopar.cost.op_kernels import op_kernels
from autopar.cost.optimizer import optimizer_step_time
from autopar.devices import Link

__all__ = ["fit_local"]


def fit_local(results: Sequence[dict[str, Any]]) -> Cluster:
    """A ``Cluster.local`` of ``len(results)`` processes whose costs are the device model and the
    α-β links fitted to what they measured (``autopar.runtime.calibrate.measure``: one dict per
    rank; see the module docstring)."""
    world_size = len(results)
    r0 = results[0]
    # A collective is as slow as its slowest rank: take the max over ranks per size.
    measured = []
    fits = {}
    for g, rows in r0["rows"].items():
        for kind, pts0 in rows.items():
            pts = [(s, max(r["rows"][g][kind][i][1] for r in results)) for i, (s, _) in enumerate(pts0)]
            alpha, beta = _fit_or_bound([s for s, _ in pts], [t for _, t in pts])
            measured.append((kind, g, alpha, beta))
            if g == world_size:
                fits[kind] = (alpha, beta)
    flops = _across_rounds(results, "flops", slowest=False)
    bw = _across_rounds(results, "memory_bandwidth", slowest=False)
    # A kernel is as slow as the slowest rank runs it (all ranks probed at once, as they train).
    kernels = [k for k in r0["rounds"][0] if k not in ("flops", "memory_bandwidth")]
    probes = {k: _across_rounds(results, k, slowest=True) for k in kernels}
    ar_alpha, ar_beta = fits.get("all_reduce", (60e-6, 1e-9))
    base = Cluster.local(
        world_size,
        flops=flops,
        memory_bandwidth=bw,
        # The ring-formula fallback (other group sizes) uses the all-reduce fit.
        link_bandwidth=2 * (world_size - 1) / world_size / ar_beta if world_size > 1 else 1e9,
        link_latency=ar_alpha / max(2 * (world_size - 1), 1),
    )
    base = base.with_device(**_device_fit(base, probes, r0["probe_shapes"]))
    link = Link(
        name="gloo(measured)",
        bandwidth=base.intra_node.bandwidth,
        latency=base.intra_node.latency,
        measured=tuple(measured),
    )
    return Cluster(
        device=base.device,
        gpus_per_node=world_size,
        nodes=1,
        intra_node=link,
        inter_node=link,
        backend="gloo",
        overlap_comm=base.overlap_comm,
        extra={
            "measured": {k: {"alpha_s": a, "beta_s_per_byte": b} for k, (a, b) in fits.items()},
            "kernel_probes_s": probes,
        },
    )


def _device_fit(base: Cluster, probes: dict[str, float], shapes: dict[str, Any]) -> dict[str, float]:
    """The ``DeviceSpec`` efficiencies and overheads that make the device model's time for each
    probe (of the sizes in ``shapes``) its measured time (module docstring)."""
    ideal = replace(
        base.device,
        compute_efficiency=1.0,
        memory_efficiency=1.0,
        attention_efficiency=1.0,
        attention_bwd_efficiency=1.0,
        kernel_overhead=0.0,
        optimizer_overhead=0.0,
        optimizer_efficiency=0.0,
    )
    node = probes["node"]

    def arg(*shape: int, grad: bool = True) -> TensorArg:
        return TensorArg(tuple(shape), "float32", grad)

    def model(op: str, ins: list[TensorArg], outs: list[TensorArg], **kw: bool) -> tuple[list, list]:
        ks = op_kernels(op, ins, outs, requires_grad=True, **kw)
        return ks.fwd, ks.bwd

    def ratio(kernels: list, measured: float, kind: KernelKind | None = None) -> float:
        """Model time at efficiency 1 over the measured time less the per-kernel overhead."""
        mine = [k for k in kernels if kind is None or k.kind is kind]
        t = sum(kernel_time(k, ideal) for k in mine)
        return max(1e-3, min(1.0, t / max(measured - node * len(kernels), 1e-9)))

    rows, hidden = shapes["rows"], shapes["hidden"]
    f, b = model(
        "linear", [arg(rows, hidden), arg(3 * hidden, hidden), arg(3 * hidden)], [arg(rows, 3 * hidden)]
    )
    out = {"compute_efficiency": ratio(f + b, probes["linear"], KernelKind.GEMM)}
    bh, heads, s, d = shapes["attention"]
    q = arg(bh, heads, s, d)
    f, b = model("scaled_dot_product_attention", [q, q, q], [q], causal=True)
    out["attention_efficiency"] = ratio(f, probes["attention_fwd"])
    out["attention_bwd_efficiency"] = ratio(b, probes["attention_bwd"])
    memory_bound = []
    for op, ins, outs in (
        ("gelu", [arg(rows, 4 * hidden)], [arg(rows, 4 * hidden)]),
        ("layer_norm", [arg(rows, hidden), arg(hidden), arg(hidden)], [arg(rows, hidden)]),
        ("softmax", [arg(rows, 4 * hidden)], [arg(rows, 4 * hidden)]),
        ("add", [arg(rows, 4 * hidden), arg(rows, 4 * hidden)], [arg(rows, 4 * hidden)]),
    ):
        fk, bk = model(op, ins, outs)
        memory_bound += [(fk + bk, probes[op])]
    t_model = sum(kernel_time(k, ideal) for ks, _ in memory_bound for k in ks)
    t_meas = sum(m - node * len(ks) for ks, m in memory_bound)
    out["memory_efficiency"] = max(1e-3, min(1.0, t_model / max(t_meas, 1e-9)))
    out["kernel_overhead"] = node
    # AdamW's per-tensor cost: its step over many small tensors less the bytes it moves.
    moved = optimizer_step_time(64 * 64, 64, 4, replace(ideal, memory_efficiency=out["memory_efficiency"]))
    out["optimizer_overhead"] = max(0.0, probes["adamw_small"] - moved) / 64
    return out


def _fit_or_bound(sizes: Sequence[int], times: Sequence[float]) -> tuple[float, float]:
    """``fit_alpha_beta``; where the times do not grow with size (scheduling noise larger than the
    transfer, common with more processes than cores), a conservative bound instead: α the fastest
    time, and the largest buffer's time beyond α (at least 5 % of it) charged per byte."""
    try:
        return fit_alpha_beta(sizes, times)
    except ValueError:
        alpha = min(times)
        return alpha, max(times[-1] - alpha, 0.05 * times[-1]) / sizes[-1]


def _across_rounds(results: Sequence[dict], key: str, slowest: bool) -> float:
    """One compute figure from every rank's rounds: per round the slowest rank's (``slowest``:
    a time) or the median rank's (a rate), then the median over rounds (``ROUNDS``)."""
    per_round = []
    for i in range(len(results[0]["rounds"])):
        values = [r["rounds"][i][key] for r in results]
        per_round.append(max(values) if slowest else statistics.median(values))
    return statistics.median(per_round)

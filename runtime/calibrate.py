"""Measure this machine's cost profile for ``Cluster.local``: compute and gloo collectives.

Processes on one machine talking through gloo are nothing like GPUs on NVLink: gloo's
reduce-scatter is an all-reduce plus a local chunk (about twice a ring reduce-scatter's traffic),
latencies are tens of microseconds, and one core's matmul rate is a few tens of GFLOP/s. So for
the local cluster we measure rather than assume:

* compute — fp32 matmul FLOP/s of one process with one thread (the roofline's compute roof) and
  copy bandwidth (its memory roof);
* collectives — for each of all-reduce, all-gather, reduce-scatter and all-to-all, and for every
  group size a mesh axis can have (the divisors of ``world_size``, all groups of that size
  measured concurrently, as a mesh's axes run), the median time at several buffer sizes, fitted
  by least squares to ``α + β·S`` with ``S`` sized as in ``autopar.cost.comm``; the fits go into
  ``Link.measured``.

``measure_local(world_size)`` spawns the processes (``autopar.runtime.launch.spawn``), measures,
and returns a ``Cluster`` ready for ``autopar.plan``. It takes a few seconds. The α-β fits are
``autopar.cost.fit``'s.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import torch

from autopar.cluster import Cluster, Link
from autopar.cost.fit import fit_alpha_beta

__all__ = ["measure_local"]

DEFAULT_SIZES = (1 << 12, 1 << 16, 1 << 19, 1 << 21)


def _time(fn, repeats: int) -> float:
    import torch.distributed as dist

    samples = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def _probe(rank: int, world: int, sizes: Sequence[int], repeats: int) -> dict[str, object]:
    import torch.distributed as dist

    from autopar.runtime.compat import all_gather_into, all_to_all_into, reduce_scatter_into

    out: dict[str, object] = {}
    a = torch.randn(384, 384)
    b = torch.randn(384, 384)
    torch.mm(a, b)
    t = min(_time(lambda: torch.mm(a, b), repeats) for _ in range(3))
    out["flops"] = 2 * 384**3 / t
    big = torch.randn(1 << 22)
    dst = torch.empty_like(big)
    t = min(_time(lambda: dst.copy_(big), repeats) for _ in range(3))
    out["memory_bandwidth"] = 2 * big.numel() * 4 / t
    # Every group size a mesh axis can have: groups of `g` consecutive ranks, all measured at once
    # (as the axes of a mesh run concurrently).
    out["rows"] = {}
    for g in [d for d in range(2, world + 1) if world % d == 0]:
        groups = [dist.new_group(list(range(s, s + g))) for s in range(0, world, g)]
        group = groups[rank // g]
        rows: dict[str, list[tuple[int, float]]] = {
            k: [] for k in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
        }
        for nbytes in sizes:
            n = max(g, (nbytes // 4) // g * g)
            x = torch.randn(n)
            part = torch.empty(n // g)
            full = torch.empty(n)
            dist.all_reduce(x.clone(), group=group)  # warm up connections for this size
            rows["all_reduce"].append(
                (n * 4, _time(lambda x=x, gr=group: dist.all_reduce(x, group=gr), repeats))
            )
            rows["all_gather"].append(
                (n * 4, _time(lambda p=part, f=full, gr=group: all_gather_into(f, p, gr), repeats))
            )
            rows["reduce_scatter"].append(
                (n * 4, _time(lambda x=x, p=part, gr=group: reduce_scatter_into(p, x, gr), repeats))
            )
            rows["all_to_all"].append(
                (n * 4, _time(lambda x=x, f=full, gr=group: all_to_all_into(f, x, gr), repeats))
            )
        out["rows"][g] = rows
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


def measure_local(
    world_size: int, *, sizes: Sequence[int] = DEFAULT_SIZES, repeats: int = 7, timeout: float = 300.0
) -> Cluster:
    """A ``Cluster.local(world_size)`` whose compute and collective costs were measured here."""
    from autopar.runtime.launch import spawn

    results = spawn(_probe, world_size, tuple(sizes), repeats, timeout=timeout)
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
    flops = statistics.median(r["flops"] for r in results)
    bw = statistics.median(r["memory_bandwidth"] for r in results)
    ar_alpha, ar_beta = fits.get("all_reduce", (60e-6, 1e-9))
    base = Cluster.local(
        world_size,
        flops=flops,
        memory_bandwidth=bw,
        # The ring-formula fallback (other group sizes) uses the all-reduce fit.
        link_bandwidth=2 * (world_size - 1) / world_size / ar_beta if world_size > 1 else 1e9,
        link_latency=ar_alpha / max(2 * (world_size - 1), 1),
    )
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
        extra={"measured": {k: {"alpha_s": a, "beta_s_per_byte": b} for k, (a, b) in fits.items()}},
    )

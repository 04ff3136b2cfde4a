"""α-β costs of collectives on one mesh axis.

A collective over ``n`` devices of a ring on a link with latency α and per-device bandwidth B
costs ``steps·α + volume/B``, with the volumes of NCCL's performance notes
(``nccl-tests/doc/PERFORMANCE.md``, "bus bandwidth"): for a buffer of ``S`` bytes

* all-reduce:      2(n−1) steps, 2(n−1)/n · S bytes per device  (S = the full buffer)
* all-gather:       (n−1) steps,  (n−1)/n · S                    (S = the gathered output)
* reduce-scatter:   (n−1) steps,  (n−1)/n · S                    (S = the full input)
* all-to-all:       (n−1) steps,  (n−1)/n · S                    (S = one device's buffer)
* point-to-point:       1 step,          S

With ``n == 1`` every collective is free. A link with measured costs (``Link.measured``, e.g. gloo
on this machine, whose reduce-scatter is an all-reduce plus a local chunk and so is not ring
shaped) uses ``α + β·S`` from the measurement instead of the formula.
"""

from __future__ import annotations

from dataclasses import replace

from autopar.cluster import Link

__all__ = [
    "all_gather_cost",
    "all_reduce_cost",
    "all_to_all_cost",
    "bandwidth_only",
    "p2p_cost",
    "reduce_scatter_cost",
]


def bandwidth_only(link: Link) -> Link:
    """``link`` with no per-message latency (measured α zeroed too): the share of a collective
    fused into a larger one (a gradient bucket) pays bandwidth only."""
    return replace(link, latency=0.0, measured=tuple((c, m, 0.0, b) for c, m, _, b in link.measured))


def all_reduce_cost(nbytes: float, n: int, link: Link) -> float:
    """Ring all-reduce of an ``nbytes`` buffer over ``n`` devices."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    m = link.measured_cost("all_reduce", n)
    if m is not None:
        return m[0] + m[1] * nbytes
    return 2 * (n - 1) * link.latency + 2 * (n - 1) / n * nbytes / link.bandwidth


def all_gather_cost(nbytes: float, n: int, link: Link) -> float:
    """All-gather producing an ``nbytes`` buffer (each device contributes ``nbytes / n``)."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    m = link.measured_cost("all_gather", n)
    if m is not None:
        return m[0] + m[1] * nbytes
    return (n - 1) * link.latency + (n - 1) / n * nbytes / link.bandwidth


def reduce_scatter_cost(nbytes: float, n: int, link: Link) -> float:
    """Reduce-scatter of an ``nbytes`` input (each device keeps ``nbytes / n``)."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    m = link.measured_cost("reduce_scatter", n)
    if m is not None:
        return m[0] + m[1] * nbytes
    return (n - 1) * link.latency + (n - 1) / n * nbytes / link.bandwidth


def all_to_all_cost(nbytes: float, n: int, link: Link) -> float:
    """All-to-all where each device holds ``nbytes`` and keeps ``1/n`` of it."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    m = link.measured_cost("all_to_all", n)
    if m is not None:
        return m[0] + m[1] * nbytes
    return (n - 1) * link.latency + (n - 1) / n * nbytes / link.bandwidth


def p2p_cost(nbytes: float, link: Link) -> float:
    """One send/recv of ``nbytes``."""
    if nbytes <= 0:
        return 0.0
    return link.latency + nbytes / link.bandwidth

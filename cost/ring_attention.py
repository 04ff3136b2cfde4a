"""Ring attention's cost (context parallelism's point-to-point form,
``autopar.program.ring_attention``): the work of the busiest device at each step of the ring, and
the part of the passing of keys and values that the steps' compute does not hide.

**Work.** At step ``s`` device ``c`` attends its queries to the keys of its source ``(c − s) mod
n``. The devices step together — a device waits for its predecessor's keys — so each step lasts
as long as its busiest device's share, and the op as long as the sum over steps of those maxima:
:func:`striped_ring_share` states it as a fraction of a device's (query, key) pairs against the
whole sequence, the figure ``autopar.cost.compute.op_flops`` takes as ``causal``. Under a causal mask a
query piece sees the key pieces before it whole and its own under the mask (``(m + 1) / 2m`` of a
piece of ``m`` rows). Contiguous pieces leave the first device idle after its first step while the
last works every step (the sum of maxima is the whole dense work, about twice the balanced one);
striped pieces (one of each of ``k`` blocks) keep every device busy at every step — Megatron-Core's
load balancing (``2·cp`` chunks, device ``i`` holding ``i`` and ``2·cp − 1 − i``) does the same.

**Passing.** Each step but the last sends the device's current keys and values to its successor
while it computes (Liu et al., "Ring Attention with Blockwise Transformers", arXiv 2310.01889, §3:
the transfer is hidden while a block's compute outlasts it; Megatron-Core
``AttnFuncWithCPAndKVP2P``: the same overlap on a side stream). Backward sends the keys and values
again and, beside them, their gradients so far, and one last send returns the gradients to their
owners after the last step. Exposed time is what a transfer outlasts its step's compute by, the
steps' compute taken as equal shares of the op's:

``fwd: (n − 1) · max(0, t(kv) − F/n)``, ``bwd: (n − 1) · max(0, t(2·kv) − B/n) + t(kv)``

with ``t`` the time of one send of that many bytes to the next device of the axis
(``autopar.mesh.Mesh.p2p_cost``), ``kv`` the bytes of a device's keys and values, ``F`` and ``B``
the op's forward and backward compute on the busiest device.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["ring_exposed_time", "striped_ring_share"]


def striped_ring_share(length: int, blocks: int, n: int, causal: bool = True) -> float:
    """The sum over the ring's steps of the busiest device's causal (query, key) pairs, as a
    fraction of one device's rows against all ``length`` keys (1 without a mask), for a sequence
    split in ``blocks`` stripes over ``n`` devices (``Shard(d, blocks)``: device ``c`` holds piece ``c`` of ``m =
    length / (blocks · n)`` positions of every block). Query piece ``j`` sees key piece ``i`` whole
    where ``i < j``, or ``i = j`` and the source precedes the device; its own piece causally. At
    step 0 every device has ``m²·k(k−1)/2 + k·m(m+1)/2`` pairs; at each later step some device's
    source precedes it (the last device's always does), so the busiest has ``m²·k(k−1)/2 + k·m²``.
    Contiguous (``k = 1``): ``(n − ½)/n`` as ``m`` grows; one position a stripe (``m = 1``,
    striped attention, Brandon et al. arXiv 2311.09431): ``(R + 1)/2R`` for ``R`` rows a device,
    the balanced half."""
    if not causal:
        return 1.0
    k = blocks
    m = length // (k * n)
    if m <= 0:
        return 1.0
    base = m * m * k * (k - 1) / 2
    total = n * base + (n - 1) * k * m * m + k * m * (m + 1) / 2
    return total / (k * m * length)


def ring_exposed_time(
    n: int, kv_bytes: float, forward: float, backward: float, send: Callable[[float], float]
) -> tuple[float, float]:
    """Seconds of the ring's passing not hidden by its steps (module docstring), forward and
    backward: ``n`` devices, ``kv_bytes`` of keys and values per device, ``forward``/``backward``
    the op's compute on the busiest device, ``send(bytes)`` one transfer to the next device."""
    if n <= 1:
        return 0.0, 0.0
    fwd = (n - 1) * max(0.0, send(kv_bytes) - forward / n)
    bwd = (n - 1) * max(0.0, send(2 * kv_bytes) - backward / n) + send(kv_bytes)
    return fwd, bwd

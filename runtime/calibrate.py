"""Measure this machine for ``Cluster.local``: compute and gloo collectives (the runtime measures;
``autopar.cost.calibration`` fits the cost model to the measurements; ``autopar.measure_local``
does both and returns the ``Cluster``).

Processes on one machine talking through gloo are nothing like GPUs on NVLink: gloo's
reduce-scatter is an all-reduce plus a local chunk (about twice a ring reduce-scatter's traffic),
latencies are tens of microseconds, and one core's matmul rate is a few tens of GFLOP/s. So for
the local cluster we measure rather than assume:

* compute — fp32 matmul FLOP/s of one process with one thread (the roofline's compute roof) and
  copy bandwidth (its memory roof); then the probes the device model's efficiencies are fitted
  to, each timed forward and backward: a linear layer, causal attention, the memory-bound ops of
  a transformer layer — GeLU, LayerNorm, softmax, an add —, one node of a generated program (the
  per-op cost of running a program node) and AdamW over many small tensors and one large one;
  every rank probes at once, ``ROUNDS`` times;
* collectives — for each of all-reduce, all-gather, reduce-scatter and all-to-all, and for every
  group size a mesh axis can have (the divisors of ``world_size``, all groups of that size
  measured concurrently, as a mesh's axes run), the time per call of a burst of calls issued back
  to back (as a training step issues them) at several buffer sizes.

``measure(world_size)`` spawns the processes (``autopar.runtime.launch.spawn``) and returns what
each rank measured. Measuring and fitting take about 12 s (2 processes on a 2-core machine).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["measure"]

DEFAULT_SIZES = (1 << 12, 1 << 16, 1 << 19, 1 << 21)


STEADY_SECONDS = 0.1
"""How long each compute probe runs on every rank at once."""

ROUNDS = 3
"""How many times the compute probes are repeated; each probe's figure is the median over the
rounds of its slowest rank. With more processes than cores one round can land on a bad share of
them (4 processes on 2 cores: one calibration predicted a step 21 % slower than the next, whose
measured steps were the same to 0.1 %); the median of three drops such a round."""


def _steady(fn, seconds: float = STEADY_SECONDS) -> float:
    """Seconds per call of ``fn`` run back to back for about ``seconds`` on every rank at once
    (after a barrier): the rate a rank sustains while the others compute too, as in training —
    with more processes than cores, each gets its share of them. (A median of short timed calls
    would catch a rank while the others wait at a barrier, alone on a core.)"""
    import torch.distributed as dist

    fn()
    dist.barrier()
    n, t0 = 0, time.perf_counter()
    while True:
        fn()
        n += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= seconds:
            return elapsed / n


def _burst(fn, calls: int) -> float:
    """Seconds per call of ``calls`` collectives issued back to back after one barrier (every
    rank makes the same number of calls): what one costs inside a training step, where the ranks
    arrive together, rather than after each rank has been woken from a barrier."""
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls


def _roofs() -> dict[str, float]:
    """Matmul FLOP/s and copy bandwidth of this rank, every rank running them at once."""
    a = torch.randn(384, 384)
    b = torch.randn(384, 384)
    torch.mm(a, b)
    flops = 2 * 384**3 / _steady(lambda: torch.mm(a, b))
    big = torch.randn(1 << 22)
    dst = torch.empty_like(big)
    bandwidth = 2 * big.numel() * 4 / _steady(lambda: dst.copy_(big))
    return {"flops": flops, "memory_bandwidth": bandwidth}


def _probe(rank: int, world: int, sizes: Sequence[int], repeats: int, rounds: int) -> dict[str, object]:
    import torch.distributed as dist

    from autopar.runtime.compat import all_gather_into, all_to_all_into, reduce_scatter_into

    out: dict[str, object] = {"rounds": [_roofs() | _kernel_probes() for _ in range(rounds)]}
    out["probe_shapes"] = {"rows": PROBE_ROWS, "hidden": PROBE_HIDDEN, "attention": PROBE_ATTENTION}
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
                (n * 4, _burst(lambda x=x, gr=group: dist.all_reduce(x, group=gr), 3 * repeats))
            )
            rows["all_gather"].append(
                (n * 4, _burst(lambda p=part, f=full, gr=group: all_gather_into(f, p, gr), 3 * repeats))
            )
            rows["reduce_scatter"].append(
                (n * 4, _burst(lambda x=x, p=part, gr=group: reduce_scatter_into(p, x, gr), 3 * repeats))
            )
            rows["all_to_all"].append(
                (n * 4, _burst(lambda x=x, f=full, gr=group: all_to_all_into(f, x, gr), 3 * repeats))
            )
        out["rows"][g] = rows
    return out


def _kernel_probes() -> dict[str, float]:
    """Measured seconds of the probes that fit the device model's efficiencies (module docstring).
    Each is timed as training runs it: forward, then backward through autograd."""
    import torch.nn.functional as F

    def fwd_bwd(fn, *shapes: tuple[int, ...]) -> tuple[float, float]:
        xs = [torch.randn(*sh, requires_grad=True) for sh in shapes]
        out = fn(*xs)
        grad = torch.randn_like(out)
        t_f = _steady(lambda: fn(*xs))
        t_fb = _steady(lambda: fn(*xs).backward(grad))
        return t_f, max(t_fb - t_f, 1e-9)

    rows, hidden = PROBE_ROWS, PROBE_HIDDEN
    b, h, s, d = PROBE_ATTENTION
    got: dict[str, float] = {}
    got["linear"] = sum(fwd_bwd(F.linear, (rows, hidden), (3 * hidden, hidden), (3 * hidden,)))
    got["attention_fwd"], got["attention_bwd"] = fwd_bwd(
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        (b, h, s, d),
        (b, h, s, d),
        (b, h, s, d),
    )
    got["gelu"] = sum(fwd_bwd(F.gelu, (rows, 4 * hidden)))
    got["layer_norm"] = sum(
        fwd_bwd(lambda x, w, bb: F.layer_norm(x, (hidden,), w, bb), (rows, hidden), (hidden,), (hidden,))
    )
    got["softmax"] = sum(fwd_bwd(lambda x: x.softmax(-1), (rows, 4 * hidden)))
    got["add"] = sum(fwd_bwd(torch.add, (rows, 4 * hidden), (rows, 4 * hidden)))
    # A program node: one small op run by a generated fx program, as the per-rank programs run.
    g = torch.fx.Graph()
    v = g.placeholder("x")
    for _ in range(100):
        v = g.call_function(torch.ops.aten.add.Tensor, (v, 1.0))
    g.output(v)
    prog = torch.fx.GraphModule(torch.nn.Module(), g)
    one = torch.ones(4)
    got["node"] = _steady(lambda: prog(one)) / 100
    # AdamW (torch's default, foreach) over many small tensors and over one large one.
    for name, shapes in (("adamw_small", [(64,)] * 64), ("adamw_large", [(1 << 20,)])):
        params = [torch.nn.Parameter(torch.randn(*sh)) for sh in shapes]
        for p in params:
            p.grad = torch.randn_like(p)
        opt = torch.optim.AdamW(params, lr=1e-4)
        opt.step()
        got[name] = _steady(opt.step)
    return got


PROBE_ROWS, PROBE_HIDDEN = 2048, 256
"""Tokens and hidden size of the linear and memory-bound probes (a small transformer layer's)."""
PROBE_ATTENTION = (4, 4, 128, 64)
"""(batch, heads, sequence, head dim) of the attention probe."""


def measure(
    world_size: int,
    *,
    sizes: Sequence[int] = DEFAULT_SIZES,
    repeats: int = 7,
    rounds: int = ROUNDS,
    timeout: float = 300.0,
) -> list[dict[str, Any]]:
    """What ``world_size`` local gloo processes measure here, one dict per rank: ``rounds`` (the
    compute figures of each round: ``flops``, ``memory_bandwidth`` and each probe's seconds,
    ``ROUNDS`` of them), ``rows`` (group size -> collective kind -> ``(bytes, seconds per call)``
    at each of ``sizes``) and ``probe_shapes`` (the probes' sizes). ``autopar.cost.calibration``
    fits the cost model to them (``autopar.measure_local`` does both)."""
    from autopar.runtime.launch import spawn

    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    return spawn(_probe, world_size, tuple(sizes), repeats, rounds, timeout=timeout)

"""Measure this machine's cost profile for ``Cluster.local``: compute and gloo collectives.

Processes on one machine talking through gloo are nothing like GPUs on NVLink: gloo's
reduce-scatter is an all-reduce plus a local chunk (about twice a ring reduce-scatter's traffic),
latencies are tens of microseconds, and one core's matmul rate is a few tens of GFLOP/s. So for
the local cluster we measure rather than assume:

* compute — fp32 matmul FLOP/s of one process with one thread (the roofline's compute roof) and
  copy bandwidth (its memory roof); then, so that the device model's kernels cost what they cost
  here, the efficiencies the model charges them at, each the ratio of the model's own time for a
  probe (``autopar.cost.compute.op_kernels`` at efficiency 1) to the measured time: a linear
  layer forward and backward (``compute_efficiency``), causal attention forward and backward
  (``attention_efficiency``, ``attention_bwd_efficiency``), the memory-bound ops of a
  transformer layer — GeLU, LayerNorm, softmax, an add — forward and backward
  (``memory_efficiency``: a CPU core reaches far less than its copy bandwidth on ``erf`` or a
  row reduction), the per-op cost of running a program node (``kernel_overhead``) and AdamW's
  per-tensor cost (``optimizer_overhead``);
* collectives — for each of all-reduce, all-gather, reduce-scatter and all-to-all, and for every
  group size a mesh axis can have (the divisors of ``world_size``, all groups of that size
  measured concurrently, as a mesh's axes run), the time per call of a burst of calls issued back
  to back (as a training step issues them) at several buffer sizes, fitted
  by least squares to ``α + β·S`` with ``S`` sized as in ``autopar.cost.comm``; the fits go into
  ``Link.measured``.

``measure_local(world_size)`` spawns the processes (``autopar.runtime.launch.spawn``), measures,
and returns a ``Cluster`` ready for ``autopar.plan``. It takes about 12 s (2 processes on a
2-core machine). The α-β fits are ``autopar.cost.fit``'s.
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


def _device_fit(base: Cluster, probes: dict[str, float]) -> dict[str, float]:
    """The ``DeviceSpec`` efficiencies and overheads that make the device model's time for each
    probe its measured time (module docstring)."""
    from dataclasses import replace

    from autopar.cost.compute import KernelKind, TensorArg, kernel_time, op_kernels
    from autopar.cost.optimizer import optimizer_step_time

    ideal = replace(
        base.device,
        compute_efficiency=1.0,
        memory_efficiency=1.0,
        attention_efficiency=1.0,
        attention_bwd_efficiency=1.0,
        kernel_overhead=0.0,
        optimizer_overhead=0.0,
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

    rows, hidden = PROBE_ROWS, PROBE_HIDDEN
    f, b = model(
        "linear", [arg(rows, hidden), arg(3 * hidden, hidden), arg(3 * hidden)], [arg(rows, 3 * hidden)]
    )
    out = {"compute_efficiency": ratio(f + b, probes["linear"], KernelKind.GEMM)}
    bh, heads, s, d = PROBE_ATTENTION
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


def measure_local(
    world_size: int,
    *,
    sizes: Sequence[int] = DEFAULT_SIZES,
    repeats: int = 7,
    rounds: int = ROUNDS,
    timeout: float = 300.0,
) -> Cluster:
    """A ``Cluster.local(world_size)`` whose compute and collective costs were measured here
    (the compute probes ``rounds`` times: ``ROUNDS``)."""
    from autopar.runtime.launch import spawn

    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    results = spawn(_probe, world_size, tuple(sizes), repeats, rounds, timeout=timeout)
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
    base = base.with_device(**_device_fit(base, probes))
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

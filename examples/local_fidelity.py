"""Prediction against measurement on this machine: plans of one small GPT on 2 and 4 local gloo
processes, each predicted from the measured local cluster and then run.

    python examples/local_fidelity.py                    # 2 and 4 processes, every layout
    python examples/local_fidelity.py --world 2 --steps 30
    python examples/local_fidelity.py --world 4 --slow-link 50e6   # two nodes of 2, a slow link
    python examples/local_fidelity.py --world 4 --calibration c4.json   # measure once, reuse
    python examples/local_fidelity.py --world 2 --slow-device 3   # a mixed cluster: unequal shares

For each world size the machine is measured first (``autopar.measure_local``:
matmul rate, memory bandwidth, per-op overhead and every gloo collective's α-β, with all ranks
running at once as they will in training); then five plans are made on that cluster —

* ``dp`` — data parallelism: every weight replicated, the batch split (``mesh (world,)``);
* ``tp`` — Megatron-LM's tensor parallelism over all processes (``layouts.megatron(tp=world)``);
* ``zero3`` — ZeRO-3 as FSDP runs it (``layouts.fsdp``): weights stored sharded, gathered for use;
* ``pp`` — two pipeline stages, 1F1B over four micro-batches (the rest data-parallel);
* ``auto`` — ``autopar.plan``'s own choice;
* ``offload`` — ``dp`` with the optimizer state on the host (``offload_optimizer=True``,
  ``autopar.runtime.host_optimizer``: the gradients copied out, AdamW on the host's copies, the weights
  copied back; each phase's median is printed beside ``autopar.cost.offload``'s);
* ``activations`` — ``dp`` with the saved activations of every layer but the last copied to the
  host and back (``offload_activations``, ``passes.offload_activations``) —

With ``--slow-link B`` the processes stand for two nodes of ``world / 2`` each, joined by one NIC
per node of ``B`` bytes/s (``autopar.runtime.link_emulation``: a collective that crosses the nodes
completes no earlier than its bytes get through the nodes' NICs). The plans are made for that
cluster — the measured one with ``nodes=2`` and the slow link between the nodes — and two more
join them: ``hsdp`` (``layouts.fsdp(replicate=2)``: sharded inside a node, replicated across),
``tp2`` (``layouts.megatron(tp=world / 2)``: tensor parallelism inside a node, data parallelism
across), ``dp-ring`` (``dp`` with its gradient all-reduce held to one collective,
``Cluster.two_level=False``, where ``dp`` reduces in two levels: ``Plan.two_level``) and
``zero3-ring`` (``zero3`` with its gathers and reduce-scatters held to one collective each). The emulated NIC is a wire, not a core: its transfers overlap compute (``overlap_comm``).

With ``--slow-device F`` the processes stand for two nodes, the first's a device ``F`` times
slower (``autopar.runtime.device_emulation.SlowDevice``: every op but the collectives stretched
``F``-fold), planned as a mixed cluster (``slow_first_node``); the plans are ``DEVICE_LAYOUTS``:
equal data-parallel shares against unequal ones (``autopar.dp_shares``).

Each is run for ``--steps`` training steps (after warm-up) on processes of its own, one thread
each: forward, backward and ``AdamW.step()``; the step a rank sees is as slow as the slowest rank,
so each step's time is the maximum over ranks, and the figure is the median over steps. Printed per
plan: the predicted step (``plan.predicted.step_time``, the simulator's), the measured median, their
ratio, and whether the plans rank in the same order by prediction as by measurement (plans predicted
within 5 % of each other are a tie: ``auto`` often finds the ``dp`` layout itself).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings
from typing import Any

import torch

LAYOUTS = ("dp", "tp", "zero3", "pp", "auto", "offload", "activations")
NODE_LAYOUTS = ("dp", "dp-ring", "tp", "tp2", "zero3", "zero3-ring", "hsdp", "auto")
"""With ``--slow-link``: the pipeline's sends are not emulated (``emulate_nodes``), so no ``pp``."""
TIE = 0.05
"""Predictions closer than this (relative) are a tie: their order is not checked."""


def build(layers: int, hidden: int, seq: int, batch: int, seed: int = 0) -> tuple[Any, tuple]:
    from autopar.models import GPT, GPTConfig

    torch.manual_seed(seed)
    model = GPT(GPTConfig(n_layer=layers, n_head=4, n_embd=hidden, vocab_size=512, block_size=seq))
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 512, (batch, seq), generator=g)
    return model, (ids, torch.randint(0, 512, (batch, seq), generator=g))


def make_plan(layout: str, model: Any, inputs: tuple, cluster: Any) -> Any:
    import autopar

    world = cluster.world_size
    batch_split = {"args[0]": ("S(0)",), "args[1]": ("S(0)",)}
    if layout in ("dp-ring", "zero3-ring"):  # every collective as one, never in two levels
        from dataclasses import replace

        return make_plan(layout.removesuffix("-ring"), model, inputs, replace(cluster, two_level=False))
    if layout in ("dp", "offload", "activations"):
        fixed = {n: ("R",) for n, _ in model.named_parameters()} | batch_split
        if layout != "dp":  # this machine's memory as the processes' host (Cluster.local's host=True)
            from dataclasses import replace

            from autopar.cluster import local_host

            cluster = replace(cluster, host=local_host(cluster.device, world))
        layers = len(model.blocks) if layout == "activations" else 0
        return autopar.plan(
            model, inputs, cluster, mesh_shape=(world,), fixed=fixed, pp=1, offload_optimizer=layout == "offload",
            offload_activations=max(layers - 1, 0), recompute="none",
        )  # fmt: skip
    if layout == "tp":
        return autopar.layouts.megatron(model, inputs, cluster, tp=world)
    if layout == "tp2":
        return autopar.layouts.megatron(model, inputs, cluster, tp=world // 2)
    if layout == "zero3":
        return autopar.layouts.fsdp(model, inputs, cluster)
    if layout == "hsdp":
        return autopar.layouts.fsdp(model, inputs, cluster, replicate=2)
    if layout == "pp":
        fixed = {"args[0]": ("S(0)",), "args[1]": ("S(0)",)} if world > 2 else {}
        return autopar.plan(model, inputs, cluster, pp=2, microbatches=4, schedule="1f1b", fixed=fixed)
    return autopar.plan(model, inputs, cluster)


DEVICE_LAYOUTS = ("equal", "shares", "auto")
"""With ``--slow-device``: ``equal`` — data parallelism over every rank with ``--microbatches``
accumulated, each rank the same count (planned held to the floor: the slower node); ``shares`` —
the same with unequal data-parallel shares (``autopar.dp_shares``); ``auto`` — autopar's choice."""


def device_plan(layout: str, model: Any, inputs: tuple, cluster: Any, microbatches: int) -> Any:
    """A ``DEVICE_LAYOUTS`` plan on the mixed ``cluster`` (``slow_first_node``)."""
    import autopar

    world = cluster.world_size
    if layout == "equal":
        return autopar.plan(
            model, inputs, cluster.uniform(), pp=1, microbatches=microbatches, mesh_shape=(world,)
        )
    if layout == "shares":
        plan = autopar.plan(model, inputs, cluster, pp=1, microbatches=microbatches, mesh_shape=(world,))
        if plan.pipeline is None or not plan.pipeline.dp_shares:
            raise SystemExit("the shares layout came out with equal shares: see autopar.dp_shares's log")
        return plan
    return autopar.plan(model, inputs, cluster)


def two_nodes(cluster: Any, bandwidth: float) -> Any:
    """``cluster`` (measured, one node) as two nodes of half its processes, one NIC each of
    ``bandwidth`` bytes/s between them (the emulated link), the gloo link inside each."""
    from dataclasses import replace

    from autopar.devices import Link

    per = cluster.world_size // 2
    slow = Link(name="emulated NIC", bandwidth=bandwidth, latency=cluster.intra_node.latency)
    return replace(cluster, gpus_per_node=per, nodes=2, inter_node=slow, nics_per_node=1, overlap_comm=True)


def slow_first_node(cluster: Any, factor: float) -> Any:
    """``cluster`` (measured, one node) as two nodes of half its processes, the first a device
    ``factor`` times slower (its compute, memory bandwidth and per-op overheads; the emulated
    ``SlowDevice`` stretches every op alike), a mixed cluster (``Cluster.node_groups``)."""
    from dataclasses import replace

    from autopar.node_groups import NodeGroup, floor_device

    d = cluster.device
    slow = replace(
        d,
        name=f"{d.name} ÷ {factor:g}",
        peak_flops={k: v / factor for k, v in d.peak_flops.items()},
        memory_bandwidth=d.memory_bandwidth / factor,
        kernel_overhead=d.kernel_overhead * factor,
        host_overhead=d.host_overhead * factor,
    )
    per = cluster.world_size // 2
    groups = (
        NodeGroup(device=slow, nodes=1, intra_node=cluster.intra_node),
        NodeGroup(device=d, nodes=1, intra_node=cluster.intra_node),
    )
    return replace(
        cluster,
        gpus_per_node=per,
        nodes=2,
        inter_node=cluster.intra_node,
        node_groups=groups,
        device=floor_device([slow, d]),  # ranks in lockstep are held to the slower node
    )


def worker(
    rank: int,
    world: int,
    plans: dict[str, str],
    cluster: dict,
    shape: tuple,
    steps: int,
    link: Any = None,
    slow: float | None = None,
) -> dict:
    import contextlib

    import autopar
    from autopar.runtime.device_emulation import SlowDevice
    from autopar.runtime.link_emulation import emulate_nodes

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    out = {}
    for name, text in plans.items():
        plan = autopar.Plan.from_dict(json.loads(text))
        model, inputs = build(*shape)
        pm = autopar.parallelize(model, autopar.Cluster.from_dict(cluster), inputs, plan=plan)
        if link is not None:
            emulate_nodes(pm, link)
        opt = pm.optimizer(torch.optim.AdamW, lr=1e-4)  # on the host where the plan offloads it
        times, phases = [], []
        for i in range(steps + 3):
            torch.distributed.barrier()
            t0 = time.perf_counter()
            # The first node's ranks emulate its slower device (``--slow-device``).
            with SlowDevice(slow) if slow and rank < world // 2 else contextlib.nullcontext():
                loss = pm(*inputs)
                opt.zero_grad()
                loss.backward()
                opt.step()
            if i >= 3:  # warm-up
                times.append(time.perf_counter() - t0)
                if getattr(opt, "last", None):
                    phases.append(dict(opt.last))
        out[name] = times
        if phases:
            out[f"{name}:phases"] = {k: statistics.median(p[k] for p in phases) for k in phases[0]}
    return out


def calibrated(world: int, path: str | None) -> Any:
    """The measured local cluster of ``world`` processes: read from ``path`` where it exists, else
    measured (``autopar.measure_local``) and written there. With 4 processes on 2 cores one
    calibration can predict every step 20-30 % slower than the next (``runtime.calibrate.ROUNDS``):
    runs that share one calibration compare plans and links, not calibrations."""
    import os

    import autopar
    from autopar.api import measure_local

    if path and os.path.exists(path):
        with open(path) as f:
            cluster = autopar.Cluster.from_dict(json.load(f))
        if cluster.world_size != world:
            raise SystemExit(f"{path} calibrates {cluster.world_size} processes, not {world}")
        return cluster
    cluster = measure_local(world)
    if path:
        with open(path, "w") as f:
            json.dump(cluster.to_dict(), f)
    return cluster


def run(
    world: int,
    layouts: list[str],
    steps: int,
    shape: tuple,
    slow: float | None = None,
    calibration: str | None = None,
    slow_device: float | None = None,
    microbatches: int = 4,
) -> list[tuple[str, float, float, str]]:
    import tempfile

    from autopar.runtime.launch import spawn
    from autopar.runtime.link_emulation import EmulatedLink

    cluster = calibrated(world, calibration)
    link = None
    if slow is not None:
        cluster = two_nodes(cluster, slow)
        link = EmulatedLink.create(world // 2, slow, tempfile.gettempdir())
    if slow_device is not None:
        cluster = slow_first_node(cluster, slow_device)
    model, inputs = build(*shape)
    plans, what = {}, {}
    for name in layouts:
        plan = (
            device_plan(name, model, inputs, cluster, microbatches)
            if slow_device is not None
            else make_plan(name, model, inputs, cluster)
        )
        plans[name] = json.dumps(plan.to_dict())
        axes = " × ".join(f"{a}={n}" for a, n in zip(plan.mesh_axes, plan.mesh_shape))
        pipe = plan.pipeline
        what[name] = (f"pp={pipe.pp} m={pipe.microbatches} " if pipe else "") + axes
        if pipe is not None and pipe.dp_shares:
            what[name] += f", shares {':'.join(map(str, pipe.dp_shares))}"
        what[name] += f" (predicted {plan.predicted.step_time * 1e3:.1f} ms)"
    res = {  # each plan in processes of its own, as a user runs one
        name: spawn(
            worker, world, {name: text}, cluster.to_dict(), shape, steps, link, slow_device, timeout=1800
        )
        for name, text in plans.items()
    }
    rows = []
    for name in layouts:
        per_step = [max(r[name][i] for r in res[name]) for i in range(steps)]
        pred = json.loads(plans[name])["predicted"]["step_time"]
        rows.append((name, pred, statistics.median(per_step), what[name]))
        figures = json.loads(plans[name])["info"].get("offload")
        if figures and "to_host" in figures:  # the offloaded step's phases, rank 0's medians (cost.offload)
            got = res[name][0][f"{name}:phases"]
            print(
                f"  {name}: "
                + ", ".join(
                    f"{k} predicted {figures[f] * 1e3:.2f} ms, measured {got[k] * 1e3:.2f} ms"
                    for k, f in (
                        ("to_host", "to_host"),
                        ("host_step", "host_step"),
                        ("to_device", "to_device"),
                    )
                )
            )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, nargs="*", default=[2, 4])
    ap.add_argument(
        "--layout", nargs="*", default=None, choices=sorted(set(LAYOUTS + NODE_LAYOUTS + DEVICE_LAYOUTS))
    )
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--slow-link", type=float, default=None, metavar="BYTES_PER_S",
                    help="two emulated nodes joined by one NIC of this speed each")  # fmt: skip
    ap.add_argument("--slow-device", type=float, default=None, metavar="FACTOR",
                    help="two nodes, the first's processes emulating a device FACTOR times slower")  # fmt: skip
    ap.add_argument("--microbatches", type=int, default=4, help="with --slow-device: accumulated per rank")
    ap.add_argument("--calibration", default=None, metavar="FILE",
                    help="the measured cluster: read it from FILE, or measure and write it there")  # fmt: skip
    args = ap.parse_args()
    if args.calibration and len(args.world) > 1:
        ap.error("--calibration holds one world size's measurements: give one --world")
    if args.slow_device and args.slow_link:
        ap.error("--slow-device and --slow-link emulate one thing each: give one")
    layouts = args.layout or list(
        DEVICE_LAYOUTS if args.slow_device else NODE_LAYOUTS if args.slow_link else LAYOUTS
    )
    if args.slow_link and "pp" in layouts:
        ap.error("--slow-link emulates no pipeline sends: leave pp out")
    if args.slow_link and any(w % 2 or w < 4 for w in args.world):
        ap.error("--slow-link needs world sizes of 4 or more, even (two nodes of at least 2)")
    warnings.simplefilter("ignore")
    shape = (args.layers, args.hidden, args.seq, args.batch)
    print(f"GPT {args.layers} layers × {args.hidden}, batch {args.batch} × {args.seq}, vocabulary 512; "
          f"median of {args.steps} steps, the slowest rank's")  # fmt: skip
    for world in args.world:
        rows = run(
            world,
            layouts,
            args.steps,
            shape,
            args.slow_link,
            args.calibration,
            args.slow_device,
            args.microbatches,
        )
        link = (
            f", two nodes of {world // 2} joined by {args.slow_link / 1e6:g} MB/s NICs"
            if args.slow_link
            else f", two nodes of {world // 2}, the first {args.slow_device:g}× slower"
            if args.slow_device
            else ""
        )
        print(f"\n{world} processes{link}")
        print(f"  {'plan':<6} {'predicted':>10} {'measured':>10} {'pred/meas':>9}  layout")
        for name, pred, meas, what in rows:
            print(f"  {name:<6} {pred * 1e3:>8.1f}ms {meas * 1e3:>8.1f}ms {pred / meas:>9.2f}  {what}")
        by_pred = [r[0] for r in sorted(rows, key=lambda r: r[1])]
        by_meas = [r[0] for r in sorted(rows, key=lambda r: r[2])]
        worst = max(abs(r[1] / r[2] - 1) for r in rows)
        print(f"  order by prediction:  {' < '.join(by_pred)}")
        print(f"  order by measurement: {' < '.join(by_meas)}")
        # Plans predicted within TIE of each other (the same layout found twice, say) are not
        # ranked; every other pair must be measured in the order predicted.
        pairs = [(a, b) for a in rows for b in rows if a[1] * (1 + TIE) < b[1]]
        wrong = [(a[0], b[0]) for a, b in pairs if a[2] >= b[2]]
        print(f"  pairs predicted more than {TIE:.0%} apart: {len(pairs)}, measured in the predicted order: "
              f"{len(pairs) - len(wrong)}" + (f" (not: {wrong})" if wrong else ""))  # fmt: skip
        print(f"  largest error: {worst:.0%}")


if __name__ == "__main__":
    main()

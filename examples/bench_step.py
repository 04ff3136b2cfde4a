"""One plan's training step eager and compiled by Inductor, side by side in one run.

    python examples/bench_step.py                      # 2 gloo processes: a DP and a TP plan
    python examples/bench_step.py --layout tp --steps 30 --layers 2
    python examples/bench_step.py --gpu --make-plan gpu.plan.json   # here (OR-Tools): the GPU's plan
    python examples/bench_step.py --gpu --plan gpu.plan.json        # one GPU, NCCL, world size 1

On the CPU (``--world`` gloo processes, ``torch.set_num_threads(1)`` each) the plan of each layout
is made once — ``dp``: every weight replicated, the batch split; ``tp``: Megatron-LM's tensor
parallelism over all processes — and every rank builds two modules from it, ``parallelize(...)``
and ``parallelize(..., compile=True)`` (``autopar.passes.compile``), then trains them in
alternation, one AdamW step each, 3 warm-up steps and then ``--steps`` measured. Reported per
layout, medians over the measured steps of the slowest rank's time:

* program — the module's call and ``loss.backward()``: the forward and backward programs;
* step — the same plus the optimizer step (AdamW, not compiled in either);
* ratio — compiled / eager (the issue's goal: ≤ 0.8);
* comm — of the eager program's time, the share the rank spent blocked in collectives
  (``StepTimes.exposed_comm``): what compilation cannot shorten (the compiled program's waits are
  Inductor's and not timed);
* compile — the slowest rank's seconds in Inductor (``pm.compiled``), paid once at
  ``parallelize``.

On a GPU (``--gpu``, world size 1, NCCL) the rows are the model's own eager step, the model under
``torch.compile``, autopar's program eager without and with the fused Triton kernels, and
compiled; and the plan's predicted step time. Each module is built, measured and freed in turn.
The plan is made where OR-Tools is (``--make-plan``, the model on the meta device) and carried to
the GPU as JSON (``--plan``), as ``examples/gpu_checks.py`` does.
The CPU machine's Triton kernels are off (``autopar.passes.fusion``), so its eager row is the
plain ATen program.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch


def _model(n_layer: int, n_embd: int, seq: int, batch: int, vocab: int, seed: int = 0) -> tuple[Any, tuple]:
    from autopar.models import GPT, GPTConfig

    torch.manual_seed(seed)
    model = GPT(GPTConfig(n_layer=n_layer, n_head=4, n_embd=n_embd, vocab_size=vocab, block_size=seq))
    idx = torch.randint(0, vocab, (batch, seq))
    return model, (idx, torch.randint(0, vocab, (batch, seq)))


def _plan(layout: str, model: Any, inputs: tuple, cluster: Any) -> Any:
    import warnings

    import autopar

    world = cluster.world_size
    with (
        warnings.catch_warnings()
    ):  # the plan's audit judges Cluster.local's nominal speeds: not measured here
        warnings.simplefilter("ignore")
        if layout == "dp":
            fixed = {n: ("R",) for n, _ in model.named_parameters()}
            return autopar.plan(model, inputs, cluster, mesh_shape=(world,), fixed=fixed)
        return autopar.layouts.megatron(model, inputs, cluster, tp=world)


# ------------------------------------------------------------------------------------------- CPU


def cpu_worker(rank: int, world: int, plan_json: str, shape: tuple, steps: int) -> dict[str, Any]:
    import warnings

    import autopar

    warnings.simplefilter("ignore")
    plan = autopar.Plan.from_dict(json.loads(plan_json))
    cluster = autopar.Cluster.local(world)
    mods: dict[str, Any] = {}
    for name, compile_ in (("eager", False), ("compiled", True)):
        model, inputs = _model(*shape)
        pm = autopar.parallelize(model, cluster, inputs, plan=plan, compile=compile_)
        pm.step.enable_timing()
        mods[name] = (pm, torch.optim.AdamW(pm.parameters(), lr=1e-4), inputs)
    times: dict[str, dict[str, list[float]]] = {n: {"program": [], "step": []} for n in mods}
    losses: dict[str, list[float]] = {n: [] for n in mods}
    for i in range(steps + 3):
        for name in ("eager", "compiled") if i % 2 == 0 else ("compiled", "eager"):
            pm, opt, inputs = mods[name]
            torch.distributed.barrier()
            t0 = time.perf_counter()
            loss = pm(*inputs)
            opt.zero_grad()
            loss.backward()
            t1 = time.perf_counter()
            opt.step()
            t2 = time.perf_counter()
            losses[name].append(loss.item())
            if i >= 3:  # warm-up
                times[name]["program"].append(t1 - t0)
                times[name]["step"].append(t2 - t0)
    report = mods["compiled"][0].compiled
    eager_times = mods["eager"][0].step.times[3:]
    return {
        "times": times,
        "comm": [t.exposed_comm / t.step for t in eager_times],
        "losses": losses,
        "compile": report.total_seconds if report is not None and report.compiled else float("nan"),
        "compiled": bool(report is not None and report.compiled),
        "why": "" if report is None else report.reason,
    }


def run_cpu(world: int, layout: str, steps: int, shape: tuple) -> dict[str, Any]:
    import autopar
    from autopar.runtime.launch import spawn

    model, inputs = _model(*shape)
    plan = _plan(layout, model, inputs, autopar.Cluster.local(world))
    res = spawn(cpu_worker, world, json.dumps(plan.to_dict()), shape, steps, timeout=1800)
    out: dict[str, Any] = {"compiled": all(r["compiled"] for r in res), "why": res[0]["why"]}
    for name in ("eager", "compiled"):
        for part in ("program", "step"):
            # A step is as slow as its slowest rank: the max over ranks, step by step.
            per_step = [max(r["times"][name][part][i] for r in res) for i in range(steps)]
            out[f"{part}_{name}"] = statistics.median(per_step)
    out["compile"] = max(r["compile"] for r in res)
    out["comm"] = statistics.median(statistics.mean(r["comm"][i] for r in res) for i in range(steps))
    a, b = res[0]["losses"]["eager"], res[0]["losses"]["compiled"]
    out["loss_diff"] = max(abs(x - y) / abs(x) for x, y in zip(a, b))
    return out


# ------------------------------------------------------------------------------------------- GPU


def _time_steps(step: Any, steps: int) -> float:
    """Median seconds of ``step()`` after 3 warm-up calls, the device synchronized around each."""
    times = []
    for i in range(steps + 3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def make_gpu_plan(shape: tuple, cluster_name: str, dtype: torch.dtype, path: str) -> None:
    """The GPU's one-device plan, the model built on the meta device (no GPU needed)."""
    import autopar

    with torch.device("meta"):
        model, _ = _model(*shape)
    model = model.to(dtype)
    inputs = tuple(torch.empty(shape[3], shape[2], dtype=torch.long, device="meta") for _ in range(2))
    plan = autopar.plan(model, inputs, autopar.Cluster.preset(cluster_name, gpus_per_node=1), mesh_shape=(1,))
    plan.save(path)
    print(f"wrote {path}: predicted step {plan.predicted.step_time * 1e3:.2f} ms on {cluster_name}")


def run_gpu(shape: tuple, steps: int, cluster_name: str, dtype: torch.dtype, plan_path: str) -> None:
    import datetime
    import gc
    import socket

    import torch.distributed as dist

    import autopar

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.cuda.set_device(0)
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
        timeout=datetime.timedelta(seconds=600),
    )  # fmt: skip
    cluster = autopar.Cluster.preset(cluster_name, gpus_per_node=1)
    rows: list[tuple[str, float, str]] = []

    def fresh() -> tuple[Any, tuple]:
        model, inputs = _model(*shape)
        return model.to(dtype), inputs

    def train_step(module: Any, opt: Any, inputs: tuple) -> Any:
        def step() -> None:
            loss = module(*inputs)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

        return step

    try:
        plan = autopar.Plan.load(plan_path)
        print(f"plan: predicted step {plan.predicted.step_time * 1e3:.2f} ms on {cluster_name}", flush=True)
        for name in ("model eager", "torch.compile(model)"):
            model, inputs = fresh()
            model = model.cuda()
            cuda_inputs = tuple(x.cuda() for x in inputs)
            module = torch.compile(model) if "compile" in name else model
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            t0 = time.perf_counter()
            train_step(module, opt, cuda_inputs)()  # torch.compile compiles on the first call
            torch.cuda.synchronize()
            first = time.perf_counter() - t0
            rows.append(
                (name, _time_steps(train_step(module, opt, cuda_inputs), steps), f"first step {first:.1f} s")
            )
            print(f"{name:<28} {rows[-1][1] * 1e3:9.2f} ms   {rows[-1][2]}", flush=True)
            del model, module, opt
            gc.collect()
            torch.cuda.empty_cache()
        for name, options in (
            ("autopar eager, no kernels", {"disable": ("fuse_kernels",)}),
            ("autopar eager, our kernels", {}),
            ("autopar compiled", {"compile": True}),
        ):
            model, inputs = fresh()
            pm = autopar.parallelize(model, cluster, inputs, plan=plan, **options)
            opt = torch.optim.AdamW(pm.parameters(), lr=1e-4)
            note = str(pm.compiled) if pm.compiled is not None else ""
            rows.append((name, _time_steps(train_step(pm, opt, inputs), steps), note))
            print(f"{name:<28} {rows[-1][1] * 1e3:9.2f} ms   {note}", flush=True)
            del model, pm, opt
            gc.collect()
            torch.cuda.empty_cache()
    finally:
        dist.destroy_process_group()
    base = dict((n, t) for n, t, _ in rows)
    print(
        f"compiled / autopar eager (kernels): {base['autopar compiled'] / base['autopar eager, our kernels']:.2f}"
    )
    print(
        f"compiled / torch.compile(model):    {base['autopar compiled'] / base['torch.compile(model)']:.2f}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--layout", nargs="*", default=["dp", "tp"], choices=["dp", "tp"])
    ap.add_argument("--steps", type=int, default=20, help="measured steps (at least 20)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument(
        "--gpu", action="store_true", help="one GPU, world size 1 (default shape: 12 × 768, 8 × 1024)"
    )
    ap.add_argument("--cluster", default="H100-SXM", help="device preset the GPU plan is made for")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"], help="GPU parameters")
    ap.add_argument(
        "--make-plan", metavar="FILE", help="--gpu: write the GPU's plan here and stop (needs OR-Tools)"
    )
    ap.add_argument("--plan", metavar="FILE", help="--gpu: the plan --make-plan wrote")
    args = ap.parse_args()
    if args.steps < 20:
        ap.error("--steps: at least 20 measured steps")
    if args.gpu:
        defaults = ap.parse_args([])
        gpu_shape = {
            "layers": 12 if args.layers == defaults.layers else args.layers,
            "hidden": 768 if args.hidden == defaults.hidden else args.hidden,
            "seq": 1024 if args.seq == defaults.seq else args.seq,
            "batch": args.batch,
            "vocab": 50304 if args.vocab == defaults.vocab else args.vocab,
        }
        shape = tuple(gpu_shape.values())
        dtype = getattr(torch, args.dtype)
        if args.make_plan:
            make_gpu_plan(shape, args.cluster, dtype, args.make_plan)
            return
        if not torch.cuda.is_available():
            ap.error("--gpu: no CUDA device here")
        if not args.plan:
            ap.error(
                "--gpu: give --plan FILE (written by --gpu --make-plan FILE where OR-Tools is installed)"
            )
        print(f"GPT {shape[0]} layers × {shape[1]}, batch {shape[3]} × {shape[2]}, vocabulary {shape[4]}, "
              f"{args.dtype}; 1 GPU ({torch.cuda.get_device_name()}), median of {args.steps} steps")  # fmt: skip
        run_gpu(shape, args.steps, args.cluster, dtype, args.plan)
        return
    shape = (args.layers, args.hidden, args.seq, args.batch, args.vocab)
    print(
        f"GPT {args.layers} layers × {args.hidden}, batch {args.batch} × {args.seq}, vocabulary {args.vocab}; "
        f"{args.world} gloo processes, 1 thread each; median of {args.steps} steps (slowest rank)"
    )
    print(
        f"{'layout':>6} {'program eager':>14} {'compiled':>10} {'ratio':>6}   {'step eager':>11} {'compiled':>10} "
        f"{'ratio':>6}   {'comm':>5}   {'compile':>8}  {'loss rel. diff':>14}"
    )
    for layout in args.layout:
        s = run_cpu(args.world, layout, args.steps, shape)
        if not s["compiled"]:
            print(f"{layout:>6} not compiled: {s['why']}", flush=True)
            continue
        print(
            f"{layout:>6} {s['program_eager'] * 1e3:>12.1f}ms {s['program_compiled'] * 1e3:>8.1f}ms "
            f"{s['program_compiled'] / s['program_eager']:>6.2f}   {s['step_eager'] * 1e3:>9.1f}ms "
            f"{s['step_compiled'] * 1e3:>8.1f}ms {s['step_compiled'] / s['step_eager']:>6.2f}   "
            f"{s['comm']:>5.0%}   {s['compile']:>7.1f}s  {s['loss_diff']:>14.1e}",
            flush=True,
        )


if __name__ == "__main__":
    main()

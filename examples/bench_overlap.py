"""Communication overlap, measured side by side: the overlap passes on vs off, same plan, same
processes, one step of each in turn.

    python examples/bench_overlap.py                      # DP and ZeRO-3 on 2 and 4 processes
    python examples/bench_overlap.py --world 2 --layout dp --steps 30

For each layout the plan is made once; every rank builds two modules from it, one with the
rank-program passes (``bucket_gradients``, ``prefetch_params``, ``sink_waits``) and one with them
turned off (``PlanConfig.disable``; ZeRO-3 still gathers again in backward in both, that is
memory, not overlap), and trains them in alternation, ``torch.set_num_threads(1)`` per rank.
Reported per layout (medians over the steps, the slowest rank's step):

* step — forward call to the end of backward, plus the optimizer step;
* exposed communication — time the rank blocked in ``wait_tensor`` (``StepTimes``);
* hidden — 1 − exposed(on) / exposed(off): the share of the unoverlapped communication that
  the passes hid behind compute;
* ratio — step(on) / step(off).

The model (our GPT) is sized so that communication is a large share of the unoverlapped step.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

OVERLAP_PASSES = ("bucket_gradients", "prefetch_params", "sink_waits")


def _model(n_layer: int, n_embd: int, seq: int, batch: int, seed: int = 0) -> tuple[Any, tuple]:
    from autopar.models import GPT, GPTConfig

    torch.manual_seed(seed)
    model = GPT(GPTConfig(n_layer=n_layer, n_head=4, n_embd=n_embd, vocab_size=256, block_size=seq))
    idx = torch.randint(0, 256, (batch, seq))
    return model, (idx, torch.randint(0, 256, (batch, seq)))


def _plan(layout: str, model: Any, inputs: tuple, world: int) -> Any:
    import autopar

    cluster = autopar.Cluster.local(world)
    if layout == "dp":
        fixed = {n: ("R",) for n, _ in model.named_parameters()}
        return autopar.plan(model, inputs, cluster, mesh_shape=(world,), fixed=fixed)
    # ZeRO-3 as FSDP runs it: every parameter stored sharded, gathered whole for each use.
    return autopar.layouts.fsdp(model, inputs, cluster)


def worker(rank: int, world: int, plan_json: str, shape: tuple, steps: int) -> dict[str, Any]:
    import warnings

    import autopar

    warnings.simplefilter("ignore")
    plan = autopar.Plan.from_dict(__import__("json").loads(plan_json))
    cluster = autopar.Cluster.local(world)
    mods = {}
    for name, disable in (("on", ()), ("off", OVERLAP_PASSES)):
        model, inputs = _model(*shape)
        pm = autopar.parallelize(model, cluster, inputs, plan=plan, disable=disable)
        assert pm.step is not None, "the whole step was not captured"
        pm.step.enable_timing()
        mods[name] = (pm, torch.optim.AdamW(pm.parameters(), lr=1e-4), inputs)
    times: dict[str, list[float]] = {"on": [], "off": []}
    for i in range(steps + 3):
        for name in ("on", "off") if i % 2 == 0 else ("off", "on"):
            pm, opt, inputs = mods[name]
            torch.distributed.barrier()
            t0 = time.perf_counter()
            loss = pm(*inputs)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if i >= 3:  # warm-up
                times[name].append(time.perf_counter() - t0)
    out = {}
    for name, (pm, _, _) in mods.items():
        exposed = [t.exposed_comm for t in pm.step.times[3:]]
        out[name] = {"step": times[name], "exposed": exposed, "loss": loss.item()}
    return out


def run(world: int, layout: str, steps: int, shape: tuple) -> dict[str, float]:
    import json

    from autopar.runtime.launch import spawn

    model, inputs = _model(*shape)
    plan = _plan(layout, model, inputs, world)
    res = spawn(worker, world, json.dumps(plan.to_dict()), shape, steps, timeout=900)
    summary = {}
    for name in ("on", "off"):
        # The step a rank sees is as slow as the slowest rank: take the max over ranks per step.
        steps_ = [max(r[name]["step"][i] for r in res) for i in range(steps)]
        exposed = [statistics.mean(r[name]["exposed"][i] for r in res) for i in range(steps)]
        summary[f"step_{name}"] = statistics.median(steps_)
        summary[f"exposed_{name}"] = statistics.median(exposed)
    summary["comm_share_off"] = summary["exposed_off"] / summary["step_off"]
    summary["hidden"] = 1 - summary["exposed_on"] / summary["exposed_off"] if summary["exposed_off"] else 0.0
    summary["ratio"] = summary["step_on"] / summary["step_off"]
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, nargs="*", default=[2, 4])
    ap.add_argument("--layout", nargs="*", default=["dp", "zero3"], choices=["dp", "zero3"])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    args = ap.parse_args()
    shape = (args.layers, args.hidden, args.seq, args.batch)
    print(
        f"GPT {args.layers} layers × {args.hidden}, batch {args.batch} × {args.seq}; median of {args.steps} steps"
    )
    print(
        f"{'world':>5} {'layout':>6} {'step off':>10} {'step on':>10} {'ratio':>6} "
        f"{'exposed off':>12} {'exposed on':>11} {'comm share':>10} {'hidden':>7}"
    )
    for world in args.world:
        for layout in args.layout:
            s = run(world, layout, args.steps, shape)
            print(
                f"{world:>5} {layout:>6} {s['step_off'] * 1e3:>8.1f}ms {s['step_on'] * 1e3:>8.1f}ms "
                f"{s['ratio']:>6.2f} {s['exposed_off'] * 1e3:>10.1f}ms {s['exposed_on'] * 1e3:>9.1f}ms "
                f"{s['comm_share_off']:>10.0%} {s['hidden']:>7.0%}",
                flush=True,
            )


if __name__ == "__main__":
    main()

"""``autopar plan``: capture a model, plan it on a cluster, print the plan and save it (with how
the model was built, so ``compare`` and ``report`` can rebuild it)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from autopar.commands.console import Console
from autopar.commands.loading import build_cluster, build_workload, capture_workload, plan_config
from autopar.commands.options import (
    CommandHelp,
    UsageError,
    add_command,
    cluster_args,
    model_args,
    planning_args,
)
from autopar.display import fmt_count

HELP = CommandHelp(
    summary="plan a model on a cluster and print (and save) the plan",
    examples="""
        autopar plan llama3-8b --cluster H100-SXM --nodes 8 --batch 64 --seq 8192 -o plan.json
        autopar plan llama3-8b --nodes 4,8,16 --batch 64 --seq 8192   # the same workload on three clusters
        autopar plan gpt2 --gpus-per-node 8 --batch 32 --mesh 4x2 --figures out/
        autopar plan config.json --batch 16 --seq 2048 --memory-budget 60GiB
        autopar plan mymodels:build --cluster local --gpus-per-node 4
    """,
)
"""What ``autopar plan --help`` says."""


def add_parser(subs: Any) -> None:
    """Add ``autopar plan`` to the subcommands ``subs``."""
    p = add_command(subs, "plan", HELP)
    model_args(p)
    cluster_args(p, several_nodes=True)
    planning_args(p)
    g = p.add_argument_group("output files")
    g.add_argument("-o", "--output", help="write the plan to this JSON file (with several --nodes: one file "
                   "per node count, named PLAN-<n>nodes.json)")  # fmt: skip
    g.add_argument("--figures", metavar="DIR", help="write the plan's pictures (PNG) to this directory")
    g.add_argument("--full", action="store_true", help="also print every module's placements")
    p.set_defaults(func=run)


def run(args: argparse.Namespace, console: Console) -> int:
    """Run ``autopar plan``; returns the exit status. With several node counts the workload is
    captured once and its micro-batch graphs shared by every plan; a table compares the plans."""
    from autopar.microbatch import MicrobatchCaptures

    counts: list[int] = args.nodes
    several = len(counts) > 1
    if several and args.batch is None:
        raise UsageError(
            f"--nodes {','.join(map(str, counts))} plans one workload on each cluster: give its --batch "
            "(the default, one sequence per device, differs from one cluster to the next)"
        )
    clusters = [build_cluster(argparse.Namespace(**{**vars(args), "nodes": n})) for n in counts]
    config = plan_config(args)
    w = build_workload(args, args.model, devices=clusters[0].world_size)
    cap = capture_workload(console, w)
    graphs = MicrobatchCaptures(w.model, w.example_inputs, whole=cap)
    rows = []
    for n, cluster in zip(counts, clusters):
        if several:
            print(f"\n=== {n} node(s): {cluster.world_size} devices ===")
        output = _numbered(args.output, n) if several and args.output else args.output
        figures = str(Path(args.figures) / f"{n}nodes") if several and args.figures else args.figures
        plan, seconds = _plan_one(args, console, w, cap, graphs, cluster, config, output, figures)
        rows.append((n, cluster.world_size, plan, seconds))
    if several:
        print()
        print(comparison(rows, w))
    return 0


def _numbered(path: str, nodes: int) -> str:
    """``plan.json`` → ``plan-8nodes.json``."""
    p = Path(path)
    return str(p.with_name(f"{p.stem}-{nodes}nodes{p.suffix or '.json'}"))


def _plan_one(
    args: argparse.Namespace,
    console: Console,
    w: Any,
    cap: Any,
    graphs: Any,
    cluster: Any,
    config: Any,
    output: str | None,
    figures: str | None,
) -> tuple[Any, float]:
    """Plan workload ``w`` on ``cluster``, print the plan and write its files; the plan and the
    seconds its planning took."""
    from autopar.audit import record
    from autopar.plan_search import plan_model

    t0 = time.perf_counter()
    with console.planning():
        plan = plan_model(w.model, w.example_inputs, cluster, config, captured=cap, graphs=graphs)
    seconds = time.perf_counter() - t0
    plan.info["workload"] = w.info
    record(plan, warn=False)  # saved with the plan; print(plan) below shows its findings
    print(f"model: {w.description or w.name}; {fmt_count(w.num_params)} parameters, {w.info['dtype']}; "
          f"batch {w.batch}" + (f" × {w.seq}" if w.seq else ""))  # fmt: skip
    print(plan)
    if args.full:
        print()
        print(plan.table(full=True))
    print(f"\nplanned in {seconds:.1f} s")
    if output:
        plan.save(output)
        print(f"wrote {output}")
    if figures:
        from autopar import viz

        for path in viz.plan_figures(plan, Path(figures)):
            print(f"wrote {path}")
    return plan, seconds


def comparison(rows: list[tuple[int, int, Any, float]], w: Any) -> str:
    """One line per node count: the layout chosen, the predicted step, tokens (or samples) per
    second, MFU (``autopar.audit``), memory per device, and the planning time."""
    from autopar.display import fmt_bytes

    unit = "tokens/s" if w.seq else "samples/s"
    per_step = w.batch * (w.seq or 1)
    head = ("nodes", "devices", "layout", "step", unit, "MFU", "memory", "planned")
    lines = [head]
    for n, devices, plan, seconds in rows:
        step = plan.predicted.step_time
        mfu = plan.info.get("audit", {}).get("mfu")
        lines.append((
            str(n), str(devices), layout_words(plan), f"{step * 1e3:.1f} ms", f"{per_step / step:,.0f}",
            f"{mfu * 100:.1f} %" if mfu else "-", fmt_bytes(plan.predicted.memory_per_device), f"{seconds:.1f} s",
        ))  # fmt: skip
    widths = [max(len(r[i]) for r in lines) for i in range(len(head))]
    out = [
        "  ".join(c.ljust(wd) if i == 2 else c.rjust(wd) for i, (c, wd) in enumerate(zip(r, widths)))
        for r in lines
    ]
    return "the workload on each cluster (predicted):\n" + "\n".join(out)


def layout_words(plan: Any) -> str:
    """``dp=32 × tp=2``, then ``pp=4 m=8 interleaved``, the recomputation where there is one."""
    words = [" × ".join(f"{a}={k}" for a, k in zip(plan.mesh_axes, plan.mesh_shape))]
    pipe = plan.pipeline
    if pipe is not None and (pipe.pp > 1 or pipe.microbatches > 1):
        words.append(f"pp={pipe.pp} m={pipe.microbatches}" + (f" {pipe.schedule}" if pipe.pp > 1 else ""))
    if plan.recompute != "none":
        layers = plan.recompute_layers
        words.append(
            f"recompute {plan.recompute}" + (f" ×{len(layers)} layers" if layers is not None else "")
        )
    return ", ".join(words)

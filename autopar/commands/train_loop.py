"""One rank of ``autopar train``: build the model (the same, seeded, on every rank), parallelize it
(rank 0 plans, or every rank loads ``--plan``), and run the training loop — AdamW, gradient
clipping, the loss and time of every step — into a **run record** (``autopar report --measured``
sets it against the prediction). A rank's failure comes back as one line, not a traceback."""

from __future__ import annotations

import argparse
import os
import time
import warnings
from dataclasses import dataclass
from typing import Any

from autopar.commands.console import drop_warning, one_line, show_warning
from autopar.commands.loading import build_cluster
from autopar.display import fmt_count


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainJob:
    """What every rank of ``autopar train`` needs (picklable: sent to spawned processes)."""

    model: str
    batch: int | None
    seq: int | None
    dtype: str
    layers: int | None
    overrides: dict[str, Any]
    cluster: str
    plan: str
    verify: bool
    save_plan: str
    steps: int
    lr: float
    debug: bool
    compile: bool = False


def train_rank(rank: int, world: int, job: TrainJob) -> dict[str, Any]:
    """One rank of ``autopar train``: build, parallelize (plan on rank 0 or load ``job.plan``),
    train; returns the run record (rank 0) or the error as one line, so the launcher reports every
    rank's failure in one line each instead of nested tracebacks."""
    with warnings.catch_warnings():
        # Every rank runs the same code and would print the same warnings: rank 0 prints them.
        warnings.showwarning = show_warning if rank == 0 else drop_warning
        try:
            return _train(rank, world, job)
        except Exception as exc:
            if job.debug:
                raise
            return {"error": one_line(exc)}


def _train(rank: int, world: int, job: TrainJob) -> dict[str, Any]:
    import statistics

    import torch

    import autopar
    from autopar import zoo
    from autopar.cluster import Cluster

    cuda = torch.cuda.is_available() and not job.cluster.startswith("local") and job.cluster != ""
    if cuda:  # parameters are materialized on this rank's GPU by parallelize (NCCL backend)
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if job.cluster in ("", "local"):
        cluster = Cluster.local(world)
    else:
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        ns = argparse.Namespace(
            cluster=job.cluster, nodes=max(1, world // per_node), gpus_per_node=min(per_node, world)
        )
        cluster = build_cluster(ns)
    plan = autopar.Plan.load(job.plan, verify=job.verify) if job.plan else None
    w = zoo.load(job.model, batch=job.batch or world, seq=job.seq, dtype=job.dtype, device="cpu", layers=job.layers,
                 overrides=job.overrides)  # fmt: skip
    model, inputs = w.model, w.example_inputs
    pm = autopar.parallelize(model, cluster, inputs, plan=plan, compile=job.compile or None)
    if rank == 0:
        print(f"model: {w.description or w.name}; {fmt_count(w.num_params)} parameters; batch {w.batch}"
              + (f" × {w.seq}" if w.seq else "") + f"; {world} processes")  # fmt: skip
        print(pm.plan)
        if pm.compiled is not None:
            print(f"step programs: {pm.compiled}")
        if job.save_plan:
            pm.plan.save(job.save_plan)
            print(f"wrote {job.save_plan}")
    opt = pm.optimizer(torch.optim.AdamW, lr=job.lr)  # on the host where the plan offloads it
    losses, times = [], []
    args, kwargs = (inputs, {}) if isinstance(inputs, tuple) else ((), inputs)
    for step in range(job.steps):
        t0 = time.perf_counter()
        out = pm(*args, **kwargs)
        loss = out if isinstance(out, torch.Tensor) else out["loss"]
        opt.zero_grad()
        loss.backward()
        pm.clip_grad_norm_(1.0)
        opt.step()
        losses.append(float(loss.detach()))
        times.append(time.perf_counter() - t0)
        if rank == 0:
            print(f"step {step}: loss {losses[-1]:.6f}  ({times[-1] * 1e3:.1f} ms)")
    record = {
        "model": w.info, "world": world, "fingerprint": pm.plan.fingerprint, "mesh": list(pm.plan.mesh_shape),
        "axes": list(pm.plan.mesh_axes), "cluster": cluster.describe(), "losses": losses, "step_times": times,
        "median_step_time": statistics.median(times[1:] if len(times) > 1 else times),
        "predicted_step_time": pm.plan.predicted.step_time,
        "predicted_memory_per_device": pm.plan.predicted.memory_per_device,
    }  # fmt: skip
    if pm.compiled is not None:
        record["compiled"] = pm.compiled.compiled
        record["compile_seconds"] = pm.compiled.seconds
    if cuda:
        record["peak_memory_per_device"] = torch.cuda.max_memory_allocated()
    return {"record": record}

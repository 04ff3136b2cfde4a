"""GPU checks (needs CUDA; no OR-Tools): what the cost model and the runtime claim, on one GPU.

1. Single-device training steps (bf16, eager, ``AdamW(fused=True)``) of several GPT and LLaMA
   shapes, measured as ``reference/h100_training_steps.csv`` was (median of 10 steps after 3
   warm-up, ``torch.cuda.synchronize`` around each phase, ``max_memory_allocated``), beside
   ``autopar.reference.predict_step`` on the device preset named by ``--preset``.
2. With ``--plan FILE`` (a 1-device plan saved where OR-Tools is installed, by ``--make-plan``):
   the per-rank program run on CUDA against eager PyTorch from the same weights, 3 AdamW steps
   (losses), then its step time against ``plan.predicted.step_time``.

    python examples/gpu_checks.py --make-plan gpt_full.plan.json --recompute full   # here (OR-Tools)
    python examples/gpu_checks.py --plan gpt_full.plan.json --cpu                   # a dry run here
    python examples/gpu_checks.py --preset H100-SXM [--plan gpt_full.plan.json]     # on the GPU

``--make-plan`` plans the model built on the meta device, as a large model is planned; the GPU
captures the real model on CUDA, and runs the plan only if the two are one program.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

import torch

import autopar
from autopar.reference import StepRow, build_step_model, predict_step

SHAPES = [  # (model, layers, heads, hidden, batch, seq): the two reference rows and two more
    ("gpt", 12, 16, 2048, 8, 1024),
    ("llama", 16, 32, 2048, 4, 2048),
    ("gpt", 24, 16, 1024, 16, 2048),
    ("llama", 8, 32, 4096, 2, 4096),
]


def _loss(out) -> torch.Tensor:
    """The loss of a GPT (a tensor, or ``(logits, loss)``) or a transformers model (``.loss``)."""
    if isinstance(out, torch.Tensor):
        return out
    return out[1] if isinstance(out, tuple) else out.loss


def _timed(fn) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t


def measure(row: StepRow) -> tuple[float, float, float]:
    model = build_step_model(row)[0].to_empty(device="cuda")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    ids = torch.randint(0, 32000, (row.batch, row.seq), device="cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)

    def fwd_bwd() -> None:
        out = model(ids, ids) if row.model == "gpt" else model(input_ids=ids, labels=ids)
        loss = _loss(out)
        loss.backward()

    torch.cuda.reset_peak_memory_stats()
    fb, op = [], []
    for i in range(13):
        a, b = _timed(fwd_bwd), _timed(opt.step)
        opt.zero_grad()
        if i >= 3:
            fb.append(a)
            op.append(b)
    peak = torch.cuda.max_memory_allocated()
    opt.state.clear()
    return statistics.median(fb), statistics.median(op), peak


def steps(preset: str) -> None:
    cluster = autopar.Cluster.preset(preset, gpus_per_node=1)
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | predicted on {preset}")
    print(f"{'shape':<32} {'fwd+bwd pred/meas ms':>22} {'ratio':>6} {'opt pred/meas ms':>18} {'ratio':>6} "
          f"{'peak pred/meas GiB':>20} {'ratio':>6}")  # fmt: skip
    for kind, layers, heads, hidden, batch, seq in SHAPES:
        row = StepRow(model=kind, layers=layers, heads=heads, hidden=hidden, batch=batch, seq=seq,
                      params=0, fwd_bwd_ms=0.0, optimizer_ms=0.0, peak_memory_bytes=0)  # fmt: skip
        est = predict_step(*build_step_model(row), cluster)
        try:
            fb, op, peak = measure(row)
        except torch.cuda.OutOfMemoryError:
            print(f"{row.name:<32} out of memory")
            continue
        g = 2**30
        print(f"{row.name:<32} {est.fwd_bwd * 1e3:>10.2f}/{fb * 1e3:<10.2f} {est.fwd_bwd / fb:>6.3f} "
              f"{est.optimizer * 1e3:>8.2f}/{op * 1e3:<8.2f} {est.optimizer / op:>6.3f} "
              f"{est.peak_memory / g:>9.2f}/{peak / g:<9.2f} {est.peak_memory / peak:>6.3f}", flush=True)  # fmt: skip


def runtime(path: str, device: str = "cuda") -> None:
    """``device="cpu"`` (gloo): a dry run of the same check here, losses only (no timings)."""
    import torch.distributed as dist

    from autopar.models import GPT, GPTConfig

    plan = autopar.Plan.load(path)
    meta = plan.info["gpu_check"]
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1)
    if device == "cuda":
        torch.cuda.set_device(0)
    torch.manual_seed(0)
    with torch.device(device):
        eager = GPT(GPTConfig(**meta["config"]))
    ids = torch.randint(0, meta["config"]["vocab_size"], (meta["batch"], meta["seq"]), device=device)
    model = copy.deepcopy(eager)
    pm = autopar.parallelize(model, autopar.Cluster.from_dict(plan.cluster), (ids, ids), plan=plan)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (eager, pm)]
    for step in range(3):
        losses = []
        for m, opt in zip((eager, pm), opts):
            out = m(ids, ids)
            loss = _loss(out)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        print(f"step {step}: eager {losses[0]:.7f} per-rank program ({plan.recompute}) {losses[1]:.7f} "
              f"rel {abs(losses[0] - losses[1]) / abs(losses[0]):.2e}", flush=True)  # fmt: skip
    if device != "cuda":
        dist.destroy_process_group()
        return
    for name, m, opt in (("eager", eager, opts[0]), ("per-rank program", pm, opts[1])):

        def one(m=m, opt=opt) -> None:
            out = m(ids, ids)
            _loss(out).backward()
            opt.step()
            opt.zero_grad()

        for _ in range(3):
            one()
        ts = [_timed(one) for _ in range(10)]
        print(f"{name}: median step {statistics.median(ts) * 1e3:.2f} ms", flush=True)
    print(f"predicted step (plan, {plan.recompute}): {plan.predicted.step_time * 1e3:.2f} ms")
    dist.destroy_process_group()


PLAN_MODEL = {"n_layer": 4, "n_head": 8, "n_embd": 512, "block_size": 512, "vocab_size": 8192, "dropout": 0.0}
PLAN_BATCH, PLAN_SEQ = 8, 512


def make_plan(path: str, preset: str, recompute: str) -> None:
    """The 1-device plan ``--plan`` runs, made from the model on the meta device."""
    from autopar.models import GPT, GPTConfig

    with torch.device("meta"):
        model = GPT(GPTConfig(**PLAN_MODEL))
        ids = torch.empty(PLAN_BATCH, PLAN_SEQ, dtype=torch.long)
    cluster = autopar.Cluster.preset(preset, gpus_per_node=1)
    plan = autopar.plan(model, (ids, ids), cluster, recompute=recompute, mesh_shape=(1,))
    plan.info["gpu_check"] = {"config": PLAN_MODEL, "batch": PLAN_BATCH, "seq": PLAN_SEQ}
    plan.save(path)
    print(f"{path}: {plan.recompute} recomputation, predicted step {plan.predicted.step_time * 1e3:.2f} ms "
          f"on {preset}, fingerprint {plan.fingerprint}")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="H100-SXM")
    ap.add_argument("--plan", help="a 1-device plan JSON to run on CUDA against eager")
    ap.add_argument("--make-plan", metavar="FILE", help="plan the --plan check's model here and save it")
    ap.add_argument("--recompute", default="full", help="with --make-plan: none, selective, full")
    ap.add_argument("--skip-steps", action="store_true")
    ap.add_argument("--cpu", action="store_true", help="with --plan: a dry run on the CPU (losses only)")
    args = ap.parse_args()
    if args.make_plan:
        make_plan(args.make_plan, args.preset, args.recompute)
        return
    if args.cpu:
        runtime(args.plan, "cpu")
        return
    if not torch.cuda.is_available():
        raise SystemExit("gpu_checks: no CUDA device here; run it on a GPU machine")
    if args.plan:
        runtime(args.plan)
    if not args.skip_steps:
        steps(args.preset)


if __name__ == "__main__":
    main()

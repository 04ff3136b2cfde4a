"""GPU checks (needs CUDA; no OR-Tools): what the cost model and the runtime claim, on one GPU.

1. Single-device training steps (bf16, eager, ``AdamW(fused=True)``) of several GPT and LLaMA
   shapes, measured as ``reference/h100_training_steps.csv`` was (median of 10 steps after 3
   warm-up, ``torch.cuda.synchronize`` around each phase, ``max_memory_allocated``), beside
   ``autopar.reference.predict_step`` on the device preset named by ``--preset``.
2. With ``--offload``: the offloaded optimizer step (``autopar.runtime.host_optimizer``) phase by phase
   against ``autopar.cost.offload``, with the preset's DGX host and with this machine's host
   measured.
3. With ``--plan FILE`` (a 1-device plan saved where OR-Tools is installed, by ``--make-plan``):
   the per-rank program run on CUDA against eager PyTorch from the same weights, 3 AdamW steps
   (losses), then its step time against ``plan.predicted.step_time``.
4. With ``--ring``: context parallelism's ring attention played on one GPU (``ring_check``): its
   block kernels against whole SDPA, and its busiest device's time per step against the cost
   model's share (``--cpu --ring``: the same, small, on the CPU).

    python examples/gpu_checks.py --make-plan gpt_full.plan.json --recompute full   # here (OR-Tools)
    python examples/gpu_checks.py --make-plan gpt_off.plan.json --recompute none --offload-activations 3
    python examples/gpu_checks.py --plan gpt_full.plan.json --cpu                   # a dry run here
    python examples/gpu_checks.py --preset H100-SXM [--plan gpt_full.plan.json]     # on the GPU

``--make-plan`` plans the model built on the meta device, as a large model is planned; the GPU
captures the real model on CUDA, and runs the plan only if the two are one program.
"""

from __future__ import annotations

import argparse
import copy
import functools
import os
import statistics
import time
from collections.abc import Sequence

import torch

import autopar
from autopar.reference import StepRow, build_step_model, predict_step

SHAPES = [  # (model, layers, heads, hidden, batch, seq, vocab): the two reference rows and two more
    ("gpt", 12, 16, 2048, 8, 1024, 0),
    ("llama", 16, 32, 2048, 4, 2048, 0),
    ("gpt", 24, 16, 1024, 16, 2048, 0),
    ("llama", 8, 32, 4096, 2, 4096, 0),
]
MCORE_SHAPES = [  # Megatron-Core's weak-scaling GPTs at their sequence and vocabulary (published_runs.csv):
    ("gpt", 24, 16, 2048, 1, 4096, 131072),  # GPT 1.7B whole, micro-batch 1 and 2
    ("gpt", 24, 16, 2048, 2, 4096, 131072),
    ("gpt", 8, 32, 4096, 1, 4096, 131072),  # GPT 7.1B's width, 8 of its 30 layers, no tp
]
MATMULS = [  # (M, N, K): the GEMMs of the GPT 1.7B and 7.1B (tp 2) rows at micro-batch 1, forward and weight grads
    (4096, 6144, 2048), (4096, 2048, 2048), (4096, 8192, 2048), (4096, 2048, 8192), (4096, 131072, 2048),
    (2048, 8192, 4096), (8192, 2048, 4096), (4096, 6144, 4096), (4096, 4096, 2048), (4096, 65536, 4096),
]  # fmt: skip
REF_MATMULS = [  # h100_matmul.csv's shapes, measured again the same way
    (8192, 8192, 8192), (8192, 2048, 2048), (2048, 6144, 2048), (4096, 4096, 1024), (16384, 50304, 2048),
]  # fmt: skip
FP32_MATMULS = [  # float32, at "highest" (plain FP32) and "high" (TF32): the --plan check's GEMMs and one large
    (8192, 8192, 8192), (4096, 1536, 512), (4096, 512, 512), (4096, 2048, 512), (4096, 512, 2048), (4096, 8192, 512),
]  # fmt: skip
ATTENTION = [  # (batch, heads, seq, head_dim): causal SDPA forward + backward
    (1, 16, 4096, 128), (1, 32, 4096, 128), (2, 16, 2048, 128), (1, 8, 8192, 128),
]  # fmt: skip


def _loss(out) -> torch.Tensor:
    """The loss of a GPT (a tensor, or ``(logits, loss)``) or a transformers model (``.loss``)."""
    if isinstance(out, torch.Tensor):
        return out
    return out[1] if isinstance(out, tuple) else out.loss


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(fn) -> float:
    _sync()
    t = time.perf_counter()
    fn()
    _sync()
    return time.perf_counter() - t


def measure(row: StepRow) -> tuple[float, float, float]:
    model = build_step_model(row)[0].to_empty(device="cuda")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    ids = torch.randint(0, 32000, (row.batch, row.seq), device="cuda")  # every vocabulary here is larger
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


def _per_call(fn, reps: int = 50) -> float:
    """Seconds per call of ``fn`` issued ``reps`` times back to back, between CUDA events (no
    host synchronisation inside: the launch gaps of a real step, not of a timed single call)."""
    for _ in range(3):
        fn()
    if not torch.cuda.is_available():
        return _timed(lambda: [fn() for _ in range(reps)]) / reps
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


def kernels(preset: str, device: str = "cuda") -> None:
    """GEMMs (bf16; float32 at both of PyTorch's matmul precisions) and causal attention at the
    published rows' shapes, predicted against measured."""
    import torch.nn.functional as F

    from autopar.cost.compute import BACKWARD_FLOP_RATIO, Kernel, KernelKind, gemm_efficiency, kernel_time

    dev = autopar.Cluster.preset(preset, gpus_per_node=1).device
    print(f"{'matmul M×N×K':<24} {'dtype':<16} {'pred TFLOP/s':>12} {'meas':>8} {'ratio':>6}")
    rows = [(*mnk, torch.bfloat16, "highest") for mnk in MATMULS + REF_MATMULS]
    rows += [(*mnk, torch.float32, p) for p in ("highest", "high") for mnk in FP32_MATMULS]
    before = torch.get_float32_matmul_precision()
    for m, n, k, dtype, precision in rows:
        torch.set_float32_matmul_precision(precision)
        a = torch.randn(m, k, device=device, dtype=dtype)
        b = torch.randn(k, n, device=device, dtype=dtype)

        def mm(a: torch.Tensor = a, b: torch.Tensor = b) -> None:
            a @ b

        meas = 2 * m * n * k / _per_call(mm) / 1e12
        key = "bfloat16" if dtype == torch.bfloat16 else ("float32" if precision == "highest" else "tfloat32")
        pred = gemm_efficiency(m, n, k, dev) * dev.flops_for(key) / 1e12
        what = key if dtype == torch.bfloat16 else f"fp32 {precision}"
        print(f"{f'{m}×{n}×{k}':<24} {what:<16} {pred:>12.1f} {meas:>8.1f} {pred / meas:>6.3f}", flush=True)
    torch.set_float32_matmul_precision(before)
    print(f"{'causal SDPA b,h,s,d':<24} {'pred fwd/bwd ms':>16} {'meas fwd/bwd ms':>16} {'ratios':>12}")
    for bsz, h, s, d in ATTENTION:
        q, k, v = (
            torch.randn(bsz, h, s, d, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in "qkv"
        )
        flops = 2.0 * bsz * h * s * s * 2 * d * (s + 1) / (2 * s)
        io = 4 * q.numel() * 2
        fk = Kernel(KernelKind.ATTENTION, io, flops, "bfloat16", seq=s, head_dim=d, causal=True)
        bk = Kernel(KernelKind.ATTENTION, 2 * io, BACKWARD_FLOP_RATIO["attention"] * flops, "bfloat16", seq=s,
                    head_dim=d, causal=True, backward=True)  # fmt: skip
        pf, pb = kernel_time(fk, dev), kernel_time(bk, dev)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        g = torch.randn_like(out)
        for _ in range(3):
            F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(g)

        def fwd(q: torch.Tensor = q, k: torch.Tensor = k, v: torch.Tensor = v) -> torch.Tensor:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        def fwd_bwd(fwd=fwd, g: torch.Tensor = g) -> None:
            fwd().backward(g)

        mf = [_per_call(fwd, 20)]
        mb = [_per_call(fwd_bwd, 20) - mf[0]]
        mf_, mb_ = statistics.median(mf), statistics.median(mb)
        print(f"{f'{bsz},{h},{s},{d}':<24} {pf * 1e3:>7.3f}/{pb * 1e3:<8.3f} {mf_ * 1e3:>7.3f}/{mb_ * 1e3:<8.3f} "
              f"{pf / mf_:>5.2f}/{pb / mb_:<5.2f}", flush=True)  # fmt: skip


OPT_SWEEP = [  # (tensors, elements each, dtype, fused): one optimizer.step() over them
    (1, 2**30, torch.bfloat16, True), (64, 2**24, torch.bfloat16, True), (1024, 2**20, torch.bfloat16, True),
    (8192, 2**17, torch.bfloat16, True), (1024, 2**20, torch.bfloat16, False), (256, 2**22, torch.float32, True),
    (256, 2**22, torch.float32, False), (64, 2**18, torch.float32, False),
]  # fmt: skip


def optimizer_sweep(preset: str) -> None:
    """AdamW steps over tensors of several counts and sizes (bandwidth and per-tensor cost apart)."""
    from autopar.cost.optimizer import OptimizerSettings, optimizer_step_time

    dev = autopar.Cluster.preset(preset, gpus_per_node=1).device
    print(
        f"{'AdamW tensors × elements':<30} {'dtype':<9} {'impl':<8} {'pred ms':>8} {'meas ms':>8} {'ratio':>6}"
    )
    for count, numel, dtype, fused in OPT_SWEEP:
        params = [torch.zeros(numel, device="cuda", dtype=dtype, requires_grad=True) for _ in range(count)]
        for p in params:
            p.grad = torch.randn_like(p)
        opt = torch.optim.AdamW(params, lr=1e-5, fused=fused, foreach=None if fused else True)
        for _ in range(2):
            opt.step()
        meas = statistics.median(_timed(opt.step) for _ in range(5))
        size = torch.empty((), dtype=dtype).element_size()
        pred = optimizer_step_time(count * numel, count, size, dev, OptimizerSettings(fused=fused))
        print(f"{f'{count} × {numel}':<30} {str(dtype)[6:]:<9} {'fused' if fused else 'foreach':<8} "
              f"{pred * 1e3:>8.2f} {meas * 1e3:>8.2f} {pred / meas:>6.3f}", flush=True)  # fmt: skip
        del opt, params
        torch.cuda.empty_cache()


OFFLOAD_SIZES = [(64, 4 << 20), (128, 8 << 20)]  # (tensors, elements each): 0.27 and 1.07 B bf16 parameters


def offload_check(preset: str) -> None:
    """The offloaded optimizer step (``autopar.runtime.host_optimizer``, bf16 weights, fp32 host state)
    phase by phase against ``autopar.cost.offload``: with the preset's DGX host, and with this
    machine's host measured (a pinned copy's bandwidth each way, a large host copy's DRAM rate)."""
    from autopar.cost.offload import offload_step_time
    from autopar.cost.optimizer import plan_settings
    from autopar.devices import HostSpec, Link
    from autopar.runtime.host_optimizer import HostOffloadOptimizer

    preset_host = autopar.Cluster.preset(preset, gpus_per_node=1).host
    big = torch.empty(256 << 20, dtype=torch.bfloat16, pin_memory=True)
    dev = torch.empty_like(big, device="cuda")
    d2h = statistics.median(_timed(lambda: big.copy_(dev, non_blocking=True)) for _ in range(5))
    h2d = statistics.median(_timed(lambda: dev.copy_(big, non_blocking=True)) for _ in range(5))
    a, b = torch.empty(512 << 20, dtype=torch.float32), torch.empty(512 << 20, dtype=torch.float32)
    dram = statistics.median(2 * a.numel() * 4 / _timed(lambda: b.copy_(a)) for _ in range(3))
    big_bytes = 256 * 2**20 * 2
    pcie = min(big_bytes / d2h, big_bytes / h2d)
    print(f"this host: pinned copies {big_bytes / d2h / 1e9:.1f} GB/s out, {big_bytes / h2d / 1e9:.1f} GB/s in; "
          f"DRAM copy {dram / 1e9:.1f} GB/s; threads {torch.get_num_threads()}")  # fmt: skip
    here = HostSpec(
        name="measured", memory=preset_host.memory, memory_bandwidth=dram,
        link=Link(name="PCIe(measured)", bandwidth=pcie, latency=10e-6),
        optimizer_efficiency=preset_host.optimizer_efficiency,
    )  # fmt: skip
    print(f"{'tensors × elements':<22} {'phase':<10} {'measured':>10} {'pred. DGX':>10} {'pred. here':>10}")
    for count, numel in OFFLOAD_SIZES:
        params = [
            torch.zeros(numel, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(count)
        ]
        for p in params:
            p.grad = torch.randn_like(p)
        opt = HostOffloadOptimizer(params, torch.optim.AdamW, lr=1e-5, synchronize=True)
        runs = []
        for _ in range(4):
            opt.step()
            runs.append(dict(opt.last))
        settings = plan_settings("adamw", 2)
        preds = [offload_step_time(count * numel, count, 2, h, 1, settings) for h in (preset_host, here)]
        for phase, field in (("to_host", "to_host"), ("host_step", "step"), ("to_device", "to_device")):
            meas = statistics.median(r[phase] for r in runs[1:])
            print(f"{f'{count} × {numel}':<22} {phase:<10} {meas * 1e3:>8.1f}ms "
                  + " ".join(f"{getattr(p, field) * 1e3:>8.1f}ms" for p in preds), flush=True)  # fmt: skip
        del opt, params
        torch.cuda.empty_cache()


def profile(shape: tuple[str, int, int, int, int, int, int]) -> None:
    """The CUDA kernels of one forward + backward of ``shape``, by total time (where a step goes)."""
    kind, layers, heads, hidden, batch, seq, vocab = shape
    row = StepRow(model=kind, layers=layers, heads=heads, hidden=hidden, batch=batch, seq=seq,
                  params=0, fwd_bwd_ms=0.0, optimizer_ms=0.0, peak_memory_bytes=0, vocab=vocab)  # fmt: skip
    model = build_step_model(row)[0].to_empty(device="cuda")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    ids = torch.randint(0, 32000, (batch, seq), device="cuda")

    def fwd_bwd() -> None:
        out = model(ids, ids) if kind == "gpt" else model(input_ids=ids, labels=ids)
        _loss(out).backward()
        model.zero_grad(set_to_none=True)

    for _ in range(3):
        fwd_bwd()
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        fwd_bwd()
        torch.cuda.synchronize()
    print(f"profile of {row.name}, one forward + backward:")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=70))
    model.to_empty(device="meta")
    torch.cuda.empty_cache()


def steps(preset: str, shapes: list[tuple[str, int, int, int, int, int, int]]) -> None:
    cluster = autopar.Cluster.preset(preset, gpus_per_node=1)
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | predicted on {preset}")
    print(f"{'shape':<40} {'fwd+bwd pred/meas ms':>22} {'ratio':>6} {'opt pred/meas ms':>18} {'ratio':>6} "
          f"{'peak pred/meas GiB':>20} {'ratio':>6}")  # fmt: skip
    for kind, layers, heads, hidden, batch, seq, vocab in shapes:
        row = StepRow(model=kind, layers=layers, heads=heads, hidden=hidden, batch=batch, seq=seq,
                      params=0, fwd_bwd_ms=0.0, optimizer_ms=0.0, peak_memory_bytes=0, vocab=vocab)  # fmt: skip
        est = predict_step(*build_step_model(row), cluster)
        try:
            fb, op, peak = measure(row)
        except torch.cuda.OutOfMemoryError:
            print(f"{row.name:<40} out of memory")
            continue
        g = 2**30
        torch.cuda.empty_cache()
        print(f"{row.name:<40} {est.fwd_bwd * 1e3:>10.2f}/{fb * 1e3:<10.2f} {est.fwd_bwd / fb:>6.3f} "
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
        torch.cuda.reset_peak_memory_stats()
        ts = [_timed(one) for _ in range(10)]
        peak = torch.cuda.max_memory_allocated() / 2**20
        print(
            f"{name}: median step {statistics.median(ts) * 1e3:.2f} ms, peak memory {peak:.0f} MiB",
            flush=True,
        )
    off = f", activations of {len(plan.offload_layers)} layers offloaded" if plan.offload_layers else ""
    print(f"predicted step (plan, {plan.recompute}{off}): {plan.predicted.step_time * 1e3:.2f} ms, "
          f"memory {plan.predicted.memory_per_device / 2**20:.0f} MiB")  # fmt: skip
    dist.destroy_process_group()


PLAN_MODEL = {"n_layer": 4, "n_head": 8, "n_embd": 512, "block_size": 512, "vocab_size": 8192, "dropout": 0.0}
PLAN_BATCH, PLAN_SEQ = 8, 512


def make_plan(path: str, preset: str, recompute: str, offload_activations: int = 0) -> None:
    """The 1-device plan ``--plan`` runs, made from the model on the meta device;
    ``offload_activations``: its first this many layers' activations on the host."""
    from autopar.models import GPT, GPTConfig

    with torch.device("meta"):
        model = GPT(GPTConfig(**PLAN_MODEL))
        ids = torch.empty(PLAN_BATCH, PLAN_SEQ, dtype=torch.long)
    cluster = autopar.Cluster.preset(preset, gpus_per_node=1)
    plan = autopar.plan(
        model, (ids, ids), cluster, recompute=recompute, mesh_shape=(1,),
        offload_activations=offload_activations, offload_optimizer=False,
    )  # fmt: skip
    plan.info["gpu_check"] = {"config": PLAN_MODEL, "batch": PLAN_BATCH, "seq": PLAN_SEQ}
    plan.save(path)
    print(f"{path}: {plan.recompute} recomputation, predicted step {plan.predicted.step_time * 1e3:.2f} ms "
          f"on {preset}, fingerprint {plan.fingerprint}")  # fmt: skip


LLAMA_1B = {  # LLaMA-3.2-1B's shape (transformers' LlamaForCausalLM, tied embeddings), random weights
    "hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
    "intermediate_size": 8192, "vocab_size": 128256, "max_position_embeddings": 2048, "tie_word_embeddings": True,
    "use_cache": False, "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0,
}  # fmt: skip
LLAMA_BATCH, LLAMA_SEQ = 4, 2048


def _llama(device: str) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(LlamaConfig(**LLAMA_1B, attn_implementation="sdpa")).to(torch.bfloat16)
    make = torch.empty if device == "meta" else torch.randint
    shape = (LLAMA_BATCH, LLAMA_SEQ)
    if device == "meta":
        ids, labels = (torch.empty(shape, dtype=torch.long, device="meta") for _ in "il")
    else:
        ids, labels = (make(0, LLAMA_1B["vocab_size"], shape, device=device) for _ in "il")
    return model, {"input_ids": ids, "labels": labels}


def make_llama_plans(prefix: str, preset: str) -> None:
    """World-size-1 plans of the 1B LLaMA: with the fused kernels (as a GPU plan assumes) and
    without (``disable=("fuse_kernels",)``), saved as ``PREFIX.fused.plan.json`` and
    ``PREFIX.eager.plan.json``."""
    cluster = autopar.Cluster.preset(preset, gpus_per_node=1)
    for name, disable in (("fused", ()), ("eager", ("fuse_kernels",))):
        model, inputs = _llama("meta")
        plan = autopar.plan(model, inputs, cluster, mesh_shape=(1,), recompute="none", disable=disable)
        plan.save(f"{prefix}.{name}.plan.json")
        print(f"{prefix}.{name}.plan.json: predicted step {plan.predicted.step_time * 1e3:.2f} ms, "
              f"peak {plan.predicted.memory_per_device / 2**30:.2f} GiB on {preset}")  # fmt: skip


LLAMA_VARIANTS = ("model", "torch.compile", "program", "kernels", "compiled")


def llama_steps(
    prefix: str, steps: int = 20, device: str = "cuda", variants: Sequence[str] = LLAMA_VARIANTS
) -> None:
    """The 1B LLaMA's training step on one GPU (AdamW fused, bf16), each of ``variants``: the model
    eager (``model``), the model under ``torch.compile``, and autopar's per-rank program (world
    size 1, NCCL) without the fused kernels (``program``), with them (``kernels``) and compiled by
    Inductor (``compiled``: ``parallelize(..., compile=True)``), against each plan's prediction;
    losses of 3 steps first, same weights."""
    import torch.distributed as dist

    unknown = sorted(set(variants) - set(LLAMA_VARIANTS))
    if unknown:
        raise SystemExit(
            f"gpu_checks: unknown --llama-variants {unknown}; known: {', '.join(LLAMA_VARIANTS)}"
        )
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29534")
    cuda = device == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    if cuda:
        torch.cuda.set_device(0)
    base, inputs = _llama(device)
    runs: list[tuple[str, torch.nn.Module, float | None]] = []
    if "model" in variants:
        runs.append(("model eager", base, None))
    if "torch.compile" in variants:
        runs.append(("torch.compile(model)", torch.compile(copy.deepcopy(base)), None))
    for variant, name, what, extra in (
        ("program", "eager", "per-rank program, no kernels", {"disable": ("fuse_kernels",)}),
        ("kernels", "fused", "per-rank program, kernels", {}),
        ("compiled", "fused", "per-rank program, compiled", {"compile": True}),
    ):
        if variant not in variants:
            continue
        plan = autopar.Plan.load(f"{prefix}.{name}.plan.json")
        cluster = autopar.Cluster.from_dict(plan.cluster)
        t0 = time.perf_counter()
        pm = autopar.parallelize(copy.deepcopy(base), cluster, inputs, plan=plan, **extra)
        if variant == "compiled":
            print(
                f"compile=True: parallelize took {time.perf_counter() - t0:.1f} s; {pm.compiled}", flush=True
            )
        runs.append((what, pm, plan.predicted.step_time))
    for name, m, pred in runs:
        opt = torch.optim.AdamW(m.parameters(), lr=1e-5, fused=cuda)

        def one(m=m, opt=opt) -> float:
            loss = _loss(m(**inputs))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.item()

        t0 = time.perf_counter()
        losses = [one() for _ in range(3)]
        first = time.perf_counter() - t0
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        ts = [_timed(one) for _ in range(steps)]
        peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
        p = f"{pred * 1e3:8.2f} ms predicted, ratio {pred / statistics.median(ts):.3f}" if pred else ""
        print(f"{name:<34} losses {' '.join(f'{x:.5f}' for x in losses)} | first 3 steps {first:6.1f} s | "
              f"median step {statistics.median(ts) * 1e3:8.2f} ms | peak {peak:6.2f} GiB | {p}", flush=True)  # fmt: skip
        del opt
        if cuda:
            torch.cuda.empty_cache()
    dist.destroy_process_group()


RING = [(1, 32, 8192, 128, 2), (1, 32, 8192, 128, 4), (1, 8, 32768, 128, 8)]
"""(batch, heads, seq, head_dim, ring devices): causal ring attention played on one GPU."""


def ring_check(device: str = "cuda", shapes: Sequence[tuple[int, int, int, int, int]] = RING) -> None:
    """Context parallelism's ring (``autopar.program.ring_attention``) on one device: every ring
    device's steps played in one process (``play_ring``: the block kernels — FlashAttention on
    CUDA in bf16 — with the merged log-sum-exp, no collectives) against whole causal SDPA, forward
    and backward; then the busiest device's attention per step, summed over the steps (the ring's
    devices step together), against the whole op's time over ``n`` — measured, and as
    ``cost.ring_attention.striped_ring_share`` predicts it."""
    from autopar.cost.ring_attention import striped_ring_share
    from autopar.program import ring_attention as RA

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    print(
        "\nring attention (causal, stripes of one position): errors against whole SDPA; busiest device per step"
    )
    for b, h, seq, d, n in shapes:
        gen = torch.Generator(device=device).manual_seed(0)
        q, k, v, dout = (
            torch.randn(b, h, seq, d, device=device, dtype=dtype, generator=gen) for _ in range(4)
        )
        blocks = seq // n  # stripes of one position, as the planner runs a causal ring
        pieces = [RA.stripes(seq, blocks, n, c) for c in range(n)]
        qr, kr, vr = (t.clone().requires_grad_(True) for t in (q, k, v))
        whole = torch.nn.functional.scaled_dot_product_attention(qr, kr, vr, is_causal=True)
        whole.backward(dout)
        got = RA.play_ring(q, k, v, dout, n, blocks, True)
        errs = [
            float((a.float() - r.detach().float()).norm() / r.detach().float().norm())
            for a, r in zip(got, (whole, qr.grad, kr.grad, vr.grad))
        ]
        rows = [torch.cat([torch.arange(lo, hi, device=device) for lo, hi in p]) for p in pieces]
        local = [(q[..., r, :], k[..., r, :], v[..., r, :]) for r in rows]
        per_step = []
        for s in range(n):
            times = []
            for c in range(n):
                plan = RA.step_plan(seq, blocks, n, c, (c - s) % n, True)
                step = functools.partial(RA.attend_step, local[c][0], *local[(c - s) % n][1:], plan, None)
                times.append(_per_call(step, 10) if plan else 0.0)
            per_step.append(max(times))
        whole_op = functools.partial(
            torch.nn.functional.scaled_dot_product_attention, q, k, v, is_causal=True
        )
        alone = _per_call(whole_op, 10)
        predicted = striped_ring_share(seq, blocks, n) / 0.5
        print(
            f"  {b}x{h}x{seq}x{d} over {n}: rel. errors out {errs[0]:.1e}, dq {errs[1]:.1e}, dk {errs[2]:.1e}, "
            f"dv {errs[3]:.1e}; forward {sum(per_step) * 1e3:.3f} ms = {sum(per_step) / (alone / n):.3f}× the whole "
            f"op's {alone * 1e3:.3f} ms over {n} (the cost model: {predicted:.3f}×)"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="H100-SXM")
    ap.add_argument("--plan", help="a 1-device plan JSON to run on CUDA against eager")
    ap.add_argument("--make-plan", metavar="FILE", help="plan the --plan check's model here and save it")
    ap.add_argument("--recompute", default="full", help="with --make-plan: none, selective, full")
    ap.add_argument(
        "--offload-activations", type=int, default=0, metavar="K",
        help="with --make-plan: the first K layers' activations offloaded to the host",
    )  # fmt: skip
    ap.add_argument("--skip-steps", action="store_true")
    ap.add_argument("--precision", help="torch.set_float32_matmul_precision first (highest, high, medium)")
    ap.add_argument(
        "--optimizer", action="store_true", help="also an AdamW sweep over tensor counts and sizes"
    )
    ap.add_argument(
        "--mcore", action="store_true", help="also the published rows' shapes: steps, GEMMs, attention"
    )
    ap.add_argument("--cpu", action="store_true", help="with --plan: a dry run on the CPU (losses only)")
    ap.add_argument(
        "--ring", action="store_true", help="also ring attention's steps on this GPU (--cpu: small)"
    )
    ap.add_argument(
        "--offload",
        action="store_true",
        help="also the offloaded optimizer step against autopar.cost.offload",
    )
    ap.add_argument("--make-llama", metavar="PREFIX", help="plan the 1B LLaMA step check here (two plans)")
    ap.add_argument(
        "--llama", metavar="PREFIX", help="run the 1B LLaMA step check on the GPU from those plans"
    )
    ap.add_argument("--llama-variants", default=",".join(LLAMA_VARIANTS), help="which --llama steps to run")
    args = ap.parse_args()
    if args.precision:
        torch.set_float32_matmul_precision(args.precision)
    if args.make_plan:
        make_plan(args.make_plan, args.preset, args.recompute, args.offload_activations)
        return
    if args.make_llama:
        make_llama_plans(args.make_llama, args.preset)
        return
    if args.cpu:
        if args.ring:
            ring_check("cpu", [(1, 4, 512, 32, 2), (1, 4, 1024, 32, 4)])
        if args.plan:
            runtime(args.plan, "cpu")
        return
    if not torch.cuda.is_available():
        raise SystemExit("gpu_checks: no CUDA device here; run it on a GPU machine")
    if args.plan:
        runtime(args.plan)
    if args.llama:
        llama_steps(args.llama, variants=args.llama_variants.split(","))
    if args.mcore:
        kernels(args.preset)
    if args.optimizer:
        optimizer_sweep(args.preset)
    if args.offload:
        offload_check(args.preset)
    if args.ring:
        ring_check()
    if not args.skip_steps:
        steps(args.preset, SHAPES + (MCORE_SHAPES if args.mcore else []))


if __name__ == "__main__":
    main()

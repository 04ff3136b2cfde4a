"""The autopar demo: plan a GPT for two nodes of eight A100s, compare with the best Megatron-LM
layout (``autopar.layouts.best_megatron``), then
train a small GPT on four local processes under the plan autopar chooses.

Part 1 (``plan_demo``): the model (a 12-layer, 1024-wide GPT with a 50k vocabulary, ~200M
parameters) is built on the meta device, so nothing is allocated: autopar plans from shapes alone.
One global batch is 32 sequences × 1024 tokens.

Part 2 (``train_demo``): four processes on this machine (gloo, one thread each) stand in for four
devices. autopar measures this machine's compute and collective costs, rank 0 plans a small GPT for
them and broadcasts the plan, every rank runs its generated program, and the loss of each step is
printed next to the loss of the same model trained in one process.

    python examples/demo.py             # both parts
    python examples/demo.py --plan-only # part 1
"""

from __future__ import annotations

import time
import warnings

import torch

import autopar
from autopar.models import GPT, GPTConfig

CONFIG = GPTConfig(n_layer=12, n_head=16, n_embd=1024, vocab_size=50304, block_size=1024)
BATCH, SEQ = 32, 1024


def _bytes(b: float) -> str:
    for unit, f in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if b >= f:
            return f"{b / f:.2f} {unit}"
    return f"{b:.0f} B"


def _line(name: str, plan: autopar.Plan) -> str:
    p = plan.predicted
    mesh = " × ".join(f"{a}={n}" for a, n in zip(plan.mesh_axes, plan.mesh_shape))
    return (
        f"  {name:<10} mesh {mesh:<12} step {p.step_time * 1e3:8.2f} ms   memory/device {_bytes(p.memory_per_device):>10}"
        f"   communication/step {_bytes(sum(p.comm_bytes_per_axis)):>10}"
    )


def plan_demo() -> None:
    """Plan the GPT automatically, then the best Megatron-LM layout, and compare."""
    cluster = autopar.Cluster.preset("A100-80GB", gpus_per_node=8, nodes=2)
    with torch.device("meta"):  # bf16, as it trains on GPUs (fp32 matmuls run on the slower FP32 units)
        model = GPT(CONFIG).to(torch.bfloat16)
    n_params = sum(p.numel() for p in model.parameters())
    idx = torch.empty(BATCH, SEQ, dtype=torch.long, device="meta")
    targets = torch.empty(BATCH, SEQ, dtype=torch.long, device="meta")  # a distinct tensor from idx
    print(
        f"model: GPT {CONFIG.n_layer} layers × {CONFIG.n_embd} wide, {n_params / 1e6:.0f}M parameters, bf16 (meta device)"
    )
    print(f"batch: {BATCH} × {SEQ} tokens; cluster: {cluster.describe()}")
    print()

    with warnings.catch_warnings():
        # Ops without a sharding rule run replicated; the plan lists them (printed below).
        warnings.filterwarnings("ignore", message="autopar: no sharding rule")
        t0 = time.perf_counter()
        plan = autopar.plan(model, (idx, targets), cluster)
        t_auto = time.perf_counter() - t0
        t0 = time.perf_counter()
        # The best Megatron-LM layout an expert reaches by tuning tp and sequence parallelism (pp=1
        # and no recomputation held, so the demo stays quick; layouts.best_megatron searches all).
        megatron = autopar.layouts.best_megatron(model, (idx, targets), cluster, pp=1, recompute="none")
        t_megatron = time.perf_counter() - t0
        rule = autopar.layouts.megatron(
            model, (idx, targets), cluster, tp=8
        )  # the rule of thumb: tp = a node

    print(plan.table(max_rows=30))
    print()
    tried = ", ".join(
        f"{tuple(m['mesh'])}: {m['objective'] * 1e3:.1f} ms"
        if m["feasible"]
        else f"{tuple(m['mesh'])}: slower (pruned)"
        if m.get("pruned")
        else f"{tuple(m['mesh'])}: infeasible"
        for m in plan.info["meshes_tried"]
    )
    print(f"meshes tried: {tried}")
    if plan.info.get("unruled_ops"):
        print(f"ops without a sharding rule (run replicated): {', '.join(plan.info['unruled_ops'])}")
    print(f"planning took {t_auto:.1f} s (best Megatron layout search {t_megatron:.1f} s)")
    print()
    print(megatron.summary())
    print()
    print("predicted per training step:")
    print(_line("autopar", plan))
    print(_line("Megatron", megatron) + f"   best of {len(megatron.info['megatron_candidates'])} layouts: "
          f"{megatron.info.get('layout', '')}")  # fmt: skip
    print(_line("tp=8", rule) + "   (rule of thumb, for context)")
    a, m = plan.predicted, megatron.predicted
    print(
        f"  autopar / best Megatron: step time ×{a.step_time / m.step_time:.2f} "
        f"({m.step_time / a.step_time:.2f}× faster), memory ×{a.memory_per_device / m.memory_per_device:.2f}, "
        f"communication ×{sum(a.comm_bytes_per_axis) / sum(m.comm_bytes_per_axis):.2f}"
    )


TRAIN_CONFIG = GPTConfig(n_layer=2, n_head=4, n_embd=64, vocab_size=256, block_size=64)
TRAIN_BATCH, TRAIN_SEQ, TRAIN_STEPS = 8, 64, 5


def _train_setup() -> tuple[torch.nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)  # every rank and the one-process reference build the same model and batch
    model = GPT(TRAIN_CONFIG)
    idx = torch.randint(0, TRAIN_CONFIG.vocab_size, (TRAIN_BATCH, TRAIN_SEQ))
    return model, (idx, torch.roll(idx, -1, dims=1))


def _train(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor], steps: int) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(steps):
        loss = model(*batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _train_worker(rank: int, world: int, cluster: autopar.Cluster) -> dict[str, object]:
    warnings.filterwarnings("ignore", message="autopar: no sharding rule")
    model, batch = _train_setup()
    pm = autopar.parallelize(model, cluster, batch)  # rank 0 plans and broadcasts the plan
    return {"losses": _train(pm, batch, TRAIN_STEPS), "summary": pm.plan.summary(), "code": pm.code}


def train_demo(world: int = 4) -> None:
    """Train a small GPT on ``world`` local processes and compare its losses with one process."""
    from autopar.api import measure_local
    from autopar.runtime.launch import spawn

    print(f"training a {TRAIN_CONFIG.n_layer}-layer GPT on {world} local processes (gloo, one thread each)")
    t0 = time.perf_counter()
    cluster = measure_local(world)
    ar = cluster.extra["measured"]["all_reduce"]
    print(
        f"  measured this machine in {time.perf_counter() - t0:.1f} s: "
        f"{cluster.device.flops_for('float32') / 1e9:.0f} GFLOP/s per process, all-reduce over {world}: "
        f"α = {ar['alpha_s'] * 1e6:.0f} µs, {1 / ar['beta_s_per_byte'] / 1e9:.2f} GB/s"
    )
    results = spawn(_train_worker, world, cluster, timeout=600)
    model, batch = _train_setup()
    reference = _train(model, batch, TRAIN_STEPS)
    print("  " + str(results[0]["summary"]).replace("\n", "\n  "))
    print(f"  {'step':>4}  {'1 process':>12}  {f'{world} processes':>12}  {'rel. diff':>9}")
    for i, (a, b) in enumerate(zip(reference, results[0]["losses"])):
        print(f"  {i:>4}  {a:>12.6f}  {b:>12.6f}  {abs(a - b) / abs(a):>9.1e}")


def main() -> None:
    import sys

    plan_demo()
    if "--plan-only" not in sys.argv:
        print()
        train_demo()


if __name__ == "__main__":
    main()

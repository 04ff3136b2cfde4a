"""The autopar demo: plan a GPT for two nodes of eight A100s and compare with Megatron-LM.

The model (a 12-layer, 1024-wide GPT with a 50k vocabulary, ~200M parameters) is built on the
meta device, so nothing is allocated: autopar plans from shapes alone. One global batch is
32 sequences × 1024 tokens.

    python examples/demo.py
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
    """Plan the GPT automatically, then as Megatron-LM lays it out (tp=8), and compare."""
    cluster = autopar.Cluster.preset("A100-80GB", gpus_per_node=8, nodes=2)
    with torch.device("meta"):
        model = GPT(CONFIG)
    n_params = sum(p.numel() for p in model.parameters())
    idx = torch.empty(BATCH, SEQ, dtype=torch.long, device="meta")
    targets = torch.empty(BATCH, SEQ, dtype=torch.long, device="meta")  # a distinct tensor from idx
    print(
        f"model: GPT {CONFIG.n_layer} layers × {CONFIG.n_embd} wide, {n_params / 1e6:.0f}M parameters (meta device)"
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
        megatron = autopar.layouts.megatron(model, (idx, targets), cluster, tp=8)
        t_megatron = time.perf_counter() - t0

    print(plan.table(max_rows=30))
    print()
    tried = ", ".join(
        f"{tuple(m['mesh'])}: {m['objective'] * 1e3:.1f} ms"
        if m["feasible"]
        else f"{tuple(m['mesh'])}: infeasible"
        for m in plan.info["meshes_tried"]
    )
    print(f"meshes tried: {tried}")
    if plan.info.get("unruled_ops"):
        print(f"ops without a sharding rule (run replicated): {', '.join(plan.info['unruled_ops'])}")
    print(f"planning took {t_auto:.1f} s (Megatron layout {t_megatron:.1f} s)")
    print()
    print(megatron.summary())
    print()
    print("predicted per training step:")
    print(_line("autopar", plan))
    print(_line("Megatron", megatron))
    a, m = plan.predicted, megatron.predicted
    print(
        f"  autopar / Megatron: step time ×{a.step_time / m.step_time:.2f} "
        f"({m.step_time / a.step_time:.2f}× faster), memory ×{a.memory_per_device / m.memory_per_device:.2f}, "
        f"communication ×{sum(a.comm_bytes_per_axis) / sum(m.comm_bytes_per_axis):.2f}"
    )


def main() -> None:
    plan_demo()


if __name__ == "__main__":
    main()

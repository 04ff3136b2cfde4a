"""Optimizer offload where memory is the bind: models too large for their devices with the AdamW
state on them, planned with it on the host (ZeRO-Offload, ``autopar.cost.offload``).

    python examples/offload.py [--workloads gpt-2.7b@A100-40GB:1 llama3-8b@H100-SXM:1]
                               [--no-baseline]

Each workload is ``model[:batch:seq]@preset:gpus`` on one node (bf16, meta device):

* ``gpt-2.7b`` — ``autopar.models.GPT`` at GPT-3's 2.7B shape (32 layers, width 2560, 32 heads),
  8 × 2048 tokens a step;
* ``llama3-8b`` (or any other ``autopar.zoo`` name) — the zoo's model (LLaMA-3-8B:
  ``LlamaForCausalLM``), 8 × 4096 tokens a step.

For each it prints autopar's plan (``autopar.plan``, offload left to the search), whether any plan
fits with the optimizer state on the device (``offload_optimizer=False``), and the best
Megatron-LM layout (``layouts.best_megatron``, which offloads as Megatron-Core's
``--optimizer-cpu-offload`` where nothing fits without it), each with its simulated step:
compute and collectives, exposed gradient reduction and the optimizer step — on the host, the
gradients out, the update and the weights back.
"""

from __future__ import annotations

import argparse
import time
import warnings
from typing import Any

import torch

import autopar
from autopar.display import fmt_bytes, fmt_time
from autopar.solver import InfeasibleError


def _workload(spec: str) -> tuple[torch.nn.Module, Any]:
    """``name`` or ``name:batch:seq`` (sequences a step and tokens each; default the docstring's)."""
    name, _, rest = spec.partition(":")
    b, _, q = rest.partition(":")
    if name == "gpt-2.7b":
        from autopar.models import GPT, GPTConfig

        with torch.device("meta"):
            model = GPT(GPTConfig(n_layer=32, n_head=32, n_embd=2560, vocab_size=50304, block_size=2048))
            model = model.to(torch.bfloat16)
        ids = torch.empty(int(b or 8), int(q or 2048), dtype=torch.long, device="meta")
        return model, (ids, ids.clone())
    from autopar import zoo  # any other name: the zoo's model (``autopar models`` lists them)

    w = zoo.load(name, batch=int(b or 8), seq=int(q or 4096))
    return w.model, w.example_inputs


def _line(label: str, plan: autopar.Plan, seconds: float) -> str:
    sim = plan.info.get("simulated", {})
    layout = f"mesh {dict(zip(plan.mesh_axes, plan.mesh_shape))}"
    if plan.pipeline is not None:
        layout += f", pp {plan.pipeline.pp} × {plan.pipeline.microbatches} mb"
    if plan.recompute != "none":
        layout += f", recompute {plan.recompute}"
    if plan.offload_optimizer:
        layout += ", optimizer on the host"
    if plan.offload_layers:
        layout += f", activations of {len(plan.offload_layers)} layers on the host"
    out = (
        f"  {label:<22} {fmt_time(plan.predicted.step_time):>10}  {layout}; memory {fmt_bytes(plan.predicted.memory_per_device)}"
        f" (planned in {seconds:.0f} s)\n"
        f"  {'':<22} compute and collectives {fmt_time(sim.get('compute_and_comm', 0.0))}, exposed gradient reduction "
        f"{fmt_time(sim.get('exposed_grad_sync', 0.0))}, optimizer {fmt_time(sim.get('optimizer', 0.0))}"
    )
    f = plan.info.get("offload") or {}
    if "to_host" in f:
        out += (
            f"\n  {'':<22} host: {fmt_time(f['to_host'])} gradients out + {fmt_time(f['host_step'])} update + "
            f"{fmt_time(f['to_device'])} weights back; {fmt_bytes(f['host_bytes_per_device'])} of host memory per device, "
            f"{fmt_bytes(f['device_bytes_saved'])} freed on it"
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", nargs="+", default=["gpt-2.7b@A100-40GB:1", "llama3-8b@H100-SXM:1"])
    ap.add_argument("--no-baseline", action="store_true", help="skip best_megatron")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    for spec in args.workloads:
        name, _, where = spec.partition("@")
        preset, _, gpus = where.partition(":")
        cluster = autopar.Cluster.preset(preset, gpus_per_node=int(gpus or 1))
        model, inputs = _workload(name)
        n = sum(p.numel() for p in model.parameters())
        print(f"{name} ({n / 1e9:.2f} B parameters) on {cluster.describe()}; host: {cluster.host.name}")
        t = time.perf_counter()
        plan = autopar.plan(model, inputs, cluster)
        print(_line("autopar", plan, time.perf_counter() - t))
        if plan.info.get("offload_reason"):
            print(f"  {'':<22} offloaded because {plan.info['offload_reason'].splitlines()[0][:160]}")
        t = time.perf_counter()
        try:
            kept = autopar.plan(model, inputs, cluster, offload_optimizer=False)
            print(_line("state on the device", kept, time.perf_counter() - t))
            print(
                f"  {'':<22} offload's speed-up: {kept.predicted.step_time / plan.predicted.step_time:.3f}×"
            )
        except InfeasibleError as e:
            print(f"  {'state on the device':<22} does not fit: {str(e).splitlines()[0][:150]}")
        if not args.no_baseline:
            t = time.perf_counter()
            try:
                mega = autopar.layouts.best_megatron(model, inputs, cluster)
                print(_line("best Megatron-LM", mega, time.perf_counter() - t))
                print(
                    f"  {'':<22} autopar against it: {mega.predicted.step_time / plan.predicted.step_time:.3f}×"
                )
            except InfeasibleError as e:
                print(f"  {'best Megatron-LM':<22} none fits: {str(e).splitlines()[0][:150]}")
        print()


if __name__ == "__main__":
    main()

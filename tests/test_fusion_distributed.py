"""The fused per-rank program trains like one process (``autopar.passes.fusion.fuse_kernels``, the
kernels under Triton's interpreter: ``conftest`` sets ``TRITON_INTERPRET=1`` and the spawned gloo
processes inherit it).

On 2 processes, two SGD steps of LLaMA under the Megatron layout (tp = 2: fused RMSNorm, rotary,
SwiGLU, the loss on gathered logits) and under a vocabulary-parallel plan (the loss fused as
``vocab_parallel_cross_entropy``, its all-reduces between the kernels), and of GPT-2 under data
parallelism (fused LayerNorm, GPT-2's tanh GeLU with the fc bias, the loss): the losses and the
parameters after are those of one process (``_runtime_helpers``' tolerances), and each rank's
traced step holds the fused ops' forward and backward nodes. ``disable=("fuse_kernels",)`` leaves
none.
"""

from __future__ import annotations

from typing import Any

import _runtime_helpers as H
import pytest

from autopar.ir import FusionKind
from autopar.runtime.launch import spawn

pytestmark = pytest.mark.filterwarnings("ignore:autopar")

STEPS = 2
FUSE = {"interpret_kernels": True, "kernels": tuple(k.value for k in FusionKind)}
"""On the CPU the kernels run under Triton's interpreter only when asked; every kind, the
residual add + LayerNorm too (measured slower than eager on a GPU, so off by default)."""

FUSED_OPS = {
    "llama megatron": {"add_rms_norm", "rotary", "swiglu", "cross_entropy"},
    "llama vocab-parallel": {
        "add_rms_norm",
        "rotary",
        "swiglu",
        "vocab_parallel_cross_entropy_stats",
        "vocab_parallel_cross_entropy",
    },
    "gpt2 dp": {"add_layer_norm", "bias_gelu", "cross_entropy"},
    "gpt2 dp unfused": set(),
    "gpt2 dp on the CPU by default": set(),
}
"""Per run: the ``autopar::`` ops whose forward and backward nodes the traced step must hold."""


def _fused_ops(pm: Any) -> set[str]:
    """Names of the ``autopar::`` custom ops in this rank's traced step (``…_backward`` ones
    stripped of the suffix: each must come with its forward)."""
    names = {
        str(n.target).split(".")[1]
        for n in pm.step.joint.graph.nodes
        if n.op == "call_function" and str(n.target).startswith("autopar.")
    }
    forward = {n for n in names if not n.endswith("_backward")}
    backward = {n.removesuffix("_backward") for n in names if n.endswith("_backward")}
    assert backward <= forward, (forward, backward)
    return forward


def fusion_worker(rank: int, world: int, runs: dict[str, tuple[str, Any, dict]]) -> dict[str, Any]:
    H.quiet()
    import autopar

    cluster = autopar.Cluster.local(world)
    out = {}
    for name, (kind, plan, options) in runs.items():
        model, inputs = H.build(kind)
        pm = autopar.parallelize(model, cluster, inputs, plan=plan, **options)
        assert pm.step is not None, f"{name}: the whole step was not captured"
        ops = _fused_ops(pm)
        losses = H.train(pm, inputs, H.make_optimizer("sgd", pm.parameters()), STEPS)
        out[name] = (ops, (losses, pm.full_state_dict()))
    return out


@pytest.mark.distributed
@pytest.mark.timeout(420)
def test_fused_programs_train_like_one_process() -> None:
    import autopar
    from autopar.graph import op_name
    from autopar.ir import Rewrite
    from autopar.planner import plan_captured

    cluster = autopar.Cluster.local(2)
    llama, llama_inputs = H.build("llama")
    gpt2, gpt2_inputs = H.build("gpt2")
    vocab_parallel = plan_captured(
        autopar.capture(llama, llama_inputs),
        cluster,
        autopar.PlanConfig(mesh_shape=(2,), fixed={"lm_head.weight": ("S(0)",)}),
        node_constraint=lambda n, s: op_name(n) != "cross_entropy_loss" or Rewrite.LOSS_CLASSES in s.rewrites,
    )
    dp = H.make_plan("dp", gpt2, gpt2_inputs, 2)
    runs = {
        "llama megatron": ("llama", H.make_plan("megatron", llama, llama_inputs, 2), FUSE),
        "llama vocab-parallel": ("llama", vocab_parallel, FUSE),
        "gpt2 dp": ("gpt2", dp, FUSE),
        "gpt2 dp unfused": ("gpt2", dp, {**FUSE, "disable": ("fuse_kernels",)}),
        "gpt2 dp on the CPU by default": ("gpt2", dp, {}),
    }
    refs = {kind: H.reference(kind, "sgd", STEPS) for kind in ("llama", "gpt2")}
    results = spawn(fusion_worker, 2, runs, timeout=400)
    problems = []
    for rank, by_run in enumerate(results):
        for name, (ops, got) in by_run.items():
            if ops != FUSED_OPS[name]:
                problems.append(
                    f"rank {rank}, {name}: fused ops {sorted(ops)}, expected {sorted(FUSED_OPS[name])}"
                )
            problems += H.compare_training(refs[runs[name][0]], got, "sgd", f"rank {rank}, {name}")
    assert not problems, "\n".join(problems)

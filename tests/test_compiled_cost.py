"""The cost of a step compiled by Inductor (``PlanConfig.compile``; ``autopar.passes.chains``,
``autopar.cost.compiled``).

* chains on a captured tiny GPT (fused kernels off, so its norms and GeLU are plain ops): each
  residual add joins its LayerNorm, GeLU is a chain of its own, matmuls and attention are never
  members, a run of views launches nothing;
* the compiled costs: every chain's share no more than its members' eager kernels, the step at
  least its GEMMs and attention (the compute-bound floor, unchanged), and a member's share the
  formula's bytes;
* ``autopar.plan(..., compile=True)``: recorded in the plan (and its JSON), a different prediction;
  ``PlanConfig(compile=...)`` validated;
* the calibration point: the 1B LLaMA of ``examples/gpu_checks.py`` on one H100, compiled against
  the fused kernels' step, 151.91 / 159.18 = 0.954 measured (torch 2.11).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import autopar
from autopar.capture import capture
from autopar.cost.compiled import ChainShare, chain_share_kernels
from autopar.cost.compute import KernelKind, TensorArg, kernel_time
from autopar.graph import OpFamily, op_family, op_name
from autopar.ir import COST
from autopar.passes import PassContext, run_passes
from autopar.passes.annotate import node_kernels
from autopar.passes.chains import CHAIN, CHAINS, Chain
from autopar.planner import GRAPH_PASSES

H100 = autopar.Cluster.preset("H100-SXM", gpus_per_node=1)
MEASURED_RATIO = 151.91 / 159.18
"""The 1B LLaMA's per-rank program on one H100 (torch 2.11), compiled / with the fused kernels."""


def _annotated(model: torch.nn.Module, inputs: Any, **config: Any) -> torch.fx.GraphModule:
    cap = capture(model, inputs)
    ctx = PassContext(captured=cap, cluster=H100, config=autopar.PlanConfig(**config))
    return run_passes(cap.gm, ctx, GRAPH_PASSES)


def _step(gm: torch.fx.GraphModule) -> float:
    return sum(n.meta[COST].fwd_time + n.meta[COST].bwd_time for n in gm.graph.nodes if COST in n.meta)


@pytest.fixture(scope="module")
def gpt_graphs() -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
    """A tiny GPT annotated eager and compiled, fused kernels off."""
    from autopar.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=32, vocab_size=128))
    idx = torch.randint(0, 128, (2, 32))
    off = ("fuse_kernels",)
    return _annotated(model, (idx, idx), disable=off), _annotated(
        model, (idx, idx), disable=off, compile=True
    )


def _ops(gm: torch.fx.GraphModule, chain: Chain) -> list[str]:
    by = {n.name: n for n in gm.graph.nodes}
    return [op_name(by[m]) for m in chain.members]


def test_chains_of_a_tiny_gpt(gpt_graphs) -> None:
    eager, compiled = gpt_graphs
    assert eager.meta[CHAINS] == () and not any(CHAIN in n.meta for n in eager.graph.nodes)
    chains: tuple[Chain, ...] = compiled.meta[CHAINS]
    kinds = [tuple(op for op in _ops(compiled, c) if op not in ("view", "getitem")) for c in chains]
    # two blocks: add + LayerNorm before attention and before the MLP each (the first reads the two
    # embeddings), GeLU on its own, the last add with the final LayerNorm
    assert kinds.count(("add", "layer_norm")) == 5, kinds
    assert kinds.count(("gelu",)) == 2, kinds
    for n in compiled.graph.nodes:
        fam = op_family(n) if n.op == "call_function" else None
        if fam in (OpFamily.MATMUL, OpFamily.ATTENTION, OpFamily.EMBEDDING, OpFamily.LOSS):
            assert CHAIN not in n.meta, n.format_node()
    first = next(c for c in chains if _ops(compiled, c) == ["add", "layer_norm"])
    assert first.inputs[:2] == ("embedding", "embedding_1")  # token and position embeddings
    assert set(first.outputs) == {"add", "layer_norm"}  # the residual stream and the matmul's input
    views = [c for c in chains if c.computing == 0]
    assert views and all(set(_ops(compiled, c)) <= {"view", "transpose", "split", "getitem"} for c in views)
    by = {n.name: n for n in compiled.graph.nodes}
    for c in views:  # no launch, no bytes
        assert all(_free(by[m]) for m in c.members), c.members


def _free(node: torch.fx.Node) -> bool:
    ks = node_kernels(node, compiled=True)
    return not ks.fwd and not ks.bwd


def test_compiled_costs_no_more_than_eager_and_no_less_than_the_compute_floor(gpt_graphs) -> None:
    eager, compiled = gpt_graphs
    e_nodes = {n.name: n for n in eager.graph.nodes}
    for c in compiled.meta[CHAINS]:
        by = {n.name: n for n in compiled.graph.nodes}
        share = sum(by[m].meta[COST].fwd_time + by[m].meta[COST].bwd_time for m in c.members)
        alone = sum(e_nodes[m].meta[COST].fwd_time + e_nodes[m].meta[COST].bwd_time for m in c.members)
        assert share <= alone * (1 + 1e-9), (c.members, share, alone)
    floor = 0.0
    for n in compiled.graph.nodes:
        if n.op == "call_function":
            ks = node_kernels(n, compiled=True)
            floor += sum(
                kernel_time(k, H100.device) for k in (*ks.fwd, *ks.bwd) if k.kind is not KernelKind.MEMORY
            )
    assert floor > 0
    assert floor <= _step(compiled) < _step(eager)


def test_a_members_share_is_its_boundary_bytes() -> None:
    x = TensorArg((8, 16), "bfloat16", grad=True)  # 256 bytes
    w = TensorArg((16,), "bfloat16", grad=True)  # broadcast: 32 bytes
    out = TensorArg((8, 16), "bfloat16")
    share = ChainShare(reads=(True, True), writes=True, extern_grads=2, launch_fwd=True, launch_bwd=False)
    ks = chain_share_kernels([x, w], [out], share, requires_grad=True)
    assert [k.nbytes for k in ks.fwd] == [256 + 32 + 256] and ks.fwd[0].launches == 1
    # backward: x and w again, the output's two gradients, x's gradient; w's a reduction of its own
    assert [k.nbytes for k in ks.bwd] == [256 + 32 + 2 * 256 + 256, 2 * 256 + 32]
    assert [k.launches for k in ks.bwd] == [0, 1]
    interior = ChainShare(reads=(False,), writes=False, extern_grads=0, launch_fwd=False, launch_bwd=False)
    inner = chain_share_kernels([x], [out], interior, requires_grad=True)
    assert inner.fwd == () and inner.bwd == ()  # an interior op costs nothing of its own


def test_plan_records_compile_and_predicts_the_compiled_step(make_llama, batch, tmp_path) -> None:
    model, inputs = make_llama(), batch(2, 32, 256)
    eager = autopar.plan(model, inputs, H100, mesh_shape=(1,), disable=("fuse_kernels",))
    compiled = autopar.plan(model, inputs, H100, mesh_shape=(1,), disable=("fuse_kernels",), compile=True)
    assert not eager.compile and compiled.compile
    assert compiled.predicted.step_time < eager.predicted.step_time
    assert "compiled by Inductor" in str(compiled) and "compiled by Inductor" not in str(eager)
    compiled.save(tmp_path / "p.json")
    assert autopar.Plan.load(tmp_path / "p.json").compile
    with pytest.raises(ValueError, match="compile is True or False, got 'yes'"):
        autopar.PlanConfig(compile="yes")


def test_llama_1b_compiled_against_the_measured_steps() -> None:
    """The plans ``gpu_checks.py --make-llama`` makes (world size 1), compiled and not.

    With the fused kernels, measured on one H100 (torch 2.11): 159.18 ms eager, 151.91 ms compiled
    (0.954). The model predicts 145.47 and 145.17 ms (0.998): beside the fused kernels, the chains
    left are the logits' cast to float32 (bounded on both sides: the matmul before it, the fused
    cross-entropy after it), the GQA key/value expansion feeding attention and views, which
    compiling cannot shorten; the rest of the measured gain is eager work of the per-rank program
    the model never charged (its eager step is 8.6 % under the measured one, its compiled 4.4 %).
    Held: compiled below eager and within 0.05 of the measured ratio; the compiled step within
    ±10 % of the measured one (as ``test_cost_calibration`` holds the reference steps).

    Without the kernels Inductor fuses the norms, SwiGLU, rotary and the loss itself: predicted
    149.1 ms against ``torch.compile(model)``'s measured 146.51 ms (the same fusions, made by
    Dynamo and Inductor from the model), held within ±10 %; eager 182.9 predicted, 203.26
    measured."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    from gpu_checks import _llama

    steps = {}
    for kernels in (True, False):
        for compile in (False, True):
            model, inputs = _llama("meta")
            disable = () if kernels else ("fuse_kernels",)
            plan = autopar.plan(
                model, inputs, H100, mesh_shape=(1,), recompute="none", compile=compile, disable=disable
            )
            assert plan.compile is compile and bool(plan.fusions) is kernels
            steps[kernels, compile] = plan.predicted.step_time
    ratio = steps[True, True] / steps[True, False]
    assert MEASURED_RATIO - 0.05 <= ratio < 1.0, ratio
    assert math.isclose(steps[True, True], 151.91e-3, rel_tol=0.10), steps
    assert steps[False, True] < steps[False, False]
    assert math.isclose(steps[False, True], 146.51e-3, rel_tol=0.10), steps

"""Kernel fusion (``autopar.passes.fusion``): the groups found by graph structure, the rewritten
program computing what eager computes, and the cost model charging each group one fused kernel.

* matcher — exact counts per kind (and per layer) on the captured graphs of transformers' GPT-2,
  LLaMA, Mistral and Qwen2 and of our GPT, and on this rank's lowered program of a tp = 2
  Megatron plan and a vocabulary-parallel plan (built without processes, as
  ``test_runtime_lower`` builds them); a member read outside its group blocks the group;
* numerics — ``fuse_kernels`` applied to a captured program (the kernels under Triton's
  interpreter, ``conftest`` sets ``TRITON_INTERPRET=1``) gives the eager loss and gradients at
  fp32 within 1e-5;
* cost — a fused group is charged exactly its kernel's traffic (the arithmetic is in the test), a
  GPU plan gets cheaper with fusion than with ``disable=("fuse_kernels",)``, a CPU cluster
  assumes no fusion, and the plan lists its fusions through a JSON round trip.

Training on gloo processes with the fused programs is ``test_fusion_distributed``.
"""

from __future__ import annotations

import copy
import json
import logging
import math
from collections import Counter
from typing import Any

import _runtime_helpers as H
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autopar
from autopar.capture import capture
from autopar.cost.compute import itemsize
from autopar.cost.fused_traffic import PARTIAL_ROWS
from autopar.graph import op_name, outer_instance
from autopar.ir import COST, Rewrite
from autopar.passes import PassContext, run_passes
from autopar.passes.fusion import (
    FUSION,
    FUSIONS,
    FusionKind,
    find_fusions,
    fuse_kernels,
    fusion_counts,
)
from autopar.passes.lower import lower
from autopar.passes.rank_compiler import propagate_fake
from autopar.placement import parse_spec
from autopar.planner import GRAPH_PASSES
from autopar.program import kernels as K
from autopar.program.collectives import AxisGroup
from autopar.runtime.shards import local_shard

pytestmark = pytest.mark.filterwarnings("ignore:autopar")

LN, RMS, GELU, SWIGLU, ROTARY, CE = (
    "add_layer_norm",
    "add_rms_norm",
    "bias_gelu",
    "swiglu",
    "rotary",
    "cross_entropy",
)
GPT_LIKE = {LN: 5, GELU: 2, CE: 1}
"""Two pre-norm layers: two norms each and the final one, one GeLU each, one loss."""
ALL_KERNELS = tuple(k.value for k in FusionKind)
"""Every fused kind, the residual add + LayerNorm too (off by default: measured slower than eager)."""
LLAMA_LIKE = {RMS: 5, SWIGLU: 2, ROTARY: 2, CE: 1}
"""Two layers: two norms each and the final one, SwiGLU and q/k rotary each, one loss (counts
are listed in ``FusionKind`` order, as the pass logs them)."""


def _lm(name: str) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """A tiny transformers causal LM (2 layers, hidden 32, 4 heads; GQA with 2 KV heads)."""
    import transformers

    torch.manual_seed(0)
    small = dict(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=64, vocab_size=64
    )
    cfg = getattr(transformers, f"{name}Config")(num_key_value_heads=2, use_cache=False, **small)
    ids = torch.randint(0, 64, (2, 8))
    return getattr(transformers, f"{name}ForCausalLM")(cfg), {"input_ids": ids, "labels": ids.clone()}


def _model(kind: str) -> tuple[nn.Module, Any]:
    if kind in ("Mistral", "Qwen2"):
        return _lm(kind)
    return H.build(kind)


# ------------------------------------------------------------------------------------- matcher


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        ("gpt2", GPT_LIKE),
        ("gpt", GPT_LIKE),
        ("llama", LLAMA_LIKE),
        ("Mistral", LLAMA_LIKE),
        ("Qwen2", LLAMA_LIKE),
    ],
)
def test_matcher_finds_every_group_of_the_zoo(kind: str, expected: dict[str, int]) -> None:
    model, inputs = _model(kind)
    graph = capture(model, inputs).gm.graph
    groups = find_fusions(graph)
    assert fusion_counts(groups) == expected
    # Per layer (the module the anchor runs in): two norms, one MLP activation, q/k rotary where
    # there is one; the final norm and the loss outside the layers.
    nodes = {n.name: n for n in graph.nodes}
    per_layer: dict[str, Counter] = {}
    for g in groups:
        stack = list(nodes[g.anchor].meta.get("nn_module_stack", {}).values())
        where = outer_instance(str(stack[-1][0])) if stack else ""
        per_layer.setdefault(where, Counter())[str(g.kind)] += 1
    layers = sorted(k for k in per_layer if k and k[-1].isdigit())
    assert len(layers) == 2, per_layer
    one = {k: 2 if k in (LN, RMS) else 1 for k in expected if k != CE}
    assert all(per_layer[name] == one for name in layers), per_layer
    rest = sum((c for k, c in per_layer.items() if k not in layers), Counter())
    assert rest == {next(iter(expected)): 1, CE: 1}, per_layer  # the final norm and the loss
    names = [n for g in groups for n in g.members]
    assert len(names) == len(set(names)), "a node is in two groups"
    by_kind = {k: [g for g in groups if g.kind == k] for k in FusionKind}
    norms = by_kind[FusionKind.ADD_LAYER_NORM] + by_kind[FusionKind.ADD_RMS_NORM]
    # Per layer: the first layer's first norm reads the embeddings (no residual add before it: in
    # GPT-2 a dropout, in our GPT a broadcast add of positions); every other norm fuses its add.
    assert [g.inputs[1] is not None for g in norms] == [False, True, True, True, True]
    assert all(g.outputs[1] for g in norms[1:]), "the residual stream is the fused op's second output"
    for g in by_kind[FusionKind.BIAS_GELU]:  # the fc bias moves from the GEMM into the fused op
        assert g.split_bias and g.inputs[1] is not None
        assert g.approximate == ("tanh" if kind == "gpt2" else "none")
    for g in by_kind[FusionKind.ROTARY]:  # q (4 heads) and k (2 heads) share cos and sin
        q, k, cos, sin = g.input_shapes
        assert (q[1], k[1]) == (4, 2) and q[2:] == k[2:] and cos == sin and cos[1] == 1
        assert len(g.members) == 14  # per tensor: x·cos, two slices, neg, cat, ·sin, add
    if kind in ("llama", "Mistral", "Qwen2"):  # pow, mean, add eps, rsqrt, mul, cast back, weight
        assert all(len(g.members) == 8 + (g.inputs[1] is not None) for g in norms)


def _lowered(kind: str, plan: autopar.Plan, model: nn.Module, inputs: Any) -> torch.fx.GraphModule:
    """Rank 0's lowered program of a 1-D ``plan``, with its values propagated (no processes: the
    axis group's name is made up; fake tensors never reach a process group)."""

    class NamedAxis(AxisGroup):
        @property
        def group_name(self) -> str:
            return f"axis{self.axis}"

    cap = capture(model, inputs)
    gm = lower(cap, plan, [NamedAxis(axis=0, name=plan.mesh_axes[0], size=2, coord=0, group=None)])
    named = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers())
    leaves = inputs if isinstance(inputs, dict) else {f"args[{i}]": v for i, v in enumerate(inputs)}
    values = []
    for ph in (n for n in gm.graph.nodes if n.op == "placeholder"):
        full = named.get(cap.params.get(ph.name, ""), buffers.get(cap.buffers.get(ph.name, "")))
        if full is None:
            full = leaves[cap.inputs[ph.name]]
        local = local_shard(full.detach(), parse_spec(plan.node(ph.name).outputs[0]), plan.mesh_shape, (0,))
        values.append(local.requires_grad_(ph.name in cap.params))
    propagate_fake(gm, values)
    return gm


def _vocab_parallel_plan(model: nn.Module, inputs: Any) -> autopar.Plan:
    """A 2-device plan whose loss is vocabulary-parallel (the head split by vocabulary rows)."""
    from autopar.planner import plan_captured

    return plan_captured(
        capture(model, inputs),
        autopar.Cluster.local(2),
        autopar.PlanConfig(mesh_shape=(2,), fixed={"lm_head.weight": ("S(0)",)}),
        node_constraint=lambda n, s: op_name(n) != "cross_entropy_loss" or Rewrite.LOSS_CLASSES in s.rewrites,
    )


@pytest.mark.parametrize(("kind", "expected"), [("llama", LLAMA_LIKE), ("gpt2", GPT_LIKE)])
def test_matcher_finds_the_groups_of_a_lowered_megatron_program(kind: str, expected: dict[str, int]) -> None:
    model, inputs = H.build(kind)
    plan = autopar.layouts.megatron(model, inputs, autopar.Cluster.local(2), tp=2)
    gm = _lowered(kind, plan, model, inputs)
    groups = find_fusions(gm.graph)
    assert fusion_counts(groups) == expected
    (ce,) = [g for g in groups if g.kind == FusionKind.CROSS_ENTROPY]
    assert not ce.lowered  # the plan gathers the logits: the plain loss
    if kind == "llama":  # column-parallel q/k/v: each rank rotates its 2 q heads and 1 k head
        rot = next(g for g in groups if g.kind == FusionKind.ROTARY)
        assert (rot.input_shapes[0][1], rot.input_shapes[1][1]) == (2, 1)


def test_matcher_finds_the_vocabulary_parallel_loss_of_a_lowered_program() -> None:
    model, inputs = H.build("llama")
    plan = _vocab_parallel_plan(model, inputs)
    gm = _lowered("llama", plan, model, inputs)
    (ce,) = [g for g in find_fusions(gm.graph) if g.kind == FusionKind.CROSS_ENTROPY]
    assert ce.lowered and ce.input_shapes[0][1] == 32  # this rank's half of 64 classes
    loss = next(n for n in gm.graph.nodes if n.name == ce.members[0])
    assert loss.target is autopar.program.local_ops.sharded_cross_entropy and loss.kwargs["class_axes"]


class _Norm(nn.Module):
    """``LlamaRMSNorm`` of a residual add; ``leak`` also returns the variance (an inner member)."""

    def __init__(self, leak: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(8))
        self.leak = leak

    def forward(self, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        s = x + r
        h = s.to(torch.float32)
        var = h.pow(2).mean(-1, keepdim=True)
        y = self.weight * (h * torch.rsqrt(var + 1e-6)).to(s.dtype)
        out = y.sum() + s.sum()  # the residual stream read again: an output of the group
        return out + var.sum() if self.leak else out


class _Glu(nn.Module):
    def __init__(self, leak: bool) -> None:
        super().__init__()
        self.leak = leak

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        s = F.silu(a)
        y = (s * b).sum()
        return y + s.sum() if self.leak else y


class _Rope(nn.Module):
    """Rotary on q and k; ``learned``: cos is a parameter (a gradient would flow into it)."""

    def __init__(self, learned: bool) -> None:
        super().__init__()
        cos = torch.randn(1, 1, 4, 8)
        self.cos = nn.Parameter(cos) if learned else None
        self.register_buffer("table", cos)

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        cos = self.cos if self.cos is not None else self.table
        sin = self.table * 0.5

        def rot(x: torch.Tensor) -> torch.Tensor:
            return torch.cat((-x[..., 4:], x[..., :4]), dim=-1)

        return (q * cos + rot(q) * sin).sum() + (k * cos + rot(k) * sin).sum()


@pytest.mark.parametrize(
    ("module", "inputs", "kind"),
    [
        (_Norm, (torch.randn(2, 3, 8), torch.randn(2, 3, 8)), RMS),
        (_Glu, (torch.randn(2, 6), torch.randn(2, 6)), SWIGLU),
        (_Rope, (torch.randn(2, 4, 4, 8), torch.randn(2, 2, 4, 8)), ROTARY),
    ],
)
def test_a_member_read_outside_its_group_blocks_the_fusion(module: type, inputs: tuple, kind: str) -> None:
    """The variance of an RMSNorm or the ``silu`` of a SwiGLU also read elsewhere (the fused op
    would not compute them), and rotary tables that need a gradient (the kernel treats cos and sin
    as constants), leave the ops unfused; the same graphs without that reader fuse."""
    found = fusion_counts(find_fusions(capture(module(False), inputs).gm.graph))
    assert found == {kind: 1}
    assert kind not in fusion_counts(find_fusions(capture(module(True), inputs).gm.graph))


# ------------------------------------------------------------------------------------- numerics


def _program_inputs(cap: Any, model: nn.Module, inputs: Any) -> list[Any]:
    """The captured program's placeholders: parameters (leaves needing a gradient), buffers,
    constants and the user's inputs."""
    named = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers())
    leaves = inputs if isinstance(inputs, dict) else {f"args[{i}]": v for i, v in enumerate(inputs)}
    out = []
    for ph in (n for n in cap.gm.graph.nodes if n.op == "placeholder"):
        if ph.name in cap.params:
            out.append(named[cap.params[ph.name]].detach().clone().requires_grad_(True))
        elif ph.name in cap.buffers:
            out.append(buffers[cap.buffers[ph.name]])
        elif ph.name in cap.constants:
            out.append(cap.constants[ph.name])
        else:
            out.append(leaves[cap.inputs[ph.name]])
    return out


def _loss_and_grads(gm: torch.fx.GraphModule, values: list[Any]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    out = gm(*values)
    loss = out[0] if isinstance(out, (tuple, list)) else out
    params = [v for v in values if isinstance(v, torch.Tensor) and v.requires_grad]
    return loss.detach(), list(torch.autograd.grad(loss, params))


@pytest.mark.parametrize(("kind", "expected"), [("gpt2", GPT_LIKE), ("gpt", GPT_LIKE), ("llama", LLAMA_LIKE)])
def test_fused_program_computes_the_eager_loss_and_gradients(
    kind: str, expected: dict[str, int], caplog
) -> None:
    assert K.available("cpu"), "the kernels must run here (Triton's interpreter: TRITON_INTERPRET=1)"
    model, inputs = H.build(kind)
    cap = capture(model, inputs)
    eager = copy.deepcopy(cap.gm)
    ctx = PassContext(
        captured=cap,
        cluster=autopar.Cluster.local(1),
        config=autopar.PlanConfig(interpret_kernels=True, kernels=ALL_KERNELS),
    )
    with caplog.at_level(logging.INFO, logger="autopar.passes"):
        fused = run_passes(cap.gm, ctx, [fuse_kernels])
    assert f"fused {expected}" in caplog.text
    calls = [n for n in fused.graph.nodes if n.op == "call_function" and FUSION in n.meta]
    assert {
        n.target.__name__ for n in calls if n.target.__module__.startswith("autopar.program.kernels")
    } == set(expected)
    assert not [n for n in fused.graph.nodes if op_name(n) in ("layer_norm", "rsqrt", "silu", "tanh", "gelu")]
    loss0, grads0 = _loss_and_grads(eager, _program_inputs(cap, model, inputs))
    loss1, grads1 = _loss_and_grads(fused, _program_inputs(cap, model, inputs))
    assert torch.allclose(loss1, loss0, rtol=1e-5, atol=1e-5), (loss1, loss0)
    for g1, g0 in zip(grads1, grads0):
        assert torch.allclose(g1, g0, rtol=1e-5, atol=1e-5), (g1 - g0).abs().max()


def test_a_kernel_measured_slower_than_eager_stays_eager_unless_named(caplog) -> None:
    """The residual add + LayerNorm kernel measured 0.50× eager on an H100
    (``autopar.cost.kernel_speedups``): by default neither the program (``fuse_kernels``) nor
    the planner's costs (``annotate_fusions``) use it, and each says why; ``kernels=`` names it back."""
    model, inputs = H.build("gpt2")
    cap = capture(model, inputs)
    default = PassContext(
        captured=cap, cluster=autopar.Cluster.local(1), config=autopar.PlanConfig(interpret_kernels=True)
    )
    with caplog.at_level(logging.INFO, logger="autopar.passes"):
        fused = run_passes(cap.gm, default, [fuse_kernels])
    assert "add_layer_norm left eager (measured slower than eager: add_layer_norm 0.50×)" in caplog.text
    kinds = {str(n.meta[FUSION].kind) for n in fused.graph.nodes if FUSION in n.meta}
    assert kinds == {"bias_gelu", "cross_entropy"}
    gpu = autopar.Cluster.preset("H100-SXM")
    assumed = _annotated(*H.build("gpt2"), gpu).meta[FUSIONS]
    assert "add_layer_norm" not in {str(g.kind) for g in assumed} and assumed
    named = _annotated(*H.build("gpt2"), gpu, kernels=ALL_KERNELS).meta[FUSIONS]
    assert fusion_counts(list(named))["add_layer_norm"] == GPT_LIKE["add_layer_norm"]
    with pytest.raises(ValueError, match=r"kernels names unknown fused kernel kinds \['layernorm'\]"):
        autopar.PlanConfig(kernels=("layernorm",))


def test_fuse_kernels_leaves_the_program_where_the_kernels_do_not_run(monkeypatch, caplog) -> None:
    model, inputs = H.build("gpt")
    cap = capture(model, inputs)
    before = cap.gm.code
    asked = autopar.PlanConfig(interpret_kernels=True)
    ctx = PassContext(captured=cap, cluster=autopar.Cluster.local(1), config=asked)
    monkeypatch.setattr(K, "available", lambda device: False)
    with caplog.at_level(logging.INFO, logger="autopar.passes"):
        run_passes(cap.gm, ctx, [fuse_kernels])
    assert cap.gm.code == before
    assert "program unchanged: the kernels do not run on cpu" in caplog.text
    monkeypatch.undo()
    # On the CPU, unless asked: the eager ops stay, whatever the interpreter could do.
    caplog.clear()
    default = PassContext(captured=cap, cluster=autopar.Cluster.local(1))
    with caplog.at_level(logging.INFO, logger="autopar.passes"):
        run_passes(cap.gm, default, [fuse_kernels])
    assert cap.gm.code == before
    assert "on the CPU the eager ops stay" in caplog.text
    off = PassContext(
        captured=cap, cluster=autopar.Cluster.local(1), config=autopar.PlanConfig(disable=("fuse_kernels",))
    )
    run_passes(cap.gm, off, [fuse_kernels])
    assert cap.gm.code == before, "disable=('fuse_kernels',) turns the pass off"


# ------------------------------------------------------------------------------------- cost


def _annotated(
    model: nn.Module, inputs: Any, cluster: autopar.Cluster, **config: Any
) -> torch.fx.GraphModule:
    cap = capture(model, inputs)
    ctx = PassContext(captured=cap, cluster=cluster, config=autopar.PlanConfig(**config))
    return run_passes(cap.gm, ctx, GRAPH_PASSES)


def test_a_fused_norm_is_charged_exactly_its_kernels_traffic(make_llama, batch) -> None:
    """LLaMA's post-attention RMSNorm of layer 0, batch 2 × 8 tokens, hidden 64, fp32: R = 16 rows,
    H = 64, 4 bytes each. Forward: read x and residual (2·R·H·4), the weight (H·4); write out and
    the sum (2·R·H·4) and rstd (4·R): 16 704 bytes. Backward: read dout, the residual stream's
    gradient (read on by the next residual add), the sum (3·R·H·4), weight and rstd, write dx
    (R·H·4): 16 704 bytes; then the weight gradient's [R, H] fp32 partials (R < PARTIAL_ROWS)
    zero-filled (4 096) and summed (4 096 + 256); and one addition for the out's second reader
    (gate and up projections both send a gradient: 3·R·H·4 = 12 288)."""
    cluster = autopar.Cluster.preset("H100-SXM")
    dev = cluster.device
    gm = _annotated(make_llama(), batch(2, 8, 256), cluster)
    g = next(g for g in gm.meta[FUSIONS] if g.kind == FusionKind.ADD_RMS_NORM and g.inputs[1] is not None)
    nodes = {n.name: n for n in gm.graph.nodes}
    anchor = nodes[g.anchor]
    R, Hd, s = 16, 64, 4
    assert tuple(anchor.meta["val"].shape) == (2, 8, Hd) and itemsize(g.dtype) == s and R < PARTIAL_ROWS
    fwd_bytes = 2 * R * Hd * s + Hd * s + 2 * R * Hd * s + 4 * R
    bwd_bytes = [
        3 * R * Hd * s + Hd * s + 4 * R + R * Hd * s,
        R * Hd * 4,
        R * Hd * 4 + Hd * 4,
        3 * R * Hd * s,
    ]
    assert fwd_bytes == 16704 and bwd_bytes[0] == 16704
    cost = anchor.meta[COST]
    assert cost.fwd_time == pytest.approx(dev.kernel_overhead + fwd_bytes / dev.achieved_bandwidth, rel=1e-12)
    assert cost.bwd_time == pytest.approx(
        len(bwd_bytes) * dev.kernel_overhead + sum(bwd_bytes) / dev.achieved_bandwidth, rel=1e-12
    )
    assert cost.bytes_moved == fwd_bytes
    others = [nodes[m].meta[COST] for m in g.members if m != g.anchor]
    assert len(others) == 8 and all(c.fwd_time == 0 and c.bwd_time == 0 for c in others)
    # Saved for backward: the sum, the output (read by the projections, which save their input)
    # and rstd; none of eager's float32 intermediates.
    assert sum(nodes[m].meta[COST].saved_bytes for m in g.members) == 2 * R * Hd * s + 4 * R
    eager = _annotated(make_llama(), batch(2, 8, 256), cluster, disable=("fuse_kernels",))
    enodes = {n.name: n for n in eager.graph.nodes}
    assert not eager.meta[FUSIONS] and all(FUSION not in n.meta for n in eager.graph.nodes)
    eager_time = sum(enodes[m].meta[COST].fwd_time + enodes[m].meta[COST].bwd_time for m in g.members)
    assert eager_time > 3 * (cost.fwd_time + cost.bwd_time)  # nine eager kernels each way


def test_fused_cross_entropy_reads_the_logits_once_each_way(make_gpt, batch) -> None:
    """Our GPT's loss over 16 rows × 128 classes, fp32: forward reads the logits (8 192 bytes), the
    int64 targets (128) and writes loss and log-sum-exp (128), then sums the rows' losses (68);
    backward reads logits, targets, log-sum-exp and the loss gradient and writes the logits'
    gradient (2·8 192 + 128 + 64 + 64)."""
    cluster = autopar.Cluster.preset("H100-SXM")
    dev = cluster.device
    ids = torch.randint(0, 128, (2, 8))
    gm = _annotated(make_gpt(), (ids, ids.clone()), cluster)
    (g,) = [g for g in gm.meta[FUSIONS] if g.kind == FusionKind.CROSS_ENTROPY]
    cost = next(n for n in gm.graph.nodes if n.name == g.anchor).meta[COST]
    rows, logits = 16, 16 * 128 * 4
    fwd = [logits + 8 * rows + 8 * rows, 4 * rows + 4]
    bwd = 2 * logits + 8 * rows + 4 * rows + 4 * rows
    assert cost.fwd_time == pytest.approx(
        2 * dev.kernel_overhead + sum(fwd) / dev.achieved_bandwidth, rel=1e-12
    )
    assert cost.bwd_time == pytest.approx(dev.kernel_overhead + bwd / dev.achieved_bandwidth, rel=1e-12)


@pytest.fixture(scope="module")
def llama_plans() -> dict[str, autopar.Plan]:
    model, inputs = H.build("llama")
    gpu = autopar.Cluster.preset("A100-80GB", gpus_per_node=8)
    return {
        "fused": autopar.plan(model, inputs, gpu, mesh_shape=(8,)),
        "eager": autopar.plan(model, inputs, gpu, mesh_shape=(8,), disable=("fuse_kernels",)),
        "cpu": autopar.plan(model, inputs, autopar.Cluster.local(2), mesh_shape=(2,)),
    }


def test_fusion_makes_the_planned_gpu_step_cheaper(llama_plans: dict[str, autopar.Plan]) -> None:
    fused, eager, cpu = llama_plans["fused"], llama_plans["eager"], llama_plans["cpu"]
    assert fused.fusion_counts() == LLAMA_LIKE
    assert eager.fusions == [] and cpu.fusions == [], "no fusion assumed when disabled or on a CPU cluster"
    assert fused.predicted.step_time < eager.predicted.step_time
    assert fused.predicted.compute_time < eager.predicted.compute_time
    # The groups' members are charged nothing but at their anchor.
    times = {n.name: n.compute_time for n in fused.nodes}
    for f in fused.fusions:
        assert times[f.anchor] > 0 and all(times[m] == 0 for m in f.members if m != f.anchor)
    assert "fused kernels assumed (autopar.program.kernels): add_rms_norm ×5, swiglu ×2, rotary ×2" in str(
        fused
    )
    assert "fused kernels" not in str(eager)


def test_plan_lists_its_fusions_through_json(llama_plans: dict[str, autopar.Plan], tmp_path) -> None:
    plan = llama_plans["fused"]
    path = tmp_path / "plan.json"
    plan.save(path)
    loaded = autopar.Plan.load(path)
    assert loaded == plan and loaded.fusions == plan.fusions
    assert loaded.fusion_counts() == LLAMA_LIKE
    d = json.loads(path.read_text())
    d.pop("checksum")
    old = {k: v for k, v in d.items() if k != "fusions"}  # a plan written before fusions existed
    assert autopar.Plan.from_dict(old).fusions == []
    bad = {**d, "fusions": [{**d["fusions"][0], "kind": "fused_attention"}]}
    with pytest.raises(ValueError, match=r"fusions\[0\]\.kind"):
        autopar.Plan.from_dict(bad)
    bad = {**d, "fusions": [{**d["fusions"][0], "anchor": "nowhere"}]}
    with pytest.raises(ValueError, match=r"fusions\[0\]\.anchor"):
        autopar.Plan.from_dict(bad)


def test_annotation_costs_stay_eager_without_the_fusion_pass(make_llama, batch) -> None:
    """The single-device eager reference (``autopar.reference``) runs ``annotate_tensors`` and
    ``annotate_cost`` only: no group, eager kernels."""
    from autopar.passes.annotate import annotate_cost, annotate_tensors

    cluster = autopar.Cluster.preset("H100-SXM")
    cap = capture(make_llama(), batch(2, 8, 256))
    gm = run_passes(cap.gm, PassContext(captured=cap, cluster=cluster), [annotate_tensors, annotate_cost])
    assert all(FUSION not in n.meta for n in gm.graph.nodes)
    rsqrt = next(n for n in gm.graph.nodes if op_name(n) == "rsqrt")
    assert rsqrt.meta[COST].fwd_time > 0
    assert math.isclose(
        rsqrt.meta[COST].fwd_time,
        cluster.device.kernel_overhead + 2 * 16 * 4 / cluster.device.achieved_bandwidth,
    )

"""The planning side of fusion: ``annotate_fusions`` writes the groups on the captured graph where
fusion is assumed, and the cost model's questions about a member are answered here — what its
fused kernel costs (``autopar.cost.fused_traffic``), what the group saves for backward, and the
role that decides which members may share a strategy list."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

from torch.fx import GraphModule, Node

from autopar.cost.compute import Kernel, KernelKind, OpKernels, TensorArg, itemsize
from autopar.cost.fused_traffic import (
    add_norm_kernels,
    bias_gelu_kernels,
    cross_entropy_kernels,
    rotary_kernels,
    rows_and_width,
    saved_statistics_bytes,
    swiglu_kernels,
)
from autopar.cost.kernel_speedups import SPEEDUPS, faster_than_eager
from autopar.ir import FusionKind
from autopar.passes import PassContext
from autopar.passes.fusion.find_groups import find_fusions, fusion_counts
from autopar.passes.fusion.matching import (
    FUSION,
    FUSIONS,
    FusionGroup,
    needs_grad,
    shape_of,
)

log = logging.getLogger("autopar.passes")


def fusion_assumed(ctx: PassContext) -> bool:
    """Whether the cost model charges fused kernels: the cluster runs on GPUs (its backend is
    NCCL: ``Cluster.preset``, not ``Cluster.local``) and neither ``fuse_kernels`` nor
    ``annotate_fusions`` is disabled. The single-device eager reference (``autopar.reference``)
    never runs ``annotate_fusions``, so it stays eager."""
    disabled = {"fuse_kernels", "annotate_fusions"} & set(ctx.config.disable)
    return ctx.cluster.backend == "nccl" and not disabled


def fused_kinds(config: Any) -> frozenset[str]:
    """The kinds whose kernels a program uses and the planner costs: ``config.kernels``, else the
    kinds measured faster than eager (``autopar.cost.kernel_speedups``)."""
    kinds = config.kernels
    return frozenset(kinds) if kinds is not None else faster_than_eager()


def left_eager(groups: list[FusionGroup], config: Any) -> tuple[list[FusionGroup], str]:
    """``groups`` less those of kinds not used (``fused_kinds``), and what was left eager and
    why, for the passes' log lines ("" when nothing was)."""
    kinds = fused_kinds(config)
    out = [g for g in groups if str(g.kind) in kinds]
    dropped = sorted({str(g.kind) for g in groups} - kinds)
    if not dropped:
        return out, ""
    why = (
        "not in PlanConfig.kernels"
        if config.kernels is not None
        else "measured slower than eager: "
        + ", ".join(f"{k} {SPEEDUPS.get(k, float('nan')):.2f}×" for k in dropped)
    )
    return out, f"{', '.join(dropped)} left eager ({why})"


def annotate_fusions(gm: GraphModule, ctx: PassContext) -> GraphModule:
    """Write every group found on its members (``node.meta[FUSION]``) and on the graph
    (``gm.meta[FUSIONS]``) when fusion is assumed (:func:`fusion_assumed`); clear them otherwise."""
    for n in gm.graph.nodes:
        n.meta.pop(FUSION, None)
    if not fusion_assumed(ctx):
        gm.meta[FUSIONS] = ()
        why = "the cluster is not a GPU cluster" if ctx.cluster.backend != "nccl" else "fusion is disabled"
        log.info("pass annotate_fusions: no fused kernels assumed (%s)", why)
        return gm
    groups, eager = left_eager(find_fusions(gm.graph), ctx.config)
    if eager:
        log.info("pass annotate_fusions: %s", eager)
    by_name = {n.name: n for n in gm.graph.nodes}
    for g in groups:
        for m in g.members:
            by_name[m].meta[FUSION] = g
    gm.meta[FUSIONS] = tuple(groups)
    log.info("pass annotate_fusions: fused kernels assumed: %s", fusion_counts(groups) or "none found")
    return gm


def saved_by_group(group: FusionGroup) -> frozenset[str]:
    """Names of the values the fused op keeps for backward (``autopar.cost.fused_traffic``): a norm's
    input (the sum, or ``x`` without a residual), GeLU's input, SwiGLU's inputs, rotary's cos and
    sin, cross-entropy's logits and targets."""
    k = group.kind
    if k in (FusionKind.ADD_LAYER_NORM, FusionKind.ADD_RMS_NORM):
        if group.inputs[1] is not None:
            return frozenset(group.outputs[1][:1])
        return frozenset(i for i in group.inputs[:1] if i is not None)
    if k is FusionKind.BIAS_GELU:
        return frozenset(group.inputs[:1])
    if k is FusionKind.ROTARY:
        return frozenset(i for i in group.inputs[2:] if i is not None)
    return frozenset(i for i in group.inputs if i is not None)


def fusion_role(node: Node) -> tuple:
    """What costing ``node`` depends on as a member of its group: the group's kind, which of its
    inputs are present, how many readers each output has, and whether ``node`` is the anchor.
    Repeated layers' nodes share a strategy list only with nodes of the same role (the first
    layer's first norm has no residual add; the others do)."""
    g: FusionGroup = node.meta[FUSION]
    return (
        str(g.kind),
        tuple(i is None for i in g.inputs),
        g.extern_grads,
        g.split_bias != "",
        node.name == g.anchor,
    )


def fused_saved_bytes(node: Node) -> float:
    """Statistics the fused op of ``node``'s group keeps for backward (global shapes), charged at
    its anchor (``autopar.cost.fused_traffic.saved_statistics_bytes``); nothing at other members."""
    g = node.meta.get(FUSION)
    if g is None or node.name != g.anchor:
        return 0.0
    shape = g.input_shapes[0] if g.kind is FusionKind.CROSS_ENTROPY else shape_of(node)
    rows, _ = rows_and_width(tuple(shape or ()))
    return saved_statistics_bytes(g.kind, rows)


def fused_kernels(node: Node, args: Sequence[TensorArg], outs: Sequence[TensorArg]) -> OpKernels:
    """The kernels ``node`` runs as a member of its group (``node.meta[FUSION]``): the whole fused
    kernel at the anchor (``autopar.cost.fused_traffic``, with the shapes of ``args``/``outs`` — the
    anchor's tensor arguments and results, local shapes for a sharded strategy), nothing at the
    other members; plus, at the anchor, one gradient addition for each reader of an output
    beyond the first (autograd adds them up, as ``op_kernels`` charges an eager op)."""
    g: FusionGroup = node.meta[FUSION]
    if node.name != g.anchor:
        return OpKernels()
    grad = needs_grad(node)
    out = outs[0] if outs else TensorArg((), g.dtype)
    s = itemsize(out.dtype)
    k = g.kind
    if k in (FusionKind.ADD_LAYER_NORM, FusionKind.ADD_RMS_NORM):
        rows, width = rows_and_width(out.shape)
        ks = add_norm_kernels(
            rows, width, s, s,
            residual=g.inputs[1] is not None, weight=g.inputs[2] is not None,
            bias=k is FusionKind.ADD_LAYER_NORM and g.inputs[3] is not None,
            statistics=2 if k is FusionKind.ADD_LAYER_NORM else 1,
            sum_grad=len(g.extern_grads) > 1 and g.extern_grads[1] > 0,
            grad=grad, param_grad=any(a.grad and len(a.shape) == 1 for a in args),
        )  # fmt: skip
    elif k is FusionKind.BIAS_GELU:
        _, width = rows_and_width(out.shape)
        ks = bias_gelu_kernels(
            out.numel, width, s, s, bias=g.inputs[1] is not None, bias_grad=not g.split_bias, grad=grad
        )
    elif k is FusionKind.SWIGLU:
        ks = swiglu_kernels(out.numel, s, grad=grad)
    elif k is FusionKind.ROTARY:
        q, kk, table = (math.prod(sh or ()) for sh in g.input_shapes[:3])
        scale = out.numel / max(q, 1)
        ks = rotary_kernels(out.numel, round(kk * scale), table, s, grad=grad)
    else:  # cross-entropy: the anchor's first argument is the logits
        logits = args[0] if args else TensorArg(g.input_shapes[0] or (), g.dtype)
        rows, classes = rows_and_width(logits.shape)
        full = (g.input_shapes[0] or (0, 0))[-1]
        ks = cross_entropy_kernels(
            rows,
            classes,
            itemsize(logits.dtype),
            grad=grad,
            vocab_parallel=classes < full,
            reduced=g.reduction != 0,
        )
    adds = [max(0, c - 1) for c in g.extern_grads]
    extra = tuple(Kernel(KernelKind.MEMORY, 3.0 * out.nbytes) for c in adds for _ in range(c)) if grad else ()
    return OpKernels(ks.fwd, ks.bwd + extra)

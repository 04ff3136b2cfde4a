"""Annotation passes: tensor facts and single-device costs for every node, and the single-device
training step they add up to (``autopar.passes.eager_step``).

``annotate_tensors`` writes :class:`autopar.ir.TensorInfo` (shape, dtype, module, layer pattern,
whether a gradient flows, the node's role). ``annotate_cost`` writes :class:`autopar.ir.NodeCost`:
the kernels eager PyTorch runs for the op forward and backward (``autopar.cost.op_kernels``)
timed on the cluster's device with global (unsharded) shapes, and the bytes it keeps for backward
(the members of a fusion group found by ``autopar.passes.fusion.annotate_fusions``: its fused
kernel instead, when the cluster is assumed to run them). ``single_device_step`` walks the
annotated graph as one eager training step runs it — the host issuing ops, the device running
their kernels, tensors allocated and freed — and returns the step's time and peak memory
(``autopar.cost.step``).

Words:

* **storage** — the memory a value lives in. A view (``view``, ``transpose``, a ``split``'s part, a
  cast to its own dtype) shares its input's storage; every other op allocates its own, and the
  storage's **owner** is the node that allocated it. Found from the fake tensors' storages, with one
  rule the fake tensors do not know: attention kernels write their output as (batch, seq, heads,
  dim), so a copy into (batch, seq, heads·dim) of its transpose (``reshape``, which capture's
  canonical graph makes of ``contiguous`` then ``view``) is free on the device.
* **saved** — what autograd keeps for backward, from the ops' derivative formulas
  (``tools/autograd/derivatives.yaml``): a matmul keeps each operand only if the *other* needs a
  gradient; ``mul`` likewise (a rotary ``q · cos`` keeps ``cos``, not ``q``); nonlinear pointwise
  ops their input (or output); softmax its output; attention q, k, v, its output and the
  log-sum-exp; layer norm its input and two statistics per row; an embedding its indices; views,
  additions and casts nothing. A storage kept through any of its views is counted once, at its
  owner, as Korthikanti et al. (arXiv 2205.05198 §4) count activations. Where the cost model
  assumes fused kernels (``autopar.passes.fusion``), a fusion group's members save what the fused
  op saves (``saved_by_group``: a norm its input and statistics, not its float32 intermediates).
* **causal attention** — ``is_causal=True``, or a mask built structurally as a triangle
  (``tril``/``triu``, or a comparison of key and query positions, as transformers' mask functions
  build under ``torch.export``): costed as the causal kernel that skips the masked half.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch
from torch.fx import GraphModule, Node

from autopar.cost.compiled import chain_share_kernels
from autopar.cost.compute import OpKernels, TensorArg, kernel_time
from autopar.cost.op_kernels import op_kernels
from autopar.graph import OpFamily, op_family, op_info, op_name, tensor_inputs, tensor_outputs
from autopar.ir import COST, TENSOR, NodeCost, TensorInfo
from autopar.passes import PassContext
from autopar.passes.chain_records import CHAIN, compile_assumed
from autopar.passes.fusion import FUSION, fused_kernels, fused_saved_bytes, fusion_assumed, saved_by_group

__all__ = [
    "FACTS",
    "OpFacts",
    "annotate_cost",
    "annotate_tensors",
    "attention_mask",
    "extra_saved_bytes",
    "grad_flows",
    "grad_sync_share",
    "is_alias",
    "node_kernels",
    "op_facts",
    "ordered_tensor_args",
    "saved_inputs",
    "saves_inputs",
    "saves_output",
    "storage_id",
    "storage_views",
    "tensor_bytes",
    "value_is_saved",
]

_LAYER_RE = re.compile(r"\.(\d+)(?=\.|$)")


def saves_inputs(node: Node) -> bool:
    return op_info(node).saves_inputs


def saves_output(node: Node) -> bool:
    return op_info(node).saves_output


def _module_of(node: Node) -> str:
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    return str(path)


def annotate_tensors(gm: GraphModule, ctx: PassContext) -> GraphModule:
    """Write ``TensorInfo`` on every node that produces a tensor."""
    cap = ctx.captured
    grad: dict[Node, bool] = {}
    for node in gm.graph.nodes:
        vals = tensor_outputs(node)
        if node.op == "placeholder":
            if node.name in cap.params:
                kind, fqn = "param", cap.params[node.name]
                module = fqn.rsplit(".", 1)[0] if "." in fqn else ""
            elif node.name in cap.buffers:
                kind, fqn = "buffer", cap.buffers[node.name]
                module = fqn.rsplit(".", 1)[0] if "." in fqn else ""
            else:
                kind, fqn, module = "input", cap.inputs.get(node.name, node.name), ""
            val = node.meta.get("val")
            grad[node] = kind == "param" and isinstance(val, torch.Tensor) and val.is_floating_point()
        elif node.op == "output":
            # The output node produces nothing (a ``val`` on it, as FakeTensorProp leaves, is its
            # inputs' values): no record, so no strategy asks for the graph's outputs whole.
            grad[node] = False
            continue
        else:
            kind, fqn, module = "op", "", _module_of(node)
            ins = [i for i in node.all_input_nodes]
            floating = any(v.is_floating_point() for v in vals)
            # Ops under torch.no_grad (a wrap_with_set_grad_enabled(False, ...)) carry no gradient.
            no_grad = (
                node.target is getattr(torch.ops.higher_order, "wrap_with_set_grad_enabled", None)
                and not node.args[0]
            )
            grad[node] = floating and not no_grad and any(grad.get(i, False) for i in ins)
            if (
                node.target.__class__.__name__ == "builtin_function_or_method"
                and node.target.__name__ == "getitem"
            ):
                grad[node] = grad.get(node.args[0], False) and floating
        if not vals:
            continue
        v = vals[0]
        node.meta[TENSOR] = TensorInfo(
            shape=tuple(int(s) for s in v.shape),
            dtype=str(v.dtype).replace("torch.", ""),
            module=module,
            layer=_LAYER_RE.sub(".*", module),
            requires_grad=grad[node],
            kind=kind,
            fqn=fqn,
        )
    return gm


# ------------------------------------------------------------------------------- tensors
def tensor_bytes(t: torch.Tensor) -> float:
    """Bytes of ``t``'s elements."""
    return float(math.prod(t.shape)) * t.element_size()


def grad_flows(node: Node) -> bool:
    """A gradient flows into ``node``'s value (``TensorInfo.requires_grad``)."""
    info = node.meta.get(TENSOR)
    return info is not None and info.requires_grad


def storage_id(node: Node) -> int | None:
    """The identity of the storage ``node``'s value lives in (its fake tensor's), or ``None``."""
    v = node.meta.get("val")
    if not isinstance(v, torch.Tensor):
        return None
    try:
        return v.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError, AttributeError):  # sparse/nested/opaque tensors
        return None


def ordered_tensor_args(node: Node) -> list[Node]:
    """Tensor arguments in call order, duplicates kept (``mul(x, x)`` lists ``x`` twice)."""
    out = []
    for a in (*node.args, *node.kwargs.values()):
        if isinstance(a, Node) and isinstance(a.meta.get("val"), torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out.extend(x for x in a if isinstance(x, Node) and isinstance(x.meta.get("val"), torch.Tensor))
    return out


def _attention_layout_view(node: Node) -> bool:
    """``node`` reads an attention output through views only (module docstring: a ``reshape``
    of the transposed output is free because the kernel wrote it as (batch, seq, heads, dim))."""
    cur = node
    for _ in range(8):
        ins = tensor_inputs(cur)
        if len(ins) != 1:
            return False
        cur = ins[0]
        if op_family(cur) is OpFamily.ATTENTION:
            return True
        if op_family(cur) is not OpFamily.VIEW and op_name(cur) != "getitem":
            return False
    return False


_MULTI_VIEWS = frozenset(("split", "split_with_sizes", "chunk", "unbind", "tensor_split"))


def is_alias(node: Node) -> bool:
    """The node's output shares the storage of one of its inputs (module docstring: storage)."""
    if node.op != "call_function":
        return False
    st = storage_id(node)
    ins = tensor_inputs(node)
    if st is not None and any(storage_id(i) == st for i in ins):
        return True
    name = op_name(node)
    if name == "getitem":
        src = node.args[0]
        return isinstance(src, Node) and op_info(src).family is OpFamily.VIEW and is_alias(src)
    if name in _MULTI_VIEWS:
        return True  # its parts are views (read through getitem)
    if name == "dropout" and (_schema_arg(node, "p", 0.5) == 0 or _schema_arg(node, "train", True) is False):
        return True  # returns its input (ATen's dropout with p = 0 or in eval)
    return name in ("contiguous", "reshape") and _attention_layout_view(node)


def storage_views(owner: Node) -> list[Node]:
    """``owner`` and every node viewing its storage."""
    out, stack, seen = [], [owner], {owner}
    while stack:
        n = stack.pop()
        out.append(n)
        for u in n.users:
            if u not in seen and is_alias(u) and u.op == "call_function":
                seen.add(u)
                stack.append(u)
    return out


def _operands(node: Node) -> tuple[int, int] | None:
    """Positions (in ``ordered_tensor_args``) of the two operands whose derivative reads the other."""
    name = op_name(node)
    fam = op_family(node)
    if fam is OpFamily.MATMUL or fam is OpFamily.CONV:
        return (1, 2) if name in ("addmm", "baddbmm") else (0, 1)
    if name in ("mul", "mul_"):
        return (0, 1)
    return None


def saved_inputs(node: Node) -> list[Node]:
    """The tensor inputs autograd keeps for ``node``'s backward (module docstring: saved)."""
    if node.op != "call_function" or not grad_flows(node):
        return []
    args = ordered_tensor_args(node)
    name = op_name(node)
    fam = op_family(node)
    pair = _operands(node)
    if pair is not None and len(args) > max(pair):
        a, b = args[pair[0]], args[pair[1]]
        return list(dict.fromkeys([*([a] if grad_flows(b) else []), *([b] if grad_flows(a) else [])]))
    if name in ("div", "div_") and len(args) == 2:
        a, b = args
        return list(dict.fromkeys([*([a] if grad_flows(b) else []), b]))
    if name in ("mul", "mul_", "div", "div_") and len(args) == 1:
        return []  # by a number: the derivative reads only the number (autograd's MulBackward1)
    if name in ("where", "masked_fill", "masked_fill_"):
        return [i for i in args if not i.meta["val"].is_floating_point()]
    if fam in (OpFamily.EMBEDDING, OpFamily.ROUTING) and saves_inputs(node):
        return [i for i in args if not i.meta["val"].is_floating_point()]  # the indices
    if name in ("cross_entropy_loss", "nll_loss", "nll_loss_nd", "nll_loss_forward"):
        return list(dict.fromkeys(args[:2]))  # its log-probabilities (the input's size) and targets
    if saves_inputs(node):
        return list(dict.fromkeys(args))
    return []


def value_is_saved(node: Node) -> bool:
    """True when ``node`` owns a storage that autograd keeps for backward through any of its views
    (module docstring). Parameters and buffers are training state, never activations."""
    facts = node.meta.get(FACTS)
    return facts.output_saved if facts is not None else _value_is_saved(node)


def _value_is_saved(node: Node, fused: bool = False) -> bool:
    """``fused``: nodes of a fusion group (``autopar.passes.fusion``) save what the fused op saves
    (``saved_by_group``) instead of what their eager ops would."""
    info = node.meta.get(TENSOR)
    if info is None or is_alias(node):
        return False
    if node.op == "placeholder" and info.kind in ("param", "buffer"):
        return False
    for a in storage_views(node):
        group = a.meta.get(FUSION) if fused else None
        if group is not None:
            if a.name in saved_by_group(group):
                return True
        elif saves_output(a) and grad_flows(a):
            return True
        for user in a.users:
            ugroup = user.meta.get(FUSION) if fused else None
            if ugroup is not None:
                if ugroup is not group and {a.name, node.name} & saved_by_group(ugroup):
                    return True
            elif a in saved_inputs(user):
                return True
    return False


def extra_saved_bytes(node: Node, fused: bool = False) -> float:
    """Bytes an op keeps for backward beyond its inputs/outputs (statistics, masks); ``fused``: a
    fusion group's statistics, at its anchor (``autopar.passes.fusion.fused_saved_bytes``)."""
    info = node.meta.get(TENSOR)
    if info is None or not info.requires_grad or node.op != "call_function":
        return 0.0
    if fused and FUSION in node.meta:
        return fused_saved_bytes(node)
    name = op_name(node)
    family = op_family(node)
    shape = info.shape
    if family is OpFamily.ATTENTION:
        return 4.0 * math.prod(shape[:-1])  # fp32 log-sum-exp per query row
    if family is OpFamily.NORM:
        return 8.0 * math.prod(shape[:-1])  # mean and rstd per row
    if name in ("dropout", "native_dropout") and len(node.args) > 1 and node.args[1]:
        return float(math.prod(shape))  # bool mask
    return 0.0


# ------------------------------------------------------------------------------- attention
_TRIANGLE = {"tril", "triu"}
_COMPARE = {"le", "lt", "ge", "gt"}
_MASK_PASS = {
    "expand", "view", "reshape", "unsqueeze", "squeeze", "slice", "select", "to", "_to_copy", "alias",
    "contiguous", "clone", "__and__", "bitwise_and", "logical_and", "mul", "masked_fill", "where",
    "logical_not", "bitwise_not", "__invert__", "add", "sub", "__or__", "bitwise_or", "logical_or",
}  # fmt: skip


def _varies(shape: tuple[int, ...], dim: int) -> bool:
    return len(shape) >= -dim and shape[dim] > 1


def _is_triangle(node: Node, depth: int = 0) -> bool:
    """``node`` (a mask) is built as a triangle over its last two dimensions: a ``tril``/``triu``,
    or a comparison of one value that varies along the query dimension only with one that varies
    along the key dimension only; combined with other masks by ``and``/``where``, or reshaped."""
    if depth > 40 or node.op != "call_function":
        return False
    name = op_name(node)
    if name in _TRIANGLE:
        return True
    ins = tensor_inputs(node)
    if name in _COMPARE and len(ins) == 2:
        a, b = (tuple(i.meta["val"].shape) for i in ins)
        rows = [_varies(s, -2) and not _varies(s, -1) for s in (a, b)]
        cols = [_varies(s, -1) and not _varies(s, -2) for s in (a, b)]
        return (rows[0] and cols[1]) or (rows[1] and cols[0])
    if name in _MASK_PASS:
        return any(_is_triangle(i, depth + 1) for i in ins)
    return False


def _schema_arg(node: Node, name: str, default: object = None) -> object:
    if name in node.kwargs:
        return node.kwargs[name]
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return default
    for i, a in enumerate(schema.arguments):
        if a.name == name:
            return node.args[i] if i < len(node.args) else default
    return default


def attention_mask(node: Node) -> tuple[bool, bool]:
    """``(causal, masked)`` of an attention node: ``causal`` when ``is_causal`` is set or its mask
    is a triangle (``_is_triangle``); ``masked`` when it reads another explicit mask."""
    causal = bool(_schema_arg(node, "is_causal", False))
    mask = _schema_arg(node, "attn_mask") or _schema_arg(node, "attn_bias")
    if isinstance(mask, Node):
        if _is_triangle(mask):
            return True, False
        return causal, True
    return causal, False


# ------------------------------------------------------------------------------- kernels
FACTS = "autopar.op_facts"


@dataclass(frozen=True, slots=True)
class OpFacts:
    """What ``annotate_cost`` found about a node from the graph around it, so that costing its
    sharded strategies (``autopar.passes.strategies``) does not walk the graph again."""

    alias: bool
    """Its output shares an input's storage (``is_alias``)."""
    output_saved: bool
    """It owns a storage autograd keeps for backward (``value_is_saved``)."""
    grad_contributions: int
    """Consumers that send its output a gradient."""
    causal: bool = False
    masked: bool = False
    """Attention only: ``attention_mask``."""
    groups: int = 1
    """Convolution only: its groups."""
    equation: str | None = None
    """``einsum`` only: its equation (costed as the GEMM it runs: ``cost.op_kernels.einsum_gemm_dims``)."""


def op_facts(node: Node, fused: bool = False) -> OpFacts:
    """The node's ``OpFacts``: as ``annotate_cost`` recorded them, else found now (``fused``: with
    fusion groups saving what their fused ops save)."""
    facts = node.meta.get(FACTS)
    if facts is not None:
        return facts
    causal = masked = False
    if op_family(node) is OpFamily.ATTENTION:
        causal, masked = attention_mask(node)
    groups = _schema_arg(node, "groups", 1) if node.op == "call_function" else 1
    return OpFacts(
        alias=is_alias(node),
        output_saved=_value_is_saved(node, fused),
        grad_contributions=grad_contributions(node),
        causal=causal,
        masked=masked,
        groups=groups if isinstance(groups, int) else 1,
        equation=node.args[0] if op_name(node) == "einsum" and isinstance(node.args[0], str) else None,
    )


def _arg(n: Node, grad: bool) -> TensorArg:
    v = n.meta["val"]
    dtype = str(v.dtype).replace("torch.", "")
    stored = None
    if any(st == 0 for st, sz in zip(v.stride(), v.shape) if sz > 1):  # an expanded view
        try:
            stored = float(v.untyped_storage().nbytes())
        except (RuntimeError, NotImplementedError, AttributeError):
            stored = None
    return TensorArg(tuple(int(s) for s in v.shape), dtype, grad, stored, channels_last(v))


def channels_last(v: torch.Tensor) -> bool:
    """Whether a 4-d or 5-d value is laid out channels-last (``torch.channels_last`` or
    ``channels_last_3d``): dense in that order, its channel stride (dimension 1) strictly the
    smallest — so a 1×1 convolution's weight converted with ``model.to(memory_format=...)`` counts
    (its strides say so) though its memory reads the same either way."""
    if v.dim() not in (4, 5) or v.shape[1] <= 1:
        return False
    fmt = torch.channels_last if v.dim() == 4 else torch.channels_last_3d
    try:
        return v.is_contiguous(memory_format=fmt) and v.stride(1) < min(v.stride()[2:])
    except (RuntimeError, NotImplementedError):  # symbolic strides it cannot decide (a symbolic
        return False  # micro-batch export): taken as channels-first, its transposes priced


def grad_contributions(node: Node) -> int:
    """How many consumers send ``node``'s output a gradient (autograd adds them up)."""
    if not grad_flows(node):
        return 0
    return sum(
        1 for u in node.users if u.op == "call_function" and grad_flows(u) and op_name(u) != "getitem"
    ) or (1 if any(grad_flows(u) for u in node.users) else 0)


def grad_sync_share(node: Node) -> float:
    """The share of ``node``'s gradient synchronization one consumer's edge pays: autograd sums the
    gradients of all its consumers first, and the runtime synchronizes the sum once (a tied
    weight, a norm's output read by three projections), so each of ``k`` consumers pays ``1/k``
    (exact when they read it alike, the case the runtime syncs once)."""
    return 1.0 / max(1, op_facts(node).grad_contributions)


def node_kernels(
    node: Node,
    args: list[TensorArg] | None = None,
    outs: list[TensorArg] | None = None,
    *,
    fused: bool = False,
    tf32: bool = False,
    compiled: bool = False,
    causal: bool | float | None = None,
) -> OpKernels:
    """The kernels of ``node`` forward and backward (``autopar.cost.op_kernels``), with its
    global shapes, or with ``args``/``outs`` given (a sharded strategy's local shapes, in the order
    of ``ordered_tensor_args`` and ``tensor_outputs``). ``fused``: a member of a fusion group runs
    its group's fused kernel (at the group's anchor) or nothing (``autopar.passes.fusion``).
    ``tf32``: float32 matmuls on TF32 tensor cores (``PlanConfig.matmul_tf32``). ``compiled``: a
    member of a chain (``autopar.passes.chains``) runs its share of the chain's generated kernel
    (``autopar.cost.compiled``). ``causal``: whether attention's kernel skips the causally masked
    pairs, or the fraction of them it keeps, where the strategy decides it (a query shard:
    ``autopar.passes.strategies``); default the op's own mask."""
    if node.op != "call_function":
        return OpKernels()
    if args is None:
        args = [_arg(i, grad_flows(i)) for i in ordered_tensor_args(node)]
    if outs is None:
        outs = [TensorArg(tuple(o.shape), str(o.dtype).replace("torch.", "")) for o in tensor_outputs(node)]
    if fused and FUSION in node.meta:
        return fused_kernels(node, args, outs)
    role = node.meta.get(CHAIN) if compiled else None
    if role is not None:
        return chain_share_kernels(args, outs, role.share, requires_grad=grad_flows(node))
    f = op_facts(node)
    return op_kernels(
        op_name(node),
        args,
        outs,
        requires_grad=grad_flows(node),
        alias=f.alias,
        causal=f.causal if causal is None else causal,
        masked=f.masked,
        groups=f.groups,
        grad_contributions=f.grad_contributions,
        tf32=tf32,
        equation=f.equation,
    )


def annotate_cost(gm: GraphModule, ctx: PassContext) -> GraphModule:
    """Write ``NodeCost`` (single device, global shapes) on every node; the members of a fusion
    group (``annotate_fusions``, when ``fusion_assumed``) are charged its fused kernel, and the
    members of a chain (``annotate_chains``, when ``compile_assumed``) their share of its
    generated kernel."""
    device = ctx.cluster.device
    fused = fusion_assumed(ctx)
    compiled = compile_assumed(ctx)
    tf32 = ctx.config.matmul_tf32
    for node in gm.graph.nodes:
        info = node.meta.get(TENSOR)
        if info is None:
            continue
        out_bytes = sum(tensor_bytes(o) for o in tensor_outputs(node))
        node.meta.pop(FACTS, None)
        node.meta[FACTS] = op_facts(node, fused)
        if node.op != "call_function":
            bwd = 0.0
            if info.kind == "param" and info.requires_grad:  # a tied weight's gradients are added up
                extra = max(0, grad_contributions(node) - 1)
                bwd = extra * (device.kernel_overhead + 3 * out_bytes / device.achieved_bandwidth)
            node.meta[COST] = NodeCost(0.0, 0.0, 0.0, out_bytes, 0.0, 0.0, bwd)
            continue
        ks = node_kernels(node, fused=fused, tf32=tf32, compiled=compiled)
        fwd = sum(kernel_time(k, device) for k in ks.fwd)
        bwd = sum(kernel_time(k, device) for k in ks.bwd)
        saved = (out_bytes if value_is_saved(node) else 0.0) + extra_saved_bytes(node, fused)
        node.meta[COST] = NodeCost(ks.fwd_flops, ks.bwd_flops, ks.fwd_bytes, out_bytes, saved, fwd, bwd)
    return gm

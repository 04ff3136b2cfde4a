"""Annotation passes: tensor facts and single-device costs for every node.

``annotate_tensors`` writes :class:`autopar.ir.TensorInfo` (shape, dtype, module, layer pattern,
whether a gradient flows, the node's role). ``annotate_cost`` writes :class:`autopar.ir.NodeCost`
using the formulas of ``autopar.cost`` on the cluster's device with global (unsharded) shapes.

What autograd saves for backward (``saved_bytes``) follows the ops' derivative formulas
(``tools/autograd/derivatives.yaml``): matmuls keep their inputs, nonlinear pointwise ops their
input, softmax its output, attention q/k/v/out and the log-sum-exp, layer norm its input and two
statistics per row; linear ops (add, views, casts) keep nothing. A value kept by several consumers
is counted once, on its producer, as Korthikanti et al. (arXiv 2205.05198 §4) count activations.
"""

from __future__ import annotations

import math
import re

import torch
from torch.fx import GraphModule, Node

from autopar.cost.compute import BACKWARD_FLOP_RATIO, op_flops, roofline_time
from autopar.graph import OpFamily, op_family, op_info, op_name, tensor_inputs, tensor_outputs
from autopar.ir import COST, TENSOR, NodeCost, TensorInfo
from autopar.passes import PassContext

__all__ = ["annotate_cost", "annotate_tensors", "saves_inputs", "saves_output"]

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
            kind, fqn, module = "output", "", ""
            grad[node] = False
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


def _nbytes(t: torch.Tensor) -> float:
    return float(math.prod(t.shape)) * t.element_size()


def value_is_saved(node: Node) -> bool:
    """True when some consumer keeps this value for backward (or the op keeps its own output)."""
    info = node.meta.get(TENSOR)
    if info is None:
        return False
    if node.op == "placeholder" and info.kind in ("param", "buffer"):
        return False  # weights are counted as training state, not activations
    if saves_output(node) and info.requires_grad:
        return True
    for user in node.users:
        uinfo = user.meta.get(TENSOR)
        if uinfo is not None and uinfo.requires_grad and saves_inputs(user):
            return True
        if op_name(user) == "getitem":
            continue
    return False


def extra_saved_bytes(node: Node) -> float:
    """Bytes an op keeps for backward beyond its inputs/outputs (statistics, masks)."""
    info = node.meta.get(TENSOR)
    if info is None or not info.requires_grad or node.op != "call_function":
        return 0.0
    name = op_name(node)
    family = op_family(node)
    shape = info.shape
    if family is OpFamily.ATTENTION:
        return 4.0 * math.prod(shape[:-1])  # fp32 log-sum-exp per query row
    if family is OpFamily.NORM:
        return 8.0 * math.prod(shape[:-1])  # mean and rstd per row
    if name in ("dropout", "native_dropout") and node.args[1] if len(node.args) > 1 else False:
        return float(math.prod(shape))  # bool mask
    return 0.0


def annotate_cost(gm: GraphModule, ctx: PassContext) -> GraphModule:
    """Write ``NodeCost`` (single device, global shapes) on every op node."""
    device = ctx.cluster.device
    for node in gm.graph.nodes:
        info = node.meta.get(TENSOR)
        if info is None:
            continue
        outs = tensor_outputs(node)
        out_bytes = sum(_nbytes(o) for o in outs)
        if node.op != "call_function":
            node.meta[COST] = NodeCost(0.0, 0.0, 0.0, out_bytes, 0.0, 0.0, 0.0)
            continue
        ins = tensor_inputs(node)
        in_shapes = [tuple(i.meta["val"].shape) for i in _ordered_tensor_args(node)]
        flops, family = op_flops(op_name(node), in_shapes, info.shape)
        moved = out_bytes + sum(_nbytes(i.meta["val"]) for i in ins)
        fwd = roofline_time(flops, moved, device, info.dtype)
        bwd_flops = flops * BACKWARD_FLOP_RATIO[family] if info.requires_grad else 0.0
        bwd = roofline_time(bwd_flops, 2 * moved, device, info.dtype) if info.requires_grad else 0.0
        saved = (out_bytes if value_is_saved(node) else 0.0) + extra_saved_bytes(node)
        node.meta[COST] = NodeCost(flops, bwd_flops, moved, out_bytes, saved, fwd, bwd)
    return gm


def _ordered_tensor_args(node: Node) -> list[Node]:
    """Tensor arguments in call order, duplicates kept (``mul(x, x)`` lists ``x`` twice)."""
    out = []
    for a in node.args:
        if isinstance(a, Node) and isinstance(a.meta.get("val"), torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out.extend(x for x in a if isinstance(x, Node) and isinstance(x.meta.get("val"), torch.Tensor))
    return out

"""Block-sharding hints: which nodes would benefit from ``Shard(dim, blocks=k)`` (a fused QKV or
gate/up projection whose output is split into ``k`` equal parts), propagated back to the weights."""

from __future__ import annotations

import torch
from torch.fx import Node

from autopar.graph import tensor_inputs, tensor_outputs
from autopar.rules.base import aten, norm_dim, op_key, shape_of
from autopar.rules.pointwise import UNARY
from autopar.rules.views import view_map


def block_hints(graph: torch.fx.Graph) -> dict[Node, set[tuple[int, int]]]:
    """Which nodes would benefit from ``Shard(dim, blocks=k)``: producers of an equal ``k``-way
    split (a fused QKV or gate/up projection), propagated back through pointwise ops, 1:1 views
    and matmuls to the weights and biases."""
    hints: dict[Node, set[tuple[int, int]]] = {}
    work: list[tuple[Node, int, int]] = []
    for n in graph.nodes:
        if n.op == "call_function" and op_key(n) in (aten.split, aten.split_with_sizes, aten.chunk):
            outs = tensor_outputs(n)
            src = n.args[0]
            if not isinstance(src, Node) or len(outs) < 2:
                continue
            rank = len(shape_of(src))
            dim = norm_dim(n.args[2] if len(n.args) > 2 else n.kwargs.get("dim", 0), rank)
            if len({int(o.shape[dim]) for o in outs}) == 1:
                work.append((src, dim, len(outs)))
    while work:
        node, dim, k = work.pop()
        if (dim, k) in hints.setdefault(node, set()):
            continue
        hints[node].add((dim, k))
        if node.op != "call_function":
            continue
        key = op_key(node)
        rank = len(shape_of(node))
        if key in (aten.addmm, aten.linear, aten.mm, aten.matmul):
            a = node.args
            if key is aten.addmm:
                bias, w = a[0], a[2]
                wdim = 1
            elif key is aten.linear:
                w = a[1]
                bias = a[2] if len(a) > 2 else None
                wdim = 0
            else:
                w, bias, wdim = a[1], None, len(shape_of(a[1])) - 1
            if dim == rank - 1:
                if isinstance(w, Node):
                    work.append((w, wdim, k))
                if isinstance(bias, Node) and shape_of(bias) and shape_of(bias)[-1] > 1:
                    work.append((bias, len(shape_of(bias)) - 1, k))
        elif key in UNARY:
            for i in tensor_inputs(node):
                sh = shape_of(i)
                d = dim - (rank - len(sh))
                if d >= 0 and sh[d] == shape_of(node)[dim]:
                    work.append((i, d, k))
        elif key in (aten.view, aten.reshape, aten._unsafe_view):
            src = node.args[0]
            mapping = view_map(shape_of(src), shape_of(node))
            for (d, b), od in mapping.items():
                if b == 0 and od == dim:
                    work.append((src, d, k))
    return hints

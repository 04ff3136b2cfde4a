"""Weights whose gradient is synced at the weight itself: where the lowering (``passes.lower``)
puts a data-parallel gradient's all-reduce, read by the planner too (``autopar.dp_shares``: such a
sync runs once per step, not once per micro-batch).

Words: a value is **derived** from the weights when a weight reaches it through the ops of the
captured graph; a **weight sync** is the all-reduce of a weight's gradient over the axes its uses
split work along, issued at the weight (where the bucketing pass, ``passes.overlap``, merges it
with others) instead of at each use.

A weight qualifies when every use reads it as laid out (no reshard) and splits work along the same
axes, so its whole gradient is partial there; or when it feeds, through a chain of single-use ops
run replicated on every axis (a position-embedding lookup), a value whose uses are like that —
the all-reduce then moves from that value's gradient to the weight's, which is the same sum
pushed through the same linear map on every device.
"""

from __future__ import annotations

from collections.abc import Container

from torch.fx import Graph, Node

from autopar.graph import OpFamily, op_family, tensor_inputs, tensor_outputs
from autopar.placement import Replicate, Spec, parse_spec
from autopar.planfile import NodePlan, Plan
from autopar.reshard import grad_sync_axes

__all__ = ["dropped", "weight_syncs"]


def dropped(node: Node) -> bool:
    """Export's shape assertions compute nothing; the per-rank program leaves them out."""
    return op_family(node) is OpFamily.ASSERT


def weight_syncs(
    graph: Graph, params: Container[str], plan: Plan
) -> tuple[set[tuple[Node, tuple[int, ...]]], dict[str, tuple[int, ...]]]:
    """``(values, weights)`` of the captured ``graph`` under ``plan`` (``params``: the placeholders
    that are weights): each value (a weight, or the last value of its replicated chain) whose
    gradient needs no sync of its own, with the axes its weight's sync covers; and each weight
    synced at itself, with those axes (module docstring)."""
    mesh = tuple(plan.mesh_shape)
    np: dict[str, NodePlan] = {n.name: n for n in plan.nodes}

    def spec_out(node: Node) -> Spec:
        p = np.get(node.name)
        return tuple(Replicate() for _ in mesh) if p is None else parse_spec(p.outputs[0])

    derived: set[Node] = set()
    for node in graph.nodes:
        if (node.op == "placeholder" and node.name in params) or (
            node.op == "call_function" and any(i in derived for i in node.all_input_nodes)
        ):
            derived.add(node)
    values: set[tuple[Node, tuple[int, ...]]] = set()
    order: list[tuple[str, tuple[int, ...]]] = []
    for p in graph.nodes:
        if p.op != "placeholder" or p.name not in params:
            continue
        v = p
        while True:
            users = [u for u in v.users if not dropped(u)]
            if not users or any(u.op != "call_function" or u.name not in np for u in users):
                break
            src = spec_out(v)
            reqs = set()
            for u in users:
                up = np[u.name]
                dst = up.inputs[tensor_inputs(u).index(v)]
                if dst is None or parse_spec(dst) != src:
                    reqs.add(None)
                    continue
                reqs.add(grad_sync_axes(up.split, src))
            if len(reqs) != 1 or None in reqs:
                break
            # An axis of one device reduces nothing (``local_input`` leaves it out too: the two
            # must name the same axes, or the consumer would sync the gradient again).
            axes = tuple(a for a in reqs.pop() if mesh[a] > 1)
            if axes:
                values.add((v, axes))
                order.append((p.name, axes))
                break
            (u,) = users if len(users) == 1 else (None,)
            if u is None or any(np[u.name].split) or len(tensor_outputs(u)) != 1:
                break
            if [i for i in tensor_inputs(u) if i in derived] != [v]:
                break
            v = u
    return values, dict(order)

"""What the fusion matchers share (``autopar.passes.fusion``'s words): the record of a group
(:class:`FusionGroup`) and the ``meta`` keys it is written under, a matcher's raw result
(:class:`Match`), the questions a matcher asks of a node (is it this ``aten`` op, who reads it,
its value's shape, an argument by position or name), and the residual add before a norm, which
both norm families match."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.fx import Node

from autopar.graph import OpFamily, op_family, op_name
from autopar.ir import TENSOR, FusionKind

FUSION = "autopar.fusion"
"""``node.meta`` key: the :class:`FusionGroup` the node is a member of."""
FUSIONS = "autopar.fusions"
"""``gm.meta`` key: every group ``annotate_fusions`` found, in program order."""


@dataclass(frozen=True, slots=True)
class FusionGroup:
    """One match (module docstring). Inputs and outputs are by role, per kind:

    ========================  ===================================  ==================
    kind                      inputs                               outputs
    ========================  ===================================  ==================
    ``add_layer_norm``        x, residual, weight, bias            out, sum
    ``add_rms_norm``          x, residual, weight                  out, sum
    ``bias_gelu``             x, bias                              out
    ``swiglu``                gate, up                             out
    ``rotary``                q, k, cos, sin                       q_out, k_out
    ``cross_entropy``         logits, target                       loss
    ========================  ===================================  ==================

    An absent input (no residual, no weight) is ``None``; the ``sum`` of a norm without a residual
    is its input ``x`` (the outputs entry then lists only identity casts of it, or nothing)."""

    kind: FusionKind
    members: tuple[str, ...]
    """Node names, in program order."""
    inputs: tuple[str | None, ...]
    input_shapes: tuple[tuple[int, ...] | None, ...]
    """Shapes of the inputs where the group was found (global in the captured graph)."""
    outputs: tuple[tuple[str, ...], ...]
    """Per output of the fused op: the members holding that value (read outside the group)."""
    anchor: str
    """The member that carries the fused kernel's cost."""
    dtype: str
    """dtype of the fused op's (first) output: the activations' dtype."""
    eps: float = 0.0
    """Norms: the epsilon added to the variance."""
    approximate: str = "none"
    """``bias_gelu``: ``"none"`` (erf) or ``"tanh"``."""
    ignore_index: int = -100
    reduction: int = 1
    """``cross_entropy``: ``aten``'s reduction (0 none, 1 mean, 2 sum)."""
    split_bias: str = ""
    """``bias_gelu``: the ``linear``/``addmm`` whose bias moves into the fused op."""
    extern_grads: tuple[int, ...] = ()
    """Per output: readers outside the group that send it a gradient (autograd adds them up)."""
    lowered: bool = False
    """``cross_entropy`` in a rank's program: the lowering's ``sharded_*`` call."""


def is_aten(n: Any, *names: str) -> bool:
    return (
        isinstance(n, Node)
        and n.op == "call_function"
        and isinstance(n.target, torch._ops.OpOverload)
        and n.target.namespace == "aten"
        and op_name(n) in names
    )


def is_assert(n: Node) -> bool:
    return n.op == "call_function" and op_family(n) is OpFamily.ASSERT


def readers_of(n: Node) -> list[Node]:
    """``n``'s users other than export's metadata assertions (they compute nothing)."""
    return [u for u in n.users if not is_assert(u)]


def value_of(n: Any) -> torch.Tensor | None:
    v = n.meta.get("val") if isinstance(n, Node) else None
    return v if isinstance(v, torch.Tensor) else None


def shape_of(n: Any) -> tuple[int, ...] | None:
    v = value_of(n)
    return tuple(int(s) for s in v.shape) if v is not None else None


def arg_of(n: Node, i: int, name: str, default: Any = None) -> Any:
    if len(n.args) > i:
        return n.args[i]
    return n.kwargs.get(name, default)


def scalar_of(a: Any) -> float | None:
    return float(a) if isinstance(a, (int, float)) and not isinstance(a, bool) else None


def is_close(a: float | None, b: float) -> bool:
    return a is not None and math.isclose(a, b, rel_tol=1e-4)


def needs_grad(n: Node) -> bool:
    """A gradient flows into ``n``'s value: the planning annotation where there is one, else the
    fake value's ``requires_grad`` (a rank's program with propagated values)."""
    info = n.meta.get(TENSOR)
    if info is not None:
        return bool(info.requires_grad)
    v = value_of(n)
    return v is not None and bool(v.requires_grad)


def same_tensor(a: Node, b: Node) -> bool:
    """``a`` and ``b`` hold tensors of one shape and dtype."""
    va, vb = value_of(a), value_of(b)
    return va is not None and vb is not None and va.shape == vb.shape and va.dtype == vb.dtype


def on_last_dim(n: Node, dim: Any) -> bool:
    v = value_of(n)
    return v is not None and isinstance(dim, int) and dim % max(v.dim(), 1) == v.dim() - 1


def is_cast(n: Any) -> bool:
    """A dtype conversion that keeps shape and device (``to``/``_to_copy``)."""
    if not is_aten(n, "to", "_to_copy") or not isinstance(n.args[0], Node):
        return False
    a, b = value_of(n.args[0]), value_of(n)
    return a is not None and b is not None and a.shape == b.shape and a.device == b.device


@dataclass
class Match:
    """A matcher's find, as nodes: what :func:`autopar.passes.fusion.find_groups.to_group` records."""

    kind: FusionKind
    members: list[Node]
    inputs: list[Node | None]
    outputs: list[list[Node]]
    anchor: Node
    attrs: dict[str, Any] = field(default_factory=dict)


def residual_add(x: Any) -> tuple[Node, Node] | None:
    """``(a, b)`` when ``x = a + b`` adds two activations of ``x``'s shape and dtype."""
    if not (is_aten(x, "add") and x.target is torch.ops.aten.add.Tensor):
        return None
    if len(x.args) < 2 or not all(isinstance(a, Node) for a in x.args[:2]):
        return None
    if scalar_of(arg_of(x, 2, "alpha", 1)) != 1.0:
        return None
    a, b = x.args[0], x.args[1]
    return (a, b) if same_tensor(a, x) and same_tensor(b, x) else None


def with_residual(match: Match, x: Node, sum_aliases: list[Node], rest: list[Node | None]) -> Match:
    """Complete a norm's match: with the residual add producing ``x`` when there is one."""
    pair = residual_add(x)
    if pair is not None:
        match.members.insert(0, x)
        match.inputs = [pair[0], pair[1], *rest]
        match.outputs.append([x, *sum_aliases])
    else:
        match.inputs = [x, None, *rest]
        match.outputs.append(list(sum_aliases))
    return match

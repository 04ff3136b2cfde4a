"""The rule registry: how an op runs along one mesh axis (``AxisStrategy``) and the table from
aten ops to the rule that enumerates their strategies. Family modules register their rules here."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch.fx import Node

from autopar.graph import op_name, tensor_inputs, tensor_outputs
from autopar.ir import Rewrite
from autopar.placement import Partial, Placement, Replicate, Shard

__all__ = [
    "AxisStrategy",
    "P",
    "R",
    "align",
    "arg",
    "aten",
    "axis_strategies",
    "has_rule",
    "has_rule_for",
    "norm_dim",
    "op_key",
    "register",
    "rule_names",
    "shape_of",
    "with_hints",
]

aten = torch.ops.aten
R = Replicate()
"""Replicated: the placement most strategies name."""
P = Partial()
"""Partial sums."""


@dataclass(frozen=True, slots=True)
class AxisStrategy:
    """How an op runs along one mesh axis."""

    inputs: tuple[Placement | None, ...]
    """One per entry of ``tensor_inputs(node)`` (``None``: not a tensor; never resharded)."""
    outputs: tuple[Placement, ...]
    """One per entry of ``tensor_outputs(node)``."""
    rewrite: Rewrite = Rewrite.NONE
    """Tag for the lowering: the local op differs from the global one."""
    comm: str = ""
    """A collective inside the op along this axis (e.g. vocabulary-parallel cross-entropy)."""

    @property
    def split(self) -> bool:
        """True when the devices of the axis share the op's work (not a replicated computation)."""
        return any(p is not None and not isinstance(p, Replicate) for p in (*self.inputs, *self.outputs))


def shape_of(n: Node) -> tuple[int, ...]:
    return tuple(int(s) for s in n.meta["val"].shape)


RuleFn = Callable[[Node, list[Node]], list[AxisStrategy]]
_RULES: dict[object, RuleFn] = {}


def register(*ops: object) -> Callable[[RuleFn], RuleFn]:
    """Register a rule for aten ops (overloads or packets) or, for custom ops that may not be
    loaded yet, their packet names (``"grouped_mm_fallback"``)."""

    def deco(fn: RuleFn) -> RuleFn:
        for op in ops:
            _RULES[op] = fn
        return fn

    return deco


def op_key(node: Node) -> object:
    t = node.target
    return getattr(t, "overloadpacket", t)


def _rule_of(node: Node) -> RuleFn | None:
    """The rule registered for the node's op (overload, packet, or packet name for custom ops
    registered by name)."""
    return _RULES.get(node.target) or _RULES.get(op_key(node)) or _RULES.get(op_name(node))


def has_rule(node: Node) -> bool:
    return node.op == "call_function" and _rule_of(node) is not None


def has_rule_for(op_name: str) -> bool:
    """Whether an op, named as a Plan records it (``NodePlan.op``: the aten packet name, e.g.
    ``"linear"``, or a custom op's packet name), has a sharding rule: ``has_rule`` for a plan that
    no longer has its graph."""
    return op_name in rule_names()


def rule_names() -> frozenset[str]:
    """The names of every op with a registered rule, as ``autopar.graph.op_name`` writes them."""
    names = set()
    for key in _RULES:
        if isinstance(key, str):
            names.add(key)
        elif isinstance(key, torch._ops.OpOverload):
            names.add(key.overloadpacket.__name__)
        else:
            names.add(getattr(key, "__name__", str(key)))
    return frozenset(names)


def axis_strategies(node: Node, hints: dict[Node, set[tuple[int, int]]] | None = None) -> list[AxisStrategy]:
    """All strategies of ``node`` along one axis; the replicated strategy is always first.

    ``hints`` maps a node to the ``(dim, blocks)`` block-shardings its consumers can use (see
    ``block_hints``); rules offer ``Shard(dim, blocks)`` variants for them.
    """
    ins = tensor_inputs(node)
    n_out = len(tensor_outputs(node))
    replicated = AxisStrategy(tuple(R for _ in ins), tuple(R for _ in range(n_out)))
    if node.op == "placeholder":
        return [replicated, *_placeholder_strategies(node, hints)]
    if node.op != "call_function":
        return [replicated]
    fn = _rule_of(node)
    if fn is None:
        return [replicated]
    out = [replicated]
    seen = {replicated}
    for s in fn(node, ins, hints or {}) if _takes_hints(fn) else fn(node, ins):
        if len(s.inputs) == len(ins) and len(s.outputs) == n_out and s not in seen:
            seen.add(s)
            out.append(s)
    return out


def _takes_hints(fn: RuleFn) -> bool:
    return getattr(fn, "_hints", False)


def with_hints(fn: Callable[..., list[AxisStrategy]]) -> RuleFn:
    fn._hints = True  # type: ignore[attr-defined]
    return fn


def _placeholder_strategies(node: Node, hints: dict[Node, set[tuple[int, int]]] | None) -> list[AxisStrategy]:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return []
    out = [AxisStrategy((), (Shard(d),)) for d in range(val.dim()) if val.shape[d] > 1]
    for d, k in sorted((hints or {}).get(node, ())):
        out.append(AxisStrategy((), (Shard(d, k),)))
    return out


def align(out_rank: int, in_shape: Sequence[int], out_dim: int) -> Placement:
    """Placement an input needs so that it lines up with an output sharded on ``out_dim``."""
    d = out_dim - (out_rank - len(in_shape))
    if d < 0 or in_shape[d] == 1:
        return R
    return Shard(d)


def arg(node: Node, name: str, default: object) -> object:
    """Argument ``name`` of an aten call, whether it was passed by position or by keyword."""
    schema = getattr(node.target, "_schema", None)
    if schema is not None:
        for i, a in enumerate(schema.arguments):
            if a.name == name and i < len(node.args):
                return node.args[i]
    return node.kwargs.get(name, default)


def norm_dim(d: int, rank: int) -> int:
    return d + rank if d < 0 else d

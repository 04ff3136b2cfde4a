"""Finding the fusion groups of a graph: each node whose op starts a matcher is offered to it
(``MATCHERS``), rotary halves are collected and paired, and a match becomes a group
(:class:`~autopar.passes.fusion.matching.FusionGroup`) when none of its nodes is claimed by an
earlier one and it is closed (no member read outside but through an output)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

from torch.fx import Graph, Node

from autopar.graph import op_name
from autopar.ir import FusionKind
from autopar.passes.fusion.cross_entropy_match import match_cross_entropy
from autopar.passes.fusion.gelu_match import match_gelu, match_tanh_gelu
from autopar.passes.fusion.layer_norm_match import match_layer_norm
from autopar.passes.fusion.matching import (
    FusionGroup,
    Match,
    is_aten,
    needs_grad,
    readers_of,
    shape_of,
    value_of,
)
from autopar.passes.fusion.rms_norm_match import match_rms_norm, match_rms_norm_op
from autopar.passes.fusion.rotary_match import rotary_half, rotary_pairs
from autopar.passes.fusion.swiglu_match import match_swiglu
from autopar.planfile import FusionPlan

_MATCHERS: dict[str, Callable[[Node], Match | None]] = {
    "layer_norm": match_layer_norm,
    "native_layer_norm": match_layer_norm,
    "rms_norm": match_rms_norm_op,
    "rsqrt": match_rms_norm,
    "gelu": match_gelu,
    "tanh": match_tanh_gelu,
    "silu": match_swiglu,
    "cross_entropy_loss": match_cross_entropy,
    "nll_loss": match_cross_entropy,
    "nll_loss_nd": match_cross_entropy,
    "nll_loss2d": match_cross_entropy,
    "sharded_cross_entropy": match_cross_entropy,
    "sharded_nll_loss": match_cross_entropy,
}
"""Op name -> the matcher that starts from such a node (rotary starts from ``add``)."""


def _closed(m: Match) -> bool:
    """No member is read outside the group except through an output (module docstring)."""
    inside = set(m.members)
    exposed = {o for out in m.outputs for o in out}
    for mem in m.members:
        if mem in exposed:
            continue
        if any(r not in inside for r in readers_of(mem)):
            return False
    return True


def to_group(m: Match) -> FusionGroup:
    """The record of match ``m``: node names, input shapes, the first output's dtype, and per output
    how many readers outside the group send it a gradient."""
    inside = set(m.members)
    order = {n: i for i, n in enumerate(m.anchor.graph.nodes)}
    members = sorted(m.members, key=order.__getitem__)
    extern = tuple(
        sum(
            1
            for o in out
            for r in readers_of(o)
            if r not in inside and (r.op == "output" or (r.op == "call_function" and needs_grad(r)))
        )
        for out in m.outputs
    )
    first = value_of(m.outputs[0][0]) if m.outputs[0] else None
    return FusionGroup(
        kind=m.kind,
        members=tuple(n.name for n in members),
        inputs=tuple(i.name if i is not None else None for i in m.inputs),
        input_shapes=tuple(shape_of(i) if i is not None else None for i in m.inputs),
        outputs=tuple(tuple(o.name for o in out) for out in m.outputs),
        anchor=m.anchor.name,
        dtype=str(first.dtype).replace("torch.", "") if first is not None else "float32",
        eps=float(m.attrs.get("eps") or 0.0),
        approximate=str(m.attrs.get("approximate", "none")),
        ignore_index=int(m.attrs.get("ignore_index", -100)),
        reduction=int(m.attrs.get("reduction", 1)),
        split_bias=str(m.attrs.get("split_bias", "")),
        extern_grads=extern,
        lowered=bool(m.attrs.get("lowered", False)),
    )


def find_fusions(graph: Graph) -> list[FusionGroup]:
    """Every fusible group of ``graph`` (module docstring), in program order of their anchors;
    no node is in two groups. Nodes need their values (``meta["val"]``)."""
    claimed: set[Node] = set()
    found: list[tuple[int, Match]] = []
    halves: dict[tuple[Node, Node], list[tuple[Node, Node, list[Node]]]] = {}
    order = {n: i for i, n in enumerate(graph.nodes)}

    def take(m: Match | None) -> None:
        if m is None or any(n in claimed for n in m.members) or not _closed(m):
            return
        claimed.update(m.members)
        found.append((order[m.anchor], m))

    for n in graph.nodes:
        if n.op != "call_function" or n in claimed:
            continue
        name = op_name(n)
        matcher = _MATCHERS.get(name)
        if matcher is not None:
            take(matcher(n))
        elif is_aten(n, "add"):
            half = rotary_half(n)
            if half is not None:
                x, cos, sin, members = half
                halves.setdefault((cos, sin), []).append((x, n, members))
    for m in rotary_pairs(halves):
        take(m)
    found.sort(key=lambda im: im[0])
    return [to_group(m) for _, m in found]


def fusion_plan(groups: Sequence[FusionGroup]) -> list[FusionPlan]:
    """The plan's record of the groups (``Plan.fusions``)."""
    return [FusionPlan(kind=str(g.kind), members=g.members, anchor=g.anchor) for g in groups]


def fusion_counts(groups: Sequence[FusionGroup]) -> dict[str, int]:
    """Groups per kind, in ``FusionKind`` order."""
    c = Counter(str(g.kind) for g in groups)
    return {str(k): c[str(k)] for k in FusionKind if c[str(k)]}

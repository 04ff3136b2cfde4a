"""The ``rotary`` matcher (kernel: ``autopar.program.kernels.rotary``): ``x·cos + rotate_half(x)·sin``
halves, found from their ``add``, then paired (q with k) per cos/sin tables in program order."""

from __future__ import annotations

from typing import Any

import torch
from torch.fx import Node

from autopar.ir import FusionKind
from autopar.passes.fusion.matching import (
    Match,
    arg_of,
    is_aten,
    needs_grad,
    on_last_dim,
    readers_of,
    scalar_of,
    shape_of,
    value_of,
)


def _rotate_half(c: Any) -> tuple[Node, list[Node]] | None:
    """``(x, members)`` when ``c = cat([−x[..., d/2:], x[..., :d/2]], -1)``."""
    if not is_aten(c, "cat") or not on_last_dim(c, arg_of(c, 1, "dim", 0)):
        return None
    parts = c.args[0]
    if not isinstance(parts, (list, tuple)) or len(parts) != 2:
        return None
    neg, first = parts
    if not is_aten(neg, "neg") or not isinstance(neg.args[0], Node):
        return None
    second = neg.args[0]
    if not (is_aten(first, "slice") and is_aten(second, "slice")) or first.args[0] is not second.args[0]:
        return None
    x = first.args[0]
    xs = shape_of(x)
    if xs is None or len(xs) != 4 or xs[-1] % 2:
        return None
    half = xs[-1] // 2
    for sl, lo, hi in ((first, 0, half), (second, half, xs[-1])):
        dim, start, end, step = (
            arg_of(sl, 1, "dim", 0),
            arg_of(sl, 2, "start"),
            arg_of(sl, 3, "end"),
            arg_of(sl, 4, "step", 1),
        )
        if (
            not on_last_dim(x, dim)
            or (start or 0) != lo
            or end is None
            or min(end, xs[-1]) != hi
            or step != 1
        ):
            return None
    return x, [first, second, neg, c]


def rotary_half(a: Node) -> tuple[Node, Node, Node, list[Node]] | None:
    """``(x, cos, sin, members)`` when ``a = x·cos + rotate_half(x)·sin``."""
    if not (is_aten(a, "add") and a.target is torch.ops.aten.add.Tensor) or len(a.args) < 2:
        return None
    if scalar_of(arg_of(a, 2, "alpha", 1)) != 1.0:
        return None
    for p, q in (a.args[:2], a.args[1::-1]):
        if not (is_aten(p, "mul") and is_aten(q, "mul")) or readers_of(p) != [a] or readers_of(q) != [a]:
            continue
        for c, sin in (q.args[:2], q.args[1::-1]):
            rot = _rotate_half(c)
            if rot is None or not isinstance(sin, Node):
                continue
            x, rot_members = rot
            if x not in p.args[:2] or len(p.args) != 2:
                continue
            cos = p.args[1] if p.args[0] is x else p.args[0]
            if not isinstance(cos, Node) or cos is x:
                continue
            return x, cos, sin, [p, *rot_members, q, a]
    return None


def table_ok(t: Node, x: Node) -> bool:
    """cos/sin broadcastable to ``[b, 1, s, d]`` against ``x`` ``[b, h, s, d]``, no gradient."""
    ts, xs = shape_of(t), shape_of(x)
    if ts is None or xs is None or needs_grad(t):
        return False
    if len(ts) == 2:
        return ts == xs[2:]
    return len(ts) == 4 and ts[1] == 1 and ts[2:] == xs[2:] and ts[0] in (1, xs[0])


def rotary_pairs(halves: dict[tuple[Node, Node], list[tuple[Node, Node, list[Node]]]]) -> list[Match]:
    """The rotary matches of the halves found by :func:`rotary_half`, as ``{(cos, sin): [(x, out,
    members), ...]}`` in program order: q and k paired in turn, where both tables fit both (no
    gradient, broadcastable), the shapes agree and each output has its input's promoted dtype."""
    out: list[Match] = []
    for (cos, sin), hs in halves.items():
        for (q, q_out, qm), (k, k_out, km) in zip(hs[0::2], hs[1::2]):
            if q is k or not (table_ok(cos, q) and table_ok(sin, q) and table_ok(cos, k)):
                continue
            qs, ks = shape_of(q), shape_of(k)
            if qs[0] != ks[0] or qs[2:] != ks[2:] or shape_of(q_out) != qs or shape_of(k_out) != ks:
                continue
            kinds = [
                (value_of(x).dtype, value_of(y).dtype, value_of(cos).dtype)
                for x, y in ((q, q_out), (k, k_out))
            ]
            if any(out != torch.promote_types(x, c) for x, out, c in kinds):
                continue
            out.append(Match(FusionKind.ROTARY, qm + km, [q, k, cos, sin], [[q_out], [k_out]], q_out))
    return out

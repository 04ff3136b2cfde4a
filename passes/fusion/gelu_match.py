"""The ``bias_gelu`` matchers (kernel: ``autopar.program.kernels.gelu``): ``aten.gelu``, and GPT-2's
``NewGELUActivation`` written out (found from its ``tanh``), each with the bias added before it or
split out of the ``linear``/``addmm`` that computes its input."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.fx import Node

from autopar.ir import FusionKind
from autopar.passes.fusion.matching import (
    Match,
    arg_of,
    is_aten,
    is_close,
    readers_of,
    same_tensor,
    scalar_of,
    shape_of,
)


def _bias_of(v: Node, readers: set[Node]) -> tuple[Node, Node | None, list[Node], Node | None]:
    """``(x, bias, members, split)`` for a GeLU reading ``v`` (only ``readers`` read it):
    ``v = x + bias`` (``v`` joins the group), or ``v`` computed by a ``linear``/``addmm`` with a
    bias through views keeping the last dimension, each read once (``split``: that GEMM, whose
    bias moves into the fused op), or no bias (``bias`` None)."""
    shape = shape_of(v)
    if shape is None or not shape or set(readers_of(v)) - readers:
        return v, None, [], None
    width = shape[-1]
    if is_aten(v, "add") and v.target is torch.ops.aten.add.Tensor and len(v.args) >= 2:
        a, b = v.args[0], v.args[1]
        if scalar_of(arg_of(v, 2, "alpha", 1)) == 1.0 and isinstance(a, Node) and isinstance(b, Node):
            for act, bias in ((a, b), (b, a)):
                if shape_of(bias) == (width,) and same_tensor(act, v):
                    return act, bias, [v], None
    cur = v
    while is_aten(cur, "view", "reshape", "_unsafe_view") and isinstance(cur.args[0], Node):
        src = cur.args[0]
        if readers_of(src) != [cur] or (shape_of(src) or (None,))[-1] != width:
            return v, None, [], None
        cur = src
    if (
        is_aten(cur, "linear")
        and isinstance(arg_of(cur, 2, "bias"), Node)
        and shape_of(cur.args[2]) == (width,)
    ):
        return v, cur.args[2], [], cur
    if (
        is_aten(cur, "addmm")
        and isinstance(cur.args[0], Node)
        and shape_of(cur.args[0]) == (width,)
        and scalar_of(cur.kwargs.get("beta", 1)) == 1.0
        and scalar_of(cur.kwargs.get("alpha", 1)) == 1.0
    ):
        return v, cur.args[0], [], cur
    return v, None, [], None


def _gelu_match(out: Node, v: Node, members: list[Node], approximate: str) -> Match:
    x, bias, extra, split = _bias_of(v, set(members))
    attrs = {"approximate": approximate, "split_bias": split.name if split is not None else ""}
    return Match(FusionKind.BIAS_GELU, extra + members, [x, bias], [[out]], out, attrs)


def match_gelu(n: Node) -> Match | None:
    if not is_aten(n, "gelu") or not isinstance(n.args[0], Node):
        return None
    approximate = arg_of(n, 1, "approximate", "none")
    if approximate not in ("none", "tanh"):
        return None
    return _gelu_match(n, n.args[0], [n], approximate)


def _mul_tree(n: Any, stop: set[Node] = frozenset()) -> tuple[float, list[Node], list[Node]] | None:
    """``n`` as a product: ``(constant, tensor factors, mul nodes)``, flattening muls that only
    ``n``'s tree reads."""
    if not is_aten(n, "mul"):
        return None
    const, factors, nodes = 1.0, [], [n]
    for a in n.args[:2]:
        c = scalar_of(a)
        if c is not None:
            const *= c
        elif isinstance(a, Node) and a not in stop and is_aten(a, "mul") and readers_of(a) == [n]:
            sub = _mul_tree(a, stop)
            if sub is None:
                return None
            const *= sub[0]
            factors += sub[1]
            nodes += sub[2]
        elif isinstance(a, Node):
            factors.append(a)
        else:
            return None
    return const, factors, nodes


def _add_terms(n: Node) -> tuple[list[Node], list[Node]] | None:
    """``n`` as a sum of tensor terms (no constants), flattening adds only ``n`` reads."""
    if (
        not (is_aten(n, "add") and n.target is torch.ops.aten.add.Tensor)
        or scalar_of(arg_of(n, 2, "alpha", 1)) != 1.0
    ):
        return None
    terms, nodes = [], [n]
    for a in n.args[:2]:
        if not isinstance(a, Node):
            return None
        if is_aten(a, "add") and readers_of(a) == [n]:
            sub = _add_terms(a)
            if sub is None:
                return None
            terms += sub[0]
            nodes += sub[1]
        else:
            terms.append(a)
    return terms, nodes


def _cubic_of(t: Node, v: Node) -> list[Node] | None:
    """Members of ``0.044715 · v³`` (``pow(v, 3)``, ``v·v·v`` or ``pow(v, 2)·v``), or None."""
    tree = _mul_tree(t)
    if tree is None or not is_close(tree[0], 0.044715):
        return None
    _, factors, nodes = tree
    if (
        len(factors) == 1
        and is_aten(factors[0], "pow")
        and factors[0].args[0] is v
        and scalar_of(factors[0].args[1]) == 3.0
    ):
        return [*nodes, factors[0]]
    if len(factors) == 3 and all(f is v for f in factors):
        return nodes
    if len(factors) == 2:
        p = next((f for f in factors if f is not v), None)
        if (
            p is not None
            and is_aten(p, "pow")
            and p.args[0] is v
            and scalar_of(p.args[1]) == 2.0
            and v in factors
        ):
            return [*nodes, p]
    return None


_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def match_tanh_gelu(t: Node) -> Match | None:
    """GPT-2's ``NewGELUActivation`` written out, found from its ``tanh`` (module docstring):
    ``tanh(c·inner)`` with ``c = √(2/π)``, ``inner = v + 0.044715·v³``, and the product
    ``0.5 · v · (1 + tanh(…))``."""
    if not is_aten(t, "tanh") or not isinstance(t.args[0], Node) or readers_of(t.args[0]) != [t]:
        return None
    scaled = _mul_tree(t.args[0])
    if scaled is None or not is_close(scaled[0], _SQRT_2_OVER_PI) or len(scaled[1]) != 1:
        return None
    inner = scaled[1][0]
    if len(readers_of(inner)) != 1:
        return None
    summed = _add_terms(inner)
    if summed is None or len(summed[0]) != 2:
        return None
    v = cubic = None
    for a, b in (summed[0], summed[0][::-1]):
        members = _cubic_of(b, a) if len(readers_of(b)) == 1 else None
        if members is not None:
            v, cubic = a, members
            break
    if v is None:
        return None
    ones = readers_of(t)
    if len(ones) != 1 or not is_aten(ones[0], "add") or scalar_of(arg_of(ones[0], 2, "alpha", 1)) != 1.0:
        return None
    one_plus = ones[0]
    if [scalar_of(a) for a in one_plus.args[:2] if not isinstance(a, Node)] != [1.0]:
        return None
    chain, cur = [], one_plus
    while len(readers_of(cur)) == 1 and is_aten(readers_of(cur)[0], "mul"):
        cur = readers_of(cur)[0]
        chain.append(cur)
    for top in reversed(chain):  # the largest product of 0.5, v and (1 + tanh) alone
        tree = _mul_tree(top, stop={one_plus})
        if (
            tree is not None
            and is_close(tree[0], 0.5)
            and sorted(map(id, tree[1])) == sorted(map(id, [v, one_plus]))
        ):
            members = [*scaled[2], *summed[1], *cubic, t, one_plus, *tree[2]]
            return _gelu_match(top, v, list(dict.fromkeys(members)), "tanh")
    return None

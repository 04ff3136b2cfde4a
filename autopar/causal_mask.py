"""Attention masks proven causal, and the attention that reads one turned into ``is_causal``.

Under ``torch.export`` transformers builds an explicit boolean mask where eager mode calls
``scaled_dot_product_attention(..., is_causal=True)``: while tracing it cannot prove that no
padding or packing changes the mask, so it computes one from the positions. When that mask is
computed from positions alone (no user input reaches it), it is the same on every step, and
``prove_causal`` decides whether it is exactly the square causal triangle — key ``j`` visible to
query ``i`` if and only if ``j ≤ i`` — for every batch row and head. ``causal_attention`` then
rewrites the attention to ``is_causal=True`` without the mask: the value is the same, the kernel
skips the masked half (as ``autopar.passes.annotate`` prices a triangle mask), and the mask —
``batch × s²`` booleans, 17 GB for one 131 072-token sequence, built on every step — is never
built.

Words:

* **small value** — a node computed without user inputs, of at most ``SMALL`` elements: evaluated
  on the CPU (positions, sequence ids, their broadcast index vectors: O(batch · s)).
* **abstract value** — a large mask (O(s²)) known only by what it is: ``TRUE`` (every element
  true) or ``CAUSAL`` (the triangle). Rules: a comparison ``le(k, q)`` (or ``ge(q, k)``) of small
  key positions varying along the last dimension and query positions along the one before, the
  same strictly increasing vector for both, is ``CAUSAL`` (``k[j] ≤ q[i]`` exactly when
  ``j ≤ i``); ``eq`` of two such operands holding one value per batch row (a packed-sequence id
  where nothing is packed) is ``TRUE``; ``and`` keeps ``CAUSAL`` with ``TRUE`` or ``CAUSAL``;
  casts to bool, expands and views keep a value. Anything else is unknown, and the mask is kept.
"""

from __future__ import annotations

import enum
from typing import Any

import torch
from torch.fx import GraphModule, Node

from autopar.graph import OpFamily, is_random, op_family, op_name, written_inputs

__all__ = ["SMALL", "causal_attention", "prove_mask"]

SMALL = 1 << 26
"""Elements up to which a value is evaluated on the CPU: the O(batch · s) position vectors of any
sequence people train (64 sequences of 1M tokens), the O(batch · s²) mask itself below about
8 × 2896 tokens."""

aten = torch.ops.aten


class _Mask(enum.Enum):
    TRUE = "true"
    CAUSAL = "causal"


_KEEP = {"expand", "view", "reshape", "unsqueeze", "alias", "clone", "contiguous", "_unsafe_view"}
_CAST = {"to", "_to_copy"}
_AND = {"__and__", "bitwise_and", "logical_and"}
_FLIP = {"le": "ge", "ge": "le", "lt": "gt", "gt": "lt", "eq": "eq"}
"""Comparisons and the one with swapped operands."""


def _is_bool_cast(node: Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.dtype == torch.bool


class _Prover:
    def __init__(self, constants: dict[str, Any]) -> None:
        self.constants = constants
        self.memo: dict[Node, Any] = {}

    def prove(self, mask: Node) -> str | None:
        """``prove_mask`` with this prover's memo (one mask is read by every layer)."""
        got = _classify(self.value(mask))
        return None if got is None else got.value

    def value(self, node: Node) -> Any:
        """A concrete CPU tensor, a ``_Mask``, or None (unknown)."""
        if node not in self.memo:
            self.memo[node] = None  # cycles cannot occur in a DAG; guards recursion on failure
            self.memo[node] = self._value(node)
        return self.memo[node]

    def _value(self, node: Node) -> Any:
        if node.op == "placeholder":
            c = self.constants.get(node.name)
            return c.detach().to("cpu") if isinstance(c, torch.Tensor) and c.numel() <= SMALL else None
        if node.op != "call_function" or is_random(node) or written_inputs(node):
            return None
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor) or not all(isinstance(d, int) for d in val.shape):
            return None  # a symbolic shape: nothing is proven
        if val.numel() <= SMALL:
            return self._evaluate(node)
        return self._abstract(node)

    def _evaluate(self, node: Node) -> torch.Tensor | None:
        ok = True

        def concrete(a: Any) -> Any:
            nonlocal ok
            if isinstance(a, Node):
                v = self.value(a)
                if not isinstance(v, torch.Tensor):
                    ok = False
                return v
            return a

        args = torch.fx.node.map_aggregate(node.args, concrete)
        kwargs = dict(torch.fx.node.map_aggregate(node.kwargs, concrete))
        if not ok:
            return None
        if "device" in kwargs:
            kwargs["device"] = torch.device("cpu")
        try:
            out = node.target(*args, **kwargs)
        except Exception:  # an op the CPU cannot run here: unknown, the mask is kept
            return None
        return out if isinstance(out, torch.Tensor) else None

    def _abstract(self, node: Node) -> _Mask | None:
        name = op_name(node)
        args = [a for a in node.args if isinstance(a, Node)]
        if (name in _KEEP or (name in _CAST and _is_bool_cast(node))) and args:
            return _classify(self.value(args[0]))
        if name in _AND and len(args) == 2:
            a, b = (_classify(self.value(x)) for x in args)
            if a is None or b is None:
                return None
            return _Mask.CAUSAL if _Mask.CAUSAL in (a, b) else _Mask.TRUE
        if name in _FLIP and len(args) == 2:
            a, b = (self.value(x) for x in args)
            if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.dim() < 2:
                return None
            if a.shape[-1] == 1 and a.shape[-2] != 1:  # queries first: op(q, k) is flip(op)(k, q)
                a, b, name = b, a, _FLIP[name]
            return _compare(name, a, b, tuple(node.meta["val"].shape))
        return None


def _classify(v: Any) -> _Mask | None:
    """A value as a ``_Mask``: abstract ones as they are, a concrete boolean one by its elements."""
    if v is None or isinstance(v, _Mask):
        return v
    if not isinstance(v, torch.Tensor) or v.dtype != torch.bool:
        return None
    if bool(v.all()):
        return _Mask.TRUE
    if v.dim() >= 2 and v.shape[-1] == v.shape[-2]:
        s = v.shape[-1]
        tri = torch.ones(s, s, dtype=torch.bool).tril()
        if bool((v == tri).all()):
            return _Mask.CAUSAL
    return None


def _compare(name: str, k: torch.Tensor, q: torch.Tensor, shape: tuple[int, ...]) -> _Mask | None:
    """``name(k, q)`` (``le``, ``lt``, ``ge``, ``gt``, ``eq``) broadcast to ``shape`` (…, s_q,
    s_k), from small operands: ``k`` varying along the last dimension only, ``q`` along the one
    before only. ``TRUE`` where every key compares true with every query of its row (bounds
    suffice: a sliding window wider than the sequence); ``CAUSAL`` for ``le`` of one strictly
    increasing position vector with itself (module docstring)."""
    if len(shape) < 2 or k.dim() < 2 or q.dim() < 2:
        return None
    if k.shape[-2] != 1 or q.shape[-1] != 1:
        return None
    lead = shape[:-2]
    try:
        keys = k.expand(*lead, 1, shape[-1]).reshape(-1, shape[-1])
        queries = q.expand(*lead, shape[-2], 1).reshape(-1, shape[-2])
    except RuntimeError:
        return None
    kmin, kmax = keys.amin(1), keys.amax(1)
    qmin, qmax = queries.amin(1), queries.amax(1)
    everywhere = {
        "le": kmax <= qmin,
        "lt": kmax < qmin,
        "ge": kmin >= qmax,
        "gt": kmin > qmax,
        "eq": (kmin == kmax) & (qmin == qmax) & (kmin == qmin),
    }[name]
    if bool(everywhere.all()):
        return _Mask.TRUE
    if name != "le" or shape[-1] != shape[-2] or not torch.equal(keys, queries):
        return None
    increasing = bool((keys[:, 1:] > keys[:, :-1]).all()) if shape[-1] > 1 else True
    return _Mask.CAUSAL if increasing else None


def prove_mask(mask: Node, constants: dict[str, Any] | None = None) -> str | None:
    """What ``mask`` (a boolean attention mask node) is proven to be on every batch row and head:
    ``"causal"`` (the square causal triangle), ``"true"`` (every key visible) or None (module
    docstring). ``constants``: lifted constant placeholders by name."""
    return _Prover(dict(constants or {})).prove(mask)


def causal_attention(gm: GraphModule, constants: dict[str, Any] | None = None) -> int:
    """Rewrite every ``scaled_dot_product_attention`` whose boolean mask ``prove_mask`` proves the
    square causal triangle to ``is_causal=True`` without the mask, and one whose mask it proves
    all true to no mask (an encoder given no padding); drop the mask's subgraph where nothing else
    reads it. Returns how many attentions were rewritten."""
    graph = gm.graph
    done = 0
    prover = _Prover(dict(constants or {}))  # one mask is read by every layer: proven once
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten.scaled_dot_product_attention.default:
            continue
        names = [a.name for a in node.target._schema.arguments]
        given = dict(zip(names, node.args)) | dict(node.kwargs)
        mask = given.get("attn_mask")
        if not isinstance(mask, Node) or given.get("is_causal", False):
            continue
        mval, q, k = mask.meta.get("val"), given["query"], given["key"]
        if not isinstance(mval, torch.Tensor) or mval.dtype != torch.bool:
            continue
        proven = prover.prove(mask)
        if proven is None or tuple(mval.shape[-2:]) != (q.meta["val"].shape[-2], k.meta["val"].shape[-2]):
            continue  # also: a mask broadcast along the queries or keys is not the whole mask
        if proven == "causal" and q.meta["val"].shape[-2] != k.meta["val"].shape[-2]:
            continue  # is_causal aligns top-left: only a square triangle is the same mask
        given["attn_mask"] = None
        given["is_causal"] = proven == "causal"
        positional = [given.pop(n) for n in names[:3]]
        node.args = tuple(positional)
        node.kwargs = {n: given[n] for n in names[3:] if n in given}
        _drop_unused(mask)
        done += 1
    if done:
        gm.recompile()
    return done


def _drop_unused(node: Node) -> None:
    """Erase ``node`` and, in turn, the inputs only it read (pure ops: the mask's subgraph), with
    the metadata assertions export wrote on them (they compute nothing)."""
    stack = [node]
    erased: set[Node] = set()
    while stack:
        n = stack.pop()
        if n in erased or n.op != "call_function" or written_inputs(n):
            continue  # a node read twice (``expand`` of one value by two paths) is erased once
        checks = [u for u in n.users if op_family(u) is OpFamily.ASSERT and not u.users]
        if len(checks) != len(n.users):
            continue
        for u in checks:
            n.graph.erase_node(u)
            erased.add(u)
        ins = list(n.all_input_nodes)
        n.graph.erase_node(n)
        erased.add(n)
        stack.extend(ins)

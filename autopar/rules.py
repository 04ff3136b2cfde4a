"""Sharding rules: for each aten op, the ways it can run on one mesh axis.

A rule looks at one fx node (shapes and dtypes from its FakeTensor ``val``) and returns a list of
``AxisStrategy``: one placement per tensor input and one per tensor output, meaning "if the inputs
arrive laid out like this along the axis, running the op locally on every device gives outputs
laid out like that". N-D strategies are products of axis strategies, kept when every tensor
divides evenly (``passes.strategies``).

Rules are written by op *family*, never per model:

* pointwise — any dimension of the (broadcast) output, mapped back to each input; ``Partial``
  flows through ops that are linear in that input (add/sub of two partials, mul/div by a
  replicated factor, casts and copies).
* views — ``view``/``reshape``/``expand``/``transpose``/``permute``/``unsqueeze``/``split``/``cat``...
  follow the dimension mapping; a reshape moves a shard only where the sharded dimension leads its
  group of merged or split dimensions, so every local piece stays contiguous.
* matmul — ``mm``/``addmm``/``bmm``/``matmul``/``linear``: shard a batch, row or column
  dimension, or the contracted dimension (output ``Partial``; Megatron-LM's row-parallel layer).
* reductions, normalizations, softmax — shard any dimension not reduced over; ``sum``/``mean``
  over a sharded dimension give ``Partial``.
* embedding — shard the batch (indices), the embedding dimension, or the vocabulary (output
  ``Partial``: Megatron-LM's vocabulary-parallel embedding, arXiv 1909.08053 §3).
* attention (SDPA) — shard batch or heads; or queries' sequence with keys/values replicated.
* cross-entropy — shard the rows (output ``Partial``) and/or the classes (vocabulary-parallel
  cross-entropy; its max and sum-exp all-reduces are part of the op, costed by ``op_comm``).

Ops with no rule run replicated (a single warning names them): always correct. Each strategy may
carry a ``rewrite`` tag: the lowering (``passes.lower``) must change the local op, e.g. the mean
over a sharded dimension becomes a local mean divided by the shard count.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch.fx import Node

from autopar.placement import Partial, Placement, Replicate, Shard

__all__ = [
    "ZERO1",
    "ZERO2",
    "ZERO_TAGS",
    "AxisStrategy",
    "axis_strategies",
    "has_rule",
    "tensor_inputs",
    "tensor_outputs",
    "zero_stage_of",
]

aten = torch.ops.aten
R = Replicate()
ZERO1 = "zero1"
"""Tag of a sharded parameter whose users gather it once and keep it; its gradient is all-reduced
in full, then this device keeps its shard (ZeRO stage 1: only optimizer state is sharded)."""
ZERO2 = "zero2"
"""Tag of a sharded parameter gathered once and kept for backward, its gradient reduce-scattered
(ZeRO stage 2: gradients and optimizer state sharded). Untagged sharded parameters that users
gather are gathered again in backward and freed after each use (ZeRO stage 3)."""
ZERO_TAGS = {ZERO1: 1, ZERO2: 2}


def zero_stage_of(rewrites: Sequence[str]) -> int:
    """The ZeRO stage a sharded parameter runs with, from its strategy's rewrite tags."""
    for r in rewrites:
        if r in ZERO_TAGS:
            return ZERO_TAGS[r]
    return 3


P = Partial()


@dataclass(frozen=True, slots=True)
class AxisStrategy:
    """How an op runs along one mesh axis."""

    inputs: tuple[Placement | None, ...]
    """One per entry of ``tensor_inputs(node)`` (``None``: not a tensor; never resharded)."""
    outputs: tuple[Placement, ...]
    """One per entry of ``tensor_outputs(node)``."""
    rewrite: str = ""
    """Tag for the lowering: the local op differs from the global one."""
    comm: str = ""
    """A collective inside the op along this axis (e.g. vocabulary-parallel cross-entropy)."""

    @property
    def split(self) -> bool:
        """True when the devices of the axis share the op's work (not a replicated computation)."""
        return any(p is not None and not isinstance(p, Replicate) for p in (*self.inputs, *self.outputs))


# --------------------------------------------------------------------------------------------
# What counts as a tensor input / output of a node


def tensor_inputs(node: Node) -> list[Node]:
    """The distinct tensor-valued producer nodes of ``node``, in first-use order."""
    return [n for n in node.all_input_nodes if _is_tensor_node(n)]


def _is_tensor_node(n: Node) -> bool:
    return isinstance(n.meta.get("val"), torch.Tensor)


def tensor_outputs(node: Node) -> list[torch.Tensor]:
    """The tensors ``node`` produces, flattened (most ops: one)."""
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return [val]
    if isinstance(val, (list, tuple)):
        return [v for v in val if isinstance(v, torch.Tensor)]
    return []


def _shape(n: Node) -> tuple[int, ...]:
    return tuple(int(s) for s in n.meta["val"].shape)


# --------------------------------------------------------------------------------------------
# Rule registry

RuleFn = Callable[[Node, list[Node]], list[AxisStrategy]]
_RULES: dict[object, RuleFn] = {}


def _register(*ops: object) -> Callable[[RuleFn], RuleFn]:
    def deco(fn: RuleFn) -> RuleFn:
        for op in ops:
            _RULES[op] = fn
        return fn

    return deco


def _key(node: Node) -> object:
    t = node.target
    return getattr(t, "overloadpacket", t)


def has_rule(node: Node) -> bool:
    return node.op == "call_function" and (_key(node) in _RULES or node.target in _RULES)


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
    fn = _RULES.get(node.target) or _RULES.get(_key(node))
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


def _with_hints(fn: Callable[..., list[AxisStrategy]]) -> RuleFn:
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


# --------------------------------------------------------------------------------------------
# Helpers for broadcasting


def _align(out_rank: int, in_shape: Sequence[int], out_dim: int) -> Placement:
    """Placement an input needs so that it lines up with an output sharded on ``out_dim``."""
    d = out_dim - (out_rank - len(in_shape))
    if d < 0 or in_shape[d] == 1:
        return R
    return Shard(d)


def _arg(node: Node, name: str, default: object) -> object:
    """Argument ``name`` of an aten call, whether it was passed by position or by keyword."""
    schema = getattr(node.target, "_schema", None)
    if schema is not None:
        for i, a in enumerate(schema.arguments):
            if a.name == name and i < len(node.args):
                return node.args[i]
    return node.kwargs.get(name, default)


def _norm_dim(d: int, rank: int) -> int:
    return d + rank if d < 0 else d


def _shard_dim_of(p: Placement | None) -> int | None:
    return p.dim if isinstance(p, Shard) else None


# --------------------------------------------------------------------------------------------
# Pointwise

_UNARY = [
    aten.neg,
    aten.tanh,
    aten.silu,
    aten.gelu,
    aten.relu,
    aten.sigmoid,
    aten.exp,
    aten.log,
    aten.rsqrt,
    aten.sqrt,
    aten.abs,
    aten.erf,
    aten.sin,
    aten.cos,
    aten.reciprocal,
    aten.square,
    aten.clamp,
    aten.clamp_min,
    aten.clamp_max,
    aten.hardtanh,
    aten.leaky_relu,
    aten.softplus,
    aten.elu,
    aten.mish,
    aten.hardswish,
    aten.hardsigmoid,
    aten.logical_not,
    aten.bitwise_not,
    aten.dropout,
    aten.native_dropout,
    aten.clone,
    aten.contiguous,
    aten.alias,
    aten.detach,
    aten.to,
    aten._to_copy,
    aten.type_as,
    aten.zeros_like,
    aten.ones_like,
    aten.full_like,
    aten.empty_like,
    aten.rand_like,
    aten.isnan,
    aten.isinf,
    aten.sign,
    aten.floor,
    aten.ceil,
    aten.round,
    aten.log1p,
    aten.expm1,
    aten.gelu_,
    aten.relu_,
    aten.silu_,
    aten.masked_fill,
    aten.where,
    aten.pow,
    aten.add,
    aten.sub,
    aten.mul,
    aten.div,
    aten.rsub,
    aten.eq,
    aten.ne,
    aten.lt,
    aten.le,
    aten.gt,
    aten.ge,
    aten.__and__,
    aten.__or__,
    aten.bitwise_and,
    aten.bitwise_or,
    aten.logical_and,
    aten.logical_or,
    aten.maximum,
    aten.minimum,
    aten.fmod,
    aten.remainder,
    aten.lerp,
    aten.addcmul,
    aten.addcdiv,
    aten.tril,
    aten.triu,
    aten.floor_divide,
]
# Ops linear in each tensor input (so Partial passes through when all tensor inputs are Partial).
_LINEAR_ALL = {aten.neg, aten.clone, aten.contiguous, aten.alias, aten.to, aten._to_copy, aten.add, aten.sub}
# Ops linear in one input given the others replicated (mul by a replicated factor, div by one).
_LINEAR_ONE = {aten.mul: (0, 1), aten.div: (0,)}


@_register(*_UNARY)
def _pointwise(node: Node, ins: list[Node]) -> list[AxisStrategy]:
    out_shape = _shape(node) if isinstance(node.meta.get("val"), torch.Tensor) else None
    if out_shape is None:
        return []
    # tril/triu act on the last two dimensions as a pair: they must stay unsharded.
    banned = set()
    if _key(node) in (aten.tril, aten.triu):
        banned = {len(out_shape) - 1, len(out_shape) - 2}
    rank = len(out_shape)
    strategies = []
    for d in range(rank):
        if out_shape[d] == 1 or d in banned:
            continue
        strategies.append(AxisStrategy(tuple(_align(rank, _shape(i), d) for i in ins), (Shard(d),)))
    key = _key(node)
    tensor_args = [a for a in node.args if isinstance(a, Node)]
    if (
        ins
        and key in _LINEAR_ALL
        and len(tensor_args) == len([a for a in node.args if not isinstance(a, (torch.dtype, bool))])
        and all(_shape(i) == out_shape for i in ins)
    ):
        strategies.append(AxisStrategy(tuple(P for _ in ins), (P,)))
    if key in _LINEAR_ONE:
        # mul(a, b): Partial in the one input that is full-size, the other replicated.
        args = node.args
        for pos in _LINEAR_ONE[key]:
            if pos < len(args) and isinstance(args[pos], Node) and args[pos] in ins:
                partial_in = args[pos]
                if _shape(partial_in) != out_shape:
                    continue
                strategies.append(AxisStrategy(tuple(P if i is partial_in else R for i in ins), (P,)))
    return strategies


# --------------------------------------------------------------------------------------------
# Views and shape ops


def _view_groups(
    in_shape: Sequence[int], out_shape: Sequence[int]
) -> list[tuple[list[int], list[int]]] | None:
    """Pair up runs of input and output dims with equal products (the reshape's dim mapping)."""
    groups = []
    i = j = 0
    ni, no = len(in_shape), len(out_shape)
    while i < ni or j < no:
        gi, gj = [], []
        pi = pj = 1
        if i < ni:
            gi.append(i)
            pi *= in_shape[i]
            i += 1
        if j < no:
            gj.append(j)
            pj *= out_shape[j]
            j += 1
        while pi != pj:
            if pi < pj and i < ni:
                gi.append(i)
                pi *= in_shape[i]
                i += 1
            elif pj < pi and j < no:
                gj.append(j)
                pj *= out_shape[j]
                j += 1
            else:
                return None
        groups.append((gi, gj))
    return groups


def _view_map(in_shape: Sequence[int], out_shape: Sequence[int]) -> dict[tuple[int, int], int]:
    """``(in_dim, blocks) -> out_dim`` for shards that survive the reshape as contiguous pieces."""
    groups = _view_groups(in_shape, out_shape)
    if groups is None:
        return {}
    mapping = {}
    for gi, gj in groups:
        lead_i = [d for d in gi if in_shape[d] != 1]
        lead_j = [d for d in gj if out_shape[d] != 1]
        if not lead_i or not lead_j:
            continue
        mapping[(lead_i[0], 1)] = lead_j[0]
        if len(lead_i) == 1 and len(lead_j) == 1:
            mapping[(lead_i[0], 0)] = lead_j[0]  # blocks of any count survive a 1:1 dim
    return mapping


def _view_like(node: Node, ins: list[Node], hints: dict) -> list[AxisStrategy]:
    src = node.args[0]
    if not isinstance(src, Node) or not ins:
        return []
    in_shape, out_shape = _shape(src), _shape(node)
    mapping = _view_map(in_shape, out_shape)
    out = []
    for d in range(len(in_shape)):
        od = mapping.get((d, 1))
        if od is not None:
            out.append(AxisStrategy(tuple(Shard(d) if i is src else R for i in ins), (Shard(od),)))
    for d, k in hints.get(src, ()):
        od = mapping.get((d, 0))
        if od is not None:
            out.append(AxisStrategy(tuple(Shard(d, k) if i is src else R for i in ins), (Shard(od, k),)))
    if len(ins) == 1:
        out.append(AxisStrategy((P,), (P,)))
    return out


_register(
    aten.view, aten.reshape, aten._unsafe_view, aten.squeeze, aten.unsqueeze, aten.flatten, aten.unflatten
)(_with_hints(_view_like))


@_register(aten.expand)
def _expand(node: Node, ins: list[Node]) -> list[AxisStrategy]:
    src = node.args[0]
    in_shape, out_shape = _shape(src), _shape(node)
    off = len(out_shape) - len(in_shape)
    out = []
    for d in range(len(in_shape)):
        if in_shape[d] == out_shape[d + off] and in_shape[d] > 1:
            out.append(AxisStrategy((Shard(d),), (Shard(d + off),)))
    out.append(AxisStrategy((P,), (P,)))
    return out


@_with_hints
def _permute_like(node: Node, ins: list[Node], hints: dict) -> list[AxisStrategy]:
    src = node.args[0]
    rank = len(_shape(src))
    key = _key(node)
    if key is aten.permute:
        perm = [_norm_dim(d, rank) for d in node.args[1]]
    elif key is aten.t:
        perm = [1, 0] if rank == 2 else [0]
    else:  # transpose
        a, b = _norm_dim(node.args[1], rank), _norm_dim(node.args[2], rank)
        perm = list(range(rank))
        perm[a], perm[b] = perm[b], perm[a]
    inv = {p: i for i, p in enumerate(perm)}
    out = [AxisStrategy((Shard(d),), (Shard(inv[d]),)) for d in range(rank) if _shape(src)[d] > 1]
    out += [AxisStrategy((Shard(d, k),), (Shard(inv[d], k),)) for d, k in hints.get(src, ())]
    out.append(AxisStrategy((P,), (P,)))
    return out


_register(aten.transpose, aten.permute, aten.t)(_permute_like)


@_register(aten.slice, aten.narrow, aten.select)
def _slice(node: Node, ins: list[Node]) -> list[AxisStrategy]:
    src = node.args[0]
    in_shape = _shape(src)
    dim = _norm_dim(node.args[1] if len(node.args) > 1 else 0, len(in_shape))
    removed = _key(node) is aten.select
    out = []
    for d in range(len(in_shape)):
        if d == dim or in_shape[d] == 1:
            continue
        od = d - 1 if removed and d > dim else d
        out.append(AxisStrategy(tuple(Shard(d) if i is src else R for i in ins), (Shard(od),)))
    if len(ins) == 1:
        out.append(AxisStrategy((P,), (P,)))
    return out


@_with_hints
def _split(node: Node, ins: list[Node], hints: dict) -> list[AxisStrategy]:
    src = node.args[0]
    in_shape = _shape(src)
    outs = tensor_outputs(node)
    key = _key(node)
    if key is aten.unbind:
        dim = _norm_dim(node.args[1] if len(node.args) > 1 else 0, len(in_shape))
    else:
        dim = _norm_dim(node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0), len(in_shape))
    out = []
    for d in range(len(in_shape)):
        if d == dim or in_shape[d] == 1:
            continue
        od = d - 1 if key is aten.unbind and d > dim else d
        out.append(AxisStrategy((Shard(d),), tuple(Shard(od) for _ in outs)))
    sizes = {int(o.shape[dim]) for o in outs} if key is not aten.unbind else set()
    if len(sizes) == 1 and len(outs) > 1:
        # Equal parts along a block-sharded dim: each part comes out plainly sharded.
        out.append(
            AxisStrategy((Shard(dim, len(outs)),), tuple(Shard(dim) for _ in outs), rewrite="split_local")
        )
    out.append(AxisStrategy((P,), tuple(P for _ in outs)))
    return out


_register(aten.split, aten.split_with_sizes, aten.chunk, aten.unbind)(_split)


@_register(aten.pad, aten.constant_pad_nd)
def _pad(node: Node, ins: list[Node]) -> list[AxisStrategy]:
    """Padding changes only the padded dimensions: any other one can stay sharded."""
    src = node.args[0]
    rank = len(_shape(src))
    pads = list(node.args[1]) if len(node.args) > 1 else []
    padded = {rank - 1 - i // 2 for i, p in enumerate(pads) if p}
    return [
        AxisStrategy((Shard(d),), (Shard(d),)) for d in range(rank) if d not in padded and _shape(src)[d] > 1
    ]


@_register(aten.cat, aten.concat, aten.stack)
def _cat(node: Node, ins: list[Node]) -> list[AxisStrategy]:
    out_shape = _shape(node)
    stack = _key(node) is aten.stack
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    dim = _norm_dim(dim, len(out_shape))
    out = []
    for d in range(len(out_shape)):
        if d == dim or out_shape[d] == 1:
            continue
        ind = d - 1 if stack and d > dim else d
        out.append(AxisStrategy(tuple(Shard(ind) for _ in ins), (Shard(d),)))
    out.append(AxisStrategy(tuple(P for _ in ins), (P,)))
    return out


@_register(operator.getitem)
def _getitem(node: Node, ins: list[Node]) -> list[AxisStrategy]:
    # getitem of a multi-output op: placement follows the producer (see passes.strategies).
    return []


# --------------------------------------------------------------------------------------------
# Matmul family. Each is an einsum; we list its dims and derive strategies generically.


def _einsum_strategies(
    letters_in: Sequence[str | None],
    letter_out: str,
    contracted: str,
    operands: Sequence[Node | None],
    ins: list[Node],
    shapes: dict[str, int],
    hints: dict,
    out_node: Node,
    additive: Node | None = None,
) -> list[AxisStrategy]:
    """Strategies of ``out = einsum(letters_in -> letter_out) (+ additive)``: shard one letter on
    every operand that has it; a contracted letter gives a Partial output."""
    letters = sorted({c for s in letters_in if s for c in s} | set(letter_out))
    out = []

    def spec_for(letter: str, blocks: int = 1) -> AxisStrategy | None:
        placements = {}
        for s, node in zip(letters_in, operands):
            if node is None or s is None:
                continue
            p = Shard(s.index(letter), blocks) if letter in s else R
            if node in placements and placements[node] != p:
                return None
            placements[node] = p
        if letter in letter_out:
            o: Placement = Shard(letter_out.index(letter), blocks)
        elif letter in contracted:
            o = P
            # An added bias joins a Partial output as Partial itself: one device adds it.
            for s, node in zip(letters_in, operands):
                if node is not None and s is not None and letter not in s and node is additive:
                    placements[node] = P
        else:
            return None
        return AxisStrategy(tuple(placements.get(i, R) for i in ins), (o,))

    for c in letters:
        if shapes.get(c, 1) > 1:
            s = spec_for(c)
            if s is not None:
                out.append(s)
    for d, k in hints.get(out_node, ()):
        if d < len(letter_out):
            s = spec_for(letter_out[d], k)
            if s is not None:
                out.append(s)
    return out


def _batch_letters(n: int) -> str:
    return "abcdefgh"[:n]


@_with_hints
def _matmul(node: Node, ins: list[Node], hints: dict) -> list[AxisStrategy]:
    key = _key(node)
    a = node.args
    if key in (aten.mm, aten.bmm, aten.matmul):
        x, w, bias = a[0], a[1], None
    elif key in (aten.addmm, aten.baddbmm):
        bias, x, w = a[0], a[1], a[2]
    else:  # linear(x, w, bias): out = x @ w.T + bias
        x, w = a[0], a[1]
        bias = a[2] if len(a) > 2 else node.kwargs.get("bias")
    xs, ws = _shape(x), _shape(w)
    os_ = _shape(node)
    if key is aten.linear:
        nb = len(xs) - 1
        lx = _batch_letters(nb) + "k"
        lw = "nk"
        lo = _batch_letters(nb) + "n"
    elif len(xs) >= 2 and len(ws) >= 2:
        nbx, nbw = len(xs) - 2, len(ws) - 2
        nb = max(nbx, nbw)
        b = _batch_letters(nb)
        lx = b[nb - nbx :] + "mk"
        lw = b[nb - nbw :] + "kn"
        lo = b + "mn"
    elif len(xs) == 1 and len(ws) == 2:
        lx, lw, lo = "k", "kn", "n"
    elif len(xs) >= 2 and len(ws) == 1:
        b = _batch_letters(len(xs) - 2)
        lx, lw, lo = b + "mk", "k", b + "m"
    else:
        return []
    shapes = {}
    for letters, sh in ((lx, xs), (lw, ws), (lo, os_)):
        for c, s in zip(letters, sh):
            if s != 1:
                shapes[c] = s
    operands: list[Node | None] = [x if isinstance(x, Node) else None, w if isinstance(w, Node) else None]
    letters_in: list[str | None] = [lx, lw]
    if isinstance(bias, Node):
        bs = _shape(bias)
        letters_in.append(lo[len(lo) - len(bs) :] if bs else "")
        operands.append(bias)
    out = _einsum_strategies(
        letters_in,
        lo,
        "k",
        operands,
        ins,
        shapes,
        hints,
        node,
        additive=bias if isinstance(bias, Node) else None,
    )
    # Partial activations times a replicated weight stay Partial (no bias).
    if bias is None and isinstance(x, Node) and x is not w:
        out.append(AxisStrategy(tuple(P if i is x else R for i in ins), (P,)))
    # Bias with a broadcast dim of size 1 must be Replicate where the letter is missing.
    fixed = []
    for s in out:
        if isinstance(bias, Node):
            bi = ins.index(bias)
            bp = s.inputs[bi]
            if isinstance(bp, Shard) and _shape(bias)[bp.dim] == 1:
                s = AxisStrategy(tuple(R if j == bi else p for j, p in enumerate(s.inputs)), s.outputs)
        fixed.append(s)
    return fixed


_register(aten.mm, aten.bmm, aten.matmul, aten.addmm, aten.baddbmm, aten.linear)(_matmul)


# --------------------------------------------------------------------------------------------
# Reductions and normalizations


_REDUCTIONS = (
    aten.sum,
    aten.mean,
    aten.amax,
    aten.amin,
    aten.var,
    aten.std,
    aten.prod,
    aten.argmax,
    aten.argmin,
    aten.any,
    aten.all,
    aten.logsumexp,
    aten.norm,
)


def _reduced_dims(node: Node, rank: int) -> tuple[set[int], bool]:
    key = _key(node)
    args = node.args
    if key in _REDUCTIONS:
        dims = args[1] if len(args) > 1 else node.kwargs.get("dim")
        keep = args[2] if len(args) > 2 else node.kwargs.get("keepdim", False)
        if dims is None or dims == [] or dims == ():
            return set(range(rank)), bool(keep)
        if isinstance(dims, int):
            dims = [dims]
        return {_norm_dim(d, rank) for d in dims}, bool(keep)
    return set(), True


@_register(*_REDUCTIONS)
def _reduction(node: Node, ins: list[Node]) -> list[AxisStrategy]:
    src = node.args[0]
    if not isinstance(node.meta.get("val"), torch.Tensor):
        return []
    rank = len(_shape(src))
    reduced, keep = _reduced_dims(node, rank)
    key = _key(node)
    out = []
    for d in range(rank):
        if _shape(src)[d] == 1:
            continue
        if d in reduced:
            if key is aten.sum:
                out.append(AxisStrategy((Shard(d),), (P,)))
            elif key is aten.mean:
                out.append(AxisStrategy((Shard(d),), (P,), rewrite="mean_partial"))
            continue
        od = d if keep else d - sum(1 for r in reduced if r < d)
        out.append(AxisStrategy((Shard(d),), (Shard(od),)))
    if key in (aten.sum, aten.mean):
        out.append(AxisStrategy((P,), (P,)))
    return out


@_register(aten.cumsum, aten.cumprod, aten._softmax, aten.softmax, aten._log_softmax, aten.log_softmax)
def _along_dim(node: Node, ins: list[Node]) -> list[AxisStrategy]:
    src = node.args[0]
    rank = len(_shape(src))
    dim = _norm_dim(node.args[1], rank)
    return [AxisStrategy((Shard(d),), (Shard(d),)) for d in range(rank) if d != dim and _shape(src)[d] > 1]


@_register(aten.layer_norm, aten.rms_norm, aten.native_layer_norm, aten.group_norm)
def _layer_norm(node: Node, ins: list[Node]) -> list[AxisStrategy]:
    x = node.args[0]
    rank = len(_shape(x))
    key = _key(node)
    if key is aten.group_norm:
        lead = 1
    else:
        lead = rank - len(node.args[1])
    n_out = len(tensor_outputs(node))
    out = []
    for d in range(lead):
        if _shape(x)[d] > 1:
            outs = (Shard(d), *(Shard(d) for _ in range(n_out - 1)))
            out.append(AxisStrategy(tuple(Shard(d) if i is x else R for i in ins), outs))
    return out


@_register(
    aten.batch_norm,
    aten.native_batch_norm,
    aten._native_batch_norm_legit_functional,
    aten._native_batch_norm_legit_no_training,
    aten.instance_norm,
)
def _batch_norm(node: Node, ins: list[Node]) -> list[AxisStrategy]:
    # Batch statistics span the batch: only the channel dimension (1) can be sharded, taking
    # weight, bias and running stats along with it.
    x = node.args[0]
    if len(_shape(x)) < 2 or _shape(x)[1] == 1:
        return []
    outs = tensor_outputs(node)
    in_p = tuple(Shard(1) if i is x else Shard(0) for i in ins)
    out_p = tuple(Shard(1) if o.dim() == len(_shape(x)) else Shard(0) for o in outs)
    return [AxisStrategy(in_p, out_p)]


# --------------------------------------------------------------------------------------------
# Embedding, attention, convolution, losses


@_register(aten.embedding)
def _embedding(node: Node, ins: list[Node]) -> list[AxisStrategy]:
    w, idx = node.args[0], node.args[1]
    if w is idx:
        return []
    irank = len(_shape(idx))

    def mk(wp: Placement, ip: Placement, op: Placement, rewrite: str = "") -> AxisStrategy:
        return AxisStrategy(tuple(wp if i is w else ip for i in ins), (op,), rewrite=rewrite)

    out = [mk(R, Shard(d), Shard(d)) for d in range(irank) if _shape(idx)[d] > 1]
    out.append(mk(Shard(1), R, Shard(irank)))
    out.append(mk(Shard(0), R, P, rewrite="vocab_parallel_embedding"))
    return out


@_register(
    aten.scaled_dot_product_attention,
    aten._scaled_dot_product_flash_attention_for_cpu,
    aten._scaled_dot_product_efficient_attention,
    aten._scaled_dot_product_flash_attention,
)
def _sdpa(node: Node, ins: list[Node]) -> list[AxisStrategy]:
    q, k, v = node.args[0], node.args[1], node.args[2]
    rank = len(_shape(q))
    outs = tensor_outputs(node)

    def for_dim(d: int, seq_q: bool = False) -> AxisStrategy | None:
        ps = []
        for i in ins:
            sh = _shape(i)
            off = len(sh) - rank
            if seq_q and i in (k, v):
                ps.append(R)
                continue
            dd = d + off
            ps.append(Shard(dd) if 0 <= dd < len(sh) and sh[dd] > 1 else R)
        if any(i in (q, k, v) and isinstance(p, Replicate) and not seq_q for i, p in zip(ins, ps)):
            return None
        o = tuple(Shard(d) if len(x.shape) == rank else (Shard(d) if d < x.dim() else R) for x in outs)
        return AxisStrategy(tuple(ps), o)

    out = []
    for d in range(rank - 2):  # batch and heads
        if _shape(q)[d] > 1:
            s = for_dim(d)
            if s is not None:
                out.append(s)
    # Queries' sequence split with keys/values whole: only without a causal mask (a causal mask
    # built from local query positions would be misaligned).
    if _shape(q)[rank - 2] > 1 and len(outs) == 1 and not _arg(node, "is_causal", False):
        s = for_dim(rank - 2, seq_q=True)
        if s is not None:
            out.append(s)
    return out


@_register(aten.convolution, aten.conv1d, aten.conv2d, aten.conv3d)
def _conv(node: Node, ins: list[Node]) -> list[AxisStrategy]:
    x, w = node.args[0], node.args[1]
    bias = node.args[2] if len(node.args) > 2 and isinstance(node.args[2], Node) else None
    groups = node.args[-1] if _key(node) is aten.convolution else (node.args[6] if len(node.args) > 6 else 1)
    out = []
    if _shape(x)[0] > 1:
        out.append(AxisStrategy(tuple(Shard(0) if i is x else R for i in ins), (Shard(0),)))
    if groups == 1:
        # Output channels: weight (and bias) sharded on dim 0. Input channels: contracted -> Partial.
        out.append(AxisStrategy(tuple(R if i is x else Shard(0) for i in ins), (Shard(1),)))
        if bias is None:
            out.append(AxisStrategy(tuple(Shard(1) if i in (x, w) else R for i in ins), (P,)))
    return out


@_register(aten.cross_entropy_loss, aten.nll_loss, aten.nll_loss_nd, aten.nll_loss_forward)
def _cross_entropy(node: Node, ins: list[Node]) -> list[AxisStrategy]:
    x, t = node.args[0], node.args[1]
    key = _key(node)
    weight = node.args[2] if len(node.args) > 2 else node.kwargs.get("weight")
    reduction = node.args[3] if len(node.args) > 3 else node.kwargs.get("reduction", 1)
    smoothing = node.args[5] if len(node.args) > 5 else node.kwargs.get("label_smoothing", 0.0)
    n_out = len(tensor_outputs(node))
    if weight is not None or reduction not in (1, 2) or n_out != 1 or smoothing:
        return []
    xs = _shape(x)
    if len(xs) != 2 or len(_shape(t)) != 1:
        return []
    out = []
    if xs[0] > 1:
        out.append(AxisStrategy(tuple(Shard(0) for _ in ins), (P,), rewrite="loss_rows"))
    if key is aten.cross_entropy_loss and xs[1] > 1:
        out.append(
            AxisStrategy(
                tuple(Shard(1) if i is x else R for i in ins),
                (R,),
                rewrite="loss_classes",
                comm="all_reduce:3",
            )
        )
    return out


def block_hints(graph: torch.fx.Graph) -> dict[Node, set[tuple[int, int]]]:
    """Which nodes would benefit from ``Shard(dim, blocks=k)``: producers of an equal ``k``-way
    split (a fused QKV or gate/up projection), propagated back through pointwise ops, 1:1 views
    and matmuls to the weights and biases."""
    hints: dict[Node, set[tuple[int, int]]] = {}
    work: list[tuple[Node, int, int]] = []
    for n in graph.nodes:
        if n.op == "call_function" and _key(n) in (aten.split, aten.split_with_sizes, aten.chunk):
            outs = tensor_outputs(n)
            src = n.args[0]
            if not isinstance(src, Node) or len(outs) < 2:
                continue
            rank = len(_shape(src))
            dim = _norm_dim(n.args[2] if len(n.args) > 2 else n.kwargs.get("dim", 0), rank)
            if len({int(o.shape[dim]) for o in outs}) == 1:
                work.append((src, dim, len(outs)))
    while work:
        node, dim, k = work.pop()
        if (dim, k) in hints.setdefault(node, set()):
            continue
        hints[node].add((dim, k))
        if node.op != "call_function":
            continue
        key = _key(node)
        rank = len(_shape(node))
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
                w, bias, wdim = a[1], None, len(_shape(a[1])) - 1
            if dim == rank - 1:
                if isinstance(w, Node):
                    work.append((w, wdim, k))
                if isinstance(bias, Node) and _shape(bias) and _shape(bias)[-1] > 1:
                    work.append((bias, len(_shape(bias)) - 1, k))
        elif key in _UNARY:
            for i in tensor_inputs(node):
                sh = _shape(i)
                d = dim - (rank - len(sh))
                if d >= 0 and sh[d] == _shape(node)[dim]:
                    work.append((i, d, k))
        elif key in (aten.view, aten.reshape, aten._unsafe_view):
            src = node.args[0]
            mapping = _view_map(_shape(src), _shape(node))
            for (d, b), od in mapping.items():
                if b == 0 and od == dim:
                    work.append((src, d, k))
    return hints

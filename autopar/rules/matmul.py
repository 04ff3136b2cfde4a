"""The matmul family (``mm``/``addmm``/``bmm``/``matmul``/``linear``), each an einsum: shard a batch,
row or column letter on every operand that has it, or the contracted letter (output ``Partial``:
Megatron-LM's row-parallel layer, arXiv 1909.08053 §3)."""

from __future__ import annotations

from collections.abc import Sequence

from torch.fx import Node

from autopar.cost.op_kernels import einsum_subscripts
from autopar.placement import Placement, Shard
from autopar.rules.base import AxisStrategy, P, R, aten, op_key, register, shape_of, with_hints


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


@with_hints
def _matmul(node: Node, ins: list[Node], hints: dict) -> list[AxisStrategy]:
    key = op_key(node)
    a = node.args
    if key in (aten.mm, aten.bmm, aten.matmul):
        x, w, bias = a[0], a[1], None
    elif key in (aten.addmm, aten.baddbmm):
        bias, x, w = a[0], a[1], a[2]
    else:  # linear(x, w, bias): out = x @ w.T + bias
        x, w = a[0], a[1]
        bias = a[2] if len(a) > 2 else node.kwargs.get("bias")
    xs, ws = shape_of(x), shape_of(w)
    os_ = shape_of(node)
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
        bs = shape_of(bias)
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
            if isinstance(bp, Shard) and shape_of(bias)[bp.dim] == 1:
                s = AxisStrategy(tuple(R if j == bi else p for j, p in enumerate(s.inputs)), s.outputs)
        fixed.append(s)
    return fixed


register(aten.mm, aten.bmm, aten.matmul, aten.addmm, aten.baddbmm, aten.linear)(_matmul)


@register(aten.einsum)
def _einsum(node: Node, ins: list[Node]) -> list[AxisStrategy]:
    """``einsum``, read off its equation (Mamba-2's scans, bilinear forms): a letter in the output
    splits every operand holding it and the output there (batch and free dimensions); a letter
    summed away splits every operand holding it, the output ``Partial`` (a sharded contraction);
    one operand ``Partial`` with the others whole gives a ``Partial`` result (einsum is linear in
    each). Letters repeated within an operand (a diagonal) are not split."""
    equation, operands = node.args[0], node.args[1]
    if not isinstance(equation, str) or not all(isinstance(o, Node) for o in operands):
        return []
    if len(set(operands)) != len(operands) or list(operands) != list(ins):
        return []
    parsed = einsum_subscripts(equation, [len(shape_of(o)) for o in operands])
    if parsed is None:
        return []
    terms, out = parsed
    out_strats = []
    for letter in dict.fromkeys("".join(terms)):
        if any(t.count(letter) > 1 for t in terms) or out.count(letter) > 1:
            continue
        holders = [k for k, t in enumerate(terms) if letter in t]
        if any(shape_of(operands[k])[terms[k].index(letter)] <= 1 for k in holders):
            continue
        placements = tuple(Shard(terms[k].index(letter)) if k in holders else R for k in range(len(terms)))
        result = Shard(out.index(letter)) if letter in out else P
        out_strats.append(AxisStrategy(placements, (result,)))
    for k in range(len(terms)):
        out_strats.append(AxisStrategy(tuple(P if j == k else R for j in range(len(terms))), (P,)))
    return out_strats

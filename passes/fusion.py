"""Kernel fusion: groups of ATen ops that one fused kernel of ``autopar.program.kernels`` computes,
found by graph structure (ops and data flow, never module or node names), in the captured graph
(where the cost model charges them as one kernel) and in this rank's program (where the group is
replaced by a call of the kernel).

Words:

* **group** — the nodes one fused kernel replaces (:class:`FusionGroup`): its **members**, the
  fused op's **inputs** (values computed outside the group) and **outputs** (members whose values
  the fused op returns; a value read under several names — an identity cast of the residual
  stream — lists each). A member read outside the group other than through an output blocks the
  match: the fused kernel would not compute that value.
* **anchor** — the member that carries the fused kernel's cost in the planner's per-node costs
  (``autopar.cost.fusion``); the other members cost nothing.
* **kinds** (``autopar.ir.FusionKind``) and the spellings matched:

  - ``add_layer_norm`` — ``aten.layer_norm``/``native_layer_norm`` over the last dimension, with
    the ``add`` of two same-shaped activations that feeds it (the residual add: its output, the
    residual stream, is usually read again by the next residual add, and is the fused op's
    second output);
  - ``add_rms_norm`` — transformers' ``LlamaRMSNorm`` (LLaMA, Mistral, Qwen2): optional cast to
    float32, ``pow(·, 2)``, ``mean(-1, keepdim=True)``, ``add eps``, ``rsqrt``, ``mul``, optional
    cast back to the input dtype, optional ``mul`` by a weight; also ``aten.rms_norm``
    (``F.rms_norm``); each with the residual add before it. A cast to float32 of a float32 value
    is the identity, so it may be read outside (it is the residual stream under another name);
  - ``bias_gelu`` — ``aten.gelu`` (either approximation), and GPT-2's ``NewGELUActivation`` written
    out (``0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))``), after an ``add`` of a bias or after a
    ``linear``/``addmm`` with a bias (reached through views that keep the last dimension): that
    bias moves into the fused op and the GEMM runs without it, as Megatron-LM's
    ``bias_gelu_impl`` does;
  - ``swiglu`` — ``silu(gate) · up``;
  - ``rotary`` — transformers' ``q·cos + rotate_half(q)·sin`` with ``rotate_half(x) = cat(−x₂, x₁)``
    from two slices of the last dimension, for q and k reading the same cos and sin (constants:
    no gradient), paired in program order;
  - ``cross_entropy`` — ``aten.cross_entropy_loss`` (no class weights or smoothing),
    ``log_softmax`` + ``nll_loss``, and in this rank's program the lowering's
    ``autopar.program.local_ops.sharded_cross_entropy`` (``sharded_nll_loss`` of a ``log_softmax``),
    whose vocabulary-parallel form then runs ``vocab_parallel_cross_entropy``.

Passes:

* ``annotate_fusions`` (planning, ``autopar.planner.GRAPH_PASSES``) writes each group on its
  members (``node.meta["autopar.fusion"]``) and all of them on the graph (``gm.meta``), when
  fusion is assumed (:func:`fusion_assumed`: a GPU cluster, and neither ``fuse_kernels`` nor
  ``annotate_fusions`` disabled); ``annotate_cost`` and the strategies then charge each group its
  fused kernel (:func:`fused_kernels`) and count what it saves for backward.
* ``fuse_kernels`` (rank program) rewrites this rank's forward program before the whole step is
  traced (``autopar.api._capture_step``, the pipeline's stage programs in
  ``autopar.passes.pipeline.build_stage_step``), so the traced step records one node per fused
  forward op and one per backward op. It runs where the kernels run (``autopar.program.kernels
  .available``: CUDA with Triton, or Triton's interpreter on the CPU) and leaves the program as it
  is elsewhere, saying why.
"""

from __future__ import annotations

import logging
import math
import operator
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.fx import Graph, GraphModule, Node

from autopar.cost.compute import Kernel, KernelKind, OpKernels, TensorArg, itemsize
from autopar.cost.fusion import (
    add_norm_kernels,
    bias_gelu_kernels,
    cross_entropy_kernels,
    rotary_kernels,
    rows_and_width,
    saved_statistics_bytes,
    swiglu_kernels,
)
from autopar.graph import OpFamily, op_family, op_name
from autopar.ir import TENSOR, FusionKind
from autopar.passes import PassContext
from autopar.planfile import FusionPlan
from autopar.program import local_ops as O

__all__ = [
    "FUSION",
    "FUSIONS",
    "FusionGroup",
    "FusionKind",
    "annotate_fusions",
    "apply_fusions",
    "find_fusions",
    "fuse_kernels",
    "fused_kernels",
    "fused_saved_bytes",
    "fusion_assumed",
    "fusion_counts",
    "fusion_plan",
    "fusion_role",
    "saved_by_group",
]

log = logging.getLogger("autopar.passes")

FUSION = "autopar.fusion"
"""``node.meta`` key: the :class:`FusionGroup` the node is a member of."""
FUSIONS = "autopar.fusions"
"""``gm.meta`` key: every group ``annotate_fusions`` found, in program order."""

_REDUCTIONS = {0: "none", 1: "mean", 2: "sum"}
"""``aten`` loss reductions by number, as the kernels name them."""


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


# ------------------------------------------------------------------------------ graph helpers


def _aten(n: Any, *names: str) -> bool:
    return (
        isinstance(n, Node)
        and n.op == "call_function"
        and isinstance(n.target, torch._ops.OpOverload)
        and n.target.namespace == "aten"
        and op_name(n) in names
    )


def _is_assert(n: Node) -> bool:
    return n.op == "call_function" and op_family(n) is OpFamily.ASSERT


def _readers(n: Node) -> list[Node]:
    """``n``'s users other than export's metadata assertions (they compute nothing)."""
    return [u for u in n.users if not _is_assert(u)]


def _val(n: Any) -> torch.Tensor | None:
    v = n.meta.get("val") if isinstance(n, Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _shape(n: Any) -> tuple[int, ...] | None:
    v = _val(n)
    return tuple(int(s) for s in v.shape) if v is not None else None


def _arg(n: Node, i: int, name: str, default: Any = None) -> Any:
    if len(n.args) > i:
        return n.args[i]
    return n.kwargs.get(name, default)


def _scalar(a: Any) -> float | None:
    return float(a) if isinstance(a, (int, float)) and not isinstance(a, bool) else None


def _close(a: float | None, b: float) -> bool:
    return a is not None and math.isclose(a, b, rel_tol=1e-4)


def _needs_grad(n: Node) -> bool:
    """A gradient flows into ``n``'s value: the planning annotation where there is one, else the
    fake value's ``requires_grad`` (a rank's program with propagated values)."""
    info = n.meta.get(TENSOR)
    if info is not None:
        return bool(info.requires_grad)
    v = _val(n)
    return v is not None and bool(v.requires_grad)


def _same(a: Node, b: Node) -> bool:
    """``a`` and ``b`` hold tensors of one shape and dtype."""
    va, vb = _val(a), _val(b)
    return va is not None and vb is not None and va.shape == vb.shape and va.dtype == vb.dtype


def _last_dim(n: Node, dim: Any) -> bool:
    v = _val(n)
    return v is not None and isinstance(dim, int) and dim % max(v.dim(), 1) == v.dim() - 1


def _is_cast(n: Any) -> bool:
    """A dtype conversion that keeps shape and device (``to``/``_to_copy``)."""
    if not _aten(n, "to", "_to_copy") or not isinstance(n.args[0], Node):
        return False
    a, b = _val(n.args[0]), _val(n)
    return a is not None and b is not None and a.shape == b.shape and a.device == b.device


# ------------------------------------------------------------------------------ matches


@dataclass
class _Match:
    kind: FusionKind
    members: list[Node]
    inputs: list[Node | None]
    outputs: list[list[Node]]
    anchor: Node
    attrs: dict[str, Any] = field(default_factory=dict)


def _residual_add(x: Any) -> tuple[Node, Node] | None:
    """``(a, b)`` when ``x = a + b`` adds two activations of ``x``'s shape and dtype."""
    if not (_aten(x, "add") and x.target is torch.ops.aten.add.Tensor):
        return None
    if len(x.args) < 2 or not all(isinstance(a, Node) for a in x.args[:2]):
        return None
    if _scalar(_arg(x, 2, "alpha", 1)) != 1.0:
        return None
    a, b = x.args[0], x.args[1]
    return (a, b) if _same(a, x) and _same(b, x) else None


def _with_residual(match: _Match, x: Node, sum_aliases: list[Node], rest: list[Node | None]) -> _Match:
    """Complete a norm's match: with the residual add producing ``x`` when there is one."""
    pair = _residual_add(x)
    if pair is not None:
        match.members.insert(0, x)
        match.inputs = [pair[0], pair[1], *rest]
        match.outputs.append([x, *sum_aliases])
    else:
        match.inputs = [x, None, *rest]
        match.outputs.append(list(sum_aliases))
    return match


def _match_layer_norm(n: Node) -> _Match | None:
    if not _aten(n, "layer_norm", "native_layer_norm"):
        return None
    x, normalized = n.args[0], _arg(n, 1, "normalized_shape")
    xv = _val(x)
    if xv is None or xv.dim() == 0 or list(normalized or ()) != [xv.shape[-1]]:
        return None
    weight, bias = _arg(n, 2, "weight"), _arg(n, 3, "bias")
    eps = _scalar(_arg(n, 4, "eps", 1e-5))
    if eps is None:
        return None
    for p in (weight, bias):
        if p is not None and _shape(p) != (xv.shape[-1],):
            return None
    members, out = [n], n
    if op_name(n) == "native_layer_norm":  # (out, mean, rstd): only the output may be read
        gets = _readers(n)
        if any(g.target is not operator.getitem for g in gets):
            return None
        firsts = [g for g in gets if g.args[1] == 0]
        if len(firsts) != 1:
            return None
        out = firsts[0]
        members += gets
    m = _Match(FusionKind.ADD_LAYER_NORM, members, [], [[out]], n, {"eps": eps})
    return _with_residual(m, x, [], [weight, bias])


def _match_rms_norm_op(n: Node) -> _Match | None:
    """``aten.rms_norm`` over the last dimension."""
    if not _aten(n, "rms_norm"):
        return None
    x, normalized = n.args[0], _arg(n, 1, "normalized_shape")
    xv = _val(x)
    if xv is None or xv.dim() == 0 or list(normalized or ()) != [xv.shape[-1]]:
        return None
    weight = _arg(n, 2, "weight")
    if weight is not None and _shape(weight) != (xv.shape[-1],):
        return None
    eps = _scalar(_arg(n, 3, "eps"))
    if eps is None:
        eps = float(torch.finfo(xv.dtype).eps)  # F.rms_norm's default
    m = _Match(FusionKind.ADD_RMS_NORM, [n], [], [[n]], n, {"eps": eps})
    return _with_residual(m, x, [], [weight])


def _match_rms_norm(r: Node) -> _Match | None:
    """LlamaRMSNorm written out, found from its ``rsqrt`` (module docstring)."""
    if not _aten(r, "rsqrt"):
        return None
    a = r.args[0]
    if not _aten(a, "add") or len(a.args) < 2:
        return None
    mean, eps = a.args[0], _scalar(a.args[1])
    if eps is None or not _aten(mean, "mean") or _arg(mean, 2, "keepdim", False) is not True:
        return None
    dims = _arg(mean, 1, "dim")
    sq = mean.args[0]
    squared = (_aten(sq, "pow") and _scalar(sq.args[1]) == 2.0) or (
        _aten(sq, "mul") and len(sq.args) == 2 and sq.args[0] is sq.args[1]
    )
    if not squared:
        return None
    xf = sq.args[0]
    xv = _val(xf)
    if (
        xv is None
        or xv.dtype != torch.float32
        or not isinstance(dims, (list, tuple))
        or len(dims) != 1
        or not _last_dim(xf, dims[0])
    ):
        return None
    norms = [u for u in _readers(r) if _aten(u, "mul") and set(u.args[:2]) == {xf, r}]
    if len(norms) != 1:
        return None
    members = [sq, mean, a, r, norms[0]]
    cur = norms[0]
    x, cast_in, identity = xf, None, False
    if _is_cast(xf):
        x, cast_in = xf.args[0], xf
        identity = _val(x).dtype == torch.float32
        members.insert(0, xf)
    dtype = _val(x).dtype
    nxt = _readers(cur)
    if len(nxt) == 1 and _is_cast(nxt[0]):
        cur = nxt[0]
        members.append(cur)
        nxt = _readers(cur)
    weight = None
    if len(nxt) == 1 and _aten(nxt[0], "mul") and len(nxt[0].args) == 2:
        other = nxt[0].args[1] if nxt[0].args[0] is cur else nxt[0].args[0]
        if isinstance(other, Node) and other is not cur and _shape(other) == (xv.shape[-1],):
            weight, cur = other, nxt[0]
            members.append(cur)
    out = _val(cur)
    expect = torch.result_type(_val(x), _val(weight)) if weight is not None else dtype
    if out is None or out.dtype != expect or out.shape != xv.shape:
        return None
    m = _Match(FusionKind.ADD_RMS_NORM, members, [], [[cur]], cur, {"eps": eps})
    return _with_residual(m, x, [cast_in] if identity else [], [weight])


def _bias_of(v: Node, readers: set[Node]) -> tuple[Node, Node | None, list[Node], Node | None]:
    """``(x, bias, members, split)`` for a GeLU reading ``v`` (only ``readers`` read it):
    ``v = x + bias`` (``v`` joins the group), or ``v`` computed by a ``linear``/``addmm`` with a
    bias through views keeping the last dimension, each read once (``split``: that GEMM, whose
    bias moves into the fused op), or no bias (``bias`` None)."""
    shape = _shape(v)
    if shape is None or not shape or set(_readers(v)) - readers:
        return v, None, [], None
    width = shape[-1]
    if _aten(v, "add") and v.target is torch.ops.aten.add.Tensor and len(v.args) >= 2:
        a, b = v.args[0], v.args[1]
        if _scalar(_arg(v, 2, "alpha", 1)) == 1.0 and isinstance(a, Node) and isinstance(b, Node):
            for act, bias in ((a, b), (b, a)):
                if _shape(bias) == (width,) and _same(act, v):
                    return act, bias, [v], None
    cur = v
    while _aten(cur, "view", "reshape", "_unsafe_view") and isinstance(cur.args[0], Node):
        src = cur.args[0]
        if _readers(src) != [cur] or (_shape(src) or (None,))[-1] != width:
            return v, None, [], None
        cur = src
    if _aten(cur, "linear") and isinstance(_arg(cur, 2, "bias"), Node) and _shape(cur.args[2]) == (width,):
        return v, cur.args[2], [], cur
    if (
        _aten(cur, "addmm")
        and isinstance(cur.args[0], Node)
        and _shape(cur.args[0]) == (width,)
        and _scalar(cur.kwargs.get("beta", 1)) == 1.0
        and _scalar(cur.kwargs.get("alpha", 1)) == 1.0
    ):
        return v, cur.args[0], [], cur
    return v, None, [], None


def _gelu_match(out: Node, v: Node, members: list[Node], approximate: str) -> _Match:
    x, bias, extra, split = _bias_of(v, set(members))
    attrs = {"approximate": approximate, "split_bias": split.name if split is not None else ""}
    return _Match(FusionKind.BIAS_GELU, extra + members, [x, bias], [[out]], out, attrs)


def _match_gelu(n: Node) -> _Match | None:
    if not _aten(n, "gelu") or not isinstance(n.args[0], Node):
        return None
    approximate = _arg(n, 1, "approximate", "none")
    if approximate not in ("none", "tanh"):
        return None
    return _gelu_match(n, n.args[0], [n], approximate)


def _mul_tree(n: Any, stop: set[Node] = frozenset()) -> tuple[float, list[Node], list[Node]] | None:
    """``n`` as a product: ``(constant, tensor factors, mul nodes)``, flattening muls that only
    ``n``'s tree reads."""
    if not _aten(n, "mul"):
        return None
    const, factors, nodes = 1.0, [], [n]
    for a in n.args[:2]:
        c = _scalar(a)
        if c is not None:
            const *= c
        elif isinstance(a, Node) and a not in stop and _aten(a, "mul") and _readers(a) == [n]:
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
        not (_aten(n, "add") and n.target is torch.ops.aten.add.Tensor)
        or _scalar(_arg(n, 2, "alpha", 1)) != 1.0
    ):
        return None
    terms, nodes = [], [n]
    for a in n.args[:2]:
        if not isinstance(a, Node):
            return None
        if _aten(a, "add") and _readers(a) == [n]:
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
    if tree is None or not _close(tree[0], 0.044715):
        return None
    _, factors, nodes = tree
    if (
        len(factors) == 1
        and _aten(factors[0], "pow")
        and factors[0].args[0] is v
        and _scalar(factors[0].args[1]) == 3.0
    ):
        return [*nodes, factors[0]]
    if len(factors) == 3 and all(f is v for f in factors):
        return nodes
    if len(factors) == 2:
        p = next((f for f in factors if f is not v), None)
        if (
            p is not None
            and _aten(p, "pow")
            and p.args[0] is v
            and _scalar(p.args[1]) == 2.0
            and v in factors
        ):
            return [*nodes, p]
    return None


_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def _match_tanh_gelu(t: Node) -> _Match | None:
    """GPT-2's ``NewGELUActivation`` written out, found from its ``tanh`` (module docstring):
    ``tanh(c·inner)`` with ``c = √(2/π)``, ``inner = v + 0.044715·v³``, and the product
    ``0.5 · v · (1 + tanh(…))``."""
    if not _aten(t, "tanh") or not isinstance(t.args[0], Node) or _readers(t.args[0]) != [t]:
        return None
    scaled = _mul_tree(t.args[0])
    if scaled is None or not _close(scaled[0], _SQRT_2_OVER_PI) or len(scaled[1]) != 1:
        return None
    inner = scaled[1][0]
    if len(_readers(inner)) != 1:
        return None
    summed = _add_terms(inner)
    if summed is None or len(summed[0]) != 2:
        return None
    v = cubic = None
    for a, b in (summed[0], summed[0][::-1]):
        members = _cubic_of(b, a) if len(_readers(b)) == 1 else None
        if members is not None:
            v, cubic = a, members
            break
    if v is None:
        return None
    ones = _readers(t)
    if len(ones) != 1 or not _aten(ones[0], "add") or _scalar(_arg(ones[0], 2, "alpha", 1)) != 1.0:
        return None
    one_plus = ones[0]
    if [_scalar(a) for a in one_plus.args[:2] if not isinstance(a, Node)] != [1.0]:
        return None
    chain, cur = [], one_plus
    while len(_readers(cur)) == 1 and _aten(_readers(cur)[0], "mul"):
        cur = _readers(cur)[0]
        chain.append(cur)
    for top in reversed(chain):  # the largest product of 0.5, v and (1 + tanh) alone
        tree = _mul_tree(top, stop={one_plus})
        if (
            tree is not None
            and _close(tree[0], 0.5)
            and sorted(map(id, tree[1])) == sorted(map(id, [v, one_plus]))
        ):
            members = [*scaled[2], *summed[1], *cubic, t, one_plus, *tree[2]]
            return _gelu_match(top, v, list(dict.fromkeys(members)), "tanh")
    return None


def _match_swiglu(s: Node) -> _Match | None:
    if not _aten(s, "silu") or not isinstance(s.args[0], Node):
        return None
    rs = _readers(s)
    if len(rs) != 1 or not _aten(rs[0], "mul") or len(rs[0].args) != 2:
        return None
    m = rs[0]
    up = m.args[1] if m.args[0] is s else m.args[0]
    if not isinstance(up, Node) or up is s or not (_same(up, m) and _same(s, m) and _same(s.args[0], s)):
        return None
    return _Match(FusionKind.SWIGLU, [s, m], [s.args[0], up], [[m]], m)


def _rotate_half(c: Any) -> tuple[Node, list[Node]] | None:
    """``(x, members)`` when ``c = cat([−x[..., d/2:], x[..., :d/2]], -1)``."""
    if not _aten(c, "cat") or not _last_dim(c, _arg(c, 1, "dim", 0)):
        return None
    parts = c.args[0]
    if not isinstance(parts, (list, tuple)) or len(parts) != 2:
        return None
    neg, first = parts
    if not _aten(neg, "neg") or not isinstance(neg.args[0], Node):
        return None
    second = neg.args[0]
    if not (_aten(first, "slice") and _aten(second, "slice")) or first.args[0] is not second.args[0]:
        return None
    x = first.args[0]
    xs = _shape(x)
    if xs is None or len(xs) != 4 or xs[-1] % 2:
        return None
    half = xs[-1] // 2
    for sl, lo, hi in ((first, 0, half), (second, half, xs[-1])):
        dim, start, end, step = (
            _arg(sl, 1, "dim", 0),
            _arg(sl, 2, "start"),
            _arg(sl, 3, "end"),
            _arg(sl, 4, "step", 1),
        )
        if not _last_dim(x, dim) or (start or 0) != lo or end is None or min(end, xs[-1]) != hi or step != 1:
            return None
    return x, [first, second, neg, c]


def _rotary_half(a: Node) -> tuple[Node, Node, Node, list[Node]] | None:
    """``(x, cos, sin, members)`` when ``a = x·cos + rotate_half(x)·sin``."""
    if not (_aten(a, "add") and a.target is torch.ops.aten.add.Tensor) or len(a.args) < 2:
        return None
    if _scalar(_arg(a, 2, "alpha", 1)) != 1.0:
        return None
    for p, q in (a.args[:2], a.args[1::-1]):
        if not (_aten(p, "mul") and _aten(q, "mul")) or _readers(p) != [a] or _readers(q) != [a]:
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


def _table_ok(t: Node, x: Node) -> bool:
    """cos/sin broadcastable to ``[b, 1, s, d]`` against ``x`` ``[b, h, s, d]``, no gradient."""
    ts, xs = _shape(t), _shape(x)
    if ts is None or xs is None or _needs_grad(t):
        return False
    if len(ts) == 2:
        return ts == xs[2:]
    return len(ts) == 4 and ts[1] == 1 and ts[2:] == xs[2:] and ts[0] in (1, xs[0])


def _match_cross_entropy(n: Node) -> _Match | None:
    if _aten(n, "cross_entropy_loss"):
        logits, target = n.args[0], n.args[1]
        if _arg(n, 2, "weight") is not None or _scalar(_arg(n, 5, "label_smoothing", 0.0)) != 0.0:
            return None
        attrs = {"reduction": _arg(n, 3, "reduction", 1), "ignore_index": _arg(n, 4, "ignore_index", -100)}
        members = [n]
    elif _aten(n, "nll_loss", "nll_loss_nd", "nll_loss2d") or n.target is O.sharded_nll_loss:
        lsm, target = n.args[0], n.args[1]
        if (
            not _aten(lsm, "log_softmax", "_log_softmax")
            or _readers(lsm) != [n]
            or not _last_dim(lsm, lsm.args[1])
        ):
            return None
        if _aten(lsm, "log_softmax") and _arg(lsm, 2, "dtype") is not None:
            return None
        if _aten(lsm, "_log_softmax") and lsm.args[2]:
            return None
        logits = lsm.args[0]
        if n.target is O.sharded_nll_loss:
            attrs = {"lowered": True}
        else:
            if _arg(n, 2, "weight") is not None:
                return None
            attrs = {
                "reduction": _arg(n, 3, "reduction", 1),
                "ignore_index": _arg(n, 4, "ignore_index", -100),
            }
        members = [lsm, n]
    elif n.target is O.sharded_cross_entropy and not n.kwargs.get("fused", False):
        logits, target = n.args[0], n.args[1]
        attrs = {"lowered": True}
        members = [n]
    else:
        return None
    lv, tv = _val(logits), _val(target)
    if lv is None or tv is None or lv.dim() != 2 or tv.dim() != 1 or tv.is_floating_point():
        return None
    if "lowered" in attrs:
        attrs["ignore_index"] = n.kwargs.get("ignore_index", -100)
        attrs["reduction"] = n.kwargs.get("reduction", 1)
    return _Match(FusionKind.CROSS_ENTROPY, members, [logits, target], [[n]], members[0], attrs)


_MATCHERS: dict[str, Callable[[Node], _Match | None]] = {
    "layer_norm": _match_layer_norm,
    "native_layer_norm": _match_layer_norm,
    "rms_norm": _match_rms_norm_op,
    "rsqrt": _match_rms_norm,
    "gelu": _match_gelu,
    "tanh": _match_tanh_gelu,
    "silu": _match_swiglu,
    "cross_entropy_loss": _match_cross_entropy,
    "nll_loss": _match_cross_entropy,
    "nll_loss_nd": _match_cross_entropy,
    "nll_loss2d": _match_cross_entropy,
    "sharded_cross_entropy": _match_cross_entropy,
    "sharded_nll_loss": _match_cross_entropy,
}
"""Op name -> the matcher that starts from such a node (rotary starts from ``add``)."""


def _closed(m: _Match) -> bool:
    """No member is read outside the group except through an output (module docstring)."""
    inside = set(m.members)
    exposed = {o for out in m.outputs for o in out}
    for mem in m.members:
        if mem in exposed:
            continue
        if any(r not in inside for r in _readers(mem)):
            return False
    return True


def _group(m: _Match) -> FusionGroup:
    inside = set(m.members)
    order = {n: i for i, n in enumerate(m.anchor.graph.nodes)}
    members = sorted(m.members, key=order.__getitem__)
    extern = tuple(
        sum(
            1
            for o in out
            for r in _readers(o)
            if r not in inside and (r.op == "output" or (r.op == "call_function" and _needs_grad(r)))
        )
        for out in m.outputs
    )
    first = _val(m.outputs[0][0]) if m.outputs[0] else None
    return FusionGroup(
        kind=m.kind,
        members=tuple(n.name for n in members),
        inputs=tuple(i.name if i is not None else None for i in m.inputs),
        input_shapes=tuple(_shape(i) if i is not None else None for i in m.inputs),
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
    found: list[tuple[int, _Match]] = []
    halves: dict[tuple[Node, Node], list[tuple[Node, Node, list[Node]]]] = {}
    order = {n: i for i, n in enumerate(graph.nodes)}

    def take(m: _Match | None) -> None:
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
        elif _aten(n, "add"):
            half = _rotary_half(n)
            if half is not None:
                x, cos, sin, members = half
                halves.setdefault((cos, sin), []).append((x, n, members))
    for (cos, sin), hs in halves.items():
        for (q, q_out, qm), (k, k_out, km) in zip(hs[0::2], hs[1::2]):
            if q is k or not (_table_ok(cos, q) and _table_ok(sin, q) and _table_ok(cos, k)):
                continue
            qs, ks = _shape(q), _shape(k)
            if qs[0] != ks[0] or qs[2:] != ks[2:] or _shape(q_out) != qs or _shape(k_out) != ks:
                continue
            kinds = [(_val(x).dtype, _val(y).dtype, _val(cos).dtype) for x, y in ((q, q_out), (k, k_out))]
            if any(out != torch.promote_types(x, c) for x, out, c in kinds):
                continue
            take(_Match(FusionKind.ROTARY, qm + km, [q, k, cos, sin], [[q_out], [k_out]], q_out))
    found.sort(key=lambda im: im[0])
    return [_group(m) for _, m in found]


def fusion_plan(groups: Sequence[FusionGroup]) -> list[FusionPlan]:
    """The plan's record of the groups (``Plan.fusions``)."""
    return [FusionPlan(kind=str(g.kind), members=g.members, anchor=g.anchor) for g in groups]


def fusion_counts(groups: Sequence[FusionGroup]) -> dict[str, int]:
    """Groups per kind, in ``FusionKind`` order."""
    c = Counter(str(g.kind) for g in groups)
    return {str(k): c[str(k)] for k in FusionKind if c[str(k)]}


# ------------------------------------------------------------------------------ planning


def fusion_assumed(ctx: PassContext) -> bool:
    """Whether the cost model charges fused kernels: the cluster runs on GPUs (its backend is
    NCCL: ``Cluster.preset``, not ``Cluster.local``) and neither ``fuse_kernels`` nor
    ``annotate_fusions`` is disabled. The single-device eager reference (``autopar.reference``)
    never runs ``annotate_fusions``, so it stays eager."""
    disabled = {"fuse_kernels", "annotate_fusions"} & set(ctx.config.disable)
    return ctx.cluster.backend == "nccl" and not disabled


def annotate_fusions(gm: GraphModule, ctx: PassContext) -> GraphModule:
    """Write every group found on its members (``node.meta[FUSION]``) and on the graph
    (``gm.meta[FUSIONS]``) when fusion is assumed (:func:`fusion_assumed`); clear them otherwise."""
    for n in gm.graph.nodes:
        n.meta.pop(FUSION, None)
    if not fusion_assumed(ctx):
        gm.meta[FUSIONS] = ()
        why = "the cluster is not a GPU cluster" if ctx.cluster.backend != "nccl" else "fusion is disabled"
        log.info("pass annotate_fusions: no fused kernels assumed (%s)", why)
        return gm
    groups = find_fusions(gm.graph)
    by_name = {n.name: n for n in gm.graph.nodes}
    for g in groups:
        for m in g.members:
            by_name[m].meta[FUSION] = g
    gm.meta[FUSIONS] = tuple(groups)
    log.info("pass annotate_fusions: fused kernels assumed: %s", fusion_counts(groups) or "none found")
    return gm


def saved_by_group(group: FusionGroup) -> frozenset[str]:
    """Names of the values the fused op keeps for backward (``autopar.cost.fusion``): a norm's
    input (the sum, or ``x`` without a residual), GeLU's input, SwiGLU's inputs, rotary's cos and
    sin, cross-entropy's logits and targets."""
    k = group.kind
    if k in (FusionKind.ADD_LAYER_NORM, FusionKind.ADD_RMS_NORM):
        if group.inputs[1] is not None:
            return frozenset(group.outputs[1][:1])
        return frozenset(i for i in group.inputs[:1] if i is not None)
    if k is FusionKind.BIAS_GELU:
        return frozenset(group.inputs[:1])
    if k is FusionKind.ROTARY:
        return frozenset(i for i in group.inputs[2:] if i is not None)
    return frozenset(i for i in group.inputs if i is not None)


def fusion_role(node: Node) -> tuple:
    """What costing ``node`` depends on as a member of its group: the group's kind, which of its
    inputs are present, how many readers each output has, and whether ``node`` is the anchor.
    Repeated layers' nodes share a strategy list only with nodes of the same role (the first
    layer's first norm has no residual add; the others do)."""
    g: FusionGroup = node.meta[FUSION]
    return (
        str(g.kind),
        tuple(i is None for i in g.inputs),
        g.extern_grads,
        g.split_bias != "",
        node.name == g.anchor,
    )


def fused_saved_bytes(node: Node) -> float:
    """Statistics the fused op of ``node``'s group keeps for backward (global shapes), charged at
    its anchor (``autopar.cost.fusion.saved_statistics_bytes``); nothing at other members."""
    g = node.meta.get(FUSION)
    if g is None or node.name != g.anchor:
        return 0.0
    shape = g.input_shapes[0] if g.kind is FusionKind.CROSS_ENTROPY else _shape(node)
    rows, _ = rows_and_width(tuple(shape or ()))
    return saved_statistics_bytes(g.kind, rows)


def fused_kernels(node: Node, args: Sequence[TensorArg], outs: Sequence[TensorArg]) -> OpKernels:
    """The kernels ``node`` runs as a member of its group (``node.meta[FUSION]``): the whole fused
    kernel at the anchor (``autopar.cost.fusion``, with the shapes of ``args``/``outs`` — the
    anchor's tensor arguments and results, local shapes for a sharded strategy), nothing at the
    other members; plus, at the anchor, one gradient addition for each reader of an output
    beyond the first (autograd adds them up, as ``op_kernels`` charges an eager op)."""
    g: FusionGroup = node.meta[FUSION]
    if node.name != g.anchor:
        return OpKernels()
    grad = _needs_grad(node)
    out = outs[0] if outs else TensorArg((), g.dtype)
    s = itemsize(out.dtype)
    k = g.kind
    if k in (FusionKind.ADD_LAYER_NORM, FusionKind.ADD_RMS_NORM):
        rows, width = rows_and_width(out.shape)
        ks = add_norm_kernels(
            rows, width, s, s,
            residual=g.inputs[1] is not None, weight=g.inputs[2] is not None,
            bias=k is FusionKind.ADD_LAYER_NORM and g.inputs[3] is not None,
            statistics=2 if k is FusionKind.ADD_LAYER_NORM else 1,
            sum_grad=len(g.extern_grads) > 1 and g.extern_grads[1] > 0,
            grad=grad, param_grad=any(a.grad and len(a.shape) == 1 for a in args),
        )  # fmt: skip
    elif k is FusionKind.BIAS_GELU:
        _, width = rows_and_width(out.shape)
        ks = bias_gelu_kernels(
            out.numel, width, s, s, bias=g.inputs[1] is not None, bias_grad=not g.split_bias, grad=grad
        )
    elif k is FusionKind.SWIGLU:
        ks = swiglu_kernels(out.numel, s, grad=grad)
    elif k is FusionKind.ROTARY:
        q, kk, table = (math.prod(sh or ()) for sh in g.input_shapes[:3])
        scale = out.numel / max(q, 1)
        ks = rotary_kernels(out.numel, round(kk * scale), table, s, grad=grad)
    else:  # cross-entropy: the anchor's first argument is the logits
        logits = args[0] if args else TensorArg(g.input_shapes[0] or (), g.dtype)
        rows, classes = rows_and_width(logits.shape)
        full = (g.input_shapes[0] or (0, 0))[-1]
        ks = cross_entropy_kernels(
            rows,
            classes,
            itemsize(logits.dtype),
            grad=grad,
            vocab_parallel=classes < full,
            reduced=g.reduction != 0,
        )
    adds = [max(0, c - 1) for c in g.extern_grads]
    extra = tuple(Kernel(KernelKind.MEMORY, 3.0 * out.nbytes) for c in adds for _ in range(c)) if grad else ()
    return OpKernels(ks.fwd, ks.bwd + extra)


# ------------------------------------------------------------------------------ rank program


def _kernels() -> Any:
    import autopar.program.kernels as K

    return K


def _device_of(gm: GraphModule) -> torch.device | None:
    for n in gm.graph.nodes:
        v = _val(n)
        if n.op == "placeholder" and v is not None and v.is_floating_point():
            return v.device
    return None


def kernels_run(device: torch.device, config: Any) -> bool:
    """Whether ``fuse_kernels`` fuses a program running on ``device``: the kernels run there
    (``autopar.program.kernels.available``), natively (CUDA), or under Triton's interpreter on the
    CPU when ``config.interpret_kernels`` asks for it."""
    try:
        K = _kernels()
    except ImportError:
        return False
    if device.type == "cpu" and not config.interpret_kernels:
        return False
    return K.available(device)


def _why_not(gm: GraphModule, config: Any) -> str:
    """Why the fused kernels cannot run for ``gm`` ("" when they can)."""
    try:
        K = _kernels()
    except ImportError as e:
        return f"autopar.program.kernels is not importable ({e})"
    device = _device_of(gm)
    if device is not None and device.type == "cpu" and not config.interpret_kernels:
        return (
            "on the CPU the eager ops stay (the kernels would run under Triton's interpreter: "
            "interpret_kernels=True asks for that)"
        )
    unavailable = (
        "the kernels do not run {} (they need a CUDA device with Triton, or Triton's interpreter: "
        "TRITON_INTERPRET=1 before triton is imported); the eager ops stay"
    )
    if device is None:
        if not (K.available("cpu") or (torch.cuda.is_available() and K.available("cuda"))):
            return unavailable.format("on this machine")
        return "the program's values are not known (no meta['val']: propagate them first)"
    if not K.available(device):
        return unavailable.format(f"on {device.type} here")
    return ""


def _call(K: Any, g: FusionGroup, ins: list[Node | None], old: Node) -> tuple[Callable, tuple, dict, int]:
    """``(function, args, kwargs, outputs)`` of the fused call replacing group ``g``."""
    k = g.kind
    if k is FusionKind.ADD_LAYER_NORM:
        return K.add_layer_norm, (*ins, g.eps), {}, 2
    if k is FusionKind.ADD_RMS_NORM:
        return K.add_rms_norm, (*ins, g.eps), {}, 2
    if k is FusionKind.BIAS_GELU:
        return K.bias_gelu, (*ins, g.approximate), {}, 1
    if k is FusionKind.SWIGLU:
        return K.swiglu, tuple(ins), {}, 1
    if k is FusionKind.ROTARY:
        return K.rotary, tuple(ins), {}, 2
    if g.lowered:  # the lowering's call, with the fused kernels inside
        kw = {key: v for key, v in old.kwargs.items()}
        kw["fused"] = True
        return O.sharded_cross_entropy, tuple(ins), kw, 1
    return K.cross_entropy, (*ins, g.ignore_index, _REDUCTIONS[g.reduction]), {}, 1


_COPIED_META = ("autopar.source", "autopar.stage", "custom", "nn_module_stack", "stack_trace")


def _rewrite(
    gm: GraphModule, g: FusionGroup, by_name: dict[str, Node], repl: dict[Node, Node], K: Any
) -> bool:
    """Replace group ``g`` by its fused call; False (nothing changed) when the call cannot be
    placed after its inputs and before the first reader of its outputs."""
    graph = gm.graph

    def now(n: Node) -> Node:
        while n in repl:
            n = repl[n]
        return n

    members = [by_name[m] for m in g.members]
    inside = set(members)
    ins = [now(by_name[i]) if i is not None else None for i in g.inputs]
    outs = [[by_name[o] for o in out] for out in g.outputs]
    order = {n: i for i, n in enumerate(graph.nodes)}
    readers = [r for out in outs for o in out for r in o.users if r not in inside]
    point = min(readers, key=order.__getitem__) if readers else members[-1].next
    if any(i is not None and order[i] >= order[point] for i in ins):
        return False
    anchor = by_name[g.anchor]
    fn, args, kwargs, n_out = _call(K, g, ins, by_name[g.outputs[0][0]])
    if g.split_bias:  # the GEMM runs without its bias, which the fused op adds
        mm = by_name[g.split_bias]
        if op_name(mm) == "linear":
            mm.args = mm.args[:2]
            mm.kwargs = {}
        else:
            mm.target = torch.ops.aten.mm.default
            mm.args = (mm.args[1], mm.args[2])
            mm.kwargs = {}
    with graph.inserting_before(point):
        fused = graph.call_function(fn, args, kwargs)
        gets = (
            [graph.call_function(operator.getitem, (fused, i)) for i in range(n_out)]
            if n_out > 1
            else [fused]
        )
    for node in (fused, *gets):
        node.meta.update({k: anchor.meta[k] for k in _COPIED_META if k in anchor.meta})
        node.meta[FUSION] = g
    vals = [_val(out[0]) if out else _val(ins[0]) for out in outs]
    if n_out > 1:
        for gn, v in zip(gets, vals):
            if v is not None:
                gn.meta["val"] = v
        fused.meta["val"] = tuple(vals)
    elif vals[0] is not None:
        fused.meta["val"] = vals[0]
    for out, gn in zip(outs, gets):
        for o in out:
            for r in list(o.users):
                if r not in inside:
                    r.replace_input_with(o, gn)
            repl[o] = gn
    for gn in gets:
        if gn is not fused and not gn.users:
            graph.erase_node(gn)
    for m in sorted(members, key=order.__getitem__, reverse=True):
        for u in list(m.users):
            if _is_assert(u):
                graph.erase_node(u)
        graph.erase_node(m)
    return True


def apply_fusions(gm: GraphModule, groups: Sequence[FusionGroup]) -> list[FusionGroup]:
    """Replace each group of ``gm`` by a call of its fused kernel (``autopar.program.kernels``);
    returns the groups replaced (a group whose call cannot be placed is left as it is)."""
    K = _kernels()
    by_name = {n.name: n for n in gm.graph.nodes}
    repl: dict[Node, Node] = {}
    done = [g for g in groups if _rewrite(gm, g, by_name, repl, K)]
    gm.graph.lint()
    gm.recompile()
    return done


def fuse_kernels(gm: GraphModule, ctx: PassContext) -> GraphModule:
    """Rank-program pass: replace every fusible group of this rank's forward program by its fused
    kernel (module docstring), where the kernels run; log the groups fused per kind, or why the
    program stays as it is. The program's values must be known (``meta["val"]``:
    ``autopar.passes.pipeline.propagate_fake``)."""
    why = _why_not(gm, ctx.config)
    if why:
        log.info("pass fuse_kernels: program unchanged: %s", why)
        return gm
    groups = find_fusions(gm.graph)
    done = apply_fusions(gm, groups)
    log.info("pass fuse_kernels: fused %s", fusion_counts(done) or "nothing (no fusible group found)")
    if len(done) < len(groups):
        log.info(
            "pass fuse_kernels: %d group(s) left unfused (their call could not be placed)",
            len(groups) - len(done),
        )
    return gm

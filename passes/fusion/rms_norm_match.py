"""The ``add_rms_norm`` matchers (kernel: ``autopar.program.kernels.rms_norm``): ``aten.rms_norm``, and
transformers' ``LlamaRMSNorm`` written out (found from its ``rsqrt``), each with the residual add
before it."""

from __future__ import annotations

import torch
from torch.fx import Node

from autopar.ir import FusionKind
from autopar.passes.fusion.matching import (
    Match,
    arg_of,
    is_aten,
    is_cast,
    on_last_dim,
    readers_of,
    scalar_of,
    shape_of,
    value_of,
    with_residual,
)


def match_rms_norm_op(n: Node) -> Match | None:
    """``aten.rms_norm`` over the last dimension."""
    if not is_aten(n, "rms_norm"):
        return None
    x, normalized = n.args[0], arg_of(n, 1, "normalized_shape")
    xv = value_of(x)
    if xv is None or xv.dim() == 0 or list(normalized or ()) != [xv.shape[-1]]:
        return None
    weight = arg_of(n, 2, "weight")
    if weight is not None and shape_of(weight) != (xv.shape[-1],):
        return None
    eps = scalar_of(arg_of(n, 3, "eps"))
    if eps is None:
        eps = float(torch.finfo(xv.dtype).eps)  # F.rms_norm's default
    m = Match(FusionKind.ADD_RMS_NORM, [n], [], [[n]], n, {"eps": eps})
    return with_residual(m, x, [], [weight])


def match_rms_norm(r: Node) -> Match | None:
    """LlamaRMSNorm written out, found from its ``rsqrt`` (module docstring)."""
    if not is_aten(r, "rsqrt"):
        return None
    a = r.args[0]
    if not is_aten(a, "add") or len(a.args) < 2:
        return None
    mean, eps = a.args[0], scalar_of(a.args[1])
    if eps is None or not is_aten(mean, "mean") or arg_of(mean, 2, "keepdim", False) is not True:
        return None
    dims = arg_of(mean, 1, "dim")
    sq = mean.args[0]
    squared = (is_aten(sq, "pow") and scalar_of(sq.args[1]) == 2.0) or (
        is_aten(sq, "mul") and len(sq.args) == 2 and sq.args[0] is sq.args[1]
    )
    if not squared:
        return None
    xf = sq.args[0]
    xv = value_of(xf)
    if (
        xv is None
        or xv.dtype != torch.float32
        or not isinstance(dims, (list, tuple))
        or len(dims) != 1
        or not on_last_dim(xf, dims[0])
    ):
        return None
    norms = [u for u in readers_of(r) if is_aten(u, "mul") and set(u.args[:2]) == {xf, r}]
    if len(norms) != 1:
        return None
    members = [sq, mean, a, r, norms[0]]
    cur = norms[0]
    x, cast_in, identity = xf, None, False
    if is_cast(xf):
        x, cast_in = xf.args[0], xf
        identity = value_of(x).dtype == torch.float32
        members.insert(0, xf)
    dtype = value_of(x).dtype
    nxt = readers_of(cur)
    if len(nxt) == 1 and is_cast(nxt[0]):
        cur = nxt[0]
        members.append(cur)
        nxt = readers_of(cur)
    weight = None
    if len(nxt) == 1 and is_aten(nxt[0], "mul") and len(nxt[0].args) == 2:
        other = nxt[0].args[1] if nxt[0].args[0] is cur else nxt[0].args[0]
        if isinstance(other, Node) and other is not cur and shape_of(other) == (xv.shape[-1],):
            weight, cur = other, nxt[0]
            members.append(cur)
    out = value_of(cur)
    expect = torch.result_type(value_of(x), value_of(weight)) if weight is not None else dtype
    if out is None or out.dtype != expect or out.shape != xv.shape:
        return None
    m = Match(FusionKind.ADD_RMS_NORM, members, [], [[cur]], cur, {"eps": eps})
    return with_residual(m, x, [cast_in] if identity else [], [weight])

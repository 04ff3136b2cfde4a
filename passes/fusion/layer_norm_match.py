"""The ``add_layer_norm`` matcher (kernel: ``autopar.program.kernels.layer_norm``): ``aten.layer_norm``
or ``native_layer_norm`` over the last dimension, with the residual add that feeds it."""

from __future__ import annotations

import operator

from torch.fx import Node

from autopar.graph import op_name
from autopar.ir import FusionKind
from autopar.passes.fusion.matching import (
    Match,
    arg_of,
    is_aten,
    readers_of,
    scalar_of,
    shape_of,
    value_of,
    with_residual,
)


def match_layer_norm(n: Node) -> Match | None:
    if not is_aten(n, "layer_norm", "native_layer_norm"):
        return None
    x, normalized = n.args[0], arg_of(n, 1, "normalized_shape")
    xv = value_of(x)
    if xv is None or xv.dim() == 0 or list(normalized or ()) != [xv.shape[-1]]:
        return None
    weight, bias = arg_of(n, 2, "weight"), arg_of(n, 3, "bias")
    eps = scalar_of(arg_of(n, 4, "eps", 1e-5))
    if eps is None:
        return None
    for p in (weight, bias):
        if p is not None and shape_of(p) != (xv.shape[-1],):
            return None
    members, out = [n], n
    if op_name(n) == "native_layer_norm":  # (out, mean, rstd): only the output may be read
        gets = readers_of(n)
        if any(g.target is not operator.getitem for g in gets):
            return None
        firsts = [g for g in gets if g.args[1] == 0]
        if len(firsts) != 1:
            return None
        out = firsts[0]
        members += gets
    m = Match(FusionKind.ADD_LAYER_NORM, members, [], [[out]], n, {"eps": eps})
    return with_residual(m, x, [], [weight, bias])

"""The ``cross_entropy`` matcher (kernel: ``autopar.program.kernels.cross_entropy``):
``aten.cross_entropy_loss``, ``log_softmax`` + ``nll_loss``, and the lowering's
``sharded_cross_entropy``/``sharded_nll_loss``."""

from __future__ import annotations

from torch.fx import Node

from autopar.ir import FusionKind
from autopar.passes.fusion.matching import (
    Match,
    arg_of,
    is_aten,
    on_last_dim,
    readers_of,
    scalar_of,
    value_of,
)
from autopar.program import local_ops as O


def match_cross_entropy(n: Node) -> Match | None:
    if is_aten(n, "cross_entropy_loss"):
        logits, target = n.args[0], n.args[1]
        if arg_of(n, 2, "weight") is not None or scalar_of(arg_of(n, 5, "label_smoothing", 0.0)) != 0.0:
            return None
        attrs = {
            "reduction": arg_of(n, 3, "reduction", 1),
            "ignore_index": arg_of(n, 4, "ignore_index", -100),
        }
        members = [n]
    elif is_aten(n, "nll_loss", "nll_loss_nd", "nll_loss2d") or n.target is O.sharded_nll_loss:
        lsm, target = n.args[0], n.args[1]
        if (
            not is_aten(lsm, "log_softmax", "_log_softmax")
            or readers_of(lsm) != [n]
            or not on_last_dim(lsm, lsm.args[1])
        ):
            return None
        if is_aten(lsm, "log_softmax") and arg_of(lsm, 2, "dtype") is not None:
            return None
        if is_aten(lsm, "_log_softmax") and lsm.args[2]:
            return None
        logits = lsm.args[0]
        if n.target is O.sharded_nll_loss:
            attrs = {"lowered": True}
        else:
            if arg_of(n, 2, "weight") is not None:
                return None
            attrs = {
                "reduction": arg_of(n, 3, "reduction", 1),
                "ignore_index": arg_of(n, 4, "ignore_index", -100),
            }
        members = [lsm, n]
    elif n.target is O.sharded_cross_entropy and not n.kwargs.get("fused", False):
        logits, target = n.args[0], n.args[1]
        attrs = {"lowered": True}
        members = [n]
    else:
        return None
    lv, tv = value_of(logits), value_of(target)
    if lv is None or tv is None or lv.dim() != 2 or tv.dim() != 1 or tv.is_floating_point():
        return None
    if "lowered" in attrs:
        attrs["ignore_index"] = n.kwargs.get("ignore_index", -100)
        attrs["reduction"] = n.kwargs.get("reduction", 1)
    return Match(FusionKind.CROSS_ENTROPY, members, [logits, target], [[n]], members[0], attrs)

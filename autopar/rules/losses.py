"""Cross-entropy and NLL: shard the rows (output ``Partial``) and/or the classes (vocabulary-parallel
cross-entropy; its max and sum-exp all-reduces are part of the op, costed as in-op communication).
With classes per position (logits ``(N, C, d1, ...)``, target ``(N, d1, ...)``: a segmentation
loss), the batch and the positions are rows; the classes stay whole."""

from __future__ import annotations

from torch.fx import Node

from autopar.graph import tensor_outputs
from autopar.ir import Rewrite
from autopar.placement import Shard
from autopar.rules.base import AxisStrategy, P, R, aten, op_key, register, shape_of


@register(aten.cross_entropy_loss, aten.nll_loss, aten.nll_loss_nd, aten.nll_loss2d, aten.nll_loss_forward)
def _cross_entropy(node: Node, ins: list[Node]) -> list[AxisStrategy]:
    x, t = node.args[0], node.args[1]
    key = op_key(node)
    weight = node.args[2] if len(node.args) > 2 else node.kwargs.get("weight")
    reduction = node.args[3] if len(node.args) > 3 else node.kwargs.get("reduction", 1)
    smoothing = node.args[5] if len(node.args) > 5 else node.kwargs.get("label_smoothing", 0.0)
    n_out = len(tensor_outputs(node))
    if weight is not None or reduction not in (1, 2) or n_out != 1 or smoothing:
        return []
    xs, ts = shape_of(x), shape_of(t)
    if len(xs) >= 3 and len(ts) == len(xs) - 1:
        # Per-position classes (segmentation: logits (N, C, d1, ...), target (N, d1, ...)): every
        # dimension but the classes' holds rows; the classes stay whole.
        return [
            AxisStrategy(
                tuple(Shard(d) if i is x else Shard(d - 1 if d else 0) for i in ins),
                (P,),
                rewrite=Rewrite.LOSS_ROWS,
            )
            for d in (0, *range(2, len(xs)))
            if xs[d] > 1
        ]
    if len(xs) != 2 or len(ts) != 1:
        return []
    out = []
    if xs[0] > 1:
        out.append(AxisStrategy(tuple(Shard(0) for _ in ins), (P,), rewrite=Rewrite.LOSS_ROWS))
    if key is aten.cross_entropy_loss and xs[1] > 1:
        out.append(
            AxisStrategy(
                tuple(Shard(1) if i is x else R for i in ins),
                (R,),
                rewrite=Rewrite.LOSS_CLASSES,
                comm="all_reduce:3",
            )
        )
    return out

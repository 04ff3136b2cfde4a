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


@register(aten.binary_cross_entropy_with_logits)
def _binary_cross_entropy(node: Node, ins: list[Node]) -> list[AxisStrategy]:
    """An element-wise loss (multi-label classification, ELECTRA's discriminator): logits and
    target of one shape split alike along any dimension; its sum is partial, its mean partial
    after dividing by the shards (``Rewrite.MEAN_PARTIAL``: the local loss over the pieces'
    count), unreduced it stays split. Weights and positive-class weights (broadcast) are left to
    run whole."""
    x, t = node.args[0], node.args[1]
    weight = node.args[2] if len(node.args) > 2 else node.kwargs.get("weight")
    pos_weight = node.args[3] if len(node.args) > 3 else node.kwargs.get("pos_weight")
    reduction = node.args[4] if len(node.args) > 4 else node.kwargs.get("reduction", 1)
    xs = shape_of(x)
    if weight is not None or pos_weight is not None or shape_of(t) != xs or x is t:
        return []
    out = []
    for d in range(len(xs)):
        if xs[d] <= 1:
            continue
        if reduction == 0:
            out.append(AxisStrategy((Shard(d), Shard(d)), (Shard(d),)))
        elif reduction == 2:
            out.append(AxisStrategy((Shard(d), Shard(d)), (P,)))
        elif reduction == 1:
            out.append(AxisStrategy((Shard(d), Shard(d)), (P,), rewrite=Rewrite.MEAN_PARTIAL))
    return out

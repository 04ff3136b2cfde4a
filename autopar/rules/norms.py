"""Normalizations: layer/RMS/group norm shard the leading (non-normalized) dimensions; batch norm
shards channels, or rows with its statistics merged over the devices (synchronized batch norm)."""

from __future__ import annotations

from torch.fx import Node

from autopar.graph import tensor_outputs
from autopar.ir import Rewrite
from autopar.placement import Shard
from autopar.rules.base import AxisStrategy, R, aten, op_key, register, shape_of


@register(aten.layer_norm, aten.rms_norm, aten.native_layer_norm, aten.group_norm)
def _layer_norm(node: Node, ins: list[Node]) -> list[AxisStrategy]:
    x = node.args[0]
    rank = len(shape_of(x))
    key = op_key(node)
    if key is aten.group_norm:
        lead = 1
    else:
        lead = rank - len(node.args[1])
    n_out = len(tensor_outputs(node))
    out = []
    for d in range(lead):
        if shape_of(x)[d] > 1:
            outs = (Shard(d), *(Shard(d) for _ in range(n_out - 1)))
            out.append(AxisStrategy(tuple(Shard(d) if i is x else R for i in ins), outs))
    return out


SYNCED_WHEN_SPLIT = frozenset(
    {"batch_norm", "native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_functional"}
)
"""Ops (as ``autopar.graph.op_name`` writes them) whose rows split over an axis only with a
collective inside the op on it (a training batch norm's synchronized statistics)."""

SYNC_FORMS = ("sync_batch_norm", "sync_batch_norm_reduce")
"""The in-op collectives a synchronized batch norm merges its statistics with: an all-gather of
count, mean and M2 per device (latency ``(n − 1)·α`` on a ring), or two all-reduces, of the sums
and then of the squared deviations from the global mean (a tree's ``log n`` across nodes); the
solver takes the cheaper (``autopar.cost.batch_norm``)."""

_TRAINS = frozenset(
    {
        aten.batch_norm,
        aten.native_batch_norm,
        aten._native_batch_norm_legit,
        aten._native_batch_norm_legit_functional,
    }
)
"""Batch norm ops whose ``training`` flag is argument 5 (``_native_batch_norm_legit_no_training``
never trains)."""


@register(
    aten.batch_norm,
    aten.native_batch_norm,
    aten._native_batch_norm_legit,
    aten._native_batch_norm_legit_functional,
    aten._native_batch_norm_legit_no_training,
    aten.instance_norm,
)
def _batch_norm(node: Node, ins: list[Node]) -> list[AxisStrategy]:
    """Channels (dimension 1) split alike with weight, bias and running statistics; rows (the
    batch, or a spatial dimension) split with the statistics whole: in training they are merged
    over the devices (``Rewrite.SYNC_BATCH_NORM``, one strategy per merge form of
    ``SYNC_FORMS``); in evaluation the stored statistics make the op element-wise. Instance norm's
    statistics are per sample and channel: its batch splits freely when it keeps no running
    statistics."""
    x = node.args[0]
    xs = shape_of(x)
    if len(xs) < 2:
        return []
    outs = tensor_outputs(node)
    key = op_key(node)
    out = []
    if xs[1] > 1:
        in_p = tuple(Shard(1) if i is x else Shard(0) for i in ins)
        out_p = tuple(Shard(1) if o.dim() == len(xs) else Shard(0) for o in outs)
        out.append(AxisStrategy(in_p, out_p))
    if key is aten.instance_norm:
        if node.args[3] is None and xs[0] > 1:
            out.append(AxisStrategy(tuple(Shard(0) if i is x else R for i in ins), (Shard(0),)))
        return out
    training = key in _TRAINS and bool(node.args[5])
    for d in (0, *range(2, len(xs))):
        if xs[d] <= 1:
            continue
        in_p = tuple(Shard(d) if i is x else R for i in ins)
        out_p = tuple(Shard(d) if o.dim() == len(xs) else R for o in outs)
        if training:  # both forms of merging the statistics (``autopar.cost.batch_norm``)
            for form in SYNC_FORMS:
                out.append(AxisStrategy(in_p, out_p, rewrite=Rewrite.SYNC_BATCH_NORM, comm=form))
        else:
            out.append(AxisStrategy(in_p, out_p))
    return out

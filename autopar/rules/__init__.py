"""Sharding rules: for each aten op, the ways it can run on one mesh axis.

A rule looks at one fx node (shapes and dtypes from its FakeTensor ``val``) and returns a list of
:class:`AxisStrategy`: one placement per tensor input and one per tensor output, meaning "if the
inputs arrive laid out like this along the axis, running the op locally on every device gives
outputs laid out like that". N-D strategies are products of axis strategies, kept when every
tensor divides evenly (``autopar.passes.strategies``).

Rules are written by op *family*, one module each, never per model: ``pointwise``, ``views``,
``matmul``, ``reductions`` (with softmax), ``norms``, ``embedding``, ``attention``, ``conv``,
``losses``, ``routing`` (top-k, sort, scatters and gathers), ``moe_regions`` (mixture-of-experts regions placed as wholes); ``blocks`` finds where a fused weight wants block sharding. ``base`` holds the
registry. Ops with no rule run replicated (a single warning names them): always correct. A
strategy may carry a :class:`autopar.ir.Rewrite`: the lowering (``autopar.passes.lower``) then
runs a local form of the op, e.g. a mean over a sharded dimension becomes a local mean divided
by the shard count.
"""

from autopar.rules import (
    attention,
    conv,
    embedding,
    losses,
    matmul,
    norms,
    pointwise,
    reductions,
    routing,
    views,
)
from autopar.rules.base import AxisStrategy, axis_strategies, has_rule
from autopar.rules.blocks import block_hints

__all__ = ["AxisStrategy", "axis_strategies", "block_hints", "has_rule"]

# The family modules register their rules on import.
_FAMILIES = (attention, conv, embedding, losses, matmul, norms, pointwise, reductions, routing, views)

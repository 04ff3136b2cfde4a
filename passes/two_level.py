"""``two_level_reduce``: gradient all-reduces over several nodes written as two levels.

A rank-program pass (``passes.overlap.RANK_PASSES``, after ``compress_gradients``). Its words are
``autopar.cost.comm``'s (two-level all-reduce) and ``passes.collective_nodes``'s (gradient
all-reduce, issue, wait). Each gradient all-reduce over a process group the plan reduces in two
levels (``Plan.two_level``; the groups in ``RankInfo.two_level``) becomes:

* where it was issued: the gradient flattened and padded with zeros to a multiple of ``p`` (the
  group's members on one node), **reduce-scattered on the node** (this rank keeps the node's sum
  of its ``1/p`` piece), waited for, and its piece **all-reduced across the nodes** (the group of
  the members at the same place on every node) — issued, not waited for;
* where its wait was (``sink_waits`` put it where the gradient is first needed, or at the end):
  that all-reduce waited for, the pieces **all-gathered on the node**, the padding cut and the
  gradient's shape restored.

The slow collective — across the nodes — overlaps the rest of the backward as the one all-reduce
did; the two on-node ones run on the node's fast link. The sum is the same; only the order of
additions differs (a float sum's rounding).

A gradient compressed in bf16 (``passes.compress``) is flattened and padded before its cast, so
the cast stays the value a deferred reduction sums in the gradient's own precision
(``COMPRESS_CAST``). The on-node reduce-scatter carries ``TWO_LEVEL``: for a pipeline's
micro-batches, ``passes.stage_cut.defer_reductions`` adds the earlier micro-batches' sum to the
value it reduces, as it does before a one-collective gradient all-reduce. PowerSGD's, fp8's and
top-k's reductions (modules, not all-reduce nodes) are left as they are.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch.fx import GraphModule, Node

from autopar.ir import COMPRESS_CAST, PHASE, RANK, TWO_LEVEL, Phase
from autopar.passes import PassContext
from autopar.passes.collective_nodes import gradient_all_reduces

__all__ = ["two_level_reduce"]

log = logging.getLogger("autopar.passes")

_fc = torch.ops._c10d_functional
aten = torch.ops.aten


def _node(gm: GraphModule, target: object, args: tuple, val: torch.Tensor, **meta: object) -> Node:
    n = gm.graph.call_function(target, args)
    n.meta.update({PHASE: Phase.BWD, "val": val, **meta})
    return n


def _rewrite(gm: GraphModule, issue: Node, wait: Node, inside: str, p: int, across: str) -> None:
    """The gradient all-reduce ``issue``/``wait`` as the two levels (module docstring)."""
    x = issue.args[0]
    cast = x if x.meta.get(COMPRESS_CAST) else None
    grad = cast.args[0] if cast is not None else x
    gval, out_val = grad.meta["val"], wait.meta["val"]
    numel = gval.numel()
    pad = -numel % p
    with gm.graph.inserting_before(issue):
        flat_val = gval.reshape(-1)
        flat = _node(gm, aten.reshape.default, (grad, [-1]), flat_val)
        if pad:
            flat_val = F.pad(flat_val, (0, pad))
            flat = _node(gm, aten.constant_pad_nd.default, (flat, [0, pad]), flat_val)
        if cast is not None:
            flat_val = flat_val.to(cast.meta["val"].dtype)
            flat = _node(gm, aten._to_copy.default, (flat,), flat_val, **{COMPRESS_CAST: True})
            flat.kwargs = dict(cast.kwargs)
        piece = flat_val.new_empty(flat_val.numel() // p)
        rs = _node(
            gm, _fc.reduce_scatter_tensor.default, (flat, "sum", p, inside), piece, **{TWO_LEVEL: True}
        )
        rs_done = _node(gm, _fc.wait_tensor.default, (rs,), piece)
        ar = _node(gm, _fc.all_reduce.default, (rs_done, "sum", across), piece)
    with gm.graph.inserting_before(wait):
        ar_done = _node(gm, _fc.wait_tensor.default, (ar,), piece)
        ag = _node(gm, _fc.all_gather_into_tensor.default, (ar_done, p, inside), flat_val)
        whole = _node(gm, _fc.wait_tensor.default, (ag,), flat_val)
        if pad:
            whole = _node(gm, aten.slice.Tensor, (whole, 0, 0, numel), flat_val[:numel])
        shaped = _node(gm, aten.view.default, (whole, list(out_val.shape)), out_val)
    wait.replace_all_uses_with(shaped)
    gm.graph.erase_node(wait)
    gm.graph.erase_node(issue)
    if cast is not None and not cast.users:
        gm.graph.erase_node(cast)


def two_level_reduce(gm: GraphModule, ctx: PassContext) -> GraphModule:
    """Write the plan's two-level gradient reductions into ``gm`` (module docstring)."""
    info = gm.meta.get(RANK)
    groups = getattr(info, "two_level", None)
    if not groups:
        return gm
    done = 0
    for issue, wait in gradient_all_reduces(gm):
        level = groups.get(issue.args[2])
        if level is None or not isinstance(issue.args[0].meta.get("val"), torch.Tensor):
            continue
        inside, p, across = level
        _rewrite(gm, issue, wait, inside, p, across)
        done += 1
    if done:
        log.info("two_level_reduce: %d gradient all-reduces in two levels", done)
        gm.graph.lint()
        gm.recompile()
    return gm

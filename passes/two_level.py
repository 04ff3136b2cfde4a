"""``two_level_reduce``: gradient all-reduces, reduce-scatters and all-gathers over several nodes
written as two levels.

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

Each reduce-scatter (sum) and all-gather over such a group — a ZeRO weight's gathers and its
gradient's reduce-scatter, any reshard's — becomes the two-level form of ``autopar.cost.comm``:

* a reduce-scatter: its ``n = N·p`` pieces (member ``m·p + l`` is the ``l``-th on node ``m``)
  laid out place-major (a copy), **reduce-scattered on the node** and waited for (member ``l``
  keeps the node's sum of the pieces of place ``l``), then **reduce-scattered across the nodes**
  (it keeps the whole sum of piece ``m·p + l``, its own) — issued where the one was, waited for
  where it was;
* an all-gather: **gathered across the nodes** where the one was issued; where it was waited for,
  **gathered on the node**, and the pieces laid back in member order (a copy).

An issue waited for more than once keeps its first wait, which the later ones' users read. One
whose issue has a user other than its waits stays one collective, and the pass warns, naming it:
the plan priced it in two levels.

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
from autopar.passes.collective_nodes import gradient_all_reduces, is_wait

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


def _like(
    gm: GraphModule, model: Node, target: object, args: tuple, val: torch.Tensor, **kwargs: object
) -> Node:
    """A node beside ``model`` (an issue or a wait it replaces): its metadata (phase, stage, …) but
    ``val``."""
    n = gm.graph.call_function(target, args, kwargs or None)
    n.meta.update({k: v for k, v in model.meta.items() if k != "val"})
    n.meta["val"] = val
    return n


def _place_major(
    gm: GraphModule, model: Node, x: Node, xv: torch.Tensor, a: int, b: int
) -> tuple[Node, torch.Tensor]:
    """``x`` (``a·b`` pieces, in order) with its pieces as a ``b × a`` grid flattened: piece ``i·b + j``
    moves to ``j·a + i`` (a copy)."""
    grid = xv.reshape(a, b, -1)
    moved_val = grid.permute(1, 0, 2).contiguous().reshape(-1)
    r = _like(gm, model, aten.reshape.default, (x, [a, b, -1]), grid)
    t = _like(gm, model, aten.permute.default, (r, [1, 0, 2]), grid.permute(1, 0, 2))
    c = _like(
        gm,
        model,
        aten.clone.default,
        (t,),
        grid.permute(1, 0, 2).contiguous(),
        memory_format=torch.contiguous_format,
    )
    return _like(gm, model, aten.reshape.default, (c, [-1]), moved_val), moved_val


def _rewrite_scatter(gm: GraphModule, issue: Node, wait: Node, inside: str, p: int, across: str) -> None:
    """A reduce-scatter over ``n = N·p`` members as two levels (module docstring): the pieces laid
    out place-major, reduce-scattered on the node, then across the nodes."""
    x, n = issue.args[0], int(issue.args[2])
    xv, out_val = x.meta["val"], wait.meta["val"]
    nodes = n // p
    with gm.graph.inserting_before(issue):
        flat, flat_val = _place_major(gm, issue, x, xv, nodes, p)
        part = flat_val.new_empty(flat_val.numel() // p)
        inner = _like(gm, issue, _fc.reduce_scatter_tensor.default, (flat, "sum", p, inside), part)
        inner_done = _like(gm, issue, _fc.wait_tensor.default, (inner,), part)
        mine = part.new_empty(part.numel() // nodes)
        outer = _like(gm, issue, _fc.reduce_scatter_tensor.default, (inner_done, "sum", nodes, across), mine)
    with gm.graph.inserting_before(wait):
        done = _like(gm, wait, _fc.wait_tensor.default, (outer,), mine)
        shaped = _like(gm, wait, aten.reshape.default, (done, list(out_val.shape)), out_val)
    wait.replace_all_uses_with(shaped)
    gm.graph.erase_node(wait)
    gm.graph.erase_node(issue)


def _rewrite_gather(gm: GraphModule, issue: Node, wait: Node, inside: str, p: int, across: str) -> None:
    """An all-gather over ``n = N·p`` members as two levels, the reduce-scatter's mirror: across
    the nodes (issued where the one was, waited for where it was), on the node, the pieces laid
    back in member order."""
    x, n = issue.args[0], int(issue.args[1])
    xv, out_val = x.meta["val"], wait.meta["val"]
    nodes = n // p
    with gm.graph.inserting_before(issue):
        mine = xv.reshape(-1)
        flat = _like(gm, issue, aten.reshape.default, (x, [-1]), mine)
        row = mine.new_empty(mine.numel() * nodes)
        outer = _like(gm, issue, _fc.all_gather_into_tensor.default, (flat, nodes, across), row)
    with gm.graph.inserting_before(wait):
        outer_done = _like(gm, wait, _fc.wait_tensor.default, (outer,), row)
        grid = row.new_empty(row.numel() * p)
        inner = _like(gm, wait, _fc.all_gather_into_tensor.default, (outer_done, p, inside), grid)
        inner_done = _like(gm, wait, _fc.wait_tensor.default, (inner,), grid)
        ordered, _ = _place_major(gm, wait, inner_done, grid, p, nodes)
        shaped = _like(gm, wait, aten.reshape.default, (ordered, list(out_val.shape)), out_val)
    wait.replace_all_uses_with(shaped)
    gm.graph.erase_node(wait)
    gm.graph.erase_node(issue)


def _scatters_and_gathers(
    gm: GraphModule, groups: dict[str, tuple[str, int, str]]
) -> tuple[list[tuple[Node, list[Node], str]], list[str]]:
    """``(issue, waits, kind)`` of each reduce-scatter (sum) and all-gather over a group the plan
    runs in two levels, its waits in program order, and the names of those left as one
    collective: an issue read by something other than a wait, or whose input has no tensor value
    (the plan priced them in two levels, so ``two_level_reduce`` says so)."""
    found, kept = [], []
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        if n.target is _fc.reduce_scatter_tensor.default and n.args[1] == "sum":
            kind, group = "scatter", n.args[3]
        elif n.target is _fc.all_gather_into_tensor.default:
            kind, group = "gather", n.args[2]
        else:
            continue
        if group not in groups:
            continue
        waits = sorted(n.users, key=order.__getitem__)
        if (
            not waits
            or not all(is_wait(w) for w in waits)
            or not isinstance(n.args[0].meta.get("val"), torch.Tensor)
        ):
            kept.append(n.name)
            continue
        found.append((n, waits, kind))
    return found, kept


def two_level_reduce(gm: GraphModule, ctx: PassContext) -> GraphModule:
    """Write the plan's two-level gradient reductions, reduce-scatters and all-gathers into ``gm``
    (module docstring)."""
    info = gm.meta.get(RANK)
    groups = getattr(info, "two_level", None)
    if not groups:
        return gm
    done = moved = 0
    for issue, wait in gradient_all_reduces(gm):
        level = groups.get(issue.args[2])
        if level is None or not isinstance(issue.args[0].meta.get("val"), torch.Tensor):
            continue
        inside, p, across = level
        _rewrite(gm, issue, wait, inside, p, across)
        done += 1
    found, kept = _scatters_and_gathers(gm, groups)
    for issue, (wait, *later), kind in found:
        for w in later:  # waited for again: the later waits read the first (before their users)
            w.replace_all_uses_with(wait)
            gm.graph.erase_node(w)
        inside, p, across = groups[issue.args[-1]]
        (_rewrite_scatter if kind == "scatter" else _rewrite_gather)(gm, issue, wait, inside, p, across)
        moved += 1
    if kept:
        log.warning(
            "two_level_reduce: %d reduce-scatters or all-gathers the plan prices in two levels run as one "
            "collective (their issue is read by something other than a wait, or has no tensor input): %s",
            len(kept),
            ", ".join(kept),
        )
    if done or moved:
        log.info(
            "two_level_reduce: %d gradient all-reduces, %d reduce-scatters and all-gathers in two levels",
            done,
            moved,
        )
        gm.graph.lint()
        gm.recompile()
    return gm

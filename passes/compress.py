"""``compress_gradients``: the plan's gradient compression written into the rank program.

A rank-program pass (``passes.overlap.RANK_PASSES``, after ``sink_waits``). Its words are
``autopar.cost.compression``'s. It rewrites the *gradient all-reduces*: sum all-reduces in the
backward whose waited result reaches only the program's outputs, through views and copies —
data-parallel weight gradients and their buckets (``passes.overlap.bucket_gradients``), exactly
the reductions the cost model compresses (``cost.reshard_cost.compressed_grad_sync``) and the
ones a pipeline stage defers to its last micro-batch (``passes.stage_cut.defer_reductions``).

* ``bf16``: a cast to bfloat16 before the issue and one back after the wait. The issue and wait
  stay where ``sink_waits`` put them, so the reduction overlaps the backward as before. The
  cast's node carries ``COMPRESS_CAST``: deferral adds the earlier micro-batches' sum before it,
  in the gradient's own precision. A gradient already in 2 bytes is left alone.
* ``powersgd``: the issue and its wait replaced by one call of a ``PowerSGDReduce`` module
  (``autopar.program.compression``), registered on the program, at the issue's place (the
  bucket's last gradient is ready there). Buffers without a member worth compressing
  (``cost.compression.powersgd_matrix``) are left alone, and a lookup table's gradient (computed
  by ``embedding_dense_backward``, ``GradCompression.for_weight``) goes in the exact part.

* ``fp8`` and ``topk``: the issue and its wait replaced by one call of an ``Fp8Reduce`` or
  ``TopKReduce`` module (``autopar.program.compression``) on the whole buffer, at the issue's
  place; top-k's ``k`` is the buffer's ``ceil(density · n)`` (``grad_compression.topk_count``).
  A bucket's top-k is taken over its members together: ``cost.compression`` prices each
  gradient's own ``k``, and the bucket's is their sum within one element per member.

Each buffer's members are read off ``GRAD_MEMBERS`` (the bucket's shapes, set by
``bucket_gradients``), or, for an unbucketed gradient, off the value all-reduced.
"""

from __future__ import annotations

import logging

import torch
from torch.fx import GraphModule, Node

from autopar.grad_compression import powersgd_matrix, topk_count
from autopar.ir import COMPRESS_CAST, GRAD_MEMBERS, PHASE, RANK, Phase
from autopar.passes import PassContext
from autopar.passes.collective_nodes import gradient_all_reduces
from autopar.program.compression import Fp8Reduce, PowerSGDReduce, TopKReduce

__all__ = ["compress_gradients"]

log = logging.getLogger("autopar.passes")

_fc = torch.ops._c10d_functional
aten = torch.ops.aten


def _members(issue: Node) -> list[tuple[int, ...]]:
    shapes = issue.meta.get(GRAD_MEMBERS)
    if shapes is not None:
        return [tuple(s) for s in shapes]
    return [tuple(issue.args[0].meta["val"].shape)]


_CARRIES = {
    "add",
    "view",
    "reshape",
    "_unsafe_view",
    "_to_copy",
    "clone",
    "t",
    "transpose",
    "permute",
    "contiguous",
}
"""Ops a gradient passes through on its way from the op computing it to its all-reduce (a tied
weight's two gradients added, views, casts)."""


def _from_lookup(grad: Node) -> bool:
    """Whether the gradient ``grad`` is (or sums) an embedding table's: computed by
    ``embedding_dense_backward``, reached back through ``_CARRIES`` (``GradCompression.for_weight``)."""
    todo, seen = [grad], {grad}
    while todo:
        n = todo.pop()
        if n.op != "call_function":
            continue
        name = getattr(n.target, "__name__", str(n.target)).split(".")[0]
        if name == "embedding_dense_backward":
            return True
        if name in _CARRIES:
            for i in n.all_input_nodes:
                if i not in seen:
                    seen.add(i)
                    todo.append(i)
    return False


def _member_grads(issue: Node) -> list[Node]:
    """The gradients a (bucketed) all-reduce carries, in order: a bucket's ``cat`` of flattened
    members (``passes.overlap.bucket_gradients``), else the one value reduced."""
    x = issue.args[0]
    if issue.meta.get(GRAD_MEMBERS) is not None and getattr(x.target, "__name__", "").startswith("cat"):
        return [f.args[0] for f in x.args[0]]
    return [x]


def _replace(gm: GraphModule, issue: Node, wait: Node, name: str, reduce: torch.nn.Module) -> None:
    """The all-reduce ``issue`` and its ``wait`` replaced by one call of ``reduce``, registered on
    ``gm`` as ``name``, at the issue's place."""
    g = gm.graph
    gm.add_submodule(name, reduce)
    with g.inserting_before(issue):
        call = g.call_module(name, (issue.args[0],))
    call.meta.update({PHASE: Phase.BWD, "val": issue.args[0].meta["val"]})
    wait.replace_all_uses_with(call)
    g.erase_node(wait)
    g.erase_node(issue)


def compress_gradients(gm: GraphModule, ctx: PassContext) -> GraphModule:
    """Write the plan's gradient compression into ``gm`` (module docstring)."""
    info = gm.meta.get(RANK)
    c = getattr(info, "compression", None)
    if c is None:
        return gm
    g = gm.graph
    done = 0
    for issue, wait in gradient_all_reduces(gm):
        x = issue.args[0]
        val = x.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        if c.method == "bf16":
            if val.element_size() <= 2:
                continue
            with g.inserting_before(issue):
                cast = g.call_function(aten._to_copy.default, (x,), {"dtype": torch.bfloat16})
            cast.meta.update({PHASE: Phase.BWD, COMPRESS_CAST: True, "val": val.to(torch.bfloat16)})
            issue.update_arg(0, cast)
            issue.meta["val"] = cast.meta["val"]
            with g.inserting_after(wait):
                back = g.call_function(aten._to_copy.default, (wait,), {"dtype": val.dtype})
            back.meta.update({PHASE: Phase.BWD, "val": val})
            wait.replace_all_uses_with(back, delete_user_cb=lambda u, b=back: u is not b)
            wait.meta["val"] = cast.meta["val"]
        elif c.method in ("fp8", "topk"):
            group = issue.args[2]
            k = topk_count(val.numel(), c)
            _replace(
                gm,
                issue,
                wait,
                f"{c.method}_{done}",
                Fp8Reduce(group) if c.method == "fp8" else TopKReduce(k, group),
            )
        else:
            shapes = _members(issue)
            lookups = [_from_lookup(gr) for gr in _member_grads(issue)]
            if len(lookups) != len(shapes):  # bucket_gradients builds both from one member list
                raise RuntimeError(
                    f"compress_gradients: {issue.name} carries {len(shapes)} gradients but "
                    f"{len(lookups)} were found feeding it; the bucket's layout changed"
                )
            matrices = [
                powersgd_matrix(s, c) if c.for_weight(lookup) is not None else None
                for s, lookup in zip(shapes, lookups)
            ]
            if all(m is None for m in matrices):
                continue
            psgd = PowerSGDReduce(
                shapes, matrices, c.rank, issue.args[2], seed=done, warmup_steps=c.warmup_steps
            )
            _replace(gm, issue, wait, f"powersgd_{done}", psgd)
        done += 1
    if done:
        log.info("compress_gradients: %d gradient all-reduces compressed (%s)", done, c.describe())
        g.lint()
        gm.recompile()
    return gm

"""The local forms of rewritten ops: what ``passes.lower`` emits for a node whose plan carries a
``Rewrite`` (``autopar.ir``) — the op does not run as captured on this device's shards, but as its
local form (``autopar.program.local_ops``, ``experts``, ``ring_attention``) with the positions,
axes and counts read off the plan. ``LOCAL_OPS`` maps each rewrite to the method of ``LocalOps``
(a part of the lowerer, ``passes.lower._Lowerer``) that emits it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch.fx import Graph, Node

from autopar.graph import OpFamily, op_family, op_name, written_inputs
from autopar.ir import Rewrite
from autopar.passes.plan_check import LoweringError
from autopar.placement import Shard, parse_spec, shard_slices
from autopar.planfile import NodePlan, Plan
from autopar.program import experts as M
from autopar.program import local_ops as O
from autopar.program import ring_attention as R
from autopar.reshard import broadcast_chain, repeat_stride
from autopar.rules.routing import grouped_mm_operands

__all__ = ["EXPERT_REWRITES", "LOCAL_OPS", "LocalOps", "out_of_place"]

aten = torch.ops.aten

EXPERT_REWRITES = {
    Rewrite.EXPERT_DISPATCH,
    Rewrite.EXPERT_LOCAL,
    Rewrite.EXPERT_COMBINE,
    Rewrite.EXPERT_DISPATCH_COMBINE,
}
"""Rewrites of a grouped matmul over this device's experts (``lower_experts``)."""


def out_of_place(node: Node) -> Any:
    """``node``'s op, or its out-of-place form when it writes into an intermediate value nothing
    reads after it (``div_`` on top-k weights, ``index_add_`` into fresh zeros): the same value,
    and the traced backward (``passes.joint``) cannot read a saved input the write overwrote."""
    target = node.target
    name = op_name(node)
    written = written_inputs(node)
    if not name.endswith("_") or written != [node.args[0]] or node.args[0].op == "placeholder":
        return target
    src = node.args[0]
    aliased = (op_family(src) is OpFamily.VIEW and op_name(src) != "getitem") or op_name(src) in (
        "alias",
        "detach",
        "contiguous",
    )
    if aliased:
        return target  # a write through a view reaches its base, which others read
    order = {n: i for i, n in enumerate(node.graph.nodes)} if len(src.users) > 1 else {}
    if any(order[u] > order[node] for u in src.users if u is not node):
        return target
    packet = getattr(torch.ops.aten, name[:-1], None)
    overload = getattr(packet, target._overloadname, None) if packet is not None else None
    return overload if overload is not None else target


class LocalOps:
    """The lowerer's methods that emit rewritten ops, each ``(node, its NodePlan, its local args
    and kwargs, its tensor inputs) -> the local op's node``, reading the lowerer's state."""

    g: Graph
    mesh: tuple[int, ...]
    coord: tuple[int, ...]
    plan: Plan
    routes: dict[Node, Node]
    ax: Callable[[int], Node]
    """Mesh axis ``a``'s group node (``passes.lower._Lowerer.ax``)."""
    fail: Callable[[Node, str], LoweringError]

    def lower_experts(self, node: Node, p: NodePlan, args: tuple, kwargs: dict, ins: list[Node]) -> Node:
        """A grouped matmul over this device's experts (``autopar.program.experts``): dispatch its rows
        to their experts' devices first (``EXPERT_DISPATCH``), or take them already dispatched;
        combine its output back after (``EXPERT_COMBINE``). The route (counts exchanged once) is
        made at the dispatch and reused, keyed by the counts the matmuls share."""
        (a,) = [a for a, r in enumerate(p.rewrites) if Rewrite(r) in EXPERT_REWRITES]
        rw = Rewrite(p.rewrites[a])
        _, _, offs_node = grouped_mm_operands(node)
        ax = self.ax(a)
        args = list(args)
        offs_pos = 2 if len(args) > 2 else None
        offs = args[2] if offs_pos is not None else kwargs["offs"]
        if rw in (Rewrite.EXPERT_DISPATCH, Rewrite.EXPERT_DISPATCH_COMBINE):
            route = self.g.call_function(M.route, (offs, ax))
            self.routes[offs_node] = route
            args[0] = self.g.call_function(M.dispatch, (args[0], route, ax))
        elif offs_node in self.routes:
            route = self.routes[offs_node]
        else:
            raise self.fail(node, "its rows are dispatched, but no grouped matmul before it dispatched them")
        local = self.g.call_function(M.expert_offsets, (route, offs_node.meta["val"].dtype))
        if offs_pos is not None:
            args[offs_pos] = local
        else:
            kwargs = {**kwargs, "offs": local}
        y = self.g.call_function(node.target, tuple(args), kwargs)
        if rw in (Rewrite.EXPERT_COMBINE, Rewrite.EXPERT_DISPATCH_COMBINE):
            y = self.g.call_function(M.combine, (y, route, ax))
        return y

    def lower_mean(self, node: Node, p: NodePlan, args: tuple, kwargs: dict, ins: list[Node]) -> Node:
        """A mean over split dimensions (``Rewrite.MEAN_PARTIAL``): ``aten.mean`` as ``mean_partial``;
        any other op reducing to the mean of all its elements (an element-wise loss's) runs as it is
        on this device's equal piece, divided by the number of pieces."""
        shards = math.prod(n for n, r in zip(self.mesh, p.rewrites) if r == Rewrite.MEAN_PARTIAL)
        if op_name(node) != "mean":
            local = self.g.call_function(out_of_place(node), tuple(args), kwargs)
            return self.g.call_function(aten.div.Tensor, (local, shards))
        dims = args[1] if len(args) > 1 else kwargs.get("dim")
        keep = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
        return self.g.call_function(O.mean_partial, (args[0], dims, keep, shards))

    def lower_embedding(self, node: Node, p: NodePlan, args: tuple, kwargs: dict, ins: list[Node]) -> Node:
        w = node.args[0]
        start = shard_slices(
            tuple(w.meta["val"].shape), parse_spec(p.inputs[ins.index(w)]), self.mesh, self.coord
        )[0][0][0]
        padding_idx = args[2] if len(args) > 2 else kwargs.get("padding_idx", -1)
        return self.g.call_function(O.vocab_parallel_embedding, (args[0], args[1], start, padding_idx))

    def lower_causal_queries(
        self, node: Node, p: NodePlan, args: tuple, kwargs: dict, ins: list[Node]
    ) -> Node:
        """Causal attention over this device's queries (``Rewrite.CAUSAL_QUERIES``): the global
        positions of its query rows, read off the plan's spec for them, align the mask."""
        q = node.args[0]
        rank = q.meta["val"].dim()
        pieces = shard_slices(
            tuple(q.meta["val"].shape), parse_spec(p.inputs[ins.index(q)]), self.mesh, self.coord
        )[rank - 2]
        names = [a.name for a in node.target._schema.arguments]
        given = dict(zip(names, args)) | kwargs
        if given.get("attn_mask") is not None:
            raise self.fail(node, "it is causal and has an explicit mask; SDPA itself refuses both")
        return self.g.call_function(
            O.causal_query_attention,
            (given["query"], given["key"], given["value"], tuple(pieces)),
            {
                "dropout_p": given.get("dropout_p", 0.0),
                "scale": given.get("scale"),
                "enable_gqa": given.get("enable_gqa", False),
            },
        )

    def lower_ring_attention(
        self, node: Node, p: NodePlan, args: tuple, kwargs: dict, ins: list[Node]
    ) -> Node:
        """Attention as a ring along the one axis the plan names (``Rewrite.RING_ATTENTION``,
        ``autopar.program.ring_attention``): the global positions each device of that axis holds,
        read off the plan's spec for the queries (the keys and values share it)."""
        (a,) = [i for i, r in enumerate(p.rewrites) if r == Rewrite.RING_ATTENTION and self.mesh[i] > 1]
        q = node.args[0]
        spec = parse_spec(p.inputs[ins.index(q)])
        if any(parse_spec(p.inputs[ins.index(x)]) != spec for x in node.args[1:3]):
            raise self.fail(node, "a ring needs its queries, keys and values split alike")
        seq = q.meta["val"].dim() - 2
        split = [
            b for b, pl in enumerate(spec) if isinstance(pl, Shard) and pl.dim == seq and self.mesh[b] > 1
        ]
        if split != [a]:
            raise self.fail(node, f"its ring runs on axis {a}, and its sequence is split on axes {split}")
        names = [x.name for x in node.target._schema.arguments]
        given = dict(zip(names, args)) | kwargs
        if given.get("attn_mask") is not None or given.get("dropout_p", 0.0):
            raise self.fail(node, "ring attention takes no explicit mask and no dropout")
        # Keys and values repeated for grouped-query attention (transformers' ``repeat_kv``) travel
        # once per distinct head: each device takes every ``stride``-th of its heads, and the ring
        # repeats them back per step (the cost model prices the same bytes).
        kv = []
        for x, name in zip(node.args[1:3], ("key", "value")):
            chain = broadcast_chain(x)
            stride = repeat_stride(chain, spec, self.mesh)
            value = given[name]
            if stride > 1:
                assert chain is not None
                value = self.g.call_function(aten.slice.Tensor, (value, chain.dim, 0, None, stride))
            kv.append(value)
        return self.g.call_function(
            R.ring_attention,
            (given["query"], *kv, self.ax(a), spec[a].blocks),
            {"causal": bool(given.get("is_causal", False)), "scale": given.get("scale")},
        )

    def lower_loss(self, node: Node, p: NodePlan, args: tuple, kwargs: dict, ins: list[Node]) -> Node:
        x = node.args[0]
        # A size-1 axis splits nothing: its rows or classes need no reduction.
        class_axes = [
            self.ax(a) for a, r in enumerate(p.rewrites) if r == Rewrite.LOSS_CLASSES and self.mesh[a] > 1
        ]
        rows = [a for a, r in enumerate(p.rewrites) if r == Rewrite.LOSS_ROWS and self.mesh[a] > 1]
        copies = 1
        pipe = self.plan.pipeline
        if pipe is not None and pipe.dp_shares and rows and rows[0] == 0:
            # Unequal shares: no per-micro-batch count over the first axis (its ranks run different
            # numbers of micro-batches); its rows are counted as this rank's (``_reduce_rows``).
            copies, rows = self.mesh[0], rows[1:]
        row_axes = [self.ax(a) for a in rows]
        reduction = args[3] if len(args) > 3 else kwargs.get("reduction", 1)
        ignore = args[4] if len(args) > 4 else kwargs.get("ignore_index", -100)
        class_start = 0
        if class_axes:
            xs = parse_spec(p.inputs[ins.index(x)])
            class_start = shard_slices(tuple(x.meta["val"].shape), xs, self.mesh, self.coord)[1][0][0]
        kw: dict[str, Any] = {"ignore_index": ignore, "reduction": reduction}
        if op_name(node) == "cross_entropy_loss":
            fn = O.sharded_cross_entropy
            kw |= {"class_start": class_start, "class_axes": class_axes}
        elif class_axes:
            raise self.fail(node, "class-sharded nll_loss is not supported")
        else:
            fn = O.sharded_nll_loss
        if copies > 1:
            kw["row_copies"] = copies
        return self.g.call_function(fn, (args[0], args[1]), kw | {"row_axes": row_axes})

    def lower_batch_norm(self, node: Node, p: NodePlan, args: tuple, kwargs: dict, ins: list[Node]) -> Node:
        """Training batch norm over rows split along the axes the plan names
        (``Rewrite.SYNC_BATCH_NORM``): the statistics merged over them (``O.sync_batch_norm``),
        gathered or all-reduced as the plan's in-op collective says."""
        axes = [
            self.ax(a) for a, r in enumerate(p.rewrites) if r == Rewrite.SYNC_BATCH_NORM and self.mesh[a] > 1
        ]
        names = [a.name for a in node.target._schema.arguments]
        given = dict(zip(names, args)) | kwargs
        return self.g.call_function(
            O.sync_batch_norm,
            (
                given["input"],
                given.get("weight"),
                given.get("bias"),
                given.get("running_mean"),
                given.get("running_var"),
                given["momentum"],
                given["eps"],
                axes,
                op_name(node),
                "sync_batch_norm_reduce" in p.comms,
            ),
        )


LOCAL_OPS = {
    **{r: LocalOps.lower_experts for r in EXPERT_REWRITES},
    Rewrite.MEAN_PARTIAL: LocalOps.lower_mean,
    Rewrite.VOCAB_PARALLEL_EMBEDDING: LocalOps.lower_embedding,
    Rewrite.LOSS_ROWS: LocalOps.lower_loss,
    Rewrite.LOSS_CLASSES: LocalOps.lower_loss,
    Rewrite.CAUSAL_QUERIES: LocalOps.lower_causal_queries,
    Rewrite.RING_ATTENTION: LocalOps.lower_ring_attention,
    Rewrite.SYNC_BATCH_NORM: LocalOps.lower_batch_norm,
}
"""Each ``Rewrite`` and the method that emits its local op (``autopar.program.local_ops``)."""

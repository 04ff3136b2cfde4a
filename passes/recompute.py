"""Recomputation on the whole-step program: compute a forward value again in backward instead of
saving it from forward.

``recompute_in_backward(gm, nodes)`` gives every backward reader of a node in ``nodes`` a copy of
it computed in backward, just before the first backward node that needs it; inputs of a copied
node that are themselves in ``nodes`` are copied too, the others are read as they are (and are then
what backward saves). The forward nodes stay for forward; once no backward node reads them they
are no longer saved (``passes.joint.partition`` saves exactly the forward values backward reads).

This is the one mechanism behind ZeRO-3's re-gather (``passes.overlap.regather_zero3_params``:
the nodes computed from one parameter shard, its all-gather among them) and activation
recomputation (Chen et al., arXiv 1604.06174; Korthikanti et al., arXiv 2205.05198: selective
and full recomputation choose which nodes).

``recompute_layers`` is the rank-program pass that applies the plan's recomputation
(``Plan.recompute``, read from ``RankInfo``) layer by layer: it recomputes the forward nodes
lowered from the captured nodes the plan was costed as recomputing (``RankInfo.recompute_sources``,
by ``passes.strategies.recomputed``; a node's source is ``meta["custom"]["autopar.source"]``, kept
through the joint trace), grouped by repeated-layer instance (``transformer.h.3``,
``RankInfo.layer_of``) so each layer is recomputed just before its own backward:

* ``full`` — every forward node of a layer is recomputed in that layer's backward except the
  layer's outputs (values read by another layer or outside layers: the checkpoints); the layer's
  inputs are the only activations it keeps (Chen et al.).
* ``selective`` — only the nodes producing attention-score tensors (the ``s × s`` product of
  queries and keys, masking, softmax) are recomputed; the matmul inputs are kept (Korthikanti et
  al. §5).

Random ops (dropout) are never recomputed — their outputs are kept, so a recomputed layer sees the
same masks — and neither are ops writing into their inputs.
"""

from __future__ import annotations

import logging
from collections import defaultdict

from torch.fx import GraphModule, Node

from autopar.graph import is_random
from autopar.passes import PassContext
from autopar.passes.joint import PHASE, RANK, Phase, mutates

__all__ = ["RECOMPUTE_MODES", "recompute_in_backward", "recompute_layers", "source_of"]

RECOMPUTE_MODES = ("none", "selective", "full")

log = logging.getLogger(__name__)


def recompute_in_backward(gm: GraphModule, nodes: set[Node], after: Node | None = None) -> int:
    """Copy the nodes of ``nodes`` that backward reads into backward (see module docstring);
    returns the number of nodes copied. ``after``: only backward readers from this node on read
    the copies (earlier ones — tangent-free work autograd placed among the forward — keep the
    originals)."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    start = order[after] if after is not None else -1
    bwd_readers = {
        n: [u for u in n.users if u.meta.get(PHASE) == Phase.BWD and u.op != "output" and order[u] >= start]
        for n in nodes
    }
    needed: set[Node] = set()
    stack = [n for n, us in bwd_readers.items() if us]
    while stack:
        n = stack.pop()
        if n in needed:
            continue
        needed.add(n)
        stack.extend(i for i in n.all_input_nodes if i in nodes)
    if not needed:
        return 0
    first_reader = min((u for n in needed for u in bwd_readers[n]), key=lambda u: order[u], default=None)
    if first_reader is None:
        # Only other copies read them (an intermediate of the chain): place before the earliest
        # backward reader of any node of the chain.
        return 0
    copies: dict[Node, Node] = {}
    with gm.graph.inserting_before(first_reader):
        for n in sorted(needed, key=lambda x: order[x]):
            c = gm.graph.node_copy(n, lambda x: copies.get(x, x))
            c.meta.update(n.meta)
            c.meta[PHASE] = Phase.BWD
            copies[n] = c
    for n, readers in bwd_readers.items():
        if n in copies:
            for u in readers:
                u.replace_input_with(n, copies[n])
    return len(copies)


def source_of(n: Node) -> str | None:
    """The captured node ``n`` was lowered from (kept through the joint trace)."""
    custom = n.meta.get("custom")
    return custom.get("autopar.source") if isinstance(custom, dict) else None


def _sink_early_backward(gm: GraphModule, end: Node | None) -> None:
    """Move backward-only nodes autograd recorded among the forward (aliases of saved values,
    tangent-free parts of derivatives) to just before their first reader, so that a value's
    first backward reader is where its layer's backward starts."""
    if end is None:
        return
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    early = [
        n
        for n in gm.graph.nodes
        if order[n] < order[end]
        and n.op == "call_function"
        and n.meta.get(PHASE) == Phase.BWD
        and not mutates(n)
    ]
    for n in reversed(early):
        users = [u for u in n.users if u.op != "output"]
        if not users or any(u.meta.get(PHASE) != Phase.BWD for u in users):
            continue
        first = min(users, key=lambda u: order[u])
        if order[first] > order[n]:
            first.prepend(n)
            order[n] = order[first] - 0.5


def recompute_layers(gm: GraphModule, ctx: PassContext) -> GraphModule:
    """Apply the plan's recomputation to the whole-step program (module docstring)."""
    info = gm.meta.get(RANK)
    mode = getattr(info, "recompute", "none")
    if mode == "none" or info is None:
        return gm
    layer_of = info.layer_of
    by_layer: dict[str, set[Node]] = defaultdict(set)
    tangents = {n for n in gm.graph.nodes if n.op == "placeholder" and n.meta.get(PHASE) == Phase.BWD}
    end = next(
        (
            n
            for n in gm.graph.nodes
            if n.op == "call_function" and any(i in tangents for i in n.all_input_nodes)
        ),
        None,
    )  # the forward region ends at the first node reading a tangent
    _sink_early_backward(gm, end)
    for n in gm.graph.nodes:
        if n is end:
            break
        if n.op != "call_function" or n.meta.get(PHASE) != Phase.FWD:
            continue
        src = source_of(n)
        if src not in info.recompute_sources or mutates(n) or is_random(n):
            continue
        by_layer[layer_of.get(src, "")].add(n)
    copied = 0
    for nodes in by_layer.values():  # one layer at a time: its copies go before its own backward
        copied += recompute_in_backward(gm, nodes)
    log.info(
        "recompute_layers (%s): %d forward nodes recomputed in backward over %d layers",
        mode,
        copied,
        len(by_layer),
    )
    gm.graph.lint()
    gm.recompile()
    return gm

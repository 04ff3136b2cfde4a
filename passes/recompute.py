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
* ``ops`` — the nodes the solver chose to recompute, one by one (``NodePlan.recomputed``), with
  the views of their outputs (``passes.recompute_ops``).
* ``selective`` — only the nodes producing attention-score tensors (the ``s × s`` product of
  queries and keys, masking, softmax) are recomputed; the matmul inputs are kept (Korthikanti et
  al. §5).

Random ops (dropout) are recomputed too, drawing the same numbers: the forward draw becomes
``run_and_save_rng_state(op, …)`` — one call that reads the generator's state and draws, so no pass
can separate the two — and its copy in backward ``run_with_rng_state(state, op, …)``, which sets
that state, draws, and puts the generator back where it was, so every later draw of the step is
the one it would be without recomputation (``autopar.program.rng``; AOTAutograd's functionalized
RNG and Megatron-LM's ``CheckpointFunction`` do the same). Backward keeps the state — a few KB per
random op — instead of a mask. Ops writing into their inputs are not recomputed, except those
writing only into a value recomputed with them that nothing else reads (the ``empty_like`` a
``bernoulli_`` fills, the mask a ``div_`` scales: how dropout is traced on a CPU).
"""

from __future__ import annotations

import logging
import operator
from collections import defaultdict

import torch
from torch.fx import GraphModule, Node
from torch.fx.node import map_arg

from autopar.graph import is_random, mutates, written_inputs
from autopar.ir import PHASE, RANK, Phase
from autopar.passes import PassContext
from autopar.passes.annotate import storage_id
from autopar.program.rng import run_and_save_rng_state, run_with_rng_state

__all__ = ["RECOMPUTE_MODES", "recompute_in_backward", "recompute_layers", "source_of"]

RECOMPUTE_MODES = ("none", "selective", "full", "ops")

log = logging.getLogger(__name__)


def recompute_in_backward(gm: GraphModule, nodes: set[Node], after: Node | None = None) -> int:
    """Copy the nodes of ``nodes`` that backward reads into backward (see module docstring);
    returns the number of nodes copied. ``after``: only backward readers from this node on read
    the copies (earlier ones — tangent-free work autograd placed among the forward — keep the
    originals). A random node among the copies draws in forward through
    ``run_and_save_rng_state`` and in backward through ``run_with_rng_state`` (``_record_draw``)."""
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
        draw = _draw_of(n)
        stack.extend(i for i in (draw or n).all_input_nodes if i in nodes)
    if not needed:
        return 0
    first_reader = min((u for n in needed for u in bwd_readers[n]), key=lambda u: order[u], default=None)
    if first_reader is None:
        # Only other copies read them (an intermediate of the chain): place before the earliest
        # backward reader of any node of the chain.
        return 0
    for n in needed:
        if _draw_of(n) is None and is_random(n):
            _record_draw(gm, n)
    copies: dict[Node, Node] = {}
    g = gm.graph
    with g.inserting_before(first_reader):
        for n in sorted(needed, key=lambda x: order[x]):
            draw = _draw_of(n)
            if draw is None:
                c = g.node_copy(n, lambda x: copies.get(x, x))
            else:  # replay the forward's draw: same numbers, generator left as it was
                op, *args = map_arg(draw.args, lambda x: copies.get(x, x))
                replay = g.call_function(
                    run_with_rng_state,
                    (_state_of(draw), op, *args),
                    map_arg(draw.kwargs, lambda x: copies.get(x, x)),
                )
                replay.meta.update(draw.meta)
                replay.meta[PHASE] = Phase.BWD
                c = g.call_function(operator.getitem, (replay, 1))
            c.meta.update(n.meta)
            c.meta[PHASE] = Phase.BWD
            copies[n] = c
    for n, readers in bwd_readers.items():
        if n in copies:
            for u in readers:
                u.replace_input_with(n, copies[n])
    return len(copies)


def _draw_of(n: Node) -> Node | None:
    """The ``run_and_save_rng_state`` call whose output ``n`` is (``_record_draw``), else None."""
    if n.op == "call_function" and n.target is operator.getitem and n.args[1] == 1:
        src = n.args[0]
        if isinstance(src, Node) and src.target is run_and_save_rng_state:
            return src
    return None


def _state_of(draw: Node) -> Node:
    """The generator state a ``run_and_save_rng_state`` call recorded (its element 0)."""
    return next(u for u in draw.users if u.target is operator.getitem and u.args[1] == 0)


def _record_draw(gm: GraphModule, n: Node) -> None:
    """Make the forward random node ``n`` record its generator's state just before it draws: a
    ``run_and_save_rng_state(op, *args)`` call is inserted before ``n``, its element 0 is the state
    (what backward keeps: a few KB, ``autopar.program.rng``), and ``n`` becomes its element 1 —
    the same value, read by the same users."""
    g = gm.graph
    val = n.meta.get("val")
    device = val.device if isinstance(val, torch.Tensor) else torch.device("cpu")
    # The state's size: the CPU's Mersenne Twister state, or a CUDA Philox seed and offset.
    state_val = torch.empty(torch.get_rng_state().numel() if device.type == "cpu" else 16, dtype=torch.uint8)
    with g.inserting_before(n):
        draw = g.call_function(run_and_save_rng_state, (n.target, *n.args), dict(n.kwargs))
        state = g.create_node("call_function", operator.getitem, (draw, 0), name=f"{n.name}_rng_state")
    draw.meta.update(n.meta)
    draw.meta["val"] = (state_val, val)
    state.meta.update({k: v for k, v in n.meta.items() if k != "val"})
    state.meta["val"] = state_val
    n.target = operator.getitem
    n.args = (draw, 1)
    n.kwargs = {}


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


def _writes_fresh(n: Node, chosen: set[Node]) -> bool:
    """``n`` writes only into values recomputed with it that nothing else reads (``bernoulli_``
    filling an ``empty_like``, a ``div_`` scaling the mask it drew): its copy writes into the
    copies, and no other reader can tell the order of the write."""
    written = written_inputs(n)
    return bool(written) and all(v in chosen and set(v.users) == {n} for v in written)


def _add_forward_views(gm: GraphModule, by_layer: dict[str, set[Node]], end: Node | None) -> None:
    """Per-activation recomputation (``"ops"``): each chosen node's forward views join it. The
    lowering writes views of its own (a linear's input flattened for its matmul, under the linear's
    source); one kept in forward would keep the recomputed storage alive for the backward reading
    it. A view is a forward node sharing the chosen node's storage (its fake value's)."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    stop = order[end] if end is not None else len(order)
    for nodes in by_layer.values():
        stack = list(nodes)
        while stack:
            n = stack.pop()
            st = storage_id(n)
            if st is None:
                continue
            for u in n.users:
                if (
                    u not in nodes
                    and u.op == "call_function"
                    and u.meta.get(PHASE) == Phase.FWD
                    and order[u] < stop
                    and not mutates(u)
                    and storage_id(u) == st
                ):
                    nodes.add(u)
                    stack.append(u)


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
        if src not in info.recompute_sources:
            continue
        layer = layer_of.get(src, "")
        if mutates(n) and not _writes_fresh(n, by_layer.get(layer, set())):
            continue
        by_layer[layer].add(n)
    if mode == "ops":
        _add_forward_views(gm, by_layer, end)
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

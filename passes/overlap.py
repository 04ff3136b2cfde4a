"""Rank-program passes over the whole-step program: where communication runs, and what it overlaps.

Each pass is ``(gm, ctx) -> gm`` over the joint program (``passes.joint``), logs what it changed,
and can be turned off by name (``PlanConfig.disable``). ``RANK_PASSES`` is the list, in order (the
per-rank compiler, ``passes.rank_compiler``, runs it after tracing the step):

1. ``regather_zero3_params`` — a ZeRO-3 parameter (stored sharded, gathered for use) is gathered
   again in backward instead of keeping the gathered copy from forward: only the shard is saved
   (Rajbhandari et al., arXiv 1910.02054 §5.3). The copies are recomputation
   (``passes.recompute.recompute_in_backward``) of the nodes computed from that parameter alone.
2. ``offload_activations`` (``passes.offload_activations``) — the saved activations of the
   plan's offloaded layers copied to host memory as the forward makes them and fetched back, a
   layer ahead, for their backward (``Plan.offload_layers``; nothing without).
3. ``bucket_gradients`` — gradient all-reduces whose result is only returned as a gradient
   (data-parallel weights) are merged into flat buckets of up to 25 MiB, in the order backward
   produces them, each issued as soon as its last gradient is ready (PyTorch DDP's bucketing,
   Li et al., VLDB 2020); and of at most ``1/GRADIENT_BUCKETS`` of the gradients they reduce
   (``cost.timeline.GRADIENT_BUCKETS``, what the simulator plays), so that a small model's
   reduction does not wait whole for the end of the backward.
4. ``prefetch_params`` — each ZeRO-3 gather is issued while the previous gathered layer
   computes (one layer ahead), in forward and in backward (FSDP's prefetch), rather than just
   before its first use.
5. ``sink_waits`` — every collective is issued as early as its input allows (except parameter
   gathers, which ``prefetch_params`` places to bound memory) and waited for as late as its first
   use allows (lightning-thunder's ``sort_waits``), so communication overlaps whatever compute
   lies between.
6. ``compress_gradients`` (``passes.compress``) — the plan's gradient compression written around
   the gradient all-reduces (``Plan.compression``; nothing without one).
7. ``two_level_reduce`` (``passes.two_level``) — the gradient all-reduces over several nodes the
   plan runs in two levels (``Plan.two_level``): on each node, across the nodes, on each node.
8. ``gather_into_buffers`` (``passes.gather_buffers``) — on gloo only, every all-gather writes
   into a buffer the program allocates (the functional op's ``out=`` form), the workaround for a
   heap fault of torch's gloo backend with several gathers in flight on one group.

Words: a collective is an *issue* node (``_c10d_functional.all_reduce`` …) and a *wait* node
(``wait_tensor``); the issue starts the transfer and returns at once, the wait blocks until it is
done.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Callable

import torch
from torch.fx import GraphModule, Node

from autopar.cost.timeline import GRADIENT_BUCKETS
from autopar.graph import outer_instance, output_node
from autopar.ir import GRAD_MEMBERS, PHASE, RANK, Phase
from autopar.passes import PassContext
from autopar.passes.collective_nodes import (
    gradient_all_reduces,
    is_issue,
    is_wait,
    layout_only,
)
from autopar.passes.compress import compress_gradients
from autopar.passes.gather_buffers import gather_into_buffers
from autopar.passes.offload_activations import offload_activations
from autopar.passes.recompute import recompute_in_backward, recompute_layers
from autopar.passes.two_level import two_level_reduce

__all__ = [
    "BUCKET_BYTES",
    "RANK_PASSES",
    "bucket_gradients",
    "prefetch_params",
    "regather_zero3_params",
    "sink_waits",
]

log = logging.getLogger("autopar.passes")

BUCKET_BYTES = 25 * 1024 * 1024
"""DDP's default bucket size."""

aten = torch.ops.aten
_fc = torch.ops._c10d_functional


def _primal_sources(gm: GraphModule) -> dict[Node, frozenset[Node]]:
    """For every node, the placeholders it is computed from."""
    src: dict[Node, frozenset[Node]] = {}
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            src[n] = frozenset({n})
        else:
            acc: frozenset[Node] = frozenset()
            for i in n.all_input_nodes:
                acc = acc | src.get(i, frozenset())
            src[n] = acc
    return src


def _zero3_params(gm: GraphModule) -> list[Node]:
    info = gm.meta.get(RANK)
    if info is None:
        return []
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return [ph for ph, p in zip(phs, info.primals) if p.kind == "param" and p.zero_stage == 3]


def _param_gathers(gm: GraphModule, phase: Phase) -> list[Node]:
    """All-gathers (issue nodes) in ``phase`` computed from exactly one ZeRO-3 parameter."""
    params = set(_zero3_params(gm))
    if not params:
        return []
    src = _primal_sources(gm)
    return [
        n
        for n in gm.graph.nodes
        if is_issue(n)
        and n.target is _fc.all_gather_into_tensor.default
        and n.meta.get(PHASE) == phase
        and len(src[n]) == 1
        and next(iter(src[n])) in params
    ]


# ------------------------------------------------------------------------------------------ 1


def regather_zero3_params(gm: GraphModule, ctx: PassContext) -> GraphModule:
    """Gather ZeRO-3 parameters again in backward (see module docstring, 1)."""
    src = _primal_sources(gm)
    copied = 0
    for p in _zero3_params(gm):
        chain = {
            n
            for n in gm.graph.nodes
            if n.op == "call_function" and n.meta.get(PHASE) == Phase.FWD and src[n] == frozenset({p})
        }
        if not any(is_issue(n) for n in chain):
            continue  # used where it lies: nothing gathered, nothing to free
        copied += recompute_in_backward(gm, chain)
    if not copied:
        return gm  # nothing moved: the program's code stands (a recompile costs tens of ms)
    log.info(
        "regather_zero3_params: %d nodes recomputed in backward (the gathered weights are not saved)",
        copied,
    )
    gm.graph.lint()
    gm.recompile()
    return gm


# ------------------------------------------------------------------------------------------ 2


def _fake_of(n: Node) -> torch.Tensor:
    return n.meta["val"]


def bucket_gradients(gm: GraphModule, ctx: PassContext, bucket_bytes: int = BUCKET_BYTES) -> GraphModule:
    """Merge gradient all-reduces into buckets (see module docstring, 2)."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    groups: dict[tuple, list[tuple[Node, Node]]] = {}
    for n, w in gradient_all_reduces(gm):
        val = _fake_of(n.args[0])
        groups.setdefault((n.args[2], val.dtype, val.device), []).append((n, w))
    made = merged = 0
    for members in groups.values():
        buckets: list[list[tuple[Node, Node]]] = [[]]
        size = 0
        sizes = {ar: _fake_of(ar.args[0]).numel() * _fake_of(ar.args[0]).element_size() for ar, _ in members}
        cap = min(bucket_bytes, math.ceil(sum(sizes.values()) / GRADIENT_BUCKETS))
        for ar, w in sorted(members, key=lambda m: order[m[0]]):
            nbytes = sizes[ar]
            if buckets[-1] and size + nbytes > cap:
                buckets.append([])
                size = 0
            buckets[-1].append((ar, w))
            size += nbytes
        for bucket in buckets:
            if len(bucket) < 2:
                continue
            _make_bucket(gm, bucket)
            made += 1
            merged += len(bucket)
    if made:
        log.info("bucket_gradients: %d gradient all-reduces merged into %d buckets", merged, made)
    gm.graph.lint()
    gm.recompile()
    return gm


def _make_bucket(gm: GraphModule, bucket: list[tuple[Node, Node]]) -> None:
    g = gm.graph
    last_ar = bucket[-1][0]
    group = last_ar.args[2]
    ins = [ar.args[0] for ar, _ in bucket]
    fake = [_fake_of(i) for i in ins]
    mode = fake[0].fake_mode if hasattr(fake[0], "fake_mode") else None

    def node(target: Callable, args: tuple, val_fn: Callable) -> Node:
        n = g.call_function(target, args)
        n.meta[PHASE] = Phase.BWD
        if mode is not None:
            with mode:
                n.meta["val"] = val_fn()
        return n

    with g.inserting_before(last_ar):
        flats = [node(aten.reshape.default, (i, [-1]), lambda f=f: f.reshape(-1)) for i, f in zip(ins, fake)]
        total = sum(f.numel() for f in fake)
        cat = node(aten.cat.default, (flats,), lambda: torch.cat([f.reshape(-1) for f in fake]))
        ar = node(_fc.all_reduce.default, (cat, "sum", group), lambda: cat.meta["val"].clone())
        ar.meta[GRAD_MEMBERS] = tuple(tuple(f.shape) for f in fake)
        w = node(_fc.wait_tensor.default, (ar,), lambda: ar.meta["val"].clone())
    offset = 0
    for (old_ar, old_w), f in zip(bucket, fake):
        with g.inserting_after(w):
            piece = node(
                aten.slice.Tensor,
                (w, 0, offset, offset + f.numel()),
                lambda o=offset, f=f: w.meta["val"][o : o + f.numel()],
            )
        with g.inserting_after(piece):
            view = node(
                aten.view.default, (piece, list(f.shape)), lambda p=piece, f=f: p.meta["val"].view(f.shape)
            )
        old_w.replace_all_uses_with(view)
        g.erase_node(old_w)
        g.erase_node(old_ar)
        offset += f.numel()
        _after(view)
    assert offset == total


def _after(n: Node) -> None:
    """Move the views that carry ``n`` to the output (``only_returned``) after it: a gradient's
    all-reduce read through a view (an expert weight's ``transpose``) may have had them before
    the bucket's wait."""
    out = output_node(n.graph.owning_module)
    stack, seen = [u for u in n.users if u is not out], set()
    while stack:
        u = stack.pop(0)
        if u in seen:
            continue
        seen.add(u)
        out.prepend(u)
        stack.extend(v for v in u.users if v is not out)


# ------------------------------------------------------------------------------------------ 3


def _first_use(n: Node, order: dict[Node, int]) -> Node | None:
    """The first node (in program order) reading the wait that completes issue ``n``."""
    users = [u for w in n.users for u in w.users]
    return min(users, key=lambda u: order[u]) if users else None


def _hoist(issue: Node, before: Node, order: dict[Node, int]) -> int:
    """Move ``issue`` and the inputs it alone needs (views of one primal, later than ``before``)
    so they run just before ``before``. Returns the number of nodes moved."""
    chain = []
    stack = [issue]
    while stack:
        n = stack.pop()
        if n.op != "call_function" or order[n] <= order[before]:
            continue
        chain.append(n)
        stack.extend(n.all_input_nodes)
    for n in sorted(chain, key=lambda x: order[x]):
        before.prepend(n)
    return len(chain)


def _layer_of_gather(gm: GraphModule, gather: Node, src: dict[Node, frozenset[Node]]) -> str:
    """The layer a parameter gather belongs to: the outermost repeated module holding the
    parameter (``blocks.3``), or the parameter's own module outside repeated layers."""
    info = gm.meta[RANK]
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    (p,) = src[gather]
    name = info.primals[phs.index(p)].name
    return outer_instance(name.rsplit(".", 1)[0] if "." in name else name)


def prefetch_params(gm: GraphModule, ctx: PassContext) -> GraphModule:
    """Issue each layer's ZeRO-3 gathers while the previous layer computes (see module
    docstring, 3): gathers are grouped by layer, and the groups ordered by first use.

    On gloo too: a layer's gathers in flight at once hit a heap fault of torch's gloo backend
    through the functional op's own path, which ``gather_into_buffers`` (the last pass of the list,
    ``passes.gather_buffers``) avoids by rewriting every gather there. ``tests/test_zero3_prefetch_stress.py``
    (``AUTOPAR_STRESS=1``) and ``examples/stress_zero3_prefetch.py`` are the stress runs that
    would catch it coming back."""
    moved = 0
    src = _primal_sources(gm)
    for phase in (Phase.FWD, Phase.BWD):
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        groups: dict[str, list[Node]] = {}
        for g in _param_gathers(gm, phase):
            if _first_use(g, order) is not None:
                groups.setdefault(_layer_of_gather(gm, g, src), []).append(g)
        layers = sorted(groups.values(), key=lambda gs: min(order[_first_use(g, order)] for g in gs))
        for prev, cur in itertools.pairwise(layers):
            order = {n: i for i, n in enumerate(gm.graph.nodes)}
            target = min((_first_use(g, order) for g in prev), key=lambda u: order[u])
            for g in sorted(cur, key=lambda g: order[g]):
                order = {n: i for i, n in enumerate(gm.graph.nodes)}
                if order[g] > order[target]:
                    moved += _hoist(g, target, order)
    if not moved:
        return gm  # nothing moved: the program's code stands
    log.info("prefetch_params: %d nodes moved to gather each layer's parameters one layer ahead", moved)
    gm.graph.lint()
    gm.recompile()
    return gm


# ------------------------------------------------------------------------------------------ 4


def _returned_tail(w: Node, out: Node) -> set[Node] | None:
    """The nodes between ``w`` and the output when ``w``'s value is only returned, through
    layout-only ops each reading nothing but the tail (else None)."""
    tail: set[Node] = set()
    stack = [w]
    while stack:
        n = stack.pop()
        for u in n.users:
            if u is out:
                continue
            if not layout_only(u):
                return None
            if any(i is not w and i not in tail and i is not n for i in u.all_input_nodes):
                return None
            if u not in tail:
                tail.add(u)
                stack.append(u)
    return tail


def sink_waits(gm: GraphModule, ctx: PassContext) -> GraphModule:
    """Issue collectives early and wait late (see module docstring, 4)."""
    param_gathers = set(_param_gathers(gm, Phase.FWD)) | set(_param_gathers(gm, Phase.BWD))
    raised = sunk = 0
    # Issue early: right after the last producer of the issue's inputs (its tensor, and the sizes
    # of an all-to-all whose splits are read from a tensor: a MoE dispatch).
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    for n in list(gm.graph.nodes):
        if not is_issue(n) or n in param_gathers:
            continue
        src = max(n.all_input_nodes, key=position.__getitem__, default=None)
        if isinstance(src, Node) and src.op != "placeholder" and src.next is not n:
            src.append(n)
            raised += 1
    # Wait late: right before the first user; a wait whose value is only returned (through views
    # and copies: a gradient's reduce-scatter) goes to the end with that tail.
    out = output_node(gm)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for w in [n for n in gm.graph.nodes if is_wait(n)]:
        if not w.users:
            continue
        tail = _returned_tail(w, out)
        if tail is not None:
            for n in [w, *sorted(tail, key=lambda x: order[x])]:
                out.prepend(n)
            sunk += 1
            continue
        first = min(w.users, key=lambda u: order[u])
        if w.next is not first:
            first.prepend(w)
            sunk += 1
    if raised or sunk:
        log.info("sink_waits: %d collectives issued earlier, %d waits moved later", raised, sunk)
    gm.graph.lint()
    gm.recompile()
    return gm


RANK_PASSES = (
    recompute_layers,
    regather_zero3_params,
    offload_activations,
    bucket_gradients,
    prefetch_params,
    sink_waits,
    compress_gradients,
    two_level_reduce,
    gather_into_buffers,
)
"""The rank-program passes, in order (data: ``PlanConfig.disable`` turns any off by name)."""

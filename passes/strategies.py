"""Strategy enumeration: the N-D strategies of every node, each with its per-device cost.

For a mesh with axes ``0..A-1`` a node's N-D strategies are the products of its one-axis
strategies (``autopar.rules``), kept when every tensor it touches divides evenly. Each carries

* ``compute_time`` — forward + backward time of the kernels the local op runs on this device's
  shards (``autopar.cost.compute``, the same kernels ``annotate_cost`` times with global shapes;
  a fusion group's fused kernel at its anchor, nothing at its other members:
  ``autopar.passes.fusion``);
* ``comm_time`` — collectives inside the op (vocabulary-parallel cross-entropy);
* ``memory`` — bytes per device: for a parameter its training state (weight, gradient, optimizer
  state; ``autopar.cost.memory``), for an input its local batch, for an op the activations saved
  for backward (local shapes). An input's ``compute_time`` is writing its local batch into device
  memory.

Two reductions keep the solver small (``NodeStrategies``):

* **followers** — a cheap op (pointwise with one tensor input, view, cast, ``getitem``) whose
  strategy is fully determined by its producer's (no reshard between them) *follows* it: the solver
  gives it no variable of its own (Alpa's "follow" trick).
* **repeated layers** — nodes at the same position of repeated modules (``h.0``, ``h.1``, …) with
  the same op and shapes (and, where fused kernels are assumed, the same role in a like fusion
  group: ``autopar.passes.fusion.fusion_role``) get one strategy list computed once; the solver
  ties them (``autopar.solver``), so solve time barely grows with depth.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from dataclasses import replace

import torch
from torch.fx import GraphModule, Node

from autopar.cost.batch_norm import sync_batch_norm_cost, sync_batch_norm_reduce_cost
from autopar.cost.compute import TensorArg, causal_share, itemsize, kernel_time, memory_time
from autopar.cost.memory import training_state_bytes
from autopar.cost.moe import expert_all_to_all_cost
from autopar.cost.offload import ACTIVATION_WINDOW, host_of, offload_step_time
from autopar.cost.optimizer import optimizer_step_time, plan_settings
from autopar.cost.ring_attention import ring_exposed_time, striped_ring_share
from autopar.graph import OpFamily, op_family, op_info, op_name, outer_instance, tensor_inputs, tensor_outputs
from autopar.ir import COST, STRATEGIES, TENSOR, NodeStrategies, Rewrite, Strategy
from autopar.passes import PassContext, zero_stages
from autopar.passes.annotate import (
    channels_last,
    extra_saved_bytes,
    node_kernels,
    ordered_tensor_args,
    value_is_saved,
)
from autopar.passes.chain_records import CHAIN, compile_assumed
from autopar.passes.formulate import parse_fixed, spec_matches
from autopar.passes.fusion import FUSION, fusion_assumed, fusion_role
from autopar.passes.recompute_ops import recompute_candidate, recompute_twins
from autopar.passes.recompute_rule import offloaded_layers, recomputed, recomputed_layers, repeated_layers
from autopar.placement import Partial, Replicate, Shard, Spec, divides, local_shape, shard_slices
from autopar.reshard import broadcast_chain, repeat_stride
from autopar.rules import AxisStrategy, axis_strategies, block_hints, has_rule
from autopar.rules.base import arg
from autopar.rules.moe_regions import MoERegion, moe_regions, region_strategies

__all__ = [
    "annotate_strategies",
    "getitem_strategies",
    "offloaded_layers",
    "recomputed",
    "recomputed_layers",
    "repeated_layers",
    "tie_key",
    "unruled_ops",
    "with_follow",
]


def tie_key(node: Node, ordinal: dict[Node, int]) -> tuple | None:
    """Nodes with equal keys sit at the same place of repeated layers and can share a choice."""
    info = node.meta.get(TENSOR)
    if info is None or "*" not in info.layer:
        if info is not None and info.kind == "param" and "*" in _pattern(info.fqn):
            return ("param", _pattern(info.fqn), info.shape, info.dtype)
        return None
    shapes = tuple(tuple(i.meta["val"].shape) for i in tensor_inputs(node))
    target = str(node.target) if node.op == "call_function" else node.op
    return (_outer_pattern(info.module), ordinal[node], target, info.shape, shapes)


def _pattern(path: str) -> str:
    import re

    return re.sub(r"\.(\d+)(?=\.|$)", ".*", path)


def _outer_pattern(path: str) -> str:
    inst = outer_instance(path)
    return _pattern(inst)


_SEQUENCE_FORMS = (Rewrite.CAUSAL_QUERIES, Rewrite.RING_ATTENTION)


def _fits_axis(node: Node, c: AxisStrategy, n: int) -> bool:
    """A ring's stripes are made for one ring size (``rules.attention.RING_SIZES``): a striped ring
    runs on the axis of that many devices, one position a stripe (a causal ring is only offered
    striped; a contiguous one is unmasked)."""
    if c.rewrite is not Rewrite.RING_ATTENTION:
        return True
    q = c.inputs[0]
    if n == 1 or not isinstance(q, Shard):
        return False
    return q.blocks == 1 or q.blocks * n == int(node.args[0].meta["val"].shape[q.dim])


def _ring_conflict(node: Node, combo: tuple[AxisStrategy, ...], mesh_shape: tuple[int, ...]) -> bool:
    """A ring on one axis only, and no other axis splitting the queries' sequence: a ring passes
    keys among its own axis's devices and would never see those split along another."""
    seq = len(node.args[0].meta["val"].shape) - 2
    rings = [a for a, c in enumerate(combo) if c.rewrite is Rewrite.RING_ATTENTION]
    others = [
        a
        for a, (c, n) in enumerate(zip(combo, mesh_shape))
        if a not in rings and n > 1 and isinstance(c.inputs[0], Shard) and c.inputs[0].dim == seq
    ]
    return len(rings) > 1 or bool(others)


def _combine(
    node: Node, axis_lists: list[list[AxisStrategy]], mesh_shape: tuple[int, ...]
) -> list[tuple[tuple[AxisStrategy, ...], Strategy]]:
    ins = tensor_inputs(node)
    outs = tensor_outputs(node)
    in_shapes = [tuple(i.meta["val"].shape) for i in ins]
    out_shapes = [tuple(o.shape) for o in outs]
    result = []
    axis_lists = [[c for c in cs if _fits_axis(node, c, n)] for cs, n in zip(axis_lists, mesh_shape)]
    for combo in itertools.product(*axis_lists):
        if any(c.rewrite in _SEQUENCE_FORMS and n == 1 for c, n in zip(combo, mesh_shape)):
            continue  # a query split over one device: the op itself, lowered for nothing
        if any(c.rewrite is Rewrite.RING_ATTENTION for c in combo) and _ring_conflict(
            node, combo, mesh_shape
        ):
            continue
        if len({c.comm for c in combo if c.rewrite is Rewrite.SYNC_BATCH_NORM}) > 1:
            continue  # a batch norm merges its statistics in one form over all its axes
        in_specs = tuple(
            None if combo[0].inputs[j] is None else tuple(c.inputs[j] for c in combo) for j in range(len(ins))
        )
        out_specs = tuple(tuple(c.outputs[j] for c in combo) for j in range(len(outs)))
        ok = all(s is None or _valid(sh, s, mesh_shape) for sh, s in zip(in_shapes, in_specs)) and all(
            _valid(sh, s, mesh_shape) for sh, s in zip(out_shapes, out_specs)
        )
        if not ok:
            continue
        result.append(
            (
                combo,
                Strategy(
                    inputs=in_specs,
                    outputs=out_specs,
                    rewrites=tuple(c.rewrite for c in combo),
                    comms=tuple(c.comm for c in combo),
                    split=tuple(c.split for c in combo),
                ),
            )
        )
    return result


def _zero_variants(node: Node, strategies: list[Strategy], ctx: PassContext) -> list[tuple[None, Strategy]]:
    """A trainable parameter's sharded layouts, once per allowed ZeRO stage (``zero_stages``).

    The stage only matters where a user gathers the parameter; elsewhere the variants cost the same
    and the solver keeps the first (stage 3 first).
    """
    info = node.meta.get(TENSOR)
    if node.op != "placeholder" or info is None or info.kind != "param" or not info.requires_grad:
        return [(None, s) for s in strategies]
    out = []
    for s in strategies:
        if not any(isinstance(p, Shard) for p in s.outputs[0]):
            out.append((None, s))
            continue
        for stage in sorted(zero_stages(ctx.config), reverse=True):
            out.append((None, replace(s, zero_stage=stage)))
    return out


def _valid(shape: tuple[int, ...], spec: Spec, mesh_shape: tuple[int, ...]) -> bool:
    if not divides(shape, spec, mesh_shape):
        return False
    blocked = [p.dim for p in spec if isinstance(p, Shard) and p.blocks > 1]
    sharded = [p.dim for p in spec if isinstance(p, Shard)]
    # A block-sharded dim is sharded on one axis only (keeps the local layout simple).
    return all(sharded.count(d) == 1 for d in blocked)


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> float:
    return float(math.prod(shape)) * torch.empty((), dtype=dtype).element_size()


def _query_share(node: Node, s: Strategy, mesh: tuple[int, ...]) -> bool | float | None:
    """Attention whose queries' sequence this strategy splits over devices (context
    parallelism's all-gather form): what its mask costs on the busiest device; ``None`` where
    the strategy splits no queries (the op's own mask). A causal op (``is_causal``, aligned by the
    local op, ``Rewrite.CAUSAL_QUERIES``) runs each of the device's query pieces against the keys
    up to it, the kernel skipping the masked pairs: the busiest device keeps the largest share of
    its pairs (``cost.compute.causal_share``) — nearly all of them for the last contiguous chunk,
    about half where the queries are split in blocks (``Shard(d, blocks=k)``, striped attention:
    each device holds one piece of every block). An explicit mask split with the queries is read
    by the kernel, nothing skipped: dense (``False``)."""
    if op_family(node) is not OpFamily.ATTENTION or not s.inputs or s.inputs[0] is None:
        return None
    q = node.args[0].meta["val"]
    seq = q.dim() - 2
    axes = [
        a
        for a, (p, n) in enumerate(zip(s.inputs[0], mesh))
        if isinstance(p, Shard) and p.dim == seq and n > 1
    ]
    if not axes:
        return None
    if Rewrite.RING_ATTENTION in s.rewrites:
        return _ring_share(node, s, mesh)
    if Rewrite.CAUSAL_QUERIES not in s.rewrites:
        return False
    shape, keys = tuple(q.shape), int(node.args[1].meta["val"].shape[-2])
    share = 0.0
    for coords in itertools.product(*(range(mesh[a]) for a in axes)):
        coord = [0] * len(mesh)
        for a, c in zip(axes, coords):
            coord[a] = c
        share = max(share, causal_share(keys, shard_slices(shape, s.inputs[0], mesh, coord)[seq]))
    return share


def _ring_axis(s: Strategy) -> int | None:
    return next((a for a, r in enumerate(s.rewrites) if r is Rewrite.RING_ATTENTION), None)


def _ring_share(node: Node, s: Strategy, mesh: tuple[int, ...]) -> bool | float:
    """Ring attention (``Rewrite.RING_ATTENTION``): its keys are priced whole (the ring brings
    them all), the pairs as the busiest device's at each step (``cost.ring_attention``: the
    queries in stripes along the ring's axis, the only axis splitting their sequence)."""
    if not arg(node, "is_causal", False):
        return False
    a = _ring_axis(s)
    assert a is not None
    q = s.inputs[0][a]
    assert isinstance(q, Shard)
    return striped_ring_share(int(node.args[0].meta["val"].shape[-2]), q.blocks, mesh[a])


def _cost_strategy(
    node: Node,
    s: Strategy,
    ctx: PassContext,
    layers: frozenset[str] | None = None,
    offload: frozenset[str] | None = None,
) -> Strategy:
    mesh = ctx.mesh.shape
    info = node.meta[TENSOR]
    outs = tensor_outputs(node)
    if node.op == "placeholder":
        val = node.meta["val"]
        local = local_shape(tuple(val.shape), s.outputs[0], mesh)
        if info.kind == "param":
            numel = float(math.prod(local))
            state = ctx.config.optimizer_state_dtype
            state_on_host = ctx.config.offload_optimizer is True
            # A flat-sharded optimizer state (PlanConfig.state_split) is split over the axes the
            # placement leaves whole.
            flat = math.prod(
                mesh[a]
                for a in ctx.config.state_split.get(info.fqn, ())
                if a < len(mesh) and not isinstance(s.outputs[0][a], (Shard, Partial))
            )
            mem = (
                training_state_bytes(
                    numel,
                    val.element_size(),
                    optimizer=ctx.config.optimizer,
                    mixed_precision=ctx.mixed_precision,
                    state_bytes=itemsize(state) if state is not None else None,
                    optimizer_shards=flat,
                    offload_optimizer=state_on_host,
                )
                if info.requires_grad
                else numel * val.element_size()
            )
            # Its share of the optimizer step (``cost.optimizer``, as the simulator plays it): a
            # sharded or flat-sharded state updates fewer elements. Once per step, so per
            # micro-batch a ``1/m`` share. Without it a replicated weight and its ZeRO-sharded
            # twin cost the solver the same where their collectives do, and it kept the slower.
            if info.requires_grad:
                settings = plan_settings(ctx.config.optimizer, val.element_size(), state)
                if state_on_host:  # the step on the host, its copies over the host link (cost.offload)
                    step = offload_step_time(
                        numel / flat,
                        0,
                        val.element_size(),
                        host_of(ctx.cluster),
                        ctx.cluster.gpus_per_node,
                        settings,
                    ).total
                else:
                    step = optimizer_step_time(
                        numel / flat, 0, val.element_size(), ctx.cluster.device, settings
                    )
                return replace(
                    s, compute_time=step / ctx.config.microbatches_per_sync, comm_time=0.0, memory=mem
                )
        else:
            mem = _nbytes(local, val.dtype)
        # A user input is written into each device's memory every step: a device given only its
        # shard of the batch loads less (without this, replicated and sharded inputs would tie).
        load = memory_time(mem, ctx.cluster.device) if info.kind == "input" else 0.0
        return replace(s, compute_time=load, comm_time=0.0, memory=mem)
    cost = node.meta.get(COST)
    if cost is None:
        return s
    divisor = math.prod(n for n, sp in zip(mesh, s.split) if sp)
    ins = tensor_inputs(node)
    # The op's kernels on this device's shards (autopar.cost.compute): a GEMM whose reduction
    # dimension is split runs at the efficiency of its shorter K, not at 1/divisor of the time.
    spec_of = dict(zip(ins, s.inputs))
    ring = _ring_axis(s)
    if ring is not None:  # the ring brings every key and value: priced whole along its axis
        for kv in node.args[1:3]:
            whole = list(spec_of[kv])
            whole[ring] = Replicate()
            spec_of[kv] = tuple(whole)
    args = []
    for a in ordered_tensor_args(node):
        v = a.meta["val"]
        spec = spec_of.get(a)
        shape = local_shape(tuple(v.shape), spec, mesh) if spec is not None else tuple(v.shape)
        args.append(
            TensorArg(
                shape, str(v.dtype).replace("torch.", ""), _requires_grad(a), channels_last=channels_last(v)
            )
        )
    local_outs = [
        TensorArg(local_shape(tuple(o.shape), spec, mesh), str(o.dtype).replace("torch.", ""))
        for o, spec in zip(outs, s.outputs)
    ]
    fused = fusion_assumed(ctx)
    compiled = compile_assumed(ctx)
    ks = node_kernels(
        node,
        args,
        local_outs,
        fused=fused,
        tf32=ctx.config.matmul_tf32,
        compiled=compiled,
        causal=_query_share(node, s, mesh),
    )
    dev = ctx.cluster.device
    fwd = sum(kernel_time(k, dev) for k in ks.fwd)
    bwd = sum(kernel_time(k, dev) for k in ks.bwd)
    layout_fwd = sum(kernel_time(k, dev) for k in ks.fwd if k.tensor_cores)
    layout = layout_fwd + sum(kernel_time(k, dev) for k in ks.bwd if k.tensor_cores)
    comm = 0.0
    for a, c in enumerate(s.comms):
        if c.startswith("all_reduce:"):
            count = int(c.split(":")[1])
            rows = math.prod(local_shape(tuple(outs[0].shape), s.outputs[0], mesh)) if outs[0].dim() else 1
            x_local = local_shape(tuple(ins[0].meta["val"].shape), s.inputs[0], mesh)
            rows = x_local[0] if x_local else rows
            comm += count * ctx.mesh.all_reduce_cost(rows * 4.0, a)
        elif c == "ring_attention":  # keys and values passed around the axis (cost.ring_attention)
            # repeated heads (grouped-query attention) travel once each: ``reshard.repeat_stride``
            kv = 0.0
            for x in node.args[1:3]:
                spec = s.inputs[ins.index(x)]
                t = x.meta["val"]
                stride = repeat_stride(broadcast_chain(x), spec, mesh)
                kv += _nbytes(local_shape(tuple(t.shape), spec, mesh), t.dtype) / stride
            comm += sum(ring_exposed_time(mesh[a], kv, fwd, bwd, lambda b, a=a: ctx.mesh.p2p_cost(b, a)))
        elif c == "sync_batch_norm":  # statistics gathered over the rows' devices (cost.batch_norm)
            x = ins[0]
            channels = local_shape(tuple(x.meta["val"].shape), s.inputs[0], mesh)[1]
            before = math.prod(mesh[b] for b in range(a) if s.comms[b] == "sync_batch_norm")
            comm += sync_batch_norm_cost(
                ctx.mesh, a, channels, before=before, requires_grad=_requires_grad(x)
            )
        elif c == "sync_batch_norm_reduce":  # or all-reduced in two passes (cost.batch_norm)
            x = ins[0]
            channels = local_shape(tuple(x.meta["val"].shape), s.inputs[0], mesh)[1]
            comm += sync_batch_norm_reduce_cost(ctx.mesh, a, channels, requires_grad=_requires_grad(x))
        elif c.startswith("moe_"):  # a grouped matmul over this device's experts (rules.routing)
            x, w = ins[0], ins[1]
            xb = _nbytes(local_shape(tuple(x.meta["val"].shape), s.inputs[0], mesh), x.meta["val"].dtype)
            ob = _nbytes(local_shape(tuple(outs[0].shape), s.outputs[0], mesh), outs[0].dtype)
            comm += expert_all_to_all_cost(
                ctx.mesh,
                a,
                rows_in_bytes=xb,
                rows_out_bytes=ob,
                dispatch="dispatch" in c,
                combine="combine" in c,
                num_experts=int(w.meta["val"].shape[0]),
                requires_grad=info.requires_grad,
            )
    mem = 0.0
    if value_is_saved(node):
        mem += sum(_nbytes(local_shape(tuple(o.shape), sp, mesh), o.dtype) for o, sp in zip(outs, s.outputs))
    mem += extra_saved_bytes(node, fused) / divisor
    if recomputed(node, ctx.config.recompute, layers):  # its forward runs again in backward; nothing saved
        return replace(
            s, compute_time=2 * fwd + bwd, comm_time=2 * comm, memory=0.0, layout_time=layout + layout_fwd
        )
    if offload and mem > 0 and outer_instance(info.module) in offload:
        # saved on the host; one offloaded layer's worth counted on the device (cost.offload)
        share = ACTIVATION_WINDOW / len(offload)
        return replace(
            s, compute_time=fwd + bwd, comm_time=comm, memory=mem * share, offloaded=mem, layout_time=layout
        )
    return replace(s, compute_time=fwd + bwd, comm_time=comm, memory=mem, layout_time=layout)


def _requires_grad(node: Node) -> bool:
    info = node.meta.get(TENSOR)
    return info is not None and info.requires_grad


def annotate_strategies(gm: GraphModule, ctx: PassContext) -> GraphModule:
    """Write ``NodeStrategies`` on every tensor-producing node (see module docstring)."""
    mesh = ctx.mesh.shape
    hints = block_hints(gm.graph)
    fused = fusion_assumed(ctx)
    # Ordinal of each node inside its outermost repeated-layer instance.
    counters: dict[str, int] = defaultdict(int)
    ordinal: dict[Node, int] = {}
    for node in gm.graph.nodes:
        info = node.meta.get(TENSOR)
        if info is not None and info.module:
            inst = outer_instance(info.module)
            ordinal[node] = counters[inst]
            counters[inst] += 1
    cache: dict[tuple, NodeStrategies] = {}
    axis_cache: dict[Node, list[AxisStrategy]] = {}
    region_of = {m: r for r in moe_regions(gm.graph) for m in r.members}
    # Some layers recomputed, the others not: the two kinds tie only among themselves.
    layers = None
    if ctx.config.recompute in ("selective", "full", "ops"):
        layers = recomputed_layers(gm.graph, ctx.config.recompute_layers)
    per_op = ctx.config.recompute == "ops"  # candidates get recomputed twins (passes.recompute_ops)
    # Layers whose saved activations go to the host tie only among themselves, too.
    offload = offloaded_layers(gm.graph, ctx.config.offload_activations)
    # the layouts a parameter or input is held to survive the cut to ``max_strategies``
    fixed = parse_fixed(ctx.captured, ctx.config, len(mesh)) if ctx.captured is not None else {}
    for node in gm.graph.nodes:
        info = node.meta.get(TENSOR)
        if info is None:
            continue
        want = fixed.get(info.fqn) if node.op == "placeholder" and info.fqn else None
        if node.op == "call_function" and op_name(node) == "getitem":
            if node.args[0].meta.get(STRATEGIES) is not None:
                node.meta[STRATEGIES] = getitem_strategies(node)
            continue
        if node in region_of:
            _region_member(node, region_of[node], ordinal, cache, ctx, layers, offload)
            continue
        key = tie_key(node, ordinal)
        if key is not None and layers is not None and info.module:
            key = (*key, outer_instance(info.module) in layers)
        if key is not None and offload and info.module:
            key = (*key, "offloaded", outer_instance(info.module) in offload)
        if key is not None and fused and FUSION in node.meta:  # tied only to members of like groups
            key = (*key, fusion_role(node))
        if key is not None and CHAIN in node.meta:  # tied only to members of like chains
            key = (*key, node.meta[CHAIN].key())
        if key is not None and want is not None:
            key = (*key, "fixed", want)
        twins = per_op and recompute_candidate(node, layers)
        if key is not None and per_op:
            key = (*key, "candidate", twins)
        hkey = tuple(sorted(hints.get(node, ())))
        if key is not None and (key, hkey) in cache:
            ns = cache[(key, hkey)]
        else:
            axis = axis_strategies(node, hints)
            axis_cache[node] = axis
            combos = _combine(node, [axis] * len(mesh), mesh)
            strategies = [
                _cost_strategy(node, s, ctx, layers, offload)
                for _, s in _zero_variants(node, [s for _, s in combos], ctx)
            ]
            if len(strategies) > ctx.config.max_strategies:
                head, rest = (
                    strategies[:1],
                    sorted(strategies[1:], key=lambda s: s.compute_time + s.comm_time),
                )
                holds = [
                    want is not None and bool(s.outputs) and spec_matches(s.outputs[0], want) for s in rest
                ]
                held = [s for s, h in zip(rest, holds) if h]
                rest = [s for s, h in zip(rest, holds) if not h]
                strategies = head + held + rest[: max(0, ctx.config.max_strategies - 1 - len(held))]
            if twins:
                strategies = recompute_twins(node, strategies)
            ns = NodeStrategies(tuple(strategies))
            if key is not None:
                cache[(key, hkey)] = ns
        node.meta[STRATEGIES] = with_follow(node, ns)
        if key is not None:
            node.meta["autopar.tie"] = (key, hkey)
    return gm


def _region_member(
    node: Node,
    region: MoERegion,
    ordinal: dict[Node, int],
    cache: dict[tuple, NodeStrategies],
    ctx: PassContext,
    layers: frozenset[str] | None = None,
    offload: frozenset[str] | None = None,
) -> None:
    """A mixture-of-experts region's member: its strategies are one per assignment of modes to the
    mesh axes (``autopar.rules.routing``), in the same order for every member, which follows the
    region's leader (the sort) one to one. Repeated layers' regions share the lists."""
    key = ("moe", tie_key(region.leader, ordinal), region.members.index(node))
    info = node.meta.get(TENSOR)
    if layers is not None and info is not None and info.module:
        key = (*key, outer_instance(info.module) in layers)
    if offload and info is not None and info.module:
        key = (*key, "offloaded", outer_instance(info.module) in offload)
    ns = cache.get(key) if key[1] is not None else None
    if ns is None:
        built = region_strategies(region, ctx.mesh.shape)[node]
        ns = NodeStrategies(tuple(_cost_strategy(node, s, ctx, layers, offload) for s in built))
        if key[1] is not None:
            cache[key] = ns
    if node is region.leader:
        node.meta[STRATEGIES] = ns
        if key[1] is not None:
            node.meta["autopar.tie"] = (key, ())
    else:
        node.meta[STRATEGIES] = NodeStrategies(
            ns.strategies, follows=region.leader.name, follow_map=tuple(range(len(ns.strategies))), bound=True
        )


def unruled_ops(gm: GraphModule) -> list[str]:
    """Ops of ``gm`` that have tensor inputs and outputs but no sharding rule (they run replicated).
    Factories (arange, zeros, ...) have nothing to shard from and are not listed."""
    return sorted(
        {
            op_name(n)
            for n in gm.graph.nodes
            if n.op == "call_function" and not has_rule(n) and tensor_outputs(n) and tensor_inputs(n)
        }
    )


def getitem_strategies(node: Node) -> NodeStrategies:
    """``getitem`` of a multi-output op: one strategy per producer strategy, passing its output on."""
    src = node.args[0]
    ns = src.meta[STRATEGIES]
    out_i = _output_position(src, node.args[1])
    n_axes = len(ns.strategies[0].split) if ns.strategies else 0
    strategies = tuple(
        Strategy(
            inputs=(s.outputs[out_i],),
            outputs=(s.outputs[out_i],),
            rewrites=(Rewrite.NONE,) * n_axes,
            comms=("",) * n_axes,
            split=(False,) * n_axes,
        )
        for s in ns.strategies
    )
    return NodeStrategies(strategies, follows=src.name, follow_map=tuple(range(len(strategies))))


def _output_position(src: Node, idx: int) -> int:
    val = src.meta.get("val")
    pos = 0
    for i, v in enumerate(val):
        if i == idx:
            return pos
        if isinstance(v, torch.Tensor):
            pos += 1
    return pos


def with_follow(node: Node, ns: NodeStrategies) -> NodeStrategies:
    """Make a cheap one-input op follow its producer: its choice becomes a function of the producer's.

    For each producer
    strategy the follower takes the cheapest of its strategies that reads that producer's output
    as it is (no reshard on that edge); when some producer strategy has no such match the node
    keeps its own variables. Alpa's "follow" heuristic; other inputs keep ordinary edges.

    A recomputation candidate (``passes.recompute_ops``) keeps its own variables: following, it
    would take the cheapest strategy, never its recomputed twin.

    Only an op with one user whose output is no larger than its input follows: a reshard moved
    past a follower is then paid once on the same bytes. With several users it would be paid on
    each of their edges (a residual stream cast once and read by a norm and an add), and past a
    broadcast (``expand`` of a rotary table) on the larger tensor; there the follower keeps its
    own variables. Following regardless cost 8–27 % on LLaMA-8B's plans.
    """
    if node.op != "call_function" or len(ns.strategies) <= 1 or len(node.users) != 1:
        return ns
    if ns.strategies[-1].recomputed:  # a recomputation candidate decides for itself
        return ns
    name = op_name(node)
    if not op_info(name).cheap:
        return ns
    ins = tensor_inputs(node)
    candidates = [
        (j, i)
        for j, i in enumerate(ins)
        if i.meta.get(STRATEGIES) is not None and i.meta[TENSOR].kind not in ("param", "input", "buffer")
    ]
    if not candidates or len(ins) != 1:
        return ns
    j, producer = max(candidates, key=lambda ji: math.prod(ji[1].meta[TENSOR].shape))
    if math.prod(node.meta[TENSOR].shape) > math.prod(producer.meta[TENSOR].shape):
        return ns  # a broadcast: resharding its small input beats resharding its output
    pns = producer.meta[STRATEGIES]
    # The cheapest strategy reading each input spec (the first of equals), then one per producer
    # strategy: by dictionary rather than comparing every pair of specs.
    cheapest: dict[tuple, tuple[float, int]] = {}
    for k, s in enumerate(ns.strategies):
        dst = s.inputs[j]
        if dst is None:
            continue
        c = s.compute_time + s.comm_time
        if dst not in cheapest or c < cheapest[dst][0]:
            cheapest[dst] = (c, k)
    fmap = []
    for ps in pns.strategies:
        hit = cheapest.get(ps.outputs[0])
        if hit is None:
            return ns
        fmap.append(hit[1])
    return NodeStrategies(ns.strategies, follows=producer.name, follow_map=tuple(fmap))

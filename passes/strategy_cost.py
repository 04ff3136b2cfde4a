"""The cost of one N-D strategy of one node on this device (``annotate_strategies`` writes it on
every strategy it enumerates, ``autopar.passes.strategies``):

* ``compute_time`` — forward + backward time of the kernels the local op runs on this device's
  shards (``autopar.cost.compute``), attention's by the share of its (query, key) pairs the
  busiest device keeps where the queries' sequence is split (context parallelism: gathered keys,
  causal pieces, a striped ring); a parameter's, its share of the optimizer step; an input's,
  writing its local batch into device memory;
* ``comm_time`` — collectives inside the op (vocabulary-parallel cross-entropy's all-reduces, the
  ring's exposed passing, synchronized batch norm, expert all-to-alls);
* ``memory`` — bytes per device: a parameter's training state, an input's local batch, an op's
  activations saved for backward (none where it is recomputed; a window's share where its layer is
  offloaded).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import torch
from torch.fx import Node

from autopar.cost.batch_norm import sync_batch_norm_cost, sync_batch_norm_reduce_cost
from autopar.cost.compute import TensorArg, causal_share, itemsize, kernel_time, memory_time
from autopar.cost.memory import training_state_bytes
from autopar.cost.moe import expert_all_to_all_cost
from autopar.cost.offload import ACTIVATION_WINDOW, host_of, offload_step_time
from autopar.cost.optimizer import optimizer_step_time, plan_settings
from autopar.cost.ring_attention import ring_exposed_time, striped_ring_share
from autopar.graph import OpFamily, op_family, outer_instance, tensor_inputs, tensor_outputs
from autopar.ir import COST, TENSOR, Rewrite, Strategy
from autopar.passes import PassContext
from autopar.passes.annotate import (
    channels_last,
    extra_saved_bytes,
    node_kernels,
    ordered_tensor_args,
    value_is_saved,
)
from autopar.passes.chain_records import compile_assumed
from autopar.passes.fusion import fusion_assumed
from autopar.passes.recompute_rule import recomputed
from autopar.placement import Partial, Replicate, Shard, local_shape, shard_slices
from autopar.reshard import broadcast_chain, repeat_stride
from autopar.rules.base import arg

__all__ = ["cost_strategy"]


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


def cost_strategy(
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

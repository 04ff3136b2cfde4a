"""The single-device eager training step of an annotated graph (``annotate_tensors`` and
``annotate_cost`` of ``autopar.passes.annotate``): ``single_device_step`` walks the graph as one
eager step runs it — the host issuing ops, the device running their kernels, tensors allocated and
freed in forward, kept for backward (``autopar.passes.annotate``'s **saved** and **storage**),
gradients created and freed in backward, the optimizer step — and returns the step's time and peak
memory (``autopar.cost.step``). The reference measurements (``autopar.reference``) are predicted
with it.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch
from torch.fx import GraphModule, Node

from autopar.cost.compute import OpKernels, kernel_time, runs_on
from autopar.cost.memory import state_bytes_per_param
from autopar.cost.optimizer import OptimizerSettings, optimizer_step_time
from autopar.cost.step import MemoryTrace, StepEstimate, eager_time
from autopar.graph import OpFamily, op_family, op_name
from autopar.ir import TENSOR
from autopar.passes import PassContext
from autopar.passes.annotate import (
    extra_saved_bytes,
    grad_flows,
    is_alias,
    node_kernels,
    ordered_tensor_args,
    saved_inputs,
    saves_output,
    storage_views,
    tensor_bytes,
)

__all__ = ["StepOptions", "single_device_step"]


StepOptions = OptimizerSettings
"""How the single-device step is run: its optimizer's settings (the reference measurement's setup
by default)."""


def _pass_through(node: Node, i: Node) -> bool:
    """Backward hands ``node``'s output gradient to input ``i`` unchanged (no new tensor)."""
    name = op_name(node)
    fam = op_family(node)
    if name in ("expand", "slice", "narrow", "select", "split", "split_with_sizes", "chunk", "unbind"):
        return False
    if fam is OpFamily.VIEW and (is_alias(node) or name in ("cat", "concat", "stack")):
        return True
    if name in ("contiguous", "clone", "alias", "detach", "getitem") or (
        name in ("to", "_to_copy", "type_as") and is_alias(node)
    ):
        return True
    if name in ("add", "add_", "sub", "sub_"):
        args = ordered_tensor_args(node)
        same = i.meta["val"].shape == node.meta["val"].shape
        return same and (name.startswith("add") or (args and args[0] is i))
    return False


def _bwd_workspace(node: Node) -> float:
    """Bytes a node's backward holds besides the gradients it returns."""
    fam = op_family(node)
    args = ordered_tensor_args(node)
    if fam is OpFamily.ATTENTION and args and grad_flows(args[0]):
        return 4.0 * math.prod(args[0].meta["val"].shape)  # dQ accumulated in fp32
    if fam is OpFamily.LOSS and op_name(node) != "mse_loss" and args:
        return tensor_bytes(args[0].meta["val"])  # the log-probabilities' gradient
    return 0.0


def single_device_step(gm: GraphModule, ctx: PassContext, options: StepOptions | None = None) -> StepEstimate:
    """One eager training step of the annotated graph on one device of ``ctx.cluster``: forward,
    ``loss.backward()``, ``optimizer.step()`` (module docstring; ``autopar.cost.step``).

    What it models: every op of the captured graph and the kernels eager PyTorch runs for it
    forward and backward, the host's time to issue them, autograd's gradient additions, the
    optimizer update; memory as allocated and freed in that order, gradients set to ``None``
    between steps (``zero_grad()``'s default), optimizer state present (a step after the first).
    What it does not: ops hidden inside higher-order ops (their outputs are costed as one write),
    the caching allocator's fragmentation, and anything outside the graph (data loading, logging).
    """
    opts = options or StepOptions(optimizer=ctx.config.optimizer, master_weights=ctx.mixed_precision)
    device = ctx.cluster.device
    nodes = list(gm.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}

    # -- training state and inputs: alive throughout
    params = [
        n for n in nodes if n.op == "placeholder" and TENSOR in n.meta and n.meta[TENSOR].kind == "param"
    ]
    trainable = [p for p in params if p.meta[TENSOR].requires_grad]
    param_bytes = sum(tensor_bytes(p.meta["val"]) for p in params)
    numel = sum(float(math.prod(p.meta["val"].shape)) for p in trainable)
    pbytes = trainable[0].meta["val"].element_size() if trainable else 4
    sb = state_bytes_per_param(
        pbytes, optimizer=opts.optimizer, master_weights=opts.master_weights, state_bytes=opts.state_bytes
    )
    state = numel * sb.optimizer
    resident = sum(
        tensor_bytes(n.meta["val"])
        for n in nodes
        if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor)
    )
    mem = MemoryTrace(resident + state)

    # -- storages: owner, bytes, last forward use, savers
    owner: dict[Node, Node] = {}
    for n in nodes:
        if isinstance(n.meta.get("val"), torch.Tensor) and n not in owner:
            for a in storage_views(n):
                owner.setdefault(a, n)
    last_use: dict[Node, int] = {}
    savers: dict[Node, list[Node]] = defaultdict(list)
    outputs: set[Node] = set()
    for n in nodes:
        if n.op == "output":
            outputs |= {owner.get(i, i) for i in n.all_input_nodes}
            continue
        for i in n.all_input_nodes:
            o = owner.get(i)
            if o is not None:
                last_use[o] = max(last_use.get(o, 0), index[n])
        for i in saved_inputs(n):
            o = owner.get(i)
            if o is not None and o.op != "placeholder":
                savers[o].append(n)
        if saves_output(n) and grad_flows(n) and n in owner:
            savers[owner[n]].append(n)
    release_at: dict[Node, list[Node]] = defaultdict(list)  # backward node -> storages it frees
    for o, ss in savers.items():
        release_at[min(ss, key=index.__getitem__)].append(o)

    # -- forward
    events: list[tuple[float, float]] = []
    kernels = 0
    fwd_dev = 0.0
    bwd_kernels: dict[Node, OpKernels] = {}
    frees: dict[int, list[Node]] = defaultdict(list)
    for o, i in last_use.items():
        if o.op != "placeholder" and o not in savers and o not in outputs:
            frees[i].append(o)
    for n in nodes:
        if n.op != "call_function":
            continue
        ks = node_kernels(n, tf32=ctx.config.matmul_tf32)
        ks = OpKernels(  # a layout change this device never runs is no launch either
            tuple(k for k in ks.fwd if runs_on(k, device)), tuple(k for k in ks.bwd if runs_on(k, device))
        )
        bwd_kernels[n] = ks
        dev = sum(kernel_time(k, device) for k in ks.fwd)
        fwd_dev += dev
        kernels += len(ks.fwd)
        events.append((device.host_overhead, dev))
        if owner.get(n) is n and isinstance(n.meta.get("val"), torch.Tensor):
            mem.alloc(tensor_bytes(n.meta["val"]), f"forward of {n.name}")
        elif owner.get(n) is None:  # a multi-output op: its results own themselves (getitem)
            pass
        mem.alloc(extra_saved_bytes(n), f"forward of {n.name}")
        if op_family(n) is OpFamily.LOSS and op_name(n) != "mse_loss":
            ws = _bwd_workspace(n)  # the log-probabilities, made and then kept as the saved value
            mem.alloc(ws, f"forward of {n.name}")
            mem.free(ws)
        for o in frees.get(index[n], ()):
            mem.free(tensor_bytes(o.meta["val"]))
    t_fwd, host_fwd = eager_time(events)
    activations = sum(tensor_bytes(o.meta["val"]) for o in savers) + sum(extra_saved_bytes(n) for n in nodes)

    # -- backward: reverse order, gradients as refcounted tensors
    live: dict[int, list[float]] = {}
    grads: dict[Node, list[int]] = defaultdict(list)
    counter = iter(range(1 << 62))

    def new(nbytes: float, what: str) -> int:
        t = next(counter)
        live[t] = [nbytes, 1]
        mem.alloc(nbytes, what)
        return t

    def unref(t: int) -> None:
        live[t][1] -= 1
        if live[t][1] == 0:
            mem.free(live.pop(t)[0])

    for o in outputs:  # loss.backward(): only the scalar loss gets a gradient
        if grad_flows(o) and math.prod(o.meta["val"].shape) == 1:
            grads[o].append(new(tensor_bytes(o.meta["val"]), "loss gradient"))
    param_grad: dict[Node, int] = {}
    bwd_events: list[tuple[float, float]] = []
    bwd_dev = 0.0
    for n in reversed(nodes):
        if n.op == "placeholder" and n in grads:
            ts = grads.pop(n)  # AccumulateGrad: the first becomes .grad, the others are added in
            for t in ts:
                if n not in param_grad:
                    param_grad[n] = t
                else:
                    unref(t)
            continue
        if n.op != "call_function" or not grad_flows(n):
            for o in release_at.pop(n, ()):
                mem.free(tensor_bytes(o.meta["val"]))
            continue
        ts = grads.pop(n, [])
        what = f"backward of {n.name}"
        ks = bwd_kernels[n]
        if ts:
            dev = sum(kernel_time(k, device) for k in ks.bwd)
            bwd_dev += dev
            kernels += len(ks.bwd)
            bwd_events.extend((device.host_overhead, kernel_time(k, device)) for k in ks.bwd)
            for t in ts[1:]:  # accumulated into the first
                unref(t)
            g = ts[0]
            ws = new(_bwd_workspace(n), what)
            ins = [n.args[0]] if op_name(n) == "getitem" else ordered_tensor_args(n)
            for i in dict.fromkeys(ins):
                if not grad_flows(i):
                    continue
                if _pass_through(n, i):
                    live[g][1] += 1
                    grads[i].append(g)
                else:
                    grads[i].append(new(tensor_bytes(i.meta["val"]), what))
            unref(ws)
            unref(g)
        mem.free(extra_saved_bytes(n))
        for o in release_at.pop(n, ()):
            mem.free(tensor_bytes(o.meta["val"]))
    t_all, host_all = eager_time(bwd_events, start=t_fwd)
    host_all = max(host_all, host_fwd)
    backward = max(t_all, host_all) - t_fwd
    grad_bytes = sum(live[t][0] for t in set(param_grad.values()) if t in live)

    # -- optimizer step: parameters, gradients and state alive; foreach keeps a denominator list
    if not opts.fused and opts.optimizer in ("adam", "adamw"):
        mem.alloc(numel * opts.moment_bytes(pbytes), "optimizer step (foreach denominators)")
    opt_time = optimizer_step_time(numel, len(trainable), pbytes, device, opts)
    return StepEstimate(
        forward=max(t_fwd, host_fwd),
        backward=backward,
        optimizer=opt_time,
        peak_memory=mem.peak,
        peak_at=mem.where,
        parameters=param_bytes,
        gradients=grad_bytes,
        optimizer_state=state,
        activations=activations,
        kernels=kernels,
        device_time=fwd_dev + bwd_dev,
        host_time=host_all,
    )

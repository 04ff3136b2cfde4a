"""The rank-program side of fusion: ``fuse_kernels`` replaces each group of this rank's forward
program by a call of its fused kernel (``autopar.program.kernels``), where the kernels run; a
linear's bias that moves into ``bias_gelu`` is taken off the GEMM."""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.fx import GraphModule, Node

from autopar.graph import op_name
from autopar.ir import FusionKind
from autopar.passes import PassContext
from autopar.passes.fusion.annotate_groups import left_eager
from autopar.passes.fusion.find_groups import find_fusions, fusion_counts
from autopar.passes.fusion.matching import (
    FUSION,
    FusionGroup,
    is_assert,
    value_of,
)
from autopar.program import local_ops as O

log = logging.getLogger("autopar.passes")

_REDUCTIONS = {0: "none", 1: "mean", 2: "sum"}
"""``aten`` loss reductions by number, as the kernels name them."""


def _kernels() -> Any:
    import autopar.program.kernels as K

    return K


def _device_of(gm: GraphModule) -> torch.device | None:
    for n in gm.graph.nodes:
        v = value_of(n)
        if n.op == "placeholder" and v is not None and v.is_floating_point():
            return v.device
    return None


def kernels_run(device: torch.device, config: Any) -> bool:
    """Whether ``fuse_kernels`` fuses a program running on ``device``: the kernels run there
    (``autopar.program.kernels.available``), natively (CUDA), or under Triton's interpreter on the
    CPU when ``config.interpret_kernels`` asks for it."""
    try:
        K = _kernels()
    except ImportError:
        return False
    if device.type == "cpu" and not config.interpret_kernels:
        return False
    return K.available(device)


def _why_not(gm: GraphModule, config: Any) -> str:
    """Why the fused kernels cannot run for ``gm`` ("" when they can)."""
    try:
        K = _kernels()
    except ImportError as e:
        return f"autopar.program.kernels is not importable ({e})"
    device = _device_of(gm)
    if device is not None and device.type == "cpu" and not config.interpret_kernels:
        return (
            "on the CPU the eager ops stay (the kernels would run under Triton's interpreter: "
            "interpret_kernels=True asks for that)"
        )
    unavailable = (
        "the kernels do not run {} (they need a CUDA device with Triton, or Triton's interpreter: "
        "TRITON_INTERPRET=1 before triton is imported); the eager ops stay"
    )
    if device is None:
        if not (K.available("cpu") or (torch.cuda.is_available() and K.available("cuda"))):
            return unavailable.format("on this machine")
        return "the program's values are not known (no meta['val']: propagate them first)"
    if not K.available(device):
        return unavailable.format(f"on {device.type} here")
    return ""


def _call(K: Any, g: FusionGroup, ins: list[Node | None], old: Node) -> tuple[Callable, tuple, dict, int]:
    """``(function, args, kwargs, outputs)`` of the fused call replacing group ``g``."""
    k = g.kind
    if k is FusionKind.ADD_LAYER_NORM:
        return K.add_layer_norm, (*ins, g.eps), {}, 2
    if k is FusionKind.ADD_RMS_NORM:
        return K.add_rms_norm, (*ins, g.eps), {}, 2
    if k is FusionKind.BIAS_GELU:
        return K.bias_gelu, (*ins, g.approximate), {}, 1
    if k is FusionKind.SWIGLU:
        return K.swiglu, tuple(ins), {}, 1
    if k is FusionKind.ROTARY:
        return K.rotary, tuple(ins), {}, 2
    if g.lowered:  # the lowering's call, with the fused kernels inside
        kw = {key: v for key, v in old.kwargs.items()}
        kw["fused"] = True
        return O.sharded_cross_entropy, tuple(ins), kw, 1
    return K.cross_entropy, (*ins, g.ignore_index, _REDUCTIONS[g.reduction]), {}, 1


_COPIED_META = ("autopar.source", "autopar.stage", "custom", "nn_module_stack", "stack_trace")


def _rewrite(
    gm: GraphModule, g: FusionGroup, by_name: dict[str, Node], repl: dict[Node, Node], K: Any
) -> bool:
    """Replace group ``g`` by its fused call; False (nothing changed) when the call cannot be
    placed after its inputs and before the first reader of its outputs."""
    graph = gm.graph

    def now(n: Node) -> Node:
        while n in repl:
            n = repl[n]
        return n

    members = [by_name[m] for m in g.members]
    inside = set(members)
    ins = [now(by_name[i]) if i is not None else None for i in g.inputs]
    outs = [[by_name[o] for o in out] for out in g.outputs]
    order = {n: i for i, n in enumerate(graph.nodes)}
    readers = [r for out in outs for o in out for r in o.users if r not in inside]
    point = min(readers, key=order.__getitem__) if readers else members[-1].next
    if any(i is not None and order[i] >= order[point] for i in ins):
        return False
    anchor = by_name[g.anchor]
    fn, args, kwargs, n_out = _call(K, g, ins, by_name[g.outputs[0][0]])
    if g.split_bias:  # the GEMM runs without its bias, which the fused op adds
        mm = by_name[g.split_bias]
        if op_name(mm) == "linear":
            mm.args = mm.args[:2]
            mm.kwargs = {}
        else:
            mm.target = torch.ops.aten.mm.default
            mm.args = (mm.args[1], mm.args[2])
            mm.kwargs = {}
    with graph.inserting_before(point):
        fused = graph.call_function(fn, args, kwargs)
        gets = (
            [graph.call_function(operator.getitem, (fused, i)) for i in range(n_out)]
            if n_out > 1
            else [fused]
        )
    for node in (fused, *gets):
        node.meta.update({k: anchor.meta[k] for k in _COPIED_META if k in anchor.meta})
        node.meta[FUSION] = g
    vals = [value_of(out[0]) if out else value_of(ins[0]) for out in outs]
    if n_out > 1:
        for gn, v in zip(gets, vals):
            if v is not None:
                gn.meta["val"] = v
        fused.meta["val"] = tuple(vals)
    elif vals[0] is not None:
        fused.meta["val"] = vals[0]
    for out, gn in zip(outs, gets):
        for o in out:
            for r in list(o.users):
                if r not in inside:
                    r.replace_input_with(o, gn)
            repl[o] = gn
    for gn in gets:
        if gn is not fused and not gn.users:
            graph.erase_node(gn)
    for m in sorted(members, key=order.__getitem__, reverse=True):
        for u in list(m.users):
            if is_assert(u):
                graph.erase_node(u)
        graph.erase_node(m)
    return True


def apply_fusions(gm: GraphModule, groups: Sequence[FusionGroup]) -> list[FusionGroup]:
    """Replace each group of ``gm`` by a call of its fused kernel (``autopar.program.kernels``);
    returns the groups replaced (a group whose call cannot be placed is left as it is)."""
    K = _kernels()
    by_name = {n.name: n for n in gm.graph.nodes}
    repl: dict[Node, Node] = {}
    done = [g for g in groups if _rewrite(gm, g, by_name, repl, K)]
    gm.graph.lint()
    gm.recompile()
    return done


def fuse_kernels(gm: GraphModule, ctx: PassContext) -> GraphModule:
    """Rank-program pass: replace every fusible group of this rank's forward program by its fused
    kernel (module docstring), where the kernels run; log the groups fused per kind, or why the
    program stays as it is. The program's values must be known (``meta["val"]``:
    ``autopar.passes.rank_compiler.propagate_fake``)."""
    why = _why_not(gm, ctx.config)
    if why:
        log.info("pass fuse_kernels: program unchanged: %s", why)
        return gm
    groups, eager = left_eager(find_fusions(gm.graph), ctx.config)
    if eager:
        log.info("pass fuse_kernels: %s", eager)
    done = apply_fusions(gm, groups)
    log.info("pass fuse_kernels: fused %s", fusion_counts(done) or "nothing (no fusible group found)")
    if len(done) < len(groups):
        log.info(
            "pass fuse_kernels: %d group(s) left unfused (their call could not be placed)",
            len(groups) - len(done),
        )
    return gm

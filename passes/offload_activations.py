"""Activation offload on the whole-step program: the saved activations of the plan's offloaded
layers (``Plan.offload_layers``, read from ``RankInfo.offload_layers``) go to host memory as the
forward makes them and come back for their backward (vDNN, Rhu et al., arXiv 1602.08124;
Megatron-Core's CPU offloading), as ``autopar.cost.offload`` prices it.

Words: a **saved activation** is a forward value a backward node reads (what ``passes.joint``'s
partition would save); it lies in an offloaded layer where the captured node it was lowered from
does (``RankInfo.layer_of``). For each one the pass writes three calls of
``autopar.program.host_copies``:

* ``to_host(x)`` right after ``x`` is made, in the forward: the copy out runs beside the rest of
  the forward, and backward reads only what it returns, so the device tensor is freed after its
  last forward use;
* ``fetch(h)`` in the backward, a layer ahead: before the first backward node reading a saved
  activation of the layer after (the layer whose backward runs just before this one's), or before
  this layer's own first reader where there is none;
* ``ready(f)`` before the value's first backward reader, which reads it from there on.

Parameters and views of them are training state, never offloaded; non-tensor values (RNG states,
sizes) stay as they are.
"""

from __future__ import annotations

import logging
from collections import defaultdict

import torch
from torch.fx import GraphModule, Node

from autopar.ir import PHASE, RANK, Phase
from autopar.passes import PassContext
from autopar.passes.annotate import is_alias
from autopar.passes.recompute import source_of
from autopar.program.host_copies import fetch, ready, to_host

__all__ = ["offload_activations"]

log = logging.getLogger("autopar.passes")


def _is_state(n: Node) -> bool:
    """``n`` is a placeholder (a parameter, buffer or input: not made by this forward) or a view of
    one."""
    while n.op == "call_function" and is_alias(n) and n.args and isinstance(n.args[0], Node):
        n = n.args[0]
    return n.op == "placeholder"


def offload_activations(gm: GraphModule, ctx: PassContext) -> GraphModule:
    """Write the plan's activation offload into the whole-step program (module docstring)."""
    info = gm.meta.get(RANK)
    chosen = set(getattr(info, "offload_layers", ()) or ())
    if not chosen or info is None:
        return gm
    layer_of = info.layer_of
    nodes = list(gm.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}

    def layer(n: Node) -> str | None:
        src = source_of(n)
        return layer_of.get(src) if src is not None else None

    # Every layer's saved activations with their backward readers, and the forward order of layers.
    saved: dict[str, list[tuple[Node, list[Node]]]] = defaultdict(list)
    first_fwd: dict[str, int] = {}
    for n in nodes:
        if n.op != "call_function" or n.meta.get(PHASE) != Phase.FWD:
            continue
        lay = layer(n)
        if lay is None:
            continue
        first_fwd.setdefault(lay, order[n])
        readers = [u for u in n.users if u.meta.get(PHASE) == Phase.BWD and u.op != "output"]
        if readers and isinstance(n.meta.get("val"), torch.Tensor) and not _is_state(n):
            saved[lay].append((n, readers))
    first_reader = {
        lay: min((u for _, rs in vals for u in rs), key=order.__getitem__) for lay, vals in saved.items()
    }
    in_order = sorted(first_fwd, key=first_fwd.__getitem__)
    g = gm.graph
    copied = 0
    for k, lay in enumerate(in_order):
        if lay not in chosen or lay not in saved:
            continue
        own = first_reader[lay]
        after = in_order[k + 1] if k + 1 < len(in_order) else None
        ahead = first_reader.get(after) if after is not None else None
        at = ahead if ahead is not None and order[ahead] < order[own] else own
        for n, readers in saved[lay]:
            with g.inserting_after(n):
                h = g.call_function(to_host, (n,))
            h.meta[PHASE] = Phase.FWD
            with g.inserting_before(at):
                f = g.call_function(fetch, (h,))
            f.meta[PHASE] = Phase.BWD
            first = min(readers, key=order.__getitem__)
            with g.inserting_before(first):
                r = g.call_function(ready, (f,))
            r.meta.update({key: v for key, v in n.meta.items() if key in ("val", "tensor_meta")})
            r.meta[PHASE] = Phase.BWD
            for u in readers:
                u.replace_input_with(n, r)
            copied += 1
    log.info("offload_activations: %d saved activations of %d layers go to host memory", copied, len(chosen))
    g.lint()
    gm.recompile()
    return gm

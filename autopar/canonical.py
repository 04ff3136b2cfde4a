"""The canonical graph: one form for what export records differently per device.

**Canonical graph.** What export records depends in places on the device the model is traced on,
and a plan made on the meta device must run on the real model, so ``canonicalize`` rewrites each
such place into one form (the values are the same) and the fingerprint is taken after it:

* ``Tensor.contiguous()`` records nothing when its input's strides already are contiguous, and
  the strides are the device kernel's choice (scaled-dot-product attention returns (batch, heads,
  seq, dim)-contiguous output on the meta device, (batch, seq, heads, dim)-strided on CPU and
  CUDA, so ``y.transpose(1, 2).contiguous()`` is a copy on one and nothing on the other).
  ``drop_layout_copies`` removes every ``contiguous`` in the default memory format and turns the
  ``view`` reading through it into ``reshape``; the fingerprint reads the two as one op (the
  per-rank program makes every ``view`` a ``reshape`` anyway, ``passes.lower``).
* A Python number written into a tensor (``x[:, 0] = 0``) is a lifted constant tensor and
  ``fill_`` on CPU and CUDA, ``scalar_tensor`` expanded and ``copy_``-ed on the meta device.
  ``canonical_scalars`` makes both ``scalar_tensor`` then ``fill_``.
* A slice that keeps its whole dimension (``hidden[:, slice(-k, None)]`` with ``k = 0``, the
  ``x[:]`` of a dimension) is recorded by export only where it cannot prove the slice whole:
  with a symbolic batch it is kept on the batch dimension, with concrete sizes it is not. It is
  the identity, yet a slice rule may not split the dimension it slices, so a micro-batch graph
  would run everything after it replicated over data parallelism. ``drop_identity_slices``
  removes every ``slice`` whose output is its input's size, and every ``alias`` (what export
  writes for the same slice where it sees it whole).
* Attention under a mask built from positions alone: eager transformers calls
  ``scaled_dot_product_attention(..., is_causal=True)``, export records the mask it computes from
  the positions while tracing. ``autopar.causal_mask.causal_attention`` turns an attention whose
  mask it proves the square causal triangle into ``is_causal=True`` without the mask (and one
  proven all true into no mask), so the kernel skips the masked half and the mask is never built.
* Node names are numbered again in graph order (``linear``, ``linear_1``, …), so a node removed or
  added above does not rename every node of its op below it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import torch

from autopar.causal_mask import causal_attention
from autopar.graph import is_view, tensor_val, uses_through, written_inputs

__all__ = ["SAME_OPS", "canonicalize", "graph_fingerprint"]


def canonicalize(gm: torch.fx.GraphModule, constants: dict[str, Any]) -> None:
    """The captured graph in its device-independent form (module docstring: canonical graph);
    ``constants`` (lifted constant placeholder name -> tensor) loses the constants no longer read."""
    drop_layout_copies(gm)
    drop_identity_slices(gm)
    canonical_scalars(gm, constants)
    causal_attention(gm, constants)
    renumber_names(gm)


def canonical_scalars(gm: torch.fx.GraphModule, constants: dict[str, Any]) -> int:
    """A Python number written into a tensor, in one form: ``lift_fresh_copy`` of a 0-d lifted
    constant becomes ``scalar_tensor`` of its value, and ``copy_`` of a 0-d value expanded to
    the destination becomes ``fill_`` (module docstring). Returns how many nodes were rewritten."""
    aten = torch.ops.aten
    graph = gm.graph
    done = 0
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is aten.lift_fresh_copy.default and _is_placeholder(node.args[0]):
            const = node.args[0]
            value = _scalar_value(constants.get(const.name))
            if value is None:
                continue
            dtype = constants[const.name].dtype
            with graph.inserting_before(node):
                new = graph.create_node(
                    "call_function",
                    aten.scalar_tensor.default,
                    (value,),
                    {"dtype": dtype},
                    name="scalar_tensor",
                )
            new.meta = dict(node.meta)
            node.replace_all_uses_with(new)
            graph.erase_node(node)
            if not const.users:
                graph.erase_node(const)
                del constants[const.name]
            done += 1
        elif node.target is aten.copy_.default and len(node.args) == 2 and not node.kwargs:
            dst, src = node.args
            chain = []
            while isinstance(src, torch.fx.Node) and src.target in (aten.expand.default, aten.view.default):
                if len(src.users) != 1:
                    break
                chain.append(src)
                src = src.args[0]
            sv, dv = tensor_val(src), tensor_val(dst)
            if (
                not chain
                or getattr(src, "target", None) is not aten.scalar_tensor.default
                or sv is None
                or dv is None
                or sv.dim() != 0
                or sv.dtype != dv.dtype
            ):
                continue
            with graph.inserting_before(node):
                new = graph.create_node("call_function", aten.fill_.Tensor, (dst, src), name="fill_")
            new.meta = dict(node.meta)
            node.replace_all_uses_with(new)
            graph.erase_node(node)
            for n in chain:
                graph.erase_node(n)
            done += 1
    if done:
        gm.recompile()
    return done


def _is_placeholder(x: Any) -> bool:
    return isinstance(x, torch.fx.Node) and x.op == "placeholder"


def _scalar_value(t: Any) -> bool | int | float | None:
    """The Python number a 0-d constant tensor holds (``None`` if it is not one, or is fake)."""
    if not isinstance(t, torch.Tensor) or t.dim() != 0 or t.is_complex():
        return None
    inner = getattr(t, "constant", None)  # a fake tensor of a real constant
    try:
        return (inner if isinstance(inner, torch.Tensor) else t).item()
    except Exception:  # a fake tensor without its value
        return None


def renumber_names(gm: torch.fx.GraphModule) -> None:
    """Every node but the placeholders named again, in graph order, as fx names a new graph's nodes
    (``view``, ``view_1``, …): the same ops in the same order get the same names whatever was
    removed or added above them."""
    from torch.fx.graph import _name_regex

    old = gm.graph
    new = torch.fx.Graph(owning_module=gm, tracer_cls=old._tracer_cls)
    new._codegen = old._codegen
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in old.nodes:
        if node.op in ("placeholder", "output"):
            name = node.name
        else:
            match = _name_regex.match(node.name)
            name = match.group(1) if match else node.name
        copy = new.create_node(
            node.op, node.target, torch.fx.map_arg(node.args, env.__getitem__),
            torch.fx.map_arg(node.kwargs, env.__getitem__), name=name, type_expr=node.type,
        )  # fmt: skip
        copy.meta = node.meta
        env[node] = copy
    gm.graph = new
    gm.recompile()


def drop_layout_copies(gm: torch.fx.GraphModule) -> int:
    """Remove each ``contiguous`` (default memory format) whose result nothing writes into, and
    turn every ``view`` that reads it, directly or through other views, into ``reshape`` (module
    docstring: canonical graph). Returns how many were removed."""
    aten = torch.ops.aten

    def source(node: torch.fx.Node) -> torch.fx.Node | None:
        if node.target is not aten.contiguous.default:
            return None
        fmt = node.kwargs.get("memory_format", node.args[1] if len(node.args) > 1 else None)
        src = node.args[0]
        return src if fmt in (None, torch.contiguous_format) and isinstance(src, torch.fx.Node) else None

    def views_to_reshapes(node: torch.fx.Node) -> None:
        for _, u in uses_through(node, lambda _, u: is_view(u) and u.target is not aten.view.default):
            if u.target is aten.view.default:
                u.target = aten.reshape.default

    return _drop_identities(gm, source, views_to_reshapes)


def drop_identity_slices(gm: torch.fx.GraphModule) -> int:
    """Remove each ``slice`` (step 1) whose output has its input's shape, and each ``alias``: the
    identity (module docstring: canonical graph; export writes ``x[:, 0:]`` as ``alias`` where it
    sees the slice whole, as ``slice`` where the size is a symbol). One that something writes
    into stays, as ``drop_layout_copies`` keeps a written copy (the two are read alike only where
    nothing writes). Returns how many were removed."""
    aten = torch.ops.aten

    def source(node: torch.fx.Node) -> torch.fx.Node | None:
        if node.target not in (aten.slice.Tensor, aten.alias.default):
            return None
        src = node.args[0]
        step = node.args[4] if len(node.args) > 4 else node.kwargs.get("step", 1)
        step = 1 if node.target is aten.alias.default else step
        out, inp = tensor_val(node), tensor_val(src) if isinstance(src, torch.fx.Node) else None
        if step != 1 or out is None or inp is None or tuple(out.shape) != tuple(inp.shape):
            return None
        return src

    return _drop_identities(gm, source)


def _drop_identities(
    gm: torch.fx.GraphModule,
    source: Callable[[torch.fx.Node], torch.fx.Node | None],
    before: Callable[[torch.fx.Node], None] | None = None,
) -> int:
    """Replace each op that ``source`` finds an identity of its input (returning that input) by
    the input, unless something writes into its result in place (the write must not reach the
    input); ``before`` first sees each node removed. Returns how many were removed."""
    dropped = 0
    for node in list(gm.graph.nodes):
        src = source(node) if node.op == "call_function" else None
        if src is None or _written(node):
            continue
        if before is not None:
            before(node)
        node.replace_all_uses_with(src)
        gm.graph.erase_node(node)
        dropped += 1
    if dropped:
        gm.recompile()
    return dropped


def _written(value: torch.fx.Node) -> bool:
    """Something writes into ``value`` in place, directly or through views of it."""
    return any(v in written_inputs(u) for v, u in uses_through(value, lambda _, u: is_view(u)))


SAME_OPS = {torch.ops.aten.reshape.default: torch.ops.aten.view.default}
"""Ops the fingerprint (and ``passes.plan_check.program_difference``) reads as one:
``drop_layout_copies`` makes a ``view`` a ``reshape`` on one device where the other recorded
no copy."""


def graph_fingerprint(graph: torch.fx.Graph) -> str:
    """A hash of every node's kind, name, op and output shape: the program a plan was made for."""
    h = hashlib.sha256()
    for n in graph.nodes:
        val = n.meta.get("val")
        shape = tuple(val.shape) if isinstance(val, torch.Tensor) else ""
        target = SAME_OPS.get(n.target, n.target) if n.op == "call_function" else n.target
        h.update(f"{n.op}|{n.name}|{target}|{shape}\n".encode())
    return h.hexdigest()[:16]

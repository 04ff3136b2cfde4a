"""Micro-batch graphs from a model cut to a few layers: the batch's symbols without exporting every
layer twice.

A micro-batch graph is the whole model's graph with every size that follows from the batch
evaluated at the micro-batch (``autopar.microbatch``). Which sizes follow from the batch, and how,
only an export with a symbolic batch says, and that export costs two to three times a concrete one
(12–17 s for LLaMA-3-8B's 32 layers on this project's 2-core machine against 5–7 s), because every
op computes its sizes as formulas in the symbol. A transformer's layers are a few kinds of layer
repeated, so the formulas of one layer of each kind are the formulas of all.

**Repeated list.** A ``ModuleList`` or ``Sequential`` of at least three children named ``0 … n−1``,
all of one class, whose parameters and buffers (names, shapes, dtypes) take at most n/2 forms (the
blocks of a transformer; T5's first block holds the position bias the others read; dense and MoE
layers). Only the outermost are taken: the experts inside a block are cut with it.

**Template.** What each child of a repeated list is matched with (``plan_cuts``, read from the
whole model's concrete export): the first child from 1 on whose ops — op, argument structure and
literals — are its own; child 0 is its own (it reads the embedding, not a layer's output), and so
is a child like no other. LLaMA's 32 layers match children 0, 1, 1, …; Gemma 3's, whose every
sixth layer attends globally, 0, 1, …, 5, 1, …; SmolLM3's (no rotary embedding in every fourth),
0, 1, 2, 3, 1, 2, 3, ….

**Cut model.** The model with each repeated list cut to its children up to the last template
(``cut_lists``) while it is exported with a symbolic batch: what those layers cost (about 1.5 s
for LLaMA-3-8B's two). A list whose cut would keep every child is not cut.

**Match.** Each op of the whole model's *concrete* export is matched with an op of the cut model's
symbolic export (``align``): the k-th op of child i of a repeated list with the k-th op of its
template, and the k-th op before, between or after the lists with the k-th op at the same place in
the cut model. Ops are placed by the module path the exporter records for each
(``nn_module_stack``). A match must call the same op on the matching inputs with the same argument
structure, and its sizes, strides and integer arguments evaluated at the whole batch must be the
concrete export's: where a layer computes otherwise than its template, ``NotAligned`` says where,
and the caller exports the whole model with a symbolic batch as before. A size a layer computes
from the batch otherwise than its template yet to the same value at the whole batch (a layer that
hard-codes the batch size its template reads) is not told apart.

**Specialised graph** (``specialise_aligned``). A copy of the concrete export in which every integer
argument and every value (sizes, strides, storage offset, storage size) that its match computes
from the batch is evaluated at the micro-batch: node for node the graph exporting the micro-batch
itself gives (the tests compare both), so plans and the runtime agree on names and fingerprints.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

__all__ = ["ListCut", "NotAligned", "cut_lists", "plan_cuts", "repeated_lists", "specialise_aligned"]

_SYM = (torch.SymInt, torch.SymBool, torch.SymFloat)
CUT = 2
"""A repeated list has more children than this (module docstring)."""


class NotAligned(Exception):
    """The concrete export does not match the cut model's op for op (module docstring: match)."""


def repeated_lists(model: nn.Module) -> dict[str, int]:
    """The model's outermost repeated lists (module docstring), by module name, with their lengths."""
    found: dict[str, int] = {}
    for name, mod in model.named_modules():
        if any(name.startswith(f"{p}.") or not p for p in found):
            continue
        if not isinstance(mod, (nn.ModuleList, nn.Sequential)):
            continue
        keys = list(mod._modules)
        kids = list(mod._modules.values())
        if len(kids) <= CUT or keys != [str(i) for i in range(len(kids))] or any(k is None for k in kids):
            continue
        if len({type(k) for k in kids}) != 1:
            continue
        if len({_signature(k) for k in kids}) <= len(kids) // 2:  # some layers repeat others
            found[name] = len(kids)
    return found


def _signature(m: nn.Module) -> tuple:
    return (
        tuple((n, tuple(p.shape), p.dtype) for n, p in m.named_parameters()),
        tuple((n, tuple(b.shape), b.dtype) for n, b in m.named_buffers()),
    )


@contextlib.contextmanager
def cut_lists(model: nn.Module, keep: dict[str, int]) -> Iterator[None]:
    """``model`` with each list named in ``keep`` holding only its first ``keep[name]`` children,
    restored after."""
    saved: dict[str, Any] = {}
    try:
        for name, k in keep.items():
            mod = model.get_submodule(name)
            saved[name] = mod._modules
            mod._modules = type(mod._modules)(list(mod._modules.items())[:k])
        yield
    finally:
        for name, kids in saved.items():
            model.get_submodule(name)._modules = kids


@dataclass(frozen=True)
class ListCut:
    """How one repeated list is cut (module docstring: cut model, match)."""

    length: int
    """Its children in the model."""
    template: tuple[int, ...]
    """Child i of the model → the child of the cut model it is matched with."""

    @property
    def keep(self) -> int:
        """The children the cut model keeps: the first ``keep``."""
        return max(self.template) + 1

    @staticmethod
    def kept(keep: int) -> ListCut:
        """The cut model's own list: each child its own template."""
        return ListCut(keep, tuple(range(keep)))


def plan_cuts(full: torch.fx.Graph, lists: dict[str, int]) -> dict[str, ListCut]:
    """How to cut each of ``lists`` (module docstring: cut model), read from the whole model's
    concrete export ``full``: child i is matched with the first child from 1 on whose ops (op,
    argument structure, literals, the ops outside the lists it reads: ``_leaf``) are its own — child 0, which reads no layer's output,
    only where none is — and the cut keeps children up to the last one matched. Where ops run
    between the children (in the loop over them), the last child is matched with a later child
    than any other, so that each child matched but the last is followed by such ops in the cut
    model too. A list whose cut would keep every child is not cut."""
    ops: dict[tuple[str, int], list[tuple]] = {}
    between: set[str] = set()  # lists with ops between two of their children
    last: tuple[str, int] | None = None
    before: dict[str, set[torch.fx.Node]] = {name: set() for name in lists}  # the ops before each list
    for n in full.nodes:
        if n.op not in ("call_function", "get_attr"):
            continue
        where = _where_in(n, lists)
        if where is not None:
            leaves = pytree.tree_leaves((n.args, n.kwargs))
            ops.setdefault(where, []).append(
                (str(n.target), tuple(_leaf(x, where, lists, before[where[0]]) for x in leaves))
            )
            last = where
        elif last is not None and last[1] < lists[last[0]] - 1:
            between.add(last[0])
        for name, ahead in before.items():
            if (name, 0) not in ops:
                ahead.add(n)
    cuts: dict[str, ListCut] = {}
    for name, length in lists.items():
        sig = [tuple(ops.get((name, i), ())) for i in range(length)]
        first: dict[tuple, int] = {}
        for i in range(1, length):
            first.setdefault(sig[i], i)
        template = [0] + [first[sig[i]] for i in range(1, length)]
        if name in between:  # ops between children: every child matched but the last has a next
            later = [j for j in range(max(template[:-1]) + 1, length) if sig[j] == sig[-1]]
            template[-1] = later[0] if later else length - 1
        cut = ListCut(length, tuple(template))
        if cut.keep < length:
            cuts[name] = cut
    return cuts


def _leaf(x: Any, where: tuple[str, int], lists: dict[str, int], before: set[torch.fx.Node]) -> str:
    """An argument of an op of child ``where`` as ``plan_cuts`` compares them: a literal, a
    placeholder (each layer has its own parameters), an op of the same child or of another, an op
    made ``before`` the list by name (a sliding-window layer reads another mask than a global
    one), another op outside the lists (between two children)."""
    if not isinstance(x, torch.fx.Node):
        return repr(x)
    if x.op == "placeholder":
        return "placeholder"
    other = _where_in(x, lists)
    if other is not None:
        return "own" if other == where else "layer"
    return x.name if x in before else "outside"


def _child(path: str, lists: Any) -> tuple[str, int] | None:
    """(list, child index) where module path ``path`` lies inside a child of one of ``lists``."""
    for name in lists:
        prefix = f"{name}." if name else ""
        if path.startswith(prefix):
            head = path[len(prefix) :].split(".", 1)[0]
            if head.isdigit():
                return name, int(head)
    return None


def _where_in(n: torch.fx.Node, lists: Any) -> tuple[str, int] | None:
    """(list, child index) of the module op ``n`` was recorded in, if inside one of ``lists``."""
    if n.op not in ("call_function", "get_attr"):
        return None
    for path, *_ in (n.meta.get("nn_module_stack") or {}).values():
        where = _child(path, lists)
        if where is not None:
            return where
    return None


def _places(graph: torch.fx.Graph, cuts: dict[str, ListCut], cut: bool) -> dict[Any, list[torch.fx.Node]]:
    """The graph's ops grouped by place: ``(key, i)`` → its ops in order, the key being the place
    in the cut model they match (module docstring: match) — child ``template[i]`` of a list, or
    after it (after the last child: the list's end) — and ``i`` the child of the model."""
    groups: dict[Any, list[torch.fx.Node]] = {}
    last: tuple[str, int] | None = None
    for n in graph.nodes:
        if n.op not in ("call_function", "get_attr"):
            continue
        if cut and _symbolic_only(n):
            continue
        where = _where_in(n, cuts)
        if where is not None:
            name, i = where
            key: Any = ("layer", name, cuts[name].template[i])
            last = where
        elif last is None:
            key, i = ("around", None), 0
        else:
            name, i = last
            c = cuts[name]
            key = ("around", name, "end" if i == c.length - 1 else c.template[i])
        groups.setdefault((key, i), []).append(n)
    return groups


def _symbolic_only(n: torch.fx.Node) -> bool:
    """An op of the symbolic export a concrete one does not have: a size computed from the batch
    (``sym_size``, arithmetic on it) or an assertion on one."""
    v = n.meta.get("val")
    if isinstance(v, _SYM):
        return True
    if v is None:
        return any(
            isinstance(a, torch.fx.Node) and isinstance(a.meta.get("val"), _SYM) for a in n.all_input_nodes
        )
    return False


def align(
    full: torch.fx.Graph,
    cut: torch.fx.Graph,
    cuts: dict[str, ListCut],
    inputs: set[str],
    at: Callable[[Any, bool], int],
) -> tuple[dict[torch.fx.Node, torch.fx.Node], set[torch.fx.Node]]:
    """Every node of the concrete export ``full`` matched with one of the cut model's export
    ``cut`` (module docstring: match; the sizes are checked by ``specialise_aligned``).
    ``inputs``: the user inputs' placeholder names (the same in both). A view the cut model's
    export takes and the concrete one leaves out (a slice over a whole dimension, which only a
    concrete size shows to be one) is passed over where it is the whole of its input at the batch
    and at the micro-batch alike; a view of the whole of its input the concrete export takes and the
    cut model's leaves out (an ``alias``) is matched with its input's match, and returned among
    the second value's views (its arguments are left as they are)."""
    match: dict[torch.fx.Node, torch.fx.Node] = {}
    views: set[torch.fx.Node] = set()
    cut_ph = {n.name: n for n in cut.nodes if n.op == "placeholder"}
    for n in full.nodes:
        if n.op == "placeholder" and n.name in inputs:
            if n.name not in cut_ph:
                raise NotAligned(f"input {n.name} is not an input of the cut model")
            match[n] = cut_ph[n.name]
    kept = {name: ListCut.kept(c.keep) for name, c in cuts.items()}
    cut_groups = _places(cut, kept, cut=True)
    full_groups = _places(full, cuts, cut=False)
    by_key = {key: ops for (key, _), ops in cut_groups.items()}
    passed: dict[torch.fx.Node, torch.fx.Node] = {}  # a view passed over -> its input
    # each op's place in its group, from the group's end, views of a whole input left out
    # (``_disagreement``)
    places: dict[torch.fx.Node, tuple] = {}
    for groups, sizes in ((full_groups, None), (cut_groups, at)):
        for (key, _), ops in groups.items():
            own = [a for a in ops if not _whole_view(a, sizes)]
            places.update((a, (key[:2], k)) for k, a in enumerate(reversed(own)))
    for (key, i), ops in full_groups.items():
        mate = by_key.get(key, [])
        j = 0
        for a in ops:
            why = "nothing left"
            while j < len(mate):
                b = mate[j]
                why = _disagreement(a, b, match, passed, places, at)
                if why is None or not _whole_view(b, at):
                    break
                passed[b] = passed.get(b.args[0], b.args[0])
                j += 1
            if why is None:
                match[a] = mate[j]
                j += 1
            elif _whole_view(a, None) and a.args[0] in match:  # a view the cut model left out
                match[a] = match[a.args[0]]
                views.add(a)
            else:
                b = mate[j] if j < len(mate) else None
                raise NotAligned(
                    f"{a.name} ({a.target}) at {_where(key, i)} against the cut model's "
                    f"{'nothing' if b is None else b.name}: {why}"
                )
        if any(not _whole_view(b, at) for b in mate[j:]):
            raise NotAligned(f"the cut model has {len(mate) - j} op(s) more at {_where(key, i)}")
    return match, views


def _disagreement(
    a: torch.fx.Node,
    b: torch.fx.Node,
    match: dict[torch.fx.Node, torch.fx.Node],
    passed: dict[torch.fx.Node, torch.fx.Node],
    places: dict[torch.fx.Node, tuple],
    at: Callable[[Any, bool], int],
) -> str | None:
    """Why op ``a`` of the concrete export cannot be op ``b`` of the cut model's (``None``: it
    can): another op, other arguments, another input, or a size argument the cut model computes
    to another value at the batch. An input is the match of ``a``'s (``passed``: through the
    views passed over) or, from another layer (child i − 1 of a list, where the cut model's op reads
    the child before the template), the op at the same place from the end of its layer."""
    if a.target != b.target:
        return f"{a.target} against {b.target}"
    leaves, spec = pytree.tree_flatten((a.args, a.kwargs))
    cleaves, cspec = pytree.tree_flatten((b.args, b.kwargs))
    if spec != cspec:
        return "other arguments"
    for x, y in zip(leaves, cleaves):
        if isinstance(y, torch.fx.Node) and isinstance(y.meta.get("val"), torch.SymInt):
            if not isinstance(x, int) or at(y.meta["val"], True) != x:
                return f"{x!r} against {y.meta['val']} at the batch"
        elif isinstance(x, torch.fx.Node) and isinstance(y, torch.fx.Node):
            y = passed.get(y, y)
            if x in match and match[x] is not y and (x not in places or places[x] != places.get(y)):
                return f"input {x.name} against {y.name}"
        elif isinstance(x, torch.fx.Node) or isinstance(y, torch.fx.Node) or type(x) is not type(y) or x != y:
            return f"argument {x!r} against {y!r}"
    return None


def _whole_view(n: torch.fx.Node, at: Callable[[Any, bool], int] | None) -> bool:
    """Whether op ``n`` is a view of the whole of its first input: of the cut model's export, at
    the batch and at the micro-batch (``at``); of the concrete export (``at`` None), as it is."""
    x = n.args[0] if n.args else None
    v = n.meta.get("val")
    u = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
    if not isinstance(v, torch.Tensor) or not isinstance(u, torch.Tensor) or v.dim() != u.dim():
        return False
    if v.untyped_storage()._cdata != u.untyped_storage()._cdata:
        return False

    def layout(t: torch.Tensor, w: bool) -> tuple:
        if at is None:
            return list(t.shape), list(t.stride()), t.storage_offset()
        return [at(s, w) for s in t.shape], [at(s, w) for s in t.stride()], at(t.storage_offset(), w)

    return all(layout(v, w) == layout(u, w) for w in (True, False))


def _where(key: tuple, i: int) -> str:
    prefix = f"{key[1]}." if key[1] else ""
    if key[0] == "layer":
        return f"{prefix}{i}"
    if key[1] is None:
        return "the start"
    return f"after {prefix}{i}"


def specialise_aligned(
    full: torch.fx.GraphModule,
    cut: torch.fx.GraphModule,
    cuts: dict[str, ListCut],
    inputs: set[str],
    at: Callable[[Any, bool], int],
    make_val: Callable[[Any, Any, Callable[[Any], int]], Any],
) -> torch.fx.GraphModule:
    """A copy of ``full`` (the whole model's concrete export) at the micro-batch (module docstring:
    specialised graph). ``at(size, whole)``: a symbolic size of ``cut`` evaluated at the micro-batch
    (or, ``whole``, at the export's batch); ``make_val(full_val, sizes, value)``: the value
    of one node with its sizes read through ``value`` (``autopar.microbatch``)."""
    match, views = align(full.graph, cut.graph, cuts, inputs, at)
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    graph.output(graph.graph_copy(full.graph, env))
    for n, c in match.items():
        new = env[n]
        if n.op == "call_function" and n not in views:
            new.args = _args(new.args, c.args, at)
            new.kwargs = _args(new.kwargs, c.kwargs, at)
    for n in full.graph.nodes:  # the copy's meta is its own dict: the original keeps its values
        if "val" in n.meta and n.op != "output":
            env[n].meta["val"] = _value(n, match.get(n), at, make_val)
    return torch.fx.GraphModule(full, graph)


def _args(a: Any, c: Any, at: Callable[[Any, bool], int]) -> Any:
    """``a`` (a concrete node's arguments, already copied) with every integer its match's
    arguments ``c`` compute from the batch (``align`` checked them at the batch) evaluated at the
    micro-batch."""
    leaves, spec = pytree.tree_flatten(a)
    cleaves = pytree.tree_leaves(c)
    out = [
        at(y.meta["val"], False)
        if isinstance(y, torch.fx.Node) and isinstance(y.meta.get("val"), torch.SymInt)
        else x
        for x, y in zip(leaves, cleaves)
    ]
    return pytree.tree_unflatten(out, spec)


def _value(
    n: torch.fx.Node, c: torch.fx.Node | None, at: Callable[[Any, bool], int], make_val: Callable
) -> Any:
    """Node ``n``'s value at the micro-batch: its own where it has no match (a parameter), else with
    the sizes of its match's value evaluated there (checked at the batch first)."""
    v = n.meta["val"]
    if c is None:
        return pytree.tree_map(lambda t: make_val(t, t, int) if isinstance(t, torch.Tensor) else t, v)
    cv = c.meta.get("val")
    leaves, spec = pytree.tree_flatten(v)
    cleaves, cspec = pytree.tree_flatten(cv)
    if spec != cspec:
        raise NotAligned(f"{n.name}: its value's structure differs from the cut model's")
    out = []
    for x, y in zip(leaves, cleaves):
        if isinstance(x, torch.Tensor):
            if not isinstance(y, torch.Tensor) or y.dim() != x.dim() or y.dtype != x.dtype:
                raise NotAligned(f"{n.name}: a tensor of {tuple(x.shape)} against the cut model's {y!r}")
            whole = (
                [at(s, True) for s in y.shape],
                [at(s, True) for s in y.stride()],
                at(y.storage_offset(), True),
                at(y.untyped_storage().nbytes(), True),
            )
            if whole != (list(x.shape), list(x.stride()), x.storage_offset(), x.untyped_storage().nbytes()):
                raise NotAligned(
                    f"{n.name}: sizes {tuple(x.shape)} strides {x.stride()} are not the cut model's "
                    f"{tuple(y.shape)} {y.stride()} at the batch"
                )
            x = make_val(x, y, lambda s: at(s, False))
        elif isinstance(y, _SYM):
            raise NotAligned(f"{n.name}: a symbolic {type(y).__name__} in its value")
        out.append(x)
    return pytree.tree_unflatten(out, spec)

"""Mixture-of-experts regions: found by structure, placed as wholes (their routing ops one at a
time: ``autopar.rules.routing``).

A dropless MoE layer, however it is written (transformers'
Mixtral/Qwen-MoE experts, torchtitan's, a plain PyTorch one), sorts its (token, slot) pairs by
expert, gathers the tokens' rows in that order, counts rows per expert and runs a grouped matmul
(``offs`` = cumulative counts) over them, then brings the rows back to token order — by the
inverse permutation (``index`` with ``inv`` where ``inv[perm] = arange``) or by scattering them
into the tokens (``index_add``/``scatter_add``/``index_put(accumulate)``). ``moe_regions`` finds
these regions from the graph's structure alone: a ``sort`` of a 1-D tensor and everything its
outputs reach until rows are back in token order.

Inside a region the rows are in an order of the region's own making, so a region runs one way on
each mesh axis — its **mode** — chosen once for the whole region (its nodes follow one decision):

* ``R`` — replicated: every device runs the whole region on every token;
* ``T`` — token-parallel: each device sorts, groups and computes its own tokens' rows (Megatron-LM's
  ``dispatch_preprocess``); the experts' weights are replicated (their gradients all-reduced), the
  per-expert counts ``Partial``;
* ``E`` — expert-parallel (GShard, Lepikhin et al. 2020; DeepSpeed-MoE; Megatron-LM's
  ``MoEAlltoAllTokenDispatcher``): as ``T`` on the token side, but the experts' weights are split by
  expert, and the grouped matmuls' rows are *dispatched* to the devices of their experts before
  the first one and *combined* back after the last one (``autopar.program.experts``: counts exchanged
  first, then an all-to-all of the rows with uneven splits — dropless). At most one axis runs
  ``E``.

A region's rows are written ``S(0)`` in its ``T`` and ``E`` modes; their order is the region's, and
no node outside the region reads them (a region whose rows escape is not offered ``T``/``E``).
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.fx import Node

from autopar.graph import OpFamily, op_family, op_name, tensor_inputs, tensor_outputs
from autopar.ir import Rewrite, Strategy
from autopar.placement import Placement, Shard, Spec, divides
from autopar.rules.base import P, R, arg, norm_dim, shape_of
from autopar.rules.routing import grouped_mm_operands

__all__ = ["MoERegion", "Mode", "moe_regions", "region_strategies"]

S0 = Shard(0)


Mode = str
"""``"R"``, ``"T"`` or ``"E"`` (module docstring)."""


@dataclass(frozen=True, slots=True)
class MoERegion:
    """One mixture-of-experts region (module docstring), found by ``moe_regions``."""

    leader: Node
    """The member first in graph order: every other member follows its choice."""
    sort: Node
    """The sort of the (token, slot) expert ids the region starts from."""
    members: tuple[Node, ...]
    """Nodes whose layout the region's mode fixes, in graph order (``getitem``s of the sort
    excluded: they follow the sort as any ``getitem`` does)."""
    rows: frozenset[Node]
    """Members whose dimension 0 is a row of the region."""
    counts: frozenset[Node]
    """Members counting rows per expert (Partial when the rows are split)."""
    exits: frozenset[Node]
    """Members whose output is in token order again (an ordinary ``S(0)`` when split)."""
    experts: tuple[Node, ...]
    """The grouped matmuls, in graph order."""
    dispatched: frozenset[Node]
    """Members whose rows live on the experts' devices in mode ``E``: the grouped matmuls' outputs
    up to the last one, and what lies between them."""
    num_experts: int

    @property
    def expert_parallel(self) -> bool:
        """The region can run mode ``E``: its experts are grouped matmuls and the rows between them
        never leave the dispatched side."""
        return bool(self.experts)


_ROWWISE_VIEWS = {"view", "reshape", "_unsafe_view", "unsqueeze", "expand", "contiguous", "clone", "alias"}


def _keeps_rows(node: Node, src: Node) -> bool:
    """A view/shape op that keeps dimension 0 of ``src`` as dimension 0, whole."""
    val, sval = node.meta.get("val"), src.meta.get("val")
    if not isinstance(val, torch.Tensor) or not isinstance(sval, torch.Tensor) or val.dim() == 0:
        return False
    return val.shape[0] == sval.shape[0] and (val.dim() == 1 or sval.dim() >= 1)


def moe_regions(graph: torch.fx.Graph) -> list[MoERegion]:
    """Every mixture-of-experts region of ``graph`` (module docstring); a region whose rows would
    escape, or that mixes rows of two sorts, is not returned (its ops then run by their own
    rules)."""
    out = []
    claimed: set[Node] = set()
    for n in graph.nodes:
        if n.op != "call_function" or op_name(n) not in ("sort", "argsort"):
            continue
        src = n.args[0]
        if not isinstance(src, Node) or len(shape_of(src)) != 1:
            continue
        region = _grow(n)
        if region is not None and not (set(region.members) & claimed):
            claimed |= set(region.members)
            out.append(region)
    return out


def _grow(sort: Node) -> MoERegion | None:
    """The region a sort starts, or None when its rows escape (see ``moe_regions``)."""
    length = shape_of(sort.args[0])[0]
    rows: set[Node] = set()
    counts: set[Node] = set()
    exits: set[Node] = set()
    index_of: dict[Node, tuple[str, int]] = {}
    """Index-valued members: ("perm", rows their values index) for sorted→original positions,
    ("inv", length) for original→sorted."""
    members: list[Node] = [sort]
    experts: list[Node] = []
    if op_name(sort) == "sort":
        vals = [u for u in sort.users if u.target is operator.getitem]
        for g in vals:
            if g.args[1] == 0:
                rows.add(g)
            else:
                index_of[g] = ("perm", length)
    else:
        index_of[sort] = ("perm", length)
    rows.add(sort)

    def inside(v: object) -> bool:
        return isinstance(v, Node) and (v in rows or v in index_of or v in counts)

    nodes = list(sort.graph.nodes)
    for u in nodes[nodes.index(sort) + 1 :]:  # graph order: producers are classified first
        if not any(inside(i) for i in u.all_input_nodes):
            continue
        if u.op != "call_function":
            return None  # a region value returned as it is
        name = op_name(u)
        if name == "getitem" or op_family(u) is OpFamily.ASSERT:
            if (
                name == "getitem"
                and u.args[0] is not sort
                and u.args[0] in rows
                and u.args[0] not in index_of
            ):
                rows.add(u)
                members.append(u)
            continue
        t_in = tensor_inputs(u)
        inner = [i for i in t_in if inside(i)]
        outer = [i for i in t_in if not inside(i)]
        kind = None
        if all(i in counts for i in inner):
            if name not in ("to", "_to_copy", "type_as", "clone", "contiguous", "alias", "cumsum"):
                continue  # reads the counts as the Partial they are: an ordinary op
            counts.add(u)
            members.append(u)
            continue
        if (name in ("histc", "bincount") and len(t_in) == 1) or (
            name == "cumsum" and all(i in counts for i in t_in)
        ):
            kind = "counts"
        elif (
            name == "floor_divide" and len(t_in) == 1 and u.args[0] in index_of and isinstance(u.args[1], int)
        ):
            kind_, rows_ = index_of[u.args[0]]
            if kind_ != "perm" or rows_ % u.args[1]:
                return None
            index_of[u] = ("perm", rows_ // u.args[1])
            kind = "index"
        elif name == "index" and len(u.args[1]) == 1 and u.args[1][0] in index_of:
            x, idx = u.args[0], u.args[1][0]
            kind_, rows_ = index_of[idx]
            if kind_ == "perm" and not inside(x) and shape_of(x)[0] == rows_:
                kind = "rows"  # gather token rows into the region's order
            elif kind_ == "inv" and x in rows:
                kind = "exit"  # rows back in token order
            else:
                return None
        elif (
            name in ("index_put_", "index_put")
            and u.args[1][0] in index_of
            and not bool(arg(u, "accumulate", False))
        ):
            target, idx, vals = u.args[0], u.args[1][0], u.args[2]
            if (
                index_of[idx][0] == "perm"
                and isinstance(vals, Node)
                and op_name(vals) == "arange"
                and target in rows
                and shape_of(target)[0] == length
            ):
                index_of[u] = ("inv", length)
                rows.add(vals)  # positions in the region's order: arange over this device's rows
                if vals not in members:
                    members.append(vals)
                kind = "index"
            else:
                return None
        elif name in ("index_add", "index_add_", "scatter_add", "scatter_add_") or (
            name in ("index_put_", "index_put") and bool(arg(u, "accumulate", False))
        ):
            target = u.args[0]
            if inside(target):
                return None
            kind = "exit"
        elif grouped_mm_operands(u) is not None:
            x, w, offs = grouped_mm_operands(u)
            if x not in rows or offs not in counts or inside(w):
                return None
            experts.append(u)
            kind = "rows"
        elif (
            name == "argsort"
            and len(t_in) == 1
            and u.args[0] in index_of
            and index_of[u.args[0]][0] == "perm"
        ):
            index_of[u] = ("inv", length)
            kind = "index"
        elif name in ("sum",) and inner and 0 in _reduced(u):
            kind = "counts"
        elif name in ("empty_like", "zeros_like", "full_like") and len(inner) == 1 and u.args[0] in index_of:
            kind = "rows"  # a scratch tensor the inverse permutation is written into
        elif (
            op_family(u) is OpFamily.POINTWISE
            or name in _ROWWISE_VIEWS
            or name in ("chunk", "split", "split_with_sizes")
        ):
            # Row-wise: every input with rows is a region value; others broadcast over the rows.
            if not inner or any(_has_rows(i, u) for i in outer):
                return None
            if any(i in index_of for i in inner) or not all(
                _keeps_rows(u, i) or name in ("chunk", "split", "split_with_sizes")
                for i in inner
                if i in rows
            ):
                if not (len(inner) == 1 and inner[0] in index_of and name in ("to", "_to_copy", "clone")):
                    return None
                index_of[u] = index_of[inner[0]]
                kind = "index"
            elif name in ("chunk", "split", "split_with_sizes") and _split_dim(u) == 0:
                return None
            else:
                kind = "rows"
        else:
            return None
        if kind == "counts":
            counts.add(u)
        elif kind == "rows":
            rows.add(u)
        elif kind == "exit":
            exits.add(u)
        if u not in members:
            members.append(u)
    # Counts may be read anywhere (they are Partial); rows and indices only inside (checked above:
    # every user of a row or index member was classified, or the region was dropped).
    if not exits:
        return None
    order = {n: i for i, n in enumerate(sort.graph.nodes)}
    members.sort(key=order.__getitem__)
    dispatched = _dispatched(experts, rows, order)
    num_experts = shape_of(grouped_mm_operands(experts[0])[1])[0] if experts else 0
    if experts and dispatched is None:
        experts, dispatched = [], set()
    return MoERegion(
        leader=members[0],
        sort=sort,
        members=tuple(members),
        rows=frozenset(rows | set(index_of)),
        counts=frozenset(counts),
        exits=frozenset(exits),
        experts=tuple(experts),
        dispatched=frozenset(dispatched or ()),
        num_experts=num_experts,
    )


def _reduced(node: Node) -> set[int]:
    rank = len(shape_of(node.args[0]))
    dims = node.args[1] if len(node.args) > 1 else None
    if dims is None:
        return set(range(rank))
    return {norm_dim(d, rank) for d in ([dims] if isinstance(dims, int) else dims)}


def _split_dim(node: Node) -> int:
    rank = len(shape_of(node.args[0]))
    return norm_dim(node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0), rank)


def _has_rows(i: Node, user: Node) -> bool:
    """``i`` lines up with ``user``'s dimension 0 (it is not a broadcast of fewer dims or size 1)."""
    out = user.meta.get("val")
    if not isinstance(out, torch.Tensor) or out.dim() == 0:
        return False
    sh = shape_of(i)
    return len(sh) == out.dim() and sh[0] > 1


def _dispatched(experts: list[Node], rows: set[Node], order: dict[Node, int]) -> set[Node] | None:
    """Nodes between the first and the last grouped matmul (both included) on the rows' way: in
    mode ``E`` they hold dispatched rows. None when a value in between is read elsewhere (its
    rows would be on the wrong devices) or the matmuls do not share their counts."""
    if not experts or len({grouped_mm_operands(e)[2] for e in experts}) != 1:
        return None
    last = experts[-1]
    between = {n for n in rows if order[experts[0]] <= order[n] <= order[last]}
    reach: set[Node] = set()
    stack = [experts[0]]
    while stack:
        n = stack.pop()
        if n in reach or n not in between:
            continue
        reach.add(n)
        if n is not last:
            stack.extend(n.users)
    if last not in reach:
        return None
    for n in reach:
        if n is last:
            continue
        for u in n.users:
            if op_family(u) is OpFamily.ASSERT:
                continue
            if u not in reach:
                return None
        for i in tensor_inputs(n):
            if n is experts[0] or i in reach:
                continue
            if grouped_mm_operands(n) is not None and i is not grouped_mm_operands(n)[0]:
                continue  # a weight or the counts
            if i in rows:
                return None  # token-side rows meeting dispatched rows
    return reach


# ------------------------------------------------------------------------------ region strategies


def region_strategies(region: MoERegion, mesh_shape: Sequence[int]) -> dict[Node, list[Strategy]]:
    """For every member, its strategies in the same order: one per valid assignment of modes to
    axes (``R``, ``T``, ``E``; at most one ``E``), the all-``R`` assignment first."""
    modes = ("R", "T", "E") if region.expert_parallel else ("R", "T")
    combos = [c for c in itertools.product(modes, repeat=len(mesh_shape)) if c.count("E") <= 1]
    out: dict[Node, list[Strategy]] = {m: [] for m in region.members}
    for combo in combos:
        built = {m: _strategy(region, m, combo) for m in region.members}
        if all(s is not None and _divides(m, s, mesh_shape) for m, s in built.items()):
            if "E" in combo and region.num_experts % mesh_shape[combo.index("E")]:
                continue
            for m, s in built.items():
                out[m].append(s)
    return out


def _divides(node: Node, s: Strategy, mesh_shape: Sequence[int]) -> bool:
    ins = tensor_inputs(node)
    return all(
        spec is None or divides(tuple(i.meta["val"].shape), spec, mesh_shape)
        for i, spec in zip(ins, s.inputs)
    ) and all(divides(tuple(o.shape), spec, mesh_shape) for o, spec in zip(tensor_outputs(node), s.outputs))


def _place(region: MoERegion, v: Node, mode: Mode, consumer: Node) -> Placement:
    """How value ``v`` is laid out along one axis in ``mode`` (as ``consumer`` reads it)."""
    if mode == "R":
        return R
    if v in region.counts:
        return P
    if v in region.rows:
        return S0
    ops = grouped_mm_operands(consumer)
    if ops is not None and v is ops[1]:  # an expert weight [E, K, N]
        return S0 if mode == "E" else R
    if (
        isinstance(v.meta.get("val"), torch.Tensor)
        and v.meta["val"].dim() >= 1
        and _row_input(region, v, consumer)
    ):
        return S0  # token rows entering the region (or the tokens an exit scatters into)
    return R


def _row_input(region: MoERegion, v: Node, consumer: Node) -> bool:
    """An input from outside whose dimension 0 is the tokens (or (token, slot) pairs)."""
    if consumer is region.sort:
        return True
    name = op_name(consumer)
    if name == "index":
        return v is consumer.args[0]
    if consumer in region.exits:
        return v is consumer.args[0]
    return False


def _strategy(region: MoERegion, node: Node, combo: Sequence[Mode]) -> Strategy | None:
    ins = tensor_inputs(node)
    outs = tensor_outputs(node)
    in_specs: list[list[Placement]] = [[] for _ in ins]
    out_specs: list[list[Placement]] = [[] for _ in outs]
    rewrites, comms, split = [], [], []
    ops = grouped_mm_operands(node)
    for mode in combo:
        for j, i in enumerate(ins):
            in_specs[j].append(_place(region, i, mode, node))
        if mode == "R":
            o = R
        elif node in region.counts:
            o = P
        elif node in region.exits:
            o = S0
        else:
            o = S0
        for j in range(len(outs)):
            out_specs[j].append(o)
        rw, cm = Rewrite.NONE, ""
        if mode == "E" and ops is not None:
            first, last = node is region.experts[0], node is region.experts[-1]
            rw = {
                (True, True): Rewrite.EXPERT_DISPATCH_COMBINE,
                (True, False): Rewrite.EXPERT_DISPATCH,
                (False, True): Rewrite.EXPERT_COMBINE,
                (False, False): Rewrite.EXPERT_LOCAL,
            }[(first, last)]
            cm = "moe_" + rw.value.removeprefix("expert_")
        rewrites.append(rw)
        comms.append(cm)
        split.append(mode != "R")
    return Strategy(
        inputs=tuple(tuple(s) for s in in_specs),
        outputs=tuple(tuple(s) for s in out_specs),
        rewrites=tuple(rewrites),
        comms=tuple(comms),
        split=tuple(split),
    )


def local_rows(spec: Spec, mesh_shape: Sequence[int], rows: int) -> float:
    """Rows one device holds of ``rows`` split by ``spec`` (dispatched rows: the balanced share)."""
    return rows / math.prod(n for p, n in zip(spec, mesh_shape) if isinstance(p, Shard) and p.dim == 0)

"""Per-activation recomputation (``PlanConfig.recompute="ops"``): the solver chooses, node by node
inside the repeated layers, which saved activations to keep and which to compute again in
backward — beside each node's sharding, under the same memory constraint.

Words:

* **candidate** — a node whose output may be recomputed instead of saved
  (``recompute_candidate``): a single-tensor op inside a repeated layer that saves something for
  backward (its output, through any view of it, or statistics: a norm's mean and rstd, a dropout
  mask, an attention's log-sum-exp), none of whose readers lie outside its layer (the layer's
  outputs are the checkpoints full recomputation keeps), writing into no input, with a known
  forward time, and computable from values backward keeps anyway (parameters, the step's inputs,
  values some backward reads: ``passes.annotate.value_is_saved``) — directly, or through a chain
  of unsaved values inside its layer that it computes again first (``_needed``: the scaling and
  masking before a softmax, as Korthikanti et al.'s selective recomputation runs them; no fused
  kernel's member among them). That condition makes the choice local: recomputing the node frees
  its own saved bytes and keeps nothing else alive, whatever the solver picks for its neighbours
  (an input that is itself recomputed is computed again once, before both; an unsaved producer
  two chosen nodes share is charged to each, a slight overestimate). Members of a fused kernel
  group (``autopar.passes.fusion``, GPU clusters) are not candidates: the group saves what its
  kernel saves.
* **twin** — for each strategy of a candidate, the same sharding with ``Strategy.recomputed``
  set: no memory, its forward time (and in-op collectives) paid twice, with the forwards of the
  unsaved chain it needs (``recompute_twins``). The solver's tie of a node across repeated layers
  holds: the choice is made once per position in a layer (as Megatron-Core's
  ``--recompute-modules`` names module kinds), and a candidate keeps its own decision instead of
  following its producer's (``passes.strategies.with_follow``).
* **closure** — what the rank program recomputes for a chosen node: the node and its unsaved
  chain, and the views and ``getitem`` parts of their outputs inside its layer
  (``recomputed_closure``), so no forward view keeps the storage alive
  (``passes.recompute.recompute_layers`` reads the set from ``RankInfo``).

This is the knapsack of Checkmate (Jain et al., MLSys 2020) and of PyTorch's min-cut partitioner
under ``activation_memory_budget``, restricted to choices that stay local, and solved jointly with
the layout: a node whose recomputation repeats a collective (a sharded matmul's all-reduce) pays it
twice in its twin.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

import torch
from torch.fx import Graph, Node

from autopar.graph import op_info, op_name, outer_instance, tensor_inputs
from autopar.ir import COST, STRATEGIES, TENSOR, Strategy
from autopar.passes.annotate import extra_saved_bytes, is_alias, storage_views, value_is_saved
from autopar.passes.fusion import FUSION

__all__ = ["recompute_candidate", "recompute_summary", "recompute_twins", "recomputed_closure"]


def _owner(node: Node) -> Node:
    """The node owning the storage ``node`` views (``node`` itself where it owns one)."""
    seen = 0
    while is_alias(node) and seen < 64:
        ins = tensor_inputs(node)
        src = node.args[0] if op_name(node) == "getitem" else (ins[0] if ins else None)
        if not isinstance(src, Node):
            break
        node, seen = src, seen + 1
    return node


def _kept_anyway(node: Node) -> bool:
    """Backward holds ``node``'s value whatever is recomputed: a parameter, buffer or step input,
    a value some backward reads (through its storage's owner), or one computed outside the
    repeated layers (a mask, a rotary table: one tensor every layer reads, held once)."""
    if node.op == "placeholder":
        return True
    owner = _owner(node)
    info = owner.meta.get(TENSOR)
    outside = info is not None and "*" not in info.layer and not info.requires_grad
    return owner.op == "placeholder" or outside or value_is_saved(owner)


def _readers(node: Node) -> Iterable[Node]:
    """The readers of ``node``'s output and of every view or part of it."""
    for v in storage_views(node):
        for u in v.users:
            if op_name(u) == "getitem" and u.op == "call_function" and u is not v:
                yield from _readers(u)
            yield u


def _needed(node: Node, inst: str, depth: int = 0, acc: dict[Node, None] | None = None) -> list[Node] | None:
    """The producers recomputing ``node`` computes again first: its inputs that backward does not
    keep (``_kept_anyway``), inside layer ``inst``, and theirs in turn (a chain of unsaved values:
    the scaling and masking before a softmax); ``None`` where one lies outside the layer, writes
    into an input, or the chain runs deeper than 8."""
    acc = {} if acc is None else acc
    for i in tensor_inputs(node):
        if i in acc or _kept_anyway(i):
            continue
        info = i.meta.get(TENSOR)
        if depth >= 8 or i.op != "call_function" or info is None or outer_instance(info.module) != inst:
            return None
        if FUSION in i.meta:  # a fused kernel's value: not run again by parts
            return None
        if op_info(i).writes or op_name(i).endswith("_"):
            return None
        acc[i] = None
        if _needed(i, inst, depth + 1, acc) is None:
            return None
    return list(acc)


def recompute_candidate(node: Node, layers: frozenset[str] | None = None) -> bool:
    """Whether the solver may recompute ``node`` (module docstring: candidate); ``layers``: the
    repeated-layer instances recomputation applies to (``None``: every one)."""
    if node.op != "call_function" or FUSION in node.meta:
        return False
    info = node.meta.get(TENSOR)
    if info is None or "*" not in info.layer or not info.requires_grad:
        return False
    if not isinstance(node.meta.get("val"), torch.Tensor) or is_alias(node) or op_name(node) == "getitem":
        return False
    inst = outer_instance(info.module)
    if layers is not None and inst not in layers:
        return False
    if op_info(node).writes or op_name(node).endswith("_"):
        return False
    if not (value_is_saved(node) or extra_saved_bytes(node) > 0):
        return False
    if _forward_time(node)[0] <= 0:  # no cost known: a twin would tie with the kept strategy
        return False
    for u in _readers(node):
        ui = u.meta.get(TENSOR)
        if u.op == "call_function" and ui is None and u.meta.get("val") is None:
            continue  # a check that produces nothing (``_assert_tensor_metadata``)
        if u.op == "output" or ui is None or outer_instance(ui.module) != inst:
            return False
    return _needed(node, inst) is not None


def _forward_time(node: Node) -> tuple[float, float]:
    """(forward, forward + backward) seconds of ``node`` at full size (``COST``; zeros where none)."""
    c = node.meta.get(COST)
    return (c.fwd_time, c.fwd_time + c.bwd_time) if c is not None else (0.0, 0.0)


def recompute_twins(node: Node, strategies: list[Strategy]) -> list[Strategy]:
    """``strategies`` and, for each, its recomputed twin (module docstring): no memory, the
    forward share of its time and in-op collectives paid again, and the forwards of the unsaved
    producers it needs (``_needed``) at the same share of their full-size time as the node's own
    (their sharding is the node's, or follows it). The forward share is the op's own (``COST``:
    forward over forward + backward at full size, known for every candidate)."""
    fwd, total = _forward_time(node)
    share = fwd / total
    before = sum(_forward_time(p)[0] for p in _needed(node, outer_instance(node.meta[TENSOR].module)) or ())
    twins = []
    for s in strategies:
        local = s.compute_time / total  # this strategy's share of the full-size op
        twins.append(
            replace(
                s,
                compute_time=s.compute_time * (1 + share) + before * local,
                comm_time=s.comm_time * (1 + share),
                memory=0.0,
                offloaded=0.0,
                recomputed=True,
            )
        )
    return [*strategies, *twins]


def recomputed_closure(graph: Graph, names: Iterable[str]) -> frozenset[str]:
    """The captured nodes the rank program recomputes for the chosen ``names`` (module docstring:
    closure): each with the unsaved producers it needs (``_needed``), and the views and parts of
    their outputs inside its layer."""
    chosen = set(names)
    out: set[str] = set()
    for n in graph.nodes:
        if n.name not in chosen:
            continue
        inst = outer_instance(n.meta[TENSOR].module)
        stack = [n, *(_needed(n, inst) or ())]
        while stack:
            v = stack.pop()
            if v.name in out:
                continue
            out.add(v.name)
            for u in v.users:
                ui = u.meta.get(TENSOR)
                if u.op != "call_function" or ui is None or outer_instance(ui.module) != inst:
                    continue
                if is_alias(u) or op_name(u) == "getitem":
                    stack.append(u)
    return frozenset(out)


def recompute_summary(graph: Graph, choice: dict[str, int]) -> dict[str, object]:
    """What a per-activation plan recomputes, per micro-batch on a device: ``freed`` the bytes the
    recomputed nodes would save kept, ``extra`` the seconds their forwards run again (each chosen
    twin against the strategy it copies: ``recompute_twins`` lists the kept strategies, then their
    twins in the same order), ``per_layer`` the ops recomputed in the first layer with any, of
    ``candidates`` candidates there, over ``layers`` layers. ``choice``: node name -> the index
    of its strategy (the solver's solution)."""
    freed = extra = 0.0
    per_layer: dict[str, list[str]] = {}
    candidates: dict[str, int] = {}
    for n in graph.nodes:
        ns = n.meta.get(STRATEGIES)
        if ns is None or not ns.strategies or not ns.strategies[-1].recomputed or n.name not in choice:
            continue
        inst = outer_instance(n.meta[TENSOR].module)
        candidates[inst] = candidates.get(inst, 0) + 1
        k, half = choice[n.name], len(ns.strategies) // 2
        if k < half:
            continue
        twin, keep = ns.strategies[k], ns.strategies[k - half]
        per_layer.setdefault(inst, []).append(op_name(n))
        freed += keep.memory
        extra += twin.compute_time + twin.comm_time - keep.compute_time - keep.comm_time
    first = next(iter(per_layer), None)
    return {
        "freed": freed,
        "extra": extra,
        "per_layer": per_layer[first] if first else [],
        "candidates": candidates.get(first, 0) if first else 0,
        "layers": len(per_layer),
    }

"""``formulate``: the annotated graph on one mesh becomes the solver's input, a ``StrategyGraph``.

Steps (the solver's formulation, ``autopar.solver``, reads the result):

1. **roots** — every node with strategies either leads or follows (``NodeStrategies.follows``);
   a follower's choice is a function of its root leader's.
2. **decisions** — leaders are merged with the same position of every repeated layer (equal tie
   key, the same strategy list, the same ``fixed`` spec), so depth does not grow the program;
   ``fixed`` forbids every strategy whose output spec differs.
3. **unary terms** — each decision's time per strategy sums its members' compute and in-op
   collectives; its memory their saved activations or training state, the activations (and
   inputs) counted ``PlanConfig.activations_in_flight`` times: the micro-batches a pipeline stage
   holds at once. Where every decision at its least memory already exceeds the budget, no plan
   fits and step 4 is skipped (``StrategyGraph.complete``).
4. **edges** — every producer→consumer input becomes a cost matrix over producer output groups
   and consumer (input spec, split) groups (``autopar.cost.reshard_cost.edge_cost``); identical edges
   of repeated layers are costed once and counted; an edge inside one decision is folded into its
   unary terms. A value read by several consumers has its gradients summed and synchronized once
   (a tied embedding and LM head), so each of its edges pays its share of that all-reduce
   (``grad_sync_share``); a parameter's all-reduce where it is not gathered happens once per step,
   so the graph of one of ``m`` micro-batches pays ``1/m`` of it
   (``PlanConfig.microbatches_per_sync``). Scalar outputs (a loss) must end replicated. A value an op writes into (batch
   norm's running statistics, ``div_``) must reach it in its layout: a reshard there would copy
   it and the write would be lost, so such edges cost ∞ unless the specs agree.

The pass writes ``gm.meta["autopar.strategy_graph"]``.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable

import torch
from torch.fx import GraphModule, Node

from autopar.capture import Captured
from autopar.config import PlanConfig
from autopar.cost.reshard_cost import (
    compressed_grad_sync,
    edge_cost,
    grad_reduce_axes,
    kept_gather_bytes,
    scalar_output_cost,
)
from autopar.grad_compression import GradCompression
from autopar.graph import OpFamily, op_family, read_by_lookup, returned_scalars, tensor_inputs, written_inputs
from autopar.ir import STRATEGIES, TENSOR, NodeStrategies, Strategy
from autopar.mesh import Mesh
from autopar.passes import PassContext
from autopar.passes.annotate import grad_sync_share
from autopar.placement import Replicate, Shard, Spec, format_spec, parse_spec, spec_problem
from autopar.reshard import (
    ReshardStep,
    StepKind,
    broadcast_chain,
    bucketed_grad_sync,
    grad_sync_axes,
    moved_by_reshard,
    reshard_steps,
)
from autopar.strategy_graph import Decision, Edge, StrategyGraph

__all__ = ["STRATEGY_GRAPH", "formulate", "parse_fixed"]

STRATEGY_GRAPH = "autopar.strategy_graph"


def parse_fixed(cap: Captured, config: PlanConfig, n_axes: int) -> dict[str, Spec]:
    """``config.fixed`` as ``{first name: spec}``, checked against the model and the mesh."""
    if not config.fixed:
        return {}
    alias_to_first = {a: first for first, names in cap.param_aliases.items() for a in names}
    known = set(cap.params.values()) | set(cap.inputs.values())
    shapes = {
        (cap.params.get(n.name) or cap.inputs.get(n.name)): tuple(n.meta["val"].shape)
        for n in cap.graph.nodes
        if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor)
    }
    out = {}
    for name, spec in config.fixed.items():
        first = alias_to_first.get(name, name)
        if first not in known:
            close = difflib.get_close_matches(name, sorted(cap.params.values()), n=3)
            raise ValueError(
                f"fixed names {name!r}, which is neither a parameter nor an input of the model (inputs: "
                f"{sorted(cap.inputs.values())}; similar parameters: {close})"
            )
        parsed = parse_spec(spec)
        shape = shapes.get(first)
        problem = spec_problem(shape, parsed) if shape is not None else None
        if problem is not None:
            raise ValueError(f"fixed spec {format_spec(parsed)} for {name!r} is not a layout: {problem}")
        if len(parsed) != n_axes:
            raise ValueError(
                f"fixed spec for {name!r} has {len(parsed)} entries but the mesh has {n_axes} axes; give one "
                f"placement per mesh axis"
            )
        out[first] = parsed
    return out


def spec_matches(spec: Spec, want: Spec) -> bool:
    """``want`` from ``fixed``: ``S(d)`` matches a shard of dimension ``d`` with any block count
    (the user asks which dimension is split); ``S(d)xk`` only ``k`` blocks exactly."""
    if len(spec) != len(want):
        return False
    for p, q in zip(spec, want):
        if type(p) is not type(q):
            return False
        if isinstance(q, Shard) and (p.dim != q.dim or (q.blocks > 1 and p.blocks != q.blocks)):
            return False
    return True


def _roots(nodes: list[Node]) -> dict[Node, tuple[Node, tuple[int, ...]]]:
    """For each node, its root leader and the map leader strategy -> node strategy."""
    by_name = {n.name: n for n in nodes}
    roots: dict[Node, tuple[Node, tuple[int, ...]]] = {}
    for n in nodes:  # topological order: producers first
        ns: NodeStrategies = n.meta[STRATEGIES]
        if ns.follows and ns.follows in by_name and by_name[ns.follows] in roots:
            leader, pmap = roots[by_name[ns.follows]]
            roots[n] = (leader, tuple(ns.follow_map[k] for k in pmap))
        else:
            roots[n] = (n, tuple(range(len(ns.strategies))))
    return roots


def _dst_key(s: Strategy, j: int) -> tuple:
    """What an edge's cost depends on at the consumer: the input spec, and for the axes where that
    spec is Replicate, whether the consumer splits work there (gradient sync)."""
    spec = s.inputs[j]
    if spec is None:
        return (None, ())
    axes = grad_sync_axes(s.split, spec)
    return (spec, tuple(a in axes for a in range(len(spec))))


EdgeCost = Callable[[int, int], tuple[float, float]]
"""(seconds, bytes kept) of carrying the producer group key with this id into the consumer's."""


def _replica_strategy(n: Node, s: Strategy) -> bool:
    """Whether ``s`` keeps the first mesh axis to independent data-parallel replicas
    (``PlanConfig.replicas_first``): no collective inside the op over it, a weight replicated over
    it, an input (with dimensions) split by rows over it."""
    if s.comms and s.comms[0]:
        return False
    kind = n.meta[TENSOR].kind
    first = s.outputs[0][0] if s.outputs and s.outputs[0] else None
    if kind == "param":
        return isinstance(first, Replicate)
    if kind == "input" and n.meta["val"].dim() > 0:
        return isinstance(first, Shard) and first.dim == 0
    return True


class _Builder:
    def __init__(
        self,
        gm: GraphModule,
        mesh: Mesh,
        fixed: dict[str, Spec],
        in_flight: int = 1,
        per_sync: int = 1,
        compression: GradCompression | None = None,
        replicas_first: bool = False,
    ) -> None:
        self.gm = gm
        self.replicas_first = replicas_first
        self.compression = compression
        self.in_flight = in_flight
        self.per_sync = per_sync
        self.mesh = mesh
        self.nodes = [n for n in gm.graph.nodes if STRATEGIES in n.meta]
        self.roots = _roots(self.nodes)
        self.decisions: list[Decision] = []
        self.index: dict[Node, int] = {}
        self.edges: dict[tuple, Edge] = {}
        self.edge_cache: dict[tuple, tuple[float, float]] = {}
        # The collectives of each reshard (value shape, source spec, destination spec), which edges
        # under different gradient settings share.
        self.steps_cache: dict[tuple, list[ReshardStep]] = {}
        self.fixed = fixed
        # Group keys are interned as small integers: an edge's cost
        # matrix is then filled and cached by integer pairs, not by hashing specs pair by pair.
        self.keys: list[tuple] = []
        self.key_ids: dict[tuple, int] = {}
        self.group_cache: dict[tuple, tuple[int, ...]] = {}

    def _intern(self, key: tuple) -> int:
        i = self.key_ids.get(key)
        if i is None:
            i = self.key_ids[key] = len(self.keys)
            self.keys.append(key)
        return i

    def _src_groups(
        self, gathered: bool, strats: tuple[Strategy, ...], fmap: tuple[int, ...]
    ) -> tuple[int, ...]:
        """What an edge's cost depends on at the producer, interned, for each strategy of its
        decision (``fmap``: decision strategy -> node strategy): the output spec, and for a
        trainable parameter (``gathered``) the ZeRO stage it runs with where it is gathered.
        Nodes of repeated layers share strategy tuples, so each list is computed once."""
        key = ("src", id(strats), fmap, gathered)
        g = self.group_cache.get(key)
        if g is None:
            stage = [s.zero_stage if gathered else 0 for s in strats]
            g = self.group_cache[key] = tuple(self._intern((strats[k].outputs[0], stage[k])) for k in fmap)
        return g

    def _dst_groups(self, strats: tuple[Strategy, ...], fmap: tuple[int, ...], j: int) -> tuple[int, ...]:
        """The interned ``_dst_key`` of input ``j`` for each strategy of the consumer's decision."""
        key = ("dst", id(strats), fmap, j)
        g = self.group_cache.get(key)
        if g is None:
            g = self.group_cache[key] = tuple(self._intern(_dst_key(strats[k], j)) for k in fmap)
        return g

    # Step 2 ------------------------------------------------------------------------------------
    def build_decisions(self) -> None:
        by_key: dict[object, int] = {}
        for n in self.nodes:
            leader, _ = self.roots[n]
            if leader is not n:
                continue
            info = n.meta[TENSOR]
            want = self.fixed.get(info.fqn) if info.kind in ("param", "input") else None
            ns: NodeStrategies = n.meta[STRATEGIES]
            tie = n.meta.get("autopar.tie")
            key = (tie, id(ns.strategies), want) if tie is not None else n.name
            ci = by_key.get(key)
            if ci is None:
                k = len(ns.strategies)
                ci = by_key[key] = len(self.decisions)
                self.decisions.append(
                    Decision(
                        name=n.name,
                        members=(),
                        unary=[0.0] * k,
                        memory=[0.0] * k,
                        allowed=[True] * k,
                        labels=tuple(
                            ",".join(format_spec(s.outputs[0])) if s.outputs else "" for s in ns.strategies
                        ),
                        weight=info.kind == "param",
                    )
                )
                if want is not None:
                    d = self.decisions[ci]
                    for k, s in enumerate(ns.strategies):
                        if not spec_matches(s.outputs[0], want):
                            d.allowed[k] = False
                    if not any(d.allowed):
                        near = sorted({",".join(format_spec(s.outputs[0])) for s in ns.strategies})
                        why = spec_problem(info.shape, want, self.mesh.shape) or (
                            "no strategy of its op produces it (a block count must match the weight's split)"
                        )
                        raise ValueError(
                            f"fixed placement {format_spec(want)} for {info.fqn} is not a valid layout of "
                            f"shape {info.shape} on mesh {self.mesh.shape}: {why}; valid layouts are {near}"
                        )
            d = self.decisions[ci]
            d.members = (*d.members, n.name)
            self.index[n] = ci

    # Step 3 ------------------------------------------------------------------------------------
    def add_unary(self) -> None:
        for n in self.nodes:
            leader, fmap = self.roots[n]
            d = self.decisions[self.index[leader]]
            strategies = n.meta[STRATEGIES].strategies
            scale = _memory_scale(n, self.in_flight)
            for k in range(d.size):
                s = strategies[fmap[k]]
                d.unary[k] += s.compute_time + s.comm_time
                d.memory[k] += s.memory * scale
                if self.replicas_first and not _replica_strategy(n, s):
                    d.allowed[k] = False

    # Step 4 ------------------------------------------------------------------------------------
    def _edge_cost_fn(self, i: Node, written: bool) -> EdgeCost:
        """The cost of an edge out of ``i`` by interned group keys; ``written``: the consumer
        writes ``i`` in place, so no reshard (a copy) may sit on the edge."""
        info = i.meta[TENSOR]
        val = i.meta["val"]
        shape, itemsize, rg = tuple(val.shape), val.element_size(), info.requires_grad
        bucketed = bucketed_grad_sync(i)
        share = grad_sync_share(i)
        mesh, cache, keys, steps_cache = self.mesh, self.edge_cache, self.keys, self.steps_cache
        replicas_first = self.replicas_first
        compression = (
            self.compression.for_weight(read_by_lookup(i))
            if self.compression is not None and info.kind == "param"
            else self.compression
        )
        once_per_step = info.kind == "param" and self.per_sync > 1
        chain = broadcast_chain(i)
        signature = self._intern(
            (
                "value",
                shape,
                itemsize,
                rg,
                bucketed,
                share,
                once_per_step,
                compression,
                chain and (chain.dim, chain.times),
            )
        )

        def cost(g: int, h: int) -> tuple[float, float]:
            """(seconds, bytes kept) of carrying group key ``g`` into ``h`` (interned)."""
            src_key, dst = keys[g], keys[h]
            if written and dst[0] is not None and src_key[0] != dst[0]:
                return (math.inf, 0.0)
            src, stage = src_key
            key = (signature, g, h)
            v = cache.get(key)
            if v is None:
                spec, split = dst
                if spec is None:
                    v = (0.0, 0.0)
                else:
                    steps = steps_cache.get((shape, src, spec))
                    if steps is None:
                        steps = steps_cache[(shape, src, spec)] = reshard_steps(shape, src, spec, mesh.shape)
                    at, steps = moved_by_reshard(chain, shape, src, spec, mesh.shape, steps)
                    if replicas_first and any(
                        st.axis == 0 and st.kind != StepKind.TO_PARTIAL and mesh.shape[0] > 1 for st in steps
                    ):
                        cache[key] = (math.inf, 0.0)  # a collective over the replicas' axis
                        return cache[key]
                    t = edge_cost(
                        at,
                        itemsize,
                        src,
                        spec,
                        split,
                        rg,
                        mesh,
                        bucketed_sync=bucketed,
                        zero_stage=stage,
                        sync_share=share,
                        steps=steps,
                        compression=compression,
                    )
                    # Once per step: a replicated weight's gradient all-reduce (nothing gathered),
                    # and ZeRO-1's gather and reduce-scatter (``zero_stages``).
                    if once_per_step and (src == spec or stage == 1):
                        t /= self.per_sync
                    kept = kept_gather_bytes(at, itemsize, src, spec, mesh, stage, steps=steps)
                    if compression is not None and rg:  # error feedback kept from step to step
                        axes = grad_reduce_axes(split, spec, mesh, steps, stage)
                        squeezed = compressed_grad_sync(
                            shape, itemsize, spec, mesh, axes, compression, steps, stage, bucketed
                        )
                        kept += squeezed.kept if squeezed is not None else 0.0
                    v = (t, share * kept)
                cache[key] = v
            return v

        return cost

    def add_edges(self) -> None:
        pending: dict[tuple, list] = {}
        through = views_written_through(self.nodes)
        for c in self.nodes:
            c_leader, c_map = self.roots[c]
            c_i = self.index[c_leader]
            c_strats = c.meta[STRATEGIES].strategies
            written = set(written_inputs(c)) | {i for i in tensor_inputs(c) if (i, c) in through}
            for j, i in enumerate(tensor_inputs(c)):
                if i not in self.roots:
                    continue
                i_leader, i_map = self.roots[i]
                i_i = self.index[i_leader]
                i_strats = i.meta[STRATEGIES].strategies
                info = i.meta[TENSOR]
                val = i.meta["val"]
                src_groups = self._src_groups(info.kind == "param" and info.requires_grad, i_strats, i_map)
                dst_groups = self._dst_groups(c_strats, c_map, j)
                key = (
                    i_i,
                    c_i,
                    src_groups,
                    dst_groups,
                    tuple(val.shape),
                    val.element_size(),
                    info.requires_grad,
                    bucketed_grad_sync(i),
                    grad_sync_share(i),
                    i in written,
                )
                entry = pending.get(key)
                if entry is None:
                    pending[key] = [i_i, c_i, src_groups, dst_groups, self._edge_cost_fn(i, i in written), 1]
                else:
                    entry[-1] += 1
        for i_i, c_i, src_groups, dst_groups, cost, count in pending.values():
            if i_i == c_i:
                d = self.decisions[c_i]
                for k in range(d.size):
                    t, m = cost(src_groups[k], dst_groups[k])
                    d.unary[k] += t * count
                    d.memory[k] += m * count
                continue
            self._add_edge(i_i, c_i, src_groups, dst_groups, cost, count)

    def _add_edge(
        self,
        a: int,
        b: int,
        src_groups: tuple[int, ...],
        dst_groups: tuple[int, ...],
        cost: EdgeCost,
        count: int,
    ) -> None:
        g_keys = list(dict.fromkeys(src_groups))
        h_keys = list(dict.fromkeys(dst_groups))
        key = (a, b, src_groups, dst_groups)
        e = self.edges.get(key)
        if e is None:
            e = self.edges[key] = Edge(
                src=a,
                dst=b,
                src_groups=tuple(tuple(k for k, s in enumerate(src_groups) if s == g) for g in g_keys),
                dst_groups=tuple(tuple(k for k, d in enumerate(dst_groups) if d == h) for h in h_keys),
                cost=[[0.0] * len(h_keys) for _ in g_keys],
                memory=[[0.0] * len(h_keys) for _ in g_keys],
            )
        for gi, g in enumerate(g_keys):
            for hi, h in enumerate(h_keys):
                t, m = cost(g, h)
                e.cost[gi][hi] += t * count
                e.memory[gi][hi] += m * count

    def add_output_edges(self) -> None:
        """Scalar outputs (a loss) must end replicated; larger outputs are returned as laid out."""
        for i, itemsize in returned_scalars(self.gm).items():
            if i not in self.roots:
                continue
            leader, fmap = self.roots[i]
            d = self.decisions[self.index[leader]]
            strats = i.meta[STRATEGIES].strategies
            for k in range(d.size):
                d.unary[k] += scalar_output_cost(itemsize, strats[fmap[k]].outputs[0], self.mesh)

    def graph(self) -> StrategyGraph:
        node_choice = {n.name: (self.index[self.roots[n][0]], self.roots[n][1]) for n in self.nodes}
        return StrategyGraph(
            decisions=self.decisions,
            edges=list(self.edges.values()),
            node_choice=node_choice,
            mesh_shape=self.mesh.shape,
        )


def views_written_through(nodes: list[Node]) -> set[tuple[Node, Node]]:
    """The edges ``(base, view)`` of the views an in-place op writes through (T5's
    ``shifted[..., 1:].copy_(ids[..., :-1])``, a ``slice`` of ``new_zeros``), back to the tensor
    they view: like the written input itself, none may be resharded — a reshard is a copy, and the
    write would land in the copy, not in the tensor later read."""
    out: set[tuple[Node, Node]] = set()
    for c in nodes:
        for v in written_inputs(c):
            while v.op == "call_function" and op_family(v) is OpFamily.VIEW and tensor_inputs(v):
                base = tensor_inputs(v)[0]
                out.add((base, v))
                v = base
    return out


def _memory_scale(n: Node, in_flight: int) -> int:
    """How many times ``n``'s memory is held: once for a parameter's or buffer's, once per
    micro-batch in flight for activations and inputs (step 3)."""
    static = n.op == "placeholder" and n.meta[TENSOR].kind in ("param", "buffer")
    return 1 if static else in_flight


def formulate(gm: GraphModule, ctx: PassContext) -> GraphModule:
    """Build the ``StrategyGraph`` of ``gm`` on ``ctx.mesh`` (see module docstring)."""
    assert ctx.mesh is not None, "formulate needs a mesh"
    fixed = parse_fixed(ctx.captured, ctx.config, ctx.mesh.ndim)
    b = _Builder(
        gm,
        ctx.mesh,
        fixed,
        ctx.config.activations_in_flight,
        ctx.config.microbatches_per_sync,
        ctx.config.grad_compression,
        ctx.config.replicas_first,
    )
    b.build_decisions()
    b.add_unary()
    graph = b.graph()
    budget = ctx.config.device_budget  # resolved by the planning entry, or by PassContext
    if graph.min_memory() > budget:  # infeasible whatever the edges: leave them out (most of the work)
        graph.complete = False
    else:
        b.add_edges()
        b.add_output_edges()
        graph = b.graph()
    gm.meta[STRATEGY_GRAPH] = graph
    return gm

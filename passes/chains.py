"""Chains: the groups of memory-bound ops Inductor compiles into one kernel each, found by graph
structure (op families and data flow, never module or node names), so that the cost model can
charge a step compiled with ``parallelize(..., compile=True)`` (``PlanConfig.compile``) its
chains' boundary traffic (``autopar.cost.compiled``) instead of one eager kernel per op.

Words:

* **member** — a node Inductor lowers to loops and may fuse: pointwise ops (casts included),
  reductions, norms, softmax, views and copies, factories (``arange``, ``full``, …). Everything
  else bounds a chain: matmuls, convolutions and attention (library calls), the fused kernels of
  ``autopar.passes.fusion`` where the cost model assumes them (custom ops, opaque), embeddings,
  losses and routing (costed as eager: gathers and scatters), in-place writes, higher-order ops,
  placeholders.
* **depth** — the number of non-members on the longest path from the graph's inputs to a node.
  A path that leaves members through a non-member and comes back raises it, so members of equal
  depth can share a kernel without it depending on itself (Inductor's cycle check; Ansel et al.,
  ASPLOS 2024, §5).
* **chain** — a connected group of members (an edge joins a member to a member it reads) of one
  depth (:class:`Chain`). A chain of views only launches nothing.
* **role** — what costing one member needs (:class:`ChainRole`, ``node.meta["autopar.chain"]``):
  which of its tensor arguments are external values it reads first, whether its output crosses
  the chain's boundary and how many gradients come back across it, and whether it carries the
  chain's forward or backward launch (``autopar.cost.compiled``, its share).

Pass: ``annotate_chains`` (planning, ``autopar.planner.GRAPH_PASSES``, after
``annotate_fusions``) writes each member's role when the step will be compiled
(:func:`compile_assumed`) and clears them otherwise; ``annotate_cost`` and the strategies then
charge members their share.
"""

from __future__ import annotations

import logging

from torch.fx import Graph, GraphModule, Node

from autopar.cost.compiled import ChainShare
from autopar.graph import OpFamily, op_family, op_name, tensor_inputs
from autopar.ir import TENSOR
from autopar.passes import PassContext
from autopar.passes.chain_records import CHAIN, CHAINS, Chain, ChainRole, compile_assumed
from autopar.passes.fusion import FUSION, fusion_assumed

__all__ = ["CHAIN", "CHAINS", "Chain", "ChainRole", "annotate_chains", "compile_assumed", "find_chains"]

log = logging.getLogger("autopar.passes")

_MEMBER_FAMILIES = frozenset(
    [
        OpFamily.POINTWISE,
        OpFamily.VIEW,
        OpFamily.REDUCTION,
        OpFamily.NORM,
        OpFamily.BATCH_NORM,
        OpFamily.SOFTMAX,
    ]
)
_FACTORIES = frozenset(["arange", "full", "zeros", "ones", "empty", "scalar_tensor", "new_zeros", "new_ones"])


def _member(node: Node, fused: bool) -> bool:
    if node.op != "call_function" or TENSOR not in node.meta:
        return False
    if fused and FUSION in node.meta:
        return False
    name = op_name(node)
    if name.endswith("_") and name != "getitem":  # an in-place write
        return False
    if name == "getitem":
        src = node.args[0]
        return isinstance(src, Node) and _member(src, fused)
    return op_family(node) in _MEMBER_FAMILIES or name in _FACTORIES


def _rg(node: Node) -> bool:
    info = node.meta.get(TENSOR)
    return info is not None and info.requires_grad


def _root(x: Node, inside: set[Node], alias: dict[Node, bool]) -> Node:
    """The value ``x`` shows: views in the chain pass their source through."""
    while x in inside and alias[x]:
        ins = [x.args[0]] if op_name(x) == "getitem" else tensor_inputs(x)
        if not ins or not isinstance(ins[0], Node):
            break
        x = ins[0]
    return x


def _readers_outside(x: Node, inside: set[Node], alias: dict[Node, bool]) -> list[Node]:
    """The nodes outside the chain that read ``x``, directly or through views in the chain."""
    out, stack, seen = [], [x], {x}
    while stack:
        y = stack.pop()
        for u in y.users:
            if u in inside and alias[u]:
                if u not in seen:
                    seen.add(u)
                    stack.append(u)
            elif u not in inside:
                out.append(u)
    return out


def find_chains(graph: Graph, fused: bool = False) -> tuple[list[Chain], dict[Node, ChainRole]]:
    """Every chain of ``graph`` and each member's role (module docstring). ``fused``: the fused
    kernels' groups (``node.meta[FUSION]``) are opaque calls, not members."""
    from autopar.passes.annotate import is_alias, ordered_tensor_args, saved_inputs, saves_output

    nodes = list(graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    member = {n for n in nodes if _member(n, fused)}
    # 1. depth: non-members on the longest path from the inputs
    depth: dict[Node, int] = {}
    for n in nodes:
        d = 0
        for i in n.all_input_nodes:
            d = max(d, depth.get(i, 0) + (1 if i.op == "call_function" and i not in member else 0))
        depth[n] = d
    # 2. groups: members joined to the members they read at the same depth (union-find)
    parent = {n: n for n in member}

    def find(x: Node) -> Node:
        while parent[x] is not x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for n in member:
        for i in n.all_input_nodes:
            if i in member and depth[i] == depth[n]:
                a, b = find(i), find(n)
                if a is not b:
                    parent[max(a, b, key=order.__getitem__)] = min(a, b, key=order.__getitem__)
    groups: dict[Node, list[Node]] = {}
    for n in nodes:
        if n in member:
            groups.setdefault(find(n), []).append(n)
    # 3. roles
    alias = {n: is_alias(n) for n in member}
    chains: list[Chain] = []
    roles: dict[Node, ChainRole] = {}
    for index, ms in enumerate(groups.values()):
        inside = set(ms)
        counted: set[Node] = set()
        inputs: list[str] = []
        outputs: list[str] = []
        kernels = [m for m in ms if not alias[m]]
        first_fwd = kernels[0] if kernels else None
        first_bwd = next((m for m in kernels if _rg(m)), None)
        reread = any(_rg(m) and (saved_inputs(m) or saves_output(m)) for m in kernels)
        for m in ms:
            if alias[m]:  # free; gradients from outside count only on a view of an external value
                ext = _root(m, inside, alias) not in inside
                outside = [u for u in m.users if u not in inside] if ext and _rg(m) else []
                share = ChainShare(
                    tuple(False for _ in ordered_tensor_args(m)),
                    False,
                    sum(1 for u in outside if _rg(u)),
                    False,
                    False,
                    False,
                    view=True,
                )
                roles[m] = ChainRole(index, share)
                continue
            reads = []
            for a in ordered_tensor_args(m):
                r = _root(a, inside, alias)
                first = r not in inside and r not in counted
                if first:
                    counted.add(r)
                    inputs.append(r.name)
                reads.append(first)
            outside = _readers_outside(m, inside, alias)
            if outside:
                outputs.append(m.name)
            grads = sum(1 for u in outside if (u.op == "output" and _rg(m)) or (u.op != "output" and _rg(u)))
            share = ChainShare(
                tuple(reads),
                bool(outside),
                grads if _rg(m) else 0,
                m is first_fwd,
                m is first_bwd,
                reread,
                shared_grad=op_name(m) == "add",
            )
            roles[m] = ChainRole(index, share)
        chains.append(
            Chain(tuple(m.name for m in ms), depth[ms[0]], tuple(inputs), tuple(outputs), len(kernels))
        )
    return chains, roles


def annotate_chains(gm: GraphModule, ctx: PassContext) -> GraphModule:
    """Write each member's :class:`ChainRole` (``node.meta[CHAIN]``) and the chains
    (``gm.meta[CHAINS]``) when the step will be compiled (:func:`compile_assumed`); clear them
    otherwise."""
    for n in gm.graph.nodes:
        n.meta.pop(CHAIN, None)
    if not compile_assumed(ctx):
        gm.meta[CHAINS] = ()
        log.info("pass annotate_chains: the step is costed eager (compile=False)")
        return gm
    chains, roles = find_chains(gm.graph, fused=fusion_assumed(ctx))
    for n, role in roles.items():
        n.meta[CHAIN] = role
    gm.meta[CHAINS] = tuple(chains)
    ops = sum(c.computing for c in chains)
    launching = sum(1 for c in chains if c.computing)
    log.info("pass annotate_chains: %d memory-bound ops in %d compiled kernels", ops, launching)
    return gm

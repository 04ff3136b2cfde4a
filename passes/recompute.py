"""Recomputation on the whole-step program: compute a forward value again in backward instead of
saving it from forward.

``recompute_in_backward(gm, nodes)`` gives every backward reader of a node in ``nodes`` a copy of
it computed in backward, just before the first backward node that needs it; inputs of a copied
node that are themselves in ``nodes`` are copied too, the others are read as they are (and are then
what backward saves). The forward nodes stay for forward; once no backward node reads them they
are no longer saved (``passes.joint.partition`` saves exactly the forward values backward reads).

This is the one mechanism behind ZeRO-3's re-gather (``passes.overlap.regather_zero3_params``:
the nodes computed from one parameter shard, its all-gather among them) and activation
recomputation (Chen et al., arXiv 1604.06174; Korthikanti et al., arXiv 2205.05198: selective
and full recomputation choose which nodes).
"""

from __future__ import annotations

from torch.fx import GraphModule, Node

from autopar.passes.joint import PHASE, Phase

__all__ = ["recompute_in_backward"]


def recompute_in_backward(gm: GraphModule, nodes: set[Node]) -> int:
    """Copy the nodes of ``nodes`` that backward reads into backward (see module docstring);
    returns the number of nodes copied."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    bwd_readers = {
        n: [u for u in n.users if u.meta.get(PHASE) == Phase.BWD and u.op != "output"] for n in nodes
    }
    needed: set[Node] = set()
    stack = [n for n, us in bwd_readers.items() if us]
    while stack:
        n = stack.pop()
        if n in needed:
            continue
        needed.add(n)
        stack.extend(i for i in n.all_input_nodes if i in nodes)
    if not needed:
        return 0
    first_reader = min((u for n in needed for u in bwd_readers[n]), key=lambda u: order[u], default=None)
    if first_reader is None:
        # Only other copies read them (an intermediate of the chain): place before the earliest
        # backward reader of any node of the chain.
        return 0
    copies: dict[Node, Node] = {}
    with gm.graph.inserting_before(first_reader):
        for n in sorted(needed, key=lambda x: order[x]):
            c = gm.graph.node_copy(n, lambda x: copies.get(x, x))
            c.meta.update(n.meta)
            c.meta[PHASE] = Phase.BWD
            copies[n] = c
    for n, readers in bwd_readers.items():
        if n in copies:
            for u in readers:
                u.replace_input_with(n, copies[n])
    return len(copies)

"""Reading collectives and gradients off a rank program's graph: the predicates the rank-program
passes share (``passes.overlap``, ``passes.compress``, ``passes.stage_cut``).

Words: a collective is an *issue* node (``_c10d_functional.all_reduce`` …, which starts the
transfer and returns at once) and a *wait* node (``wait_tensor``, which blocks until it is done);
a *gradient all-reduce* is a sum all-reduce in the backward whose waited result is only
returned (a data-parallel weight gradient, or a bucket of them); a value is *only returned* when it reaches nothing but the program's output, through ops that only
view, copy or rearrange it (*layout-only* ops).
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from autopar.graph import OpFamily, op_family, op_info, output_node
from autopar.ir import PHASE, Phase
from autopar.program.records import FUNCTIONAL_COLLECTIVES

__all__ = ["gradient_all_reduces", "is_issue", "is_wait", "layout_only", "only_returned"]

_fc = torch.ops._c10d_functional


def is_issue(n: Node) -> bool:
    """``n`` starts a functional collective."""
    return n.op == "call_function" and n.target in FUNCTIONAL_COLLECTIVES


def is_wait(n: Node) -> bool:
    """``n`` waits for a functional collective."""
    return n.op == "call_function" and n.target is _fc.wait_tensor.default


def layout_only(n: Node) -> bool:
    """Ops that only view, copy or rearrange their input (the op table's view family and
    identity-like ops)."""
    return n.op == "call_function" and (op_family(n) is OpFamily.VIEW or op_info(n).identity_like)


def only_returned(n: Node, out: Node) -> bool:
    """True when ``n``'s value reaches nothing but the output ``out`` (through layout-only ops)."""
    for u in n.users:
        if u is out:
            continue
        if layout_only(u) and only_returned(u, out):
            continue
        return False
    return True


def gradient_all_reduces(gm: GraphModule) -> list[tuple[Node, Node]]:
    """``(issue, wait)`` of each gradient all-reduce (module docstring) in ``gm``, in order."""
    out = output_node(gm)
    found = []
    for n in gm.graph.nodes:
        if not (is_issue(n) and n.target is _fc.all_reduce.default and n.args[1] == "sum"):
            continue
        if n.meta.get(PHASE) != Phase.BWD or len(n.users) != 1:
            continue
        (w,) = n.users
        if is_wait(w) and only_returned(w, out):
            found.append((n, w))
    return found

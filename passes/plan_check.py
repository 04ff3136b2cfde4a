"""Refusing, before anything runs, a plan this rank's program cannot be built from: one made for
another program (its graph fingerprint differs; ``program_difference`` says where, in words) or,
with ``certify``, one autopar could not have made for this graph (``autopar.passes.certify``).
Pure functions of the plan and the captured program: every rank refuses the same plan, before any
process group or collective.
"""

from __future__ import annotations

import torch

from autopar.canonical import SAME_OPS
from autopar.capture import Captured, traced_by
from autopar.graph import op_name
from autopar.passes.certify import certify as certify_plan
from autopar.planfile import Plan

__all__ = ["LoweringError", "check_plan", "program_difference"]


class LoweringError(RuntimeError):
    """The plan cannot be lowered onto this graph (it names the node and what is wrong)."""


_SAME_OP = {a.overloadpacket.__name__: b.overloadpacket.__name__ for a, b in SAME_OPS.items()}
"""``SAME_OPS`` by op name, as a plan records ops."""


def program_difference(plan: Plan, cap: Captured) -> str:
    """Where ``cap``'s graph and the one ``plan`` was made for first differ, in words: a node the
    plan does not have, one with another op or shape, or one the plan has and the graph lacks (a
    model changed since planning, another batch shape, or another version of torch or of the
    model's library tracing the same code differently)."""
    planned = {n.name: n for n in plan.nodes}
    seen = {node.name for node in cap.graph.nodes}
    for node in cap.graph.nodes:
        val = node.meta.get("val")
        if node.op not in ("placeholder", "call_function") or not isinstance(val, torch.Tensor):
            continue
        p = planned.get(node.name)
        here = op_name(node) if node.op == "call_function" else node.op
        if p is None:
            where = f"this program's node {node.name} ({here}) is not in the plan"
        elif node.op == "call_function" and _SAME_OP.get(p.op, p.op) != _SAME_OP.get(here, here):
            where = f"node {node.name} is {here} here, {p.op} in the plan"
        elif tuple(p.shape) != tuple(val.shape):
            where = (
                f"node {node.name} ({here}) has shape {tuple(val.shape)} here, {tuple(p.shape)} in the plan"
            )
        else:
            continue
        return where + _versions(plan, cap)
    gone = [n.name for n in plan.nodes if n.name not in seen]
    if gone:
        where = f"the plan's node {gone[0]} ({planned[gone[0]].op}) is not in this program"
    else:
        where = "every node has the plan's name, op and shape; the graph's structure differs"
    return where + _versions(plan, cap)


def _versions(plan: Plan, cap: Captured) -> str:
    """The torch versions that traced the plan's program and this one, where they differ."""
    then, now = plan.info.get("traced_by"), traced_by(cap)
    if then and then.split(" on ")[0] != now.split(" on ")[0]:
        return f"; the plan was traced by {then}, this program by {now}"
    return ""


def check_plan(cap: Captured, plan: Plan, certify: bool = True) -> None:
    """Refuse, before anything runs, a plan made for another program (its graph fingerprint differs:
    ``program_difference`` says where) and, with ``certify``, one that is not a plan autopar could
    have made for this graph (``autopar.passes.certify``: a strategy its op does not allow, a
    reshard that does not connect its producer to its consumer). Pure: every rank raises the same."""
    if plan.fingerprint != cap.fingerprint:
        raise LoweringError(
            f"the plan was made for a different program (graph fingerprint {plan.fingerprint}, this model and "
            f"batch give {cap.fingerprint}; {program_difference(plan, cap)}): plan again for this model and "
            "input shapes"
        )
    if certify:
        certify_plan(cap.graph, plan, cap.params)

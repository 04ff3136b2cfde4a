"""Second looks at a plan: whether memory shaped it, and one more solve that may free memory.

Words:

* **memory-bound** — a plan that recomputes, or whose solver memory reaches ``MEMORY_BOUND`` of
  its budget (``memory_bound``): the memory constraint shaped it, so recomputing per activation
  (``recompute="ops"``) or in fewer layers may free the bytes a faster layout needs.
* **second look** — one more solve of the same candidate under another recomputation setting,
  kept only where it runs faster (``_second_look``); ``plan.info`` records what it gave. Used by
  ``autopar.planner.plan_captured`` (one mesh search) and by the 3D search (``autopar.refine``),
  on the meshes the setting can change (``bound_meshes``), with a bounded amount of solver work
  (``PER_ACTIVATION_WORK``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from autopar.capture import Captured
from autopar.cluster import Cluster
from autopar.config import PlanConfig
from autopar.cost.offload import activation_offload_exposed
from autopar.ir import STRATEGIES, NodeStrategies
from autopar.passes.strategies import repeated_layers
from autopar.planfile import Plan
from autopar.solver import InfeasibleError, NotBetter

__all__ = [
    "MEMORY_BOUND",
    "PER_ACTIVATION_WORK",
    "activation_copy_floor",
    "bound_meshes",
    "fewer_layers_count",
    "in_fewer_layers",
    "look_work",
    "memory_bound",
    "per_activation",
]


MEMORY_BOUND = 0.9
"""A plan whose solver memory reaches this fraction of its budget was shaped by the memory
constraint (``memory_bound``): per-activation recomputation may free the bytes a faster layout
needs."""

PER_ACTIVATION_WORK = 4.0
"""CP-SAT work units (``SolverConfig.work_limit``) each mesh of a per-activation second look may
take (here and in the 3D search's, ``autopar.refine``). Its solves are wanted only where they beat
the best step found, and proving that one cannot is what takes long: on Megatron-LM's Table 1 row
1 with 4 micro-batches one mesh took 11.7 units (24 s on this 2-core machine) to end with no
better plan, while every solve that found a plan, there and on LLaMA-3-8B on 64 H100, finished
within 3.2. A solve stopped at the limit with a plan keeps it."""


def look_work(config: PlanConfig) -> float:
    """The work limit of a per-activation second look under ``config``: ``PER_ACTIVATION_WORK``,
    or the caller's own ``work_limit`` where that is tighter."""
    return PER_ACTIVATION_WORK if config.work_limit is None else min(config.work_limit, PER_ACTIVATION_WORK)


def activation_copy_floor(gm: torch.fx.GraphModule, cluster: Cluster) -> float:
    """Seconds a micro-batch's offloaded activations take at least on the host link, out in
    the forward and back in the backward (``autopar.cost.offload.activation_offload_exposed``
    with nothing under it), each node at its smallest offloaded strategy (``Strategy.offloaded``):
    a lower bound of a rank's busy time like its compute path, for any choice of strategies."""
    if cluster.host is None:
        return 0.0
    least = 0.0
    for node in gm.graph.nodes:
        ns = node.meta.get(STRATEGIES)
        if isinstance(ns, NodeStrategies) and ns.strategies:
            least += min(s.offloaded for s in ns.strategies)
    return 2 * activation_offload_exposed(least, 0.0, cluster.host.link)


def memory_bound(plan: Plan, budget: float) -> bool:
    """Whether memory shaped ``plan``: it recomputes, or the memory the solver reached lies within
    ``MEMORY_BOUND`` of ``budget`` (bytes, as the solver counts them)."""
    reached = plan.info.get("solver", {}).get("memory")
    return plan.recompute != "none" or (reached is not None and reached >= MEMORY_BOUND * budget)


def bound_meshes(plan: Plan, budget: float) -> tuple[tuple[int, ...], ...] | None:
    """The meshes of ``plan``'s solve (``info["meshes_tried"]``) whose optimum per-activation
    recomputation may change, where ``plan`` keeps every activation: those that did not fit, and
    those whose memory reached ``MEMORY_BOUND`` of ``budget``. Recomputing only relaxes the memory
    constraint (at a cost in time), so a mesh solved clear of it, or cut off by time alone, keeps
    its plan. ``None`` (every mesh) where ``plan`` recomputes (a lighter choice may beat it on any
    mesh) or the list is missing."""
    tried = plan.info.get("meshes_tried")
    if plan.recompute != "none" or not tried:
        return None
    out = []
    for t in tried:
        bound = not t.get("feasible") and "pruned" not in t
        if t.get("feasible") and t.get("memory") is not None:
            bound = t["memory"] >= MEMORY_BOUND * budget
        if bound:
            out.append(tuple(t["mesh"]))
    return tuple(out)


def per_activation(
    plan: Plan,
    config: PlanConfig,
    cluster: Cluster,
    attempt: Callable[[PlanConfig], Plan],
    score: Callable[[Plan], float] | None,
) -> Plan:
    """Under ``recompute="auto"``, where memory shaped ``plan`` (``memory_bound``): planned once
    more with ``recompute="ops"`` (the solver chooses, per activation, what to recompute:
    ``passes.recompute_ops``; the bytes it frees may let another mesh fit) on the meshes that can
    change (``bound_meshes``), kept where it runs faster. ``plan.info["per_activation_tried"]``
    says what it gave. ``disable=("per_activation",)`` turns the second look off."""
    if config.recompute != "auto" or "per_activation" in config.disable:
        return plan
    budget = config.device_budget
    if not memory_bound(plan, budget):
        return plan
    meshes = bound_meshes(plan, budget)
    if meshes == ():
        return plan
    return _second_look(
        plan,
        config.replace(recompute="ops", recompute_layers=None, meshes=meshes, work_limit=look_work(config)),
        attempt,
        score,
        "per_activation_tried",
        {},
        ("step", "without_step"),
        {"without": plan.recompute},
    )


def _second_look(
    plan: Plan,
    config: PlanConfig,
    attempt: Callable[[PlanConfig], Plan],
    score: Callable[[Plan], float] | None,
    key: str,
    note: dict[str, Any],
    names: tuple[str, str],
    extra: dict[str, Any],
) -> Plan:
    """``plan`` against one more solve under ``config``: the faster of the two (by ``score``, else
    the predicted step), with ``info[key]`` saying what the other gave: ``note``, then the second
    solve's step and ``plan``'s (``names``) and ``extra`` — or why the solve failed."""
    try:
        other = attempt(config)
    except (InfeasibleError, NotBetter) as e:
        plan.info[key] = note | {"failed": str(e).splitlines()[0][:200]}
        return plan
    steps = [score(p) if score is not None else p.predicted.step_time for p in (plan, other)]
    best = other if steps[1] < steps[0] else plan
    best.info[key] = note | {names[0]: steps[1], names[1]: steps[0]} | extra
    return best


def fewer_layers_count(plan: Plan, cap: Captured, budget: float) -> int | None:
    """The fewest repeated layers ``plan``'s recomputation (in every layer) could run in and fit
    ``budget``: memory falls linearly with the layers recomputed (they are alike), from what plans
    keeping every activation reach at least (``plan.info["kept_memory"]``) to ``plan``'s own at all
    ``L``, so ``k = ⌈L · (kept − budget) / (kept − plan's)⌉`` is where ``plan``'s layouts would fit.
    ``None`` where that is every layer, or no figure says."""
    kept = plan.info.get("kept_memory")
    reached = plan.info.get("solver", {}).get("memory")
    total = len(repeated_layers(cap.gm.graph))  # annotated by the planner's graph passes
    if plan.recompute_layers is not None or kept is None or reached is None or kept <= reached or total < 2:
        return None
    k = math.ceil(total * (kept - budget) / (kept - reached))
    return k if 1 <= k < total else None


def in_fewer_layers(
    plan: Plan,
    config: PlanConfig,
    cluster: Cluster,
    cap: Captured,
    attempt: Callable[[PlanConfig], Plan],
    score: Callable[[Plan], float] | None,
) -> Plan:
    """``plan`` recomputes in every repeated layer; the same mode in the first ``k`` only
    (``fewer_layers_count``), one solve more, where that fits and runs faster
    (``PlanConfig.recompute_layers``). ``plan.info["recompute_layers_tried"]`` says what it gave."""
    budget = config.device_budget
    k = fewer_layers_count(plan, cap, budget)
    if k is None:
        return plan
    note: dict[str, Any] = {"layers": k, "of": len(repeated_layers(cap.gm.graph))}
    return _second_look(
        plan,
        config.replace(recompute_layers=k),
        attempt,
        score,
        "recompute_layers_tried",
        note,
        ("step", "every_layer_step"),
        {},
    )

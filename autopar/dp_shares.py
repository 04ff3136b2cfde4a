"""Unequal data-parallel shares: on a mixed cluster, the ranks of a faster device kind run more of
the step's micro-batches (``PipelinePlan.dp_shares``).

Words:

* **replica** — the ranks at one coordinate of the stage mesh's first axis (with one stage, the
  whole mesh's: the first axis is the outermost, so a replica is consecutive ranks — whole nodes or
  part of one — of one device kind where the cluster's node groups allow it;
  ``Cluster.replicas``). Replicas differ in what they compute only in the rows they are given.
* **share** — how many micro-batches of one size a replica runs in the step. Equal shares are the
  plain plan (each runs ``microbatches``); unequal ones sum to the same total, ``microbatches ×
  replicas``, so the batch and the loss are unchanged.
* **blocker** — what in a plan ties the replicas together inside a micro-batch, so that they
  must run the same number: a collective over the first axis in the forward or the input
  gradient (an activation gathered, a weight gathered for use as ZeRO-3 does, an activation's
  gradient all-reduced; not a replicated value made partial, which stays where it is), an input
  not split by rows over it, a loss not left partial over it.
  Weights' gradients are reduced once per step (``passes.stage_cut.defer_reductions``) and the
  loss's parts are summed once after the schedule (``autopar.runtime.pipeline_runner``): neither
  blocks.

Choosing the shares (``balance``) is the min-max assignment of identical jobs to machines of
different speeds: give each replica one micro-batch, then each further one to the replica that
would finish it soonest. Greedy is optimal here: the finishing time ``(k + 1) · t_j`` only grows
with ``k``, so an exchange argument keeps every prefix of the greedy assignment optimal
(Graham, "Bounds on multiprocessing timing anomalies", SIAM J. Appl. Math. 1969, for uniform
machines with unit jobs). This is Metis's (ATC'24) "data-parallel share proportional to speed" on a
micro-batch grid: what the batch allows.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from torch.fx import Graph

from autopar.passes.param_syncs import weight_syncs
from autopar.placement import Partial, Shard, parse_spec
from autopar.planfile import Plan

__all__ = ["balance", "share_blockers"]


def balance(times: Sequence[float], total: int) -> tuple[int, ...]:
    """Shares of ``total`` micro-batches over replicas taking ``times[j]`` seconds each for one,
    at least one each, minimizing the slowest replica's ``share · time`` (module docstring)."""
    n = len(times)
    if n == 0 or total < n:
        raise ValueError(f"balance: {total} micro-batches cannot give each of {n} replicas one")
    if min(times) <= 0:
        raise ValueError(f"balance: every replica's time per micro-batch must be positive, got {list(times)}")
    shares = [1] * n
    heap = [(2 * t, j) for j, t in enumerate(times)]
    heapq.heapify(heap)
    for _ in range(total - n):
        _, j = heapq.heappop(heap)
        shares[j] += 1
        heapq.heappush(heap, ((shares[j] + 1) * times[j], j))
    return tuple(shares)


def share_blockers(plan: Plan, graph: Graph | None = None) -> list[str]:
    """What in ``plan`` (a stage plan of one stage) keeps the replicas of its first mesh axis
    running equal shares (module docstring: blocker); empty where unequal shares can run.
    ``graph``: the captured graph the plan was made for, where the lowering's weight syncs are
    read from (``passes.param_syncs``: a position-embedding lookup's gradient is reduced at its
    weight, once per step); without it every activation's gradient sync blocks."""
    mesh = tuple(plan.mesh_shape)
    if not mesh or mesh[0] < 2:
        return [f"the mesh {mesh} has no first axis of two or more to share"]
    why: list[str] = []
    for path, spec in plan.inputs.items():
        s = parse_spec(spec)
        if s and not (isinstance(s[0], Shard) and s[0].dim == 0):
            why.append(f"input {path} is laid out {spec[0]} on the first axis, not split by rows (S(0))")
    kinds = {n.name: n.kind for n in plan.nodes}
    at_weight: set[tuple[str, tuple[int, ...]]] = set()
    if graph is not None:
        values, _ = weight_syncs(graph, {n for n, k in kinds.items() if k == "param"}, plan)
        at_weight = {(v.name, axes) for v, axes in values}
    for r in plan.distinct_reshards():
        # A replicated value made partial stays on one coordinate: no communication either way.
        on_first = [
            c for c in r.collectives if ("axis=0," in c or "axis=0)" in c) and not c.startswith("to_partial")
        ]
        if on_first:
            why.append(f"{r.producer} → {r.consumer}: {on_first[0]} over the first axis in every micro-batch")
        elif (
            0 in r.grad_sync_axes
            and kinds.get(r.producer) != "param"
            and (r.producer, tuple(a for a in r.grad_sync_axes if mesh[a] > 1)) not in at_weight
        ):
            why.append(f"{r.producer}: its gradient is all-reduced over the first axis in every micro-batch")
    for n in plan.nodes:
        if n.comms and n.comms[0]:
            why.append(f"{n.name} ({n.op}): {n.comms[0]} over the first axis inside the op")
    outs = [n for n in plan.nodes if n.kind == "op" and n.shape == () and n.outputs]
    loss = outs[-1] if outs else None
    if loss is None or not isinstance(parse_spec(loss.outputs[0])[0], Partial):
        got = "no scalar output" if loss is None else f"{loss.name} laid out {loss.outputs[0][0]}"
        why.append(f"the loss is not partial over the first axis ({got})")
    return why

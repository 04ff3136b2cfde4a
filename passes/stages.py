"""Where to cut a captured model into pipeline stages, found by graph structure.

Words:

* **position** — a point between two consecutive compute nodes of the captured graph (in its
  topological order); cutting there puts everything before in earlier stages.
* **cut bytes** — the activation bytes that cross a position: values computed before it and read
  after it (or returned). Parameters and user inputs do not cross: a stage reads them where it
  needs them. A value read several positions later (an attention mask, rotary tables, a
  residual) crosses every position in between, so it counts at each.
* **seam** — a position whose cut bytes of values a gradient flows through are the smallest (within
  ``slack``, 0 unless too few seams are found: then 5 %) over the positions where any such value
  crosses: between the repeated layers of a
  transformer, exactly the residual stream (the hidden state). Values without a gradient that
  every layer reads (an attention mask, rotary tables, position ids) are sent to the stages that
  read them as well, but do not decide where seams are: they cross every layer boundary alike.
* **balance** — among seams, the ``S − 1`` cuts minimising the largest stage's compute time
  (forward + backward, from ``autopar.ir.NodeCost`` or given per node), by dynamic programming
  over the seams (the classic linear partition problem; Megatron-LM cuts at layer counts, which
  is this with equal layers and no embedding or head).
* **layer cuts** — Megatron-LM's own rule (``layer_cuts``, what ``autopar.layouts.megatron``
  states): every stage holds the same number of repeated layers, the embedding going with the
  first and the head with the last, whatever they cost.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from torch.fx import GraphModule, Node

from autopar.graph import outer_instance
from autopar.ir import COST, TENSOR

__all__ = ["cut_bytes", "layer_cuts", "seams", "stage_cuts"]


def _compute_nodes(gm: GraphModule) -> list[Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function"]


def _bytes(n: Node) -> float:
    info = n.meta.get(TENSOR)
    cost = n.meta.get(COST)
    if cost is not None:
        return float(cost.output_bytes)
    return float(getattr(info, "nbytes", 0.0) or 0.0)


def _rg(n: Node) -> bool:
    info = n.meta.get(TENSOR)
    return info is not None and info.requires_grad


def _stages_of(nodes: list[Node], cuts: list[int]) -> dict[str, int]:
    """Node name -> stage, stage ``k`` starting at position ``cuts[k - 1]``."""
    stage_of: dict[str, int] = {}
    s = 0
    for i, n in enumerate(nodes):
        while s < len(cuts) and i >= cuts[s]:
            s += 1
        stage_of[n.name] = s
    return stage_of


def cut_bytes(gm: GraphModule, grad_only: bool = False) -> list[float]:
    """Cut bytes after each compute node (module docstring); the last entry is the model's outputs.
    ``grad_only``: count only values a gradient flows back through."""
    nodes = _compute_nodes(gm)
    pos = {n: i for i, n in enumerate(nodes)}
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    last_read = {}
    for n in nodes:
        readers = [pos.get(u, len(nodes)) if u is not out_node else len(nodes) for u in n.users]
        last_read[n] = max(readers, default=pos[n])
    diff = [0.0] * (len(nodes) + 1)
    for n in nodes:
        if last_read[n] > pos[n] and (_rg(n) or not grad_only):
            b = _bytes(n)
            diff[pos[n]] += b
            diff[last_read[n]] -= b
    out, run = [], 0.0
    for i in range(len(nodes)):
        run += diff[i]
        out.append(run)
    return out


SEAMS = "autopar.seams"
"""``gm.meta`` key: the graph's seams by ``slack`` (a function of the graph and its cost
annotations, asked for by every cut the 3D search tries)."""


def seams(gm: GraphModule, slack: float = 0.0) -> list[int]:
    """Positions (after compute node ``i``) whose cut bytes are within ``slack`` of the smallest
    over the interior positions (module docstring), views excluded (a cut after a view would
    send the view, not its storage)."""
    known = gm.meta.setdefault(SEAMS, {})
    # Keyed too by whether the cost pass has run: cut bytes read its output sizes where it has.
    key = (slack, any(COST in n.meta for n in gm.graph.nodes), len(gm.graph.nodes))
    if key not in known:
        known[key] = _seams(gm, slack)
    return list(known[key])


def _seams(gm: GraphModule, slack: float) -> list[int]:
    cb = cut_bytes(gm, grad_only=True)
    nodes = _compute_nodes(gm)
    interior = [i for i in range(len(nodes) - 1) if cb[i] > 0]
    if not interior:
        return []
    least = min(cb[i] for i in interior)
    return [i for i in interior if cb[i] <= least * (1 + slack)]


def stage_cuts(
    gm: GraphModule,
    num_stages: int,
    node_time: Callable[[Node], float] | None = None,
    slack: float = 0.0,
    *,
    node_memory: Callable[[Node], tuple[float, float]] | None = None,
    fits: Callable[[int, float, float], bool] | None = None,
) -> dict[str, int]:
    """Captured node name -> stage ``0 … num_stages − 1`` for every compute node, cut at seams and
    balanced (module docstring). Raises ``ValueError`` when the graph has fewer seams than cuts.

    ``node_memory`` and ``fits`` (together): only cuts where every stage ``k`` fits are considered,
    ``fits(k, static, activation)`` given the sums of ``node_memory(n) = (static bytes, activation
    bytes)`` over the stage's nodes (the memory-constrained linear partition); ``ValueError`` when
    no cut at the seams fits. ``fits`` is asked about many stages at once: ``static`` and
    ``activation`` are numpy arrays, and it answers elementwise (arithmetic and comparisons)."""
    nodes = _compute_nodes(gm)
    if num_stages == 1:
        return {n.name: 0 for n in nodes}

    def default_time(n: Node) -> float:
        c = n.meta.get(COST)
        return float(c.fwd_time + c.bwd_time) if c is not None else 0.0

    t = node_time or default_time
    cand = seams(gm, slack)
    if len(cand) < num_stages - 1 and slack < 0.05:  # too few exact seams: allow 5 % more bytes
        cand = seams(gm, 0.05)
    if len(cand) < num_stages - 1:
        raise ValueError(
            f"cannot cut the model into {num_stages} pipeline stages: it has {len(cand)} places where only the "
            f"smallest activation crosses (between repeated layers); use pp <= {len(cand) + 1}"
        )
    # Prefix sums of time and memory over the nodes, read at the stage ends only.
    times = np.array([t(n) for n in nodes], dtype=float)
    mem = np.array([node_memory(n) for n in nodes], dtype=float).reshape(-1, 2) if node_memory else None
    ends = np.array([c + 1 for c in cand] + [len(nodes)])  # a stage ending after node c: nodes[:c + 1]
    prefix = np.concatenate(([0.0], np.cumsum(times)))[ends]
    if mem is not None:
        static, act = (np.concatenate(([0.0], np.cumsum(mem[:, i])))[ends] for i in (0, 1))

    def ok(k: int, a: slice | None, b: int | slice) -> np.ndarray | bool:
        """Stage ``k`` holding nodes from the ends ``a`` (positions into ``ends``; ``None`` for the
        start) to end ``b`` fits (always, without ``fits``)."""
        if fits is None or mem is None:
            return True
        s0, a0 = (static[a], act[a]) if a is not None else (0.0, 0.0)
        return fits(k, static[b] - s0, act[b] - a0)

    J = len(ends) - 1  # candidate ends; index J is the model's end
    # best[k][j]: the smallest largest-stage time cutting nodes[:ends[j]] into k + 1 stages (the
    # classic linear partition: best[k][j] = min_i max(best[k−1][i], time of ends[i]..ends[j])).
    inf = float("inf")
    best = np.full((num_stages - 1, J), inf)
    back = np.full((num_stages - 1, J), -1)
    fit = ok(0, None, slice(0, J))
    best[0] = prefix[:J] if fit is True else np.where(fit, prefix[:J], inf)
    for k in range(1, num_stages - 1):
        for j in range(1, J):
            v = np.maximum(best[k - 1][:j], prefix[j] - prefix[:j])
            fit = ok(k, slice(0, j), j)
            if fit is not True:
                v = np.where(fit, v, inf)
            i = int(np.argmin(v))  # the first minimum, as a loop over i would keep it
            if v[i] < inf:
                best[k][j], back[k][j] = v[i], i
    last = num_stages - 2
    tail = np.maximum(best[last], prefix[J] - prefix[:J])
    tail[ends[:J] >= ends[J]] = inf
    fit = ok(num_stages - 1, slice(0, J), J)
    if fit is not True:
        tail = np.where(fit, tail, inf)
    j = int(np.argmin(tail))
    if tail[j] == inf:
        raise ValueError(
            f"no cut of the model into {num_stages} pipeline stages at its seams fits the memory"
        )
    cuts = []
    for k in range(last, -1, -1):
        cuts.append(int(ends[j]))
        j = int(back[k][j])
    cuts.reverse()
    return _stages_of(nodes, cuts)


def layer_cuts(gm: GraphModule, num_stages: int) -> dict[str, int]:
    """Captured node name -> stage, every stage holding ``L / num_stages`` of the model's ``L``
    repeated layers (module docstring, layer cuts), cut at the seam after each stage's last
    layer. The repeated layers are the instances of the most repeated module path (``blocks.3``,
    ``model.layers.3``; an encoder-decoder's encoder and decoder layers count together, in order).
    Raises ``ValueError`` when the layers do not divide evenly or no seam follows a stage's last
    layer."""
    nodes = _compute_nodes(gm)
    if num_stages == 1:
        return {n.name: 0 for n in nodes}
    instance = []
    for n in nodes:
        info = n.meta.get(TENSOR)
        path = outer_instance(info.module) if info is not None else ""
        instance.append(path if path.rsplit(".", 1)[-1].isdigit() else "")
    order: list[str] = list(dict.fromkeys(i for i in instance if i))
    layers = len(order)
    if layers % num_stages:
        raise ValueError(
            f"{layers} repeated layers do not divide into {num_stages} stages of equal layer counts; "
            f"use a stage count dividing {layers}"
        )
    per = layers // num_stages
    last_of = {}
    for i, p in enumerate(instance):
        if p:
            last_of[p] = i
    cand = set(seams(gm)) | set(seams(gm, 0.05))
    cuts = []
    for k in range(1, num_stages):
        boundary = last_of[order[k * per - 1]]  # the stage's last layer ends after this node
        after = [c for c in sorted(cand) if boundary <= c < last_of[order[k * per]]]
        if not after:
            raise ValueError(
                f"no seam between layer {k * per - 1} and layer {k * per} to cut stage {k - 1} at"
            )
        cuts.append(after[0] + 1)
    return _stages_of(nodes, cuts)

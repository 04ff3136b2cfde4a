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


def seams(gm: GraphModule, slack: float = 0.0) -> list[int]:
    """Positions (after compute node ``i``) whose cut bytes are within ``slack`` of the smallest
    over the interior positions (module docstring), views excluded (a cut after a view would
    send the view, not its storage)."""
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
    no cut at the seams fits."""
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
    prefix = [0.0]
    static, act = [0.0], [0.0]
    for n in nodes:
        prefix.append(prefix[-1] + t(n))
        sm, am = node_memory(n) if node_memory is not None else (0.0, 0.0)
        static.append(static[-1] + sm)
        act.append(act[-1] + am)

    def ok(k: int, a: int, b: int) -> bool:
        """Stage ``k`` holding nodes[a:b] fits (always, without ``fits``)."""
        return fits is None or fits(k, static[b] - static[a], act[b] - act[a])

    ends = [c + 1 for c in cand]  # a stage ending after node c covers nodes [start, c + 1)
    total = len(nodes)
    # best[k][j]: the smallest largest-stage time cutting nodes[:ends[j]] into k + 1 stages.
    inf = float("inf")
    best = [[inf] * len(ends) for _ in range(num_stages - 1)]
    back = [[-1] * len(ends) for _ in range(num_stages - 1)]
    for j, e in enumerate(ends):
        if ok(0, 0, e):
            best[0][j] = prefix[e]
    for k in range(1, num_stages - 1):
        for j, e in enumerate(ends):
            for i in range(j):
                if best[k - 1][i] == inf or not ok(k, ends[i], e):
                    continue
                v = max(best[k - 1][i], prefix[e] - prefix[ends[i]])
                if v < best[k][j]:
                    best[k][j], back[k][j] = v, i
    last = num_stages - 2

    def finish(j: int) -> float:
        if ends[j] >= total or not ok(num_stages - 1, ends[j], total):
            return inf
        return max(best[last][j], prefix[total] - prefix[ends[j]])

    j_best = min(range(len(ends)), key=finish)
    if finish(j_best) == inf:
        raise ValueError(
            f"no cut of the model into {num_stages} pipeline stages at its seams fits the memory"
        )
    cuts = []
    j = j_best
    for k in range(last, -1, -1):
        cuts.append(ends[j])
        j = back[k][j]
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

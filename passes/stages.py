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
* **boundary** — a position that exactly one value a gradient flows through crosses: between
  the blocks of any network (a transformer's residual stream, a CNN's feature map, an MLP-Mixer's
  tokens), wherever the seams are not. A classifier's smallest crossing is its logits (batch ×
  classes), so its seams all lie at the head: where the cut at the seams leaves a stage *idle*
  (holding no parameter, or under ``IDLE_SHARE`` of the mean stage's time), the cut is made among
  the boundaries too, and kept where it balances better.
* **balance** — among seams, the ``S − 1`` cuts minimising the largest stage's compute time
  (forward + backward, from ``autopar.ir.NodeCost`` or given per node), by dynamic programming
  over the seams (the classic linear partition problem; Megatron-LM cuts at layer counts, which
  is this with equal layers and no embedding or head). Every stage reads at least one parameter:
  a pipeline rank holding none would have nothing to train (``torch.optim`` refuses an empty
  parameter list), so no cut makes one; where none can be avoided, the stage count is refused.
* **layer cuts** — Megatron-LM's own rule (``layer_cuts``, what ``autopar.layouts.megatron``
  states): every stage holds the same number of repeated layers, the embedding going with the
  first and the head with the last, whatever they cost.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np
from torch.fx import GraphModule, Node

from autopar.graph import outer_instance
from autopar.ir import COST, TENSOR

__all__ = ["IDLE_SHARE", "boundaries", "cut_bytes", "layer_cuts", "seams", "stage_cuts"]

IDLE_SHARE = 0.1
"""A stage with less than this share of the mean stage's compute time is idle (module docstring)."""


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


def boundaries(gm: GraphModule) -> list[int]:
    """Interior positions (after compute node ``i``) that exactly one value a gradient flows
    through crosses (module docstring, boundary)."""
    nodes = _compute_nodes(gm)
    pos = {n: i for i, n in enumerate(nodes)}
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    diff = [0] * (len(nodes) + 1)
    for n in nodes:
        if not _rg(n):
            continue
        last = max(
            (pos.get(u, len(nodes)) if u is not out_node else len(nodes) for u in n.users), default=pos[n]
        )
        if last > pos[n]:
            diff[pos[n]] += 1
            diff[last] -= 1
    out, run = [], 0
    for i in range(len(nodes) - 1):
        run += diff[i]
        if run == 1:
            out.append(i)
    return out


def _reads_param(n: Node) -> bool:
    for i in n.all_input_nodes:
        info = i.meta.get(TENSOR)
        if i.op == "placeholder" and info is not None and info.kind == "param":
            return True
    return False


def stage_cuts(
    gm: GraphModule,
    num_stages: int,
    node_time: Callable[[Node], float] | None = None,
    slack: float = 0.0,
    *,
    node_memory: Callable[[Node], tuple[float, float]] | None = None,
    fits: Callable[[int, float, float], bool] | None = None,
    stage_time: Callable[[Node, int], float] | None = None,
) -> dict[str, int]:
    """Captured node name -> stage ``0 … num_stages − 1`` for every compute node, cut at seams and
    balanced (module docstring). Raises ``ValueError`` when the graph has fewer seams than cuts.

    ``node_memory`` and ``fits`` (together): only cuts where every stage ``k`` fits are considered,
    ``fits(k, static, activation)`` given the sums of ``node_memory(n) = (static bytes, activation
    bytes)`` over the stage's nodes (the memory-constrained linear partition); ``ValueError`` when
    no cut at the seams fits. ``fits`` is asked about many stages at once: ``static`` and
    ``activation`` are numpy arrays, and it answers elementwise (arithmetic and comparisons).

    ``stage_time(n, k)``: a node's time where stage ``k`` runs, where stages run on devices of
    different speeds (a mixed cluster's pipeline ranks, ``autopar.pipelined``); the partition then
    balances each stage's time on its own devices. Default ``node_time`` on every stage."""
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
    if stage_time is not None:
        times = np.array([[stage_time(n, k) for n in nodes] for k in range(num_stages)], dtype=float)
    else:
        times = np.tile(np.array([t(n) for n in nodes], dtype=float), (num_stages, 1))
    mem = np.array([node_memory(n) for n in nodes], dtype=float).reshape(-1, 2) if node_memory else None
    held = np.array([_reads_param(n) for n in nodes], dtype=float)
    part = _Partition(times, mem, held, fits, num_stages)
    cuts, why = part.cut(cand), part.why
    if cuts is None or part.idle(cuts):
        wider = sorted(set(cand) | set(boundaries(gm)))
        alt = part.cut(wider) if len(wider) > len(cand) else None
        if alt is not None and (
            cuts is None or (not part.idle(alt) and part.largest(alt) < part.largest(cuts))
        ):
            cuts = alt
        elif cuts is None and len(wider) > len(cand):
            why = part.why
        cand = wider
    if cuts is None:
        if why == "seams":
            raise ValueError(
                f"cannot cut the model into {num_stages} pipeline stages: it has {len(cand)} places where only the "
                f"smallest activation crosses (between repeated layers); use pp <= {len(cand) + 1}"
            )
        if why == "params":
            raise ValueError(
                f"cannot cut the model into {num_stages} pipeline stages that each read a parameter: a pipeline "
                f"rank holding none would have nothing to train (torch.optim refuses an empty parameter "
                f"list); use pp <= {part.most_stages(cand)}"
            )
        raise ValueError(
            f"no cut of the model into {num_stages} pipeline stages at its seams fits the memory"
        )
    return _stages_of(nodes, cuts)


class _Partition:
    """The linear partition of the compute nodes into ``S`` contiguous stages ending at candidate
    positions, minimising the largest stage's time, every stage reading a parameter and, with
    ``fits``, fitting its memory (``stage_cuts``). ``times[k]``: each node's time on stage ``k``."""

    def __init__(
        self,
        times: np.ndarray,
        mem: np.ndarray | None,
        held: np.ndarray,
        fits: Callable[[int, float, float], bool] | None,
        S: int,
    ) -> None:
        self.times, self.mem, self.fits, self.S = times, mem, fits, S
        self.held_prefix = np.concatenate(([0.0], np.cumsum(held)))
        self.time_prefix = np.concatenate((np.zeros((S, 1)), np.cumsum(times, axis=1)), axis=1)
        self.why = ""
        """Why the last ``cut`` found none: ``"seams"``, ``"params"`` or ``"memory"``."""

    def stage_times(self, cuts: list[int]) -> list[float]:
        edges = [0, *cuts, self.times.shape[1]]
        return [
            float(self.time_prefix[k][b] - self.time_prefix[k][a])
            for k, (a, b) in enumerate(itertools.pairwise(edges))
        ]

    def largest(self, cuts: list[int]) -> float:
        return max(self.stage_times(cuts))

    def idle(self, cuts: list[int]) -> bool:
        """A stage reads no parameter, or has under ``IDLE_SHARE`` of the mean stage's time."""
        edges = [0, *cuts, self.times.shape[1]]
        if any(self.held_prefix[b] == self.held_prefix[a] for a, b in itertools.pairwise(edges)):
            return True
        per = self.stage_times(cuts)
        mean = sum(per) / len(per)
        return mean > 0 and min(per) < IDLE_SHARE * mean

    def most_stages(self, cand: list[int]) -> int:
        """The most stages that each read a parameter, cut at ``cand`` (greedy: cut as early as
        the stage so far reads one and the rest still does)."""
        n, hp = self.times.shape[1], self.held_prefix
        start, stages = 0, 1
        for c in cand:
            if hp[c + 1] > hp[start] and hp[n] > hp[c + 1]:
                start, stages = c + 1, stages + 1
        return stages

    def cut(self, cand: list[int]) -> list[int] | None:
        """The cut positions (stage ``k + 1`` starts at ``cuts[k]``), or ``None`` (``why`` set)."""
        S, n = self.S, self.times.shape[1]
        if len(cand) < S - 1:
            self.why = "seams"
            return None
        ends = np.array([c + 1 for c in cand] + [n])  # a stage ending after node c: nodes[:c + 1]
        prefix = self.time_prefix[:, ends]  # prefix[k][j]: nodes[:ends[j]]'s time on stage k
        hp = self.held_prefix[ends]
        mem = self.mem
        if mem is not None:
            static, act = (np.concatenate(([0.0], np.cumsum(mem[:, i])))[ends] for i in (0, 1))

        def ok(k: int, a: slice | None, b: int | slice) -> np.ndarray:
            """Stage ``k`` from the ends ``a`` (positions into ``ends``; ``None``: the start) to end
            ``b`` reads a parameter and fits (always, without ``fits``)."""
            h0 = hp[a] if a is not None else 0.0
            good = np.asarray(hp[b] - h0 > 0)
            if self.fits is None or mem is None:
                return good
            s0, a0 = (static[a], act[a]) if a is not None else (0.0, 0.0)
            return good & np.asarray(self.fits(k, static[b] - s0, act[b] - a0), dtype=bool)

        def ok_params(a: slice | None, b: int | slice) -> np.ndarray:
            h0 = hp[a] if a is not None else 0.0
            return np.asarray(hp[b] - h0 > 0)

        J = len(ends) - 1  # candidate ends; index J is the model's end
        # best[k][j]: the smallest largest-stage time cutting nodes[:ends[j]] into k + 1 stages (the
        # classic linear partition: best[k][j] = min_i max(best[k−1][i], time of ends[i]..ends[j])).
        inf = float("inf")
        best = np.full((S - 1, J), inf)
        back = np.full((S - 1, J), -1)
        best[0] = np.where(ok(0, None, slice(0, J)), prefix[0][:J], inf)
        params_only = np.full((S - 1, J), False)  # the same recursion with the parameter rule alone
        params_only[0] = ok_params(None, slice(0, J))
        for k in range(1, S - 1):
            for j in range(1, J):
                v = np.maximum(best[k - 1][:j], prefix[k][j] - prefix[k][:j])
                v = np.where(ok(k, slice(0, j), j), v, inf)
                i = int(np.argmin(v))  # the first minimum, as a loop over i would keep it
                if v[i] < inf:
                    best[k][j], back[k][j] = v[i], i
                params_only[k][j] = bool(np.any(params_only[k - 1][:j] & ok_params(slice(0, j), j)))
        last = S - 2
        tail = np.maximum(best[last], prefix[S - 1][J] - prefix[S - 1][:J])
        tail[ends[:J] >= ends[J]] = inf
        tail = np.where(ok(S - 1, slice(0, J), J), tail, inf)
        j = int(np.argmin(tail))
        if tail[j] == inf:
            reach = params_only[last] & ok_params(slice(0, J), J) & (ends[:J] < ends[J])
            self.why = "memory" if bool(np.any(reach)) else "params"
            return None
        cuts = []
        for k in range(last, -1, -1):
            cuts.append(int(ends[j]))
            j = int(back[k][j])
        cuts.reverse()
        return cuts


def layer_cuts(gm: GraphModule, num_stages: int) -> dict[str, int]:
    """Captured node name -> stage, every stage holding ``L / num_stages`` of the model's ``L``
    repeated layers (module docstring, layer cuts), cut at the first seam or boundary after each
    stage's last layer. The repeated layers are the instances of the most repeated module path (``blocks.3``,
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
    cand = set(seams(gm)) | set(seams(gm, 0.05)) | set(boundaries(gm))
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

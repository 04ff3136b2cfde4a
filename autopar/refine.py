"""Second looks at the 3D search's fastest candidates (``autopar.search``; its words): each
planned once more with a choice the search itself leaves out, its candidates joining the others,
so a second look wins only where it plays faster.

* **fewer layers** — a candidate recomputing in every repeated layer, again with the mode in the
  fewest layers its memory allows (``second_look.fewer_layers_count``; ``PlanConfig.recompute_layers``).
* **ZeRO stage 1** — an accumulated candidate (several micro-batches per gradient
  synchronization), again with stage 1 offered beside 2 and 3 (``passes.zero_stages``):
  Megatron-LM's distributed optimizer, a reduce-scatter and a gather once a step from the
  accumulated gradient where stage 2 reduce-scatters every micro-batch.
* **per activation** — under ``recompute="auto"``, where memory shaped the fastest candidate (it
  recomputes, or its memory reaches ``second_look.MEMORY_BOUND`` of its budget): its ``(pp, m)`` with
  ``recompute="ops"`` on the meshes it can change (``second_look.bound_meshes``), the solver choosing
  which activations to recompute, node by node (``passes.recompute_ops``).
* **gradient compression** — under ``allow_compression``, the fastest candidate with each method.
* **offload** — where the search decides offload (``PlanConfig.offload_optimizer`` or
  ``offload_activations`` left ``None``) and recomputation (``recompute="auto"``), and the
  fastest candidate recomputes: its ``(pp, m)``
  with no recomputation, once with the optimizer state on the host and once with the saved
  activations of every repeated layer but the last on the host (``autopar.cost.offload``), on the
  meshes memory bound where that ``(pp, m)`` was solved keeping every activation
  (``second_look.bound_meshes``; offload only frees memory), a mesh whose activation copies alone
  outlast the best step pruned before it is formulated (``second_look.activation_copy_floor``), and
  the optimizer kind's compute path held to the best step less the host's step, which follows
  the last backward (``host_step_floor``: an even share of the parameters). The
  bytes freed may hold the activations instead, trading the recomputed forward for the host's
  step or the copies the compute does not hide; kept where faster and where the node's host
  memory holds what is offloaded.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from autopar.cluster import Cluster
from autopar.cost.offload import offload_step_time
from autopar.passes.strategies import repeated_layers
from autopar.pipelined import Player, Scored, stage_cluster
from autopar.planfile import Plan
from autopar.planner import InfeasibleError, plan_captured
from autopar.second_look import bound_meshes, fewer_layers_count, look_work, memory_bound
from autopar.simulate import offload_figures, optimizer_settings
from autopar.solver import NotBetter

if TYPE_CHECKING:
    from autopar.search import PipelineSearch

__all__ = [
    "COMPRESSION_GAIN",
    "ZERO1_REACH",
    "ZERO1_TIME_LIMIT",
    "accumulated_zero1",
    "compressed",
    "compression_methods",
    "fewer_layers",
    "host_step_floor",
    "offloaded",
    "per_activation",
]

ZERO1_REACH = 0.02
"""Accumulated candidates within this fraction of the fastest are planned again with ZeRO stage 1
offered (``accumulated_zero1``): on Table 1 it gained 0.3 % on row 1, the fastest candidate;
row 3's 4 micro-batches, which stage 1 makes 11 % faster, lie 11 % off the fastest without it."""

COMPRESSION_GAIN = 0.05
"""A compressed candidate replaces the exact ones only where it plays at least this fraction
faster: compression changes the training (lossy), so a gain within the model's error is not
worth it."""

ZERO1_TIME_LIMIT = 10.0
"""Seconds CP-SAT may search each mesh of that plan (``PlanConfig.time_limit`` caps it too): the
memory-bound ones ran to their 60 s limit on Table 1 row 3; the plan found by then is a rival,
kept only where it plays faster."""


def fewer_layers(search: PipelineSearch) -> None:
    """Under ``recompute="auto"``, where the fastest candidate recomputes in every repeated layer:
    its ``(pp, m)`` planned again with the mode in the fewest layers its memory allows
    (``second_look.fewer_layers_count``), kept where faster. Only the fastest: an estimate and one
    solve more for each candidate doubled Table 1 row 7's planning."""
    config = search.config
    if config.recompute != "auto" or config.recompute_layers is not None or not search.scored:
        return
    best = min(search.scored, key=lambda c: c.step_time)
    plan = best.plan
    if plan.recompute == "none":
        return
    pipe = plan.pipeline
    pp, m = (pipe.pp, pipe.microbatches) if pipe is not None else (1, 1)
    cap = search.graphs(m)
    stage = search.stage_config(pp, m) if (pp, m) != (1, 1) else config.replace(pp=1)
    k = fewer_layers_count(plan, cap, stage.device_budget)
    if k is None:
        return
    sub = stage_cluster(search.cluster, pp)
    assert sub is not None
    score = Player(cap.gm, search.cluster, config, pp, m, search.budget)
    try:
        spmd = plan_captured(
            cap, sub, stage.replace(recompute=plan.recompute, recompute_layers=k), score=score
        )
    except (InfeasibleError, NotBetter) as e:
        search.tried.append({"pp": pp, "microbatches": m, "recompute_layers": k, "failed": str(e)[:200]})
        return
    found = score.candidates(spmd) if (pp, m) != (1, 1) else [Scored(spmd, spmd.predicted.step_time, "pp=1")]
    for c in found:
        c.plan.info["recompute_layers_tried"] = {
            "layers": k,
            "of": len(repeated_layers(cap.gm.graph)),
            "step": c.step_time,
            "every_layer_step": best.step_time,
        }
        search.tried.append(
            {
                "pp": pp,
                "microbatches": m,
                "candidate": c.what,
                "recompute_layers": k,
                "step_time": c.step_time,
            }
        )
    search.scored += found


def _kept(search: PipelineSearch, pp: int, m: int) -> Plan | None:
    """The fastest scored plan of ``pp`` stages and ``m`` micro-batches that keeps every
    activation on the device (no recomputation, no offload), where the search solved one: its
    meshes' memory says which meshes memory bound (``second_look.bound_meshes``)."""
    same = []
    for c in search.scored:
        pipe = c.plan.pipeline
        shape = (pipe.pp, pipe.microbatches) if pipe is not None else (1, 1)
        if (
            shape == (pp, m)
            and c.plan.recompute == "none"
            and not c.plan.offload_optimizer
            and not c.plan.offload_layers
        ):
            same.append(c)
    return min(same, key=lambda c: c.step_time).plan if same else None


def host_step_floor(plan: Plan, cluster: Cluster) -> float:
    """Seconds the host's optimizer step takes at least on the busiest device
    (``autopar.cost.offload.offload_step_time``): its shard holds at least an even share of the
    model's parameter elements, whatever the layout."""
    if cluster.host is None:
        return 0.0
    numel = sum(math.prod(n.shape) for n in plan.nodes if n.kind == "param" and n.shape)
    pbytes, settings = optimizer_settings(plan)
    share = numel / cluster.world_size
    return offload_step_time(share, 0, pbytes, cluster.host, cluster.gpus_per_node, settings).total


def per_activation(search: PipelineSearch) -> None:
    """Under ``recompute="auto"``, where memory shaped the fastest candidate
    (``second_look.memory_bound``): its ``(pp, m)`` planned again with ``recompute="ops"``; the
    candidates join the others (module docstring)."""
    config = search.config
    if config.recompute != "auto" or "per_activation" in config.disable or not search.scored:
        return
    best = min(search.scored, key=lambda c: c.step_time)
    pipe = best.plan.pipeline
    pp, m = (pipe.pp, pipe.microbatches) if pipe is not None else (1, 1)
    stage = search.stage_config(pp, m) if (pp, m) != (1, 1) else config.replace(pp=1)
    budget = stage.device_budget
    if not memory_bound(best.plan, budget):
        return
    meshes = bound_meshes(_kept(search, pp, m) or best.plan, budget)
    if meshes == ():
        return
    cap = search.graphs(m)
    sub = stage_cluster(search.cluster, pp)
    assert sub is not None
    score = Player(cap.gm, search.cluster, config, pp, m, search.budget)
    record = {"pp": pp, "microbatches": m, "recompute": "ops"}
    try:
        # its compute path bounded by the best step (a rank is busy at least m/pp of it)
        spmd = plan_captured(
            cap,
            sub,
            stage.replace(recompute="ops", recompute_layers=None, meshes=meshes, work_limit=look_work(stage)),
            score=score,
            fewer_layers=False,
            path_cutoff=search.best() * pp / m,
        )
    except (InfeasibleError, NotBetter) as e:
        search.tried.append({**record, "failed": str(e)[:200]})
        return
    found = score.candidates(spmd) if (pp, m) != (1, 1) else [Scored(spmd, spmd.predicted.step_time, "pp=1")]
    for c in found:
        c.plan.info["per_activation_tried"] = {
            "step": c.step_time,
            "without_step": best.step_time,
            "without": best.plan.recompute,
        }
        search.tried.append({**record, "candidate": c.what, "step_time": c.step_time})
    search.scored += found


def accumulated_zero1(search: PipelineSearch) -> None:
    """Where the solver picks the ZeRO stages: each accumulated candidate (several micro-batches
    per gradient synchronization) within ``ZERO1_REACH`` of the fastest, its ``(pp, m)``
    planned again with stage 1 offered beside 2 and 3 (``passes.zero_stages``: a reduce-scatter
    and a gather once a step, from the accumulated gradient), its recomputation kept. Its
    candidates join the others, so one wins only where it plays faster (Table 1 row 1, 4
    micro-batches: 0.3 %). Offered in the search itself, stage 1 made row 3's 4 micro-batches
    11 % faster (a plan 5.8 % faster than Megatron-LM's best) but row 7's 2 micro-batches 0.5 %
    slower (reduce-scatters exposed after the last backward, which the solver's sum cannot
    see) and row 3's planning 1.5-2.5× longer (memory-bound programs CP-SAT closes slowly)."""
    config = search.config
    if config.zero_stage is not None or not search.scored:
        return
    best = search.best()
    seen: set[tuple[int, int]] = set()
    for c in sorted(search.scored, key=lambda c: c.step_time):
        pipe = c.plan.pipeline
        if c.step_time > best * (1 + ZERO1_REACH):
            break
        if pipe is None or pipe.microbatches <= 1 or (pipe.pp, pipe.microbatches) in seen:
            continue
        seen.add((pipe.pp, pipe.microbatches))
        _zero1(search, c.plan, pipe.pp, pipe.microbatches)


def _zero1(search: PipelineSearch, plan: Plan, pp: int, m: int) -> None:
    """``accumulated_zero1`` for the candidate ``plan`` of ``(pp, m)``."""
    cap = search.graphs(m)
    layers = _layer_ordinals(plan, repeated_layers(cap.gm.graph))
    stage = search.stage_config(pp, m).replace(
        recompute=plan.recompute,
        recompute_layers=layers,
        zero_stage=(1, 2, 3),
        time_limit=min(search.config.time_limit, ZERO1_TIME_LIMIT),
    )
    sub = stage_cluster(search.cluster, pp)
    assert sub is not None
    score = Player(cap.gm, search.cluster, search.config, pp, m, search.budget)
    try:
        # A rank is busy at least m/pp of a micro-batch's compute path (module docstring: pruning).
        spmd = plan_captured(
            cap, sub, stage, score=score, fewer_layers=False, path_cutoff=search.best() * pp / m
        )
    except (InfeasibleError, NotBetter) as e:
        search.tried.append({"pp": pp, "microbatches": m, "zero_stage": "1, 2, 3", "failed": str(e)[:200]})
        return
    for c in score.candidates(spmd):
        search.tried.append(
            {
                "pp": pp,
                "microbatches": m,
                "candidate": c.what,
                "zero_stage": "1, 2, 3",
                "step_time": c.step_time,
            }
        )
        search.scored.append(c)


def compression_methods(plan: Plan) -> list[str]:
    """The compression methods worth planning for ``plan``: PowerSGD, top-k and fp8, and bf16
    where its parameters (so their gradients) are 4 bytes: a gradient already in 2 bytes gains
    nothing from it."""
    methods = ["powersgd", "topk", "fp8"]
    if int(plan.info.get("param_bytes", 4)) > 2:
        methods.append("bf16")
    return methods


def _layer_ordinals(plan: Plan, names: list[str]) -> tuple[int, ...] | None:
    """``plan``'s recomputed layers as ordinals of ``names`` (``PlanConfig.recompute_layers``)."""
    if plan.recompute == "none" or plan.recompute_layers is None:
        return None
    return tuple(i for i, name in enumerate(names) if name in plan.recompute_layers) or None


def compressed(search: PipelineSearch) -> None:
    """Under ``allow_compression``, the fastest candidate's ``(pp, m)`` planned again with each
    method of ``compression_methods``, its recomputation kept; the candidates join the others
    (module docstring)."""
    config = search.config
    if not config.allow_compression or config.compression is not None or not search.scored:
        return
    best = min(search.scored, key=lambda c: c.step_time)
    plan = best.plan
    pipe = plan.pipeline
    pp, m = (pipe.pp, pipe.microbatches) if pipe is not None else (1, 1)
    cap = search.graphs(m)
    layers = _layer_ordinals(plan, repeated_layers(cap.gm.graph))
    stage = search.stage_config(pp, m) if (pp, m) != (1, 1) else config.replace(pp=1)
    tried = {"none": best.step_time}
    sub = stage_cluster(search.cluster, pp)
    assert sub is not None
    for method in compression_methods(plan):
        score = Player(cap.gm, search.cluster, config, pp, m, search.budget)
        c_stage = stage.replace(
            recompute=plan.recompute, recompute_layers=layers, compression=method, allow_compression=False
        )
        try:
            spmd = plan_captured(cap, sub, c_stage, score=score, fewer_layers=False)
        except (InfeasibleError, NotBetter) as e:
            search.tried.append({"pp": pp, "microbatches": m, "compression": method, "failed": str(e)[:200]})
            continue
        found = (
            score.candidates(spmd) if (pp, m) != (1, 1) else [Scored(spmd, spmd.predicted.step_time, "pp=1")]
        )
        for c in found:
            search.tried.append(
                {
                    "pp": pp,
                    "microbatches": m,
                    "candidate": c.what,
                    "compression": method,
                    "step_time": c.step_time,
                }
            )
            tried[method] = min(tried.get(method, c.step_time), c.step_time)
        search.scored += [c for c in found if c.step_time < best.step_time * (1 - COMPRESSION_GAIN)]
    for c in search.scored:
        c.plan.info["compression_tried"] = tried


def offloaded(search: PipelineSearch) -> None:
    """Where the search decides offload and the fastest candidate recomputes: its ``(pp, m)``
    planned again keeping every activation, once with the optimizer state on the host and once
    with the saved activations of every repeated layer but the last on the host (module
    docstring); the candidates whose host state fits the node join the others."""
    config = search.config
    # only where the search chooses recomputation too: recompute="full" given is held
    if config.recompute != "auto" or search.cluster.host is None or not search.scored:
        return
    best = min(search.scored, key=lambda c: c.step_time)
    plan = best.plan
    if plan.recompute == "none" or plan.offload_optimizer or plan.offload_layers:
        return
    pipe = plan.pipeline
    pp, m = (pipe.pp, pipe.microbatches) if pipe is not None else (1, 1)
    cap = search.graphs(m)
    stage = search.stage_config(pp, m) if (pp, m) != (1, 1) else config.replace(pp=1)
    sub = stage_cluster(search.cluster, pp)
    assert sub is not None
    layers = len(repeated_layers(cap.gm.graph))
    # offload only frees memory (at a cost in time): a mesh whose plan kept every activation
    # clear of the budget keeps that plan (``second_look.bound_meshes``)
    budget = stage.device_budget
    kept_plan = _kept(search, pp, m)
    meshes = bound_meshes(kept_plan, budget) if kept_plan is not None else None
    if meshes == ():
        return
    kinds = []
    if config.offload_optimizer is None:
        kinds.append(("the optimizer state", {"offload_optimizer": True, "offload_activations": 0}))
    if config.offload_activations is None and layers >= 3:  # one layer's worth stays counted
        kinds.append((f"the activations of {layers - 1} layers", {"offload_activations": layers - 1}))
    for what, knobs in kinds:
        score = Player(cap.gm, search.cluster, config, pp, m, search.budget)
        kept = stage.replace(recompute="none", recompute_layers=None, meshes=meshes, **knobs)
        record = {"pp": pp, "microbatches": m, **knobs}
        if meshes is not None:
            record["meshes"] = [list(x) for x in meshes]
        # the host's step follows the last backward: the compute path has the rest of the best step
        host = host_step_floor(plan, search.cluster) if knobs.get("offload_optimizer") else 0.0
        if host >= search.best():
            why = f"the host's optimizer step alone takes at least {host * 1e3:.1f} ms, over the best step"
            search.tried.append({**record, "failed": why})
            continue
        try:
            # its compute path bounded by the best step (a rank is busy at least m/pp of it)
            spmd = plan_captured(
                cap, sub, kept, score=score, fewer_layers=False, path_cutoff=(search.best() - host) * pp / m
            )
        except (InfeasibleError, NotBetter) as e:
            search.tried.append({**record, "failed": str(e)[:200]})
            continue
        found = (
            score.candidates(spmd) if (pp, m) != (1, 1) else [Scored(spmd, spmd.predicted.step_time, "pp=1")]
        )
        for c in found:
            f = offload_figures(c.plan, search.cluster)
            fits = f["host_bytes_per_node"] <= f["host_memory"]
            search.tried.append(
                {
                    **record,
                    "candidate": c.what,
                    "step_time": c.step_time,
                    **({} if fits else {"failed": "the host memory does not hold what is offloaded"}),
                }
            )
            if fits:
                c.plan.info["offload_reason"] = (
                    f"with {what} on the host every activation fits: {c.step_time * 1e3:.1f} ms a step against "
                    f"{best.step_time * 1e3:.1f} ms recomputing ({plan.recompute})"
                )
                search.scored.append(c)

"""Planning a model (``autopar.plan``): the config resolved once for the
cluster's device, the model captured once for every micro-batch size (``MicrobatchCaptures``),
the pipeline sizes ``PlanConfig.pp`` asks for searched (``autopar.search``: the order, the stops,
the pruning), the second looks at the fastest candidates (``autopar.refine``), and, where nothing
fits with the optimizer state on the device, the whole search once more with it on the host.

Words (``autopar.search`` defines candidate, stage mesh and score):

* **offload check** — a plan that keeps state on the host (optimizer state, activations) carries
  its host figures (``simulate.offload_figures``) and fits the node's host memory, or is refused
  with the arithmetic.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

from torch import nn

from autopar import refine
from autopar.capture import Captured, batch_size, normalize_inputs
from autopar.cluster import Cluster
from autopar.config import PlanConfig
from autopar.cost.offload import host_of
from autopar.display import fmt_bytes
from autopar.microbatch import MicrobatchCaptures
from autopar.planfile import Plan
from autopar.planner import InfeasibleError, plan_captured
from autopar.search import PipelineSearch
from autopar.simulate import offload_figures

__all__ = ["plan_model"]

log = logging.getLogger("autopar.planner")


def plan_model(
    model: nn.Module,
    example_inputs: Any,
    cluster: Cluster,
    config: PlanConfig,
    captured: Captured | None = None,
    graphs: MicrobatchCaptures | None = None,
) -> Plan:
    """Plan ``model`` (``autopar.plan``): the one-stage plan and the pipelined candidates
    ``config.pp`` asks for (``PlanConfig.pp``; ``autopar.search``); the fastest that fits.
    ``captured``: the model already captured on ``example_inputs``; ``graphs``: its micro-batch
    graphs, shared by several plans of the same workload (``autopar plan --nodes 4,8,16``: the
    model is exported once, with and without a symbolic batch, for every cluster).

    Optimizer offload (``PlanConfig.offload_optimizer``): ``None`` plans without it (but for
    ``refine.offloaded``'s second look) and, where nothing fits so, searches again with it; the
    plan's host memory must fit the node's."""
    t_start = time.perf_counter()
    args, kwargs = normalize_inputs(example_inputs)
    config = config.resolved(cluster.device.memory)
    if config.offload_optimizer is True:
        host_of(cluster)  # a clear error before any planning
    if graphs is None:
        graphs = MicrobatchCaptures(model, (args, kwargs), whole=captured)
    try:
        return _offload_checked(_plan_model(args, kwargs, cluster, config, graphs), cluster)
    except InfeasibleError as e:
        if config.offload_optimizer is not None or cluster.host is None:
            raise
        log.info("nothing fits with the optimizer state on the device; planning with it offloaded")
        try:
            plan = _offload_checked(
                _plan_model(args, kwargs, cluster, config.replace(offload_optimizer=True), graphs), cluster
            )
        except InfeasibleError as off:
            # the offloaded attempt first: its smallest memory is the lower bound now
            known = [x for x in (off.smallest, e.smallest) if x is not None]
            raise InfeasibleError(
                f"with the optimizer state offloaded to the host: {off}\nwith it on the device: {e}",
                smallest=min(known) if known else None,
            ) from None
        head = str(e).splitlines()[0]
        plan.info["offload_reason"] = f"without it: {head}"
        plan.info["planning_time"] = time.perf_counter() - t_start  # both searches
        return plan


def _offload_checked(plan: Plan, cluster: Cluster) -> Plan:
    """``plan`` with its host figures (``simulate.offload_figures``) where it offloads; an
    ``InfeasibleError`` with the arithmetic where its host state does not fit the node's memory."""
    if not plan.offload_optimizer and not plan.offload_layers:
        return plan
    f = offload_figures(plan, cluster)
    plan.info["offload"] = f
    if f["host_bytes_per_node"] > f["host_memory"]:
        raise InfeasibleError(
            f"the offloaded state needs {fmt_bytes(f['host_bytes_per_node'])} of host memory per node "
            f"({cluster.gpus_per_node} devices × {fmt_bytes(f['host_bytes_per_device'])}), more than the node's "
            f"{fmt_bytes(f['host_memory'])}; use more devices or nodes"
        )
    return plan


def _plan_model(
    args: tuple, kwargs: dict, cluster: Cluster, config: PlanConfig, graphs: MicrobatchCaptures
) -> Plan:
    """``plan_model`` for one ``config.offload_optimizer`` (``None``: off but for
    ``refine.offloaded``)."""
    t0 = time.perf_counter()
    if config.pp == 1 and config.microbatches in (None, 1) and not config.allow_compression:
        return plan_captured(graphs(1), cluster, config)
    world = cluster.world_size
    search = PipelineSearch(graphs, cluster, config, batch_size(args, kwargs))
    if config.pp == "search":
        pps = [d for d in range(1, world + 1) if world % d == 0]
    elif config.pp == "auto":
        pps = [1] + [d for d in range(2, cluster.nodes + 1) if cluster.nodes % d == 0]
    else:
        pps = [int(config.pp)]
    if config.mesh_shape is not None and config.pp not in ("auto", "search"):  # the mesh inside a stage
        stage, pp = math.prod(config.mesh_shape), pps[0]
        if stage * pp != world:
            raise ValueError(
                f"mesh_shape {config.mesh_shape} spans {stage} devices, but the mesh inside a pipeline stage "
                f"spans world / pp = {world} / {pp} = {world / pp:g}: give a mesh_shape of that many devices"
            )
    whole = None
    if pps[0] == 1 and config.microbatches in (None, 1):
        # Meanwhile the model is exported with a symbolic batch and the first pipeline's graph made.
        whole = search.whole(pps[1] if len(pps) > 1 else None)
        if config.pp == "auto" and whole is None and len(pps) == 1:  # one stage does not fit: pipelines too
            pps += [d for d in range(2, world + 1) if world % d == 0]
    fits = whole is not None  # as it is: accumulating smaller micro-batches is then not tried,
    # except on a mixed cluster, where accumulation is what lets a faster replica run more of the
    # step's micro-batches (``autopar.dp_shares``).
    if pps[0] == 1 and ((config.pp == "auto" and fits and not cluster.mixed_kinds) or search.batch is None):
        pps = pps[1:]
    if config.pp == "auto" and not fits and len(pps) > 2 and pps[0] == 1:
        search.pipelines_first(pps)
    else:
        search.ascending(pps)
    search.recomputing_whole()
    refine.fewer_layers(search)
    refine.per_activation(search)
    refine.accumulated_zero1(search)
    refine.compressed(search)
    refine.offloaded(search)
    if not search.scored:
        head = "no layout fits the memory budget"
        if search.least is not None:
            head += (
                f": the smallest reachable is {fmt_bytes(search.least[0])} per device ({search.least[1]}); use "
                f"more devices, a larger memory_budget, a smaller batch, or recomputation"
            )
        raise InfeasibleError(
            head + ":\n  " + "\n  ".join(search.errors), smallest=search.least[0] if search.least else None
        )
    best = min(search.scored, key=lambda s: s.step_time)
    best.plan.info["pipeline_candidates"] = search.tried
    best.plan.info["planning_time"] = time.perf_counter() - t0
    best.plan.info["cluster_desc"] = cluster.describe()
    best.plan.cluster = cluster.to_dict()
    return best.plan

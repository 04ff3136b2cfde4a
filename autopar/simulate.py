"""The whole-step simulator: a plan's training step played out in time, per rank.

Words (``autopar.cost.timeline`` holds the arithmetic, ``autopar.schedule`` the schedules):

* **stage costs** — what the simulator plays. A pipelined plan stores them per stage
  (``PipelinePlan.stage_costs``, computed when it was planned, :func:`stage_costs`); a plan with
  one stage has one, built from its nodes.
* **forward / backward split** — a node's ``compute_time`` is forward + backward. Where the plan
  was made from a captured graph, the split is the node's own (``autopar.ir.NodeCost``); from a
  saved plan alone, backward is twice the forward (the matmul rule: one product forward, two
  backward). Of the backward, a matmul with a trainable weight spends half on the weight's
  gradient (``W``), the rest of the graph's backward is the input gradient (``B``).
* **communication** — collectives inside ops and reshards between them run where they are, on
  the critical path (tensor- and sequence-parallel collectives are synchronous with the compute
  that needs them; ZeRO-3 gathers are prefetched a layer ahead by the runtime, which this charges
  as exposed: an upper bound), split between forward and backward like the compute; the
  backward all-reduce of an activation's gradient (Megatron-LM's ``f``) is in the backward too.
  A weight's gradient reduction overlaps the backward in buckets (``cost.timeline``): once per step
  over the data-parallel axes, every micro-batch for a ZeRO parameter (gathered for use,
  reduce-scattered after).
* **optimizer** — one ``optimizer.step()`` over the parameter shards a rank holds
  (``autopar.cost.optimizer``), after the step's last gradient is reduced.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torch.fx import GraphModule, Node

from autopar.cluster import Cluster
from autopar.cost.memory import state_bytes_per_param
from autopar.cost.offload import (
    activation_offload_exposed,
    host_bytes_per_param,
    host_of,
    offload_step_time,
)
from autopar.cost.optimizer import OptimizerSettings, optimizer_step_time, plan_settings
from autopar.cost.timeline import GRADIENT_BUCKETS, Event, StageCost, Timeline, play
from autopar.devices import Link
from autopar.graph import OpFamily, op_family, tensor_inputs
from autopar.ir import COST, TENSOR
from autopar.placement import local_shape, parse_spec
from autopar.planfile import NodePlan, Plan
from autopar.schedule import make_schedule

__all__ = ["GraphFacts", "StepSimulation", "graph_facts", "simulate", "simulate_captured", "stage_costs"]


@dataclass
class StepSimulation:
    """A simulated step (``simulate``): the timeline and the figures it adds up to."""

    timeline: Timeline
    optimizer_time: float
    schedule: str
    microbatches: int

    @property
    def step_time(self) -> float:
        return self.timeline.step_time + self.optimizer_time

    @property
    def bubble_fraction(self) -> float:
        return self.timeline.bubble_fraction()

    @property
    def events(self) -> list[Event]:
        """The step as events (``cost.timeline.Event``), the optimizer step last on every rank,
        after the step's last gradient reduction (as ``step_time`` charges it)."""
        tl = self.timeline
        out = tl.event_list()
        t = tl.step_time
        out += [Event(f"rank {r}", "optimizer", t, t + self.optimizer_time) for r in range(len(tl.end))]
        return out

    def __str__(self) -> str:
        """``summary()``, then (pipelined) one text row of passes per rank (``Timeline.format``;
        ``autopar simulate`` draws more: ``autopar.step_draw.timeline_text``)."""
        tl = self.timeline
        return self.summary() + (f"\n{tl.format()}" if len(tl.busy) > 1 else "")

    def summary(self) -> str:
        """The step's time, schedule and optimizer step, then a line per pipeline rank."""
        tl = self.timeline
        pp = len(tl.busy)
        lines = [
            f"simulated step {self.step_time * 1e3:.3f} ms: {pp} pipeline rank(s), schedule {self.schedule}, "
            f"{self.microbatches} micro-batch(es); optimizer {self.optimizer_time * 1e3:.3f} ms",
        ]
        for r in range(pp):
            lines.append(
                f"  rank {r}: busy {tl.busy[r] * 1e3:.3f} ms, idle {tl.bubble[r] * 1e3:.3f} ms, exposed gradient "
                f"reduction {tl.exposed_sync[r] * 1e3:.3f} ms, peak memory {tl.peak_memory[r] / 2**30:.2f} GiB"
            )
        return "\n".join(lines)


def _node_split(
    n: NodePlan,
    fwd_share: Callable[[str], float] | None,
    trainable_matmul: set[str],
    factors: tuple[float, float] = (1.0, 1.0),
) -> tuple:
    """(F, B, W) seconds of one node's compute + in-op communication (module docstring), each
    scaled by ``factors`` (``stage_costs``' ``scale``)."""
    total = n.compute_time * factors[0] + n.comm_time * factors[1]
    f = fwd_share(n.name) if fwd_share is not None else None
    f = 1 / 3 if f is None else f
    bwd = total * (1 - f)
    w = bwd / 2 if n.name in trainable_matmul else 0.0
    return total * f, bwd - w, w


def stage_costs(
    plan: Plan,
    stage_of: dict[str, int] | None = None,
    num_stages: int = 1,
    *,
    first_reader: dict[str, str] | None = None,
    fwd_share: Callable[[str], float] | None = None,
    trainable_matmul: Sequence[str] = (),
    boundary_bytes: Sequence[float] = (),
    send_time: Callable[[float], float] | None = None,
    scale: Callable[[str, int], tuple[float, float]] | None = None,
    host_link: Link | None = None,
    host_overlap: bool = True,
) -> list[StageCost]:
    """Per stage, the costs of one micro-batch under ``plan`` (its nodes and reshards, made for one
    micro-batch on one stage's mesh). ``stage_of``: captured node -> stage (all in stage 0 when
    ``None``); ``first_reader``: a parameter or input node -> the node reading it first (its
    stage holds it); ``fwd_share``: a node's forward share of its time; ``trainable_matmul``: the
    matmuls computing a trainable weight's gradient; ``boundary_bytes[s]``: the bytes stage ``s``
    sends on; ``send_time``: seconds to send that many bytes to the next pipeline rank;
    ``scale(node, s)``: the factors ``(compute, communication)`` by which a node's times on stage
    ``s``'s devices differ from the plan's (a mixed cluster's pipeline ranks, ``autopar.pipelined``):
    its compute and in-op collectives, and the activation reshards it consumes; a weight's
    gradient reduction and ZeRO gathers keep the plan's (the network they cross is shared).
    ``host_link``: the devices' link to host memory, over which an activation-offloading plan
    (``Plan.offload_layers``) copies each micro-batch's saved activations out beside the forward
    and back beside the backward (``autopar.cost.offload.activation_offload_exposed``: what does
    not fit under the compute is added to it; ``host_overlap=False``: all of it, the copies taking
    the compute's own cores as on CPU processes, ``Cluster.overlap_comm``)."""
    one = (1.0, 1.0)
    stage_of = stage_of or {}
    first_reader = first_reader or {}
    tm = set(trainable_matmul)
    f = [0.0] * num_stages
    b = [0.0] * num_stages
    w = [0.0] * num_stages
    act = [0.0] * num_stages
    static = [0.0] * num_stages
    sync = [0.0] * num_stages
    mb_sync = [0.0] * num_stages
    chunks = [0] * num_stages
    kind = {n.name: n.kind for n in plan.nodes}
    zero = {n.name: n.zero_stage for n in plan.nodes if n.kind == "param"}
    gather = [0.0] * num_stages
    fwd_gather = [0.0] * num_stages
    blocking = [0.0] * num_stages

    def where(name: str) -> int:
        s = stage_of.get(name)
        if s is None:
            s = stage_of.get(first_reader.get(name, ""), 0)
        return s

    off = [0.0] * num_stages
    for n in plan.nodes:
        s = where(n.name)
        if n.kind == "param":
            static[s] += n.memory
            continue
        act[s] += n.memory
        off[s] += n.offloaded
        nf, nb, nw = _node_split(n, fwd_share, tm, scale(n.name, s) if scale is not None else one)
        f[s] += nf
        b[s] += nb
        w[s] += nw
    for r in plan.distinct_reshards(where):
        s = where(r.consumer)
        if r.grad_sync_axes and kind.get(r.producer) == "param":
            # A weight's gradient: reduced beside the backward, once per step (data parallel).
            # A ZeRO parameter gathered for use (the edge's time is the all-gather and the
            # gradient's reduce-scatter, equal volumes, ``cost.reshard_cost.edge_cost``): stage 3
            # gathers and reduces every micro-batch; stages 1 and 2 gather once per step after
            # the optimizer (``param_gather``), stage 1 reduce-scatters its accumulated gradient
            # once per step (Megatron-LM's distributed optimizer), stage 2 every micro-batch.
            stage = zero.get(r.producer, 0)
            if not r.collectives:
                sync[s] += r.time - r.blocking
                blocking[s] += r.blocking
            elif stage == 3:  # gathered for the forward, again for the backward; reduce-scattered
                fwd_gather[s] += r.time / 3
                mb_sync[s] += 2 * r.time / 3
            else:
                gather[s] += r.time / 2
                if stage == 1:
                    sync[s] += r.time / 2
                else:
                    mb_sync[s] += r.time / 2
            chunks[s] += 1
        elif r.grad_sync_axes:  # an activation's gradient (Megatron-LM's f): inside the backward
            b[s] += r.time * (scale(r.consumer, s)[1] if scale is not None else 1.0)
        else:
            t = r.time * (scale(r.consumer, s)[1] if scale is not None else 1.0)
            f[s] += t / 3
            b[s] += 2 * t / 3
    for s in range(num_stages):
        if off[s]:
            if host_link is None:
                raise ValueError(
                    "the plan offloads activations (Plan.offload_layers) but no host link was given: "
                    "simulate it on a cluster whose host is described"
                )
            f[s] += activation_offload_exposed(off[s], f[s] if host_overlap else 0.0, host_link)
            b[s] += activation_offload_exposed(off[s], b[s] + w[s] if host_overlap else 0.0, host_link)
    out = []
    for s in range(num_stages):
        nbytes = boundary_bytes[s] if s < len(boundary_bytes) else 0.0
        out.append(
            StageCost(
                forward=f[s],
                backward_input=b[s],
                backward_weight=w[s],
                send=send_time(nbytes) if send_time is not None and nbytes > 0 else 0.0,
                activation=act[s],
                static=static[s],
                grad_sync=sync[s],
                microbatch_sync=mb_sync[s],
                forward_gather=fwd_gather[s],
                sync_chunks=max(1, min(chunks[s], GRADIENT_BUCKETS)),
                param_gather=gather[s],
                sync_compute=blocking[s],
            )
        )
    return out


def optimizer_shard(plan: Plan, stages: Sequence[int] | None = None) -> tuple[float, int]:
    """``(elements, tensors)`` of the parameter shards whose optimizer state one device holds (of
    pipeline rank holding ``stages``, when given: parameters whose first reader is in them)."""
    numel = 0.0
    tensors = 0
    pp_stage = plan.pipeline.stage_of if plan.pipeline is not None else None
    first = plan.info.get("first_reader", {})
    split = plan.info.get("state_split", {})
    for n in plan.nodes:
        if n.kind != "param" or not n.shape:
            continue
        if (
            stages is not None
            and pp_stage is not None
            and pp_stage.get(first.get(n.name, ""), 0) not in stages
        ):
            continue
        local = math.prod(local_shape(tuple(n.shape), parse_spec(n.outputs[0]), tuple(plan.mesh_shape)))
        numel += local / split.get(n.fqn, 1)  # a flat-sharded state (PlanConfig.state_split)
        tensors += 1
    return numel, tensors


def optimizer_settings(plan: Plan) -> tuple[int, OptimizerSettings]:
    """The plan's parameter bytes and the optimizer its step runs (``cost.optimizer.plan_settings``:
    its optimizer, master weights where the parameters are narrower than fp32, the moments' dtype
    where the plan records one)."""
    pbytes = int(plan.info.get("param_bytes", 4))
    return pbytes, plan_settings(
        plan.info.get("optimizer", "adamw"), pbytes, plan.info.get("optimizer_state_dtype")
    )


def optimizer_time(plan: Plan, cluster: Cluster, stages: Sequence[int] | None = None) -> float:
    """One optimizer step over the parameter shards of one device (of pipeline rank holding
    ``stages``, when given); on the host where the plan offloads it (``autopar.cost.offload``)."""
    numel, tensors = optimizer_shard(plan, stages)
    pbytes, settings = optimizer_settings(plan)
    if plan.offload_optimizer:
        return offload_step_time(
            numel, tensors, pbytes, host_of(cluster), cluster.gpus_per_node, settings
        ).total
    return optimizer_step_time(numel, tensors, pbytes, cluster.device, settings)


def offload_figures(plan: Plan, cluster: Cluster) -> dict[str, float]:
    """An offloading plan's host figures (``autopar.cost.offload``), for its busiest pipeline rank:
    what the host holds per device and per node against the node's host memory; with the
    optimizer offloaded, the device memory that frees (the optimizer state and master weight) and
    the step's three phases; with activations offloaded, the bytes a micro-batch sends each way
    and what the micro-batches in flight keep on the host (1F1B's first rank: ``pp`` of them)."""
    host = host_of(cluster)
    out: dict[str, float] = {"host_memory": float(host.memory)}
    per_device = 0.0
    pipe = plan.pipeline
    if plan.offload_optimizer:
        pp = pipe.pp if pipe is not None else 1
        stages = pipe.num_stages if pipe is not None else 1
        shards = [optimizer_shard(plan, range(r, stages, pp) if pp > 1 else None) for r in range(pp)]
        numel, tensors = max(shards)
        pbytes, settings = optimizer_settings(plan)
        t = offload_step_time(numel, tensors, pbytes, host, cluster.gpus_per_node, settings)
        kept = state_bytes_per_param(
            pbytes,
            optimizer=settings.optimizer,
            master_weights=settings.master_weights,
            state_bytes=settings.state_bytes,
        ).optimizer
        held = numel * host_bytes_per_param(pbytes, settings)
        per_device += held
        out |= {
            "device_bytes_saved": numel * kept,
            "optimizer_host_bytes": held,
            "to_host": t.to_host,
            "host_step": t.step,
            "to_device": t.to_device,
        }
    if plan.offload_layers:
        sent = sum(n.offloaded for n in plan.nodes)
        in_flight = 1 if pipe is None else pipe.microbatches if pipe.schedule == "gpipe" else pipe.pp
        per_device += sent * in_flight
        out |= {"activation_bytes_per_microbatch": sent, "activation_host_bytes": sent * in_flight}
    out["host_bytes_per_device"] = per_device
    out["host_bytes_per_node"] = per_device * cluster.gpus_per_node
    return out


def simulate(plan: Plan, cluster: Cluster | None = None) -> StepSimulation:
    """Play ``plan``'s training step (module docstring); ``cluster``: the plan's own by default."""
    cluster = cluster or Cluster.from_dict(plan.cluster)
    p = plan.pipeline
    if p is None:
        stages = stage_costs(
            plan,
            host_link=cluster.host.link if cluster.host is not None else None,
            host_overlap=cluster.overlap_comm,
        )
        actions = make_schedule("1f1b", 1, 1)
        tl = play(actions, stages, overlap=cluster.overlap_comm)
        return StepSimulation(tl, optimizer_time(plan, cluster), "none", 1)
    if p.dp_shares:
        # Unequal data-parallel shares (``autopar.dp_shares``): each replica plays its own micro-
        # batches on its own devices (the stage's costs where a plan has no replica's own); the
        # step is the slowest's.
        costs = p.replica_costs or (p.stage_costs[0],) * len(p.dp_shares)
        played = [
            play(p.actions(j), [StageCost(**c)], overlap=cluster.overlap_comm) for j, c in enumerate(costs)
        ]
        j = max(range(len(played)), key=lambda j: played[j].step_time)
        parts = cluster.replicas(len(p.dp_shares)) or [cluster]
        opt = max(optimizer_time(plan, c) for c in parts)
        return StepSimulation(
            played[j], opt, p.schedule + f" (shares {':'.join(map(str, p.dp_shares))})", p.dp_shares[j]
        )
    stages = [StageCost(**d) for d in p.stage_costs]
    tl = play(p.actions(), stages, overlap=cluster.overlap_comm)
    opt = max(
        optimizer_time(plan, cluster.pipeline_part(p.pp, r), range(r, p.num_stages, p.pp))
        for r in range(p.pp)
    )
    return StepSimulation(
        tl, opt, p.schedule + (f" (v={p.virtual})" if p.virtual > 1 else ""), p.microbatches
    )


@dataclass(frozen=True)
class GraphFacts:
    """What the simulator reads off a captured, annotated graph (module docstring)."""

    first_reader: dict[str, str]
    """Parameter or input node -> the first compute node reading it."""
    fwd_share: dict[str, float]
    """Compute node -> forward share of its forward + backward time."""
    trainable_matmul: tuple[str, ...]
    """Matmuls whose backward computes a trainable weight's gradient."""
    param_bytes: int
    """Bytes per element of the trainable parameters (the largest)."""


def graph_facts(gm: GraphModule) -> GraphFacts:
    """The facts of ``gm`` (captured and annotated: ``autopar.ir.COST`` and ``TENSOR``)."""
    first: dict[str, str] = {}
    share: dict[str, float] = {}
    weights: set[Node] = set()
    pbytes = 0
    for n in gm.graph.nodes:
        info = n.meta.get(TENSOR)
        if n.op == "placeholder":
            readers = [u for u in n.users if u.op == "call_function"]
            if readers:
                first[n.name] = readers[0].name
            if info is not None and info.kind == "param" and info.requires_grad:
                weights.add(n)
                val = n.meta.get("val")
                if val is not None:
                    pbytes = max(pbytes, val.element_size())
            continue
        if n.op != "call_function":
            continue
        c = n.meta.get(COST)
        if c is not None and c.fwd_time + c.bwd_time > 0:
            share[n.name] = c.fwd_time / (c.fwd_time + c.bwd_time)
    # A weight read through views (a transpose, a cast) still makes its matmul compute its gradient.
    reach = set(weights)
    for n in gm.graph.nodes:
        if (
            n.op == "call_function"
            and op_family(n) is OpFamily.VIEW
            and any(i in reach for i in tensor_inputs(n))
        ):
            reach.add(n)
    tm = tuple(
        n.name
        for n in gm.graph.nodes
        if n.op == "call_function"
        and op_family(n) is OpFamily.MATMUL
        and any(i in reach for i in tensor_inputs(n))
    )
    return GraphFacts(first, share, tm, pbytes or 4)


def simulate_captured(plan: Plan, gm: GraphModule, cluster: Cluster) -> StepSimulation:
    """Simulate a one-stage ``plan`` just made from ``gm`` (the forward/backward split of each node
    is its own, not the saved-plan default)."""
    facts = graph_facts(gm)
    stages = stage_costs(
        plan,
        first_reader=facts.first_reader,
        fwd_share=facts.fwd_share.get,
        trainable_matmul=facts.trainable_matmul,
        host_link=cluster.host.link if cluster.host is not None else None,
        host_overlap=cluster.overlap_comm,
    )
    tl = play(make_schedule("1f1b", 1, 1), stages, overlap=cluster.overlap_comm)
    return StepSimulation(tl, optimizer_time(plan, cluster), "none", 1)

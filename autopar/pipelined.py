"""Pipelined candidates of one stage plan: the stage mesh (``stage_cluster``), the cuts of the
micro-batch graph into stages and the schedules played over them (``pipelined_candidates``),
each scored by the simulated step (``Scored``). ``autopar.search`` drives which pipeline sizes
and micro-batch counts are planned; the words are its module docstring's.

On a mixed cluster (``autopar.cluster``: node groups of different device kinds) the stage plan
is made once, on the floor device, and each pipeline rank then runs it on its own devices: a
node's compute takes its kernels' time there (``device_time_ratios``: the same kernels timed on
both devices, ``autopar.cost.compute``), its in-op collectives and activation reshards scale with
the rank's NVLink, and the cut balances each stage's time on its own rank — a faster group gets
more layers. Each rank's memory budget is its own device's.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from autopar.cluster import Cluster
from autopar.config import PlanConfig
from autopar.cost.compute import kernel_time
from autopar.cost.timeline import play
from autopar.devices import DeviceSpec
from autopar.display import fmt_bytes
from autopar.dp_shares import balance, share_blockers
from autopar.passes.annotate import node_kernels
from autopar.passes.stages import layer_cuts, seams, stage_cuts
from autopar.placement import local_shape, parse_spec
from autopar.planfile import PipelinePlan, Plan
from autopar.schedule import make_schedule, max_in_flight, stage_rank
from autopar.simulate import graph_facts, optimizer_time, simulate, stage_costs

__all__ = ["Player", "Scored", "device_time_ratios", "pipelined_candidates", "stage_cluster"]

log = logging.getLogger("autopar.planner")


def stage_cluster(cluster: Cluster, pp: int) -> Cluster | None:
    """The devices of one pipeline rank (module docstring: stage mesh), on which the stage plan is
    made: ``world / pp`` of them, within one node or whole nodes, of the floor device of a mixed
    cluster (``autopar.cluster``; a rank's own devices are ``Cluster.pipeline_part``); ``None``
    when ``pp`` does not divide the cluster into equal stages."""
    if cluster.world_size % pp:
        return None
    try:
        return cluster.uniform().part(0, cluster.world_size // pp)
    except ValueError:
        return None


def device_time_ratios(gm: Any, ref: DeviceSpec, dev: DeviceSpec, tf32: bool = False) -> dict[str, float]:
    """Per compute node of ``gm``: its kernels' time on ``dev`` ÷ their time on ``ref`` (module
    docstring), forward and backward, at the graph's global shapes — a matmul goes as the two
    devices' matmul throughputs, an elementwise op as their memory bandwidths. The ratio, not the
    time, is taken from global shapes: a shard's kernels have the same kind and nearly the same
    efficiency."""
    out: dict[str, float] = {}
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        ks = node_kernels(n, tf32=tf32)
        kernels = [*ks.fwd, *ks.bwd]
        t_ref = sum(kernel_time(k, ref) for k in kernels)
        if t_ref > 0:
            out[n.name] = sum(kernel_time(k, dev) for k in kernels) / t_ref
    return out


DEVICE_RATIOS = "autopar.device_ratios"
"""``gm.meta`` key: a micro-batch graph's ``device_time_ratios`` per pair of devices, computed
once for every (pp, m) candidate planned on it."""


@dataclass
class Scored:
    plan: Plan
    step_time: float
    what: str


def pipelined_candidates(
    spmd: Plan,
    gm: Any,
    cluster: Cluster,
    config: PlanConfig,
    pp: int,
    m: int,
    budget: float,
    by_layers: bool = False,
    why: list[str] | None = None,
    cuts: dict[str, int] | None = None,
) -> list[Scored]:
    """Every schedule for one ``(pp, m)`` around the stage plan ``spmd`` (module docstring).
    ``by_layers``: cut at equal layer counts as Megatron-LM does (``passes.stages.layer_cuts``)
    instead of balancing the stages' cost; ``cuts``: this cut, held (a plan's
    ``PipelinePlan.stage_of``, played on another cluster). ``why``: where given, each schedule
    that gives no candidate appends its reason (the cut's error, or the peak memory against the
    budget). ``budget``: one floor device's (a mixed cluster's ranks each get theirs)."""
    why = why if why is not None else []
    cuts = cuts if cuts is not None else (dict(config.stage_of) or None)
    facts = graph_facts(gm)
    by_name = {n.name: n for n in spmd.nodes}
    vals = {n.name: n.meta.get("val") for n in gm.graph.nodes}
    mesh = tuple(spmd.mesh_shape)
    link = cluster.axis_link((pp, *mesh), 0)
    # Each pipeline rank's devices (module docstring: mixed cluster) against the stage plan's.
    floor = stage_cluster(cluster, pp) or cluster
    own = [cluster.pipeline_part(pp, r) for r in range(pp)]
    budgets = [budget + c.device.memory - floor.device.memory for c in own]
    known: dict[str, dict[str, float]] = gm.meta.setdefault(DEVICE_RATIOS, {})  # one graph's, kept with it

    def ratios_on(c: Cluster) -> dict[str, float] | None:
        """Each node's time on ``c``'s devices ÷ on the floor's; ``None`` where they are alike."""
        # Name and memory do not time a kernel: a rank of the floor's own kind runs as planned.
        if replace(c.device, name=floor.device.name, memory=floor.device.memory) == floor.device:
            return None
        key = json.dumps([c.device.to_dict(), floor.device.to_dict(), config.matmul_tf32], sort_keys=True)
        if key not in known:
            known[key] = device_time_ratios(gm, floor.device, c.device, config.matmul_tf32)
        return known[key]

    ratios = [ratios_on(c) for c in own]
    link_factor = [floor.intra_node.bandwidth / c.intra_node.bandwidth for c in own]
    mixed = any(r is not None for r in ratios) or any(f != 1 for f in link_factor)

    def scale(name: str, s: int) -> tuple[float, float]:
        r = stage_rank(s, pp)
        ratio = ratios[r]
        return (ratio.get(name, 1.0) if ratio is not None else 1.0), link_factor[r]

    reshard_time: dict[str, float] = {}
    for r in spmd.distinct_reshards():  # charged where they are consumed, as ``stage_costs`` charges them
        if not r.grad_sync_axes:
            reshard_time[r.consumer] = reshard_time.get(r.consumer, 0.0) + r.time

    def node_time(n: Any) -> float:
        p = by_name.get(n.name)
        return p.compute_time + p.comm_time + reshard_time.get(n.name, 0.0) if p is not None else 0.0

    def stage_time(n: Any, s: int) -> float:
        """``node_time`` on stage ``s``'s pipeline rank."""
        p = by_name.get(n.name)
        if p is None:
            return 0.0
        c, m = scale(n.name, s)
        return p.compute_time * c + (p.comm_time + reshard_time.get(n.name, 0.0)) * m

    def over(tl: Any) -> bool:
        """Some pipeline rank peaks over its budget."""
        return any(peak > budgets[r] for r, peak in enumerate(tl.peak_memory))

    def local_bytes(name: str) -> float:
        p, v = by_name.get(name), vals.get(name)
        if p is None or not isinstance(v, torch.Tensor):
            return 0.0
        return math.prod(local_shape(tuple(v.shape), parse_spec(p.outputs[0]), mesh)) * v.element_size()

    # Each compute node's (static, activation) bytes, as ``stage_costs`` places them: a parameter
    # or input with its first reader; what no compute node reads stays with stage 0 (``extra``).
    compute = {n.name for n in gm.graph.nodes if n.op == "call_function"}
    mem: dict[str, list[float]] = {}
    extra = [0.0, 0.0]
    for p in spmd.nodes:
        at = p.name if p.name in compute else facts.first_reader.get(p.name)
        (mem.setdefault(at, [0.0, 0.0]) if at in compute else extra)[0 if p.kind == "param" else 1] += (
            p.memory
        )

    def node_memory(n: Any) -> tuple[float, float]:
        s, a = mem.get(n.name, (0.0, 0.0))
        return s, a

    def play_cut(stage_of: dict[str, int], S: int, actions: Any) -> tuple[list, Any]:
        """The stage costs of a cut, and the schedule played with them."""
        costs = cut_costs(stage_of, S, scale if mixed else None)
        return costs, play(actions, costs, overlap=cluster.overlap_comm)

    def cut_costs(stage_of: dict[str, int], S: int, by: Any) -> list:
        """The stage costs of a cut, each node's times scaled by ``by(node, stage)`` (``None``: the
        stage plan's own)."""
        boundary = [0.0] * S
        for n in gm.graph.nodes:
            s = stage_of.get(n.name)
            if s is None:
                continue
            if any(stage_of.get(u.name, S - 1) > s for u in n.users if u.op == "call_function"):
                boundary[s] += local_bytes(n.name)
        costs = stage_costs(
            spmd,
            stage_of,
            S,
            first_reader=facts.first_reader,
            fwd_share=facts.fwd_share.get,
            trainable_matmul=facts.trainable_matmul,
            boundary_bytes=boundary,
            send_time=lambda b: link.latency + b / link.bandwidth,
            scale=by,
            host_link=cluster.host.link if cluster.host is not None else None,
            host_overlap=cluster.overlap_comm,
        )
        return costs

    def fit_cut(stage_of: dict[str, int], costs: list, tl: Any, S: int, actions: Any) -> tuple:
        """Balanced by time, a rank holds more than its device: the fastest cut under per-stage
        memory caps (a stage keeps its static bytes plus its activations times the micro-batches
        it holds in flight) that share the budget among a rank's stages, so a cut meeting them
        fits (a rank's peak is at most its stages' sum). One stage per rank: each may use the whole
        budget (the memory-constrained partition is then exact). ``v`` stages per rank: the
        shares ``(w, 1 − w)`` for ``w`` = 0.1 … 0.9 with two, else equal shares and shares as the
        time-balanced cut holds memory. Each cut found is played; the fastest that fits wins, or
        the time-balanced cut stays (the caller drops it)."""
        v = S // pp
        flight = [max_in_flight([a for a in actions[stage_rank(k, pp)] if a[1] == k]) for k in range(S)]
        if v == 1:
            shares = [[1.0]]
        elif v == 2:
            shares = [[w / 10, 1 - w / 10] for w in range(1, 10)]
        else:
            held = [costs[k].static + flight[k] * costs[k].activation for k in range(S)]
            on_rank = [sum(held[r::pp]) for r in range(pp)]
            shares = [[1 / v] * v, [held[k] / on_rank[stage_rank(k, pp)] for k in range(S)]]
        best = (stage_of, costs, tl)
        for share in shares:
            caps = [budgets[stage_rank(k, pp)] * share[k // pp if len(share) == v else k] for k in range(S)]

            def fits(k: int, static: float, act: float, caps: list[float] = caps) -> bool:
                if k == 0:
                    static, act = static + extra[0], act + extra[1]
                return static + flight[k] * act <= caps[k]

            try:
                cut = stage_cuts(
                    gm,
                    S,
                    node_time,
                    node_memory=node_memory,
                    fits=fits,
                    stage_time=stage_time if mixed else None,
                )
            except ValueError:
                continue
            c, t = play_cut(cut, S, actions)
            if not over(t) and (over(best[2]) or t.step_time < best[2].step_time):
                best = (cut, c, t)
        return best

    def shares_candidate(base: Scored) -> Scored | None:
        """``base`` (one stage, ``m`` micro-batches on every replica, held to the floor) with
        unequal data-parallel shares (``autopar.dp_shares``): each replica of the first mesh axis
        plays its own micro-batches on its own devices; ``None`` where the replicas are of one
        kind, the plan ties them together (``share_blockers``: logged) or the shares come out
        equal."""
        parts = cluster.replicas(mesh[0]) if mesh else None
        if parts is None or len({c.device.name for c in parts}) < 2:
            return None
        blockers = share_blockers(spmd, gm.graph)
        if blockers:
            log.info("pp=1 m=%d: no unequal data-parallel shares: %s", m, "; ".join(blockers[:3]))
            return None
        pipe = base.plan.pipeline
        assert pipe is not None
        per = []
        for c in parts:
            ratio, f = ratios_on(c), floor.intra_node.bandwidth / c.intra_node.bandwidth
            per.append(
                cut_costs(
                    pipe.stage_of,
                    1,
                    lambda name, s, ratio=ratio, f=f: (ratio.get(name, 1.0) if ratio else 1.0, f),
                )[0]
            )
        shares = balance([c.forward + c.backward_input + c.backward_weight for c in per], m * mesh[0])
        if len(set(shares)) == 1:
            return None
        shared = replace(
            pipe,
            dp_shares=shares,
            replica_costs=tuple({f: getattr(c, f) for f in c.__dataclass_fields__} for c in per),
        )
        p = replace(base.plan, pipeline=shared, info=dict(base.plan.info))
        sim = simulate(p, cluster)  # each replica played on its own devices, the slowest's step
        # One stage holds one micro-batch in flight: every replica peaks alike (the same layout),
        # held to its own device's budget.
        peak = max(sim.timeline.peak_memory)
        if any(peak > budget + c.device.memory - floor.device.memory for c in parts):
            return None
        p.pipeline = replace(shared, peak_memory=(peak,))
        step = sim.step_time
        p.predicted = replace(base.plan.predicted, step_time=step, memory_per_device=peak)
        p.info["simulated"] = {
            "compute_and_comm": sim.timeline.busy[0],
            "bubble_fraction": 0.0,
            "exposed_grad_sync": sim.timeline.exposed_sync[0],
            "optimizer": sim.optimizer_time,
        }
        return Scored(p, step, f"{base.what} shares {':'.join(map(str, shares))}")

    if cuts is not None:  # a user's cut: wrong is an error, not a candidate that does not fit
        missing = [n for n in compute if n not in cuts]
        stages = pp * (config.virtual or 1)
        if missing or set(cuts.values()) != set(range(stages)):
            raise ValueError(
                f"the held cut (PlanConfig.stage_of) does not cut this graph into {stages} stages: "
                f"{len(missing)} of its {len(compute)} compute nodes have no stage (e.g. {missing[:3]}), "
                f"stages {sorted(set(cuts.values()))}; give the stage_of of a plan of the same model, "
                "inputs, pp, virtual and micro-batch count"
            )
    n_seams = len(seams(gm))
    if config.schedule:
        schedules = [config.schedule]
    elif pp == 1:  # gradient accumulation: one stage, its micro-batches one after another
        schedules = ["1f1b"]
    else:
        schedules = ["1f1b", "zb-h1", "gpipe", "interleaved"]
    out = []
    for schedule in schedules:
        vs = [config.virtual] if config.virtual else ([2] if schedule == "interleaved" else [1])
        for v in vs:
            label = f"pp={pp} m={m} {schedule}" + (f" v={v}" if v > 1 else "")
            if schedule == "interleaved" and (m % pp or pp * v - 1 > n_seams):
                why.append(
                    f"{label}: needs m a multiple of pp and {pp * v - 1} seams (the model has {n_seams})"
                )
                continue
            if v > 1 and schedule != "interleaved":
                continue
            S = pp * v
            try:
                actions = make_schedule(schedule, pp, m, v)
                if cuts is not None:
                    stage_of = dict(cuts)
                elif by_layers:
                    stage_of = layer_cuts(gm, S)
                else:
                    stage_of = stage_cuts(gm, S, node_time, stage_time=stage_time if mixed else None)
            except ValueError as e:
                why.append(f"{label}: {e}")
                continue
            costs, tl = play_cut(stage_of, S, actions)
            if over(tl) and not by_layers and cuts is None:
                stage_of, costs, tl = fit_cut(stage_of, costs, tl, S, actions)
            peak = max(tl.peak_memory)
            if over(tl):
                log.info(
                    "%s: peak memory %.2f GiB over the budget %.2f GiB", label, peak / 2**30, budget / 2**30
                )
                rank = max(range(len(tl.peak_memory)), key=lambda r: tl.peak_memory[r] - budgets[r])
                why.append(
                    f"{label}: pipeline rank {rank} peaks at {fmt_bytes(tl.peak_memory[rank])}, over the memory "
                    f"budget of {fmt_bytes(budgets[rank])} per device"
                )
                continue
            pipe = PipelinePlan(
                pp=pp,
                microbatches=m,
                schedule=schedule,
                virtual=v,
                stage_of=stage_of,
                stage_costs=tuple(
                    {f: getattr(c, f) for f in c.__dataclass_fields__}
                    for c in costs  # type: ignore[attr-defined]
                ),
                bubble_fraction=tl.bubble_fraction(),
                peak_memory=tuple(tl.peak_memory),
            )
            p = replace(spmd, pipeline=pipe, info=dict(spmd.info))
            p.info["memory_budget"] = budget  # one device's, not the stage plan's pp × budget
            p.info["memory_reserve"] = max(0.0, cluster.device.memory - budget)
            opt = max(optimizer_time(p, own[r], range(r, S, pp)) for r in range(pp))
            step = tl.step_time + opt
            p.predicted = replace(spmd.predicted, step_time=step, memory_per_device=peak)
            p.info["simulated"] = {
                "compute_and_comm": max(tl.busy),
                "bubble_fraction": tl.bubble_fraction(),
                "exposed_grad_sync": max(tl.exposed_sync),
                "optimizer": opt,
            }
            out.append(Scored(p, step, label))
    if pp == 1 and m > 1 and out and cluster.mixed_kinds:
        shared = shares_candidate(out[0])
        if shared is not None:
            out.append(shared)
    return out


@dataclass
class Player:
    """A ``(pp, m)`` candidate's score of a stage plan (``plan_captured(score=…)``): the fastest
    step its schedules play (``pipelined_candidates``), the candidates kept for the plan chosen."""

    gm: Any
    cluster: Cluster
    config: PlanConfig
    pp: int
    m: int
    budget: float
    played: dict[int, list[Scored]] = field(default_factory=dict)

    def candidates(self, p: Plan) -> list[Scored]:
        if id(p) not in self.played:
            self.played[id(p)] = pipelined_candidates(
                p, self.gm, self.cluster, self.config, self.pp, self.m, self.budget
            )
        return self.played[id(p)]

    def __call__(self, p: Plan) -> float:
        return min((c.step_time for c in self.candidates(p)), default=math.inf)

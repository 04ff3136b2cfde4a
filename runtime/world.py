"""This rank's place among the ranks: the world checked against the plan, rank 0's plan broadcast to
the others, the process group of every mesh axis (and of several axes together), and the device
this rank computes on.

Every rank calls these in the same order (process groups are created collectively).
``join_mesh`` gathers what ``autopar.parallelize`` needs into one :class:`RankWorld`.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from autopar.cluster import Cluster, mesh_arithmetic
from autopar.planfile import Plan
from autopar.program.collectives import AxisGroup
from autopar.runtime.monitor import DEFAULT_TIMEOUT

__all__ = ["RankWorld", "broadcast_plan", "check_world", "device_for_backend", "join_mesh", "mesh_axes"]


def device_for_backend(backend: str) -> torch.device:
    """The device this rank computes on: its CUDA device under NCCL, else the CPU."""
    if backend == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def broadcast_plan(plan_fn: Callable[[], Plan]) -> Plan:
    """Run ``plan_fn`` on rank 0 and broadcast its Plan as JSON (or its error) to every rank, so
    a planning error is raised on every rank and none waits forever."""
    payload: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            payload[0] = ("ok", json.dumps(plan_fn().to_dict()))
        except Exception as exc:  # sent to the other ranks, then re-raised on every rank
            payload[0] = ("error", f"{type(exc).__name__}: {exc}")
    dist.broadcast_object_list(payload, src=0)
    status, body = payload[0]
    if status != "ok":
        raise RuntimeError(f"planning failed on rank 0: {body}")
    return Plan.from_dict(json.loads(body))


def check_world(plan: Plan | None, cluster: Cluster) -> int:
    """The world size, after checking ``torch.distributed`` is up and matches the plan/cluster."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "autopar.parallelize needs torch.distributed: call torch.distributed.init_process_group(...) on every "
            "rank first (or use autopar.runtime.launch.spawn for local processes)"
        )
    world = dist.get_world_size()
    if plan is not None and plan.world_size != world:
        pp = f"{plan.pipeline.pp} pipeline ranks × " if plan.pipeline is not None else ""
        raise ValueError(
            f"plan mesh {pp}{mesh_arithmetic(tuple(plan.mesh_shape))} ≠ world size {world}: run it on "
            f"{plan.world_size} processes, or plan again for {world}"
        )
    if plan is None and cluster.world_size != world:
        raise ValueError(
            f"cluster has {cluster.nodes} × {cluster.gpus_per_node} = {cluster.world_size} devices but the process "
            f"group has {world} ranks"
        )
    return world


def mesh_axes(
    shape: Sequence[int],
    names: Sequence[str],
    device: torch.device,
    timeout: float = DEFAULT_TIMEOUT,
    stage_from: int = 0,
    two_level: Sequence[Sequence[int]] = (),
    gpus_per_node: int = 1,
) -> tuple[list[AxisGroup], Any, Any]:
    """This rank's view of every axis of the mesh ``shape`` (named ``names``) — its own process
    group, created with the collective ``timeout`` (seconds), and its coordinate — a
    ``DeviceMesh`` over those groups (for DTensor checkpoints) and a group of all ranks with the
    same timeout (input checks). Every rank must call this (groups are created collectively, in
    the same order everywhere).

    Each set of two or more axes from ``stage_from`` on (the axes inside a pipeline stage), all
    of more than one device, gets a group too (``AxisGroup.combined``, keyed by the axes' indices
    counted from ``stage_from``): a gradient partial on several axes is all-reduced once over
    them.

    Each set of axes in ``two_level`` (indices into ``shape``; ``Plan.two_level``) gets, for each
    of its groups, a group of the members on each node (``gpus_per_node`` consecutive ranks) and a
    group of the members at each place on their nodes (``AxisGroup.levels``;
    ``passes.two_level``)."""
    from torch.distributed.device_mesh import DeviceMesh

    shape = tuple(shape)
    rank = dist.get_rank()
    ranks = torch.arange(math.prod(shape)).reshape(shape)
    coord = [int(c) for c in torch.nonzero(ranks == rank)[0]]
    span = datetime.timedelta(seconds=timeout)
    groups = []
    for a, n in enumerate(shape):
        mine = None
        for sub in ranks.movedim(a, -1).reshape(-1, n).tolist():  # every group of axis a
            g = dist.new_group(sub, timeout=span)
            if rank in sub:
                mine = g
        groups.append(mine)
    world_group = dist.new_group(list(range(ranks.numel())), timeout=span)
    mesh = DeviceMesh.from_group(groups, device.type, mesh=ranks, mesh_dim_names=tuple(names))
    axes = [
        AxisGroup(axis=a, name=names[a], size=n, coord=coord[a], group=groups[a]) for a, n in enumerate(shape)
    ]
    combined: dict[tuple[int, ...], AxisGroup] = {}
    wide = [a for a in range(stage_from, len(shape)) if shape[a] > 1]
    for k in range(2, len(wide) + 1):
        for span_axes in itertools.combinations(wide, k):
            others = [a for a in range(len(shape)) if a not in span_axes]
            size = math.prod(shape[a] for a in span_axes)
            mine, at = None, 0
            for sub in ranks.permute(*others, *span_axes).reshape(-1, size).tolist():
                g = dist.new_group(sub, timeout=span)
                if rank in sub:
                    mine, at = g, sub.index(rank)
            parts = tuple(axes[a] for a in span_axes)
            key = tuple(a - stage_from for a in span_axes)
            name = "·".join(names[a] for a in span_axes)
            combined[key] = AxisGroup(axis=-1, name=name, size=size, coord=at, group=mine, parts=parts)
    for ax in axes:
        ax.combined = combined
    for span_axes in two_level:
        span_axes = tuple(sorted(span_axes))
        parent = (
            axes[span_axes[0]] if len(span_axes) == 1 else combined[tuple(a - stage_from for a in span_axes)]
        )
        others = [a for a in range(len(shape)) if a not in span_axes]
        size = math.prod(shape[a] for a in span_axes)
        groups = ranks.permute(*others, *span_axes).reshape(-1, size).tolist()
        parent.levels = _levels(parent, groups, gpus_per_node, span)
    return axes, mesh, world_group


def _levels(
    parent: AxisGroup, groups: list[list[int]], gpus_per_node: int, span: datetime.timedelta
) -> tuple[AxisGroup, AxisGroup] | None:
    """This rank's two levels of ``parent`` (``AxisGroup.levels``): every group of ``groups`` (the
    ranks of each of ``parent``'s groups) split into its members on each node and its members at
    each place on their nodes, each a process group (every rank creates all of them, in order)."""
    rank = dist.get_rank()
    mine: dict[str, AxisGroup] = {}
    for sub in groups:
        nodes: dict[int, list[int]] = {}
        for r in sorted(sub):
            nodes.setdefault(r // gpus_per_node, []).append(r)
        per = {len(m) for m in nodes.values()}
        if len(per) != 1 or len(nodes) < 2 or min(per) < 2:
            raise ValueError(
                f"the plan reduces {parent.name}'s gradients in two levels, but its group {sub} has "
                f"{[len(m) for m in nodes.values()]} members on its nodes of {gpus_per_node} ranks: two "
                f"levels need at least 2 nodes with the same number (≥ 2) on each; plan again for this world"
            )
        places = [[m[place] for m in nodes.values()] for place in range(min(per))]
        for level, lists in (("node", list(nodes.values())), ("across", places)):
            for members in lists:
                g = dist.new_group(members, timeout=span)
                if rank in members:
                    mine[level] = AxisGroup(
                        axis=-1,
                        name=f"{parent.name}/{level}",
                        size=len(members),
                        coord=members.index(rank),
                        group=g,
                        parts=(parent,),
                    )
    return (mine["node"], mine["across"]) if len(mine) == 2 else None


class _Released:
    """Stands for a process group ``RankWorld.release`` destroyed: any use says so."""

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError(
            "this process group was released after a training step failed on this rank: build the module again "
            "with autopar.parallelize on every rank"
        )


_RELEASED: Any = _Released()


@dataclass(eq=False)
class RankWorld:
    """This rank's process groups for a plan (``join_mesh``)."""

    axes: list[AxisGroup]
    """The mesh axes inside a pipeline stage (the plan's mesh), as this rank sees them."""
    pp: AxisGroup | None
    """The pipeline axis (a pipelined plan), else ``None``."""
    device: torch.device
    device_mesh: Any
    """A ``DeviceMesh`` over the axis groups (DTensor checkpoints)."""
    world_group: Any
    """A group of every rank with the collective timeout (input checks, agreeing on compilation)."""
    timeout: float

    @property
    def all_axes(self) -> list[AxisGroup]:
        """Every axis: the pipeline axis first where there is one."""
        return [self.pp, *self.axes] if self.pp is not None else list(self.axes)

    def release(self) -> None:
        """Destroy every process group of this world that this rank is in, and drop this world's
        references to them (its axes', the device mesh's, the all-rank group's). A gloo group
        closes its connections only when its last reference goes: a peer blocked in one of its
        collectives then fails at once ("Connection closed by peer") instead of waiting out the
        collective timeout — what a rank whose step failed does for the others
        (``ParallelModule``). The world runs nothing afterwards. Idempotent."""
        seen: set[int] = set()
        axes = [*self.all_axes, *(c for ax in self.all_axes for c in ax.combined.values())]
        axes += [level for ax in list(axes) for level in ax.levels or ()]
        groups = [ax.group for ax in axes] + [self.world_group]
        for ax in axes:
            ax.group = _RELEASED
        self.world_group, self.device_mesh = None, None
        for g in groups:
            if g is None or g is _RELEASED or id(g) in seen or g == dist.GroupMember.NON_GROUP_MEMBER:
                continue
            seen.add(id(g))
            with contextlib.suppress(Exception):  # already destroyed (the user's destroy_process_group())
                dist.destroy_process_group(g)

    def pp_groups(self) -> list[list[int]]:
        """The global ranks of every pipeline group (the outermost mesh axis), by coordinate."""
        assert self.pp is not None
        pp, world = self.pp.size, dist.get_world_size()
        return [[c * (world // pp) + i for c in range(pp)] for i in range(world // pp)]


def join_mesh(plan: Plan, device: torch.device, timeout: float = DEFAULT_TIMEOUT) -> RankWorld:
    """This rank's groups for ``plan``: its mesh, under a pipeline axis where the plan is pipelined
    (``(pp, *plan.mesh_shape)``; the combined groups span the axes inside a stage only)."""
    per_node = int(plan.cluster.get("gpus_per_node", 1))
    if plan.pipeline is None:
        axes, mesh, world_group = mesh_axes(
            plan.mesh_shape, plan.mesh_axes, device, timeout, two_level=plan.two_level, gpus_per_node=per_node
        )
        return RankWorld(axes, None, device, mesh, world_group, timeout)
    shape, names = (plan.pipeline.pp, *plan.mesh_shape), ("pp", *plan.mesh_axes)
    two = [tuple(1 + a for a in axis_set) for axis_set in plan.two_level]
    axes, mesh, world_group = mesh_axes(
        shape, names, device, timeout, stage_from=1, two_level=two, gpus_per_node=per_node
    )
    return RankWorld(axes[1:], axes[0], device, mesh, world_group, timeout)

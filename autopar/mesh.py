"""The device mesh: devices arranged as an N-D grid over a cluster, with the cost of collectives
along each axis (Alpa's ``LogicalDeviceMesh.all_gather_cost(num_bytes, mesh_dim)``).

Words:

* **mesh** — ``shape`` (row-major, the last axis innermost, so its devices sit closest together:
  consecutive ranks, one node first), laid over the first ``prod(shape)`` ranks of ``cluster``.
  A pipeline stage's mesh covers ``world_size / pp`` ranks; the pipeline axis is outermost.
* **axis kind** — what the axis does (:class:`AxisKind`): ``dp`` splits the batch, ``tp`` the
  weights, ``sp`` the sequence, ``cp`` the context (attention's keys and values), ``ep`` the
  experts, ``pp`` the pipeline stages, ``rep`` nothing (every device repeats the same work).
  Candidate meshes carry no kinds; a plan's mesh is named from the strategies the solver chose.
* **link** — the ``autopar.devices.Link`` an axis's collectives use: the node's NVLink when all
  its devices share a node, the inter-node network otherwise (``Cluster.axis_link``).
* **group** — the devices a collective over one or several axes runs on (``Mesh.group``):
  ``per_node`` devices on each of ``nodes`` nodes, so a collective that spans nodes uses as many
  NICs in parallel as NCCL does (``autopar.cost.comm``).

The cost methods apply the α-β formulas of ``autopar.cost.comm`` on the group of the axes they are
given: one axis (``mesh.all_reduce_cost(nbytes, 1)``) or several at once
(``mesh.all_reduce_cost(nbytes, axes=(0, 1))``: a gradient replicated on both axes is reduced by
one hierarchical collective over their product, not by two all-reduces).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from autopar.cluster import Cluster, mesh_arithmetic
from autopar.cost import comm
from autopar.cost.compute import memory_time
from autopar.devices import Link

__all__ = ["AxisKind", "Mesh"]


class AxisKind(str, enum.Enum):
    """What a mesh axis does (see module docstring)."""

    DP = "dp"
    TP = "tp"
    SP = "sp"
    CP = "cp"
    EP = "ep"
    PP = "pp"
    REP = "rep"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, slots=True)
class Mesh:
    """An N-D device mesh on a cluster (see module docstring)."""

    shape: tuple[int, ...]
    cluster: Cluster
    names: tuple[str, ...] = ()
    """Axis names, e.g. ``("dp", "tp")``; ``("ax0", "ax1", ...)`` when not named yet."""
    _groups: dict[tuple[int, ...], comm.Group] = field(
        default_factory=dict, init=False, compare=False, repr=False
    )
    """Memo of ``group``: the span of a set of axes is fixed by the shape and the cluster."""
    _two_levels: dict[tuple[int, ...], bool] = field(
        default_factory=dict, init=False, compare=False, repr=False
    )
    """Memo of ``two_level`` (its even-span check walks every group of the axes)."""

    def __post_init__(self) -> None:
        shape = tuple(self.shape)
        object.__setattr__(self, "shape", shape)
        if not shape or any(not isinstance(n, int) or n < 1 for n in shape):
            raise ValueError(f"mesh shape {shape} must be a non-empty tuple of positive integers")
        devices = math.prod(shape)
        world = self.cluster.world_size
        if world % devices:
            raise ValueError(
                f"mesh {mesh_arithmetic(shape)} does not divide the cluster's {world} devices "
                f"({self.cluster.nodes} node(s) × {self.cluster.gpus_per_node})"
            )
        if not self.names:
            object.__setattr__(self, "names", tuple(f"ax{i}" for i in range(len(shape))))
        elif len(self.names) != len(shape):
            raise ValueError(
                f"mesh shape {shape} has {len(shape)} axes but {len(self.names)} names {self.names}"
            )

    @classmethod
    def full(cls, shape: tuple[int, ...], cluster: Cluster, names: tuple[str, ...] = ()) -> Mesh:
        """A mesh over the whole cluster (``prod(shape)`` must equal its world size)."""
        cluster.validate_mesh(tuple(shape))
        return cls(tuple(shape), cluster, names)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def devices(self) -> int:
        return math.prod(self.shape)

    def size(self, axis: int) -> int:
        return self.shape[axis]

    def link(self, axis: int) -> Link:
        """The link mesh axis ``axis`` uses (``Cluster.axis_link``)."""
        return self.cluster.axis_link(self.shape, axis)

    def kind(self, axis: int) -> AxisKind | None:
        """The axis's kind when its name is one (``"dp"``, ``"tp"`` … or ``"dp0"``), else None."""
        name = self.names[axis].rstrip("0123456789")
        return AxisKind(name) if name in AxisKind._value2member_map_ else None

    def group(self, axes: int | Sequence[int]) -> comm.Group:
        """The device group that mesh axes ``axes`` form (``Cluster.group_span``)."""
        key = _axes(axes)
        g = self._groups.get(key)
        if g is None:
            sizes = tuple(a for a in key if self.shape[a] > 1)
            per_node, nodes = self.cluster.group_span(self.shape, sizes) if sizes else (1, 1)
            c = self.cluster
            g = self._groups[key] = comm.Group(
                per_node=per_node,
                nodes=nodes,
                intra=c.intra_node,
                inter=c.network_link(self.shape, sizes),
                nics=c.nics,
                sharing=max(1, min(c.gpus_per_node, self.devices) // per_node),
            )
        return g

    # ----------------------------------------------------------------- α-β costs on axes
    def all_reduce_cost(
        self,
        nbytes: float,
        axis: int | Sequence[int] = (),
        *,
        axes: Sequence[int] | None = None,
        bucketed: bool = False,
        two_level: bool = False,
    ) -> float:
        """All-reduce of an ``nbytes`` buffer over ``axis`` (one axis or several: one collective
        over their product); ``bucketed``: fused into a bucket with others (DDP's gradient
        buckets), so it pays bandwidth but no per-message latency; ``two_level``: a gradient
        all-reduce the runtime can run in two levels, which it does where that pays
        (``two_level``, the method)."""
        key = axes if axes is not None else axis
        g = self.group(key)
        if bucketed:
            g = g.without_latency()
        if two_level and self.two_level(key):
            return comm.two_level_all_reduce_cost(nbytes, g)
        return comm.group_all_reduce_cost(nbytes, g)

    def two_level(self, axes: int | Sequence[int]) -> bool:
        """Whether the collectives over ``axes`` that the rank program splits — gradient
        all-reduces (on each node, then across the nodes, then on each node again), reduce-scatters
        and all-gathers — run in two levels (``autopar.cost.comm.two_level_pays``): the cluster
        allows it (``Cluster.two_level``), its groups span several nodes with the same
        number of members on each, and the two levels are faster than one collective."""
        key = tuple(a for a in _axes(axes) if self.shape[a] > 1)
        got = self._two_levels.get(key)
        if got is None:
            got = self._two_levels[key] = bool(
                key
                and self.cluster.two_level
                and self.cluster.even_span(self.shape, key)
                and comm.two_level_pays(self.group(key))
            )
        return got

    def all_gather_cost(
        self,
        nbytes: float,
        axis: int | Sequence[int] = (),
        *,
        axes: Sequence[int] | None = None,
        bucketed: bool = False,
        two_level: bool = True,
    ) -> float:
        """All-gather producing an ``nbytes`` buffer over ``axis``; ``bucketed``: one of a bucket's
        (as ``all_reduce_cost``: bandwidth, no per-message latency); ``two_level``: one the rank
        program runs in two levels where its axes do (``two_level``, the method: every all-gather
        of the step program, not those inside a compression module)."""
        key = axes if axes is not None else axis
        g = self.group(key)
        if bucketed:
            g = g.without_latency()
        if two_level and self.two_level(key):
            return comm.two_level_all_gather_cost(nbytes, g) + self._reorder(nbytes)
        return comm.group_all_gather_cost(nbytes, g)

    def reduce_scatter_cost(
        self,
        nbytes: float,
        axis: int | Sequence[int] = (),
        *,
        axes: Sequence[int] | None = None,
        two_level: bool = True,
    ) -> float:
        """Reduce-scatter of an ``nbytes`` input over ``axis``, in two levels where its axes run
        them so (``two_level``, the method) unless ``two_level=False``."""
        key = axes if axes is not None else axis
        g = self.group(key)
        if two_level and self.two_level(key):
            return comm.two_level_reduce_scatter_cost(nbytes, g) + self._reorder(nbytes)
        return comm.group_reduce_scatter_cost(nbytes, g)

    def _reorder(self, nbytes: float) -> float:
        """The device copy that lays a two-level reduce-scatter's pieces out place-major (or an
        all-gather's back): ``nbytes`` read and written (``autopar.cost.compute.memory_time``)."""
        return memory_time(2 * nbytes, self.cluster.device)

    def all_to_all_cost(
        self, nbytes: float, axis: int | Sequence[int] = (), *, axes: Sequence[int] | None = None
    ) -> float:
        """All-to-all of ``nbytes`` per device over ``axis``."""
        return comm.group_all_to_all_cost(nbytes, self.group(axes if axes is not None else axis))

    def p2p_cost(self, nbytes: float, axis: int) -> float:
        """One send/recv of ``nbytes`` between neighbours along ``axis`` (a pipeline's stages):
        over NVLink inside a node, one NIC across nodes."""
        return comm.p2p_cost(nbytes, self.link(axis))

    def __str__(self) -> str:
        return " × ".join(f"{a}={n}" for a, n in zip(self.names, self.shape))


def _axes(axes: int | Sequence[int]) -> tuple[int, ...]:
    return (axes,) if isinstance(axes, int) else tuple(sorted(set(axes)))

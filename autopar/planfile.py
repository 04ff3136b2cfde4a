"""The Plan record and its file format (``autopar.plan`` is the function that makes one): everything
codegen needs to run a model in parallel, and a person needs to read it.

A Plan records the mesh (shape and axis names), for every graph node the strategy chosen (the spec
of each tensor input and output, per-axis rewrites and in-op collectives), the placement of every
parameter and user input, every reshard between nodes with its collectives, and the predicted
step time, memory and communication. It is pure data: JSON out (``save``), JSON in (``load``),
an exact round trip, and loading needs neither OR-Tools nor the model.

Specs are written one string per mesh axis: ``"R"``, ``"P"``, ``"S(d)"`` (``"S(d)xk"`` when a
fused weight is sharded block by block; see ``autopar.placement``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import autopar.display as display
from autopar.grad_compression import GradCompression
from autopar.placement import Spec, parse_spec
from autopar.plan_schema import checksum, validate

__all__ = ["FusionPlan", "NodePlan", "PipelinePlan", "Plan", "Predicted", "ReshardPlan"]

FORMAT_VERSION = 2
"""Version 2: ``NodePlan.zero_stage`` replaced the ``zero1``/``zero2`` rewrite tags of version 1."""


@dataclass(frozen=True, slots=True)
class NodePlan:
    """The strategy chosen for one graph node."""

    name: str
    op: str
    module: str
    kind: str
    """``param``, ``buffer``, ``input`` or ``op``."""
    fqn: str
    inputs: tuple[tuple[str, ...] | None, ...]
    """Spec each tensor input must arrive in (``tensor_inputs`` order)."""
    input_names: tuple[str, ...]
    outputs: tuple[tuple[str, ...], ...]
    rewrites: tuple[str, ...]
    """Per mesh axis: the ``autopar.ir.Rewrite`` value the lowering applies ("" for none)."""
    comms: tuple[str, ...]
    split: tuple[bool, ...]
    shape: tuple[int, ...]
    compute_time: float
    comm_time: float
    memory: float
    zero_stage: int = 0
    """ZeRO stage (1, 2, 3) of a trainable parameter stored sharded; 0 otherwise."""
    offloaded: float = 0.0
    """Bytes of saved activations sent to host memory and back each micro-batch (activation
    offload: ``Plan.offload_layers``); not in ``memory``."""
    recomputed: bool = False
    """Computed again in backward instead of saved (``Plan.recompute == "ops"``: the solver's
    per-activation choice)."""
    split_gain: tuple[float, ...] = ()
    """Per mesh axis: the fraction of the op's compute that splitting it along the axis saves, by
    the cost model — among its strategies that split the other axes as the chosen one does, one
    less the fastest that splits this axis over the fastest that does not: ``(n − 1)/n`` for
    kernels that fill the device, less for kernels too small to (a tiny model's LM head takes as
    long on a piece); -1 where the planner had no such pair to compare (a layout that fixed the
    op's strategy). The plan audit's replicated work counts by it (``autopar.audit``). Empty
    where the plan's maker did not record it."""


@dataclass(frozen=True, slots=True)
class ReshardPlan:
    """A producer's output turned into the spec a consumer wants."""

    producer: str
    consumer: str
    src: tuple[str, ...]
    dst: tuple[str, ...]
    collectives: tuple[str, ...]
    """e.g. ``("all_gather(axis=1, dim=2)",)``; empty for a gradient sync only."""
    grad_sync_axes: tuple[int, ...]
    """Axes whose backward all-reduces (or reduce-scatters) the gradient (Megatron's ``f``)."""
    time: float
    """Forward + backward seconds."""
    bytes_per_axis: tuple[float, ...]
    blocking: float = 0.0
    """Seconds of ``time`` spent on the device's compute rather than beside it: a compressed
    gradient all-reduce's own work (``autopar.cost.compression``; ``Plan.compression``)."""


@dataclass(frozen=True, slots=True)
class FusionPlan:
    """A group of nodes the cost model charged as one fused kernel (``autopar.passes.fusion``):
    what the plan assumed the runtime's ``fuse_kernels`` pass fuses."""

    kind: str
    """The kernel family (``autopar.ir.FusionKind``: ``add_rms_norm``, ``rotary`` …)."""
    members: tuple[str, ...]
    """The captured nodes it replaces, in program order."""
    anchor: str
    """The member whose ``compute_time`` holds the fused kernel's time (the others hold none)."""


@dataclass(frozen=True, slots=True)
class Predicted:
    """What the cost model predicts for one training step."""

    step_time: float
    compute_time: float
    comm_time: float
    memory_per_device: float
    """Bytes, the largest over devices (all devices hold equal shards)."""
    comm_bytes_per_axis: tuple[float, ...]
    optimal: bool
    """CP-SAT proved the plan optimal for the cost model."""
    gap: float = 0.0
    """Otherwise, the fraction of the optimum the solver's objective may be above it
    (``autopar.solver.SolverConfig.relative_gap``)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PipelinePlan:
    """Pipeline stages of a plan (``autopar.schedule`` defines the words): the plan's mesh is one
    stage's mesh, repeated ``pp`` times along an outer pipeline axis."""

    pp: int
    microbatches: int
    schedule: str
    virtual: int
    """Stages per pipeline rank (``v``; > 1 with the interleaved schedule)."""
    stage_of: dict[str, int]
    """Captured node name -> stage ``0 … pp·v − 1``."""
    stage_costs: tuple[dict[str, float], ...] = ()
    """Per stage, the ``autopar.cost.timeline.StageCost`` fields the simulator plays (seconds and
    bytes of one micro-batch)."""
    bubble_fraction: float = 0.0
    """Predicted idle share of the pipelined compute (``autopar.cost.timeline``)."""
    peak_memory: tuple[float, ...] = ()
    """Predicted peak bytes per pipeline rank."""
    dp_shares: tuple[int, ...] = ()
    """Unequal data-parallel shares (``autopar.dp_shares``): the micro-batches each coordinate of
    the stage mesh's first axis runs, summing to ``microbatches`` × that axis's size; every
    micro-batch has the same rows. Empty: each runs ``microbatches``. One stage only (``pp = 1``,
    gradient accumulation)."""
    replica_costs: tuple[dict[str, float], ...] = ()
    """With ``dp_shares``: per coordinate of the first axis, its one stage's costs per micro-batch
    on its own devices (as ``stage_costs``, which holds the floor device's)."""

    def __post_init__(self) -> None:
        if not self.dp_shares:
            if self.replica_costs:
                raise ValueError("PipelinePlan: replica_costs are given only with dp_shares")
            return
        shares = tuple(int(k) for k in self.dp_shares)
        object.__setattr__(self, "dp_shares", shares)
        if self.pp != 1 or self.virtual != 1:
            raise ValueError(
                f"PipelinePlan: unequal data-parallel shares {shares} run with one stage (pp = 1, gradient "
                f"accumulation), not pp = {self.pp} × v = {self.virtual}"
            )
        n, want = len(shares), self.microbatches * len(shares)
        if min(shares) < 1 or sum(shares) != want:
            raise ValueError(
                f"PipelinePlan: dp_shares {shares} must each be >= 1 and sum to microbatches × {n} = "
                f"{self.microbatches} × {n} = {want} (they sum to {sum(shares)})"
            )
        if self.replica_costs and len(self.replica_costs) != n:
            raise ValueError(
                f"PipelinePlan: {len(self.replica_costs)} replica_costs for {n} dp_shares; give one per share"
            )

    @property
    def num_stages(self) -> int:
        return self.pp * self.virtual

    def microbatches_at(self, coord0: int) -> int:
        """Micro-batches run by the ranks at coordinate ``coord0`` of the stage mesh's first axis."""
        return self.dp_shares[coord0] if self.dp_shares else self.microbatches

    def actions(self, coord0: int | None = None) -> list[list[tuple[str, int, int]]]:
        """Every pipeline rank's actions (``autopar.schedule.make_schedule``); with ``dp_shares``,
        those of the ranks at coordinate ``coord0`` of the stage mesh's first axis."""
        from autopar.schedule import make_schedule

        if self.dp_shares and coord0 is None:
            raise ValueError("PipelinePlan.actions: a plan with dp_shares needs the first axis's coordinate")
        m = self.microbatches if coord0 is None else self.microbatches_at(coord0)
        return make_schedule(self.schedule, self.pp, m, self.virtual)

    def to_dict(self) -> dict[str, Any]:
        return {
            "pp": self.pp,
            "microbatches": self.microbatches,
            "schedule": self.schedule,
            "virtual": self.virtual,
            "stage_of": dict(self.stage_of),
            "stage_costs": [dict(c) for c in self.stage_costs],
            "bubble_fraction": self.bubble_fraction,
            "peak_memory": list(self.peak_memory),
            **({"dp_shares": list(self.dp_shares)} if self.dp_shares else {}),
            **({"replica_costs": [dict(c) for c in self.replica_costs]} if self.replica_costs else {}),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PipelinePlan:
        return cls(
            pp=int(d["pp"]),
            microbatches=int(d["microbatches"]),
            schedule=str(d["schedule"]),
            virtual=int(d.get("virtual", 1)),
            stage_of={str(k): int(v) for k, v in d["stage_of"].items()},
            stage_costs=tuple(dict(c) for c in d.get("stage_costs", ())),
            bubble_fraction=float(d.get("bubble_fraction", 0.0)),
            peak_memory=tuple(float(x) for x in d.get("peak_memory", ())),
            dp_shares=tuple(int(k) for k in d.get("dp_shares", ())),
            replica_costs=tuple(dict(c) for c in d.get("replica_costs", ())),
        )


@dataclass
class Plan:
    """A parallel execution plan (see module docstring)."""

    mesh_shape: tuple[int, ...]
    mesh_axes: tuple[str, ...]
    nodes: list[NodePlan]
    params: dict[str, tuple[str, ...]]
    """Parameter FQN (first name) -> spec."""
    param_aliases: dict[str, list[str]]
    inputs: dict[str, tuple[str, ...]]
    """User input path (``"input_ids"``, ``"args[0]"``) -> spec."""
    reshards: list[ReshardPlan]
    predicted: Predicted
    cluster: dict[str, Any]
    fingerprint: str
    """Hash of the captured graph the plan was made for."""
    info: dict[str, Any] = field(default_factory=dict)
    """Provenance: solver statistics, candidate meshes tried, planning time, layout name."""
    pipeline: PipelinePlan | None = None
    """Pipeline stages, micro-batches and schedule; ``None``: one stage (the mesh is the world)."""
    recompute: str = "none"
    """Activation recomputation in every repeated layer: ``"none"``, ``"selective"`` (attention
    scores), ``"full"`` (keep each layer's input; ``autopar.passes.recompute``) or ``"ops"`` (the
    activations the solver chose, per activation: ``NodePlan.recomputed``)."""
    recompute_layers: tuple[str, ...] | None = None
    """The repeated-layer instances ``recompute`` applies to (``transformer.h.0``, in the order the
    forward runs them); the others keep their activations. ``None``: every repeated layer."""
    fusions: list[FusionPlan] = field(default_factory=list)
    """The fused kernels the predicted costs assume (empty on a CPU cluster or with
    ``disable=("fuse_kernels",)``; ``fusion_counts()`` per kind)."""
    compile: bool = False
    """The predicted costs are the step compiled by Inductor (``PlanConfig.compile``:
    ``autopar.passes.chains``); ``parallelize`` given this plan compiles unless told otherwise."""
    compression: GradCompression | None = None
    """How the data-parallel gradient all-reduces are compressed (``PlanConfig.compression``,
    ``autopar.cost.compression``; the runtime's ``passes.compress``); ``None``: reduced exactly."""
    offload_layers: tuple[str, ...] = ()
    """Repeated-layer instances whose saved activations are copied to host memory as the forward
    makes them and fetched back, a layer ahead, for their backward (``PlanConfig.offload_activations``,
    ``autopar.cost.offload``; the runtime's ``passes.offload_activations``)."""
    two_level: tuple[tuple[int, ...], ...] = ()
    """The mesh axis sets (indices into ``mesh_shape``) whose gradient all-reduces run in two levels — reduce-scatter on each
    node, all-reduce across the nodes, all-gather on each node — and whose reduce-scatters and
    all-gathers do too (on each node then across, or across then on each node), where the cost
    model found that faster than one collective (``autopar.cost.comm.two_level_pays``; the
    runtime's ``passes.two_level``)."""
    offload_optimizer: bool = False
    """The optimizer state and master weights live in host memory and the optimizer step runs on
    the host (``PlanConfig.offload_optimizer``, ``autopar.cost.offload``); the runtime's
    ``ParallelModule.optimizer`` builds that optimizer (``autopar.runtime.host_optimizer``)."""

    @property
    def world_size(self) -> int:
        """Devices the plan runs on: the stage mesh times the pipeline ranks."""
        return math.prod(self.mesh_shape) * (self.pipeline.pp if self.pipeline is not None else 1)

    # ------------------------------------------------------------------ queries
    def param_placements(self, detailed: bool = False) -> dict[str, tuple[str, ...]]:
        """Every parameter's spec, keyed by all its ``model.named_parameters()`` names.

        One entry per mesh axis, ``"R"`` or ``"S(d)"``; ``detailed=True`` keeps block counts of
        fused weights (``"S(1)x3"``)."""
        out = {}
        for fqn, spec in self.params.items():
            s = spec if detailed else tuple(x.split("x")[0] for x in spec)
            for alias in self.param_aliases.get(fqn, [fqn]):
                out[alias] = s
        return out

    def zero_stages(self) -> dict[str, int]:
        """Parameters stored sharded and gathered for use, with their ZeRO stage (1, 2 or 3)."""
        gathered = {
            r.producer for r in self.reshards if any(c.startswith("all_gather") for c in r.collectives)
        }
        return {
            n.fqn: n.zero_stage
            for n in self.nodes
            if n.kind == "param" and n.name in gathered and any(p.startswith("S") for p in n.outputs[0])
        }

    def fusion_counts(self) -> dict[str, int]:
        """Fused kernels the plan assumed, per kind in ``FusionKind`` order (``{"add_rms_norm": 5,
        "swiglu": 2, …}``)."""
        from autopar.ir import FusionKind

        kinds = [f.kind for f in self.fusions]
        return {str(k): kinds.count(str(k)) for k in FusionKind if str(k) in kinds}

    def distinct_reshards(self, stage: Callable[[str], int] | None = None) -> list[ReshardPlan]:
        """The reshards the rank program runs (``reshards`` has one per producer-consumer edge): a
        value laid out one way for several readers is laid out once — one collective and its
        backward — at its first reader, per pipeline stage (``stage``: a consumer's;
        ``passes.lower`` memoizes by producer, layout and stage). LLaMA's q, k and v projections
        read one all-gathered norm output under sequence parallelism: without this, the step
        was charged three all-gathers for the one the program runs. Kept apart: a weight's
        edges, and edges with no collective (a gradient synchronization only, Megatron-LM's
        ``f``), whose synchronization each edge already pays a share of (``grad_sync_share``)."""
        kinds = {n.name: n.kind for n in self.nodes}
        seen: set[tuple] = set()
        out = []
        for r in self.reshards:
            if r.collectives and kinds.get(r.producer) != "param":
                key = (r.producer, r.dst, r.collectives, r.grad_sync_axes, stage(r.consumer) if stage else 0)
                if key in seen:
                    continue
                seen.add(key)
            out.append(r)
        return out

    def node(self, name: str) -> NodePlan:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(f"no node {name!r} in the plan")

    def param_spec(self, fqn: str) -> Spec:
        return parse_spec(self.params[fqn])

    def sharded_fraction(self, min_dims: int = 2) -> float:
        """Fraction of weight-matrix elements (params with ``min_dims``+ dims) that are sharded."""
        total = sharded = 0
        for n in self.nodes:
            if n.kind == "param" and len(n.shape) >= min_dims:
                numel = math.prod(n.shape)
                total += numel
                if any(p.startswith("S") for p in n.outputs[0]):
                    sharded += numel
        return sharded / total if total else 0.0

    # ------------------------------------------------------------------ persistence
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT_VERSION,
            "mesh_shape": list(self.mesh_shape),
            "mesh_axes": list(self.mesh_axes),
            "nodes": [asdict(n) for n in self.nodes],
            "params": {k: list(v) for k, v in self.params.items()},
            "param_aliases": self.param_aliases,
            "inputs": {k: list(v) for k, v in self.inputs.items()},
            "reshards": [asdict(r) for r in self.reshards],
            "predicted": asdict(self.predicted),
            "cluster": self.cluster,
            "fingerprint": self.fingerprint,
            "info": self.info,
            **({"pipeline": self.pipeline.to_dict()} if self.pipeline is not None else {}),
            "recompute": self.recompute,
            **(
                {"recompute_layers": list(self.recompute_layers)} if self.recompute_layers is not None else {}
            ),
            "fusions": [asdict(f) for f in self.fusions],
            "compile": self.compile,
            **({"offload_optimizer": True} if self.offload_optimizer else {}),
            **({"offload_layers": list(self.offload_layers)} if self.offload_layers else {}),
            **({"compression": self.compression.to_dict()} if self.compression is not None else {}),
            **({"two_level": [list(a) for a in self.two_level]} if self.two_level else {}),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Plan:
        """A plan from its JSON form; every field is checked (type, range, that every spec has
        one valid placement per mesh axis) and an error names the field."""
        if d.get("format") != FORMAT_VERSION:
            raise ValueError(
                f"plan format {d.get('format')} is not supported (this autopar reads format {FORMAT_VERSION}): "
                f"plan the model again with this version"
            )

        validate(d)

        def tup(x: Any) -> Any:
            if isinstance(x, list):
                return tuple(tup(v) for v in x)
            return x

        nodes = [
            NodePlan(**{k: (tup(v) if isinstance(v, list) else v) for k, v in n.items()}) for n in d["nodes"]
        ]
        reshards = [
            ReshardPlan(**{k: (tup(v) if isinstance(v, list) else v) for k, v in r.items()})
            for r in d["reshards"]
        ]
        pred = d["predicted"]
        pred = Predicted(**{k: (tup(v) if isinstance(v, list) else v) for k, v in pred.items()})
        return cls(
            mesh_shape=tuple(d["mesh_shape"]),
            mesh_axes=tuple(d["mesh_axes"]),
            nodes=nodes,
            params={k: tuple(v) for k, v in d["params"].items()},
            param_aliases={k: list(v) for k, v in d["param_aliases"].items()},
            inputs={k: tuple(v) for k, v in d["inputs"].items()},
            reshards=reshards,
            predicted=pred,
            cluster=d["cluster"],
            fingerprint=d["fingerprint"],
            info=d.get("info", {}),
            pipeline=PipelinePlan.from_dict(d["pipeline"]) if d.get("pipeline") else None,
            recompute=str(d.get("recompute", "none")),
            recompute_layers=tuple(d["recompute_layers"]) if d.get("recompute_layers") is not None else None,
            fusions=[
                FusionPlan(kind=f["kind"], members=tuple(f["members"]), anchor=f["anchor"])
                for f in d.get("fusions", [])
            ],
            compile=bool(d.get("compile", False)),
            offload_optimizer=bool(d.get("offload_optimizer", False)),
            offload_layers=tuple(d.get("offload_layers", ())),
            compression=GradCompression.from_dict(d["compression"]) if d.get("compression") else None,
            two_level=tuple(tuple(a) for a in d.get("two_level", ())),
        )

    def save(self, path: str | Path) -> None:
        """Write the plan as JSON with a checksum of its contents (``load`` refuses an edited file)."""
        d = self.to_dict()
        d["checksum"] = checksum(d)
        Path(path).write_text(json.dumps(d, indent=1))

    @classmethod
    def load(cls, path: str | Path, *, verify: bool = True) -> Plan:
        """Read a plan file. Every failure names the file and says what to do: missing, not JSON,
        truncated, written by another format version, or edited by hand (its checksum no longer
        matches; ``verify=False`` loads a deliberately edited plan)."""
        path = Path(path)
        redo = f"plan again (autopar plan ... -o {path.name})"
        try:
            text = path.read_text()
        except FileNotFoundError:
            raise FileNotFoundError(f"{path}: no such plan file") from None
        except UnicodeDecodeError:
            raise ValueError(f"{path}: not a plan file (binary data, not JSON text)") from None
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(
                f"{path}: not a complete plan file (JSON error at line {e.lineno}, column {e.colno}: {e.msg}); "
                f"it was truncated or damaged: {redo}"
            ) from None
        if not isinstance(d, dict):
            raise ValueError(f"{path}: not a plan file (a JSON {type(d).__name__}, not an object)")
        stored = d.pop("checksum", None)
        if verify and stored is not None and stored != checksum(d):
            raise ValueError(
                f"{path}: edited after autopar wrote it (its checksum no longer matches its contents): {redo}, "
                f"or load the edited plan deliberately with Plan.load(path, verify=False) (autopar: --no-verify)"
            )
        try:
            return cls.from_dict(d)
        except KeyError as e:
            raise ValueError(f"{path}: not a plan file (no field {e.args[0]!r}): {redo}") from None
        except TypeError as e:
            raise ValueError(f"{path}: a field has the wrong form ({e}): {redo}") from None
        except ValueError as e:
            raise ValueError(f"{path}: {e}: {redo}") from None

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Plan) and self.to_dict() == other.to_dict()

    # ------------------------------------------------------------------ display (autopar.display)
    def summary(self) -> str:
        """Totals: mesh, predicted step time, memory against the budget, communication per axis."""
        return display.plan_summary(self)

    def table(self, max_rows: int | None = None, full: bool = False) -> str:
        """Rows in execution order: repeated identical layers folded (``blocks.0–31 ×32``), or every
        module with its ops' placements and collectives (``full=True``)."""
        return display.plan_table(self, max_rows=max_rows, full=full)

    def __str__(self) -> str:
        return display.plan_text(self)

    def __repr__(self) -> str:
        p = self.predicted
        return (
            f"<autopar.Plan mesh={self.mesh_shape} step={display.fmt_time(p.step_time)} "
            f"mem={display.fmt_bytes(p.memory_per_device)}>"
        )

"""``PlanConfig``: every planning option in one validated record.

``autopar.plan``, ``autopar.layouts`` and ``autopar.parallelize`` take one ``PlanConfig`` (or its
fields as keyword arguments, which build one) and pass it whole down to the passes and the solver,
so an option set once is honored everywhere. Fields are validated when the record is built, and
an error says what was wrong with the arithmetic that shows it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

from autopar.cost.memory import OPTIMIZER_BYTES_PER_PARAM
from autopar.grad_compression import METHODS, GradCompression
from autopar.placement import parse_spec

__all__ = ["PlanConfig", "stage_plan_budget"]


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanConfig:
    """Planning options (see module docstring)."""

    memory_budget: float | None = None
    """Bytes per device the plan may use; ``None``: the device's memory less ``memory_reserve``
    (:meth:`budget`)."""
    memory_reserve: float = 0.1
    """Fraction of the device's memory the default budget leaves free for what the plan does not
    count: the CUDA context (about 0.5 GiB), NCCL's buffers, the caching allocator's fragmentation.
    Ignored when ``memory_budget`` is given."""
    mesh_shape: tuple[int, ...] | None = None
    """Fix the device mesh, e.g. ``(2, 8)``; ``None``: try every candidate mesh. With pipeline
    parallelism it is the mesh inside a stage (``world / pp`` devices), so only pipelines of that
    size are planned."""
    meshes: tuple[tuple[int, ...], ...] | None = None
    """Solve only these of the candidate meshes (``mesh_shape`` unset); ``None``: every one. A
    second look of the search names the meshes it can change (``planner.per_activation``)."""
    fixed: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """``{name: spec}``: placements honored exactly, one per mesh axis, for parameters (their
    ``named_parameters`` names) or user inputs (``"input_ids"``, ``"args[0]"``), e.g.
    ``{"lm_head.weight": ("S(0)",)}``."""
    optimizer: str = "adamw"
    """Optimizer whose state is counted per parameter (``autopar.cost.memory``)."""
    state_split: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    """``{parameter name: mesh axes}``: the parameter's optimizer state (moments and fp32 master
    weight) is split evenly over those of these axes its placement leaves whole, as one flat
    buffer whatever the tensor's shape: Megatron-LM's distributed optimizer shards a contiguous
    buffer of every weight's state over the data-parallel ranks, padded to a multiple of them
    (``docs/source/api-guide/dist_optimizer.md``), so no dimension need divide.
    ``layouts.megatron(distributed_optimizer=True)`` sets it for weights whose dimensions do not
    divide those axes. Counted by the memory model and the optimizer step; autopar's runtime
    keeps such a weight's state whole."""
    pp: int | str = "auto"
    """Pipeline ranks (``autopar.schedule``; the search is ``autopar.search``): ``k`` plans ``k``
    stages (1: one stage over all devices); ``"auto"`` plans one stage and, where the cluster spans
    several nodes or one stage does not fit, pipelines of whole nodes (``pp`` dividing the node
    count) with ``2·pp`` micro-batches; ``"search"`` tries every pipeline size dividing the devices
    with ``pp``, ``2·pp`` and ``4·pp`` micro-batches (planning time grows with each candidate)."""
    recompute: str = "auto"
    """Activation recomputation in every repeated layer (``Plan.recompute``): ``"none"``,
    ``"selective"``, ``"full"``, or ``"ops"`` — per activation: the solver chooses, beside each
    node's sharding, which of a layer's saved activations to keep and which to compute again in
    backward, the fewest seconds that fit the memory (``passes.recompute_ops``); ``"auto"`` (the
    default): the lightest of none, selective and full that fits a candidate (``none`` wherever a
    plan fits without), the 3D search keeping the fastest candidate, planned once more with
    ``"ops"`` where memory shaped it and kept where that plays faster (``planner.per_activation``,
    ``refine.per_activation``). Under ``"none"`` a layout that fits only with recomputation is not
    a candidate: Table 1's row 7 (GPT 145.6B on 1536 A100) then plans 24 stages, 1.64× slower than ``"auto"``'s
    one stage recomputing selectively."""
    recompute_layers: int | tuple[int, ...] | None = None
    """The repeated layers the recomputation applies to, counted in the order the forward runs
    them (``passes.strategies.repeated_layers``); the others keep their activations. An int ``k``:
    the model's first ``k`` (under a pipeline they sit on the first stages, which hold the most
    micro-batches in flight under 1F1B); a tuple: those ordinals (Megatron-LM's
    ``--recompute-method block --recompute-num-layers N`` recomputes the first ``N`` of every
    stage: ``layouts.megatron(recompute_num_layers=N)``). ``None``: every repeated layer, and under
    ``recompute="auto"`` a count is searched (``autopar.planner``: fewer layers)."""
    activations_in_flight: int = 1
    """Micro-batches whose saved activations one device holds at once, as the memory constraint
    counts them (activations and inputs × this, training state × 1). The 3D search plans a
    pipeline stage on the graph of one micro-batch with the budget ``pp ×`` the device's (a rank
    holds ``1/pp`` of the model) and this set to ``pp``: under 1F1B the first rank holds ``pp``
    micro-batches of its ``1/pp`` of the layers."""
    microbatches_per_sync: int = 1
    """Micro-batches whose summed gradients one data-parallel reduction serves, as the objective
    counts it: a parameter's gradient all-reduce (read where it is stored, not gathered: plain
    data parallelism) happens once per step, so the graph of one of ``m`` micro-batches is charged
    ``1/m`` of it, as the simulator charges it (``autopar.simulate.stage_costs``). Gathered
    (ZeRO) parameters reduce-scatter every micro-batch and are charged in full. The 3D search sets
    it to the candidate's micro-batch count."""
    microbatches: int | None = None
    """Micro-batches per step: of a pipelined plan, or with ``pp=1`` gradient accumulation (the
    micro-batches one after another, gradients reduced once); ``None``: searched (multiples of
    ``pp``; with one stage, accumulation is tried when the whole batch does not fit or fits
    only with the recomputation ``recompute="auto"`` chose, and always under ``pp="search"``)."""
    schedule: str | None = None
    """Pipeline schedule (``autopar.schedule.SCHEDULES``); ``None``: searched."""
    virtual: int | None = None
    """Stages per pipeline rank (the interleaved schedule's ``v``); ``None``: searched (1 or 2)."""
    stage_of: Mapping[str, int] = field(default_factory=dict)
    """Hold this pipeline cut: captured node name → stage, a pipelined plan's
    ``PipelinePlan.stage_of`` (the same model, inputs, ``pp``, ``virtual`` and micro-batch count),
    e.g. to play a plan's layout on another cluster; empty: the planner cuts."""
    mixed_precision: bool | None = None
    """Count an fp32 master weight per parameter (ZeRO's 16 bytes per parameter); ``None``:
    detected from the parameters' dtype (bf16/fp16 parameters mean mixed precision)."""
    optimizer_state_dtype: str | None = None
    """dtype of the optimizer's moments: ``"bfloat16"`` gives the published 12 / 5 / 3.25 / 1.5
    bytes per parameter for DDP / ZeRO-1 / 2 / 3 at N = 8 (fp32 master kept); ``None``: float32
    under mixed precision, else the parameters' dtype (``torch.optim``'s ``zeros_like(param)``)."""
    zero_stage: int | tuple[int, ...] | None = None
    """ZeRO stage of parameters stored sharded (1, 2 or 3), or the stages the solver picks from
    per parameter (a tuple, e.g. ``(1, 2, 3)``); ``None``: 2 or 3 (``autopar.passes.zero_stages``;
    the 3D search also tries 1 on accumulated candidates near its fastest, ``autopar.refine``)."""
    time_limit: float = 60.0
    """Seconds CP-SAT may search one mesh before returning its best plan."""
    work_limit: float | None = None
    """CP-SAT's deterministic work limit per mesh (``SolverConfig.work_limit``: the same on every
    machine); ``None``: ``time_limit`` only. The per-activation second looks cap it at
    ``autopar.second_look.PER_ACTIVATION_WORK``."""
    relative_gap: float = 0.005
    """Each mesh's plan is proven within this fraction of its optimum, and a mesh must beat the
    best one solved before or beside it by more than this (``autopar.solver``'s ``SolverConfig``
    and constraint (g)); 0 proves every optimum. The 3D search screens pipelined candidates at a
    coarser gap first (``autopar.search.SCREEN_GAP``)."""
    screen_gap: float | None = None
    """Where set (the 3D search's screening), CP-SAT stops at this coarser gap while a mesh must
    still beat its rivals by ``relative_gap`` (``SolverConfig.cutoff_gap``)."""
    workers: int | None = None
    """Candidate meshes solved side by side in forked processes (default: up to 2); 1: one after
    another in this process."""
    max_strategies: int = 64
    """Cap on strategies per node (the cheapest kept; replicated always kept)."""
    disable: tuple[str, ...] = ()
    """Names of passes to skip (planning passes and rank-program passes alike), and of the 3D
    search's second looks (``"per_activation"``: ``autopar.refine``)."""
    interpret_kernels: bool = False
    """Fuse a CPU rank's program too, its Triton kernels run by Triton's interpreter (slow: for
    tests; ``TRITON_INTERPRET=1`` must be set before triton is imported). Off: on the CPU the
    eager ops stay; on a GPU the kernels always run (``autopar.passes.fusion``)."""
    kernels: tuple[str, ...] | None = None
    """Fused kernel kinds (``autopar.ir.FusionKind`` values) a GPU program uses and the planner
    costs; ``None``: the kinds measured faster than the eager ops they replace
    (``autopar.cost.kernel_speedups``: all but ``add_layer_norm``)."""
    compile: bool = False
    """The step will run compiled by Inductor (``parallelize(..., compile=True)``): the cost model
    charges each chain of memory-bound ops as one generated kernel (``autopar.passes.chains``,
    ``autopar.cost.compiled``), and the plan records it (``Plan.compile``), so ``parallelize``
    compiles when given the plan."""
    allow_compression: bool = False
    """Let the plan compress the data-parallel gradient all-reduces, a lossy change to training
    (``autopar.cost.compression``): the 3D search's fastest candidates are planned again with each
    method (``autopar.refine.compressed``) and one is kept where it plays at least 5 % faster
    (``refine.COMPRESSION_GAIN``). Off: gradients are reduced exactly."""
    replicas_first: bool = False
    """Keep the first mesh axis to independent data-parallel replicas: nothing crosses it inside a
    micro-batch (inputs split by rows over it, weights replicated over it, no reshard or in-op
    collective over it), so its ranks may run unequal shares of the micro-batches
    (``autopar.dp_shares``). The 3D search sets it on a mixed cluster, for a second plan of each
    accumulated candidate whose first plan ties the replicas together."""
    compression: str | None = None
    """Compress every data-parallel gradient all-reduce with this method (``"bf16"``, ``"fp8"``,
    ``"topk"`` or ``"powersgd"``, ``autopar.cost.compression.METHODS``) in every candidate: the solver prices
    it, the plan records it (``Plan.compression``) and the runtime runs it. ``None``: exact, unless
    ``allow_compression`` lets the search choose."""
    compression_rank: int = 4
    """PowerSGD's approximation rank (``GradCompression.rank``)."""
    compression_warmup: int = 0
    """Steps reduced exactly before PowerSGD starts (``GradCompression.warmup_steps``)."""
    compression_density: float = 0.01
    """Top-k's share of each gradient sent a step (``GradCompression.density``)."""
    offload_optimizer: bool | None = None
    """Keep the optimizer state and master weights in host memory and run the optimizer step on the
    host (ZeRO-Offload; ``autopar.cost.offload``): the device holds only weights and gradients, and
    each step copies the gradients out and the weights back over the host link. ``None``: the 3D
    search plans it where nothing fits without it (``autopar.search``); ``True``: every candidate;
    ``False``: never. Needs a cluster whose ``host`` is described (the presets' are)."""
    offload_activations: int | None = None
    """Copy the saved activations of the first this many repeated layers to host memory as the
    forward makes them and fetch them back, a layer ahead, for their backward (Megatron-Core's
    ``--cpu-offloading-num-layers``; ``autopar.cost.offload``): the device holds a window of two
    such layers instead of all, each micro-batch's copies run on the host link beside the compute.
    ``None``: the 3D search tries it where its fastest plan recomputes (``autopar.refine``); 0: never."""
    float32_matmul_precision: str | None = None
    """What float32 matmuls run at, as ``torch.set_float32_matmul_precision`` names it:
    ``"highest"`` (PyTorch's default: the device's plain FP32 rate), ``"high"`` or ``"medium"``
    (TF32 tensor cores where the device has them); ``None``: this process's
    ``torch.get_float32_matmul_precision()`` when planning (set it before planning as before
    training). bf16 and fp16 models are unaffected."""

    @property
    def grad_compression(self) -> GradCompression | None:
        """``compression`` as the record the cost model and the plan take."""
        if self.compression is None:
            return None
        return GradCompression(
            method=self.compression,
            rank=self.compression_rank,
            warmup_steps=self.compression_warmup,
            density=self.compression_density,
        )

    @property
    def matmul_tf32(self) -> bool:
        """float32 matmuls run on TF32 tensor cores (``float32_matmul_precision``)."""
        import torch

        return (self.float32_matmul_precision or torch.get_float32_matmul_precision()) != "highest"

    def __post_init__(self) -> None:
        def fail(msg: str) -> None:
            raise ValueError(f"PlanConfig: {msg}")

        if self.memory_budget is not None:
            b = self.memory_budget
            if isinstance(b, bool) or not isinstance(b, (int, float)) or not math.isfinite(b) or b <= 0:
                fail(f"memory_budget must be positive (bytes per device), got {b!r}")
        r = self.memory_reserve
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 <= r < 1:
            fail(f"memory_reserve is a fraction of the device's memory in [0, 1), got {r!r}")
        if self.mesh_shape is not None:
            shape = tuple(self.mesh_shape)
            if not shape or not all(_whole(n, 1) for n in shape):
                fail(f"mesh_shape must be a tuple of positive integers, got {self.mesh_shape!r}")
            object.__setattr__(self, "mesh_shape", shape)
        if self.meshes is not None:
            shapes = tuple(tuple(m) for m in self.meshes)
            if not shapes or any(not m or not all(_whole(n, 1) for n in m) for m in shapes):
                fail(
                    f"meshes must be a non-empty tuple of meshes (tuples of positive integers), got {self.meshes!r}"
                )
            object.__setattr__(self, "meshes", shapes)
        if self.optimizer not in OPTIMIZER_BYTES_PER_PARAM:
            fail(f"unknown optimizer {self.optimizer!r}; known: {sorted(OPTIMIZER_BYTES_PER_PARAM)}")
        if self.optimizer_state_dtype not in (None, "float32", "bfloat16", "float16"):
            fail(
                f"optimizer_state_dtype must be 'float32', 'bfloat16', 'float16' or None, "
                f"got {self.optimizer_state_dtype!r}"
            )
        if isinstance(self.zero_stage, (tuple, list)):
            stages = tuple(sorted(set(self.zero_stage)))
            if not stages or any(z not in (1, 2, 3) or isinstance(z, bool) for z in stages):
                fail(f"zero_stage must list stages among 1, 2 and 3, got {self.zero_stage!r}")
            object.__setattr__(self, "zero_stage", stages[0] if len(stages) == 1 else stages)
        elif self.zero_stage not in (None, 1, 2, 3) or isinstance(self.zero_stage, bool):
            fail(
                f"zero_stage must be 1, 2, 3, a tuple of them (the solver picks among) or None "
                f"(it picks 2 or 3), got {self.zero_stage!r}"
            )
        if not (
            isinstance(self.time_limit, (int, float))
            and math.isfinite(self.time_limit)
            and self.time_limit > 0
        ):
            fail(f"time_limit must be a positive number of seconds, got {self.time_limit!r}")
        if self.work_limit is not None and not (
            isinstance(self.work_limit, (int, float))
            and not isinstance(self.work_limit, bool)
            and math.isfinite(self.work_limit)
            and self.work_limit > 0
        ):
            fail(
                f"work_limit must be a positive number of CP-SAT's work units or None, got {self.work_limit!r}"
            )
        if not (
            isinstance(self.relative_gap, (int, float))
            and not isinstance(self.relative_gap, bool)
            and 0 <= self.relative_gap < 1
        ):
            fail(
                f"relative_gap must be a fraction in [0, 1) (0.005: plans within 0.5 % of their optimum), "
                f"got {self.relative_gap!r}"
            )
        if self.screen_gap is not None and not (
            isinstance(self.screen_gap, (int, float))
            and not isinstance(self.screen_gap, bool)
            and self.relative_gap <= self.screen_gap < 1
        ):
            fail(
                f"screen_gap must lie in [relative_gap, 1) = [{self.relative_gap}, 1), got {self.screen_gap!r}"
            )
        if self.pp not in ("auto", "search") and not _whole(self.pp, 1):
            fail(f"pp must be a positive integer, 'auto' or 'search', got {self.pp!r}")
        if self.recompute not in ("none", "selective", "full", "ops", "auto"):
            fail(f"recompute must be 'none', 'selective', 'full', 'ops' or 'auto', got {self.recompute!r}")
        layers = self.recompute_layers
        if layers is not None:
            ordinals = layers if isinstance(layers, tuple) else (layers,)
            if not ordinals or not all(_whole(k, 0) for k in ordinals):
                fail(
                    f"recompute_layers must be a positive number of layers or a tuple of layer ordinals "
                    f"(0 is the first repeated layer), got {layers!r}"
                )
            if isinstance(layers, int) and layers < 1:
                fail(
                    f"recompute_layers must be at least 1 layer (recompute='none' keeps every one), got {layers}"
                )
            if self.recompute == "none":
                fail(
                    f"recompute_layers={layers!r} names layers to recompute, but recompute='none': give "
                    f"recompute='selective', 'full', 'ops' or 'auto'"
                )
        for what in ("activations_in_flight", "microbatches_per_sync"):
            f = getattr(self, what)
            if not _whole(f, 1):
                fail(f"{what} must be a positive number of micro-batches, got {f!r}")
        for what in ("microbatches", "virtual"):
            v = getattr(self, what)
            if v is not None and not _whole(v, 1):
                fail(f"{what} must be a positive integer or None (searched), got {v!r}")
        if self.schedule is not None:
            from autopar.schedule import SCHEDULES

            if self.schedule not in SCHEDULES:
                fail(f"unknown pipeline schedule {self.schedule!r}; known: {', '.join(SCHEDULES)}")
            if self.virtual is not None and self.virtual > 1 and self.schedule != "interleaved":
                fail(
                    f"virtual={self.virtual} stages per rank needs schedule='interleaved', not {self.schedule!r}"
                )
        if isinstance(self.pp, int) and self.microbatches is not None and self.microbatches < self.pp:
            fail(
                f"microbatches={self.microbatches} < pp={self.pp}: every pipeline rank would idle at least "
                f"{self.pp - self.microbatches} of every {self.pp} slots; use microbatches >= pp"
            )
        if self.workers is not None and (not isinstance(self.workers, int) or self.workers < 1):
            fail(f"workers must be a positive integer or None, got {self.workers!r}")
        if not isinstance(self.compile, bool):
            fail(f"compile is True or False, got {self.compile!r}")
        if self.max_strategies < 2:
            fail(f"max_strategies must be at least 2, got {self.max_strategies}")
        if self.float32_matmul_precision not in (None, "highest", "high", "medium"):
            fail(
                f"float32_matmul_precision is one of 'highest', 'high', 'medium' (torch's names) or None, "
                f"got {self.float32_matmul_precision!r}"
            )
        a = self.offload_activations
        if a is not None and not _whole(a, 0):
            fail(
                f"offload_activations is a number of repeated layers (≥ 0) or None (the search decides), got {a!r}"
            )
        if self.offload_optimizer not in (None, True, False):
            fail(
                f"offload_optimizer is True, False or None (the search decides), got {self.offload_optimizer!r}"
            )
        if not isinstance(self.allow_compression, bool):
            fail(f"allow_compression is True or False, got {self.allow_compression!r}")
        if not isinstance(self.replicas_first, bool):
            fail(f"replicas_first is True or False, got {self.replicas_first!r}")
        if self.compression is not None and self.compression not in METHODS:
            fail(
                f"compression must be one of {', '.join(repr(m) for m in METHODS)} or None (exact "
                f"reduction), got {self.compression!r}"
            )
        r = self.compression_rank
        if not _whole(r, 1):
            fail(
                f"compression_rank must be a whole number ≥ 1 (PowerSGD sends (m + n) · rank values for "
                f"an m × n gradient), got {r!r}"
            )
        w = self.compression_warmup
        if not _whole(w, 0):
            fail(f"compression_warmup must be a whole number of steps ≥ 0, got {w!r}")
        d = self.compression_density
        if isinstance(d, bool) or not isinstance(d, (int, float)) or not 0 < d <= 1:
            fail(
                f"compression_density must be in (0, 1] (top-k sends ceil(density · n) of a gradient's n "
                f"elements), got {d!r}"
            )
        fixed = {}
        for name, spec in dict(self.fixed or {}).items():
            texts = (spec,) if isinstance(spec, str) else tuple(spec)
            try:
                parse_spec(texts)
            except ValueError as e:
                fail(f"fixed[{name!r}]: {e}")
            fixed[name] = texts
        object.__setattr__(self, "fixed", fixed)
        split = {}
        for name, axes in dict(self.state_split or {}).items():
            if not all(isinstance(a, int) and a >= 0 for a in axes):
                fail(f"state_split[{name!r}] must be mesh axis indices (integers >= 0), got {axes!r}")
            split[name] = tuple(axes)
        object.__setattr__(self, "state_split", split)
        cut = dict(self.stage_of or {})
        if not all(_whole(k, 0) for k in cut.values()):
            fail("stage_of maps captured node names to stage numbers ≥ 0 (a plan's PipelinePlan.stage_of)")
        object.__setattr__(self, "stage_of", cut)
        if cut and (not isinstance(self.pp, int) or self.microbatches is None):
            fail(
                f"stage_of holds one pipeline's cut: give the pp and microbatches it was made for too "
                f"(got pp={self.pp!r}, microbatches={self.microbatches!r})"
            )
        object.__setattr__(self, "disable", tuple(self.disable))
        if self.kernels is not None:
            from autopar.ir import FusionKind

            known = {k.value for k in FusionKind}
            unknown = sorted(set(self.kernels) - known)
            if unknown:
                fail(f"kernels names unknown fused kernel kinds {unknown}; the kinds are {sorted(known)}")
            object.__setattr__(self, "kernels", tuple(self.kernels))

    def budget(self, device_memory: float) -> float:
        """Bytes per device the plan may use: ``memory_budget``, else the device's memory less
        the reserve (``device_memory × (1 − memory_reserve)``). The one place the default is made."""
        if self.memory_budget is not None:
            return float(self.memory_budget)
        return float(device_memory) * (1.0 - self.memory_reserve)

    def resolved(self, device_memory: float) -> PlanConfig:
        """This config with ``memory_budget`` in bytes per device (``budget``). The planning entry
        points (``autopar.plan_search.plan_model``, ``autopar.planner.plan_captured``, the layouts)
        resolve it once; every later stage reads ``memory_budget``. Idempotent."""
        if self.memory_budget is not None:
            return self
        return self.replace(memory_budget=self.budget(device_memory))

    @property
    def device_budget(self) -> float:
        """``memory_budget`` of a resolved config (``resolved``), bytes per device: what every
        stage after a planning entry reads. A config that was never resolved is refused: its
        budget would depend on which device read it."""
        if self.memory_budget is None:
            raise ValueError(
                "this PlanConfig's memory budget was never resolved: a planning entry calls "
                "config.resolved(cluster.device.memory) once, before any later stage reads it"
            )
        return float(self.memory_budget)

    def replace(self, **changes: Any) -> PlanConfig:
        """A copy with ``changes`` applied (validated again)."""
        return replace(self, **changes)

    @classmethod
    def build(cls, config: PlanConfig | None = None, **options: Any) -> PlanConfig:
        """``config`` with keyword ``options`` applied (``None`` options are left as they are), so
        ``plan(..., memory_budget=x)`` and ``plan(..., config=PlanConfig(memory_budget=x))`` agree."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(f"unknown planning option(s) {unknown}; PlanConfig has {sorted(known)}")
        changes = {k: v for k, v in options.items() if v is not None}
        base = config if config is not None else cls()
        return base.replace(**changes) if changes else base

    def with_fixed(self, fixed: Mapping[str, Sequence[str] | str]) -> PlanConfig:
        merged = dict(self.fixed)
        merged.update({k: ((v,) if isinstance(v, str) else tuple(v)) for k, v in fixed.items()})
        return self.replace(fixed=merged)


def _whole(v: object, least: int) -> bool:
    """Whether ``v`` is a whole number (an ``int``, not a ``bool``) of at least ``least``."""
    return isinstance(v, int) and not isinstance(v, bool) and v >= least


def stage_plan_budget(device_budget: float, pp: int) -> float:
    """The memory budget a pipeline stage's plan is formulated under (bytes): that plan places the
    whole model on one stage's mesh, of which each of the ``pp`` stages holds a ``1/pp`` share, so
    it is held to ``pp ×`` one device's budget; the stages the pipeline is then cut into are held
    to ``device_budget`` itself (``autopar.pipelined.pipelined_candidates``)."""
    return device_budget * pp

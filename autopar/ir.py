"""Typed records that passes write into ``node.meta`` (never loose dict keys).

The IR goes through these states, each printable (``autopar.explain`` prints the first three as
tables, annotating a fresh capture as needed; ``print(plan)`` summarises the third;
``ParallelModule.code`` prints the fourth):

1. **captured** — an ATen-level ``torch.fx`` graph from ``torch.export`` (``autopar.capture``);
   every node carries a FakeTensor ``val``.
2. **annotated** — ``node.meta["autopar.tensor"]`` (:class:`TensorInfo`: shape, dtype, module,
   whether a gradient flows), ``node.meta["autopar.cost"]`` (:class:`NodeCost`: FLOPs, bytes,
   roofline time on one device) and ``node.meta["autopar.strategies"]`` (:class:`NodeStrategies`:
   the N-D strategies the solver may pick from, each with its per-device cost).
3. **planned** — a :class:`autopar.plan.Plan`: one strategy per node, the reshards between them.
4. **lowered** — per-rank graph with local shapes and collectives as nodes (``passes.lower``).
5. **stepped** — the whole training step as one per-rank graph (``passes.joint``): every node's
   :class:`Phase` in ``node.meta[PHASE]``, what the rank-program passes read besides the graph
   (:class:`RankInfo`) in ``gm.meta[RANK]``; partitioned into the ``StepProgram`` the runtime runs
   (``autopar.program.records``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from autopar.placement import Spec

__all__ = [
    "COMPRESS_CAST",
    "COST",
    "GRAD_MEMBERS",
    "PHASE",
    "RANK",
    "STRATEGIES",
    "TENSOR",
    "TWO_LEVEL",
    "FusionKind",
    "NodeCost",
    "NodeStrategies",
    "Phase",
    "PrimalInfo",
    "RankInfo",
    "Rewrite",
    "Strategy",
    "TensorInfo",
]

TENSOR = "autopar.tensor"
COST = "autopar.cost"
STRATEGIES = "autopar.strategies"


class Rewrite(str, enum.Enum):
    """How the local op differs from the global one along a mesh axis (the lowering maps each
    member to its local op in one table, ``autopar.passes.lower.LOCAL_OPS``)."""

    NONE = ""
    MEAN_PARTIAL = "mean_partial"
    """A mean over a sharded dimension: the local mean divided by the shard count (``Partial``)."""
    VOCAB_PARALLEL_EMBEDDING = "vocab_parallel_embedding"
    """Embedding with the table split by rows: ids outside the shard give zeros (``Partial``)."""
    LOSS_ROWS = "loss_rows"
    """Cross-entropy over this device's rows, divided by the global count of counted rows."""
    LOSS_CLASSES = "loss_classes"
    """Vocabulary-parallel cross-entropy: max, sum of exp and target logit all-reduced."""
    SPLIT_LOCAL = "split_local"
    """An equal split of a block-sharded dimension: each part comes out plainly sharded."""
    EXPERT_DISPATCH = "expert_dispatch"
    """A grouped matmul over this device's experts whose rows arrive on the token side: dispatch
    them to their experts' devices first (all-to-all, counts exchanged first)."""
    EXPERT_LOCAL = "expert_local"
    """A grouped matmul over this device's experts on rows already dispatched."""
    EXPERT_COMBINE = "expert_combine"
    """A grouped matmul over this device's experts on dispatched rows, combined back to the
    devices of their tokens after (all-to-all)."""
    EXPERT_DISPATCH_COMBINE = "expert_dispatch_combine"
    """Dispatch, the grouped matmul over this device's experts, and combine."""
    CAUSAL_QUERIES = "causal_queries"
    """Causal attention over this device's share of the queries, keys and values whole (context
    parallelism's all-gather form): the mask is aligned to the queries' global positions, and
    keys after the last of them are not read."""
    RING_ATTENTION = "ring_attention"
    """Attention over a sequence split along the axis, queries, keys and values alike, the keys and
    values passed around the axis's ring while each device attends to them (context
    parallelism's point-to-point form: ``autopar.program.ring_attention``)."""
    SYNC_BATCH_NORM = "sync_batch_norm"
    """Training batch norm over a batch (or spatial extent) split along the axis: each device's
    per-channel count, mean and squared deviations are gathered and merged, so every device
    normalizes with the statistics of the whole batch and updates the running statistics alike
    (``torch.nn.SyncBatchNorm``'s statistics; ``autopar.program.local_ops.sync_batch_norm``)."""

    def __str__(self) -> str:
        return self.value


class FusionKind(str, enum.Enum):
    """A fused kernel family (``autopar.program.kernels``): the kind of a group of nodes one fused
    kernel replaces (``autopar.passes.fusion``), costed by ``autopar.cost.fused_traffic``."""

    ADD_LAYER_NORM = "add_layer_norm"
    ADD_RMS_NORM = "add_rms_norm"
    BIAS_GELU = "bias_gelu"
    SWIGLU = "swiglu"
    ROTARY = "rotary"
    CROSS_ENTROPY = "cross_entropy"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """Shape and provenance of a node's (first) tensor output."""

    shape: tuple[int, ...]
    dtype: str
    module: str
    """FQN of the innermost ``nn.Module`` the op was called in ("" at top level)."""
    layer: str
    """``module`` with layer indices replaced by ``*`` (``transformer.h.*.attn``): repeated
    layers share it."""
    requires_grad: bool
    """A gradient flows into this value in training (it depends on a parameter)."""
    kind: str
    """``"param"``, ``"buffer"``, ``"input"``, ``"op"`` or ``"output"``."""
    fqn: str = ""
    """For parameters, buffers and inputs: the model's name for it."""


@dataclass(frozen=True, slots=True)
class NodeCost:
    """Cost of a node on one device with no sharding (global shapes)."""

    fwd_flops: float
    bwd_flops: float
    bytes_moved: float
    """Bytes read and written by the forward op."""
    output_bytes: float
    saved_bytes: float
    """Bytes kept for backward: the output if consumers save it, plus the op's own extras."""
    fwd_time: float
    bwd_time: float


@dataclass(frozen=True, slots=True)
class Strategy:
    """One way to run a node on the whole mesh: a spec per tensor input and output."""

    inputs: tuple[Spec | None, ...]
    outputs: tuple[Spec, ...]
    rewrites: tuple[Rewrite, ...] = ()
    """Per mesh axis: the lowering rewrite the axis needs (``Rewrite.NONE`` for none)."""
    comms: tuple[str, ...] = ()
    """Per mesh axis: collectives inside the op ("" for none)."""
    split: tuple[bool, ...] = ()
    """Per mesh axis: the axis's devices share the work (so replicated inputs get partial
    gradients that must be all-reduced: Megatron-LM's ``f``)."""
    compute_time: float = field(default=0.0, compare=False)
    """Forward + backward seconds on one device, local shapes."""
    comm_time: float = field(default=0.0, compare=False)
    """Seconds of collectives inside the op (forward + backward)."""
    layout_time: float = field(default=0.0, compare=False)
    """Of ``compute_time``: seconds of layout changes the op's library runs around it (cuDNN's
    transposes of a channels-first convolution on tensor cores, ``autopar.cost.op_kernels``)."""
    memory: float = field(default=0.0, compare=False)
    """Bytes one device holds for this node: saved activations, or parameter training state."""
    offloaded: float = field(default=0.0, compare=False)
    """Bytes of saved activations this node sends to host memory each micro-batch and fetches back
    for its backward (activation offload, ``PlanConfig.offload_activations``); not in ``memory``."""
    zero_stage: int = 0
    """For a trainable parameter stored sharded: how users that need it whole gather it (ZeRO
    stage 1, 2 or 3, ``autopar.cost.memory``); 0 for every other node."""
    recomputed: bool = False
    """Per-activation recomputation (``PlanConfig.recompute="ops"``): the node's forward runs again
    in backward instead of its output being saved (``passes.strategies.recompute_candidate``)."""


@dataclass(frozen=True, slots=True)
class NodeStrategies:
    strategies: tuple[Strategy, ...]
    follows: str = ""
    """Name of the node whose choice this one follows (cheap pointwise/view ops), or ""."""
    follow_map: tuple[int, ...] = ()
    """For a follower: ``follow_map[k]`` is this node's strategy when the leader picks ``k``."""
    bound: bool = False
    """The follower's strategies only make sense together with its leader's (a mixture-of-experts
    region, ``autopar.rules.routing``): a pass that drops strategies drops them jointly and never
    re-derives the follow map."""


# ------------------------------------------------------------------ the joint program (passes.joint)

PHASE = "autopar.phase"
"""``node.meta`` key of a joint program's node: its :class:`Phase`."""


class Phase(str, enum.Enum):
    """Whether a node of the joint program runs in the forward program (needed for the outputs)
    or in the backward program (the rest); a node a pass moves or copies into backward is ``BWD``."""

    FWD = "fwd"
    BWD = "bwd"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, slots=True)
class PrimalInfo:
    """What one primal is, for the rank-program passes."""

    kind: str
    """``param``, ``buffer``, ``input`` or ``const``."""
    name: str
    """Parameter/buffer FQN or user input path."""
    zero_stage: int = 0
    """ZeRO stage of a parameter stored sharded and gathered for use (0 otherwise)."""


RANK = "autopar.rank"
GRAD_MEMBERS = "autopar.grad_members"
"""On a gradient bucket's all-reduce issue (``passes.overlap.bucket_gradients``): the shapes of the
gradients flattened into it, in order (``passes.compress`` compresses each)."""
TWO_LEVEL = "autopar.two_level"
"""On the on-node reduce-scatter that starts a two-level gradient all-reduce (``passes.two_level``):
the value it reduces is the gradient (``passes.stage_cut.defer_reductions`` sums micro-batches
there, as it does before a gradient all-reduce)."""
COMPRESS_CAST = "autopar.compress_cast"
"""On the cast ``passes.compress`` puts before a gradient all-reduce (bf16 compression): the
value before it is the gradient in its own precision (``passes.stage_cut.defer_reductions`` sums
micro-batches there)."""
"""``gm.meta`` key of the joint program's :class:`RankInfo`."""


@dataclass(frozen=True, slots=True)
class RankInfo:
    """What the rank-program passes read besides the graph (``gm.meta[RANK]``)."""

    primals: tuple[PrimalInfo, ...]
    num_outputs: int
    axis_names: dict[str, str]
    """Process-group name -> mesh axis name (``dp``, ``tp`` …)."""
    recompute: str = "none"
    """The plan's activation recomputation (``passes.recompute.recompute_layers``)."""
    layer_of: dict[str, str] = field(default_factory=dict)
    """Captured node name -> the repeated-layer instance it belongs to (``transformer.h.3``)."""
    recompute_sources: frozenset[str] = frozenset()
    """Captured nodes the plan recomputes (``passes.strategies.recomputed``: the rule the plan
    was costed with)."""
    offload_layers: tuple[str, ...] = ()
    """Repeated-layer instances whose saved activations go to host memory and back
    (``Plan.offload_layers``; ``passes.offload_activations``), in forward order."""
    compression: Any = None
    """The plan's gradient compression (``Plan.compression``, an
    ``autopar.cost.compression.GradCompression``; ``passes.compress``); ``None``: exact."""
    two_level: dict[str, tuple[str, int, str]] = field(default_factory=dict)
    """Process-group name -> ``(on-node group, its size, across-nodes group)`` of each group whose
    gradient all-reduces run in two levels (``Plan.two_level``, ``AxisGroup.levels``;
    ``passes.two_level``)."""

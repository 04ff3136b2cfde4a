"""The Megatron-style layout nearest an autopar plan: the knobs an engine takes, read off the plan.

Words (``autopar.export`` writes the layout in each engine's own words):

* **layout** (:class:`Layout`) — the knobs of a Megatron-style layout (``autopar.layouts.megatron``):
  tensor-parallel size ``tp`` (Megatron-LM's column/row rule), data-parallel size ``dp``, expert-
  parallel size ``ep``, sequence parallelism, pipeline size ``pp`` with equal layer counts per
  stage, micro-batches, schedule, virtual stages, recomputation (in every layer, or the first
  ``N`` of each stage) and the distributed optimizer, plus the batch they split.
  :meth:`Layout.megatron_knobs` are the keywords ``autopar.layouts.megatron`` plans it with.
* **nearest layout** (:func:`nearest_layout`) — ``tp`` and ``ep`` are the sizes of the mesh axes
  the planner named ``tp``/``ep`` (``autopar.plan_record.axis_names``), every other axis is
  data-parallel, the pipeline, micro-batches, schedule and recomputation are the plan's, sequence
  parallelism is on where the plan splits its normalizations along the sequence on the tensor
  axis, and the distributed optimizer is on where it stores parameters sharded over data-parallel
  ranks; with a **note** for each thing the plan does that the layout does not.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Any

from autopar.graph import OpFamily, op_info, outer_instance
from autopar.ir import Rewrite
from autopar.megatron_parse import CP_FORMS
from autopar.placement import Shard, parse_spec
from autopar.planfile import Plan

__all__ = ["Layout", "nearest_layout"]

_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


@dataclass(frozen=True, kw_only=True, slots=True)
class Layout:
    """A Megatron-style layout (module docstring) and the batch it splits."""

    nodes: int
    gpus_per_node: int
    tp: int = 1
    """Tensor-parallel size (Megatron-LM's column/row-parallel weights)."""
    dp: int = 1
    """Data-parallel size: ``world / (tp · pp · cp)``; ``ep`` lies inside it."""
    ep: int = 1
    """Expert-parallel size (models with mixture-of-experts layers)."""
    cp: int = 1
    """Context-parallel size: each sequence split over ``cp`` ranks (Megatron-Core's
    ``--context-parallel-size``)."""
    cp_comm_type: tuple[str, ...] = ()
    """With ``cp > 1``: Megatron-Core's ``--cp-comm-type`` — ``allgather`` (keys and values
    gathered, each rank attending with its own queries), ``a2a`` (sequence traded for heads,
    DeepSpeed Ulysses) or ``p2p`` (keys and values passed around a ring) — one for every layer, or
    one per layer where the plan's layers differ."""
    sequence_parallel: bool = False
    """Normalizations and residual additions split along the sequence on the tensor axis."""
    pp: int = 1
    """Pipeline ranks."""
    microbatches: int = 1
    """Micro-batches per step per data-parallel rank (``pp == 1``: gradient accumulation)."""
    schedule: str = "1f1b"
    """``autopar.schedule``'s name: ``1f1b``, ``interleaved``, ``gpipe`` or ``zb-h1``."""
    virtual: int = 1
    """Pipeline stages per pipeline rank (> 1 with the interleaved schedule)."""
    recompute: str = "none"
    """``none``, ``selective`` (attention scores) or ``full`` (each layer's input kept)."""
    recompute_modules: tuple[str, ...] = ()
    """With ``selective``: Megatron-Core's ``--recompute-modules`` (``core_attn``, ``layernorm``,
    ``moe_act``): a per-activation plan's choices as module kinds (``_recompute_modules``); empty:
    Megatron's default, the attention core."""
    recompute_num_layers: int | None = None
    """With ``full``: the first N repeated layers of every pipeline stage recompute, the others keep
    their activations (Megatron-LM's ``--recompute-method block --recompute-num-layers N``);
    ``None``: every layer."""
    distributed_optimizer: bool = False
    """Optimizer state split over each weight's data-parallel ranks (ZeRO-1 style)."""
    zero_stage: int = 0
    """The ZeRO stage the engine is told (0 where nothing is sharded over data-parallel ranks)."""
    batch: int
    """Global batch in sequences."""
    seq: int | None = None
    """Tokens per sequence (or image side), where known."""
    layers: int = 0
    """The model's repeated layers (0 where the plan has none)."""
    dtype: str = "bf16"
    """Parameter dtype: ``bf16``, ``fp16`` or ``fp32``."""
    offload_optimizer: bool = False
    """Optimizer state and master weights in host memory, the step on the host (ZeRO-Offload;
    Megatron-Core's ``--optimizer-cpu-offload``)."""
    offload_layers: int = 0
    """The first this many repeated layers' saved activations go to host memory and back
    (Megatron-Core's ``--cpu-offloading-num-layers``)."""

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def micro_batch_size(self) -> int:
        """Sequences per micro-batch per data-parallel rank (Megatron's ``--micro-batch-size``)."""
        return max(1, self.batch // (self.dp * self.microbatches))

    def megatron_knobs(self) -> dict[str, Any]:
        """The keywords of ``autopar.layouts.megatron`` that plan this layout."""
        knobs = ("tp", "dp", "sequence_parallel", "ep", "pp", "microbatches", "schedule", "virtual",
                 "distributed_optimizer", "recompute", "recompute_num_layers")  # fmt: skip
        out = {k: getattr(self, k) for k in knobs}
        if self.cp > 1:
            out["cp"] = self.cp
            kinds = set(self.cp_comm_type)
            if len(kinds) > 1:
                raise ValueError(
                    f"autopar.layouts.megatron holds one context-parallel form for every layer, not "
                    f"--cp-comm-type {' '.join(self.cp_comm_type)}: plan the layout with cp_comm_type=None "
                    f"(the solver picks per layer) or autopar.plan"
                )
            if kinds:
                out["cp_comm_type"] = CP_FORMS[kinds.pop()]
        if self.offload_optimizer:
            out["offload_optimizer"] = True
        if self.offload_layers:
            out["offload_activations"] = self.offload_layers
        if self.recompute_modules and set(self.recompute_modules) != {"core_attn"}:
            raise ValueError(
                f"autopar.layouts.megatron plans Megatron's selective recomputation of the attention core "
                f"only, not --recompute-modules {' '.join(self.recompute_modules)}: plan the layout with "
                f"autopar.plan(recompute='ops') instead"
            )
        return out

    def describe(self) -> str:
        """``tp=2 × dp=4, pp=2 (1f1b, 4 micro-batches of 2), recompute=full``."""
        parts = [f"tp={self.tp} × dp={self.dp}" + (f" (ep={self.ep})" if self.ep > 1 else "")]
        if self.cp > 1:
            forms = "/".join(sorted(set(self.cp_comm_type)))
            parts[0] += f" × cp={self.cp}" + (f" ({forms})" if forms else "")
        if self.sequence_parallel:
            parts.append("sequence parallel")
        sched = self.schedule + (f", v={self.virtual}" if self.virtual > 1 else "")
        if self.pp > 1:
            parts.append(
                f"pp={self.pp} ({sched}, {self.microbatches} micro-batches of {self.micro_batch_size})"
            )
        elif self.microbatches > 1:
            parts.append(f"{self.microbatches} accumulated micro-batches of {self.micro_batch_size}")
        if self.recompute != "none":
            per = (
                f" (first {self.recompute_num_layers} layers per stage)" if self.recompute_num_layers else ""
            )
            mods = f" ({', '.join(self.recompute_modules)})" if self.recompute_modules else ""
            parts.append(f"recompute={self.recompute}{mods}{per}")
        if self.distributed_optimizer:
            parts.append(f"ZeRO-{self.zero_stage}" if self.zero_stage > 1 else "distributed optimizer")
        if self.offload_optimizer:
            parts.append("optimizer on the host")
        if self.offload_layers:
            parts.append(f"activations of the first {self.offload_layers} layers on the host")
        return ", ".join(parts)


# ------------------------------------------------------------------------------------ the plan
def _axis_sizes(plan: Plan, prefix: str) -> int:
    return math.prod(n for name, n in zip(plan.mesh_axes, plan.mesh_shape) if name.startswith(prefix))


def _layer_count(plan: Plan) -> int:
    """The repeated layers: distinct outermost numbered module instances (``blocks.3``)."""
    found = {outer_instance(n.module) for n in plan.nodes if n.kind == "op"}
    return sum(1 for p in found if p.rsplit(".", 1)[-1].isdigit())


def _layers_per_stage(plan: Plan, only: tuple[str, ...] | None = None) -> list[int] | None:
    """Repeated layers per pipeline stage (a layer counted in the stage holding most of its ops);
    ``only``: of these layer instances."""
    if plan.pipeline is None or plan.pipeline.num_stages == 1:
        return None
    votes: dict[str, Counter] = defaultdict(Counter)
    for n in plan.nodes:
        stage = plan.pipeline.stage_of.get(n.name)
        path = outer_instance(n.module)
        if stage is not None and path.rsplit(".", 1)[-1].isdigit() and (only is None or path in only):
            votes[path][stage] += 1
    counts = [0] * plan.pipeline.num_stages
    for c in votes.values():
        counts[c.most_common(1)[0][0]] += 1
    return counts


def _recompute_modules(plan: Plan, notes: list[str]) -> tuple[str, tuple[str, ...]]:
    """A per-activation plan (``Plan.recompute == "ops"``) as Megatron-Core's selective
    recomputation: ``(recompute, modules)``. A recomputed attention op or softmax is
    ``core_attn``, a norm ``layernorm``, a pointwise op of an expert layer (its module path names
    ``experts``) ``moe_act``; the others (a dense MLP's activation, a projection's output) have no
    module of their own: a note names them (the exported run keeps them). Other plans: theirs."""
    if plan.recompute != "ops":
        return plan.recompute, ()
    from autopar.graph import OpFamily, op_info

    modules: dict[str, None] = {}
    left: Counter = Counter()
    for n in plan.nodes:
        if not n.recomputed:
            continue
        family = op_info(n.op).family
        if family is OpFamily.ATTENTION or n.op in ("softmax", "_softmax"):
            modules["core_attn"] = None
        elif family is OpFamily.NORM:
            modules["layernorm"] = None
        elif family is OpFamily.POINTWISE and "experts" in n.module:
            modules["moe_act"] = None
        else:
            left[n.op] += 1
    if left:
        ops = ", ".join(f"{k} ×{v}" if v > 1 else k for k, v in left.most_common())
        notes.append(
            f"autopar recomputes activations Megatron-Core has no --recompute-modules entry for ({ops}, over "
            f"all layers): the exported run keeps them, and holds more memory than the plan"
        )
    if not modules:
        return "none", ()
    return "selective", tuple(m for m in ("core_attn", "layernorm", "moe_act") if m in modules)


def _recompute_num_layers(plan: Plan, notes: list[str]) -> int | None:
    """Megatron-LM's ``--recompute-num-layers`` (block method: the first N layers of every stage)
    for a plan recomputing some layers only (``Plan.recompute_layers``), with a note where no such
    N says what the plan does; ``None``: every layer."""
    layers = plan.recompute_layers
    if layers is None:
        return None
    if plan.recompute == "selective":
        notes.append(
            f"autopar recomputes the attention scores in {len(layers)} repeated layers ({layers[0]} …); "
            f"Megatron-LM's selective recomputation covers every layer: exported so"
        )
        return None
    counts = _layers_per_stage(plan, layers) or [len(layers)]
    if len(set(counts)) > 1:
        notes.append(
            f"autopar recomputes {'/'.join(map(str, counts))} layers per stage; Megatron-LM's block method "
            f"recomputes the same count in every stage: exported as {max(counts)} (more recomputation)"
        )
    return max(counts)


def _split_layers(plan: Plan) -> int:
    """Repeated layers whose ops lie in more than one pipeline stage."""
    if plan.pipeline is None:
        return 0
    stages: dict[str, set[int]] = defaultdict(set)
    for n in plan.nodes:
        stage = plan.pipeline.stage_of.get(n.name)
        path = outer_instance(n.module)
        if stage is not None and path.rsplit(".", 1)[-1].isdigit():
            stages[path].add(stage)
    return sum(1 for s in stages.values() if len(s) > 1)


def _is_norm(op: str) -> bool:
    return "norm" in op or op == "rsqrt"


def _sequence_parallel(plan: Plan) -> bool:
    """Most normalizations split along a dimension other than the last on a ``tp`` axis."""
    axes = [a for a, name in enumerate(plan.mesh_axes) if name.startswith("tp") and plan.mesh_shape[a] > 1]
    norms = [n for n in plan.nodes if _is_norm(n.op) and n.outputs and len(n.shape) >= 2]
    if not axes or not norms:
        return False
    split = 0
    for n in norms:
        for a in axes:
            p = n.outputs[0][a]
            if p.startswith("S(") and int(p[2:].split(")")[0]) % len(n.shape) != len(n.shape) - 1:
                split += 1
                break
    return split * 2 > len(norms)


def _batch_and_seq(plan: Plan, m: int) -> tuple[int, int | None]:
    w = plan.info.get("workload") or {}
    inputs = [n for n in plan.nodes if n.kind == "input" and n.shape]
    batch = w.get("batch") or (inputs[0].shape[0] * m if inputs else 1)
    seq = w.get("seq") or (inputs[0].shape[1] if inputs and len(inputs[0].shape) == 2 else None)
    return int(batch), seq


def _dtype(plan: Plan) -> str:
    w = plan.info.get("workload") or {}
    if w.get("dtype") in _DTYPES:
        return _DTYPES[w["dtype"]]
    return "fp32" if plan.info.get("param_bytes") == 4 else "bf16"


def _cp_comm_types(plan: Plan, notes: list[str]) -> tuple[str, ...]:
    """Megatron-Core's ``--cp-comm-type`` of each attention op of ``plan`` along its ``cp`` axis,
    in the order they run: ``allgather`` where the queries' sequence is split there (the keys and
    values gathered, in blocks or not), ``p2p`` where the keys and values are split with them (a
    ring), ``a2a`` where the heads are (``autopar.rules.attention``).
    One value where every layer agrees."""
    axis = plan.mesh_axes.index("cp")
    forms = []
    for n in plan.nodes:
        if n.kind != "op" or op_info(n.op).family is not OpFamily.ATTENTION or not n.inputs or not n.shape:
            continue
        q = parse_spec(n.inputs[0])[axis]
        seq = len(n.shape) - 2
        if isinstance(q, Shard) and q.dim in (seq, seq - 1):
            ring = n.rewrites[axis] == Rewrite.RING_ATTENTION.value
            forms.append("a2a" if q.dim != seq else "p2p" if ring else "allgather")
        else:
            notes.append(
                f"{n.name} runs {q} along cp (its sequences, not its tokens, split there); the layout "
                "splits every sequence over cp"
            )
    if len(set(forms)) == 1:
        return (forms[0],)
    return tuple(forms)


def nearest_layout(plan: Plan) -> tuple[Layout, list[str]]:
    """The Megatron-style layout nearest ``plan`` (module docstring), and notes on what the plan
    does that no such layout expresses."""
    notes: list[str] = []
    cluster = plan.cluster
    pipe = plan.pipeline
    pp, m = (pipe.pp, pipe.microbatches) if pipe is not None else (1, 1)
    schedule, virtual = (pipe.schedule, pipe.virtual) if pipe is not None else ("1f1b", 1)
    tp, ep, cp = _axis_sizes(plan, "tp"), _axis_sizes(plan, "ep"), _axis_sizes(plan, "cp")
    world = plan.world_size
    dp = world // (tp * pp * cp)
    cp_comm = _cp_comm_types(plan, notes) if cp > 1 else ()
    others = [f"{name}={n}" for name, n in zip(plan.mesh_axes, plan.mesh_shape)
              if n > 1 and name.startswith(("sp", "rep"))]  # fmt: skip
    if others:
        notes.append(
            f"mesh axes {', '.join(others)} split activations along another dimension or repeat work; "
            f"the layout runs them as data parallelism"
        )
    batch, seq = _batch_and_seq(plan, m)
    if batch % (dp * m):
        notes.append(
            f"the global batch of {batch} does not split into {dp} data-parallel ranks × {m} micro-batches"
        )
    stages = _layers_per_stage(plan)
    layers = _layer_count(plan)
    if stages is not None and len(set(stages)) > 1:
        notes.append(
            f"autopar cuts the pipeline by cost, {'/'.join(map(str, stages))} repeated layers per stage; "
            f"the layout cuts equal layer counts ({layers // len(stages) if layers % len(stages) == 0 else layers / len(stages):g} per stage)"
        )
    split = _split_layers(plan)
    if split:
        notes.append(
            f"{split} repeated layer(s) are cut inside (between attention and MLP); the layout cuts between layers"
        )
    if pipe is not None and pipe.dp_shares:
        notes.append(
            f"autopar gives the data-parallel replicas unequal shares of the step's {sum(pipe.dp_shares)} "
            f"micro-batches ({':'.join(map(str, pipe.dp_shares))}, a faster device kind more); the layout "
            f"gives each {m}"
        )
    zero = plan.zero_stages()
    stage_counts = Counter(zero.values())
    if len(stage_counts) > 1:
        per = ", ".join(f"{k} weights ZeRO-{s}" for s, k in sorted(stage_counts.items()))
        notes.append(f"per-parameter ZeRO stages ({per}); the layout takes one stage for every weight")
    zero_stage = max(stage_counts) if stage_counts else (1 if plan.info.get("state_split") else 0)
    if zero_stage == 0 and plan.info.get("state_split"):
        zero_stage = 1
    recompute, modules = _recompute_modules(plan, notes)
    layout = Layout(
        nodes=int(cluster.get("nodes", 1)), gpus_per_node=int(cluster.get("gpus_per_node", world)),
        tp=tp, dp=dp, ep=ep, cp=cp, cp_comm_type=cp_comm, sequence_parallel=_sequence_parallel(plan), pp=pp,
        microbatches=m,
        schedule=schedule, virtual=virtual, recompute=recompute, recompute_modules=modules,
        recompute_num_layers=_recompute_num_layers(plan, notes), distributed_optimizer=zero_stage > 0,
        zero_stage=zero_stage, batch=batch, seq=seq, layers=layers, dtype=_dtype(plan),
        offload_optimizer=plan.offload_optimizer, offload_layers=len(plan.offload_layers),
    )  # fmt: skip
    return layout, notes

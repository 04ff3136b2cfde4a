"""Plans exported to the engines people already train with: Megatron-LM, torchtitan, DeepSpeed.

An autopar plan chooses a strategy for every op; an engine takes a handful of knobs and applies
its own fixed rules. Exporting a plan therefore means finding the **nearest layout** the engine
can express and writing that layout in the engine's own words. Words used here:

* **layout** (:class:`Layout`) — the knobs of a Megatron-style layout (``autopar.layouts.megatron``):
  tensor-parallel size ``tp`` (Megatron-LM's column/row rule), data-parallel size ``dp``, expert-
  parallel size ``ep``, sequence parallelism, pipeline size ``pp`` with equal layer counts per
  stage, micro-batches, schedule, virtual stages, recomputation and the distributed optimizer,
  plus the batch they split. Every engine here applies the same tensor-parallel rule, so each
  engine's nearest layout is a ``Layout``, and :meth:`Layout.megatron_knobs` are the keywords
  ``autopar.layouts.megatron`` plans it with — the exported layout's prediction is that plan's
  step, not a guess.
* **nearest layout** (:func:`nearest_layout`) — read off the plan: ``tp`` and ``ep`` are the sizes
  of the mesh axes the planner named ``tp``/``ep`` (``autopar.plan_record.axis_names``), every other
  axis is data-parallel, the pipeline, micro-batches, schedule and recomputation are the plan's,
  sequence parallelism is on where the plan splits its normalizations along the sequence on the
  tensor axis, and the distributed optimizer is on where it stores parameters sharded over data-
  parallel ranks. Then each engine moves it to what that engine runs (``to_megatron``,
  ``to_torchtitan``, ``to_deepspeed``).
* **note** — one sentence on something autopar's plan does that the engine's layout does not:
  per-op choices that differ from the engine's rules, unequal pipeline cuts, per-parameter ZeRO
  stages, a schedule the engine lacks.

The configuration names are the engines' documented ones: Megatron-LM's command-line arguments
(``megatron/training/arguments.py`` and its ``ModelParallelConfig``/``TransformerConfig``);
torchtitan's TOML job file of v0.2.2 (``torchtitan/config/job_config.py``: ``[parallelism]``,
``[activation_checkpoint]``, ``[training]``; the last TOML release — later versions configure
the same fields in Python); DeepSpeed's JSON (``deepspeed.ai/docs/config-json``: batch sizes,
``zero_optimization``, ``bf16``/``fp16``, the pipeline engine's ``pipeline`` section, AutoTP
training's ``tensor_parallel.autotp_size``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import shlex
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from autopar.display import fmt_time
from autopar.graph import outer_instance
from autopar.planfile import Plan

__all__ = [
    "ENGINES",
    "ENGINE_NAMES",
    "Export",
    "Layout",
    "export",
    "nearest_layout",
    "prediction_text",
    "to_deepspeed",
    "to_megatron",
    "to_torchtitan",
    "weight_differences",
]

_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


@dataclass(frozen=True, kw_only=True, slots=True)
class Layout:
    """A Megatron-style layout (module docstring) and the batch it splits."""

    nodes: int
    gpus_per_node: int
    tp: int = 1
    """Tensor-parallel size (Megatron-LM's column/row-parallel weights)."""
    dp: int = 1
    """Data-parallel size: ``world / (tp · pp)``; ``ep`` lies inside it."""
    ep: int = 1
    """Expert-parallel size (models with mixture-of-experts layers)."""
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
        return {k: getattr(self, k) for k in knobs}

    def describe(self) -> str:
        """``tp=2 × dp=4, pp=2 (1f1b, 4 micro-batches of 2), recompute=full``."""
        parts = [f"tp={self.tp} × dp={self.dp}" + (f" (ep={self.ep})" if self.ep > 1 else "")]
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
            parts.append(f"recompute={self.recompute}{per}")
        if self.distributed_optimizer:
            parts.append(f"ZeRO-{self.zero_stage}" if self.zero_stage > 1 else "distributed optimizer")
        return ", ".join(parts)


@dataclass(frozen=True, kw_only=True, slots=True)
class Export:
    """One engine's configuration for a plan: the text to write, the layout it expresses, and the
    notes on what autopar's plan does that it does not."""

    engine: str
    text: str
    """The configuration: a shell command line, a TOML file or a JSON file."""
    layout: Layout
    notes: tuple[str, ...]


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


def nearest_layout(plan: Plan) -> tuple[Layout, list[str]]:
    """The Megatron-style layout nearest ``plan`` (module docstring), and notes on what the plan
    does that no such layout expresses."""
    notes: list[str] = []
    cluster = plan.cluster
    pipe = plan.pipeline
    pp, m = (pipe.pp, pipe.microbatches) if pipe is not None else (1, 1)
    schedule, virtual = (pipe.schedule, pipe.virtual) if pipe is not None else ("1f1b", 1)
    tp, ep = _axis_sizes(plan, "tp"), _axis_sizes(plan, "ep")
    world = plan.world_size
    dp = world // (tp * pp)
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
    zero = plan.zero_stages()
    stage_counts = Counter(zero.values())
    if len(stage_counts) > 1:
        per = ", ".join(f"{k} weights ZeRO-{s}" for s, k in sorted(stage_counts.items()))
        notes.append(f"per-parameter ZeRO stages ({per}); the layout takes one stage for every weight")
    zero_stage = max(stage_counts) if stage_counts else (1 if plan.info.get("state_split") else 0)
    if zero_stage == 0 and plan.info.get("state_split"):
        zero_stage = 1
    layout = Layout(
        nodes=int(cluster.get("nodes", 1)), gpus_per_node=int(cluster.get("gpus_per_node", world)),
        tp=tp, dp=dp, ep=ep, sequence_parallel=_sequence_parallel(plan), pp=pp, microbatches=m,
        schedule=schedule, virtual=virtual, recompute=plan.recompute,
        recompute_num_layers=_recompute_num_layers(plan, notes), distributed_optimizer=zero_stage > 0,
        zero_stage=zero_stage, batch=batch, seq=seq, layers=layers, dtype=_dtype(plan),
    )  # fmt: skip
    return layout, notes


def _pipeline_for_equal_layers(layout: Layout, notes: list[str], engine: str) -> Layout:
    """Virtual stages only where the layers divide into them and the micro-batches fill them
    (Megatron-LM's interleaved rules), else one stage per rank."""
    if layout.pp == 1 or layout.virtual == 1:
        return layout
    if layout.layers % (layout.pp * layout.virtual) or layout.microbatches % layout.pp:
        notes.append(
            f"{engine}'s interleaved schedule needs the {layout.layers} layers to divide into "
            f"{layout.pp * layout.virtual} equal stages and the {layout.microbatches} micro-batches into "
            f"multiples of pp={layout.pp}; exported as 1F1B with one stage per rank"
        )
        return dataclasses.replace(layout, schedule="1f1b", virtual=1)
    return layout


# ------------------------------------------------------------------------------------ Megatron-LM
def to_megatron(plan: Plan) -> Export:
    """Megatron-LM command-line arguments for the nearest layout, as a ``torchrun`` line."""
    layout, notes = nearest_layout(plan)
    if layout.schedule in ("gpipe", "zb-h1"):
        notes.append(
            f"Megatron-LM has no {layout.schedule} schedule; exported as 1F1B (the non-interleaved schedule)"
        )
        layout = dataclasses.replace(layout, schedule="1f1b", virtual=1)
    layout = _pipeline_for_equal_layers(layout, notes, "Megatron-LM")
    if layout.zero_stage == 3:
        notes.append(
            "autopar stores weights sharded and gathers them for each use (ZeRO-3); Megatron-LM's distributed "
            "optimizer splits only the optimizer state and gradients (exported as --use-distributed-optimizer)"
        )
    layout = dataclasses.replace(layout, zero_stage=min(layout.zero_stage, 1))
    return Export(engine="megatron", text=_megatron_command(layout), layout=layout, notes=tuple(notes))


def megatron_args(layout: Layout) -> list[str]:
    """The Megatron-LM arguments of ``layout`` (parallelism, batch, recomputation, precision)."""
    a = ["--tensor-model-parallel-size", str(layout.tp), "--pipeline-model-parallel-size", str(layout.pp)]
    if layout.virtual > 1:
        a += ["--num-layers-per-virtual-pipeline-stage", str(layout.layers // (layout.pp * layout.virtual))]
    if layout.sequence_parallel:
        a.append("--sequence-parallel")
    if layout.ep > 1:
        a += ["--expert-model-parallel-size", str(layout.ep), "--expert-tensor-parallel-size", "1"]
    if layout.layers:
        a += ["--num-layers", str(layout.layers)]
    if layout.seq:
        a += ["--seq-length", str(layout.seq)]
    a += ["--micro-batch-size", str(layout.micro_batch_size), "--global-batch-size", str(layout.batch)]
    if layout.recompute == "selective":
        a += ["--recompute-granularity", "selective"]
    elif layout.recompute == "full" and layout.recompute_num_layers:
        a += ["--recompute-granularity", "full", "--recompute-method", "block"]
        a += ["--recompute-num-layers", str(layout.recompute_num_layers)]
    elif layout.recompute == "full":
        a += [
            "--recompute-granularity",
            "full",
            "--recompute-method",
            "uniform",
            "--recompute-num-layers",
            "1",
        ]
    if layout.distributed_optimizer:
        a += ["--use-distributed-optimizer", "--overlap-param-gather"]
    if layout.dp > 1:
        a.append("--overlap-grad-reduce")
    if layout.dtype in ("bf16", "fp16"):
        a.append(f"--{layout.dtype}")
    return a


def _megatron_command(layout: Layout) -> str:
    head = [
        "torchrun",
        "--nnodes",
        str(layout.nodes),
        "--nproc-per-node",
        str(layout.gpus_per_node),
        "pretrain_gpt.py",
    ]
    args = megatron_args(layout)
    lines, i = [" ".join(head)], 0
    while i < len(args):  # one flag (and its value) per line
        j = i + 1
        while j < len(args) and not args[j].startswith("--"):
            j += 1
        lines.append(" ".join(shlex.quote(x) for x in args[i:j]))
        i = j
    return (
        "# Megatron-LM: the model's own arguments (--hidden-size, --num-attention-heads, --vocab-size, …) go on "
        "this line too\n" + " \\\n    ".join(lines) + "\n"
    )


# ------------------------------------------------------------------------------------ torchtitan
_TITAN_SCHEDULES = {"1f1b": "1F1B", "gpipe": "GPipe", "interleaved": "Interleaved1F1B"}


def to_torchtitan(plan: Plan) -> Export:
    """A torchtitan (v0.2.2) TOML job file's ``[training]``, ``[parallelism]`` and
    ``[activation_checkpoint]`` sections for the nearest layout."""
    layout, notes = nearest_layout(plan)
    if layout.schedule == "zb-h1":
        notes.append(
            "torch.distributed.pipelining has no zero-bubble schedule with one stage per rank (ZB-H1); "
            "exported as 1F1B"
        )
        layout = dataclasses.replace(layout, schedule="1f1b", virtual=1)
    layout = _pipeline_for_equal_layers(layout, notes, "torchtitan")
    if layout.tp > 1 and not layout.sequence_parallel:
        notes.append(
            "torchtitan's tensor parallelism always splits norms along the sequence (sequence parallel)"
        )
        layout = dataclasses.replace(layout, sequence_parallel=True)
    ddp = layout.tp == 1 and layout.pp == 1 and layout.ep == 1 and layout.zero_stage == 0
    shard = 1 if ddp else layout.dp
    if shard > 1:
        if layout.zero_stage < 3:
            why = "" if layout.zero_stage else " (its DDP runs only without other parallelism)"
            notes.append(
                f"torchtitan shards weights over the data-parallel ranks as FSDP, gathered for each use{why}"
            )
        notes.append(
            "the prediction plans FSDP's state split as Megatron-LM's distributed optimizer: FSDP's weight "
            "all-gathers in forward and backward are not in it"
        )
        layout = dataclasses.replace(layout, distributed_optimizer=True, zero_stage=3)
    if layout.recompute == "selective":
        notes.append(
            "torchtitan's selective checkpointing (op policy) saves every other matmul; autopar's recomputes "
            "the attention scores — the prediction is autopar's"
        )
    if layout.recompute_num_layers:
        notes.append(
            f"torchtitan's full checkpointing wraps every layer; autopar recomputes the first "
            f"{layout.recompute_num_layers} of each stage: exported as every layer (more recomputation)"
        )
    if layout.dtype == "fp16":
        notes.append("torchtitan trains in bfloat16 or float32, not float16: exported as bfloat16")
    local = layout.batch // layout.dp if layout.pp > 1 else layout.micro_batch_size
    t: dict[str, dict[str, Any]] = {
        "training": {"local_batch_size": local, "global_batch_size": layout.batch},
        "parallelism": {
            "data_parallel_replicate_degree": layout.dp if ddp else 1,
            "data_parallel_shard_degree": shard,
            "tensor_parallel_degree": layout.tp,
            "enable_async_tensor_parallel": False,
            "pipeline_parallel_degree": layout.pp,
            "context_parallel_degree": 1,
        },
        "activation_checkpoint": {"mode": layout.recompute},
    }
    if layout.seq:
        t["training"]["seq_len"] = layout.seq
    t["training"]["mixed_precision_param"] = "float32" if layout.dtype == "fp32" else "bfloat16"
    par = t["parallelism"]
    if layout.pp > 1:
        par["pipeline_parallel_schedule"] = _TITAN_SCHEDULES[layout.schedule]
        par["pipeline_parallel_microbatch_size"] = layout.micro_batch_size
        if layout.layers and layout.layers % (layout.pp * layout.virtual) == 0:
            par["pipeline_parallel_layers_per_stage"] = layout.layers // (layout.pp * layout.virtual)
            par["pipeline_parallel_first_stage_less_layers"] = 0
            par["pipeline_parallel_last_stage_less_layers"] = 0
    if layout.ep > 1:
        par["expert_parallel_degree"] = layout.ep
        par["expert_tensor_parallel_degree"] = 1
    if layout.recompute == "selective":
        t["activation_checkpoint"]["selective_ac_option"] = "op"
    head = "# torchtitan (v0.2.2 TOML job file): merge these sections into the model's train_configs/*.toml\n"
    return Export(engine="torchtitan", text=head + _toml(t), layout=layout, notes=tuple(notes))


def _toml(tables: dict[str, dict[str, Any]]) -> str:
    """Tables of scalars as TOML (strings, integers, booleans)."""

    def value(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, int):
            return str(v)
        return json.dumps(str(v))

    out = []
    for name, table in tables.items():
        out.append(f"[{name}]")
        out += [f"{k} = {value(v)}" for k, v in table.items()]
        out.append("")
    return "\n".join(out)


# ------------------------------------------------------------------------------------ DeepSpeed
def to_deepspeed(plan: Plan) -> Export:
    """A DeepSpeed configuration JSON for the nearest layout: batch sizes, ZeRO stage, precision,
    AutoTP training's tensor-parallel size and the pipeline engine's section."""
    layout, notes = nearest_layout(plan)
    if layout.pp > 1 and (layout.schedule != "1f1b" or layout.virtual > 1):
        notes.append(
            f"DeepSpeed's pipeline engine runs one schedule (1F1B-like, one stage per rank), not {layout.schedule}"
        )
        layout = dataclasses.replace(layout, schedule="1f1b", virtual=1)
    if layout.sequence_parallel:
        notes.append(
            "DeepSpeed's AutoTP does not split norms along the sequence (no Megatron sequence parallelism)"
        )
        layout = dataclasses.replace(layout, sequence_parallel=False)
    stage = layout.zero_stage
    if layout.pp > 1 and stage > 1:
        notes.append(f"DeepSpeed's pipeline engine allows ZeRO stage 0 or 1, not {stage}: exported as 1")
        stage = 1
    elif layout.tp > 1 and stage > 2:
        notes.append(f"DeepSpeed's AutoTP training allows ZeRO stages 0–2, not {stage}: exported as 2")
        stage = 2
    if stage == 3:
        notes.append(
            "the prediction plans ZeRO-3 as Megatron-LM's distributed optimizer: the weight all-gathers of "
            "ZeRO-3 are not in it"
        )
    if layout.recompute == "selective":
        notes.append("DeepSpeed has no selective (attention-only) recomputation: exported as full")
        layout = dataclasses.replace(layout, recompute="full")
    if layout.recompute_num_layers:
        notes.append(
            f"autopar recomputes the first {layout.recompute_num_layers} layers of each stage; DeepSpeed "
            f"checkpoints what the model's code wraps: wrap those layers only"
        )
    layout = dataclasses.replace(layout, zero_stage=stage, distributed_optimizer=stage > 0)
    d: dict[str, Any] = {
        "train_batch_size": layout.batch,
        "train_micro_batch_size_per_gpu": layout.micro_batch_size,
        "gradient_accumulation_steps": layout.microbatches,
        "zero_optimization": {"stage": stage, "overlap_comm": True, "contiguous_gradients": True},
        "bf16": {"enabled": layout.dtype == "bf16"},
        "fp16": {"enabled": layout.dtype == "fp16"},
    }
    if layout.tp > 1:
        d["tensor_parallel"] = {"autotp_size": layout.tp}
        if layout.pp > 1:
            notes.append(
                "DeepSpeed's pipeline engine takes tensor parallelism from a Megatron-style mpu (Megatron-DeepSpeed), "
                "not from AutoTP"
            )
    if layout.pp > 1:
        d["pipeline"] = {
            "stages": layout.pp,
            "partition": "uniform",
            "activation_checkpoint_interval": 1 if layout.recompute == "full" else 0,
        }
        notes.append(
            f"DeepSpeed takes the stage count in code: deepspeed.pipe.PipelineModule(layers, num_stages={layout.pp}, "
            f"partition_method='uniform')"
        )
    elif layout.recompute == "full":
        d["activation_checkpointing"] = {
            "partition_activations": False,
            "contiguous_memory_optimization": False,
        }
        notes.append(
            "DeepSpeed recomputes what the model's code checkpoints: wrap each layer in deepspeed.checkpointing.checkpoint"
        )
    if layout.ep > 1:
        notes.append(
            f"DeepSpeed takes the expert-parallel size in code: deepspeed.moe.layer.MoE(..., ep_size={layout.ep})"
        )
    return Export(engine="deepspeed", text=json.dumps(d, indent=2) + "\n", layout=layout, notes=tuple(notes))


ENGINES: dict[str, Callable[[Plan], Export]] = {
    "megatron": to_megatron,
    "torchtitan": to_torchtitan,
    "deepspeed": to_deepspeed,
}
"""Engine name (``autopar export --to``) -> its exporter."""

ENGINE_NAMES = {"megatron": "Megatron-LM", "torchtitan": "torchtitan", "deepspeed": "DeepSpeed"}
"""Engine name -> how the engine spells itself."""


def export(plan: Plan, engine: str) -> Export:
    """``plan`` as ``engine``'s configuration (``ENGINES``)."""
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; engines: {', '.join(ENGINES)}")
    return ENGINES[engine](plan)


# ------------------------------------------------------------------------------------ comparison
def _splits(plan: Plan, fqn: str) -> dict[int, int]:
    """``{dimension: ways}`` a weight is split along the plan's ``tp`` and ``ep`` axes."""
    out: dict[int, int] = defaultdict(lambda: 1)
    for a, p in enumerate(plan.params.get(fqn, ())):
        if plan.mesh_axes[a].startswith(("tp", "ep")) and p.startswith("S(") and plan.mesh_shape[a] > 1:
            out[int(p[2:].split(")")[0])] *= plan.mesh_shape[a]
    return dict(out)


def _split_text(s: dict[int, int]) -> str:
    return " ".join(f"S({d})/{k}" for d, k in sorted(s.items())) or "whole"


def weight_differences(plan: Plan, exported: Plan, limit: int = 4) -> str | None:
    """A note on the weights ``plan`` splits differently along its tensor/expert axes from the
    exported layout's plan (repeated layers folded: ``blocks.*.fc.weight``), or ``None``."""
    diff: dict[str, tuple[str, str]] = {}
    for fqn in plan.params:
        if fqn not in exported.params:
            continue
        a, b = _splits(plan, fqn), _splits(exported, fqn)
        if a != b:
            diff.setdefault(re.sub(r"\.\d+\.", ".*.", fqn), (_split_text(a), _split_text(b)))
    if not diff:
        return None
    shown = [f"{k} (autopar {a}, engine {b})" for k, (a, b) in list(diff.items())[:limit]]
    more = f" and {len(diff) - limit} more" if len(diff) > limit else ""
    return f"autopar places {len(diff)} weight(s) otherwise than the engine's fixed rule: {'; '.join(shown)}{more}"


def prediction_text(plan: Plan, exported: Plan | str) -> str:
    """The two predicted steps: autopar's plan and the exported layout (or why it was not planned)."""
    own = plan.predicted.step_time
    lines = [f"predicted step: autopar's plan {fmt_time(own)}"]
    if isinstance(exported, str):
        lines.append(f"                the exported layout: not planned ({exported})")
    else:
        t = exported.predicted.step_time
        lines.append(
            f"                the exported layout {fmt_time(t)} ({t / own:.2f}× autopar's; "
            f"{exported.info.get('layout', 'megatron')})"
        )
    return "\n".join(lines)

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
import re
import shlex
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from autopar.display import fmt_time
from autopar.nearest_layout import Layout, nearest_layout
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


@dataclass(frozen=True, kw_only=True, slots=True)
class Export:
    """One engine's configuration for a plan: the text to write, the layout it expresses, and the
    notes on what autopar's plan does that it does not."""

    engine: str
    text: str
    """The configuration: a shell command line, a TOML file or a JSON file."""
    layout: Layout
    notes: tuple[str, ...]


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
    if layout.offload_layers and layout.pp > 1:
        notes.append(
            f"autopar offloads the activations of the first {layout.offload_layers} layers under a pipeline; "
            "Megatron-Core's CPU offloading runs without one: not exported"
        )
        layout = dataclasses.replace(layout, offload_layers=0)
    if layout.offload_optimizer and not layout.distributed_optimizer:
        # Megatron-Core's CPU offload (HybridDeviceOptimizer) runs under the distributed optimizer;
        # over one data-parallel rank it splits nothing
        notes.append(
            "Megatron-Core offloads the optimizer only under its distributed optimizer: exported with "
            "--use-distributed-optimizer"
            + (
                f", which also splits the optimizer state over the {layout.dp} data-parallel ranks"
                if layout.dp > 1
                else ""
            )
        )
        layout = dataclasses.replace(layout, distributed_optimizer=True, zero_stage=1)
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
    if layout.cp > 1:
        a += ["--context-parallel-size", str(layout.cp)]
        if layout.cp_comm_type:
            a += ["--cp-comm-type", *layout.cp_comm_type]
    if layout.layers:
        a += ["--num-layers", str(layout.layers)]
    if layout.seq:
        a += ["--seq-length", str(layout.seq)]
    a += ["--micro-batch-size", str(layout.micro_batch_size), "--global-batch-size", str(layout.batch)]
    if layout.recompute == "selective":
        a += ["--recompute-granularity", "selective"]
        if layout.recompute_modules and layout.recompute_modules != ("core_attn",):
            a += ["--recompute-modules", *layout.recompute_modules]
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
    if layout.offload_optimizer:
        a += [
            "--optimizer-cpu-offload",
            "--optimizer-offload-fraction",
            "1.0",
            "--use-precision-aware-optimizer",
        ]
    if layout.offload_layers:
        a += ["--cpu-offloading", "--cpu-offloading-num-layers", str(layout.offload_layers)]
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
    if layout.offload_layers:
        notes.append(
            f"autopar offloads the activations of the first {layout.offload_layers} layers to the host; torchtitan "
            "has no activation offload: not exported"
        )
        layout = dataclasses.replace(layout, offload_layers=0)
    if layout.offload_optimizer:
        notes.append(
            "torchtitan offloads only through FSDP2's CPUOffloadPolicy ([training] enable_cpu_offload), which keeps "
            "the weights and gradients on the host too and steps there: not exported (the optimizer state is on the "
            "device in this layout, and its prediction plans it so)"
        )
        layout = dataclasses.replace(layout, offload_optimizer=False)
    if layout.cp > 1 and set(layout.cp_comm_type) - {"allgather", "p2p"}:
        notes.append(
            "torchtitan's context parallelism is ring attention over the keys and values "
            "(context_parallel_rotate_method allgather or alltoall), never the heads: autopar's all-to-all "
            "form (a2a, DeepSpeed Ulysses) is exported as the all-gather form"
        )
        layout = dataclasses.replace(
            layout, cp_comm_type=tuple(f if f == "p2p" else "allgather" for f in layout.cp_comm_type)
        )
    if layout.cp > 1 and len(set(layout.cp_comm_type)) > 1:
        notes.append(
            "torchtitan rotates the keys and values one way for every layer: the plan's mix of the "
            "all-gather and ring forms is exported as the ring (alltoall)"
        )
        layout = dataclasses.replace(layout, cp_comm_type=("p2p",))
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
            "context_parallel_degree": layout.cp,
            **(
                {
                    "context_parallel_rotate_method": "alltoall"
                    if layout.cp_comm_type == ("p2p",)
                    else "allgather"
                }
                if layout.cp > 1
                else {}
            ),
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
    if layout.offload_layers:
        notes.append(
            f"autopar offloads the activations of the first {layout.offload_layers} layers to the host; DeepSpeed "
            "offloads only the checkpoints of recomputed layers (activation_checkpointing.cpu_checkpointing): not "
            "exported"
        )
        layout = dataclasses.replace(layout, offload_layers=0)
    if layout.offload_optimizer and stage == 0:
        notes.append(
            "DeepSpeed offloads the optimizer (ZeRO-Offload) under ZeRO stage 1 to 3: exported with stage 1"
            + (
                f", which also splits the optimizer state over the {layout.dp} data-parallel ranks"
                if layout.dp > 1
                else ""
            )
        )
        stage = 1
    layout = dataclasses.replace(layout, zero_stage=stage, distributed_optimizer=stage > 0)
    d: dict[str, Any] = {
        "train_batch_size": layout.batch,
        "train_micro_batch_size_per_gpu": layout.micro_batch_size,
        "gradient_accumulation_steps": layout.microbatches,
        "zero_optimization": {
            "stage": stage,
            "overlap_comm": True,
            "contiguous_gradients": True,
            **(
                {"offload_optimizer": {"device": "cpu", "pin_memory": True}}
                if layout.offload_optimizer
                else {}
            ),
        },
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
    if layout.cp > 1:
        notes.append(
            f"DeepSpeed takes the sequence split in code, not in this JSON (DeepSpeed-Ulysses: "
            f"deepspeed.sequence.layer.DistributedAttention over {layout.cp} ranks, Megatron-DeepSpeed's "
            f"--ds-sequence-parallel-size {layout.cp}); the batch sizes here count {layout.dp} data-parallel ranks"
            + (
                "; Ulysses trades the sequence for heads (a2a), and the plan's all-gather form has no DeepSpeed "
                "counterpart"
                if "allgather" in layout.cp_comm_type
                else ""
            )
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
    out = ENGINES[engine](plan)
    c = plan.compression
    if c is None:
        return out
    if engine == "deepspeed" and c.method == "bf16":
        d = json.loads(out.text)
        d["communication_data_type"] = "bf16"
        return dataclasses.replace(out, text=json.dumps(d, indent=2) + "\n")
    hooks = {
        "powersgd": "register_comm_hook(PowerSGDState(process_group=None, matrix_approximation_rank="
        f"{c.rank}), powerSGD_hook)",
        "bf16": "register_comm_hook(None, bf16_compress_hook)",
    }
    runs = (
        f"PyTorch DDP runs it: {hooks[c.method]}"
        if c.method in hooks
        else "no PyTorch DDP hook runs it; autopar's runtime does"
    )
    note = (
        f"the plan compresses its data-parallel gradients ({c.describe()}), which {ENGINE_NAMES[engine]} does not: "
        f"exported uncompressed, so the step is slower than predicted where the network is slow ({runs})"
    )
    return dataclasses.replace(out, notes=(*out.notes, note))


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

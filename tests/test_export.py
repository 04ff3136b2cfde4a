"""``autopar.export`` and ``autopar export``: a plan written as Megatron-LM arguments, a torchtitan
TOML job file and a DeepSpeed JSON for the nearest layout each engine expresses, read back by
their own parsers (``tomllib``, ``json``, ``parse_megatron_args``) with the values the layout has;
the Megatron round trip (arguments parsed back into ``layouts.megatron`` give the same plan);
notes on what an engine cannot express; and the command with both predicted steps.

Plans are of a 4-layer ``gpt-tiny`` (batch 16 × 32) on one node of 8 H100: autopar's own plan,
``layouts.megatron`` with tp=2 and sequence parallelism, and a pipeline of 2 with tp=2 and 4
micro-batches."""

from __future__ import annotations

import dataclasses
import json

import pytest

import autopar
from autopar import layouts, zoo
from autopar.cli import main
from autopar.cluster import Cluster
from autopar.export import (
    export,
    nearest_layout,
    to_deepspeed,
    to_megatron,
    to_torchtitan,
    weight_differences,
)
from autopar.megatron_parse import parse_megatron_args

CLUSTER = Cluster.preset("H100-SXM", gpus_per_node=8, nodes=1)


@pytest.fixture(scope="module")
def workload() -> zoo.Workload:
    return zoo.load("gpt-tiny", batch=16, seq=32, layers=4)


def _megatron(w: zoo.Workload, **knobs) -> autopar.Plan:
    plan = layouts.megatron(w.model, w.example_inputs, CLUSTER, **knobs)
    plan.info["workload"] = w.info
    return plan


@pytest.fixture(scope="module")
def plans(workload) -> dict[str, autopar.Plan]:
    auto = autopar.plan(workload.model, workload.example_inputs, CLUSTER)
    auto.info["workload"] = workload.info
    return {
        "auto": auto,
        "tp2": _megatron(workload, tp=2, sequence_parallel=True),
        "pp2": _megatron(workload, tp=2, pp=2, microbatches=4, recompute="full"),
        "offload": _megatron(workload, tp=2, distributed_optimizer=True, offload_optimizer=True),
        "activations": _megatron(workload, tp=2, offload_activations=2),
        "cp2": _megatron(workload, tp=2, cp=2, cp_comm_type="all_gather", sequence_parallel=True),
    }


def test_nearest_layout_reads_the_plans_knobs(plans):
    auto, _ = nearest_layout(plans["auto"])
    assert (auto.tp * auto.dp * auto.pp, auto.batch, auto.seq, auto.layers, auto.dtype) == (
        8,
        16,
        32,
        4,
        "bf16",
    )
    tp2, notes = nearest_layout(plans["tp2"])
    assert (tp2.tp, tp2.dp, tp2.pp, tp2.sequence_parallel, tp2.microbatches) == (2, 4, 1, True, 1)
    assert notes == []  # a Megatron layout is its own nearest layout
    pp2, _ = nearest_layout(plans["pp2"])
    assert (pp2.tp, pp2.dp, pp2.pp, pp2.microbatches, pp2.micro_batch_size) == (2, 2, 2, 4, 2)
    assert (pp2.schedule, pp2.virtual, pp2.recompute, pp2.sequence_parallel) == ("1f1b", 1, "full", False)


@pytest.mark.parametrize("name", ["auto", "tp2", "pp2", "offload", "activations", "cp2"])
def test_megatron_arguments_round_trip_to_the_same_plan(plans, workload, name):
    plan = plans[name]
    ex = to_megatron(plan)
    knobs = parse_megatron_args(ex.text)
    assert knobs == ex.layout.megatron_knobs()
    # The exported layout, planned as ``autopar export`` plans it, and the parsed arguments planned.
    exported = _megatron(workload, **ex.layout.megatron_knobs())
    parsed = _megatron(workload, **knobs)
    for p in (exported, parsed):
        assert p.mesh_shape == exported.mesh_shape and p.mesh_axes == exported.mesh_axes
        assert p.recompute == exported.recompute
    got = [(p.pipeline.pp, p.pipeline.microbatches, p.pipeline.schedule, p.pipeline.virtual)
           if p.pipeline else None for p in (exported, parsed)]  # fmt: skip
    assert got[0] == got[1]
    assert parsed.predicted.step_time == pytest.approx(exported.predicted.step_time, rel=1e-9)
    if name != "auto":  # a Megatron plan exports as itself: same layout, same predicted step
        assert parsed.mesh_shape == plan.mesh_shape and parsed.recompute == plan.recompute
        assert parsed.predicted.step_time == pytest.approx(plan.predicted.step_time, rel=1e-6)
        assert weight_differences(plan, parsed) is None


def test_megatron_arguments_name_every_knob(plans):
    text = to_megatron(plans["pp2"]).text
    for flag in ("--tensor-model-parallel-size 2", "--pipeline-model-parallel-size 2", "--micro-batch-size 2",
                 "--global-batch-size 16", "--recompute-granularity full", "--recompute-method uniform",
                 "--recompute-num-layers 1", "--num-layers 4", "--seq-length 32", "--bf16",
                 "--nnodes 1 --nproc-per-node 8"):  # fmt: skip
        assert flag in text, flag
    assert "--sequence-parallel" in to_megatron(plans["tp2"]).text


def test_interleaved_and_schedules_megatron_lacks(plans, workload):
    pp2 = plans["pp2"]
    interleaved = _megatron(workload, tp=2, pp=2, microbatches=4, schedule="interleaved", virtual=2)
    ex = to_megatron(interleaved)
    assert "--num-layers-per-virtual-pipeline-stage 1" in ex.text
    assert parse_megatron_args(ex.text)["virtual"] == 2 and ex.notes == ()
    gpipe = dataclasses.replace(pp2, pipeline=dataclasses.replace(pp2.pipeline, schedule="gpipe"))
    ex = to_megatron(gpipe)
    assert ex.layout.schedule == "1f1b" and any("no gpipe schedule" in n for n in ex.notes)
    # 4 layers do not cut into 2 × 4 equal virtual stages: one stage per rank, said so.
    v4 = dataclasses.replace(
        pp2, pipeline=dataclasses.replace(pp2.pipeline, schedule="interleaved", virtual=4)
    )
    ex = to_megatron(v4)
    assert ex.layout.virtual == 1 and any("equal stages" in n for n in ex.notes)


def test_torchtitan_toml_parses_with_the_layouts_values(plans):
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    t = tomllib.loads(export(plans["pp2"], "torchtitan").text)
    par = t["parallelism"]
    assert (
        par["tensor_parallel_degree"],
        par["pipeline_parallel_degree"],
        par["data_parallel_shard_degree"],
    ) == (2, 2, 2)
    assert par["data_parallel_replicate_degree"] == 1 and par["pipeline_parallel_schedule"] == "1F1B"
    assert par["pipeline_parallel_microbatch_size"] == 2 and par["pipeline_parallel_layers_per_stage"] == 2
    assert t["training"]["local_batch_size"] // par["pipeline_parallel_microbatch_size"] == 4  # micro-batches
    assert t["training"]["global_batch_size"] == 16 and t["training"]["seq_len"] == 32
    assert t["activation_checkpoint"]["mode"] == "full"
    # Pure data parallelism without sharded state: DDP (replicate), not FSDP.
    ex = export(plans["auto"], "torchtitan")
    par = tomllib.loads(ex.text)["parallelism"]
    if ex.layout.zero_stage == 0:
        assert (par["data_parallel_replicate_degree"], par["data_parallel_shard_degree"]) == (8, 1)
    tp2 = export(plans["tp2"], "torchtitan")
    assert tp2.layout.distributed_optimizer and any("FSDP" in n for n in tp2.notes)


def test_deepspeed_json_parses_with_the_layouts_values(plans):
    ex = export(plans["pp2"], "deepspeed")
    d = json.loads(ex.text)
    assert (d["train_batch_size"], d["train_micro_batch_size_per_gpu"], d["gradient_accumulation_steps"]) == (
        16,
        2,
        4,
    )
    # DeepSpeed's check: train_batch_size = micro-batch × accumulation × data-parallel size
    assert d["train_batch_size"] == d["train_micro_batch_size_per_gpu"] * d["gradient_accumulation_steps"] * 2
    assert d["zero_optimization"]["stage"] == 0 and d["bf16"]["enabled"] and not d["fp16"]["enabled"]
    assert d["pipeline"]["stages"] == 2 and d["pipeline"]["activation_checkpoint_interval"] == 1
    assert d["tensor_parallel"]["autotp_size"] == 2
    tp2 = export(plans["tp2"], "deepspeed")
    assert not tp2.layout.sequence_parallel and any("sequence" in n for n in tp2.notes)
    d = json.loads(export(plans["auto"], "deepspeed").text)
    assert "pipeline" not in d and d["train_batch_size"] == 16


def test_parse_megatron_args_says_what_is_missing():
    assert (
        parse_megatron_args(["--tensor-model-parallel-size=4", "--global-batch-size", "8"], world_size=8)[
            "dp"
        ]
        == 2
    )
    with pytest.raises(ValueError, match="world size is not in the arguments"):
        parse_megatron_args(["--tensor-model-parallel-size", "2"])
    with pytest.raises(ValueError, match="not a multiple of --micro-batch-size"):
        parse_megatron_args(["--micro-batch-size", "3", "--global-batch-size", "16"], world_size=8)
    with pytest.raises(ValueError, match="needs --num-layers"):
        parse_megatron_args(["--num-layers-per-virtual-pipeline-stage", "2"], world_size=8)
    with pytest.raises(ValueError, match="unknown engine 'colossal'"):
        export(autopar.Plan.__new__(autopar.Plan), "colossal")


def test_the_command_prints_the_configuration_notes_and_both_steps(plans, tmp_path, capsys):
    path = tmp_path / "pp2.json"
    plans["pp2"].save(path)
    out_file = tmp_path / "ds.json"
    assert main(["export", str(path), "--to", "deepspeed", "-o", str(out_file), "-q"]) == 0
    out = capsys.readouterr().out
    assert json.loads(out_file.read_text())["gradient_accumulation_steps"] == 4
    assert f"wrote {out_file}" in out and "DeepSpeed layout: tp=2 × dp=2, pp=2" in out
    assert "predicted step: autopar's plan" in out and "the exported layout " in out and "× autopar's" in out
    assert main(["export", str(path), "--to", "megatron", "--no-predict", "-q"]) == 0
    out = capsys.readouterr().out
    assert "--pipeline-model-parallel-size 2" in out and "not planned (--no-predict)" in out
    bare = plans["tp2"]
    unrecorded = dataclasses.replace(bare, info={k: v for k, v in bare.info.items() if k != "workload"})
    unrecorded.save(tmp_path / "bare.json")
    assert main(["export", str(tmp_path / "bare.json"), "--to", "torchtitan", "-q"]) == 0
    out = capsys.readouterr().out
    assert "[parallelism]" in out and "does not record its model" in out


def test_recomputing_the_first_layers_of_each_stage_round_trips(workload):
    """``layouts.megatron(recompute_num_layers=1)`` under pp = 2 (4 layers, 2 per stage): Megatron-LM's
    block method recomputes each stage's first layer, ``blocks.0`` and ``blocks.2``; exported as
    ``--recompute-method block --recompute-num-layers 1`` and parsed back to the same plan. A plan
    recomputing the model's first layer only (``recompute_layers=1``: stage 0's) exports as 1 per
    stage, with a note; Megatron's knob needs full recomputation."""
    plan = _megatron(workload, tp=2, pp=2, microbatches=4, recompute="full", recompute_num_layers=1)
    assert plan.recompute_layers == ("blocks.0", "blocks.2")
    every = _megatron(workload, tp=2, pp=2, microbatches=4, recompute="full")
    assert plan.predicted.step_time < every.predicted.step_time
    assert max(plan.pipeline.peak_memory) > max(every.pipeline.peak_memory)
    ex = to_megatron(plan)
    assert "--recompute-method block" in ex.text and "--recompute-num-layers 1" in ex.text and not ex.notes
    knobs = parse_megatron_args(ex.text)
    assert knobs == ex.layout.megatron_knobs() and knobs["recompute_num_layers"] == 1
    parsed = _megatron(workload, **knobs)
    assert parsed.recompute_layers == plan.recompute_layers
    assert parsed.predicted.step_time == pytest.approx(plan.predicted.step_time, rel=1e-9)
    first = _megatron(workload, tp=2, pp=2, microbatches=4, recompute="full", recompute_layers=1)
    assert first.recompute_layers == ("blocks.0",)
    layout, notes = nearest_layout(first)
    assert layout.recompute_num_layers == 1 and any("1/0 layers per stage" in n for n in notes), notes
    with pytest.raises(ValueError, match="applies to full recomputation"):
        _megatron(workload, tp=2, recompute="selective", recompute_num_layers=1)
    with pytest.raises(ValueError, match="give 1 to 2"):
        _megatron(workload, tp=2, pp=2, microbatches=4, recompute="full", recompute_num_layers=3)
    with pytest.raises(ValueError, match="checkpoints groups of 2 layers"):
        parse_megatron_args(
            "--recompute-granularity full --recompute-method uniform --recompute-num-layers 2", 8
        )


def test_an_offloaded_optimizer_exports_as_each_engine_offloads_it(plans):
    plan = plans["offload"]
    assert plan.offload_optimizer
    ex = to_megatron(plan)
    assert "--optimizer-cpu-offload" in ex.text and "--use-distributed-optimizer" in ex.text
    assert parse_megatron_args(ex.text)["offload_optimizer"] is True
    with pytest.raises(ValueError, match="offloads part of the optimizer state"):
        parse_megatron_args(["--optimizer-cpu-offload", "--optimizer-offload-fraction", "0.5"], world_size=8)
    ds = json.loads(to_deepspeed(plan).text)
    assert ds["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert ds["zero_optimization"]["stage"] >= 1
    titan = to_torchtitan(plan)
    assert any("CPUOffloadPolicy" in n for n in titan.notes) and not titan.layout.offload_optimizer


def test_offloaded_activations_export_to_megatron_and_are_noted_elsewhere(plans):
    plan = plans["activations"]
    assert len(plan.offload_layers) == 2
    ex = to_megatron(plan)
    assert "--cpu-offloading-num-layers 2" in ex.text and "--cpu-offloading " in ex.text
    assert parse_megatron_args(ex.text)["offload_activations"] == 2
    for ex in (to_deepspeed(plan), to_torchtitan(plan)):
        assert any("activations of the first 2 layers" in n for n in ex.notes), ex.notes
        assert ex.layout.offload_layers == 0


def test_per_activation_recomputation_exports_as_megatron_core_modules(plans):
    """A per-activation plan (``recompute="ops"``) as Megatron-Core's ``--recompute-modules``: the
    recomputed attention and norms by module kind, the others noted (the exported run keeps them);
    parsed back, a module other than the attention core is refused with what to do."""
    base = plans["tp2"]

    def recomputing(*kinds: str) -> autopar.Plan:
        def pick(n):
            family = {"scaled_dot_product_attention": "attn", "layer_norm": "norm", "linear": "linear"}
            return family.get(n.op) in kinds and n.module.startswith("blocks.")

        nodes = [dataclasses.replace(n, recomputed=True) if pick(n) else n for n in base.nodes]
        plan = dataclasses.replace(base, nodes=nodes, recompute="ops", info=dict(base.info))
        assert any(n.recomputed for n in plan.nodes), kinds
        return plan

    ex = to_megatron(recomputing("attn", "norm", "linear"))
    assert (
        "--recompute-granularity selective" in ex.text
        and "--recompute-modules core_attn layernorm" in ex.text
    )
    assert any("no --recompute-modules entry for (linear" in n for n in ex.notes), ex.notes
    with pytest.raises(ValueError, match=r"--recompute-modules core_attn layernorm: .*recompute='ops'"):
        parse_megatron_args(ex.text)
    attention_only = to_megatron(recomputing("attn"))
    assert "--recompute-granularity selective" in attention_only.text
    assert "--recompute-modules" not in attention_only.text
    assert parse_megatron_args(attention_only.text)["recompute"] == "selective"
    nothing = to_megatron(recomputing("linear"))
    assert "--recompute-granularity" not in nothing.text and nothing.layout.recompute == "none"


def test_context_parallelism_exports_its_size_and_form(plans, workload):
    """A ``cp`` axis is context parallelism in every engine, not more data parallelism: Megatron-Core's
    ``--context-parallel-size`` with the plan's ``--cp-comm-type`` (per layer where layers differ),
    torchtitan's ``context_parallel_degree``, a note for DeepSpeed; forms autopar does not plan are
    refused when parsed."""
    import tomllib

    plan = plans["cp2"]
    layout, notes = nearest_layout(plan)
    assert (layout.tp, layout.cp, layout.dp, layout.cp_comm_type) == (2, 2, 2, ("allgather",)), notes
    assert "× cp=2 (allgather)" in layout.describe()
    text = to_megatron(plan).text
    assert "--context-parallel-size 2" in text and "--cp-comm-type allgather" in text
    knobs = parse_megatron_args(text)
    assert knobs["cp"] == 2 and knobs["dp"] == 2 and knobs["cp_comm_type"] == "all_gather"
    titan = tomllib.loads(to_torchtitan(plan).text)
    assert titan["parallelism"]["context_parallel_degree"] == 2
    assert any("DeepSpeed-Ulysses" in n for n in to_deepspeed(plan).notes)
    # the all-to-all form: torchtitan has none (noted), Megatron-Core's a2a
    a2a = _megatron(workload, tp=1, cp=2, cp_comm_type="a2a")
    assert "--cp-comm-type a2a" in to_megatron(a2a).text
    assert any("exported as the all-gather form" in n for n in to_torchtitan(a2a).notes)
    assert titan["parallelism"]["context_parallel_rotate_method"] == "allgather"
    # the ring: Megatron-Core's p2p, torchtitan's keys and values rotated around the ring
    ring = _megatron(workload, tp=1, cp=2, cp_comm_type="p2p")
    assert nearest_layout(ring)[0].cp_comm_type == ("p2p",)
    assert "--cp-comm-type p2p" in to_megatron(ring).text
    ring_titan = to_torchtitan(ring)
    assert tomllib.loads(ring_titan.text)["parallelism"]["context_parallel_rotate_method"] == "alltoall"
    assert not any("all-gather form" in n for n in ring_titan.notes)
    # one form per layer where the layers differ; layouts.megatron cannot hold that
    mixed = dataclasses.replace(layout, cp_comm_type=("allgather", "a2a", "allgather", "a2a"))
    with pytest.raises(ValueError, match="one context-parallel form for every layer"):
        mixed.megatron_knobs()
    base = "--nnodes 1 --nproc-per-node 8 --tensor-model-parallel-size 2 --context-parallel-size 2"
    assert parse_megatron_args(base)["cp_comm_type"] == "p2p"  # Megatron-Core's default: the ring
    with pytest.raises(ValueError, match=r"not a2a\+p2p"):
        parse_megatron_args(base + " --cp-comm-type a2a+p2p")
    with pytest.raises(ValueError, match="holds one form for every layer"):
        parse_megatron_args(base + " --cp-comm-type a2a allgather")
    with pytest.raises(ValueError, match=r"tp\(2\) × pp\(1\) × cp\(3\) = 6 does not divide the world size 8"):
        parse_megatron_args(
            "--nnodes 1 --nproc-per-node 8 --tensor-model-parallel-size 2 --context-parallel-size 3"
        )

"""The ``autopar`` command (``autopar.cli``, ``autopar.commands``): every subcommand's ``--help`` with examples, each
command run on a tiny model, one-line errors with a non-zero exit (a traceback only under
``--debug``), and progress that stays quiet when stderr is not a terminal."""

from __future__ import annotations

import io
import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

import autopar
from autopar.cli import build_parser, main
from autopar.commands.console import ProgressBar
from autopar.mesh_pool import Progress

COMMANDS = (
    "plan",
    "show",
    "compare",
    "export",
    "simulate",
    "memory",
    "calibrate",
    "report",
    "train",
    "models",
)
TINY = ["gpt-tiny", "--gpus-per-node", "4", "--batch", "8", "--seq", "32"]


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def tiny_plan(tmp_path_factory) -> Path:
    """``autopar plan gpt-tiny`` on 4 devices, mesh 2 × 2, saved."""
    path = tmp_path_factory.mktemp("cli") / "plan.json"
    assert main([*["plan", *TINY], "--mesh", "2x2", "--quiet", "-o", str(path)]) == 0
    return path


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_help_with_examples(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([command, "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: autopar {command}")
    assert "examples:" in out and f"autopar {command}" in out.split("examples:")[1]


def test_the_top_level_help_lists_every_command(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for command in COMMANDS:
        assert f"    {command} " in out, command
    assert main([]) == 2  # no command: the help, and a usage status


def test_python_dash_m_autopar_runs_the_command():
    run_ = subprocess.run(
        [sys.executable, "-m", "autopar", "models"], capture_output=True, text=True, timeout=120
    )
    assert run_.returncode == 0, run_.stderr
    assert "llama3-8b" in run_.stdout and "H100-SXM" in run_.stdout


def test_plan_prints_the_plan_and_writes_file_and_pictures(tmp_path, capsys):
    out_file, figs = tmp_path / "p.json", tmp_path / "figs"
    code, out, err = run(capsys, "plan", *TINY, "--mesh", "4", "-o", str(out_file), "--figures", str(figs))
    assert code == 0, err
    assert "model: a 2-layer, 64-wide GPT" in out and "Plan on mesh" in out and "legend:" in out
    assert f"wrote {out_file}" in out
    plan = autopar.Plan.load(out_file)
    assert plan.mesh_shape == (4,)
    assert plan.info["workload"] == {"model": "gpt-tiny", "batch": 8, "seq": 32, "dtype": "bfloat16",
                                     "layers": None, "overrides": {}}  # fmt: skip
    for name in ("time_per_layer.png", "memory_per_layer.png"):
        assert (figs / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    assert err == ""  # stderr is not a terminal here: no progress


def test_plan_on_several_node_counts_exports_the_model_once(tmp_path, capsys, monkeypatch):
    """``--nodes 1,2``: one plan per cluster, each written to its own file, and a table comparing
    them; the model is exported once for both (the micro-batch graphs are shared), and a batch
    must be given (the default differs per cluster)."""
    exports: list[str] = []
    for name, kind in (("autopar.capture", "whole"), ("autopar.microbatch", "symbolic")):
        module = sys.modules[name]  # autopar.capture is also the function
        real = module.export_program

        def counted(*args, _real=real, _kind=kind, **kwargs):
            exports.append(_kind)
            return _real(*args, **kwargs)

        monkeypatch.setattr(module, "export_program", counted)
    out_file = tmp_path / "p.json"
    argv = ["plan", "gpt-tiny", "--gpus-per-node", "2", "--batch", "8", "--seq", "32", "--nodes", "1,2"]
    code, out, err = run(capsys, *argv, "-o", str(out_file))
    assert code == 0, err
    assert "=== 1 node(s): 2 devices ===" in out and "=== 2 node(s): 4 devices ===" in out
    table = out.split("the workload on each cluster (predicted):")[1].splitlines()
    assert table[1].split()[:2] == ["nodes", "devices"] and "tokens/s" in table[1]
    assert [r.split()[:2] for r in table[2:4]] == [["1", "2"], ["2", "4"]]
    for n, devices in ((1, 2), (2, 4)):
        plan = autopar.Plan.load(tmp_path / f"p-{n}nodes.json")
        assert plan.world_size == devices
    assert exports.count("whole") == 1 and exports.count("symbolic") <= 1, exports
    code, _, err = run(capsys, "plan", "gpt-tiny", "--nodes", "1,2")
    assert code == 1 and "give its --batch" in err


def test_show_prints_summary_full_table_nodes_and_svg(tiny_plan, tmp_path, capsys):
    code, out, _ = run(capsys, "show", str(tiny_plan))
    assert code == 0 and out.startswith("Plan on mesh") and "blocks.0–1" in out
    code, full, _ = run(capsys, "show", str(tiny_plan), "--full")
    assert code == 0 and "blocks.0.attn.qkv" in full and "blocks.1.fc" in full
    code, nodes, _ = run(capsys, "show", str(tiny_plan), "--nodes")
    assert code == 0 and "placeholder" in nodes and "→" in nodes
    code, out, _ = run(capsys, "show", str(tiny_plan), "--figures", str(tmp_path), "--format", "svg")
    assert code == 0 and (tmp_path / "time_per_layer.svg").read_text().lstrip().startswith("<?xml")


def test_compare_with_megatron_and_with_a_plan_file(tiny_plan, tmp_path, capsys):
    other = tmp_path / "megatron.json"
    picture = tmp_path / "cmp.png"
    code, out, err = run(
        capsys, "compare", str(tiny_plan), "megatron:tp=2", "-o", str(other), "--figure", str(picture)
    )
    assert code == 0, err
    assert "megatron(tp=2, dp=2)" in out and "step time" in out and "B / A" in out
    assert "per layer (compute + comm)" in out and "blocks.* ×2" in out
    assert "predicted" in out.splitlines()[-3] or "faster" in out or "equally fast" in out
    assert picture.read_bytes()[:4] == b"\x89PNG"
    code, out, _ = run(capsys, "compare", str(tiny_plan), str(other))
    assert code == 0 and "megatron(tp=2, dp=2)" in out
    code, _, err = run(capsys, "compare", str(tiny_plan), "megatron:tq=2")
    assert code == 1 and "unknown knob 'tq'; knobs: tp, dp" in err
    # Recomputation is one of Megatron's knobs too (README: ``megatron:tp=8,recompute=full``).
    code, out, err = run(capsys, "compare", str(tiny_plan), "megatron:tp=2,recompute=full")
    assert code == 0, err
    assert "recompute=full" in out


def test_compare_names_a_workload_cut_into_other_micro_batches(tiny_plan, capsys):
    """Beside a pipelined layout (its own micro-batch graph), the plan is of the same workload:
    the note says so rather than calling them different programs."""
    code, out, err = run(capsys, "compare", str(tiny_plan), "megatron:tp=1,pp=2,microbatches=2")
    assert code == 0, err
    assert "the same workload into different micro-batches" in out and "different programs" not in out


def test_compare_with_best_megatron(tiny_plan, capsys):
    code, out, err = run(capsys, "compare", str(tiny_plan), "best-megatron")
    if hasattr(autopar.layouts, "best_megatron"):
        assert code == 0, err
        assert "step time" in out
    else:  # until the 3D search lands it: one line saying so
        assert code == 1 and "best-megatron is not in this version" in err and "megatron:tp=N" in err


def test_memory_breaks_down_state_and_activations(capsys, tmp_path):
    picture = tmp_path / "mem.png"
    code, out, err = run(capsys, "memory", *TINY, "--dtype", "bf16", "--figure", str(picture))
    assert code == 0, err
    assert "training state per device" in out and "activations per device" in out
    assert "ZeRO-1" in out and "4 + 12/4" in out and "2 + 14/4" in out and "16/4" in out
    assert "selective" in out and "full" in out and "✓" in out
    assert picture.read_bytes()[:4] == b"\x89PNG"
    code, _, err = run(capsys, "memory", *TINY, "--tp", "3")
    assert code == 1 and "dp(1) × tp(3) × pp(1) = 3 ≠ 4 devices" in err


def test_memory_of_llama3_8b_on_8_h100_follows_the_zero_arithmetic(capsys):
    """bf16 weights, fp32 master weights and AdamW moments: 16 B/param with plain data
    parallelism, 4 + 12/N with ZeRO-1, 2 + 14/N with ZeRO-2, 16/N with ZeRO-3 (N = 8)."""
    code, out, err = run(
        capsys, "memory", "llama3-8b", "--batch", "8", "--seq", "8192", "--recompute", "none"
    )
    assert code == 0, err
    assert "8.03B parameters" in out
    rows = [line for line in out.splitlines() if line.startswith(("  no ZeRO", "  ZeRO-"))][:4]
    assert rows[0].rstrip().endswith(" 16") and "119.66 GiB" in rows[0]  # 16 × 8.03e9 bytes
    assert rows[1].rstrip().endswith("5.5 = 4 + 12/8")
    assert rows[2].rstrip().endswith("3.75 = 2 + 14/8")
    assert rows[3].rstrip().endswith("2 = 16/8") and "14.96 GiB" in rows[3]
    # bf16 moments, fp32 master kept (K = 8): the published 12 / 5 / 3.25 / 1.5 bytes per parameter.
    code, out, err = run(capsys, "memory", "llama3-8b", "--batch", "8", "--seq", "8192", "--recompute", "none",
                         "--optimizer-state-dtype", "bf16")  # fmt: skip
    assert code == 0, err
    rows = [line for line in out.splitlines() if line.startswith(("  no ZeRO", "  ZeRO-"))][:4]
    assert [r.split()[-1] if "=" not in r else r.split("  ")[-1].strip() for r in rows] == [
        "12",
        "5 = 4 + 8/8",
        "3.25 = 2 + 10/8",
        "1.5 = 12/8",
    ], rows


def test_errors_are_one_line_with_a_nonzero_status(capsys, tmp_path):
    cases = {
        ("plan", "llama3"): "unknown model 'llama3' (did you mean llama3-8b, llama3-70b?)",
        ("plan", "gpt2", "--seq", "4096"): "gpt2 supports sequences of at most 1024 tokens",
        ("plan", "gpt-tiny", "--cluster", "B200"): "unknown cluster preset 'B200'",
        ("plan", "gpt-tiny", "--mesh", "3x3"): "mesh_shape 3 × 3 = 9 ≠ world size 8",
        ("show", str(tmp_path / "none.json")): "none.json: no such plan file",
        ("report", str(tmp_path / "none.json"), "-o", str(tmp_path / "r.html")): "no such plan file",
        ("train", "gpt-tiny"): "train needs --local N",
    }
    for argv, message in cases.items():
        code, out, err = run(capsys, *argv)
        assert code == 1, (argv, out, err)
        assert message in err, (argv, err)
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, (argv, err)
        assert err.startswith(f"autopar {argv[0]}: error: "), err
    # usage errors: status 2, one line naming the command's --help
    for argv in (["plan", "gpt2", "--batch", "0"], ["memory"], ["plan", "gpt2", "--mesh", "8y"]):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and len(err.strip().splitlines()) == 1, err
        assert f"(see autopar {argv[0]} --help)" in err


def test_debug_shows_the_traceback(capsys):
    with pytest.raises(ValueError, match="unknown model"):
        main(["plan", "nosuchmodel", "--debug"])
    run_ = subprocess.run([sys.executable, "-m", "autopar", "--debug", "show", "/nonexistent.json"],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert run_.returncode == 1 and "Traceback (most recent call last)" in run_.stderr


def test_a_truncated_plan_file_is_one_line(tiny_plan, tmp_path, capsys):
    cut = tmp_path / "cut.json"
    cut.write_text(tiny_plan.read_text()[:500])
    code, _, err = run(capsys, "show", str(cut))
    assert code == 1 and "cut.json: not a complete plan file" in err and len(err.splitlines()) == 1
    edited = tmp_path / "edited.json"
    d = json.loads(tiny_plan.read_text())
    d["mesh_axes"] = ["dp", "tp"]
    edited.write_text(json.dumps(d))
    code, _, err = run(capsys, "show", str(edited))
    assert code == 1 and "edited after autopar wrote it" in err and "--no-verify" in err
    code, out, _ = run(capsys, "show", str(edited), "--no-verify")
    assert code == 0 and "dp=2 × tp=2" in out


def test_progress_bar_names_the_mesh_being_solved_and_counts(monkeypatch):
    stream = io.StringIO()
    monkeypatch.setattr(sys, "stderr", stream)
    bar = ProgressBar(enabled=True)
    log = logging.getLogger("test.progress")

    def emit(task: str, started: bool, done: int) -> None:
        bar.handle(
            log.makeRecord(
                "x", logging.INFO, "f", 1, "m", (), None, extra={"progress": Progress(task, started, done, 2)}
            )
        )

    emit("mesh (4,)", True, 0)
    emit("mesh (2, 2)", True, 0)
    emit("mesh (4,)", False, 1)
    text = stream.getvalue()
    assert "planning" in text and "1/2" in text and "solving mesh (2, 2)" in text
    bar.close_bar()
    quiet = ProgressBar(enabled=False)
    quiet.handle(
        log.makeRecord(
            "x", logging.INFO, "f", 1, "m", (), None, extra={"progress": Progress("m", True, 0, 1)}
        )
    )
    assert quiet.bar is None


def test_parser_options_reach_the_plan_config():
    from autopar.commands.loading import plan_config

    args = build_parser().parse_args(
        ["plan", "gpt2", "--mesh", "2x4", "--memory-budget", "60GiB", "--memory-reserve", "5%", "--zero-stage", "3",
         "--fixed", "lm_head.weight=S(0),R", "--time-limit", "5"]
    )  # fmt: skip
    config = plan_config(args)
    assert (
        config.mesh_shape == (2, 4) and config.memory_budget == 60 * 2**30 and config.memory_reserve == 0.05
    )
    assert (
        config.zero_stage == 3
        and config.fixed == {"lm_head.weight": ("S(0)", "R")}
        and config.time_limit == 5
    )
    assert not config.allow_compression and config.compression is None


def test_network_racks_and_compression_options_reach_the_cluster_and_the_config():
    from autopar.commands.loading import build_cluster, plan_config

    args = build_parser().parse_args(
        ["plan", "gpt2", "--nodes", "4", "--network", "ethernet-400g", "--nodes-per-rack", "2",
         "--spine-oversubscription", "3", "--allow-compression", "--compression", "bf16"]
    )  # fmt: skip
    assert args.nodes == [4]
    args.nodes = 4  # one of the counts, as ``autopar plan`` builds each cluster
    cluster, config = build_cluster(args), plan_config(args)
    assert cluster.nics == 1 and cluster.inter_node.name == "Ethernet-400G"
    assert cluster.nodes_per_rack == 2 and cluster.spine_oversubscription == 3
    assert config.allow_compression and config.compression == "bf16"


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_train_calibrate_and_a_report_with_measurement(tiny_plan, tmp_path, capfd):
    capsys = capfd  # the ranks print from their own processes
    record, saved = tmp_path / "run.json", tmp_path / "used.json"
    code, out, err = run(capsys, "train", "gpt-tiny", "--local", "2", "--steps", "2", "--batch", "4", "--seq", "32",
                         "--record", str(record), "--save-plan", str(saved))  # fmt: skip
    assert code == 0, err
    assert "step 1: loss" in out and f"wrote {record}" in out
    run_ = json.loads(record.read_text())
    assert run_["world"] == 2 and len(run_["losses"]) == 2 and run_["median_step_time"] > 0
    # a plan for 4 processes run on 2: one line, for every rank, before any collective
    code, _, err = run(
        capsys, "train", "gpt-tiny", "--local", "2", "--plan", str(tiny_plan), "--batch", "8", "--seq", "32"
    )
    assert code == 1 and len(err.strip().splitlines()) == 1, err
    assert "every rank: plan mesh 2 × 2 = 4 ≠ world size 2: run it on 4 processes, or plan again for 2" in err
    profile = tmp_path / "local2.json"
    code, out, err = run(capsys, "calibrate", "--local", "2", "-o", str(profile))
    assert code == 0, err
    assert "all_reduce over 2: α =" in out and "GFLOP/s per process" in out
    code, out, err = run(
        capsys, "plan", "gpt-tiny", "--cluster", str(profile), "--batch", "4", "--seq", "32", "--quiet"
    )
    assert code == 0 and "2 local processes" in out, err
    html = tmp_path / "r.html"
    code, out, err = run(capsys, "report", str(saved), "-o", str(html), "--measured", str(record))
    assert code == 0, err
    text = html.read_text()
    assert "Prediction and measurement" in text and "step time (median)" in text

"""``autopar plan path/to/config.json``: a model built from a transformers configuration file on
the meta device, never downloaded (``autopar.zoo``). Tiny configurations of five architectures
(LLaMA, Qwen2, Mixtral, T5, ViT) are written with transformers' own ``save_pretrained`` and
planned from the command line; a configuration naming an architecture or model type transformers
lacks fails with one line naming it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import autopar
from autopar import zoo
from autopar.cli import main

transformers = pytest.importorskip("transformers")

_DECODER = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                vocab_size=256, max_position_embeddings=128, num_hidden_layers=2)  # fmt: skip

CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**_DECODER, architectures=["LlamaForCausalLM"]),
    "qwen2": lambda: transformers.Qwen2Config(**_DECODER, architectures=["Qwen2ForCausalLM"]),
    "mixtral": lambda: transformers.MixtralConfig(
        **_DECODER, num_local_experts=4, num_experts_per_tok=2, architectures=["MixtralForCausalLM"]
    ),
    # T5's published configurations carry the decoder's start and pad tokens; its loss needs them.
    "t5": lambda: transformers.T5Config(
        d_model=64,
        d_kv=16,
        d_ff=128,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        vocab_size=256,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
        architectures=["T5ForConditionalGeneration"],
    ),
    "vit": lambda: transformers.ViTConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        image_size=32,
        patch_size=8,
        num_labels=10,
        architectures=["ViTForImageClassification"],
    ),
}
CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mixtral": "MixtralForCausalLM",
           "t5": "T5ForConditionalGeneration", "vit": "ViTForImageClassification"}  # fmt: skip


def write_config(directory: Path, name: str) -> Path:
    CONFIGS[name]().save_pretrained(directory)
    return directory / "config.json"


@pytest.mark.parametrize("name", list(CONFIGS))
def test_plan_a_config_file_of_each_architecture(name, tmp_path, capsys):
    config = write_config(tmp_path / name, name)
    out_file = tmp_path / f"{name}.plan.json"
    # --seq is the image side for ViT (its configuration's image_size).
    argv = ["plan", str(config), "--gpus-per-node", "4", "--batch", "8", "--seq", "32", "--mesh", "4", "-q"]
    code = main([*argv, "-o", str(out_file)])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert f"model: {CLASSES[name]} from {config}" in out and f"wrote {out_file}" in out
    plan = autopar.Plan.load(out_file)
    assert plan.world_size == 4 and plan.predicted.step_time > 0
    assert plan.info["workload"]["model"] == str(config)  # compare and export can rebuild it


def test_layers_sets_every_depth_field_of_a_config_file(tmp_path):
    config = write_config(tmp_path, "t5")
    w = zoo.load(str(config), batch=2, seq=16, layers=3)
    assert (w.model.config.num_layers, w.model.config.num_decoder_layers) == (3, 3)


def _edited(tmp_path: Path, **fields) -> Path:
    config = write_config(tmp_path, "llama")
    d = json.loads(config.read_text())
    d.update(fields)
    config.write_text(json.dumps(d))
    return config


def test_an_architecture_transformers_lacks_is_one_line_naming_it(tmp_path, capsys):
    config = _edited(tmp_path, architectures=["NoSuchLlamaForCausalLM"])
    assert main(["plan", str(config), "--gpus-per-node", "4", "--batch", "8", "--seq", "32", "-q"]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert "has no architecture 'NoSuchLlamaForCausalLM'" in err and "upgrade transformers" in err


def test_a_model_type_transformers_lacks_is_one_line_naming_it(tmp_path, capsys):
    config = _edited(tmp_path, model_type="nosuchmodel", architectures=["NoSuchModelForCausalLM"])
    assert main(["plan", str(config), "--gpus-per-node", "4", "--batch", "8", "--seq", "32", "-q"]) == 1
    _, err = capsys.readouterr()
    assert err.count("\n") == 1
    assert "has no model_type 'nosuchmodel' (architecture NoSuchModelForCausalLM)" in err

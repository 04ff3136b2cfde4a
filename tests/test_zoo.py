"""The model zoo (``autopar.zoo``): published configurations built on the meta device with no
download, their parameter counts, an example batch that makes each return its loss, config files,
``module:factory``, and the messages for what cannot be built."""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch

import autopar
from autopar import zoo

PUBLISHED = {  # parameters, as the papers and model cards give them
    "gpt2": 124e6,
    "gpt2-xl": 1.56e9,
    "gpt3-175b": 175e9,
    "llama3-8b": 8.03e9,
    "llama3-70b": 70.6e9,
    "mixtral-8x7b": 46.7e9,
    "t5-base": 223e6,
    "vit-base": 86.6e6,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_builtin_models_have_their_published_size(name):
    w = zoo.load(name, batch=2)
    assert w.num_params == pytest.approx(PUBLISHED[name], rel=0.01)
    assert all(p.device.type == "meta" for p in w.model.parameters())
    assert all(p.dtype == torch.bfloat16 for p in w.model.parameters())
    assert w.info["model"] == name and w.info["batch"] == 2 and w.seq == w.info["seq"]


@pytest.mark.parametrize("name", ["gpt2", "llama3-8b", "mixtral-8x7b", "t5-base", "vit-base"])
def test_each_kind_captures_with_its_example_batch_and_returns_a_loss(name):
    w = zoo.load(name, batch=2, seq=None if name == "vit-base" else 16, layers=1, dtype="fp32")
    cap = autopar.capture(w.model, w.example_inputs)
    out_names = getattr(cap.out_spec, "context", None) or []
    assert "loss" in out_names or cap.out_spec.num_leaves == 1, cap.out_spec


def test_layers_and_overrides_change_the_configuration():
    w = zoo.load(
        "llama3-8b", batch=1, seq=32, layers=2, overrides={"hidden_size": 256, "intermediate_size": 512}
    )
    assert w.model.config.num_hidden_layers == 2 and w.model.config.hidden_size == 256
    assert w.info["layers"] == 2 and w.info["overrides"] == {"hidden_size": 256, "intermediate_size": 512}
    with pytest.raises(zoo.ZooError, match=r"no field\(s\) \['hiden_size'\]"):
        zoo.load("llama3-8b", batch=1, overrides={"hiden_size": 1})
    with pytest.raises(zoo.ZooError, match=r"unknown configuration field\(s\) \['n_embed'\]"):
        zoo.load("gpt2", batch=1, overrides={"n_embed": 1})


def test_cpu_models_get_real_weights_and_token_ids():
    w = zoo.load("gpt-tiny", batch=4, dtype="fp32", device="cpu")
    loss = w.model(*w.example_inputs)
    assert loss.dim() == 0 and torch.isfinite(loss)
    again = zoo.load("gpt-tiny", batch=4, dtype="fp32", device="cpu")
    assert torch.equal(w.example_inputs[0], again.example_inputs[0])  # seeded


def test_a_sequence_longer_than_the_model_supports_is_refused():
    with pytest.raises(
        zoo.ZooError, match=r"gpt2 supports sequences of at most 1024 tokens \(block_size=1024\); got 2048"
    ):
        zoo.load("gpt2", batch=1, seq=2048)
    with pytest.raises(zoo.ZooError, match=r"--set max_position_embeddings=16384"):
        zoo.load("llama3-8b", batch=1, seq=16384)
    w = zoo.load("llama3-8b", batch=1, seq=16384, layers=1, overrides={"max_position_embeddings": 16384})
    assert w.seq == 16384


def test_unknown_names_and_bad_arguments_say_what_works():
    with pytest.raises(zoo.ZooError, match=r"unknown model 'llama3'.*did you mean llama3-8b, llama3-70b"):
        zoo.load("llama3", batch=1)
    with pytest.raises(zoo.ZooError, match="batch must be a positive number"):
        zoo.load("gpt2", batch=0)
    with pytest.raises(zoo.ZooError, match="unknown dtype 'bf32'; use one of bf16, fp16, fp32"):
        zoo.load("gpt2", batch=1, dtype="bf32")


def test_missing_transformers_gives_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers now fails
    with pytest.raises(
        zoo.ZooError, match=r"llama3-8b is built with transformers, which is not installed: pip install"
    ):
        zoo.load("llama3-8b", batch=1)
    assert zoo.load("gpt2", batch=1).num_params > 0  # autopar's own models need nothing more


def test_a_transformers_config_file(tmp_path):
    from transformers import LlamaConfig

    LlamaConfig(num_hidden_layers=3, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=128, vocab_size=256, max_position_embeddings=128).save_pretrained(tmp_path)  # fmt: skip
    w = zoo.load(str(tmp_path / "config.json"), batch=2, seq=32, layers=2)
    assert type(w.model).__name__ == "LlamaForCausalLM" and w.model.config.num_hidden_layers == 2
    assert w.example_inputs["input_ids"].shape == (2, 32) and w.kind == "causal-lm"
    assert zoo.load(str(tmp_path), batch=1).seq == 128  # the directory works too; seq defaults to the limit
    with pytest.raises(zoo.ZooError, match="at most 128 tokens"):
        zoo.load(str(tmp_path), batch=1, seq=256)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(zoo.ZooError, match=r"bad.json: not a transformers model configuration"):
        zoo.load(str(bad), batch=1)


def test_module_factory_from_a_file_and_a_module(tmp_path, monkeypatch):
    (tmp_path / "mymodels.py").write_text(
        textwrap.dedent(
            """
            import torch
            from autopar.models import MLP

            def regression(batch, device):
                model = MLP((8, 16, 4)).to(device)
                return model, (torch.zeros(batch, 8, device=device), torch.zeros(batch, 4, device=device))

            def not_a_model():
                return 3
            """
        )
    )
    w = zoo.load(f"{tmp_path / 'mymodels.py'}:regression", batch=5)
    assert w.example_inputs[0].shape == (5, 8) and w.kind == "custom"
    monkeypatch.syspath_prepend(str(tmp_path))
    assert zoo.load("mymodels:regression", batch=3).example_inputs[1].shape == (3, 4)
    with pytest.raises(zoo.ZooError, match="returned int; a factory returns a model or"):
        zoo.load("mymodels:not_a_model", batch=1)
    with pytest.raises(zoo.ZooError, match="has no callable 'missing'"):
        zoo.load("mymodels:missing", batch=1)
    with pytest.raises(zoo.ZooError, match="cannot import 'nosuchmodule'"):
        zoo.load("nosuchmodule:f", batch=1)

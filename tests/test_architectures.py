"""Beyond GPT-2 and LLaMA: other transformers architectures (MoE, encoder-only, encoder-decoder,
vision) and a CNN are captured, planned with every parameter placed, and — for one of each kind —
trained on 2 gloo processes under the auto plan and the Megatron layout with one-process losses.

Everything here goes through the general op rules; nothing is special-cased per model.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from _runtime_helpers import make_optimizer, train
from torch import nn

import autopar
from autopar.runtime.launch import spawn

V = 64


def _lm(cfg_name: str, model_name: str, **kw: object) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    import transformers

    model = getattr(transformers, model_name)(getattr(transformers, cfg_name)(**kw))
    ids = torch.randint(0, V, (4, 16))
    return model, {"input_ids": ids, "labels": ids.clone()}


class _CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.Conv2d(8, 8, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(8, 10),
        )

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.net(x), y)


def build(name: str) -> tuple[nn.Module, object]:
    """A tiny model of architecture ``name`` (random weights, dropout 0) and one batch."""
    torch.manual_seed(0)
    small = dict(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=64, vocab_size=V
    )
    if name == "mistral":
        return _lm("MistralConfig", "MistralForCausalLM", num_key_value_heads=2, use_cache=False, **small)
    if name == "qwen2":
        return _lm("Qwen2Config", "Qwen2ForCausalLM", num_key_value_heads=2, use_cache=False, **small)
    if name == "gpt_neox":
        return _lm("GPTNeoXConfig", "GPTNeoXForCausalLM", use_cache=False, **small)
    if name == "opt":
        return _lm(
            "OPTConfig", "OPTForCausalLM", num_hidden_layers=2, hidden_size=32, num_attention_heads=4, ffn_dim=64,
            vocab_size=V, word_embed_proj_dim=32, max_position_embeddings=32, use_cache=False, dropout=0.0,
        )  # fmt: skip
    if name == "mixtral":
        return _lm(
            "MixtralConfig", "MixtralForCausalLM", num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
            use_cache=False, **small,
        )  # fmt: skip
    if name == "bert":
        return _lm(
            "BertConfig", "BertForMaskedLM", max_position_embeddings=32, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0, **small,
        )  # fmt: skip
    if name == "t5":
        import transformers

        cfg = transformers.T5Config(
            num_layers=2, num_decoder_layers=2, d_model=32, num_heads=4, d_kv=8, d_ff=64, vocab_size=V,
            dropout_rate=0.0, use_cache=False, decoder_start_token_id=0, pad_token_id=0,
        )  # fmt: skip
        model = transformers.T5ForConditionalGeneration(cfg)
        return model, {"input_ids": torch.randint(0, V, (4, 16)), "labels": torch.randint(0, V, (4, 8))}
    if name == "vit":
        import transformers

        cfg = transformers.ViTConfig(
            num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=64, image_size=32,
            patch_size=8, num_labels=10, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        )  # fmt: skip
        model = transformers.ViTForImageClassification(cfg)
        return model, {"pixel_values": torch.randn(4, 3, 32, 32), "labels": torch.randint(0, 10, (4,))}
    if name == "cnn":
        return _CNN(), (torch.randn(8, 3, 16, 16), torch.randint(0, 10, (8,)))
    raise ValueError(name)


def _train(model: nn.Module, batch: object, steps: int = 2) -> list[float]:
    return train(model, batch, make_optimizer("sgd", model.parameters()), steps)


ALL = ["mistral", "qwen2", "gpt_neox", "opt", "mixtral", "bert", "t5", "vit", "cnn"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ALL)
def test_plans_every_parameter(name: str) -> None:
    model, batch = build(name)
    cluster = autopar.Cluster.preset("A100-80GB", gpus_per_node=8, nodes=1)
    plan = autopar.plan(model, batch, cluster)
    placed = plan.param_placements()
    names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    assert names == set(placed), names ^ set(placed)
    assert all(len(spec) == len(plan.mesh_shape) for spec in placed.values())
    assert plan.predicted.step_time > 0 and plan.predicted.memory_per_device > 0


def _worker(rank: int, world: int, names: list[str]) -> dict[str, dict[str, list[float]]]:
    os.environ["TRANSFORMERS_VERBOSITY"] = "error"
    out: dict[str, dict[str, list[float]]] = {}
    cluster = autopar.Cluster.local(world)
    for name in names:
        out[name] = {}
        for layout in ("auto", "megatron"):
            model, batch = build(name)
            plan = autopar.layouts.megatron(model, batch, cluster, tp=world) if layout == "megatron" else None
            pm = autopar.parallelize(model, cluster, batch, plan=plan)
            out[name][layout] = _train(pm, batch)
            out[name][f"{layout} captured"] = pm.step is not None
    return out


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_train_like_one_process_beyond_gpt_and_llama() -> None:
    """MoE (Mixtral), encoder-decoder (T5), vision (ViT) and a CNN train on 2 processes under the
    auto plan and the Megatron layout with the losses of one process (SGD: exact gradients)."""
    names = ["mixtral", "t5", "vit", "cnn"]
    results = spawn(_worker, 2, names, timeout=540)[0]
    # Every one of these models runs its whole step (forward and backward) as one captured program;
    # none falls back to the forward program under autograd.
    fallbacks = [
        (n, key) for n in names for key, v in results[n].items() if key.endswith("captured") and not v
    ]
    assert not fallbacks, f"whole-step capture fell back for {fallbacks}"
    for name in names:
        model, batch = build(name)
        reference = _train(model, batch)
        for layout, losses in results[name].items():
            if layout.endswith("captured"):
                continue
            rel = max(abs(a - b) / abs(b) for a, b in zip(losses, reference))
            assert rel <= 1e-5, (name, layout, losses, reference)

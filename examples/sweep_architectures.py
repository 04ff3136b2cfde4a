"""Plan tiny models of many architectures as a new user would, and say what each plan found:
``transformers`` causal LMs (dense, mixture-of-experts, hybrid state-space), encoder-only and
encoder-decoder models, vision and audio models, each built from a small config with random
weights (no download, defaults left as they are, ``use_cache`` included), planned by
``autopar.plan`` on four local processes (``Cluster.local(4)``). One line per architecture: the
mesh, the predicted step and the planning time, then every autopar warning the plan raised (ops
without a sharding rule, the audit's findings); or the error that stopped it.

    python examples/sweep_architectures.py            # every architecture (a few minutes)
    python examples/sweep_architectures.py swin bart  # some

An architecture this ``transformers`` lacks is skipped with a line saying so. A clean sweep is
every line ``ok`` with no warning under it; ``--fail`` exits 1 otherwise.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

V = 128
SMALL = {
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "intermediate_size": 128,
    "vocab_size": V,
}


def _lm(config: str, model: str, **kw: Any) -> tuple[torch.nn.Module, dict]:
    import transformers

    m = getattr(transformers, model)(getattr(transformers, config)(**kw))
    ids = torch.randint(0, V, (4, 16))
    return m, {"input_ids": ids, "labels": ids.clone()}


def _hf(model: str, config: str, inputs: Callable[[], dict], **kw: Any) -> tuple[torch.nn.Module, dict]:
    import transformers

    return getattr(transformers, model)(getattr(transformers, config)(**kw)), inputs()


def _images(labels: int = 10) -> Callable[[], dict]:
    return lambda: {"pixel_values": torch.randn(4, 3, 32, 32), "labels": torch.randint(0, labels, (4,))}


LM = {  # (config, model, extra config fields)
    "llama": ("LlamaConfig", "LlamaForCausalLM", {"num_key_value_heads": 2}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"num_key_value_heads": 2, "head_dim": 16}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"num_key_value_heads": 2, "head_dim": 16}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"num_key_value_heads": 2, "head_dim": 16}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {"num_key_value_heads": 2, "head_dim": 16, "num_experts": 4,
                  "num_experts_per_tok": 2, "moe_intermediate_size": 32}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"num_key_value_heads": 2, "pad_token_id": 0}),
    "phimoe": ("PhimoeConfig", "PhimoeForCausalLM", {"num_key_value_heads": 2, "num_local_experts": 4,
               "num_experts_per_tok": 2}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {"num_key_value_heads": 2}),
    "stablelm": ("StableLmConfig", "StableLmForCausalLM", {"num_key_value_heads": 2}),
    "cohere": ("CohereConfig", "CohereForCausalLM", {"num_key_value_heads": 2}),
    "granite": ("GraniteConfig", "GraniteForCausalLM", {"num_key_value_heads": 2}),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", {"num_key_value_heads": 2}),
    "glm4": ("Glm4Config", "Glm4ForCausalLM", {"num_key_value_heads": 2, "head_dim": 16, "pad_token_id": 0}),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", {"num_key_value_heads": 2, "pad_token_id": 0}),
    "ernie4_5": ("Ernie4_5Config", "Ernie4_5ForCausalLM", {"num_key_value_heads": 2, "head_dim": 16}),
    "jamba": ("JambaConfig", "JambaForCausalLM", {"num_key_value_heads": 2, "num_experts": 4, "num_experts_per_tok": 2,
              "attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 1,
              "mamba_d_state": 8, "mamba_d_conv": 4, "mamba_expand": 2}),
    "falcon_h1": ("FalconH1Config", "FalconH1ForCausalLM", {"num_key_value_heads": 2, "head_dim": 16,
                  "mamba_d_ssm": 64, "mamba_n_heads": 4, "mamba_d_head": 16, "mamba_n_groups": 1, "mamba_d_state": 8}),
}  # fmt: skip

OTHER: dict[str, Callable[[], tuple[torch.nn.Module, Any]]] = {
    "gpt2": lambda: _lm("GPT2Config", "GPT2LMHeadModel", n_layer=2, n_embd=64, n_head=4, vocab_size=V),
    "gptj": lambda: _lm("GPTJConfig", "GPTJForCausalLM", n_layer=2, n_embd=64, n_head=4, rotary_dim=8, vocab_size=V),
    "bloom": lambda: _lm("BloomConfig", "BloomForCausalLM", n_layer=2, hidden_size=64, n_head=4, vocab_size=V),
    "gpt_bigcode": lambda: _lm("GPTBigCodeConfig", "GPTBigCodeForCausalLM", n_layer=2, n_embd=64, n_head=4, vocab_size=V),
    "t5": lambda: _lm("T5Config", "T5ForConditionalGeneration", vocab_size=V, d_model=64, d_kv=16, d_ff=128,
                      num_layers=2, num_heads=4, decoder_start_token_id=0),
    "mt5": lambda: _lm("MT5Config", "MT5ForConditionalGeneration", vocab_size=V, d_model=64, d_kv=16, d_ff=128,
                       num_layers=2, num_heads=4, decoder_start_token_id=0),
    "whisper": lambda: _hf("WhisperForConditionalGeneration", "WhisperConfig",
                           lambda: {"input_features": torch.randn(4, 16, 32), "labels": torch.randint(0, V, (4, 8))},
                           vocab_size=V, num_mel_bins=16, encoder_layers=2, decoder_layers=2, d_model=64,
                           encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
                           decoder_ffn_dim=128, max_source_positions=16, max_target_positions=16, pad_token_id=0,
                           decoder_start_token_id=1),
    "roberta": lambda: _hf("RobertaForSequenceClassification", "RobertaConfig",
                           lambda: {"input_ids": torch.randint(3, V, (4, 16)), "labels": torch.randint(0, 2, (4,))},
                           vocab_size=V, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=128, max_position_embeddings=40),
    "distilbert": lambda: _lm("DistilBertConfig", "DistilBertForMaskedLM", vocab_size=V, dim=64, n_layers=2, n_heads=4,
                              hidden_dim=128, max_position_embeddings=32),
    "electra": lambda: _hf("ElectraForPreTraining", "ElectraConfig",
                           lambda: {"input_ids": torch.randint(0, V, (4, 16)), "labels": torch.randint(0, 2, (4, 16))},
                           vocab_size=V, embedding_size=32, hidden_size=64, num_hidden_layers=2,
                           num_attention_heads=4, intermediate_size=128, max_position_embeddings=32),
    "llama_cls": lambda: _hf("LlamaForSequenceClassification", "LlamaConfig",
                             lambda: {"input_ids": torch.randint(1, V, (4, 16)), "labels": torch.randint(0, 3, (4,))},
                             pad_token_id=0, num_labels=3, **SMALL),
    "deit": lambda: _hf("DeiTForImageClassification", "DeiTConfig", _images(), hidden_size=64, num_hidden_layers=2,
                        num_attention_heads=4, intermediate_size=128, image_size=32, patch_size=8, num_labels=10),
    "swin": lambda: _hf("SwinForImageClassification", "SwinConfig", _images(), image_size=32, patch_size=4,
                        embed_dim=16, depths=[2, 2], num_heads=[2, 4], window_size=4, num_labels=10),
    "resnet": lambda: _hf("ResNetForImageClassification", "ResNetConfig", _images(), embedding_size=16,
                          hidden_sizes=[16, 32], depths=[1, 1], num_labels=10),
    "segformer": lambda: _hf("SegformerForSemanticSegmentation", "SegformerConfig",
                             lambda: {"pixel_values": torch.randn(4, 3, 32, 32),
                                      "labels": torch.randint(0, 5, (4, 32, 32))},
                             num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[16, 32],
                             num_attention_heads=[1, 2], decoder_hidden_size=32, num_labels=5, patch_sizes=[7, 3],
                             strides=[4, 2]),
    "clip": lambda: _hf("CLIPModel", "CLIPConfig",
                        lambda: {"input_ids": torch.randint(0, V, (4, 16)), "pixel_values": torch.randn(4, 3, 32, 32),
                                 "return_loss": True},
                        text_config={"vocab_size": V, "hidden_size": 64, "intermediate_size": 128,
                                     "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 16},
                        vision_config={"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                                       "num_attention_heads": 4, "image_size": 32, "patch_size": 8}),
}  # fmt: skip


def builders() -> dict[str, Callable[[], tuple[torch.nn.Module, Any]]]:
    out: dict[str, Callable[[], tuple[torch.nn.Module, Any]]] = {
        name: (lambda c=c, m=m, kw=kw: _lm(c, m, **SMALL, **kw)) for name, (c, m, kw) in LM.items()
    }
    return out | OTHER


def main() -> int:
    import autopar

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*", help="architectures (default: all)")
    ap.add_argument("--fail", action="store_true", help="exit 1 unless every plan is clean")
    args = ap.parse_args()
    table = builders()
    unknown = sorted(set(args.names) - set(table))
    if unknown:
        ap.error(f"unknown architecture(s) {unknown}; known: {sorted(table)}")
    clean = True
    for name in args.names or list(table):
        torch.manual_seed(0)
        try:
            model, batch = table[name]()
        except AttributeError as e:
            print(f"{name:<12} skipped: this transformers lacks it ({e})")
            continue
        model.train()
        t0 = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                plan = autopar.plan(model, batch, autopar.Cluster.local(4), time_limit=20)
            except Exception as e:  # the sweep's finding: what stopped a new user
                print(f"{name:<12} FAILED {type(e).__name__}: {str(e).splitlines()[0][:300]}")
                clean = False
                continue
        mine = sorted({str(w.message).strip() for w in caught if str(w.message).startswith("autopar")})
        took = time.perf_counter() - t0
        print(
            f"{name:<12} ok  mesh {plan.mesh_shape}  step {plan.predicted.step_time * 1e3:.3f} ms  planned in {took:.1f} s"
        )
        for m in mine:
            print("    " + m.replace("\n", "\n    "))
        clean = clean and not mine
    return 1 if args.fail and not clean else 0


if __name__ == "__main__":
    sys.exit(main())

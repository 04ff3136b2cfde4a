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


class _SegNet(nn.Module):
    """A segmentation head: a strided conv, then classes per position upsampled back to the image
    (``F.interpolate``) and a per-pixel cross-entropy (logits (N, C, H, W), target (N, H, W))."""

    def __init__(self) -> None:
        super().__init__()
        self.down = nn.Conv2d(3, 8, 3, stride=2, padding=1)
        self.classes = nn.Conv2d(8, 5, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = self.classes(F.relu(self.down(x)))
        return F.cross_entropy(F.interpolate(logits, scale_factor=2, mode="bilinear"), y)


class _MultiLabel(nn.Module):
    """Multi-label classification: a logit per label and a binary cross-entropy's mean over them."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden = nn.Linear(16, 32)
        self.labels = nn.Linear(32, 6)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.binary_cross_entropy_with_logits(self.labels(F.gelu(self.hidden(x))), y)


def build(name: str) -> tuple[nn.Module, object]:
    """A tiny model of architecture ``name`` (random weights, dropout 0) and one batch."""
    torch.manual_seed(0)
    small = dict(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=64, vocab_size=V
    )
    if name == "mistral":
        return _lm("MistralConfig", "MistralForCausalLM", num_key_value_heads=2, use_cache=False, **small)
    if name == "qwen2":
        # its default config (use_cache=True): the capture turns the KV cache off
        return _lm("Qwen2Config", "Qwen2ForCausalLM", num_key_value_heads=2, **small)
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
    if name == "falcon":  # multi-query: keys and values indexed out of the fused projection (x[:, :, [i]])
        return _lm(
            "FalconConfig", "FalconForCausalLM", num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
            vocab_size=V, use_cache=False, attention_dropout=0.0, hidden_dropout=0.0,
        )  # fmt: skip
    if (
        name == "deepseek_v3"
    ):  # latent attention written into slices (copy_), group-limited routing (scatter_)
        return _lm(
            "DeepseekV3Config", "DeepseekV3ForCausalLM", num_key_value_heads=4, n_routed_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1, q_lora_rank=16,
            kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, n_group=1, topk_group=1,
            use_cache=False, **small,
        )  # fmt: skip
    if name == "gpt_oss":  # attention sinks (max over the scores and the sink), experts
        return _lm(
            "GptOssConfig", "GptOssForCausalLM", num_key_value_heads=2, head_dim=8, num_local_experts=4,
            num_experts_per_tok=2, sliding_window=8, use_cache=False, attn_implementation="eager", **small,
        )  # fmt: skip
    if name == "qwen2_moe":  # a shared expert behind a (1, hidden) gate
        return _lm(
            "Qwen2MoeConfig", "Qwen2MoeForCausalLM", num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=32, shared_expert_intermediate_size=64, use_cache=False, **small,
        )  # fmt: skip
    if name == "bart":  # the decoder's inputs shifted right: fill_ into a slice of a fresh tensor
        import transformers

        cfg = transformers.BartConfig(
            vocab_size=V, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
            dropout=0.0, attention_dropout=0.0, use_cache=False,
        )  # fmt: skip
        ids = torch.randint(3, V, (4, 16))
        return transformers.BartForConditionalGeneration(cfg), {
            "input_ids": ids,
            "labels": torch.randint(3, V, (4, 8)),
        }
    if name == "mamba2":  # state-space scans written as einsum (the path without CUDA kernels)
        return _lm(
            "Mamba2Config", "Mamba2ForCausalLM", vocab_size=V, hidden_size=32, num_hidden_layers=2, state_size=8,
            num_heads=4, head_dim=16, n_groups=1, expand=2, chunk_size=8,
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
    if name == "multilabel":
        return _MultiLabel(), (torch.randn(8, 16), (torch.rand(8, 6) > 0.5).float())
    if name == "segnet":
        return _SegNet(), (torch.randn(4, 3, 16, 16), torch.randint(0, 5, (4, 16, 16)))
    raise ValueError(name)


def _train(model: nn.Module, batch: object, steps: int = 2) -> list[float]:
    return train(model, batch, make_optimizer("sgd", model.parameters()), steps)


ALL = ["mistral", "qwen2", "gpt_neox", "opt", "mixtral", "bert", "t5", "vit", "cnn"]
NEWER = ["falcon", "deepseek_v3", "gpt_oss", "qwen2_moe", "bart", "mamba2"]
"""Architectures whose ops the sweep of 2026-11-27 found without a rule (or a rule too narrow):
advanced indexing with ``None`` (Falcon), ``copy_`` and ``scatter_`` (DeepSeek-V3), ``max`` along a
dimension (GPT-OSS), a Megatron role for a (1, hidden) gate (Qwen2-MoE), ``fill_`` through a slice
(BART) and ``einsum`` (Mamba-2)."""


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


def _plans(
    names: list[str], world: int, data_parallel: bool = False
) -> dict[str, dict[str, autopar.Plan | None]]:
    """Each model's two plans, made here once rather than on every rank: the Megatron layout, and
    the auto plan (``None``: ``parallelize`` plans on rank 0 and broadcasts; ``data_parallel``: the
    plan on a mesh of ``world`` devices, one axis). The segmentation and multi-label models' auto
    plan is the FSDP layout: the batch split, and the losses with it."""
    cluster = autopar.Cluster.local(world)
    plans: dict[str, dict[str, autopar.Plan | None]] = {}
    for name in names:
        model, batch = build(name)
        if name in ("segnet", "multilabel"):
            auto = autopar.layouts.fsdp(model, batch, cluster)
        else:
            auto = autopar.plan(model, batch, cluster, mesh_shape=(world,)) if data_parallel else None
        plans[name] = {"auto": auto, "megatron": autopar.layouts.megatron(model, batch, cluster, tp=world)}
    return plans


def _worker(
    rank: int, world: int, plans: dict[str, dict[str, autopar.Plan | None]]
) -> dict[str, dict[str, list[float]]]:
    """Each model captured once and trained under each of its plans from the same initial weights
    and buffers."""
    os.environ["TRANSFORMERS_VERBOSITY"] = "error"
    out: dict[str, dict[str, list[float]]] = {}
    cluster = autopar.Cluster.local(world)
    for name, layouts in plans.items():
        model, batch = build(name)
        initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
        cap = autopar.capture(model, batch)
        out[name] = {}
        for layout, plan in layouts.items():
            pm = autopar.parallelize(model, cluster, batch, plan=plan, captured=cap)
            pm.load_full_state_dict(initial)
            out[name][layout] = _train(pm, batch)
            out[name][f"{layout} captured"] = pm.step is not None
    return out


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_train_like_one_process_beyond_gpt_and_llama() -> None:
    """MoE (Mixtral), encoder-decoder (T5), vision (ViT), a CNN, a segmentation head (its
    upsampling and per-pixel loss split with the batch) and a multi-label classifier (its binary
    cross-entropy's mean split with the batch) train on 2 processes under the auto plan and the
    Megatron layout with the losses of one process (SGD: exact gradients)."""
    names = ["mixtral", "t5", "vit", "cnn", "segnet", "multilabel"]
    results = spawn(_worker, 2, _plans(names, 2), timeout=540)[0]
    # Every one of these models runs its whole step (forward and backward) as one captured program;
    # none falls back to the forward program under autograd.
    fallbacks = [
        (n, key) for n in names for key, v in results[n].items() if key.endswith("captured") and not v
    ]
    assert not fallbacks, f"whole-step capture fell back for {fallbacks}"
    _assert_one_process_losses(results, names)
    # Their split losses are what trained: the layout ran them on each device's rows.
    for name, loss, spec in (("segnet", "cross_entropy_loss", "upsample_bilinear2d"),
                             ("multilabel", "binary_cross_entropy_with_logits", None)):  # fmt: skip
        plan = autopar.layouts.fsdp(*build(name), autopar.Cluster.local(2))
        assert next(n for n in plan.nodes if n.op == loss).outputs == (("P",),), name
        if spec:
            assert next(n for n in plan.nodes if n.op == spec).outputs == (("S(0)",),)


def _assert_one_process_losses(results: dict[str, dict[str, list[float]]], names: list[str]) -> None:
    """Each model's losses under each plan equal one process's (SGD: exact gradients)."""
    for name in names:
        model, batch = build(name)
        reference = _train(model, batch)
        for layout, losses in results[name].items():
            if layout.endswith("captured"):
                continue
            rel = max(abs(a - b) / abs(b) for a, b in zip(losses, reference))
            assert rel <= 1e-5, (name, layout, losses, reference)


def _available(name: str) -> bool:
    """Whether this ``transformers`` has the architecture (the newest are recent additions)."""
    import transformers

    cfg = {"deepseek_v3": "DeepseekV3Config", "gpt_oss": "GptOssConfig", "mamba2": "Mamba2Config"}.get(name)
    return cfg is None or hasattr(transformers, cfg)


def _batch_ops_kept_whole(model: nn.Module, batch: dict[str, torch.Tensor]) -> list[str]:
    """The ops computed from something whose output leads with the batch but which offer no
    strategy splitting anything on a mesh of 2 (what forces a data-parallel axis to repeat the
    work)."""
    from autopar.capture import capture
    from autopar.config import PlanConfig
    from autopar.ir import STRATEGIES
    from autopar.mesh import Mesh
    from autopar.passes import PassContext, run_passes
    from autopar.passes.strategies import annotate_strategies
    from autopar.planner import GRAPH_PASSES

    cap = capture(model, batch)
    cluster = autopar.Cluster.local(2)
    config = PlanConfig().resolved(cluster.device.memory)
    run_passes(cap.gm, PassContext(captured=cap, cluster=cluster, config=config), GRAPH_PASSES)
    ctx = PassContext(
        captured=cap, cluster=cluster, config=config.replace(mesh_shape=(2,)), mesh=Mesh((2,), cluster)
    )
    run_passes(cap.gm, ctx, [annotate_strategies])
    b = batch["input_ids"].shape[0]
    whole = []
    for n in cap.gm.graph.nodes:
        v = n.meta.get("val")
        if n.op != "call_function" or not isinstance(v, torch.Tensor) or v.dim() == 0 or v.shape[0] != b:
            continue
        if not n.all_input_nodes:  # a factory (arange(b)): made whole, sliced for free
            continue
        if not any(any(str(o) != "R" for o in s.outputs[0]) for s in n.meta[STRATEGIES].strategies):
            whole.append(f"{n.name} ({n.target})")
    return whole


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", NEWER)
def test_newer_architectures_plan_with_every_op_ruled(name: str) -> None:
    """Every op has a rule, every op on the batch can split it (a batch of 6: no size coincides
    with it), and the Megatron layout places every weight (the gate of one output whole)."""
    if not _available(name):
        pytest.skip(f"this transformers has no {name}")
    model, batch = build(name)
    ids = torch.randint(0, V, (6, 16))
    batch = {"input_ids": ids, "labels": ids.clone()}
    assert not _batch_ops_kept_whole(model, batch)
    cluster = autopar.Cluster.local(2)
    plan = autopar.plan(model, batch, cluster, mesh_shape=(2,))
    assert not plan.info["unruled_ops"], plan.info["unruled_ops"]
    tp = autopar.layouts.megatron(model, batch, cluster, tp=2)
    assert set(tp.param_placements()) == {n for n, _ in model.named_parameters(remove_duplicate=False)}


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_newer_architectures_train_like_one_process() -> None:
    """Falcon, DeepSeek-V3, GPT-OSS, Qwen2-MoE, BART and Mamba-2 on 2 processes, data parallel
    (the batch split through the newly ruled ops) and under the Megatron layout: the losses of one
    process (SGD)."""
    names = [n for n in NEWER if _available(n)]
    _assert_one_process_losses(spawn(_worker, 2, _plans(names, 2, True), timeout=540)[0], names)

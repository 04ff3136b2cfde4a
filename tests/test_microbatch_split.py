"""Micro-batched plans of transformers decoders keep the data-parallel split to the end: the LM
head and the loss run split over dp under pipelines and gradient accumulation, as without them.

Before the fix, the micro-batch graph (``microbatch.specialise_batch``) carried a ``val`` on its
output node, which the planner read as a tensor to deliver whole: every micro-batched plan of
these models ran the LM head and the loss replicated over dp (every data-parallel rank computing
every rank's logits), predicted slower by the whole head's work times dp.
"""

from __future__ import annotations

import pytest
import torch

import autopar
from autopar.capture import capture
from autopar.microbatch import MicrobatchCaptures
from autopar.placement import Shard, parse_spec

H, V, SEQ, BATCH = 256, 32000, 512, 32


def _decoder(name: str) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    import transformers

    small = dict(
        num_hidden_layers=2, hidden_size=H, num_attention_heads=4, intermediate_size=4 * H, vocab_size=V
    )
    cfgs = {
        "llama": ("LlamaConfig", "LlamaForCausalLM", dict(num_key_value_heads=2, **small)),
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_key_value_heads=2, **small)),
        "mistral": ("MistralConfig", "MistralForCausalLM", dict(num_key_value_heads=2, **small)),
        "mixtral": (
            "MixtralConfig", "MixtralForCausalLM",
            dict(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, **small),
        ),
        "gpt2": (
            "GPT2Config", "GPT2LMHeadModel",
            dict(n_layer=2, n_embd=H, n_head=4, vocab_size=V, n_positions=SEQ, resid_pdrop=0.0,
                 embd_pdrop=0.0, attn_pdrop=0.0),
        ),
    }  # fmt: skip
    cfg_name, cls_name, kw = cfgs[name]
    cfg = getattr(transformers, cfg_name)(use_cache=False, **kw)
    with torch.device("meta"):
        model = getattr(transformers, cls_name)(cfg).to(torch.bfloat16)
    ids = torch.empty(BATCH, SEQ, dtype=torch.long, device="meta")
    return model, {"input_ids": ids, "labels": ids.clone()}


def _split_over_dp(plan: autopar.Plan) -> dict[str, bool]:
    """Whether the LM head's output and the loss's logits input are split over the dp axis."""
    dp = plan.mesh_axes.index("dp")
    head = [
        n
        for n in plan.nodes
        if n.kind == "op" and n.module == "lm_head" and n.op in ("linear", "addmm", "mm")
    ]
    loss = [n for n in plan.nodes if n.kind == "op" and ("cross_entropy" in n.op or "nll_loss" in n.op)]
    assert head and loss, "the LM head and the loss are found"

    def split(spec: tuple[str, ...] | None) -> bool:
        return spec is not None and isinstance(parse_spec(spec)[dp], Shard)

    return {"lm_head": split(head[-1].outputs[0]), "loss": split(loss[-1].inputs[0])}


@pytest.mark.parametrize("name", ["llama", "qwen2", "mistral", "gpt2", "mixtral"])
@pytest.mark.parametrize("pp", [2, 1])
@pytest.mark.timeout(300)
def test_lm_head_and_loss_split_over_dp_under_microbatches(name: str, pp: int) -> None:
    """pp=2 with 2 micro-batches, and pp=1 with 2 accumulated micro-batches (each of 16 sequences,
    which divides dp=4 or 8): the LM head and the loss are split over dp."""
    model, batch = _decoder(name)
    cluster = autopar.Cluster.preset("H100-SXM", gpus_per_node=8, nodes=2)
    plan = autopar.layouts.megatron(
        model, batch, cluster, tp=2, pp=pp, microbatches=2, sequence_parallel=True
    )
    assert plan.pipeline is not None and plan.pipeline.microbatches == 2
    assert _split_over_dp(plan) == {"lm_head": True, "loss": True}


def test_microbatch_graph_is_the_graph_export_gives() -> None:
    """The specialised micro-batch graph is the one ``capture`` gives for that batch: the same
    code, no ``val`` on the output node, and parameters' values requiring gradients."""
    model, batch = _decoder("llama")
    micro = MicrobatchCaptures(model, batch)(4)
    whole = capture(model, {k: v[: BATCH // 4] for k, v in batch.items()})
    out = next(n for n in micro.gm.graph.nodes if n.op == "output")
    assert "val" not in out.meta
    params = [n for n in micro.gm.graph.nodes if n.op == "placeholder" and n.name in micro.params]
    assert params and all(n.meta["val"].requires_grad for n in params)
    assert micro.fingerprint == whole.fingerprint

"""Attention masks built from positions alone, proven causal (or all true) at capture and replaced
by ``is_causal=True`` (or no mask): ``autopar.causal_mask``. Decoders of several transformers
families lose their mask; a padded batch, a sliding window shorter than the sequence and an
encoder's bidirectional attention keep what they need; the proof holds when the O(s²) values are
reasoned about abstractly (as at 8192 tokens) as when they are evaluated; the captured step
computes the eager model's loss."""

from __future__ import annotations

from typing import Any

import _runtime_helpers as H
import pytest
import test_architectures as A
import torch

import autopar
import autopar.causal_mask as CM

pytestmark = pytest.mark.filterwarnings("ignore:autopar. no sharding rule")

DECODERS = ["llama", "gpt2", "mistral", "qwen2", "gpt_neox", "opt", "mixtral"]


def _model(name: str) -> tuple[torch.nn.Module, Any]:
    return H.build(name) if name in ("llama", "gpt2") else A.build(name)


def _attention(cap: Any) -> list[torch.fx.Node]:
    return [n for n in cap.gm.graph.nodes if n.target is torch.ops.aten.scaled_dot_product_attention.default]


def _masked(n: torch.fx.Node) -> bool:
    return (len(n.args) > 3 and n.args[3] is not None) or n.kwargs.get("attn_mask") is not None


@pytest.fixture(params=[CM.SMALL, 64], ids=["evaluated", "abstract"])
def small(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> int:
    """``SMALL`` as shipped (every value of these tiny models evaluated), and at 64 elements, so
    the (4, 1, 16, 16) masks are reasoned about as at long sequences and only the (4, 16)-element
    position vectors are evaluated."""
    monkeypatch.setattr(CM, "SMALL", request.param)
    return request.param


@pytest.mark.parametrize("name", DECODERS)
def test_decoders_attend_with_is_causal_and_build_no_mask(name: str, small: int) -> None:
    model, inputs = _model(name)
    cap = autopar.capture(model, inputs)
    attention = _attention(cap)
    assert attention
    for n in attention:
        assert n.kwargs.get("is_causal") is True and not _masked(n), (n.args, n.kwargs)
    s = inputs["input_ids"].shape[1]
    squares = [
        n.name
        for n in cap.gm.graph.nodes
        if isinstance(v := n.meta.get("val"), torch.Tensor)
        and v.dtype == torch.bool
        and v.shape[-2:] == (s, s)
    ]
    assert not squares, f"mask values left in the graph: {squares}"


def test_an_encoder_without_padding_attends_without_a_mask(small: int) -> None:
    model, inputs = A.build("bert")
    for n in _attention(autopar.capture(model, inputs)):
        assert n.kwargs.get("is_causal") is False and not _masked(n)


def test_a_padded_batch_keeps_its_mask(small: int) -> None:
    model, inputs = H.build("llama")
    inputs = dict(inputs)
    inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
    inputs["attention_mask"][0, :3] = 0
    for n in _attention(autopar.capture(model, inputs)):
        assert _masked(n) and not n.kwargs.get("is_causal")


def test_a_sliding_window_shorter_than_the_sequence_keeps_its_mask(small: int) -> None:
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(
        num_hidden_layers=1, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
        vocab_size=64, sliding_window=4, use_cache=False,
    )  # fmt: skip
    ids = torch.randint(0, 64, (2, 16))
    for n in _attention(autopar.capture(MistralForCausalLM(cfg), {"input_ids": ids, "labels": ids.clone()})):
        assert _masked(n)


@pytest.mark.parametrize("name", ["llama", "mistral", "opt"])
def test_the_captured_step_computes_the_eager_loss(name: str) -> None:
    model, inputs = _model(name)
    cap = autopar.capture(model, inputs)
    values = dict(model.named_parameters()) | dict(model.named_buffers())
    args = []
    for n in cap.gm.graph.nodes:
        if n.op != "placeholder":
            continue
        if n.name in cap.params or n.name in cap.buffers:
            args.append(values[cap.params.get(n.name) or cap.buffers[n.name]])
        elif n.name in cap.inputs:
            args.append(inputs[cap.inputs[n.name]])
        else:
            args.append(cap.constants[n.name])
    got = cap.gm(*args)
    got = got[0] if isinstance(got, (tuple, list)) else got
    torch.testing.assert_close(got, model(**inputs).loss, rtol=1e-5, atol=1e-6)


def test_the_mask_subgraph_is_erased_without_warnings(recwarn: pytest.WarningsRecorder) -> None:
    """A mask value read twice (LLaMA 3 8B at 131 072 tokens: an ``expand`` reached by two paths)
    is erased once: torch.fx warns when a node already erased is erased again."""
    import warnings

    model, inputs = H.build("llama")
    warnings.simplefilter("always")
    autopar.capture(model, inputs)
    assert not [w for w in recwarn if "already erased" in str(w.message)]

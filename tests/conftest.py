"""Shared fixtures: tiny models (transformers' GPT-2 and LLaMA built from small configs with random
weights, never downloaded; ``autopar.models.GPT``), their example batches, and clusters.

Models are built fresh for each test that asks (building one takes milliseconds); plans that
several tests only read are computed once per session.
"""

from __future__ import annotations

# CI has no GPU: the Triton kernels (autopar.program.kernels) run under Triton's interpreter, which
# must be in the environment before triton is first imported (the jit decorator reads it when a
# kernel is defined), so before anything that imports torch. Spawned gloo processes inherit it;
# a setting already in the environment wins.
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

from collections.abc import Callable

import pytest
import torch

import autopar
from autopar.models import GPT, GPTConfig

try:  # transformers logs config warnings (e.g. token ids outside a tiny vocabulary) on stderr
    from transformers.utils import logging as _hf_logging

    _hf_logging.set_verbosity_error()
except ImportError:  # pragma: no cover - transformers is a test dependency
    pass


def lm_batch(
    batch: int, seq: int, vocab: int, *, device: str = "cpu", seed: int = 0
) -> dict[str, torch.Tensor]:
    """Keyword inputs of a transformers causal LM. ``labels`` is a different tensor from
    ``input_ids`` (``torch.export`` would otherwise dedup the two inputs into one)."""
    if device == "meta":
        ids = torch.empty(batch, seq, dtype=torch.long, device="meta")
    else:
        ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids.clone()}


def gpt2(n_layer: int = 2, n_embd: int = 64, n_head: int = 4, vocab_size: int = 256, n_positions: int = 64):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        vocab_size=vocab_size,
        n_positions=n_positions,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(cfg).eval()


def llama(
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    vocab_size: int = 256,
    meta: bool = False,
):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        num_hidden_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=2 * hidden,
        vocab_size=vocab_size,
        max_position_embeddings=128,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    if meta:
        with torch.device("meta"):
            return LlamaForCausalLM(cfg).eval()
    return LlamaForCausalLM(cfg).eval()


def tiny_gpt(**kw: int) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig.tiny(**kw)).eval()


@pytest.fixture
def make_gpt2() -> Callable[..., torch.nn.Module]:
    """``make_gpt2(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=64)``."""
    return gpt2


@pytest.fixture
def make_llama() -> Callable[..., torch.nn.Module]:
    """``make_llama(layers=2, hidden=64, heads=4, kv_heads=2, vocab_size=256, meta=False)``."""
    return llama


@pytest.fixture
def make_gpt() -> Callable[..., GPT]:
    """``make_gpt(**GPTConfig.tiny overrides)``: our ``autopar.models.GPT``."""
    return tiny_gpt


@pytest.fixture
def batch() -> Callable[..., dict[str, torch.Tensor]]:
    """``batch(batch, seq, vocab, device="cpu")``: ``{"input_ids", "labels"}`` for a causal LM."""
    return lm_batch


@pytest.fixture(scope="session")
def a100x8() -> autopar.Cluster:
    """One node of 8 A100-80GB (NVLink)."""
    return autopar.Cluster.preset("A100-80GB", gpus_per_node=8, nodes=1)


@pytest.fixture(scope="session")
def a100x16() -> autopar.Cluster:
    """Two nodes of 8 A100-80GB (NVLink inside a node, InfiniBand between)."""
    return autopar.Cluster.preset("A100-80GB", gpus_per_node=8, nodes=2)


@pytest.fixture(scope="session")
def gpt2_plan(a100x8: autopar.Cluster) -> autopar.Plan:
    """Tiny GPT-2 (batch 8 × 32 tokens) planned on a 1-D mesh of 8 A100s; tests only read it."""
    return autopar.plan(gpt2(), lm_batch(8, 32, 256), a100x8, mesh_shape=(8,))


# Test order under the README's ``-n 2 --dist loadscope``: pytest-xdist hands whole modules to the
# two workers, those with the most tests first (its default reorder), which mixes the modules that
# spawn processes with single-process ones. Measured on this 2-core machine (stop 55): that order
# ran the suite in 1486-1566 s; the spawning modules first on both workers in 1728 s, and all of
# them on one worker (``--dist loadgroup``) in over 1700 s. Two spawned runs side by side put 4 to
# 8 busy processes on 2 cores, and each collective of a rank waits for its peers to be scheduled.

"""Hard inputs fail clearly, before anything runs: each case asserts its message says what was
wrong and what to do (``autopar.capture``, ``autopar.plan``, plan files, ``autopar.parallelize``)."""

from __future__ import annotations

import pytest
import torch

import autopar
from autopar.models import GPT, GPTConfig


def test_a_sequence_longer_than_the_position_table_is_refused_at_capture(make_gpt2, batch):
    model = make_gpt2(n_positions=64)
    with pytest.raises(ValueError, match=r"position table transformer\.wpe\.weight has 64 rows") as err:
        autopar.capture(model, batch(2, 128, 256))
    assert "at most 64 tokens" in str(err.value) and "positions up to 127 (128 tokens)" in str(err.value)
    autopar.capture(model, batch(2, 64, 256))  # the longest sequence it supports is fine
    # autopar's own GPT, on the meta device: found from the graph's structure, not from names
    with torch.device("meta"):
        gpt = GPT(GPTConfig.tiny(block_size=32))
    ids = torch.empty(2, 48, dtype=torch.long, device="meta")
    with pytest.raises(ValueError, match=r"wpe\.weight has 32 rows.*at most 32 tokens"):
        autopar.plan(gpt, (ids, ids.clone()), autopar.Cluster.preset("A100-80GB"))

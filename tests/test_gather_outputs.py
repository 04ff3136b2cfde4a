"""``parallelize(gather_outputs=True)`` gathers a model's split outputs whole on every rank each
step, which the plan's predicted step does not include: where that gather is a real cost (a
language model's logits split over the vocabulary) it says so, once, before training starts."""

from __future__ import annotations

import warnings

import pytest

import autopar
from autopar.api import _note_gathered_outputs
from autopar.capture import capture


def test_a_costly_output_gather_is_named_with_its_share_of_the_step(make_gpt2, batch):
    model, inputs = make_gpt2(n_layer=1), batch(4, 16, 256)
    cluster = autopar.Cluster.local(2)
    cap = capture(model, inputs)
    plan = autopar.layouts.megatron(model, inputs, cluster, tp=1, captured=cap)  # the logits split over dp
    with pytest.warns(UserWarning, match=r"gather_outputs=True gathers .*% of the plan's predicted") as got:
        _note_gathered_outputs(cap, plan)
    assert "gather_outputs=False" in str(got[0].message)
    # A model returning only its loss (a scalar) has nothing to gather.
    from autopar.models import GPT, GPTConfig

    gpt = GPT(GPTConfig.tiny(n_layer=1, n_head=4, n_embd=32, vocab_size=256))
    ids = inputs["input_ids"]
    cap2 = capture(gpt, (ids, inputs["labels"]))
    plan2 = autopar.layouts.megatron(gpt, (ids, inputs["labels"]), cluster, tp=1, captured=cap2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _note_gathered_outputs(cap2, plan2)

"""The annotated graph prints as a table (STYLE: every intermediate stage is readable)."""

from __future__ import annotations

import torch

import autopar
from autopar.models import GPT, GPTConfig
from autopar.passes import PassContext, run_passes
from autopar.passes.annotate import annotate_cost, annotate_tensors
from autopar.passes.strategies import annotate_strategies


def test_explain_shows_annotations_of_every_stage() -> None:
    model = GPT(GPTConfig.tiny())
    idx = torch.randint(0, 128, (4, 32))
    cap = autopar.capture(model, (idx, idx.clone()))
    bare = autopar.explain(cap.gm)
    assert "linear" in bare and " - " in bare  # nothing annotated yet
    ctx = PassContext(
        captured=cap,
        cluster=autopar.Cluster.preset("A100-80GB"),
        mesh=autopar.Mesh((8,), autopar.Cluster.preset("A100-80GB")),
    )
    run_passes(cap.gm, ctx, [annotate_tensors, annotate_cost, annotate_strategies])
    text = autopar.explain(cap.gm)
    lines = text.splitlines()
    assert len(lines) == len(cap.graph.nodes) + 1
    qkv = next(line for line in lines if line.startswith("linear ") and "blocks.0.attn.qkv" in line)
    assert "[4, 32, 96] float32" in qkv
    assert "(follows split)" in text  # getitem nodes follow their producer
    assert autopar.explain(cap.gm, max_rows=5).splitlines()[-1].startswith("...")

"""``autopar.explain`` prints every stage as a table: a fresh capture (annotated as needed), an
annotated graph, and a Plan node by node (STYLE: every intermediate stage is readable)."""

from __future__ import annotations

import pytest
import torch

import autopar
from autopar.models import GPT, GPTConfig


def _capture():
    model = GPT(GPTConfig.tiny())
    idx = torch.randint(0, 128, (4, 32))
    return model, (idx, idx.clone())


def test_explain_annotates_a_fresh_capture() -> None:
    model, inputs = _capture()
    cap = autopar.capture(model, inputs)
    text = autopar.explain(cap)
    lines = text.splitlines()
    assert lines[0].startswith("captured graph (costs on one H100-SXM")
    assert len(lines) == len(cap.graph.nodes) + 2  # title, header, one line per node
    qkv = next(line for line in lines if line.startswith("linear ") and "blocks.0.attn.qkv" in line)
    assert "[4, 32, 96] float32" in qkv
    cols = qkv.split()
    assert "-" not in cols[:-1]  # shape, FLOPs, time and saved bytes all filled in
    assert cols[-1] == "-"  # no mesh given: no strategies
    # With a mesh, the strategy counts too; getitem nodes follow their producer.
    text = autopar.explain(cap, mesh=(8,))
    assert "strategies on mesh (8,)" in text.splitlines()[0]
    assert "(follows split)" in text
    assert autopar.explain(cap, max_rows=5).splitlines()[-1].startswith("...")


def test_explain_captures_a_model_given_its_inputs() -> None:
    model, inputs = _capture()
    assert "blocks.1.fc" in autopar.explain(model, inputs)
    with pytest.raises(TypeError, match="example batch"):
        autopar.explain(model)
    with pytest.raises(TypeError, match="takes a Plan"):
        autopar.explain(42)


def test_explain_on_a_bare_graph_says_how_to_annotate() -> None:
    model, inputs = _capture()
    cap = autopar.capture(model, inputs)
    text = autopar.explain(cap.gm)
    assert text.splitlines()[0].startswith("not annotated: pass autopar.capture")
    assert "linear" in text


def test_explain_a_plan_lists_every_node(gpt2_plan) -> None:
    text = autopar.explain(gpt2_plan)
    assert text.startswith("Plan on mesh")
    body = text.split("\n\n", 1)[1].splitlines()
    assert len(body) == len(gpt2_plan.nodes) + 1
    qkv = next(line for line in body if "transformer.h.0.attn.c_attn.weight" in line)
    spec = ",".join(gpt2_plan.params["transformer.h.0.attn.c_attn.weight"])
    assert spec in qkv
    assert any("→" in line for line in body if line.startswith("addmm"))

"""Micro-batch graphs read from a model cut to one layer of each kind (``autopar.cut_export``): the same graph,
node for node, as exporting the micro-batch itself, and the whole model's symbolic export never
made; a model whose layers differ falls back to it and still gets that graph."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_capture import graph_record
from torch import nn

from autopar.capture import capture, microbatch_inputs, normalize_inputs
from autopar.cut_export import cut_lists, repeated_lists
from autopar.microbatch import MicrobatchCaptures


class _Block(nn.Module):
    """A residual MLP block; ``odd`` from ``odd_from`` on doubles its output (an op more)."""

    def __init__(self, i: int, odd_from: int | None = None) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)
        self.experts = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))
        self.odd = odd_from is not None and i >= odd_from

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.down(F.gelu(self.up(x))) + sum(e(x) for e in self.experts)
        h = h.reshape(x.shape[0], -1, 4, 4).mean(-1).repeat_interleave(4, -1)  # sizes from the batch
        return x + (h * 2 if self.odd else h)


class _Stack(nn.Module):
    def __init__(self, layers: int = 5, odd_from: int | None = None) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(_Block(i, odd_from) for i in range(layers))
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for b in self.blocks:
            h = b(h)
        return F.cross_entropy(self.head(h).flatten(0, 1), y.flatten())


def _stack_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(8, 6, 8), torch.randint(0, 3, (8, 6))


def test_the_outermost_repeated_list_is_cut_to_two_and_restored():
    model = _Stack()
    assert repeated_lists(model) == {"blocks": 5}  # not each block's experts: they are cut with it
    with cut_lists(model, {"blocks": 2}):
        assert len(model.blocks) == 2 and len(list(model.blocks.parameters())) == 2 * 10
    assert len(model.blocks) == 5 and [n for n, _ in model.blocks.named_children()] == list("01234")
    two = _Stack(layers=2)  # two blocks are not cut; the experts in each are
    assert repeated_lists(two) == {"blocks.0.experts": 3, "blocks.1.experts": 3}


def _llama(layers: int) -> tuple[nn.Module, dict]:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        num_hidden_layers=layers, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, vocab_size=64,
    )  # fmt: skip
    ids = torch.randint(0, 64, (8, 16))
    return LlamaForCausalLM(cfg), {"input_ids": ids, "labels": ids.clone()}


def _t5(layers: int) -> tuple[nn.Module, dict]:
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=layers, num_heads=4, decoder_start_token_id=0,
    )  # fmt: skip
    ids = torch.randint(0, 64, (8, 16))
    return T5ForConditionalGeneration(cfg), {"input_ids": ids, "labels": ids.clone()}


@pytest.mark.parametrize("kind", ["stack", "llama", "t5"])
def test_micro_batch_graph_from_the_cut_model_is_the_micro_batch_export(kind):
    """LLaMA (the mask and rotary tables before the layers), T5 (its first block unlike the rest,
    an encoder and a decoder list) and a stack whose blocks compute sizes from the batch: the
    graph of a micro-batch of 2 read from the cut model is the graph exporting that micro-batch
    gives, op for op and value for value, with no export of the whole model with a symbolic batch."""
    torch.manual_seed(0)
    if kind == "stack":
        model, inputs = _Stack(), _stack_inputs()
    else:
        model, inputs = _llama(3) if kind == "llama" else _t5(4)
    whole = capture(model, inputs)
    assert whole.raw is not None
    graphs = MicrobatchCaptures(model, inputs, whole=whole)
    got = graphs(4)
    assert graphs.cut_failure is None and graphs.symbolic_failure is None
    assert graphs._symbolic is None  # the whole model was never exported with a symbolic batch
    args, kwargs = normalize_inputs(inputs)
    want = capture(model, microbatch_inputs(args, kwargs, 4))
    assert got.fingerprint == want.fingerprint
    g, w = graph_record(got.gm, ops=True), graph_record(want.gm, ops=True)
    assert any(len(r) == 7 and r[2][:1] == (2,) for r in g[0])  # a micro-batch of 2
    assert g == w


class _Odd(nn.Module):
    """``_Stack``'s blocks with, from block 2 on, every other block doubling its output (two kinds
    of layer after the first two), and ``between`` an op after every block but the last."""

    def __init__(self, between: bool = False) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(_Block(i, odd_from=0 if i >= 2 and i % 2 else None) for i in range(7))
        self.head = nn.Linear(16, 3)
        self.between = between

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for i, b in enumerate(self.blocks):
            h = b(h)
            if self.between and i < len(self.blocks) - 1:
                h = h.roll(1, 0)
        return F.cross_entropy(self.head(h).flatten(0, 1), y.flatten())


@pytest.mark.parametrize("between", [False, True])
def test_layers_of_several_kinds_each_match_the_first_of_theirs(between):
    """Blocks 0, 1, 2 (plain), 3 (doubling), 4, 5, … alternating: each is matched with the first
    block from 1 on whose ops are its own — with ops between the blocks, the last with a later one,
    so that every block matched is followed by them in the cut model — and the graph is the micro-
    batch's export, without the whole model's symbolic export."""
    from autopar.cut_export import plan_cuts

    torch.manual_seed(0)
    model, inputs = _Odd(between), _stack_inputs()
    whole = capture(model, inputs)
    cut = plan_cuts(whole.raw.graph_module.graph, repeated_lists(model))["blocks"]
    assert cut.template == ((0, 1, 1, 3, 1, 3, 4) if between else (0, 1, 1, 3, 1, 3, 1))
    graphs = MicrobatchCaptures(model, inputs, whole=whole)
    got = graphs(2)
    assert graphs.cut_failure is None and graphs._symbolic is None
    want = capture(model, microbatch_inputs(*normalize_inputs(inputs), 2))
    assert graph_record(got.gm, ops=True) == graph_record(want.gm, ops=True)


class _ScaledBetween(_Stack):
    """After each block, a scale of its own: the blocks alike, what runs between them not."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for i, b in enumerate(self.blocks):
            h = b(h) * (1.0 + i / 10)
        return F.cross_entropy(self.head(h).flatten(0, 1), y.flatten())


class _ScaledBlock(_Block):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.scale


class _Scaled(_Stack):
    """Each block scaling its output by a constant of its own: no two blocks alike."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_ScaledBlock(i) for i in range(5))
        for i, b in enumerate(self.blocks):
            b.scale = 1.0 + i / 10


@pytest.mark.parametrize("kind", ["unlike", "between"])
def test_layers_unlike_each_other_or_their_template_fall_back_to_the_symbolic_export(kind):
    """No two blocks alike: not cut, said so; blocks alike but what runs between them not: no
    match, said where. Either way the graph is still the micro-batch's (from the whole model's
    symbolic export)."""
    torch.manual_seed(0)
    model, inputs = (_Scaled() if kind == "unlike" else _ScaledBetween()), _stack_inputs()
    graphs = MicrobatchCaptures(model, inputs, whole=capture(model, inputs))
    got = graphs(2)
    if kind == "unlike":
        assert graphs.cut_failure == "no list of layers repeats its layers' ops"
    else:
        assert graphs.cut_failure.startswith("NotAligned") and "after blocks.2" in graphs.cut_failure
    assert graphs.symbolic_failure is None and graphs._symbolic is not None
    want = capture(model, microbatch_inputs(*normalize_inputs(inputs), 2))
    assert got.fingerprint == want.fingerprint

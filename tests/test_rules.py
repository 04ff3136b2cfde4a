"""Sharding rules on tiny hand-built graphs: the strategies each op family offers along one mesh
axis, and the replicated fallback (with one warning) for an op without a rule."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autopar
from autopar.graph import tensor_inputs
from autopar.placement import Partial, Replicate
from autopar.rules import AxisStrategy, axis_strategies, block_hints, has_rule

R, P = Replicate(), Partial()


def _graph(fn, *args) -> torch.fx.Graph:
    class Fn(nn.Module):
        def forward(self, *a):
            return fn(*a)

    return torch.export.export(Fn(), args, strict=False).graph


def _node(graph: torch.fx.Graph, op: str) -> torch.fx.Node:
    (node,) = [n for n in graph.nodes if n.op == "call_function" and n.target.__name__.split(".")[0] == op]
    return node


def _table(node: torch.fx.Node, hints=None) -> set[tuple]:
    """Strategies as ``(inputs, outputs, rewrite)`` with inputs in the op's argument order."""
    out = set()
    for s in axis_strategies(node, hints):
        out.add((tuple(str(p) for p in s.inputs), tuple(str(p) for p in s.outputs), s.rewrite))
    return out


def test_replicated_strategy_always_comes_first():
    g = _graph(lambda x, w: F.linear(x, w), torch.randn(4, 8), torch.randn(16, 8))
    first = axis_strategies(_node(g, "linear"))[0]
    assert first == AxisStrategy((R, R), (R,))
    assert not first.split


def test_linear_column_and_row_parallel():
    # x [2, 4, 16] @ w[32, 16].T + b[32]; inputs in order (x, w, b)
    g = _graph(lambda x, w, b: F.linear(x, w, b), torch.randn(2, 4, 16), torch.randn(32, 16), torch.randn(32))
    node = _node(g, "linear")
    assert [i.name for i in tensor_inputs(node)] == [a.name for a in node.args]
    table = _table(node)
    assert (("R", "S(0)", "S(0)"), ("S(2)",), "") in table  # column-parallel: out features split
    assert (("S(2)", "S(1)", "P"), ("P",), "") in table  # row-parallel: contraction split -> Partial
    assert (("S(0)", "R", "R"), ("S(0)",), "") in table  # data parallel
    assert (("S(1)", "R", "R"), ("S(1)",), "") in table  # sequence
    for s in axis_strategies(node)[1:]:
        assert s.split


def test_addmm_conv1d_layout_is_transposed():
    # GPT-2's Conv1D: addmm(b[32], x[8, 16], w[16, 32]); the weight is [in, out].
    g = _graph(lambda b, x, w: torch.addmm(b, x, w), torch.randn(32), torch.randn(8, 16), torch.randn(16, 32))
    table = _table(_node(g, "addmm"))
    assert (("S(0)", "R", "S(1)"), ("S(1)",), "") in table  # column-parallel: weight S(1), bias S(0)
    assert (("P", "S(1)", "S(0)"), ("P",), "") in table  # row-parallel: weight S(0), bias joins as Partial
    assert (("R", "S(0)", "R"), ("S(0)",), "") in table


def test_mm_without_bias_keeps_partial_activations_partial():
    g = _graph(lambda x, w: x @ w, torch.randn(8, 16), torch.randn(16, 32))
    node = next(n for n in g.nodes if n.op == "call_function")
    assert (("P", "R"), ("P",), "") in _table(node)


def test_embedding_vocab_parallel_is_partial_with_a_rewrite():
    g = _graph(lambda w, i: F.embedding(i, w), torch.randn(64, 16), torch.randint(0, 64, (2, 8)))
    table = _table(_node(g, "embedding"))
    assert (("S(0)", "R"), ("P",), "vocab_parallel_embedding") in table  # rows of the table split
    assert (("S(1)", "R"), ("S(2)",), "") in table  # embedding dimension split
    assert (("R", "S(0)"), ("S(0)",), "") in table  # batch of indices split


def test_layer_norm_never_splits_the_normalized_dimension():
    g = _graph(
        lambda x, w, b: F.layer_norm(x, (16,), w, b), torch.randn(2, 8, 16), torch.randn(16), torch.randn(16)
    )
    table = _table(_node(g, "layer_norm"))
    assert table == {
        (("R", "R", "R"), ("R",), ""),
        (("S(0)", "R", "R"), ("S(0)",), ""),
        (("S(1)", "R", "R"), ("S(1)",), ""),
    }


@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_splits_batch_and_heads_and_queries_only_without_causal_mask(causal):
    q = torch.randn(2, 4, 8, 16)
    g = _graph(
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal), q, q.clone(), q.clone()
    )
    table = _table(_node(g, "scaled_dot_product_attention"))
    assert (("S(0)", "S(0)", "S(0)"), ("S(0)",), "") in table
    assert (("S(1)", "S(1)", "S(1)"), ("S(1)",), "") in table
    seq_split = (("S(2)", "R", "R"), ("S(2)",), "")
    # A causal mask is built from local positions: splitting queries would misalign it.
    assert (seq_split in table) is (not causal)
    assert not any("S(3)" in ins for ins, _, _ in table)  # head dimension is contracted


def test_split_offers_block_sharding_for_equal_parts():
    g = _graph(lambda x: [t.relu() for t in x.split(16, dim=1)], torch.randn(4, 48))
    node = _node(g, "split")
    hints = block_hints(g)
    assert hints[node.args[0]] == {(1, 3)}
    table = _table(node, hints)
    assert (("S(1)x3",), ("S(1)", "S(1)", "S(1)"), "split_local") in table  # fused-QKV layout
    assert (("S(0)",), ("S(0)",) * 3, "") in table
    assert (("S(1)",), ("S(1)",) * 3, "") not in table  # a plain shard would cut across the parts


def test_reductions_over_a_sharded_dim_are_partial():
    g = _graph(lambda x: x.sum(1) + x.mean(1), torch.randn(4, 8))
    assert (("S(1)",), ("P",), "") in _table(_node(g, "sum"))
    assert (("S(1)",), ("P",), "mean_partial") in _table(_node(g, "mean"))
    assert (("S(0)",), ("S(0)",), "") in _table(_node(g, "sum"))


def test_cumsum_and_softmax_keep_their_dimension_whole():
    g = _graph(lambda x: torch.cumsum(x, 1) + torch.softmax(x, -1), torch.randn(4, 8))
    for op in ("cumsum", "softmax"):
        node = _node(g, op)
        assert has_rule(node)
        assert _table(node) == {(("R",), ("R",), ""), (("S(0)",), ("S(0)",), "")}


def test_roll_and_flip_keep_every_dimension_they_do_not_move_split():
    """Swin's shifted windows roll the feature map along height and width: the batch and the
    channels stay split, and each device's roll of its piece is the piece of the whole roll."""
    x = torch.randn(4, 6, 6, 8)
    g = _graph(lambda t: torch.roll(t, shifts=(-2, -2), dims=(1, 2)) + torch.flip(t, dims=[3]), x)
    roll, flip = _node(g, "roll"), _node(g, "flip")
    assert _table(roll) == {
        (("R",), ("R",), ""),
        (("S(0)",), ("S(0)",), ""),
        (("S(3)",), ("S(3)",), ""),
        (("P",), ("P",), ""),
    }
    assert _table(flip) == {(("R",), ("R",), ""), (("S(0)",), ("S(0)",), ""), (("S(1)",), ("S(1)",), ""), (("S(2)",), ("S(2)",), ""), (("P",), ("P",), "")}  # fmt: skip
    whole = torch.roll(x, shifts=(-2, -2), dims=(1, 2))
    for piece, out in zip(x.chunk(2, dim=3), whole.chunk(2, dim=3)):
        assert torch.equal(torch.roll(piece, shifts=(-2, -2), dims=(1, 2)), out)
    flat = _node(_graph(lambda t: torch.roll(t, 3), x), "roll")  # no dims: the flattened tensor
    assert _table(flat) == {(("R",), ("R",), ""), (("P",), ("P",), "")}


def test_batch_norm_splits_channels_or_rows_synchronized_in_training():
    """Channels split with weight, bias and running statistics; rows (batch, height, width) split
    with them whole — in training only through the synchronized statistics
    (``Rewrite.SYNC_BATCH_NORM``, a collective inside the op), in evaluation as they are. Before,
    only channels split, so a data-parallel CNN gathered every activation it normalized."""
    from autopar.rules.norms import SYNC_FORMS

    x, w, b, rm, rv = torch.randn(4, 6, 5, 5), torch.randn(6), torch.randn(6), torch.zeros(6), torch.ones(6)
    rows = [("S(0)", "R", "R", "R", "R"), ("S(2)", "R", "R", "R", "R"), ("S(3)", "R", "R", "R", "R")]
    channels = (("S(1)", "S(0)", "S(0)", "S(0)", "S(0)"), ("S(1)",), "")
    replicated = (("R",) * 5, ("R",), "")
    for training, rewrite in ((True, "sync_batch_norm"), (False, "")):
        g = _graph(
            lambda t, *p, tr=training: F.batch_norm(t, p[2], p[3], p[0], p[1], training=tr), x, w, b, rm, rv
        )
        (node,) = [n for n in g.nodes if n.op == "call_function" and "batch_norm" in str(n.target)]
        assert has_rule(node)
        expected = {replicated, channels} | {(r, (r[0],), rewrite) for r in rows}
        table = _table(node)
        assert {(ins, outs[:1], rw) for ins, outs, rw in table} == expected, (training, table)
        synced = [s for s in axis_strategies(node) if s.rewrite]
        # Each row split in both merge forms: gathered, or all-reduced in two passes.
        assert {s.comm for s in synced} == (set(SYNC_FORMS) if training else set())
        assert len(synced) == (len(rows) * len(SYNC_FORMS) if training else 0)
    # Instance norm's statistics are per sample: its batch splits with no collective.
    g = _graph(lambda t: F.instance_norm(t), x)
    (node,) = [n for n in g.nodes if n.op == "call_function" and "instance_norm" in str(n.target)]
    assert (("S(0)",), ("S(0)",), "") in _table(node)


def test_random_fills_split_like_dropout():
    """A router's Gumbel or exponential noise (PhiMoE's ``empty_like(x).exponential_()``), uniform
    jitter and Bernoulli masks: each device draws its piece, as dropout does; before, they had no
    rule and ran whole on every device."""
    x = torch.rand(4, 6)
    fills = {
        "exponential_": lambda t: torch.empty_like(t).exponential_() * t,
        "uniform_": lambda t: torch.empty_like(t).uniform_(-1, 1) + t,
        "normal_": lambda t: torch.empty_like(t).normal_() + t,
        "bernoulli": lambda t: torch.bernoulli(t) * t,
    }
    for op, fn in fills.items():
        node = _node(_graph(fn, x), op)
        assert has_rule(node), op
        table = _table(node)
        assert (("S(0)",), ("S(0)",), "") in table and (("S(1)",), ("S(1)",), "") in table, (op, table)


@pytest.mark.parametrize("mode", ["nearest", "bilinear", "bicubic"])
def test_interpolation_splits_the_batch_and_channels_and_keeps_partial_sums(mode):
    """A segmentation head upsamples its feature map (SegFormer, U-Nets): without a rule it ran
    whole on every device. Batch and channels split, the spatial dimensions stay whole, and each
    device's interpolation of its channels is the channels' piece of the whole interpolation."""
    x = torch.randn(4, 6, 5, 5)
    g = _graph(lambda t: F.interpolate(t, scale_factor=2, mode=mode), x)
    (node,) = [n for n in g.nodes if n.op == "call_function" and "upsample" in str(n.target)]
    assert has_rule(node)
    assert _table(node) == {(("R",), ("R",), ""), (("S(0)",), ("S(0)",), ""), (("S(1)",), ("S(1)",), ""), (("P",), ("P",), "")}  # fmt: skip
    whole = F.interpolate(x, scale_factor=2, mode=mode)
    for piece, out in zip(x.chunk(2, dim=1), whole.chunk(2, dim=1)):
        torch.testing.assert_close(F.interpolate(piece, scale_factor=2, mode=mode), out)


def test_binary_cross_entropy_splits_logits_and_target_alike_and_its_mean_is_partial():
    x, y = torch.randn(8, 6), torch.rand(8, 6)
    for reduction, out, rewrite in (("mean", "P", "mean_partial"), ("sum", "P", ""), ("none", None, "")):
        g = _graph(lambda a, b, r=reduction: F.binary_cross_entropy_with_logits(a, b, reduction=r), x, y)
        node = _node(g, "binary_cross_entropy_with_logits")
        want = {(("R", "R"), ("R",), "")} | {
            ((f"S({d})", f"S({d})"), (out or f"S({d})",), rewrite) for d in (0, 1)
        }
        assert _table(node) == want, reduction
    # Lowered as the local loss over the pieces (``passes.lower``): their sum is the whole mean.
    pieces = sum(F.binary_cross_entropy_with_logits(a, b) / 2 for a, b in zip(x.chunk(2), y.chunk(2)))
    torch.testing.assert_close(pieces, F.binary_cross_entropy_with_logits(x, y))
    weighted = _graph(lambda a, b: F.binary_cross_entropy_with_logits(a, b, pos_weight=torch.ones(6)), x, y)
    assert _table(_node(weighted, "binary_cross_entropy_with_logits")) == {(("R", "R", "R"), ("R",), "")}


def test_pointwise_broadcast_aligns_inputs():
    g = _graph(lambda x, b: x * b, torch.randn(4, 8), torch.randn(8))
    table = _table(_node(g, "mul"))
    assert (("S(0)", "R"), ("S(0)",), "") in table  # the broadcast input is replicated
    assert (("S(1)", "S(0)"), ("S(1)",), "") in table  # ... or cut along with the output
    assert (("P", "R"), ("P",), "") in table  # mul is linear in one input


class _Gather(nn.Module):
    """Two ``searchsorted`` nodes: an op with tensor inputs and outputs and no sharding rule."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, idx: torch.Tensor, idx2: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        edges = y[:, 0].sort().values
        return (
            torch.searchsorted(edges, idx.float()) + torch.searchsorted(edges, idx2.float())
        ).sum().float() + y.sum()


def test_op_without_rule_runs_replicated_with_one_warning(a100x8):
    g = _graph(torch.searchsorted, torch.arange(8.0), torch.tensor([1.5, 3.5]))
    assert not has_rule(_node(g, "searchsorted"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        inputs = (torch.randn(16, 8), torch.tensor([0, 3, 5, 7]), torch.tensor([1, 2, 4, 6]))
        plan = autopar.plan(_Gather(), inputs, a100x8, mesh_shape=(8,))
    ours = [w for w in caught if "autopar" in str(w.message)]
    assert len(ours) == 1, [str(w.message) for w in ours]
    assert "no sharding rule for searchsorted" in str(ours[0].message)
    assert plan.info["unruled_ops"] == ["searchsorted"]
    index_nodes = [n for n in plan.nodes if n.op == "searchsorted"]
    assert len(index_nodes) == 2
    for n in index_nodes:
        assert all(spec == ("R",) for spec in n.inputs) and n.outputs == (("R",),)


def test_unruled_op_warning_reaches_the_caller_once_when_meshes_are_solved_in_parallel(a100x8):
    """Candidate meshes are solved in forked processes (``workers=2``); the warning is raised once,
    in the caller's process, where ``warnings.catch_warnings`` sees it, and points at this file."""
    inputs = (torch.randn(16, 8), torch.tensor([0, 3, 5, 7]), torch.tensor([1, 2, 4, 6]))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = autopar.plan(_Gather(), inputs, a100x8, workers=2)
    assert len(plan.info["meshes_tried"]) > 1
    ours = [w for w in caught if "no sharding rule" in str(w.message)]
    assert len(ours) == 1, [str(w.message) for w in ours]
    assert ours[0].filename == __file__


def test_advanced_indexing_keeps_the_dimensions_it_does_not_index():
    """``x[:, :, idx]`` (Falcon's multi-query keys and values): the dimensions before the indexed
    one stay in place, those after it move by the index's rank; indices on two dimensions that are
    not adjacent put theirs first (PyTorch's rule)."""
    idx = torch.tensor([1])
    g = _graph(lambda x, i: x[:, :, i], torch.randn(4, 16, 6, 8), idx)
    table = _table(_node(g, "index"))
    assert (("S(0)", "R"), ("S(0)",), "") in table
    assert (("S(1)", "R"), ("S(1)",), "") in table
    assert (("S(3)", "R"), ("S(3)",), "") in table
    assert not any(s[0][0] == "S(2)" for s in table)  # the indexed dimension stays whole
    assert (("P", "R"), ("P",), "") in table
    i, j = torch.tensor([[1, 2]]), torch.tensor([[0, 3]])
    g = _graph(lambda x, i, j: x[:, i, :, j], torch.randn(4, 5, 6, 7), i, j)
    table = _table(_node(g, "index"))  # result (1, 2, 4, 6)
    assert (("S(0)", "R", "R"), ("S(2)",), "") in table and (("S(2)", "R", "R"), ("S(3)",), "") in table


def test_max_along_a_dimension_and_scatter_of_one_value_split_the_other_dimensions():
    g = _graph(lambda x: x.max(dim=-1, keepdim=True).values, torch.randn(4, 6, 8))
    table = _table(_node(g, "max"))
    assert (("S(0)",), ("S(0)", "S(0)"), "") in table and (("S(1)",), ("S(1)", "S(1)"), "") in table
    assert not any(s[0] == ("S(2)",) for s in table)
    g = _graph(lambda x: x.max(dim=1).values, torch.randn(4, 6, 8))
    assert (("S(2)",), ("S(1)", "S(1)"), "") in _table(_node(g, "max"))
    # DeepSeek-V3's group mask: zeros.scatter_(1, top groups, 1), one row per token
    g = _graph(
        lambda s, i: torch.zeros_like(s).scatter_(1, i, 1.0), torch.randn(16, 4), torch.tensor([[1]] * 16)
    )
    table = _table(_node(g, "scatter_"))
    assert (("S(0)", "S(0)"), ("S(0)",), "") in table
    assert not any("P" in s[1] for s in table)  # a write, not a sum


def test_in_place_copy_constant_copy_and_broadcast_to_have_rules():
    g = _graph(lambda x, y: x.clone()[:, :2].copy_(y), torch.randn(4, 6), torch.randn(4, 2))
    assert has_rule(_node(g, "copy_"))
    g = _graph(lambda x: torch.broadcast_to(x, (3, 4, 6)), torch.randn(4, 6))
    node = next(n for n in g.nodes if n.op == "call_function" and "broadcast_to" in str(n.target))
    assert (("S(0)",), ("S(1)",), "") in _table(node)
    g = _graph(lambda x: x[:, torch.tensor([0, 2])], torch.randn(4, 6))  # a lifted constant index
    assert has_rule(
        next(n for n in g.nodes if n.op == "call_function" and "lift_fresh_copy" in str(n.target))
    )


def test_views_written_through_may_not_be_resharded():
    """T5's right shift writes through a slice of a fresh tensor: the slice's edge from that tensor
    is a write too (a reshard there would be a copy, and the write would land in it)."""
    from autopar.passes.formulate import views_written_through

    def shift(ids):
        out = ids.new_zeros(ids.shape)
        out[..., 1:].copy_(ids[..., :-1])
        return out

    g = _graph(shift, torch.zeros(4, 8, dtype=torch.long))
    nodes = [n for n in g.nodes if n.op == "call_function"]
    through = views_written_through(nodes)
    names = {(a.target.__name__.split(".")[0], b.target.__name__.split(".")[0]) for a, b in through}
    assert ("new_zeros", "slice") in names, names


def test_einsum_splits_by_its_equation_and_costs_as_its_gemm():
    """Letters kept in the output split every operand holding them; a summed letter splits both
    operands into a Partial result; a letter of one operand and the output splits only it. Two
    operands cost as the bmm ``torch.einsum`` runs."""
    from autopar.cost.compute import TensorArg
    from autopar.cost.op_kernels import op_kernels

    g = _graph(lambda a, b: torch.einsum("bij,bjk->bik", a, b), torch.randn(2, 3, 4), torch.randn(2, 4, 5))
    table = _table(_node(g, "einsum"))
    assert (("S(0)", "S(0)"), ("S(0)",), "") in table  # batch
    assert (("S(1)", "R"), ("S(1)",), "") in table  # rows of a
    assert (("R", "S(2)"), ("S(2)",), "") in table  # columns of b
    assert (("S(2)", "S(1)"), ("P",), "") in table  # the contraction
    assert (("P", "R"), ("P",), "") in table and (("R", "P"), ("P",), "") in table
    g = _graph(lambda a: torch.einsum("ii->i", a), torch.randn(4, 4))
    assert not any("S" in "".join(s[0]) for s in _table(_node(g, "einsum")))  # a diagonal: whole
    args = [TensorArg((2, 3, 4), "float32", True), TensorArg((2, 4, 5), "float32", True)]
    out = [TensorArg((2, 3, 5), "float32")]
    ein = op_kernels("einsum", args, out, requires_grad=True, equation="bij,bjk->bik")
    bmm = op_kernels("bmm", args, out, requires_grad=True)
    assert [k.flops for k in ein.fwd + ein.bwd] == [k.flops for k in bmm.fwd + bmm.bwd] == [240.0] * 3

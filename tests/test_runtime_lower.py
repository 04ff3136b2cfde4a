"""Codegen without processes: ``local_shard`` (how a rank's piece is cut), the local ops of
``autopar.program.local_ops``, and ``autopar.passes.lower`` run for each rank of a 2-device Megatron plan
of our tiny GPT with hand-made ``AxisGroup``s (lowering never calls a collective, so no process
group is needed): the program each rank would run, read as code and as a graph."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch
import torch.nn.functional as F

import autopar
from autopar.models import GPT, GPTConfig
from autopar.passes.lower import LoweringError, lower
from autopar.placement import Shard, local_shape, parse_spec, shard_slices
from autopar.program import collectives as C
from autopar.program import local_ops as O
from autopar.program.collectives import AxisGroup
from autopar.runtime.shards import local_shard

aten = torch.ops.aten

# --------------------------------------------------------------------------------------- local_shard

SHARD_CASES = [
    ((8, 6), "S(0)", (2,)),
    ((8, 6), "S(1)", (3,)),
    ((12, 6), "S(0)x3", (2,)),
    ((4, 24), "S(1)x3", (4,)),
    ((8, 12), ("S(0)", "S(1)"), (2, 2)),
    ((8, 12), ("S(0)", "S(0)"), (2, 2)),
    ((8, 12), ("S(1)", "S(0)"), (2, 4)),
    ((8, 12), ("R", "S(1)x3"), (2, 2)),
    ((8, 12), ("S(1)x3", "S(0)"), (2, 2)),
    ((8, 12), ("S(0)", "S(1)x3"), (4, 2)),
    ((8, 12, 4), ("S(2)", "S(0)", "S(1)x3"), (2, 2, 2)),
    ((8, 12), ("S(0)", "R"), (2, 4)),
    ((8, 12), ("R", "R"), (2, 2)),
]


def _by_index(full: torch.Tensor, ranges: list[list[tuple[int, int]]]) -> torch.Tensor:
    """``full`` restricted to the given ranges, by ``index_select`` (independent of ``narrow``)."""
    out = full
    for d, rs in enumerate(ranges):
        idx = torch.tensor([i for lo, hi in rs for i in range(lo, hi)], dtype=torch.long)
        out = out.index_select(d, idx)
    return out


@pytest.mark.parametrize(("shape", "spec", "mesh"), SHARD_CASES)
def test_local_shard_is_the_piece_shard_slices_describes(shape, spec, mesh):
    spec = parse_spec(spec)
    full = torch.arange(math.prod(shape)).view(shape)
    held = torch.zeros(full.numel(), dtype=torch.long)
    for coord in itertools.product(*(range(n) for n in mesh)):
        piece = local_shard(full, spec, mesh, coord)
        assert tuple(piece.shape) == local_shape(shape, spec, mesh)
        assert torch.equal(piece, _by_index(full, shard_slices(shape, spec, mesh, coord)))
        held += torch.bincount(piece.flatten(), minlength=full.numel())
    # Every element is held by exactly the devices of the axes that do not shard it.
    replicas = math.prod(n for p, n in zip(spec, mesh) if not isinstance(p, Shard))
    assert torch.equal(held, torch.full_like(held, replicas))


def test_local_shard_of_blocks_takes_one_piece_of_every_block():
    x = torch.arange(12)
    assert local_shard(x, parse_spec("S(0)x3"), (2,), (0,)).tolist() == [0, 1, 4, 5, 8, 9]
    assert local_shard(x, parse_spec("S(0)x3"), (2,), (1,)).tolist() == [2, 3, 6, 7, 10, 11]


def test_local_shard_on_a_2d_mesh_splits_the_outer_axis_first():
    x = torch.arange(8)
    pieces = {
        c: local_shard(x, parse_spec(("S(0)", "S(0)")), (2, 2), c).tolist()
        for c in itertools.product((0, 1), (0, 1))
    }
    assert pieces == {(0, 0): [0, 1], (0, 1): [2, 3], (1, 0): [4, 5], (1, 1): [6, 7]}
    w = torch.arange(24).view(4, 6)
    piece = local_shard(w, parse_spec(("S(1)x3", "S(0)")), (2, 2), (1, 0))
    assert piece.tolist() == [[1, 3, 5], [7, 9, 11]]


# ------------------------------------------------------------------------------------------ local ops


def test_vocab_parallel_embedding_pieces_sum_to_the_embedding_and_keep_padding_without_gradient():
    gen = torch.Generator().manual_seed(0)
    table = torch.randn(8, 5, generator=gen)
    ids = torch.tensor([[0, 3, 4, 7], [2, 2, 5, 0]])
    upstream = torch.randn(2, 4, 5, generator=gen)
    for padding_idx in (-1, 0, 5):
        ref = table.clone().requires_grad_(True)
        (
            F.embedding(ids, ref, padding_idx=None if padding_idx < 0 else padding_idx) * upstream
        ).sum().backward()
        total = torch.zeros(2, 4, 5)
        grads = []
        for start in (0, 4):  # two devices, rows [0, 4) and [4, 8)
            piece = table[start : start + 4].clone().requires_grad_(True)
            out = O.vocab_parallel_embedding(piece, ids, start, padding_idx)
            (out * upstream).sum().backward()
            total += out.detach()
            grads.append(piece.grad)
        torch.testing.assert_close(total, F.embedding(ids, table))
        torch.testing.assert_close(torch.cat(grads), ref.grad)


def test_mean_partial_pieces_sum_to_the_mean():
    x = torch.randn(4, 6, 8)
    pieces = x.chunk(2, dim=1)
    torch.testing.assert_close(sum(O.mean_partial(p, None, False, 2) for p in pieces), x.mean())
    torch.testing.assert_close(sum(O.mean_partial(p, [1], True, 2) for p in pieces), x.mean(1, keepdim=True))


# ----------------------------------------------------------------------------------------- lowering

VOCAB, BATCH, SEQ = 64, 4, 16


@pytest.fixture(scope="module")
def gpt_megatron():
    """Our tiny GPT (4 heads of 8, vocabulary 64), its capture and the Megatron plan on 2 devices."""
    torch.manual_seed(0)
    model = GPT(GPTConfig.tiny(n_layer=2, n_head=4, n_embd=32, vocab_size=VOCAB))
    inputs = (torch.randint(0, VOCAB, (BATCH, SEQ)), torch.randint(0, VOCAB, (BATCH, SEQ)))
    plan = autopar.layouts.megatron(model, inputs, autopar.Cluster.local(2), tp=2)
    return model, inputs, autopar.capture(model, inputs), plan


def _axes(plan, coord):
    return [
        AxisGroup(axis=a, name=name, size=n, coord=c, group=None)
        for a, (name, n, c) in enumerate(zip(plan.mesh_axes, plan.mesh_shape, coord))
    ]


def _calls(gm, module=None):
    return [
        n
        for n in gm.graph.nodes
        if n.op == "call_function"
        and (module is None or getattr(n.target, "__module__", "") == module.__name__)
    ]


@pytest.mark.parametrize("coord", [0, 1])
def test_lowered_program_has_each_collective_on_its_own_line(gpt_megatron, coord):
    _, _, cap, plan = gpt_megatron
    axes = _axes(plan, (coord,))
    gm = lower(cap, plan, axes, device="cpu")
    collectives = _calls(gm, C)
    kinds = {n.target.__name__ for n in collectives}
    assert {"all_reduce", "grad_sync"} <= kinds, kinds
    lines = [line for line in gm.code.splitlines() if "autopar_program_collectives_" in line]
    assert len(lines) == len(collectives)
    for line in lines:
        assert line.count("autopar_program_collectives_") == 1, line
        assert line.strip().split(" = ", 1)[1].startswith("autopar_program_collectives_"), line
    assert all(not ax.counts for ax in axes), "lowering issued a collective"


@pytest.mark.parametrize("coord", [0, 1])
def test_lowered_views_use_local_shapes(gpt_megatron, coord):
    _, _, cap, plan = gpt_megatron
    gm = lower(cap, plan, _axes(plan, (coord,)), device="cpu")
    views = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)
    captured = [n for n in cap.graph.nodes if n.op == "call_function" and n.target in views]
    lowered = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in views]
    assert len(lowered) == len(captured) > 0
    for c, low in zip(captured, lowered):
        spec = parse_spec(plan.node(c.name).outputs[0])
        if any(isinstance(p, Shard) for p in spec):
            want = list(local_shape(tuple(c.meta["val"].shape), spec, plan.mesh_shape))
        else:
            want = list(c.args[1])
        assert list(low.args[1]) == want, f"{c.format_node()} lowered to {low.format_node()}"
    # Concretely: the heads are split, q/k/v are viewed as [B, T, 4/2 heads, 8] on each device,
    # and attention's output as [B, T, 32/2].
    assert f"[{BATCH}, {SEQ}, 2, 8]" in gm.code and f"[{BATCH}, {SEQ}, 4, 8]" not in gm.code
    assert f"[{BATCH}, {SEQ}, 16]" in gm.code


@pytest.mark.parametrize(("coord", "start"), [(0, 0), (1, VOCAB // 2)])
def test_vocab_parallel_embedding_uses_the_ranks_vocabulary_offset(gpt_megatron, coord, start):
    _, _, cap, plan = gpt_megatron
    assert plan.param_placements()["wte.weight"] == ("S(0)",)
    gm = lower(cap, plan, _axes(plan, (coord,)), device="cpu")
    (emb,) = [n for n in _calls(gm) if n.target is O.vocab_parallel_embedding]
    assert emb.args[2] == start
    assert emb.args[3] == -1  # nn.Embedding without padding_idx (LLaMA's has one: see training tests)
    assert f"autopar_program_local_ops_vocab_parallel_embedding(p_wte_weight, idx, {start}" in gm.code
    # The table arrives as this rank's half of the rows (no gather), its output is all-reduced.
    assert emb.args[0].op == "placeholder"
    assert any(u.target is C.all_reduce for u in emb.users)


def test_plan_for_a_different_program_is_refused(gpt_megatron):
    model, inputs, _, plan = gpt_megatron
    other = autopar.capture(model, tuple(x[:, : SEQ // 2].contiguous() for x in inputs))
    assert other.fingerprint != plan.fingerprint
    with pytest.raises(LoweringError, match="different program") as err:
        lower(other, plan, _axes(plan, (0,)), device="cpu")
    # the message says where: the first input's shape
    half = (BATCH, SEQ // 2)
    assert f"node idx (placeholder) has shape {half} here, {(BATCH, SEQ)} in the plan" in str(err.value)
    assert plan.info["traced_by"] == f"torch {torch.__version__} on cpu"
    older = dataclasses.replace(plan, info={**plan.info, "traced_by": "torch 2.11.0 on cuda"})
    with pytest.raises(
        LoweringError, match=r"the plan was traced by torch 2\.11\.0 on cuda, this program by torch"
    ):
        lower(other, older, _axes(plan, (0,)), device="cpu")


def test_axis_groups_must_match_the_plans_mesh(gpt_megatron):
    _, _, cap, plan = gpt_megatron
    with pytest.raises(LoweringError, match="do not match"):
        lower(cap, plan, [AxisGroup(axis=0, name="tp", size=4, coord=0, group=None)], device="cpu")
    with pytest.raises(LoweringError, match="do not match"):
        lower(cap, plan, _axes(plan, (0,)) * 2, device="cpu")


def test_data_parallel_weights_are_synced_once_at_the_weight_not_per_use(gpt_megatron):
    """Each data-parallel weight's gradient is all-reduced once, after all its uses have added
    into it: one ``grad_sync`` on the weight itself (the bucketing pass then merges them)."""
    model, inputs, cap, _ = gpt_megatron
    fixed = {n: ("R",) for n, _ in model.named_parameters()}
    plan = autopar.plan(model, inputs, autopar.Cluster.local(2), fixed=fixed, mesh_shape=(2,))
    gm = lower(cap, plan, _axes(plan, (0,)), device="cpu")
    syncs = [n for n in _calls(gm, C) if n.target is C.grad_sync]
    assert sorted(n.args[0].name for n in syncs) == sorted(cap.params)
    assert all(n.args[0].op == "placeholder" and len(n.args) == 2 for n in syncs)


def test_zero3_parameters_are_gathered_through_the_freeing_store(gpt_megatron):
    model, inputs, cap, _ = gpt_megatron
    fixed = {n: (f"S({max(range(p.dim()), key=lambda i: p.shape[i])})",) for n, p in model.named_parameters()}
    fixed.update({"args[0]": ("S(0)",), "args[1]": ("S(0)",)})
    plan = autopar.plan(model, inputs, autopar.Cluster.local(2), fixed=fixed, mesh_shape=(2,), zero_stage=3)
    assert set(plan.zero_stages().values()) == {3}
    gm = lower(cap, plan, _axes(plan, (1,)), device="cpu")
    gathered = {n.args[0].name for n in _calls(gm, C) if n.target is C.all_gather_param}
    assert gathered == {cap_name for cap_name, fqn in cap.params.items() if fqn in plan.zero_stages()}
    assert gm._gathered_params.used


def test_a_lowered_program_propagates_whatever_layout_attention_returns():
    """``y.transpose(1, 2).contiguous().view(b, t, c)`` after SDPA: the capture recorded no copy
    (the exported SDPA output was [b, t, h, d]-strided, its transpose contiguous), but the
    pipeline's fake propagation of the lowered program gets SDPA's math-path layout (contiguous
    [b, h, t, d]), and a ``view`` of its transpose fails ("Cannot view a tensor with shape …"). The
    lowering emits ``reshape`` for ``view``: a view where the layout allows, a copy where not."""
    from autopar.passes.rank_compiler import propagate_fake

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=128, vocab_size=VOCAB, block_size=32))
    inputs = (torch.randint(0, VOCAB, (2, 32)), torch.randint(0, VOCAB, (2, 32)))
    cluster = autopar.Cluster.local(1)
    plan = autopar.plan(model, inputs, cluster)
    cap = autopar.capture(model, inputs)
    gm = lower(cap, plan, _axes(plan, (0,)), device="cpu")
    assert not any(n.target is aten.view.default for n in gm.graph.nodes)
    captured = {n.name: n.meta["val"] for n in cap.gm.graph.nodes if n.op == "placeholder"}
    primals = [captured[n.name] for n in gm.graph.nodes if n.op == "placeholder"]  # one device: whole
    propagate_fake(gm, primals)
    out = next(n for n in gm.graph.nodes if n.op == "output")
    assert out.args[0][0].meta["val"].shape == ()

"""Context parallelism (``layouts.megatron(..., cp=k)``): the sequence split over a ``cp`` axis,
attention in its all-gather form (keys and values gathered, each rank attending with its own
queries; a causal mask aligned to their global positions), its all-to-all form (sequence traded
for heads) or its ring (keys and values passed around the axis, Megatron-Core's ``p2p``). Plans say
what the layout promises; on 2 and 4 gloo processes GPT-2, LLaMA and our GPT train three steps like
one process under each form, under cp = 2 × tp = 2 with sequence parallelism, and under pp = 2 × cp
= 2; ``best_megatron`` tunes cp and the auto plan finds it."""

from __future__ import annotations

import math
from typing import Any

import _runtime_helpers as H
import pytest
import torch

import autopar
from autopar.placement import Replicate, Shard, parse_spec
from autopar.program import ring_attention as RA
from autopar.program.local_ops import _masked_query_attention, causal_query_attention
from autopar.runtime.launch import spawn

pytestmark = pytest.mark.filterwarnings("ignore:autopar. no sharding rule")

ROWS = 1
"""Sequences in the batch: one, so the batch cannot be split and the sequence must be."""


def build(kind: str, rows: int = ROWS) -> tuple[torch.nn.Module, Any]:
    model, inputs = H.build(kind)
    if isinstance(inputs, dict):
        return model, {k: v[:rows] for k, v in inputs.items()}
    return model, tuple(v[:rows] for v in inputs)


def cp_plan(kind: str, world: int, tp: int = 1, comm: str | None = None) -> autopar.Plan:
    """Megatron's layout with context parallelism over ``world / tp`` ranks (and sequence
    parallelism on the tensor axis where ``tp > 1``)."""
    model, inputs = build(kind)
    cluster = autopar.Cluster.local(world)
    return autopar.layouts.megatron(
        model, inputs, cluster, tp=tp, cp=world // tp, cp_comm_type=comm, sequence_parallel=tp > 1
    )


def striped_plan(kind: str) -> autopar.Plan:
    """One sequence over 2 ranks with every causal attention's queries striped (``S(2)x8``: the
    rule's balanced form, ``autopar.rules.attention``), the rest as the solver likes."""
    from autopar.capture import capture
    from autopar.config import PlanConfig
    from autopar.graph import OpFamily, op_family
    from autopar.planner import plan_captured

    model, inputs = build(kind)

    def striped(node: Any, s: Any) -> bool:
        if op_family(node) is not OpFamily.ATTENTION or not s.inputs or s.inputs[0] is None:
            return True
        q = s.inputs[0][0]
        return isinstance(q, Shard) and q.blocks > 1

    return plan_captured(
        capture(model, inputs), autopar.Cluster.local(2), PlanConfig(mesh_shape=(2,)), node_constraint=striped
    )


def attention_nodes(plan: autopar.Plan) -> list[Any]:
    return [n for n in plan.nodes if n.kind == "op" and n.op == "scaled_dot_product_attention"]


# ------------------------------------------------------------------------------------ local op


@pytest.mark.parametrize(
    "pieces", [((0, 8),), ((8, 16),), ((4, 8),), ((0, 4), (12, 16)), ((2, 4), (6, 8), (10, 12), (14, 16))]
)
def test_causal_query_attention_gives_the_rows_of_whole_causal_attention(pieces: tuple) -> None:
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 16, 8, dtype=torch.float64) for _ in range(3))
    whole = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    rows = torch.cat([torch.arange(lo, hi) for lo, hi in pieces])
    got = causal_query_attention(q[:, :, rows], k, v, pieces)
    torch.testing.assert_close(got, whole[:, :, rows])
    # the form fake tensors and traced programs run: one explicit mask
    masked = _masked_query_attention(q[:, :, rows], k, v, pieces, 0.0, None, False)
    torch.testing.assert_close(masked, whole[:, :, rows])


def _ring_by_hand(n: int, blocks: int, causal: bool, kv_heads: int = 3, length: int = 0) -> None:
    """The ring's steps (``program.ring_attention.play_ring``) played for every device of an
    ``n``-device ring in one process — each device's queries against each source's keys, the
    partial results merged, the gradients of each step's keys added to their owner's — against
    whole attention, forward and backward."""
    torch.manual_seed(0)
    length = length or 16 * n * blocks
    q = torch.randn(2, 6, length, 8, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, kv_heads, length, 8, dtype=torch.float64, requires_grad=True) for _ in range(2))
    whole = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=causal, enable_gqa=kv_heads < 6
    )
    dout = torch.randn_like(whole)
    whole.backward(dout)
    got = RA.play_ring(q.detach(), k.detach(), v.detach(), dout, n, blocks, causal)
    for name, mine, ref in zip(("out", "dq", "dk", "dv"), got, (whole, q.grad, k.grad, v.grad)):
        torch.testing.assert_close(mine, ref, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize(
    "n, blocks, causal, length",
    [(2, 1, True, 0), (2, 8, True, 0), (4, 2, True, 0), (3, 1, False, 0), (2, 2, False, 0),
     (2, 32, True, 64), (4, 16, True, 64), (3, 16, True, 48)],
)  # fmt: skip
def test_the_rings_steps_add_up_to_whole_attention(n: int, blocks: int, causal: bool, length: int) -> None:
    """Contiguous, striped in blocks of several positions, and in stripes of one position (one
    causal kernel a step, ``ring_attention.step_plan``)."""
    _ring_by_hand(n, blocks, causal, length=length)


@pytest.mark.parametrize("kernel", ["cpu", "math"])
def test_the_ring_runs_grouped_query_heads_on_either_kernel(
    kernel: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Keys and values with a third of the queries' heads travel unrepeated and are repeated per
    block; the plain-ops kernel (CUDA in fp32) gives what the flash kernel gives."""
    monkeypatch.setattr(RA, "_kernel", lambda q: kernel)
    _ring_by_hand(2, 2, True, kv_heads=2)
    _ring_by_hand(2, 32, True, kv_heads=2, length=64)


def test_the_flash_kernels_are_called_as_their_schemas_say() -> None:
    """The CUDA FlashAttention calls, forward and backward, on meta tensors (no GPU here): the
    arguments their schemas take, the shapes back."""
    q = torch.empty(1, 2, 16, 64, dtype=torch.bfloat16, device="meta")
    assert RA._kernel(q) == "flash"
    out, lse = RA.block_forward(q, q, q, True, None)
    assert out.shape == q.shape and lse.shape == (1, 2, 16) and lse.dtype == torch.float32
    assert all(g.shape == q.shape for g in RA.block_backward(out, q, q, q, out, lse, True, None))


def test_a_ring_step_plan_sees_each_key_piece_once() -> None:
    """Striped pieces (two blocks over two devices: device 0 holds 0:4 and 8:12, device 1 4:8 and
    12:16): at step 0 each query piece sees the earlier pieces of its own device whole and itself
    causally; at step 1 device 1 sees both of device 0's earlier pieces, device 0 only the first
    piece of device 1 (for its second piece)."""
    d0, d1 = ((0, 4), (8, 12)), ((4, 8), (12, 16))
    assert RA.block_plan(d0, d0, True) == (
        RA.QueryBlock((0, 4), 0, (0, 4)),
        RA.QueryBlock((4, 8), 4, (4, 8)),
    )
    assert RA.block_plan(d1, d0, True) == (RA.QueryBlock((0, 4), 4, None), RA.QueryBlock((4, 8), 8, None))
    assert RA.block_plan(d0, d1, True) == (RA.QueryBlock((4, 8), 4, None),)
    assert RA.block_plan(d0, d1, False) == (RA.QueryBlock((0, 8), 8, None),)
    with pytest.raises(ValueError, match="share one sequence split"):
        RA.block_plan(((0, 4),), ((2, 6),), True)
    # stripes of one position, 16 over 2 devices: one causal kernel a step, its own keys and
    # those before it (device 1 against device 0) over every row, those after it one row later
    assert (
        RA.step_plan(16, 8, 2, 1, 0, True)
        == RA.step_plan(16, 8, 2, 0, 0, True)
        == (RA.QueryBlock((0, 8), 0, (0, 8)),)
    )
    assert RA.step_plan(16, 8, 2, 0, 1, True) == (RA.QueryBlock((1, 8), 0, (0, 7)),)
    assert RA.step_plan(16, 2, 2, 0, 1, True) == RA.block_plan(
        RA.stripes(16, 2, 2, 0), RA.stripes(16, 2, 2, 1), True
    )


def test_the_rings_causal_share_is_the_sum_of_each_steps_busiest_device() -> None:
    """``cost.ring_attention.striped_ring_share`` against pairs counted one by one over the steps:
    contiguous pieces keep some device busy every step (three quarters of its dense pairs over two
    devices, where the balanced figure is a half), stripes balance every step, stripes of one
    position to a half."""
    from autopar.cost.ring_attention import striped_ring_share

    def counted(length: int, blocks: int, n: int) -> float:
        held = [[p for lo, hi in RA.stripes(length, blocks, n, c) for p in range(lo, hi)] for c in range(n)]
        busiest = [
            max(sum(1 for i in held[c] for j in held[(c - s) % n] if j <= i) for c in range(n))
            for s in range(n)
        ]
        return sum(busiest) / (len(held[0]) * length)

    for length, blocks, n in [(64, 1, 2), (64, 8, 2), (64, 2, 4), (96, 4, 3), (64, 32, 2), (64, 16, 4)]:
        assert striped_ring_share(length, blocks, n) == pytest.approx(counted(length, blocks, n)), (blocks, n)
    assert striped_ring_share(1024, 1, 2) == pytest.approx(0.75, abs=1e-3)
    assert striped_ring_share(1024, 1, 4) == pytest.approx(3.5 / 4, abs=1e-3)  # (n − ½)/n
    assert 0.5 < striped_ring_share(1024, 8, 2) < 0.56
    assert striped_ring_share(1024, 256, 4) == pytest.approx((256 + 1) / 512)  # one position a stripe
    assert striped_ring_share(1024, 1, 2, causal=False) == 1.0


# --------------------------------------------------------------------------------------- plans


@pytest.mark.parametrize("kind", H.MODELS)
@pytest.mark.parametrize("comm", ["all_gather", "a2a", "p2p", None])
def test_context_parallel_plan_splits_the_sequence_and_attention(kind: str, comm: str | None) -> None:
    plan = cp_plan(kind, 2, comm=comm)
    cp = plan.mesh_axes.index("cp")
    assert plan.mesh_shape[cp] == 2
    for path, spec in plan.inputs.items():
        assert parse_spec(spec)[cp] == Shard(1), (path, spec)
    for name, spec in plan.param_placements().items():
        assert parse_spec(spec)[cp] == Replicate(), f"{name} is {spec}: weights are whole along cp"
    attn = attention_nodes(plan)
    assert attn
    for n in attn:
        q = parse_spec(n.inputs[0])[cp]
        seq = len(n.shape) - 2
        ring = n.rewrites[cp] == "ring_attention"
        form = "a2a" if q == Shard(1) else "p2p" if ring else "all_gather" if q.dim == seq else None
        assert form is not None, f"{n.name}: queries {n.inputs[0]} are not split along cp"
        assert comm is None or form == comm, (n.name, n.inputs, comm)
        if form == "all_gather":
            assert all(parse_spec(s)[cp] == Replicate() for s in n.inputs[1:3]), n.inputs
        if form == "p2p":  # keys and values split as the queries are, none gathered
            assert n.inputs[1] == n.inputs[2] == n.inputs[0] and n.comms[cp] == "ring_attention", n
            into = [r for r in plan.reshards if r.consumer == n.name]
            assert all(parse_spec(r.dst)[cp] != Replicate() for r in into), into
    loss = [n for n in plan.nodes if n.op in ("cross_entropy_loss", "nll_loss_forward")]
    assert loss and all(n.split[cp] for n in loss), "the loss runs on each rank's own tokens"
    assert not autopar.audit.audit(plan).warnings, autopar.audit.audit(plan)


def _one_layer(kind: str, kv_heads: int = 8) -> tuple[torch.nn.Module, Any]:
    """One 8192-token sequence through one layer on the meta device, bf16: our GPT (``is_causal``),
    transformers' LLaMA (its mask proven causal at capture: ``is_causal``), or LLaMA given an
    ``attention_mask`` (a triangle mask combined with the padding, kept in the graph)."""
    ids = torch.empty(1, 8192, dtype=torch.long, device="meta")
    with torch.device("meta"):
        if kind == "gpt":
            from autopar.models import GPT, GPTConfig

            cfg = GPTConfig(n_layer=1, n_head=8, n_embd=1024, block_size=8192, vocab_size=1024)
            return GPT(cfg).to(torch.bfloat16), (ids, ids.clone())
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(
            num_hidden_layers=1, hidden_size=1024, num_attention_heads=8, num_key_value_heads=kv_heads,
            intermediate_size=2048, vocab_size=1024, max_position_embeddings=8192, use_cache=False,
        )  # fmt: skip
        batch = {"input_ids": ids, "labels": ids.clone()}
        if kind == "llama padded":
            batch["attention_mask"] = torch.ones(1, 8192, dtype=torch.long, device="meta")
        return LlamaForCausalLM(cfg).to(torch.bfloat16), batch


@pytest.mark.parametrize("kind", ["gpt", "llama", "llama padded"])
def test_causal_attention_over_a_query_shard_is_costed_for_its_busiest_rank(kind: str) -> None:
    """The all-gather form of causal attention costs what the rank with the most unmasked pairs
    runs. With ``is_causal`` (aligned by the ``causal_queries`` rewrite) the solver stripes the
    queries (``S(2)x8``: each rank one piece of every block) so the ranks' causal work is nearly
    even: within 20 % of the all-to-all form, which splits the heads and keeps the causal kernel's
    halving. A triangle mask split with the queries (padded LLaMA) is read, nothing skipped: about
    twice the all-to-all form — it was once priced by the top-left causal fraction of a short
    query block against all keys, near nothing: a 131 072-token LLaMA plan predicted 141 % of the
    devices' peak."""
    model, inputs = _one_layer(kind)
    cluster = autopar.Cluster.preset("H100-SXM", gpus_per_node=2, nodes=1)
    time = {}
    for comm in ("all_gather", "a2a"):
        plan = autopar.layouts.megatron(model, inputs, cluster, tp=1, cp=2, cp_comm_type=comm)
        (n,) = attention_nodes(plan)
        causal = comm == "all_gather" and kind != "llama padded"
        assert ("causal_queries" in n.rewrites) == causal, n.rewrites
        if causal:
            assert "S(2)x8" in n.inputs[0], n.inputs
        time[comm] = n.compute_time
    ratio = time["all_gather"] / time["a2a"]
    assert (1.6 < ratio < 2.2) if kind == "llama padded" else (1.0 <= ratio < 1.2), time


def test_the_ring_is_costed_as_the_all_to_all_form_plus_its_last_send() -> None:
    """One 8192-token layer on two H100s: the ring (queries, keys and values in stripes of one
    position) computes what the all-to-all form computes — a causal kernel's half of the pairs,
    within 0.1 % — where the striped all-gather form's busiest rank runs more; its keys and values
    pass behind the steps' compute, and what is left exposed is the last send of the keys' and
    values' gradients home (``cost.ring_attention``)."""
    from autopar.cost.ring_attention import ring_exposed_time

    model, inputs = _one_layer("llama")
    cluster = autopar.Cluster.preset("H100-SXM", gpus_per_node=2, nodes=1)
    got = {}
    for comm in ("all_gather", "a2a", "p2p"):
        plan = autopar.layouts.megatron(model, inputs, cluster, tp=1, cp=2, cp_comm_type=comm)
        (got[comm],) = attention_nodes(plan)
    ring = got["p2p"]
    assert ring.inputs[0] == ring.inputs[1] == ring.inputs[2] and "S(2)x4096" in ring.inputs[0]
    assert ring.compute_time == pytest.approx(got["a2a"].compute_time, rel=1e-3), (ring, got["a2a"])
    assert ring.compute_time < got["all_gather"].compute_time
    kv = 2 * 8 * 4096 * 128 * 2  # keys and values of one rank, bf16
    mesh = autopar.mesh.Mesh.full((2,), cluster)
    send = mesh.p2p_cost(kv, 0)
    assert ring.comm_time == pytest.approx(send, rel=1e-6), (ring.comm_time, send)
    # where the compute is short the passing shows: four times the bytes, a tenth of the compute
    fwd, bwd = ring_exposed_time(
        2, 4 * kv, ring.compute_time / 30, ring.compute_time / 15, lambda b: mesh.p2p_cost(b, 0)
    )
    assert fwd > 0 and bwd > mesh.p2p_cost(4 * kv, 0)


def test_the_causal_share_of_a_query_shard() -> None:
    """``cost.compute.causal_share``: the last of two contiguous chunks keeps three quarters of its
    pairs, the first a quarter; striped in 8 blocks both keep about half."""
    from autopar.cost.compute import causal_share
    from autopar.placement import Shard, shard_slices

    seq = 1024
    assert causal_share(seq, [(512, 1024)]) == pytest.approx(0.75, abs=1e-3)
    assert causal_share(seq, [(0, 512)]) == pytest.approx(0.25, abs=1e-3)
    assert causal_share(seq, [(0, seq)]) == pytest.approx(0.5, abs=1e-3)
    striped = [causal_share(seq, shard_slices((seq,), (Shard(0, 8),), (2,), (r,))[0]) for r in range(2)]
    assert all(0.46 < x < 0.54 for x in striped), striped
    assert sum(striped) / 2 == pytest.approx(0.5, abs=1e-3)


def test_cp_arguments_are_checked_before_planning() -> None:
    model, inputs = build("gpt")
    cluster = autopar.Cluster.local(2)
    with pytest.raises(ValueError, match=r"16 positions: 16 / 3"):
        autopar.layouts.megatron(model, inputs, autopar.Cluster.local(3), tp=1, cp=3)
    with pytest.raises(ValueError, match="a2a\\+p2p"):
        autopar.layouts.megatron(model, inputs, cluster, tp=1, cp=2, cp_comm_type="a2a+p2p")
    with pytest.raises(ValueError, match=r"tp=1 × cp=4 = 4 does not divide the world size 2"):
        autopar.layouts.megatron(model, inputs, cluster, tp=1, cp=4)


# ------------------------------------------------------------------------------------ training


def ring_shifts(pm: Any) -> int:
    """All-to-alls of the step program that send to one device only: the ring's passes (a reshard's
    all-to-all sends to every device of its axis)."""
    if pm.step is None:
        return 0
    a2a = torch.ops._c10d_functional.all_to_all_single.default
    return sum(
        1 for n in pm.step.joint.graph.nodes if n.target is a2a and sum(1 for s in n.args[2] if s) == 1
    )


def train_worker(rank: int, world: int, plans: dict[str, Any]) -> dict[str, Any]:
    H.quiet()
    out: dict[str, Any] = {}
    cluster = autopar.Cluster.local(world)
    built: dict[tuple[str, int], tuple[Any, Any, dict[str, torch.Tensor], Any]] = {}
    for label, (kind, rows, plan) in plans.items():
        if (kind, rows) not in built:  # each model captured once, its layouts built from that
            model, inputs = build(kind, rows)
            initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
            built[(kind, rows)] = (model, inputs, initial, autopar.capture(model, inputs))
        model, inputs, initial, cap = built[(kind, rows)]
        piped = plan.pipeline is not None and plan.pipeline.pp > 1  # captured on one micro-batch
        pm = autopar.parallelize(model, cluster, inputs, plan=plan, captured=None if piped else cap)
        res = {}
        for optimizer in ("adamw", "sgd"):
            pm.load_full_state_dict(initial)
            losses = H.train(pm, inputs, H.make_optimizer(optimizer, pm.parameters()))
            res[optimizer] = (losses, pm.full_state_dict())
        res["shifts"] = ring_shifts(pm)
        out[label] = res
    return out


def reference(kind: str, rows: int, optimizer: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    model, inputs = build(kind, rows)
    losses = H.train(model, inputs, H.make_optimizer(optimizer, model.parameters()))
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


TRAINED_FORMS = {
    "all_gather": ("gpt2", "llama"),
    "a2a": ("llama", "gpt"),
    "p2p": H.MODELS,
    "striped": ("gpt2", "llama"),
}
"""The models each form of attention trains on 2 processes: the ring (``p2p``, the most
machinery) on all three; the gather and the all-to-all on LLaMA (grouped key-value heads) and one
other each, the striped ring on GPT-2 and LLaMA (planned on all three)."""


@pytest.mark.distributed
@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", [2, 4], ids=lambda w: f"{w} processes")
def test_context_parallel_trains_like_one_process(world: int) -> None:
    """Also, on 2 processes: Megatron with tp = 1 (mesh dp = 2 × tp = 1) on LLaMA, whose RMSNorm
    weights' gradients were all-reduced twice over dp (the weight's own sync named the axis of one
    device, the consumer's did not, so each thought the other absent): doubled, and no test ran a
    mesh with an axis of one device."""
    if world == 2:
        plans = {
            f"{k} cp=2 {c}": (k, ROWS, cp_plan(k, 2, comm=c))
            for c in ("all_gather", "a2a", "p2p")
            for k in TRAINED_FORMS[c]
        }
        model, inputs = build("llama")
        plans["llama cp=2 p2p full recompute"] = (
            "llama",
            ROWS,
            autopar.layouts.megatron(
                model, inputs, autopar.Cluster.local(2), tp=1, cp=2, cp_comm_type="p2p", recompute="full"
            ),
        )
        for k in H.MODELS:
            striped = striped_plan(k)
            assert all("S(2)x8" in n.inputs[0] for n in attention_nodes(striped)), k
            if k in TRAINED_FORMS["striped"]:
                plans[f"{k} cp=2 striped"] = (k, ROWS, striped)
        dp = autopar.layouts.megatron(*build("llama", 2), autopar.Cluster.local(2), tp=1)
        assert tuple(dp.mesh_shape) == (2, 1)
        plans["llama dp=2 tp=1"] = ("llama", 2, dp)
    else:
        plans = {f"{k} cp=2 tp=2 sp": (k, ROWS, cp_plan(k, 4, tp=2)) for k in ("gpt2", "llama")}
        plans |= {
            f"{k} cp=2 tp=2 sp p2p": (k, ROWS, cp_plan(k, 4, tp=2, comm="p2p")) for k in ("gpt2", "llama")
        }
        model, inputs = build("llama", 2)  # two micro-batches of one sequence
        piped = autopar.layouts.megatron(
            model, inputs, autopar.Cluster.local(4), tp=1, cp=2, pp=2, microbatches=2
        )
        assert piped.pipeline is not None and dict(zip(piped.mesh_axes, piped.mesh_shape))["cp"] == 2
        plans["llama pp=2 cp=2"] = ("llama", 2, piped)
        # the distributed optimizer over dp × cp (Megatron-Core's data-parallel group with cp): a
        # weight whose one free dimension dp takes is split on it over cp too
        zero = autopar.layouts.megatron(
            model, inputs, autopar.Cluster.local(4), tp=1, cp=2, distributed_optimizer=True
        )
        placed = zero.param_placements()["model.layers.0.input_layernorm.weight"]
        assert dict(zip(zero.mesh_axes, placed)) == {"dp": "S(0)", "cp": "S(0)", "tp": "R"}, placed
        plans["llama dp=2 cp=2 distributed optimizer"] = ("llama", 2, zero)
    results = spawn(train_worker, world, plans, timeout=540)
    refs = {(k, r, o): reference(k, r, o) for k, r, _ in plans.values() for o in ("adamw", "sgd")}
    problems = []
    for rank, by_label in enumerate(results):
        for label, res in by_label.items():
            kind, rows, _ = plans[label]
            for opt in ("adamw", "sgd"):
                problems += H.compare_training(
                    refs[kind, rows, opt], res[opt], opt, f"rank {rank}, {label} ({opt})"
                )
            if "p2p" in label:  # per layer: one shift forward, one of the keys and two of their
                # gradients backward (and the forward's again where the layer is recomputed) — the
                # ring's passing, graph nodes of the step program
                layers = len(attention_nodes(plans[label][2]))
                want = (5 if "recompute" in label else 4) * layers
                if res["shifts"] != want:
                    problems.append(
                        f"rank {rank}, {label}: {res['shifts']} shifts in the program, not {want}"
                    )
    assert not problems, "\n".join(problems)


def test_grouped_query_keys_and_values_are_gathered_before_their_heads_repeat() -> None:
    """LLaMA with 2 key-value heads for 4 query heads under cp = 2: transformers repeats the key-value
    heads (``repeat_kv``: unsqueeze, expand, reshape) before attention, and the plan gathers the
    keys and values across cp for it. The gather runs on the key-value heads before the repeat —
    half the bytes, forward and backward — in the rank program and in the plan's price alike
    (``autopar.reshard.BroadcastChain``); the repeat lowered on the local pieces is left out.
    Training equal to one process: ``test_context_parallel_trains_like_one_process``."""
    from autopar.capture import capture
    from autopar.passes.lower import lower
    from autopar.placement import local_shape
    from autopar.program.collectives import AxisGroup
    from autopar.reshard import broadcast_chain, moved_before_broadcast, reshard_steps, unbroadcast_shape

    model, inputs = build("llama")
    plan = cp_plan("llama", 2, comm="all_gather")
    cap = capture(model, inputs)
    by_name = {n.name: n for n in cap.gm.graph.nodes}
    kv = [
        r
        for r in plan.reshards
        if by_name[r.consumer].target is torch.ops.aten.scaled_dot_product_attention.default
    ]
    chained = [r for r in kv if broadcast_chain(by_name[r.producer]) is not None]
    assert len(chained) == 4  # keys and values of both layers
    for r in chained:
        chain = broadcast_chain(by_name[r.producer])
        assert chain.times == 2 and chain.dim == 1
        full = tuple(by_name[r.producer].meta["val"].shape)
        steps = reshard_steps(full, parse_spec(r.src), parse_spec(r.dst), plan.mesh_shape)
        assert moved_before_broadcast(chain, steps)
        assert unbroadcast_shape(chain) == (full[0], full[1] // 2, *full[2:])
        # priced on the key-value heads: the gathered bytes are half those of the repeated heads
        itemsize = by_name[r.producer].meta["val"].element_size()
        small = (
            math.prod(local_shape(unbroadcast_shape(chain), parse_spec(r.dst), plan.mesh_shape)) * itemsize
        )
        whole = math.prod(local_shape(full, parse_spec(r.dst), plan.mesh_shape)) * itemsize
        assert r.bytes_per_axis[plan.mesh_axes.index("cp")] == small == whole / 2
    # the audit's bound counts those gradients at the key-value heads' size too: the plan never
    # moves less than its bound on an axis
    import autopar.audit

    (cp_comm,) = [c for c in autopar.audit.audit(plan).comm if c.axis == "cp"]
    assert cp_comm.plan_bytes >= cp_comm.bound_bytes > 0
    axes = [
        AxisGroup(axis=a, name=name, size=n, coord=0, group=None)
        for a, (name, n) in enumerate(zip(plan.mesh_axes, plan.mesh_shape))
    ]
    program = lower(cap, plan, axes, device="cpu")
    nodes = list(program.graph.nodes)
    expands = [n for n in nodes if n.target is torch.ops.aten.expand.default]
    gathered = [n for n in expands if n.args[0].op == "call_function" and "gather" in str(n.args[0].target)]
    assert len(gathered) == 4, [str(n.args[0].target) for n in expands]
    # the repeats lowered on the local pieces are gone: one expand per captured expand, no more
    assert len(expands) == sum(n.target is torch.ops.aten.expand.default for n in cap.gm.graph.nodes)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_the_ring_passes_grouped_query_heads_once_each(tp: int) -> None:
    """LLaMA with 2 key-value heads for 4 query heads on a ring of 2 (cp = 2 × tp): transformers
    repeats the key-value heads before attention (``repeat_kv``), and the ring passes each device's
    distinct heads once — half the repeated bytes at tp 1 (stride 2) and 2 (one head of two, each
    device's two query heads sharing it), and at tp 4 one head a device, each read by its one query
    head: nothing to save (``autopar.reshard.repeat_stride``). The lowered program slices them
    before the ring, and the plan's price of the ring is of the same bytes; their reorder into the
    ring's stripes (an all-to-all) runs before the repeat, or, at tp 4, after a slice to the
    device's one head. Training equal to one process:
    ``test_context_parallel_trains_like_one_process`` (cp = 2 and cp = 2 × tp = 2)."""
    from autopar.capture import capture
    from autopar.passes.lower import lower
    from autopar.program.collectives import AxisGroup
    from autopar.reshard import broadcast_chain, repeat_stride

    model, inputs = build("llama")
    plan = cp_plan("llama", 2 * tp, tp=tp, comm="p2p")
    cap = capture(model, inputs)
    by_name = {n.name: n for n in cap.gm.graph.nodes}
    want = {1: 2, 2: 2, 4: 1}[tp]
    for n in attention_nodes(plan):
        node = by_name[n.name]
        spec = parse_spec(n.inputs[0])
        for x in node.args[1:3]:
            assert broadcast_chain(x).times == 2
            assert repeat_stride(broadcast_chain(x), spec, plan.mesh_shape) == want, (tp, n.inputs)
    axes = [
        AxisGroup(axis=a, name=name, size=n, coord=0, group=None)
        for a, (name, n) in enumerate(zip(plan.mesh_axes, plan.mesh_shape))
    ]
    # the reorder into the ring's stripes runs before the repeat (``reshard.moved_before_broadcast``):
    # the keys' and values' all-to-alls move half the queries' bytes (2 key-value heads for 4)
    cp = plan.mesh_axes.index("cp")
    into = {}
    for r in plan.reshards:
        if by_name[r.consumer].target is torch.ops.aten.scaled_dot_product_attention.default:
            arg = by_name[r.consumer].args.index(by_name[r.producer])
            into.setdefault(r.consumer, {})[arg] = r.bytes_per_axis[cp]
            assert any(c.startswith(f"all_to_all(axis={cp},") for c in r.collectives), r
    assert len(into) == 2
    for moved in into.values():
        assert moved[1] == moved[2] == moved[0] / want, moved
    program = lower(cap, plan, axes, device="cpu")
    reordered = [
        n
        for n in program.graph.nodes
        if n.target is torch.ops.aten.expand.default and "all_to_all" in str(n.args[0].target)
    ]
    # keys and values of both layers reordered before their repeat; at tp 4 each device slices its
    # one head of the repeated four first (``reshard_steps``: slices before collectives), and the
    # reorder moves that head, as many bytes as the queries'
    assert len(reordered) == (4 if want > 1 else 0)
    rings = [n for n in program.graph.nodes if n.target is RA.ring_attention]
    assert len(rings) == len(attention_nodes(plan)) == 2
    for r in rings:
        for kv in r.args[1:3]:
            sliced = kv.target is torch.ops.aten.slice.Tensor
            assert sliced == (want > 1), kv.target
            if sliced:
                assert kv.args[1:] == (1, 0, None, want), kv.args
    # the price: the ring's comm on a 2-device ring of LLaMA with 8 query heads and 2 key-value
    # heads is what 8 key-value heads (no repeat) cost with a quarter of the bytes
    priced = {}
    cluster = autopar.Cluster.preset("H100-SXM", gpus_per_node=2, nodes=1)
    for kv_heads in (2, 8):
        m, batch = _one_layer("llama", kv_heads)
        p = autopar.layouts.megatron(m, batch, cluster, tp=1, cp=2, cp_comm_type="p2p")
        (priced[kv_heads],) = attention_nodes(p)
    mesh = autopar.mesh.Mesh.full((2,), cluster)
    kv_bytes = 2 * 8 * 4096 * 128 * 2  # 8 heads' keys and values of one rank, bf16
    assert priced[8].comm_time == pytest.approx(mesh.p2p_cost(kv_bytes, 0), rel=1e-6)
    assert priced[2].comm_time == pytest.approx(mesh.p2p_cost(kv_bytes / 4, 0), rel=1e-6)


# ------------------------------------------------------------------------------- best_megatron


def _long_gpt(batch: int) -> tuple[torch.nn.Module, tuple]:
    from autopar.models import GPT, GPTConfig

    with torch.device("meta"):
        cfg = GPTConfig(n_layer=2, n_head=8, n_embd=512, block_size=4096, vocab_size=4096)
        model = GPT(cfg).to(torch.bfloat16)
    ids = torch.empty(batch, 4096, dtype=torch.long, device="meta")
    return model, (ids, ids.clone())


@pytest.mark.timeout(300)
def test_best_megatron_tunes_cp_where_the_batch_cannot_fill_the_devices() -> None:
    """Two sequences on 8 devices at tp = pp = 1: dp = 8 and 4 cannot split them (cp = 1, 2), cp = 4
    can; cp = 8 is not tried once cp = 4 fits without recomputation (rule 7)."""
    model, inputs = _long_gpt(2)
    cluster = autopar.Cluster.preset("H100-SXM", gpus_per_node=8, nodes=1)
    best = autopar.layouts.best_megatron(model, inputs, cluster, tp=1, pp=1)
    tried = best.info["megatron_candidates"]
    why = {c["cp"]: c.get("why", "") for c in tried if c.get("skipped") and c.get("mbs") is None}
    assert "does not split over dp=8" in why[1] and "does not split over dp=4" in why[2], why
    assert "rule 7" in why[8], why
    assert {c["cp"] for c in tried if not c.get("skipped")} == {4}
    assert dict(zip(best.mesh_axes, best.mesh_shape)) == {"dp": 2, "cp": 4, "tp": 1}
    assert "cp=4" in best.info["layout"]


@pytest.mark.timeout(300)
def test_best_megatron_keeps_cp_1_where_data_parallelism_fills_the_devices() -> None:
    model, inputs = _long_gpt(8)
    cluster = autopar.Cluster.preset("H100-SXM", gpus_per_node=8, nodes=1)
    best = autopar.layouts.best_megatron(model, inputs, cluster, tp=1, pp=1)
    tried = best.info["megatron_candidates"]
    assert {c["cp"] for c in tried if not c.get("skipped")} == {1}
    assert any(c.get("skipped") and c["cp"] == 2 and "rule 7" in c["why"] for c in tried)
    assert "cp" not in best.mesh_axes


@pytest.mark.timeout(300)
def test_the_auto_plan_finds_context_parallelism_and_names_its_axis() -> None:
    """Two long sequences on 8 devices: the batch fills two; the planner splits the sequence over
    the other four, attention included (an axis it names ``cp``), and predicts no slower a step
    than the best Megatron layout with cp tuned."""
    model, inputs = _long_gpt(2)
    cluster = autopar.Cluster.preset("H100-SXM", gpus_per_node=8, nodes=1)
    plan = autopar.plan(model, inputs, cluster)
    assert "cp" in plan.mesh_axes, plan.mesh_axes
    cp = plan.mesh_axes.index("cp")
    assert plan.mesh_shape[cp] > 1
    assert all(n.split[cp] for n in attention_nodes(plan))
    best = autopar.layouts.best_megatron(model, inputs, cluster, tp=1, pp=1)
    assert plan.predicted.step_time <= best.predicted.step_time * 1.001


@pytest.mark.timeout(300)
def test_the_distributed_optimizer_reduces_gradients_over_dp_and_cp_together() -> None:
    """Megatron-Core shards the optimizer over data and context ranks together and reduce-scatters
    the gradients over both. LLaMA's 2-D weights are split by tp on one dimension and by dp on the
    other: with nothing left for cp, cp shares dp's dimension (``S(1)`` on both) where it once kept
    a whole copy and all-reduced the whole gradient there: the weights' bytes on cp ``dp`` times
    the gradients' bound (the 405B published row's audit warned: 4.2× on cp)."""
    import autopar.audit

    model, inputs = _one_layer("llama")
    inputs = {k: v.expand(2, -1).contiguous() for k, v in inputs.items()}
    cluster = autopar.Cluster.preset("H100-SXM", gpus_per_node=8, nodes=1)
    plan = autopar.layouts.megatron(
        model, inputs, cluster, tp=2, cp=2, sequence_parallel=True, distributed_optimizer=True
    )
    assert dict(zip(plan.mesh_axes, plan.mesh_shape)) == {"dp": 2, "cp": 2, "tp": 2}
    placed = plan.param_placements()["model.layers.0.self_attn.q_proj.weight"]
    assert dict(zip(plan.mesh_axes, placed)) == {"dp": "S(1)", "cp": "S(1)", "tp": "S(0)"}, placed
    (cp,) = [c for c in autopar.audit.audit(plan).comm if c.axis == "cp"]
    params = {n.name for n in plan.nodes if n.kind == "param"}
    a = plan.mesh_axes.index("cp")
    weights = sum(r.bytes_per_axis[a] for r in plan.reshards if r.producer in params)
    assert cp.gradient_bytes <= weights < 1.5 * cp.gradient_bytes, (weights, cp)

"""Rank-program passes on hand-built whole-step programs (single process: functional collectives
trace with fake tensors and need no process group; the group names are plain strings).

Each program is a tiny forward written with the runtime's differentiable collectives' building
blocks, traced with its backward by ``trace_joint``; the tests check what each pass moves, merges
or copies, and that the partition saves what it should.
"""

from __future__ import annotations

import itertools

import torch

from autopar.config import PlanConfig
from autopar.passes import PassContext
from autopar.passes.gather_buffers import gather_into_buffers
from autopar.passes.joint import PHASE, RANK, Phase, PrimalInfo, RankInfo, partition, trace_joint
from autopar.passes.overlap import bucket_gradients, prefetch_params, regather_zero3_params, sink_waits
from autopar.program.records import FUNCTIONAL_COLLECTIVES

fc = torch.ops._c10d_functional
GROUP = "dp_group"


class GradSync(torch.autograd.Function):
    """Megatron's ``f`` written with functional collectives, as ``autopar.program.collectives``."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return fc.wait_tensor(fc.all_reduce(g, "sum", GROUP))


class Gather(torch.autograd.Function):
    """A ZeRO parameter gather along dim 0 over 2 ranks (backward: reduce-scatter)."""

    @staticmethod
    def forward(ctx, x):
        return fc.wait_tensor(fc.all_gather_into_tensor(x.contiguous(), 2, GROUP))

    @staticmethod
    def backward(ctx, g):
        return fc.wait_tensor(fc.reduce_scatter_tensor(g.contiguous(), "sum", 2, GROUP))


class _Ctx:
    def __init__(self, **disable: object) -> None:
        self.config = PlanConfig()


def _ctx() -> PassContext:
    return _Ctx()  # the passes read only ``ctx.config``


def dp_program(*params: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Three linear layers whose weights are data-parallel (synced at the weight)."""
    h = x
    for w in params:
        h = torch.relu(h @ GradSync.apply(w))
    return h.sum()


def zero3_program(*shards: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    h = x
    for s in shards:
        h = torch.tanh(h @ Gather.apply(s))
    return h.sum()


def _joint(fn, params, x, kinds):
    def program(*args):
        return (fn(*args[:-1], x=args[-1]),)

    primals = [*params, x]
    jp = trace_joint(program, primals, list(range(len(params))))
    jp.gm.meta[RANK] = RankInfo(
        primals=(*tuple(kinds), PrimalInfo("input", "x")), num_outputs=1, axis_names={GROUP: "dp"}
    )
    return jp


def _collectives(gm, phase=None):
    return [
        n
        for n in gm.graph.nodes
        if n.op == "call_function"
        and n.target in FUNCTIONAL_COLLECTIVES
        and (phase is None or n.meta.get(PHASE) == phase)
    ]


def test_trace_joint_records_both_directions_and_partition_saves_forward_values():
    params = [torch.randn(8, 8) for _ in range(3)]
    jp = _joint(dp_program, params, torch.randn(4, 8), [PrimalInfo("param", f"w{i}") for i in range(3)])
    # The forward has no collective; backward one all-reduce per weight (Megatron's f).
    assert not _collectives(jp.gm, Phase.FWD)
    ars = _collectives(jp.gm, Phase.BWD)
    assert [n.target for n in ars] == [fc.all_reduce.default] * 3
    parts = partition(jp)
    fwd_ops = {n.target for n in parts.forward.graph.nodes if n.op == "call_function"}
    assert torch.ops.aten.mm.default in fwd_ops and fc.all_reduce.default not in fwd_ops
    assert len(_collectives(parts.backward)) == 3
    # Running the two programs gives autograd's gradients (a one-rank 'all-reduce' is the identity
    # here: replace the collectives by identities to run without a process group).
    x = torch.randn(4, 8)
    ref = [p.clone().requires_grad_() for p in params]
    h = x
    for w in ref:
        h = torch.relu(h @ w)
    h.sum().backward()
    for gm in (parts.forward, parts.backward):
        for n in list(gm.graph.nodes):
            if n.op == "call_function" and (
                n.target in FUNCTIONAL_COLLECTIVES or n.target is fc.wait_tensor.default
            ):
                n.replace_all_uses_with(n.args[0])
                gm.graph.erase_node(n)
        gm.recompile()
    res = parts.forward(*params, x)
    out, saved = res[:1], res[1:]
    grads = parts.backward(*saved, torch.ones(()))
    assert torch.allclose(out[0], dp_program(*params, x=x))
    for g, r in zip(grads, ref):
        assert torch.allclose(g, r.grad)


def test_bucket_gradients_merges_the_weight_all_reduces_into_flat_buckets():
    from autopar.cost.timeline import GRADIENT_BUCKETS

    params = [torch.randn(8, 8) for _ in range(16)]
    infos = [PrimalInfo("param", f"w{i}") for i in range(16)]
    gm = bucket_gradients(_joint(dp_program, params, torch.randn(4, 8), infos).gm, _ctx())
    # Each bucket holds at most 1/GRADIENT_BUCKETS of the gradients (what the simulator plays:
    # the last bucket, issued when the backward ends, is that share): 8 buckets of 2.
    ars = _collectives(gm, Phase.BWD)
    assert len(ars) == GRADIENT_BUCKETS == 8
    for ar in ars:
        assert ar.args[0].target is torch.ops.aten.cat.default and len(ar.args[0].args[0]) == 2
        assert ar.meta["val"].numel() == 2 * 64
    # DDP's byte cap splits them further (buckets fill in backward order): one gradient each.
    gm2 = bucket_gradients(
        _joint(dp_program, params, torch.randn(4, 8), infos).gm, _ctx(), bucket_bytes=64 * 4
    )
    assert sorted(n.meta["val"].numel() for n in _collectives(gm2, Phase.BWD)) == [64] * 16
    # Three gradients: fewer than GRADIENT_BUCKETS, so each is reduced on its own, as it is ready.
    three = _joint(dp_program, params[:3], torch.randn(4, 8), infos[:3]).gm
    assert len(_collectives(bucket_gradients(three, _ctx()), Phase.BWD)) == 3


def test_bucket_gradients_leaves_collectives_whose_result_backward_still_uses():
    """An all-reduce feeding more backward compute (Megatron's f on an activation) is not a
    gradient output: it stays where it is."""

    def program(w1, w2, x):
        h = GradSync.apply(x @ w1)  # f on an activation: its gradient feeds w1's gradient
        return ((h @ w2).sum(),)

    jp = trace_joint(program, [torch.randn(8, 8), torch.randn(8, 8), torch.randn(4, 8)], [0, 1])
    jp.gm.meta[RANK] = RankInfo(primals=(), num_outputs=1, axis_names={})
    before = len(_collectives(jp.gm))
    gm = bucket_gradients(jp.gm, _ctx())
    assert len(_collectives(gm)) == before == 1
    assert not any(n.target is torch.ops.aten.cat.default for n in gm.graph.nodes if n.op == "call_function")


def test_sink_waits_moves_each_wait_to_its_first_use():
    params = [torch.randn(8, 8) for _ in range(3)]
    jp = _joint(dp_program, params, torch.randn(4, 8), [PrimalInfo("param", f"w{i}") for i in range(3)])
    gm = sink_waits(jp.gm, _ctx())
    nodes = list(gm.graph.nodes)
    waits = [n for n in nodes if n.op == "call_function" and n.target is fc.wait_tensor.default]
    assert waits
    for w in waits:
        first = min(w.users, key=nodes.index)
        between = nodes[nodes.index(w) + 1 : nodes.index(first)]
        assert all(b.target is fc.wait_tensor.default for b in between)  # waits line up, nothing else
    # The weight gradients' all-reduces are only returned: every wait sits at the very end, after
    # all the backward compute they can overlap.
    out = nodes[-1]
    compute = [n for n in nodes if n.op == "call_function" and n.target is torch.ops.aten.mm.default]
    assert all(nodes.index(w) > nodes.index(compute[-1]) for w in waits)
    assert all(set(w.users) == {out} for w in waits)


def test_regather_zero3_params_saves_only_the_shards_and_gathers_again_in_backward():
    shards = [torch.randn(4, 8) for _ in range(3)]
    kinds = [PrimalInfo("param", f"w{i}", zero_stage=3) for i in range(3)]
    jp = _joint(zero3_program, shards, torch.randn(4, 8), kinds)
    gathered_full = [
        n
        for n in jp.gm.graph.nodes
        if n.op == "call_function" and n.target is fc.wait_tensor.default and n.meta.get(PHASE) == Phase.FWD
    ]
    before = partition(jp)
    saved_shapes_before = [
        tuple(n.meta["val"].shape)
        for n in before.forward.graph.nodes
        if n.op == "output"
        for n in n.args[0][1:]
    ]
    assert (8, 8) in saved_shapes_before  # without the pass the gathered weights are saved
    read_by_backward = [
        w for w in gathered_full if any(u.meta.get(PHASE) == Phase.BWD for u in _users_through_views(w))
    ]
    gm = regather_zero3_params(jp.gm, _ctx())
    bwd_gathers = [n for n in _collectives(gm, Phase.BWD) if n.target is fc.all_gather_into_tensor.default]
    # Layer 0's input needs no gradient, so its weight is not read by backward: 2 of 3 re-gathered.
    assert len(bwd_gathers) == len(read_by_backward) == 2
    after = partition(jp)
    out = next(n for n in after.forward.graph.nodes if n.op == "output")
    saved_shapes = [tuple(s.meta["val"].shape) for s in out.args[0][1:]]
    assert (8, 8) not in saved_shapes  # only shards (4, 8) and activations are saved


def _users_through_views(n):
    out = []
    for u in n.users:
        if u.op == "call_function" and u.target in (torch.ops.aten.view.default, torch.ops.aten.t.default):
            out += [u, *_users_through_views(u)]
        else:
            out.append(u)
    return out


def test_prefetch_issues_each_zero3_gather_while_the_previous_layer_computes():
    """In each direction, gather k is issued before layer k-1's first use of its own gathered
    weight, so the transfer runs while layer k-1 computes; without the pass it is issued only
    after layer k-1 is done."""
    shards = [torch.randn(4, 8) for _ in range(3)]
    kinds = [PrimalInfo("param", f"w{i}", zero_stage=3) for i in range(3)]

    def layout(prefetch: bool):
        jp = _joint(zero3_program, shards, torch.randn(4, 8), kinds)
        gm = regather_zero3_params(jp.gm, _ctx())
        if prefetch:
            gm = prefetch_params(gm, _ctx())
        gm = sink_waits(gm, _ctx())
        nodes = list(gm.graph.nodes)
        out = {}
        for phase in (Phase.FWD, Phase.BWD):
            gathers = [n for n in _collectives(gm, phase) if n.target is fc.all_gather_into_tensor.default]
            first_use = {g: min(nodes.index(u) for w in g.users for u in w.users) for g in gathers}
            gathers.sort(key=first_use.get)
            out[phase] = [(nodes.index(cur) < first_use[prev]) for prev, cur in itertools.pairwise(gathers)]
        return out

    on, off = layout(True), layout(False)
    assert on[Phase.FWD] == [True, True] and on[Phase.BWD] == [True]
    assert off[Phase.FWD] == [False, False] and off[Phase.BWD] == [False]


def test_gather_into_buffers_moves_every_gather_onto_the_out_path_on_gloo_only():
    """On gloo each all-gather issue becomes a buffer of the gathered shape and the functional op's
    ``out=`` form into it (``ProcessGroupGloo::_allgather_base``, not the coalesced path that
    corrupts the heap with several in flight), in the same place: the prefetched order and every
    wait are kept. On NCCL the program is left as it is."""
    from autopar.cluster import Cluster

    shards = [torch.randn(4, 8) for _ in range(3)]
    kinds = [PrimalInfo("param", f"w{i}", zero_stage=3) for i in range(3)]

    def program(backend: str):
        jp = _joint(zero3_program, shards, torch.randn(4, 8), kinds)
        gm = jp.gm
        for p in (regather_zero3_params, prefetch_params, sink_waits):
            gm = p(gm, _ctx())
        ctx = _ctx()
        ctx.cluster = Cluster.local(2) if backend == "gloo" else Cluster.preset("H100-SXM")
        before = [(n.meta.get(PHASE), n.args[0].name) for n in _collectives(gm) if "gather" in str(n.target)]
        return before, gather_into_buffers(gm, ctx)

    before, gm = program("gloo")
    nodes = list(gm.graph.nodes)
    gathers = [n for n in _collectives(gm) if "gather" in str(n.target)]
    assert len(before) == 5  # three in forward, two regathered in backward
    assert [(n.meta.get(PHASE), n.args[0].name) for n in gathers] == before
    for g in gathers:
        assert g.target is fc.all_gather_into_tensor_out.default
        buf = g.kwargs["out"]
        assert buf.target is torch.ops.aten.new_empty.default and buf.args[0] is g.args[0]
        assert tuple(buf.args[1]) == (8, 8) == tuple(g.meta["val"].shape)
        assert nodes.index(buf) < nodes.index(g)
        (w,) = g.users
        assert w.target is fc.wait_tensor.default
    # still prefetched: the second gather of forward is issued before the first one's value is used
    fwd = [g for g in gathers if g.meta.get(PHASE) == Phase.FWD]
    first_use = min(nodes.index(u) for u in next(iter(fwd[0].users)).users)
    assert nodes.index(fwd[1]) < first_use

    before, gm = program("nccl")
    assert all(
        n.target is fc.all_gather_into_tensor.default for n in _collectives(gm) if "gather" in str(n.target)
    )


def test_passes_can_be_turned_off_by_name():
    from autopar.passes import run_passes

    params = [torch.randn(8, 8) for _ in range(3)]
    jp = _joint(dp_program, params, torch.randn(4, 8), [PrimalInfo("param", f"w{i}") for i in range(3)])
    ctx = _ctx()
    ctx.config = PlanConfig(disable=("bucket_gradients",))
    ctx.timings = {}
    gm = run_passes(jp.gm, ctx, [bucket_gradients, sink_waits])
    assert len(_collectives(gm, Phase.BWD)) == 3
    assert "bucket_gradients" not in ctx.timings and "sink_waits" in ctx.timings


def test_partition_keeps_the_forwards_in_place_writes_in_forward():
    """An in-place op whose result is unused (the write is what matters: T5's position buckets,
    a buffer's running statistics) runs in the forward program, not in backward."""

    def program(w, buf, x):
        t = x @ w
        c = torch.zeros_like(t)
        c.add_(t)  # result unused
        buf.add_(1.0)
        return ((c * c).sum(),)

    w, x = torch.randn(8, 8), torch.randn(4, 8)
    jp = trace_joint(program, [w, torch.zeros(3), x], [0])
    parts = partition(jp)
    buf = torch.zeros(3)
    out = parts.forward(w, buf, x)
    assert torch.allclose(out[0], ((x @ w) ** 2).sum())
    assert torch.equal(buf, torch.ones(3))  # the buffer was updated by the forward program
    assert not any(
        n.op == "call_function" and n.target is torch.ops.aten.add_.Tensor for n in parts.backward.graph.nodes
    )

"""Reshards: the collectives ``reshard_steps`` emits, checked by kind and shape on 1-D and 2-D
meshes, and by *running* them on simulated devices: every pair of specs must reproduce the target
layout's pieces exactly (the lowering emits the same steps, so this is what runs). Edge costs are
checked against the NCCL formulas of ``autopar.cost.comm``."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from autopar import Cluster
from autopar.cost import comm
from autopar.cost.comm import all_gather_cost, all_reduce_cost, reduce_scatter_cost
from autopar.cost.reshard_cost import edge_cost, reshard_cost
from autopar.mesh import Mesh
from autopar.placement import Partial, Replicate, Shard, divides, local_shape, parse_spec, shard_slices
from autopar.reshard import reshard_steps

R, P = Replicate(), Partial()


def kinds(steps):
    return [(s.kind, s.axis) for s in steps]


# ------------------------------------------------------------------------------------------------
# Named cases: the collective each textbook reshard should be


@pytest.mark.parametrize(
    ("src", "dst", "mesh", "expected", "out_shape"),
    [
        ("S(0)", "R", (4,), [("all_gather", 0)], (16, 8)),
        ("P", "S(1)", (4,), [("reduce_scatter", 0)], (16, 2)),
        ("P", "R", (4,), [("all_reduce", 0)], (16, 8)),
        ("S(0)", "S(1)", (4,), [("all_to_all", 0)], (16, 2)),
        ("R", "S(1)", (4,), [("slice", 0)], (16, 2)),
        ("R", "P", (4,), [("to_partial", 0)], (16, 8)),
        ("S(0)x2", "R", (2,), [("all_gather", 0)], (16, 8)),
        # contiguous to striped and blocks to another dimension: one all-to-all, never a gather and
        # a slice (which would move a device's whole piece to every other where each needs a part)
        ("S(0)", "S(0)x4", (2,), [("all_to_all", 0)], (8, 8)),
        ("S(0)x4", "S(1)", (2,), [("all_to_all", 0)], (16, 4)),
        ("S(1)", "S(0)x2", (4,), [("all_to_all", 0)], (4, 8)),
        (("S(0)", "S(0)"), ("S(0)", "R"), (2, 4), [("all_gather", 1)], (8, 8)),
        (("S(0)", "R"), ("S(0)", "S(1)"), (2, 4), [("slice", 1)], (8, 2)),
        (("R", "S(0)"), ("S(0)", "R"), (2, 4), [("all_gather", 1), ("slice", 0)], (8, 8)),
        # a slice of a dimension no other axis splits comes first: the collectives after it move
        # the device's piece, not the whole (grouped-query keys reordered into a ring's stripes
        # under more tensor-parallel devices than key-value heads)
        (("P", "R"), ("R", "S(1)"), (2, 4), [("slice", 1), ("all_reduce", 0)], (16, 2)),
        (("S(0)", "R"), ("S(0)x2", "S(1)"), (2, 4), [("slice", 1), ("all_to_all", 0)], (8, 2)),
        (("P", "P"), ("R", "R"), (2, 4), [("all_reduce", 1), ("all_reduce", 0)], (16, 8)),
        (("P", "S(1)"), ("R", "S(1)"), (2, 4), [("all_reduce", 0)], (16, 2)),
        (("S(1)", "P"), ("S(1)", "S(0)"), (2, 4), [("reduce_scatter", 1)], (4, 4)),
        # an inner split of a dimension an outer axis already splits (sequence parallelism inside a
        # context-parallel chunk): one reduce-scatter of the local block, not an all-reduce and a slice
        (("S(1)", "P"), ("S(1)", "S(1)"), (2, 2), [("reduce_scatter", 1)], (16, 2)),
        # the outer axis's split would land inside the inner one's: all-reduce, then slices
        (
            ("P", "S(1)"),
            ("S(1)", "S(1)"),
            (2, 2),
            [("all_gather", 1), ("all_reduce", 0), ("slice", 0), ("slice", 1)],
            (16, 2),
        ),
    ],
)
def test_reshard_step_kinds(src, dst, mesh, expected, out_shape):
    steps = reshard_steps((16, 8), parse_spec(src), parse_spec(dst), mesh)
    assert kinds(steps) == expected
    assert steps[-1].out_shape == out_shape == local_shape((16, 8), parse_spec(dst), mesh)
    assert steps[0].in_shape == local_shape((16, 8), parse_spec(src), mesh)


def test_reshard_step_details():
    (ag,) = reshard_steps((16, 8), parse_spec("S(0)"), parse_spec("R"), (4,))
    assert (ag.dim, ag.in_shape, ag.out_shape) == (0, (4, 8), (16, 8))
    (a2a,) = reshard_steps((16, 8), parse_spec("S(0)"), parse_spec("S(1)"), (4,))
    assert (a2a.dim, a2a.dim2, a2a.in_shape, a2a.out_shape) == (0, 1, (4, 8), (16, 2))
    (rs,) = reshard_steps((16, 8), parse_spec("P"), parse_spec("S(1)"), (4,))
    assert (rs.dim, rs.in_shape, rs.out_shape) == (1, (16, 8), (16, 2))
    (blocked,) = reshard_steps((12, 8), parse_spec("S(0)x3"), parse_spec("R"), (2,))
    assert (blocked.blocks, blocked.in_shape, blocked.out_shape) == (3, (6, 8), (12, 8))


def test_same_spec_needs_no_steps():
    for spec in ("R", "P", "S(0)", "S(1)x2"):
        assert reshard_steps((16, 8), parse_spec(spec), parse_spec(spec), (2,)) == []
    assert (
        reshard_cost(
            (16, 8), 4, parse_spec(("S(0)", "S(1)")), parse_spec(("S(0)", "S(1)")), Mesh((2, 4), _cluster())
        )
        == 0
    )


def test_outer_axis_change_regathers_inner_axis_of_the_same_dim():
    # (S(0), S(0)) -> (R, S(0)): the inner axis holds a piece *of the outer piece*; it must be gathered
    # before the outer axis can be, then sliced again.
    steps = reshard_steps((16, 8), parse_spec(("S(0)", "S(0)")), parse_spec(("R", "S(0)")), (2, 4))
    assert kinds(steps) == [("all_gather", 1), ("all_gather", 0), ("slice", 1)]
    assert [s.out_shape for s in steps] == [(8, 8), (16, 8), (4, 8)]


# ------------------------------------------------------------------------------------------------
# Running the steps on simulated devices


def _coords(mesh):
    return list(itertools.product(*(range(n) for n in mesh)))


def _as_replicated(spec):
    return tuple(R if isinstance(p, Partial) else p for p in spec)


def _piece(x: torch.Tensor, spec, mesh, coord) -> torch.Tensor:
    for d, ranges in enumerate(shard_slices(tuple(x.shape), _as_replicated(spec), mesh, coord)):
        x = torch.cat([x.narrow(d, lo, hi - lo) for lo, hi in ranges], dim=d)
    return x


def _layout(x: torch.Tensor, spec, mesh, gen: torch.Generator) -> dict:
    """Each device's local tensor under ``spec``; Partial axes hold random terms summing to the piece."""
    partial_axes = [a for a, p in enumerate(spec) if isinstance(p, Partial)]
    scale = math.prod(mesh[a] for a in partial_axes)
    noise = {}
    for a in partial_axes:
        terms = [torch.randn(x.shape, generator=gen, dtype=x.dtype) for _ in range(mesh[a] - 1)]
        noise[a] = [*terms, -sum(terms)]
    out = {}
    for c in _coords(mesh):
        v = x / scale + sum((noise[a][c[a]] for a in partial_axes), torch.zeros_like(x))
        out[c] = _piece(v, spec, mesh, c)
    return out


def _held(length: int, blocks: int, n: int, c: int) -> list[int]:
    """Global positions device ``c`` of ``n`` holds along a dimension split in ``blocks``."""
    piece = length // blocks // n
    return [b * (length // blocks) + c * piece + i for b in range(blocks) for i in range(piece)]


def _run(local: dict, step, mesh) -> dict:
    """Execute one ReshardStep on every group of devices along ``step.axis``."""
    a, n = step.axis, mesh[step.axis]
    out = {}
    for c in local:
        group = [(*c[:a], i, *c[a + 1 :]) for i in range(n)]
        mine = c[a]
        parts = [local[g] for g in group]
        x = local[c]
        if step.kind == "all_gather":
            blocks = [p.chunk(step.blocks, dim=step.dim) for p in parts]
            out[c] = torch.cat([blocks[i][b] for b in range(step.blocks) for i in range(n)], dim=step.dim)
        elif step.kind == "slice":
            out[c] = torch.cat(
                [blk.chunk(n, dim=step.dim)[mine] for blk in x.chunk(step.blocks, dim=step.dim)], dim=step.dim
            )
        elif step.kind == "all_reduce":
            out[c] = sum(parts)
        elif step.kind == "reduce_scatter":
            out[c] = sum(parts).chunk(n, dim=step.dim)[mine]
        elif step.kind == "all_to_all":  # whole along dim (pieces by position), then the new piece
            length = x.shape[step.dim] * n
            held = [_held(length, step.blocks, n, i) for i in range(n)]
            whole = torch.empty(*x.shape[: step.dim], length, *x.shape[step.dim + 1 :], dtype=x.dtype)
            for i, part in enumerate(parts):
                whole.index_copy_(step.dim, torch.tensor(held[i]), part)
            keep = _held(whole.shape[step.dim2], step.blocks2, n, mine)
            out[c] = whole.index_select(step.dim2, torch.tensor(keep))
        elif step.kind == "to_partial":
            out[c] = x if mine == 0 else torch.zeros_like(x)
        else:
            raise AssertionError(f"unknown step kind {step.kind}")
        assert tuple(x.shape) == step.in_shape, (step, tuple(x.shape))
        assert tuple(out[c].shape) == step.out_shape, (step, tuple(out[c].shape))
    return out


def _assert_layout(local: dict, x: torch.Tensor, spec, mesh) -> None:
    """Summing over the Partial axes, every device holds exactly its piece of ``x``."""
    partial_axes = [a for a, p in enumerate(spec) if isinstance(p, Partial)]
    for c in _coords(mesh):
        group = [c]
        for a in partial_axes:
            group = [(*g[:a], i, *g[a + 1 :]) for g in group for i in range(mesh[a])]
        total = sum(local[g] for g in group)
        torch.testing.assert_close(total, _piece(x, spec, mesh, c), rtol=0, atol=1e-12)


def _specs(mesh, shape, choices):
    for combo in itertools.product(choices, repeat=len(mesh)):
        if not divides(shape, combo, mesh):
            continue
        blocked = [p.dim for p in combo if isinstance(p, Shard) and p.blocks > 1]
        if any([isinstance(p, Shard) and p.dim == d for p in combo].count(True) > 1 for d in blocked):
            continue
        yield combo


@pytest.mark.parametrize(
    ("mesh", "shape", "choices"),
    [
        ((4,), (8, 12), (R, P, Shard(0), Shard(1), Shard(0, 2), Shard(1, 3))),
        ((2, 4), (8, 16), (R, P, Shard(0), Shard(1))),
        ((2, 2), (8, 12), (R, P, Shard(0), Shard(1), Shard(1, 3))),
        ((2, 2, 2), (8, 8), (R, P, Shard(0), Shard(1))),
    ],
)
def test_every_reshard_reproduces_the_target_layout(mesh, shape, choices):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen, dtype=torch.float64)
    specs = list(_specs(mesh, shape, choices))
    assert len(specs) >= 2 * len(mesh)
    for src, dst in itertools.product(specs, specs):
        local = _layout(x, src, mesh, gen)
        for step in reshard_steps(shape, src, dst, mesh):
            local = _run(local, step, mesh)
        _assert_layout(local, x, dst, mesh)


def test_unchanged_axes_get_no_collective():
    mesh = (2, 4)
    for src, dst in [
        (("S(0)", "R"), ("S(0)", "S(1)")),
        (("R", "P"), ("S(1)", "P")),
        (("P", "S(1)"), ("R", "S(1)")),
    ]:
        steps = reshard_steps((8, 16), parse_spec(src), parse_spec(dst), mesh)
        changed = {a for a in range(2) if src[a] != dst[a]}
        assert {s.axis for s in steps} == changed, (src, dst, steps)


# ------------------------------------------------------------------------------------------------
# Edge costs: forward reshard + backward conjugate + gradient synchronization


def _cluster() -> Cluster:
    return Cluster.preset("A100-80GB", gpus_per_node=8, nodes=1)


def test_edge_cost_of_a_replicated_input_to_split_work_is_one_gradient_all_reduce():
    cl = _cluster()
    link = cl.axis_link((8,), 0)
    shape, nbytes = (64, 256), 64 * 256 * 4
    cost = edge_cost(shape, 4, (R,), (R,), (True,), True, Mesh((8,), cl))
    assert cost == pytest.approx(all_reduce_cost(nbytes, 8, link))
    assert edge_cost(shape, 4, (R,), (R,), (True,), False, Mesh((8,), cl)) == 0  # no gradient, no sync
    assert (
        edge_cost(shape, 4, (R,), (R,), (False,), True, Mesh((8,), cl)) == 0
    )  # replicated work: full gradient
    bucketed = edge_cost(shape, 4, (R,), (R,), (True,), True, Mesh((8,), cl), bucketed_sync=True)
    assert bucketed == pytest.approx(2 * 7 / 8 * nbytes / link.bandwidth)  # bandwidth only, no latency
    assert bucketed < cost


def test_edge_cost_fuses_gather_and_gradient_sync_into_reduce_scatter():
    # Sequence parallelism (Korthikanti et al.): all-gather forward, reduce-scatter backward.
    cl = _cluster()
    link = cl.axis_link((8,), 0)
    shape, nbytes = (64, 256), 64 * 256 * 4
    cost = edge_cost(shape, 4, (Shard(0),), (R,), (True,), True, Mesh((8,), cl))
    assert cost == pytest.approx(all_gather_cost(nbytes, 8, link) + reduce_scatter_cost(nbytes, 8, link))
    # Without a gradient only the forward all-gather is paid.
    assert edge_cost(shape, 4, (Shard(0),), (R,), (True,), False, Mesh((8,), cl)) == pytest.approx(
        all_gather_cost(nbytes, 8, link)
    )


def test_edge_cost_uses_the_link_of_each_axis():
    two_nodes = Cluster.preset("A100-80GB", gpus_per_node=8, nodes=2)
    shape = (1024, 1024)  # large enough that bandwidth, not latency, dominates
    inner = edge_cost(shape, 4, (R, Shard(0)), (R, R), (False, False), False, Mesh((2, 8), two_nodes))
    outer = edge_cost(shape, 4, (Shard(0), R), (R, R), (False, False), False, Mesh((8, 2), two_nodes))
    nbytes = 1024 * 1024 * 4
    assert inner == pytest.approx(all_gather_cost(nbytes, 8, two_nodes.intra_node))
    # The outer axis of (8, 2) puts 4 of its 8 devices on each node: as one ring, NCCL drives their
    # 4 NICs at once (autopar.cost.comm), 4 × 25 GB/s, every ring step paying the NIC's latency.
    ib = two_nodes.inter_node
    mesh = Mesh((8, 2), two_nodes)
    ring = mesh.all_gather_cost(nbytes, 0, two_level=False)
    assert ring == pytest.approx(7 * ib.latency + 7 / 8 * nbytes / (4 * ib.bandwidth))
    # The two groups of that axis share the node's NICs, and NVLink (300 GB/s) is faster than the
    # 4 NICs: the gather runs in two levels (across, then on the node), as the plan records and
    # the runtime writes it (``passes.two_level``), with the copy that reorders the pieces.
    assert mesh.two_level(0)
    copy = 2 * nbytes / two_nodes.device.achieved_bandwidth + two_nodes.device.kernel_overhead
    assert outer == pytest.approx(comm.two_level_all_gather_cost(nbytes, mesh.group(0)) + copy)
    assert inner < outer < ring


# ------------------------------------------------------------------------------------------------
# Which gradient synchronizations can be bucketed like a parameter's


def test_bucketed_grad_sync_for_values_that_only_feed_one_parameters_gradient():
    from torch import nn

    from autopar.capture import capture
    from autopar.passes import PassContext, run_passes
    from autopar.passes.annotate import annotate_tensors
    from autopar.reshard import bucketed_grad_sync

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok = nn.Embedding(16, 8)
            self.pos = nn.Embedding(4, 8)
            self.norm = nn.LayerNorm(8)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            pos = self.pos(torch.arange(ids.shape[1]))  # a lookup of one weight: bucketable
            x = self.tok(ids) + pos  # two weights' gradients meet here: not bucketable
            return self.norm(x).sum()

    cap = capture(Net(), torch.zeros(2, 4, dtype=torch.long))
    run_passes(cap.gm, PassContext(captured=cap, cluster=_cluster()), [annotate_tensors])
    nodes = {n.name: n for n in cap.graph.nodes}
    embeddings = [n for n in cap.graph.nodes if n.op == "call_function" and "embedding" in str(n.target)]
    by_weight = {e.args[0].name: e for e in embeddings}
    pos_lookup = by_weight[next(k for k, v in cap.params.items() if v == "pos.weight")]
    tok_lookup = by_weight[next(k for k, v in cap.params.items() if v == "tok.weight")]
    add = next(u for u in tok_lookup.users if "add" in str(u.target))
    assert bucketed_grad_sync(nodes[next(k for k, v in cap.params.items() if v == "pos.weight")])
    assert bucketed_grad_sync(pos_lookup)
    assert bucketed_grad_sync(tok_lookup)
    assert not bucketed_grad_sync(add)
    assert not bucketed_grad_sync(nodes[next(k for k, v in cap.inputs.items())])  # an input has no gradient

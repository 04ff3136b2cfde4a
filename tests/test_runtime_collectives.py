"""The differentiable collectives of ``autopar.program.collectives`` on 2 and 4 gloo processes.

Each collective is checked against what one process computes on the full tensors: the forward
value, and the gradient its backward (the conjugate collective) gives the input, under the
gradient convention of the module (a replicated value's gradient is complete on every device, a
shard's is the gradient of that piece, a partial value's is complete). Every rank knows every
"global" tensor (they come from seeded generators), so each checks its own piece. On 4 processes
the same checks also run on both axes of a 2 × 2 mesh (sub-groups); the tensors there depend on
the rank's other coordinate, so a collective issued on the wrong group gives wrong sums.

``run_reshard`` (what ``full_state_dict`` uses, and the same ``reshard_steps`` the lowering emits)
is checked end to end: every pair of layouts, forward and backward, matches ``local_shard``.
"""

from __future__ import annotations

import itertools
import zlib
from collections import Counter
from collections.abc import Callable

import pytest
import torch

from autopar.runtime.launch import spawn

SHAPE = (4, 12, 8)
"""Dim 0 splits 2 or 4 ways, dim 1 into 3 blocks of 2 or 4 pieces, dim 2 any way."""


def _tensor(*key: object) -> torch.Tensor:
    """A tensor of ``SHAPE`` that every process derives identically from ``key``."""
    gen = torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))
    return torch.randn(SHAPE, generator=gen)


class _Checks:
    """The checks of one axis group; ``problems`` collects what went wrong, by check name."""

    def __init__(self, ax, salt: int) -> None:
        self.ax, self.salt = ax, salt
        self.n, self.c = ax.size, ax.coord
        self.problems: dict[str, list[str]] = {}

    def glob(self, name: str, r: int = -1) -> torch.Tensor:
        """A global tensor (``r >= 0``: rank ``r``'s term of a partial value)."""
        return _tensor(name, self.salt, r)

    def piece(self, t: torch.Tensor, dim: int, blocks: int = 1, coord: int | None = None) -> torch.Tensor:
        from autopar.placement import Shard
        from autopar.runtime.shards import local_shard

        c = self.c if coord is None else coord
        return local_shard(t, (Shard(dim, blocks),), (self.n,), (c,))

    def run(
        self,
        name: str,
        op: Callable[[torch.Tensor], torch.Tensor],
        x: torch.Tensor,
        want_out: torch.Tensor,
        upstream: torch.Tensor,
        want_grad: torch.Tensor,
        want_counts: dict[str, int],
    ) -> None:
        x = x.clone().requires_grad_(True)
        before = Counter(self.ax.counts)
        y = op(x)
        (y * upstream).sum().backward()
        counts = Counter(self.ax.counts)
        counts.subtract(before)
        got = {k: v for k, v in counts.items() if v}
        out: list[str] = []
        if y.shape != want_out.shape:
            out.append(f"forward shape {tuple(y.shape)}, expected {tuple(want_out.shape)}")
        elif not torch.allclose(y, want_out, rtol=1e-6, atol=1e-6):
            out.append(f"forward differs by {(y - want_out).abs().max().item():.2e}")
        if x.grad is None or x.grad.shape != want_grad.shape:
            out.append(
                f"gradient {None if x.grad is None else tuple(x.grad.shape)}, expected {tuple(want_grad.shape)}"
            )
        elif not torch.allclose(x.grad, want_grad, rtol=1e-6, atol=1e-6):
            out.append(f"gradient differs by {(x.grad - want_grad).abs().max().item():.2e}")
        if got != want_counts:
            out.append(f"collectives issued {got}, expected {want_counts}")
        self.problems[name] = out

    def partial_sum(self, name: str) -> torch.Tensor:
        return sum(self.glob(name, r) for r in range(self.n))

    # ------------------------------------------------------------------------------ the collectives
    def all(self) -> dict[str, list[str]]:
        from autopar.program import collectives as C

        ax, c = self.ax, self.c
        for dim, blocks in ((0, 1), (2, 1), (1, 3)):
            x, g = self.glob("ag"), self.glob("ag-up")
            self.run(
                f"all_gather(dim={dim}, blocks={blocks})",
                lambda t, d=dim, b=blocks: C.all_gather(t, ax, d, b),
                self.piece(x, dim, blocks), x, g, self.piece(g, dim, blocks),
                {"all_gather/fwd": 1},
            )  # fmt: skip
            # The consumer splits work: the upstream gradient is partial, backward reduce-scatters.
            self.run(
                f"all_gather(dim={dim}, blocks={blocks}, grad_partial)",
                lambda t, d=dim, b=blocks: C.all_gather(t, ax, d, b, grad_partial=True),
                self.piece(x, dim, blocks), x, self.glob("ag-up", c), self.piece(self.partial_sum("ag-up"), dim, blocks),
                {"all_gather/fwd": 1, "reduce_scatter/bwd": 1},
            )  # fmt: skip
            self.run(
                f"shard_slice(dim={dim}, blocks={blocks})",
                lambda t, d=dim, b=blocks: C.shard_slice(t, ax, d, b),
                x, self.piece(x, dim, blocks), self.piece(g, dim, blocks), g,
                {"all_gather/bwd": 1},
            )  # fmt: skip
            self.run(
                f"reduce_scatter(dim={dim}, blocks={blocks})",
                lambda t, d=dim, b=blocks: C.reduce_scatter(t, ax, d, b),
                self.glob("rs", c), self.piece(self.partial_sum("rs"), dim, blocks), self.piece(g, dim, blocks), g,
                {"reduce_scatter/fwd": 1, "all_gather/bwd": 1},
            )  # fmt: skip
        g = self.glob("up")
        self.run(
            "all_reduce",
            lambda t: C.all_reduce(t, ax),
            self.glob("ar", c), self.partial_sum("ar"), g, g,
            {"all_reduce/fwd": 1},
        )  # fmt: skip
        for dim, dim2 in ((0, 2), (2, 1), (1, 0)):
            x = self.glob("a2a")
            self.run(
                f"all_to_all(dim={dim}, dim2={dim2})",
                lambda t, d=dim, d2=dim2: C.all_to_all(t, ax, d, d2),
                self.piece(x, dim), self.piece(x, dim2), self.piece(g, dim2), self.piece(g, dim),
                {"all_to_all/fwd": 1, "all_to_all/bwd": 1},
            )  # fmt: skip
        x = self.glob("tp")
        self.run(
            "to_partial", lambda t: C.to_partial(t, ax), x, x if c == 0 else torch.zeros_like(x), g, g, {}
        )
        self.run(
            "grad_sync",
            lambda t: C.grad_sync(t, ax),
            x, x, self.glob("gs-up", c), self.partial_sum("gs-up"),
            {"all_reduce/bwd": 1},
        )  # fmt: skip
        self.all_gather_param()
        return self.problems

    def all_gather_param(self) -> None:
        """ZeRO-3: the gathered weight is saved for backward as its shard and gathered again."""
        from autopar.program import collectives as C

        ax = self.ax
        w_full = self.glob("w")[0]  # [12, 8]: 12 output features split along dim 0
        inp = self.glob("inp")[1]  # [12, 8] inputs
        up = self.glob("w-up").flatten()[:144].view(12, 12)  # upstream gradient of inp @ w.T
        ref_w = w_full.clone().requires_grad_(True)
        ref_inp = inp.clone().requires_grad_(True)
        ((ref_inp @ ref_w.T) * up).sum().backward()
        for hooks in (True, False):
            store = C.GatheredParams()
            w = self.piece(w_full, 0).clone().requires_grad_(True)
            x = inp.clone().requires_grad_(True)
            before = Counter(ax.counts)
            if hooks:
                with torch.autograd.graph.saved_tensors_hooks(store.pack, store.unpack):
                    y = x @ C.all_gather_param(w, ax, store, 0).T
                store.clear()
            else:
                y = x @ C.all_gather_param(w, ax, store, 0).T
            (y * up).sum().backward()
            counts = Counter(ax.counts)
            counts.subtract(before)
            got = {k: v for k, v in counts.items() if v}
            want = {"all_gather/fwd": 1, "all_gather/bwd": 1} if hooks else {"all_gather/fwd": 1}
            out = []
            if not torch.allclose(y, ref_inp.detach() @ w_full.T, rtol=1e-6, atol=1e-6):
                out.append("forward differs")
            if not torch.allclose(w.grad, self.piece(ref_w.grad, 0), rtol=1e-5, atol=1e-6):
                out.append(
                    f"weight gradient differs by {(w.grad - self.piece(ref_w.grad, 0)).abs().max():.2e}"
                )
            if not torch.allclose(x.grad, ref_inp.grad, rtol=1e-5, atol=1e-6):
                out.append("input gradient differs")
            if got != want:
                out.append(
                    f"collectives issued {got}, expected {want} (backward must gather the shard again)"
                )
            self.problems[f"all_gather_param({'saved as shard' if hooks else 'no hooks'})"] = out


def _layouts(mesh: tuple[int, ...]):
    """Layouts of ``SHAPE`` on ``mesh`` the planner can produce (a block-sharded dimension is
    sharded on one axis only, ``autopar.passes.strategies``)."""
    from autopar.placement import Replicate, Shard, divides

    choices = (Replicate(), Shard(0), Shard(1), Shard(2), Shard(1, 3), Shard(2, 2))
    for spec in itertools.product(choices, repeat=len(mesh)):
        dims = [p.dim for p in spec if isinstance(p, Shard)]
        if any(p.blocks > 1 and dims.count(p.dim) > 1 for p in spec if isinstance(p, Shard)):
            continue
        if divides(SHAPE, spec, mesh):
            yield spec


def _check_run_reshard(axes, salt: int) -> dict[str, list[str]]:
    from autopar.program.collectives import run_reshard
    from autopar.runtime.shards import local_shard

    mesh = tuple(ax.size for ax in axes)
    coord = tuple(ax.coord for ax in axes)
    x, g = _tensor(7, salt), _tensor(8, salt)
    problems = []
    layouts = list(_layouts(mesh))
    for src, dst in itertools.product(layouts, layouts):
        local = local_shard(x, src, mesh, coord).clone().requires_grad_(True)
        y = run_reshard(local, SHAPE, src, dst, axes)
        (y * local_shard(g, dst, mesh, coord)).sum().backward()
        name = f"{tuple(map(str, src))} → {tuple(map(str, dst))}"
        if not torch.equal(y, local_shard(x, dst, mesh, coord)):
            problems.append(f"{name}: forward is not this rank's piece of the target layout")
        elif src != dst and not torch.equal(local.grad, local_shard(g, src, mesh, coord)):
            problems.append(f"{name}: gradient is not this rank's piece in the source layout")
    return {f"run_reshard on mesh {mesh} ({len(layouts)}² layout pairs)": problems}


def _check_sync_batch_norm(axes: list, piece: int, pieces: int) -> dict[str, list[str]]:
    """``local_ops.sync_batch_norm`` in both forms, the batch split over ``axes`` (this device's
    ``piece`` of ``pieces``), against ``F.batch_norm`` on the whole batch: output, the input's
    and the weight's gradients (the weight's summed over the devices), running statistics."""
    import torch.distributed as dist
    import torch.nn.functional as F

    from autopar.program.local_ops import sync_batch_norm

    out: dict[str, list[str]] = {}
    for reduce in (False, True):
        g = torch.Generator().manual_seed(7)
        x = torch.randn(4 * pieces, 3, 5, 5, generator=g) * 3 + 1
        r = torch.randn(x.shape, generator=g)
        w0, b0 = torch.randn(3, generator=g), torch.randn(3, generator=g)
        ref_x, ref_w = x.clone().requires_grad_(), w0.clone().requires_grad_()
        rm, rv = torch.zeros(3), torch.ones(3)
        y = F.batch_norm(ref_x, rm, rv, ref_w, b0, training=True, momentum=0.1, eps=1e-5)
        (y * r).sum().backward()
        rows = slice(4 * piece, 4 * piece + 4)
        mine_x, mine_w = x[rows].clone().requires_grad_(), w0.clone().requires_grad_()
        mrm, mrv = torch.zeros(3), torch.ones(3)
        got = sync_batch_norm(mine_x, mine_w, b0, mrm, mrv, 0.1, 1e-5, axes, "batch_norm", reduce)
        (got * r[rows]).sum().backward()
        dw = mine_w.grad.clone()
        dist.all_reduce(dw)  # a replicated weight read by split work: its gradient is partial
        msgs = []
        for what, a, b in (
            ("output", got, y[rows]),
            ("input gradient", mine_x.grad, ref_x.grad[rows]),
            ("weight gradient", dw, ref_w.grad),
            ("running mean", mrm, rm),
            ("running variance", mrv, rv),
        ):
            if not torch.allclose(a, b, atol=1e-4, rtol=1e-4):
                msgs.append(f"{what} differs by {(a - b).abs().max():.2e}")
        out[f"sync_batch_norm ({'all-reduce' if reduce else 'all-gather'}) over {len(axes)} axes"] = msgs
    return out


def collectives_worker(rank: int, world: int) -> dict[str, list[str]]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from autopar.program.collectives import AxisGroup

    problems: dict[str, list[str]] = {}
    ax = AxisGroup(axis=0, name="world", size=world, coord=rank, group=dist.group.WORLD)
    for name, msgs in _Checks(ax, salt=0).all().items():
        problems[f"world axis: {name}"] = msgs
    problems.update(_check_run_reshard([ax], salt=0))
    problems.update(_check_sync_batch_norm([ax], rank, world))
    if world == 4:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("outer", "inner"))
        coord = mesh.get_coordinate()
        axes = [
            AxisGroup(axis=a, name=n, size=2, coord=coord[a], group=mesh.get_group(a))
            for a, n in enumerate(("outer", "inner"))
        ]
        for a, sub in enumerate(axes):
            for name, msgs in _Checks(sub, salt=1 + coord[1 - a]).all().items():
                problems[f"{sub.name} axis of 2 × 2: {name}"] = msgs
        problems.update(_check_run_reshard(axes, salt=3))
        problems.update(_check_sync_batch_norm(axes, 2 * coord[0] + coord[1], 4))
    return problems


@pytest.mark.distributed
@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [2, 4])
def test_collectives_forward_values_and_conjugate_gradients(world):
    results = spawn(collectives_worker, world, timeout=200)
    names = set(results[0])
    for op in (
        "all_gather",
        "shard_slice",
        "all_reduce",
        "reduce_scatter",
        "all_to_all",
        "to_partial",
        "grad_sync",
        "all_gather_param",
        "run_reshard",
        "sync_batch_norm (all-gather)",
        "sync_batch_norm (all-reduce)",
    ):
        assert any(op in n for n in names), f"no check ran for {op}"
    assert any("blocks=3" in n and "all_gather" in n for n in names)
    assert any("blocks=3" in n and "reduce_scatter" in n for n in names)
    if world == 4:
        assert any(n.startswith("inner axis of 2 × 2") for n in names)
    bad = [
        f"rank {r}, {name}: {'; '.join(msgs)}"
        for r, res in enumerate(results)
        for name, msgs in res.items()
        if msgs
    ]
    assert not bad, "\n".join(bad)

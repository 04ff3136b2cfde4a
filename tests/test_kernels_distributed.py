"""The vocabulary-parallel cross-entropy kernel on 2 gloo processes (Triton's interpreter: the
environment ``tests/conftest.py`` sets is inherited by the spawned ranks).

Each rank holds half the classes of one set of logits (rank 0 the columns ``[0, 20)``, rank 1
``[20, 40)``; a forced block of 16 walks each half in a full block and a tail) and computes the
per-row losses with the all-reduces over a world axis. Checked against ``F.cross_entropy`` of the
full logits on one process: the losses (equal on both ranks; 0 on ``ignore_index`` rows), each
rank's piece of the logits' gradient, and that exactly the two all-reduces of
``_VocabParallelCE`` were issued (max, then the stacked sums) — and the same values as
``_VocabParallelCE`` itself, the eager op the fused one stands in for.
"""

from __future__ import annotations

import pytest
import torch

from autopar.runtime.launch import spawn

ROWS, VOCAB, IGNORED = 7, 40, (1, 5)


def _problem() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logits, targets (both halves of the vocabulary, two rows ignored) and per-row weights of
    the loss, identical on every process."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(ROWS, VOCAB, generator=g) * 3
    target = torch.tensor([3, 7, 21, 39, 0, 25, 19])
    target[list(IGNORED)] = -100
    weights = torch.rand(ROWS, generator=g)
    return logits, target, weights


def vocab_parallel_worker(rank: int, world: int) -> dict[str, object]:
    import torch.distributed as dist

    from autopar.program.collectives import AxisGroup
    from autopar.program.kernels import backend, vocab_parallel_cross_entropy
    from autopar.program.local_ops import _VocabParallelCE

    logits, target, weights = _problem()
    part = VOCAB // world
    start = rank * part
    local = logits[:, start : start + part].clone().requires_grad_(True)
    ax = AxisGroup(axis=0, name="tp", size=world, coord=rank, group=dist.group.WORLD)
    loss = vocab_parallel_cross_entropy(local, target, start, [ax], block_size=16)
    (grad,) = torch.autograd.grad((loss * weights).sum(), [local])
    counts = dict(ax.counts)

    eager_local = logits[:, start : start + part].clone().requires_grad_(True)
    eager = _VocabParallelCE.apply(eager_local, target, start, (ax,), -100)
    (eager_grad,) = torch.autograd.grad((eager * weights).sum(), [eager_local])
    return {
        "backend": backend(local),
        "loss": loss.detach(),
        "grad": grad,
        "counts": counts,
        "eager_loss": eager.detach(),
        "eager_grad": eager_grad,
    }


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_vocab_parallel_cross_entropy_on_two_processes():
    results = spawn(vocab_parallel_worker, 2, timeout=150)
    logits, target, weights = _problem()
    full = logits.clone().requires_grad_(True)
    want = torch.nn.functional.cross_entropy(full, target, reduction="none")
    (want_grad,) = torch.autograd.grad((want * weights).sum(), [full])
    tol = {"atol": 1e-5, "rtol": 1e-5}
    for rank, res in enumerate(results):
        assert res["backend"] == "triton", f"rank {rank} ran the eager fallback"
        torch.testing.assert_close(res["loss"], want.detach(), **tol)
        assert torch.all(res["loss"][list(IGNORED)] == 0)
        piece = want_grad[:, rank * VOCAB // 2 : (rank + 1) * VOCAB // 2]
        torch.testing.assert_close(res["grad"], piece, **tol)
        assert not res["grad"][list(IGNORED)].any(), "ignored rows got a gradient"
        # Forward: one max and one sum all-reduce on the axis; backward: none.
        assert res["counts"] == {"all_reduce/fwd": 2}, res["counts"]
        torch.testing.assert_close(res["loss"], res["eager_loss"], **tol)
        torch.testing.assert_close(res["grad"], res["eager_grad"], **tol)

"""Compressed gradient all-reduces as the per-rank program runs them (``autopar.passes.compress``
puts them there; ``autopar.cost.compression`` defines the words and prices them).

``PowerSGDReduce`` is a module the program calls (``call_module``) in place of one gradient
all-reduce (one gradient, or a bucket of them flattened into one buffer,
``passes.overlap.bucket_gradients``): it holds PowerSGD's state from step to step — each
compressed matrix's error feedback and warm-start ``Q`` — as buffers, so the state lives with the
program that uses it, is moved with it and starts the same on every rank.

The sum convention is the program's: the result is the sum of every rank's gradient over the
group (a rank-``r`` approximation of it for the compressed matrices), equal on every rank.

One compression, for each of the ``k`` compressed matrices ``M = g + e`` (``m × n``, fp32) of a
bucket (Vogels et al., arXiv 1905.13727, Algorithm 1; PyTorch's ``powerSGD_hook``):

1. ``P = M Q``; the ``P`` of the bucket all-reduced as one buffer; each ``P`` orthonormalized
   (reduced QR);
2. ``Q = Mᵀ P``; the ``Q`` of the bucket all-reduced as one buffer, kept for the next step;
3. ``M̂ = P Qᵀ`` (the summed gradient's approximation) is the result; ``e = M − M̂ / size`` is
   kept, what this rank's gradient lost.

The bucket's other members (vectors, small matrices) are all-reduced as they are, in one buffer
issued before the rounds and waited for after them.

``Fp8Reduce`` and ``TopKReduce`` replace a gradient all-reduce the same way, each keeping its
error feedback ``e`` (fp32, the buffer's size) as a buffer; their rounds are
``autopar.cost.compression``'s:

* fp8 — ``M = g + e`` cut into one chunk per rank (zero-padded), each scaled onto float8 e4m3
  and sent to its owner with its scale (one all-to-all of bytes); the owner sums its chunk's
  pieces in fp32, scales and quantizes the sum, and every rank all-gathers the quantized sums
  with their scales. ``e`` keeps ``M`` less what was sent, and on the owner's chunk also the sum
  less what was gathered.
* top-k — the ``k`` entries of ``M = g + e`` largest in magnitude, values and indices (as int32
  bits in an fp32 buffer), all-gathered; each rank adds every rank's entries into zeros. ``e``
  keeps ``M`` with the sent entries zeroed.

Either way the sum returned plus every rank's error equals the sum of every rank's ``g + e``:
error feedback loses nothing over the steps.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives  # registers torch.ops._c10d_functional

__all__ = ["Fp8Reduce", "PowerSGDReduce", "TopKReduce"]

_fc = torch.ops._c10d_functional


def _all_reduce(t: torch.Tensor, group_name: str) -> torch.Tensor:
    return _fc.wait_tensor(_fc.all_reduce(t, "sum", group_name))


class PowerSGDReduce(torch.nn.Module):
    """The PowerSGD-compressed sum of one gradient buffer over a process group (module
    docstring). ``shapes``: the buffer's members, in order (one for an unbucketed gradient);
    ``matrices``: each member's ``(m, n)`` where it is compressed, else ``None``; ``seed``: the
    initial ``Q``'s seed, the same on every rank; ``warmup_steps``: calls reduced exactly before
    compression starts (``GradCompression.warmup_steps``)."""

    def __init__(
        self,
        shapes: Sequence[Sequence[int]],
        matrices: Sequence[tuple[int, int] | None],
        rank: int,
        group_name: str,
        seed: int = 0,
        warmup_steps: int = 0,
    ) -> None:
        super().__init__()
        if len(shapes) != len(matrices):
            raise ValueError(
                f"PowerSGDReduce: {len(shapes)} member shapes but {len(matrices)} matrix entries"
            )
        self.shapes = [tuple(int(d) for d in s) for s in shapes]
        self.matrices = list(matrices)
        self.rank = int(rank)
        self.group_name = group_name
        self.seed = int(seed)
        self.warmup_steps = int(warmup_steps)
        self.started = False
        self.calls = 0
        """Compressions run (the tests read it)."""

    def extra_repr(self) -> str:
        k = sum(m is not None for m in self.matrices)
        return f"rank={self.rank}, compressed {k} of {len(self.shapes)} members, group={self.group_name}"

    def _start(self, device: torch.device) -> None:
        gen = torch.Generator().manual_seed(self.seed)
        for k, mn in enumerate(self.matrices):
            if mn is None:
                continue
            m, n = mn
            q = torch.randn(n, self.rank, generator=gen, dtype=torch.float32)
            self.register_buffer(f"q{k}", torch.linalg.qr(q).Q.to(device), persistent=False)
            self.register_buffer(
                f"e{k}", torch.zeros(m, n, dtype=torch.float32, device=device), persistent=False
            )
        self.started = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.started:
            self._start(x.device)
        self.calls += 1
        if self.calls <= self.warmup_steps:  # exact until PowerSGD starts
            return _all_reduce(x, self.group_name)
        size = dist.get_world_size(dist.distributed_c10d._resolve_process_group(self.group_name))
        parts = x.reshape(-1).split([math.prod(s) for s in self.shapes])
        plain = [k for k, mn in enumerate(self.matrices) if mn is None]
        pending = (
            _fc.all_reduce(torch.cat([parts[k] for k in plain]), "sum", self.group_name) if plain else None
        )
        squeezed = [k for k, mn in enumerate(self.matrices) if mn is not None]
        ms, ps = {}, []
        for k in squeezed:
            m, n = self.matrices[k]
            ms[k] = parts[k].reshape(m, n).float() + getattr(self, f"e{k}")
            ps.append(ms[k] @ getattr(self, f"q{k}"))
        summed_p = _all_reduce(torch.cat([p.reshape(-1) for p in ps]), self.group_name)
        p_of, qs, at = {}, [], 0
        for k in squeezed:
            m, _ = self.matrices[k]
            p_of[k] = torch.linalg.qr(summed_p[at : at + m * self.rank].reshape(m, self.rank)).Q
            at += m * self.rank
            qs.append(ms[k].t() @ p_of[k])
        summed_q = _all_reduce(torch.cat([q.reshape(-1) for q in qs]), self.group_name)
        out: list[torch.Tensor | None] = [None] * len(self.shapes)
        at = 0
        for k in squeezed:
            _, n = self.matrices[k]
            q = summed_q[at : at + n * self.rank].reshape(n, self.rank)
            at += n * self.rank
            getattr(self, f"q{k}").copy_(q)
            approx = p_of[k] @ q.t()
            getattr(self, f"e{k}").copy_(ms[k] - approx / size)
            out[k] = approx.to(x.dtype).reshape(-1)
        if pending is not None:
            for k, piece in zip(plain, _fc.wait_tensor(pending).split([parts[k].numel() for k in plain])):
                out[k] = piece
        return torch.cat(out).reshape(x.shape)  # type: ignore[arg-type]


def _group_size_rank(group_name: str) -> tuple[int, int]:
    group = dist.distributed_c10d._resolve_process_group(group_name)
    return dist.get_world_size(group), dist.get_rank(group)


class _ErrorFeedback(torch.nn.Module):
    """A gradient reduction that keeps what it did not send (``e``, fp32) for the next call."""

    def __init__(self, group_name: str) -> None:
        super().__init__()
        self.group_name = group_name
        self.calls = 0
        """Reductions run (the tests read it)."""
        self.e: torch.Tensor | None
        self.register_buffer("e", None, persistent=False)

    def _begin(self, x: torch.Tensor) -> tuple[int, int, torch.Tensor]:
        """One more call on ``x``: the group's size, this rank in it, and the error kept for a
        buffer of ``x``'s size (zeros where there is none yet)."""
        self.calls += 1
        size, me = _group_size_rank(self.group_name)
        if self.e is None or self.e.numel() != x.numel():
            self.e = torch.zeros(x.numel(), dtype=torch.float32, device=x.device)
        return size, me, self.e


def _dequantized(rows: torch.Tensor, chunk: int) -> torch.Tensor:
    """Rows of ``chunk`` float8 e4m3 bytes, each followed by its fp32 scale's four, as fp32."""
    values = rows[:, :chunk].contiguous().view(torch.float8_e4m3fn).float()
    return values * rows[:, chunk:].contiguous().view(torch.float32)


class Fp8Reduce(_ErrorFeedback):
    """The fp8-quantized sum of one gradient buffer over a process group, with error feedback
    (module docstring)."""

    def extra_repr(self) -> str:
        return f"fp8 e4m3, group={self.group_name}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from autopar.grad_compression import FP8_MAX

        size, me, e = self._begin(x)
        numel = x.numel()
        chunk = -(-numel // size)
        m = torch.zeros(size * chunk, dtype=torch.float32, device=x.device)
        m[:numel] = x.reshape(-1).float() + e
        rows = m.view(size, chunk)
        scale = (rows.abs().amax(dim=1) / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
        q = (rows / scale[:, None]).to(torch.float8_e4m3fn)
        sent = q.float() * scale[:, None]
        # Round 1: chunk j (its bytes, then its scale's four) to rank j: a reduce-scatter in 8 bits.
        payload = torch.cat([q.view(torch.uint8), scale[:, None].view(torch.uint8)], dim=1).reshape(-1)
        got = _fc.wait_tensor(
            _fc.all_to_all_single(payload, [chunk + 4] * size, [chunk + 4] * size, self.group_name)
        )
        summed = _dequantized(got.view(size, chunk + 4), chunk).sum(dim=0)
        # Round 2: the owner's sum, quantized again, all-gathered.
        s2 = (summed.abs().amax() / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny).reshape(1)
        q2 = (summed / s2).to(torch.float8_e4m3fn)
        mine = torch.cat([q2.view(torch.uint8), s2.view(torch.uint8)])
        all_ = _fc.wait_tensor(_fc.all_gather_into_tensor(mine, size, self.group_name))
        out = _dequantized(all_.view(size, chunk + 4), chunk)
        lost = (m - sent.reshape(-1)).view(size, chunk)
        lost[me] += summed - q2.float() * s2  # the sum's own rounding, on its owner
        e.copy_(lost.reshape(-1)[:numel])
        return out.reshape(-1)[:numel].to(x.dtype).reshape(x.shape)


class TopKReduce(_ErrorFeedback):
    """The top-k sparsified sum of one gradient buffer over a process group, with error feedback
    (module docstring); ``k``: entries each rank sends."""

    def __init__(self, k: int, group_name: str) -> None:
        super().__init__(group_name)
        self.k = int(k)

    def extra_repr(self) -> str:
        return f"k={self.k}, group={self.group_name}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        size, _, e = self._begin(x)
        m = x.reshape(-1).float() + e
        k = min(self.k, m.numel())
        idx = m.abs().topk(k, sorted=False).indices
        values = m[idx]
        e.copy_(m.index_fill(0, idx, 0.0))
        payload = torch.cat([values, idx.to(torch.int32).view(torch.float32)])
        all_ = _fc.wait_tensor(_fc.all_gather_into_tensor(payload, size, self.group_name)).view(size, 2 * k)
        out = torch.zeros_like(m)
        out.index_add_(
            0, all_[:, k:].contiguous().view(torch.int32).reshape(-1).long(), all_[:, :k].reshape(-1)
        )
        return out.to(x.dtype).reshape(x.shape)

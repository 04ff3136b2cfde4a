"""A mixture-of-experts language model in plain PyTorch, planned and trained with expert parallelism.

The model (``MoELM``): token embedding, ``n_layer`` blocks of pre-norm causal attention and a
mixture-of-experts MLP, a language-model head. The MoE MLP (``MoE``) routes each token to its
top-2 of 8 experts (softmax router, weights renormalized over the two), sorts the (token, slot)
pairs by expert, runs every expert's SwiGLU MLP on its rows with one grouped matmul per weight
(``autopar.program.experts.grouped_mm``: experts' weights stacked ``[E, …]``, rows grouped by the
cumulative counts), and scatters the weighted rows back to their tokens — dropless: every token
reaches both its experts, however unbalanced the routing. Nothing in it names autopar's
parallelism: autopar finds the MoE region by its structure (``autopar.rules.routing``).

    python examples/moe.py              # plan for 2 nodes × 8 H100, then train on 4 processes
    python examples/moe.py --plan-only

Part 1 plans a 16-layer, 1024-wide model (8 experts of 4096) for 16 H100s on the meta device:
autopar's own plan next to Megatron-LM's layout with expert parallelism (``layouts.megatron``
with ``ep``). Part 2 trains a tiny one on 4 local gloo processes under ``layouts.megatron(tp=1,
ep=2)`` (experts split over 2 devices, the tokens dispatched to them and combined back by
all-to-all) and under autopar's plan, printing each step's loss next to one process's.
"""

from __future__ import annotations

import argparse
import math
import warnings

import torch
import torch.nn.functional as F
from torch import nn

import autopar
from autopar.program.experts import grouped_mm


class MoE(nn.Module):
    """Top-``k`` routed SwiGLU experts, dropless (see module docstring)."""

    def __init__(self, dim: int, hidden: int, experts: int = 8, top_k: int = 2) -> None:
        super().__init__()
        self.top_k, self.experts = top_k, experts
        self.router = nn.Linear(dim, experts, bias=False)
        self.w_gate_up = nn.Parameter(torch.randn(experts, dim, 2 * hidden) / math.sqrt(dim))
        self.w_down = nn.Parameter(torch.randn(experts, hidden, dim) / math.sqrt(hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # [T, D] tokens
        probs = self.router(x).softmax(-1)
        weights, ids = probs.topk(self.top_k, dim=-1)  # [T, k]
        weights = weights / weights.sum(-1, keepdim=True)
        ids, order = ids.reshape(-1).sort()  # (token, slot) pairs grouped by expert
        rows = x[order // self.top_k]  # [T·k, D]
        counts = torch.histc(ids.float(), bins=self.experts, min=0, max=self.experts - 1)  # static size
        offs = torch.cumsum(counts, 0).long()
        gate, up = grouped_mm(rows, self.w_gate_up, offs).chunk(2, dim=-1)
        out = grouped_mm(F.silu(gate) * up, self.w_down, offs)  # [T·k, D]
        out = out * weights.reshape(-1)[order].unsqueeze(-1)
        y = torch.zeros_like(x).index_add_(0, order // self.top_k, out)  # back to the tokens
        return y.reshape(shape)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int, experts: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.moe = MoE(dim, hidden, experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(d, dim=-1)
        q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d)
        x = x + self.proj(a)
        return x + self.moe(self.norm2(x))


class MoELM(nn.Module):
    """Embedding, ``layers`` MoE blocks, head; ``forward(ids, targets)`` returns the loss."""

    def __init__(
        self,
        vocab: int = 64,
        dim: int = 32,
        heads: int = 4,
        hidden: int = 32,
        layers: int = 2,
        experts: int = 8,
    ) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, hidden, experts) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for blk in self.blocks:
            x = blk(x)
        return F.cross_entropy(self.head(self.norm(x)).flatten(0, 1), targets.flatten())


def tiny(seed: int = 0) -> tuple[MoELM, tuple[torch.Tensor, torch.Tensor]]:
    """The tiny model the tests and part 2 train, with one batch (4 × 16 tokens)."""
    torch.manual_seed(seed)
    model = MoELM()
    return model, (torch.randint(0, 64, (4, 16)), torch.randint(0, 64, (4, 16)))


def _line(name: str, plan: autopar.Plan) -> str:
    mesh = " × ".join(f"{a}={n}" for a, n in zip(plan.mesh_axes, plan.mesh_shape))
    p = plan.predicted
    return f"{name:<34} {mesh:<22} step {p.step_time * 1e3:8.2f} ms  memory {p.memory_per_device / 2**30:6.2f} GiB"


def plan_demo() -> None:
    cluster = autopar.Cluster.preset("H100-SXM", gpus_per_node=8, nodes=2)
    with torch.device("meta"):
        model = MoELM(vocab=32000, dim=1024, heads=16, hidden=4096, layers=16, experts=8)
    ids = torch.empty(64, 2048, dtype=torch.long, device="meta")
    batch = (ids, ids.clone())
    auto = autopar.plan(model, batch, cluster)
    print(_line("autopar", auto))
    for tp, ep in ((1, 8), (2, 8), (8, 2)):
        meg = autopar.layouts.megatron(model, batch, cluster, tp=tp, ep=ep)
        print(
            _line(f"megatron(tp={tp}, ep={ep})", meg),
            f"  autopar is {meg.predicted.step_time / auto.predicted.step_time:.2f}×",
        )
    print(auto.table(max_rows=24))


def _train(module: nn.Module, batch: tuple, steps: int = 3) -> list[float]:
    opt = torch.optim.AdamW(module.parameters(), lr=1e-3, eps=1e-6)
    losses = []
    for _ in range(steps):
        loss = module(*batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _worker(rank: int, world: int) -> dict[str, list[float]]:
    warnings.simplefilter("ignore")
    cluster = autopar.Cluster.local(world)
    out = {}
    for name in ("megatron(tp=1, ep=2)", "autopar"):
        model, batch = tiny()
        plan = autopar.layouts.megatron(model, batch, cluster, tp=1, ep=2) if name != "autopar" else None
        pm = autopar.parallelize(model, cluster, batch, plan=plan)
        out[name] = _train(pm, batch)
        out[name + " mesh"] = [f"{a}={n}" for a, n in zip(pm.plan.mesh_axes, pm.plan.mesh_shape)]
    return out


def train_demo(world: int = 4) -> None:
    from autopar.runtime.launch import spawn

    results = spawn(_worker, world, timeout=600)[0]
    model, batch = tiny()
    ref = _train(model, batch)
    for name in ("megatron(tp=1, ep=2)", "autopar"):
        print(f"{name} on {world} processes ({' × '.join(results[name + ' mesh'])}):")
        for step, (a, b) in enumerate(zip(results[name], ref)):
            print(f"  step {step}: loss {a:.6f}   one process {b:.6f}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plan-only", action="store_true")
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    plan_demo()
    if not args.plan_only:
        train_demo()

"""Example models written the way people write them: plain ``nn.Module`` code, no autopar hooks.

``GPT`` is a GPT-2-style decoder (fused QKV ``nn.Linear``, pre-LayerNorm, GELU MLP, learned
positions, LM head tied to the token embedding) that returns the mean next-token cross-entropy when
given ``targets``; ``MLP`` is a plain feed-forward stack with a regression loss. Both build on the
meta device (``with torch.device("meta"): GPT(GPTConfig.gpt3_175b())``) for planning.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPT", "MLP", "GPTConfig"]


@dataclass(kw_only=True, slots=True)
class GPTConfig:
    vocab_size: int = 50304
    """Vocabulary size (padded to a multiple of 64, as nanoGPT and Megatron-LM do)."""
    block_size: int = 1024
    """Longest sequence."""
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    """Dropout probability on the attention probabilities and on each residual branch (the
    embeddings' sum included), as GPT-2 and Megatron-LM's GPT place it; 0: none."""
    bias: bool = True
    tie_embeddings: bool = True
    """The LM head shares the token embedding's weight (GPT-2, Press & Wolf 2017); ``False``: its
    own weight, as Megatron-Core's ``--untie-embeddings-and-output-weights`` and LLaMA have it."""
    attention: str = "sdpa"
    """``"sdpa"``: ``F.scaled_dot_product_attention`` (a fused FlashAttention-style kernel on GPUs);
    ``"math"``: attention written out as Megatron-LM's GPT of 2021 runs it (Narayanan et al., SC'21)
    — ``baddbmm`` of ``Q·Kᵀ`` scaled by ``1/√d``, the causal mask, softmax, dropout and a ``bmm`` with
    ``V``, every ``s × s`` score materialised."""

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be a multiple of n_head ({self.n_head})")
        if self.attention not in ("sdpa", "math"):
            raise ValueError(f"attention must be 'sdpa' or 'math', got {self.attention!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout is a probability in [0, 1), got {self.dropout}")

    @classmethod
    def tiny(cls, **kw: int) -> GPTConfig:
        base = dict(vocab_size=128, block_size=32, n_layer=2, n_head=4, n_embd=32)
        base.update(kw)
        return cls(**base)

    @classmethod
    def gpt2_small(cls) -> GPTConfig:
        return cls()

    @classmethod
    def gpt3_175b(cls) -> GPTConfig:
        return cls(vocab_size=51200, block_size=2048, n_layer=96, n_head=96, n_embd=12288)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = cfg.dropout
        self.math = cfg.attention == "math"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q = q.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        k = k.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        v = v.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        p = self.dropout if self.training else 0.0
        if self.math:
            y = self._math_attention(q, k, v, p)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        return self.proj(y)

    @staticmethod
    def _math_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: float) -> torch.Tensor:
        b, h, t, d = q.shape
        qf, kf = q.reshape(b * h, t, d), k.reshape(b * h, t, d)
        empty = torch.empty(b * h, t, t, dtype=q.dtype, device=q.device)
        scores = torch.baddbmm(empty, qf, kf.transpose(1, 2), beta=0.0, alpha=d**-0.5).view(b, h, t, t)
        causal = torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1)
        probs = F.dropout(scores.masked_fill(causal, float("-inf")).softmax(dim=-1), p)
        return torch.bmm(probs.view(b * h, t, t), v.reshape(b * h, t, d)).view(b, h, t, d)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout) if cfg.dropout else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln_1(x)))
        return x + self.drop(self.proj(F.gelu(self.fc(self.ln_2(x)))))


class GPT(nn.Module):
    """GPT-2-style language model; ``forward(idx, targets=None)`` returns the loss or the logits."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.wte.weight  # weight tying (Press & Wolf, 2017)
        self.drop = nn.Dropout(cfg.dropout) if cfg.dropout else nn.Identity()
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        """GPT-2's initialization: N(0, 0.02) weights, zero biases."""
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


class MLP(nn.Module):
    """A feed-forward regression model: ``forward(x, y)`` returns the mean squared error."""

    def __init__(self, dims: tuple[int, ...] = (64, 256, 256, 64)) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in itertools.pairwise(dims))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = F.gelu(x)
        return F.mse_loss(x, y)

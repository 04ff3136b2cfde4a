"""The gradient compression a plan records: which method, its settings, and which gradients
PowerSGD compresses.

A data-level record (``Plan.compression``), read by the cost model (``autopar.cost.compression``,
which defines the words and prices it), the rank-program pass that writes it into the program
(``autopar.passes.compress``) and the plan file. ``powersgd_matrix`` and ``for_weight`` are the
rules both the cost model and that pass apply, so the plan prices exactly the matrices the
program compresses.

**Lookup tables stay exact under PowerSGD.** An embedding table's gradient has a row for each
index looked up and zeros elsewhere: its rank is the number of distinct indices in the batch, so a
rank-``r`` approximation loses most of it (a tied embedding and LM head alike, its gradient the
sum of both). On ``examples/compression.py converge`` (a 2-layer GPT, 4 gloo processes, 200 AdamW
steps, rank 4) compressing the tied table left the held-out loss 6.7 % above exact, keeping it
exact 3.3 % for 18 % more bytes. bf16 compresses it as any other gradient.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["FP8_MAX", "METHODS", "GradCompression", "powersgd_matrix", "topk_count"]

METHODS = ("bf16", "fp8", "topk", "powersgd")
"""The compression methods (``autopar.cost.compression`` defines each)."""

FP8_MAX = 448.0
"""The largest finite float8 e4m3 value: a quantized chunk is scaled so its largest magnitude
lands there (OCP 8-bit floating point specification, 2023: E4M3's maximum normal, 1.75 · 2⁸)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class GradCompression:
    """How the data-parallel gradient all-reduces are compressed (module docstring)."""

    method: str
    """``"bf16"``, ``"fp8"``, ``"topk"`` or ``"powersgd"``."""
    rank: int = 4
    """PowerSGD's approximation rank ``r`` (Vogels et al. reach the uncompressed accuracy at 2–4
    on their image and language models)."""
    min_compression_rate: float = 2.0
    """PowerSGD compresses a matrix only where it sends at least this many times fewer bytes."""
    warmup_steps: int = 0
    """Steps whose gradients are all-reduced exactly before PowerSGD starts (PyTorch's
    ``start_powerSGD_iter``; Vogels et al. start from the first step). The predicted step is the
    compressed one that follows."""
    density: float = 0.01
    """Top-k's share of a gradient's elements sent each step (Lin et al., "Deep Gradient
    Compression", ICLR 2018, send 0.1 %; Stich et al., "Sparsified SGD with memory", NeurIPS 2018,
    prove convergence for any share with error feedback)."""

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"GradCompression: unknown method {self.method!r}; known: {', '.join(METHODS)}")
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(
                f"GradCompression: rank must be a whole number ≥ 1 (PowerSGD sends (m + n) · rank values "
                f"for an m × n gradient), got {self.rank!r}"
            )
        w = self.warmup_steps
        if isinstance(w, bool) or not isinstance(w, int) or w < 0:
            raise ValueError(f"GradCompression: warmup_steps must be a whole number ≥ 0, got {w!r}")
        d = self.density
        if isinstance(d, bool) or not isinstance(d, (int, float)) or not 0 < d <= 1:
            raise ValueError(
                f"GradCompression: density must be in (0, 1] (top-k sends ceil(density · n) of a gradient's "
                f"n elements), got {d!r}"
            )
        if not isinstance(self.min_compression_rate, (int, float)) or self.min_compression_rate < 1:
            raise ValueError(
                f"GradCompression: min_compression_rate must be ≥ 1 (a matrix is compressed where "
                f"(m + n) · rank · rate < m · n), got {self.min_compression_rate!r}"
            )

    def for_weight(self, lookup: bool) -> GradCompression | None:
        """This compression for one weight's gradient; ``lookup``: the weight is a lookup table
        (read by an embedding op), which PowerSGD leaves exact (module docstring)."""
        return None if lookup and self.method == "powersgd" else self

    def describe(self) -> str:
        return {
            "powersgd": f"PowerSGD rank {self.rank}",
            "bf16": "bf16 all-reduce",
            "fp8": "fp8 (e4m3) reduction with error feedback",
            "topk": f"top-k {self.density * 100:g} % with error feedback",
        }[self.method]

    def to_dict(self) -> dict[str, Any]:
        """Every field by its name (the plan file's ``compression``)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GradCompression:
        return cls(
            method=d["method"],
            rank=int(d.get("rank", 4)),
            min_compression_rate=float(d.get("min_compression_rate", 2.0)),
            warmup_steps=int(d.get("warmup_steps", 0)),
            density=float(d.get("density", 0.01)),
        )


def powersgd_matrix(shape: Sequence[int], c: GradCompression) -> tuple[int, int] | None:
    """``(m, n)`` of the matrix PowerSGD compresses a gradient of ``shape`` as, or ``None`` where
    it is sent as it is (a vector, or too small to gain ``min_compression_rate``)."""
    if len(shape) < 2:
        return None
    m, n = int(shape[0]), math.prod(int(s) for s in shape[1:])
    if (m + n) * c.rank * c.min_compression_rate >= m * n:
        return None
    return m, n


def topk_count(numel: int, c: GradCompression) -> int:
    """Elements top-k sends of a gradient of ``numel``: ``ceil(density · numel)``, at least one."""
    return max(1, math.ceil(c.density * numel))

"""Memory per device: training state (weights, gradients, optimizer state) under ZeRO, and the
activations a transformer layer saves for backward, with and without recomputation.

**Training state.** Per parameter, with ``K`` bytes of optimizer state (Rajbhandari et al., "ZeRO",
arXiv 1910.02054, §3.1 and §5, Table 1, for mixed-precision Adam: bf16/fp16 weight 2 + gradient 2 +
``K = 12``: an fp32 master weight and two fp32 moments):

* DDP (stage 0):  ``2 + 2 + K``      = 16 bytes
* ZeRO-1:         ``2 + 2 + K/N``    optimizer state sharded over the ``N`` data-parallel devices
* ZeRO-2:         ``2 + (2 + K)/N``  gradients sharded too
* ZeRO-3:         ``(2 + 2 + K)/N``  weights sharded too

With bf16 optimizer moments and the fp32 master kept, ``K = 4 + 2 + 2 = 8``: 12 / 5 / 3.25 / 1.5
bytes per parameter at N = 8 (``zero_bytes_per_param``). Without master weights the moments take
the parameters' dtype, as ``torch.optim`` keeps them (``zeros_like(param)``): bf16 AdamW is
2 + 2 + 2·2 = 8 bytes per parameter; fp32 AdamW 4 + 4 + 8 = 16.

**Activations** of one transformer layer in 16-bit (Korthikanti et al., "Reducing Activation
Recomputation in Large Transformer Models", arXiv 2205.05198, §4 and Table 2; ``s`` sequence,
``b`` micro-batch, ``h`` hidden, ``a`` heads, ``t`` tensor-parallel size; one byte per dropout
mask element):

* no recomputation:            ``sbh(34 + 5as/h)``; with TP ``sbh(10 + 24/t + 5as/(ht))``; with TP
  and sequence parallelism ``sbh(34/t + 5as/(ht))``
* selective recomputation:     ``sbh(10 + 24/t)``; with TP and SP ``34·sbh/t`` (the attention
  core — softmax, its dropout, the score matmuls — recomputed)
* full recomputation:          ``2·sbh`` (only the layer's input is kept; ``2·sbh/t`` when it is
  sequence-parallel)

Under recomputation no dropout mask is kept: a recomputed dropout draws its mask again from the
generator state its forward recorded (a few KB per op, not counted; ``autopar.program.rng``), as
Megatron-LM's recomputation does — the rule ``passes.strategies.recomputed`` costs and
``passes.recompute`` runs.

``activation_bytes_per_layer`` gives these; the graph-level count of what autograd saves
(``autopar.passes.annotate``) reproduces the first for a standard GPT layer.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "OPTIMIZER_BYTES_PER_PARAM",
    "OPTIMIZER_MOMENTS",
    "RECOMPUTE",
    "StateBytes",
    "activation_bytes_per_layer",
    "state_bytes_per_param",
    "training_state_bytes",
    "zero_bytes_per_param",
]

OPTIMIZER_MOMENTS = {"adamw": 2, "adam": 2, "sgd": 0, "sgd_momentum": 1}
"""Tensors of optimizer state per parameter tensor (Adam: first and second moments)."""
OPTIMIZER_BYTES_PER_PARAM = {k: 4 * v for k, v in OPTIMIZER_MOMENTS.items()}
"""Optimizer state in fp32 per parameter (not counting an fp32 master copy)."""
RECOMPUTE = (None, "selective", "full")
"""Activation recomputation choices (module docstring)."""


@dataclass(frozen=True, slots=True)
class StateBytes:
    """Bytes of training state per parameter, by part."""

    weight: float
    grad: float
    optimizer: float
    """Optimizer moments plus the fp32 master weight when there is one."""

    @property
    def total(self) -> float:
        return self.weight + self.grad + self.optimizer


def state_bytes_per_param(
    param_bytes: int,
    *,
    optimizer: str = "adamw",
    master_weights: bool = False,
    state_bytes: int | None = None,
) -> StateBytes:
    """Bytes per parameter of weight, gradient and optimizer state (module docstring).

    ``state_bytes``: bytes per element of each optimizer moment; ``None``: fp32 (4) with master
    weights, the parameters' own size without (``torch.optim``'s ``zeros_like(param)``).
    """
    if optimizer not in OPTIMIZER_MOMENTS:
        raise ValueError(f"unknown optimizer {optimizer!r}; known: {sorted(OPTIMIZER_MOMENTS)}")
    if state_bytes is None:
        state_bytes = 4 if master_weights else param_bytes
    opt = OPTIMIZER_MOMENTS[optimizer] * state_bytes + (4 if master_weights else 0)
    return StateBytes(weight=float(param_bytes), grad=float(param_bytes), optimizer=float(opt))


def training_state_bytes(
    numel: float,
    param_bytes: int,
    *,
    optimizer: str = "adamw",
    mixed_precision: bool = False,
    state_bytes: int | None = None,
    param_shards: int = 1,
    grad_shards: int = 1,
    optimizer_shards: int = 1,
    offload_optimizer: bool = False,
) -> float:
    """Bytes one device holds for ``numel`` parameter elements.

    ``*_shards``: how many ways each part of the state is split (tensor-parallel sharding times the
    ZeRO sharding of that part). ``mixed_precision``: an fp32 master weight is kept (counted with
    the optimizer state); ``state_bytes`` as in ``state_bytes_per_param``. ``offload_optimizer``:
    the optimizer state and master weight live in host memory (``autopar.cost.offload``), not on
    the device.
    """
    s = state_bytes_per_param(
        param_bytes, optimizer=optimizer, master_weights=mixed_precision, state_bytes=state_bytes
    )
    on_device = 0.0 if offload_optimizer else s.optimizer / optimizer_shards
    return numel * (s.weight / param_shards + s.grad / grad_shards + on_device)


def zero_bytes_per_param(
    stage: int, n: int, *, weight_bytes: float = 2, grad_bytes: float = 2, optimizer_bytes: float = 12
) -> float:
    """Bytes per parameter on each of ``n`` data-parallel devices under ZeRO ``stage`` (0: plain
    data parallelism): ZeRO paper Table 1 (module docstring). ``optimizer_bytes`` is ``K``."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage}")
    if n < 1:
        raise ValueError(f"ZeRO needs n >= 1 data-parallel devices, got {n}")
    w, g, k = weight_bytes, grad_bytes, optimizer_bytes
    return (w, w, w, w / n)[stage] + (g, g, g / n, g / n)[stage] + (k, k / n, k / n, k / n)[stage]


def activation_bytes_per_layer(
    seq: int,
    batch: int,
    hidden: int,
    heads: int,
    *,
    tp: int = 1,
    sequence_parallel: bool = False,
    recompute: str | None = None,
) -> float:
    """Bytes one device keeps for backward per transformer layer (Korthikanti et al. Table 2,
    module docstring): 16-bit activations, one-byte dropout masks, attention scores materialized."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {RECOMPUTE}, got {recompute!r}")
    if tp < 1:
        raise ValueError(f"tp must be >= 1, got {tp}")
    sbh = float(seq) * batch * hidden
    scores = 5.0 * heads * seq / hidden
    if recompute == "full":
        return 2.0 * sbh / (tp if sequence_parallel else 1)
    if sequence_parallel:
        return sbh * (34.0 / tp + (0.0 if recompute == "selective" else scores / tp))
    return sbh * (10.0 + 24.0 / tp + (0.0 if recompute == "selective" else scores / tp))

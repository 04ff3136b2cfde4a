"""Shared pieces of the runtime tests (``tests/test_runtime_*.py``): tiny models, plans by layout
name, a training loop with its single-process reference, and a log of the collectives issued.

The worker functions ``autopar.runtime.launch.spawn`` runs live at module level in the test
modules next to their tests; spawned children import them by module name (pytest puts ``tests/``
on ``sys.path``, and children inherit it), and import this module with them. A worker builds its
model itself from a seed, so every rank starts from the weights of the reference computed in the
pytest process. One spawn runs several layouts in one process group, one after another: starting
processes and importing torch costs seconds, a layout a fraction of that.

Comparisons (``compare_training``) follow the numerics of the test plan: losses within a relative
1e-5 of one process at every step; after SGD parameters within a relative 1e-5 (the gradients are
exact); after AdamW within an absolute 2e-5 — AdamW divides by the root of the second moment, so a
parameter whose gradient is ~0 (the key bias of a fused QKV, whose gradient is identically zero)
turns rounding noise into updates of up to ``lr`` per step; 2e-5 is 1 % of the largest 3-step
update at ``lr=1e-3``.
"""

from __future__ import annotations

import os
from typing import Any

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch
from torch import nn

STEPS = 3
"""Optimizer steps of every training-equivalence run."""
LOSS_RTOL = 1e-5
ADAMW_ATOL = 2e-5
SGD_RTOL = 1e-5
MODELS = ("gpt2", "llama", "gpt")
VOCAB, BATCH, SEQ = 64, 4, 16


# ------------------------------------------------------------------------------------------ models


def quiet() -> None:
    """Silence transformers' config warnings and Python warnings in a worker."""
    import warnings

    os.environ["TRANSFORMERS_VERBOSITY"] = "error"
    warnings.simplefilter("ignore")


def build(kind: str, seed: int = 0, vocab: int = VOCAB, batch: int = BATCH) -> tuple[nn.Module, Any]:
    """``(model, inputs)``: a tiny fp32 model with no dropout and one global batch (``batch``
    sequences of ``SEQ`` tokens from a ``vocab`` of that many).

    ``kind``: ``"gpt2"`` (``GPT2LMHeadModel``; ``"gpt2-eager"`` with transformers' eager
    attention, whose scores are ``s × s`` tensors), ``"llama"`` (``LlamaForCausalLM``, 4 heads, 2 KV
    heads) or ``"gpt"`` (``autopar.models.GPT``, positional ``(idx, targets)``). Transformers
    models take ``{"input_ids", "labels"}`` with ``labels`` a different tensor (``torch.export``
    would merge two uses of one tensor into one input).
    """
    torch.manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, SEQ))
    if kind == "gpt":
        from autopar.models import GPT, GPTConfig

        model = GPT(GPTConfig.tiny(n_layer=2, n_head=4, n_embd=32, vocab_size=vocab))
        return model, (ids, torch.randint(0, vocab, (batch, SEQ)))
    if kind in ("gpt2", "gpt2-eager"):
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(
            n_layer=2, n_embd=32, n_head=4, vocab_size=vocab, n_positions=32,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
            bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
        model = GPT2LMHeadModel(cfg)
        if kind == "gpt2-eager":  # transformers' eager attention: its scores are s × s tensors
            model.config._attn_implementation = "eager"
    elif kind == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(
            num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=64, vocab_size=vocab, max_position_embeddings=32, use_cache=False,
            bos_token_id=0, eos_token_id=0, pad_token_id=0,
        )  # fmt: skip
        model = LlamaForCausalLM(cfg)
    else:
        raise ValueError(f"unknown model kind {kind!r}; expected one of {MODELS}")
    return model, {"input_ids": ids, "labels": ids.clone()}


def loss_of(out: Any) -> torch.Tensor:
    """The loss a model call returned: a tensor (``autopar.models``) or a ``ModelOutput``."""
    return out if isinstance(out, torch.Tensor) else out["loss"]


def call(module: nn.Module, inputs: Any) -> Any:
    return module(**inputs) if isinstance(inputs, dict) else module(*inputs)


def input_paths(inputs: Any) -> list[str]:
    """The user-input paths a plan's ``fixed`` and ``inputs`` use (``"args[0]"``, ``"input_ids"``)."""
    return list(inputs) if isinstance(inputs, dict) else [f"args[{i}]" for i in range(len(inputs))]


class OneBlock(nn.Module):
    """Exactly one transformer block (``autopar.models.Block``) and a scalar loss."""

    def __init__(self, n_embd: int, n_head: int = 4) -> None:
        super().__init__()
        from autopar.models import Block, GPTConfig

        self.block = Block(GPTConfig.tiny(n_embd=n_embd, n_head=n_head))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x).pow(2).mean()


def build_block(batch: int, seq: int, n_embd: int, seed: int = 0) -> tuple[OneBlock, tuple[torch.Tensor]]:
    torch.manual_seed(seed)
    return OneBlock(n_embd), (torch.randn(batch, seq, n_embd),)


# ------------------------------------------------------------------------------------------- plans


def sharded_specs(model: nn.Module, inputs: Any, world: int) -> dict[str, tuple[str, ...]]:
    """ZeRO-style ``fixed`` specs on a 1-D mesh: every parameter split along its largest dimension
    where that divides by ``world`` (replicated otherwise), every input split along the batch."""
    specs: dict[str, tuple[str, ...]] = {}
    for name, p in model.named_parameters():
        d = max(range(p.dim()), key=lambda i: p.shape[i])
        specs[name] = (f"S({d})",) if p.shape[d] % world == 0 else ("R",)
    for path in input_paths(inputs):
        specs[path] = ("S(0)",)
    return specs


MODES_2 = ("auto", "megatron", "dp", "sp", "zero2", "zero3")


def make_plan(mode: str, model: nn.Module, inputs: Any, world: int):
    """The plan a layout name stands for on ``world`` local processes (``None`` for ``"auto"``:
    ``autopar.parallelize`` then plans on rank 0 and broadcasts)."""
    import autopar

    cluster = autopar.Cluster.local(world)
    if mode == "auto":
        return None
    if mode == "megatron":
        return autopar.layouts.megatron(model, inputs, cluster, tp=world)
    if mode == "sp":
        return autopar.layouts.megatron(model, inputs, cluster, tp=world, sequence_parallel=True)
    if mode == "tp2dp2":
        return autopar.layouts.megatron(model, inputs, cluster, tp=2, dp=world // 2)
    if mode == "dp":
        fixed = {n: ("R",) for n, _ in model.named_parameters()}
        return autopar.plan(model, inputs, cluster, fixed=fixed, mesh_shape=(world,))
    if mode in ("zero2", "zero3"):
        fixed = sharded_specs(model, inputs, world)
        return autopar.plan(
            model, inputs, cluster, fixed=fixed, mesh_shape=(world,), zero_stage=int(mode[-1])
        )
    raise ValueError(f"unknown layout {mode!r}")


# ---------------------------------------------------------------------------------------- training


def make_optimizer(name: str, params) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-3, eps=1e-6)
    if name == "sgd":
        return torch.optim.SGD(params, lr=1e-2)
    raise ValueError(name)


def train(module: nn.Module, inputs: Any, opt: torch.optim.Optimizer, steps: int = STEPS) -> list[float]:
    losses = []
    for _ in range(steps):
        loss = loss_of(call(module, inputs))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def train_worker(
    rank: int, world: int, plan: Any, optimizer: str = "adamw", kind: str = "gpt"
) -> dict[str, Any]:
    """A spawned rank's run under ``plan``: ``kind``'s model trained ``STEPS`` steps with
    ``optimizer`` on ``world`` local processes; its losses and the full final state."""
    import warnings

    import autopar

    warnings.simplefilter("ignore")
    model, inputs = build(kind)
    pm = autopar.parallelize(model, autopar.Cluster.local(world), inputs, plan=plan)
    losses = train(pm, inputs, make_optimizer(optimizer, pm.parameters()))
    return {"losses": losses, "state": pm.full_state_dict()}


def reference(kind: str, optimizer: str, steps: int = STEPS) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Losses and final ``state_dict`` of one process training the full model."""
    model, inputs = build(kind)
    losses = train(model, inputs, make_optimizer(optimizer, model.parameters()), steps)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def compare_training(
    ref: tuple[list[float], dict[str, torch.Tensor]],
    got: tuple[list[float], dict[str, torch.Tensor]],
    optimizer: str,
    what: str,
) -> list[str]:
    """Problems (empty when the run matches the reference within the tolerances above)."""
    ref_losses, ref_sd = ref
    losses, sd = got
    problems = []
    for step, (a, b) in enumerate(zip(losses, ref_losses)):
        if abs(a - b) > LOSS_RTOL * abs(b):
            problems.append(
                f"{what}: step {step} loss {a!r} vs one process {b!r} (rel {abs(a - b) / abs(b):.1e})"
            )
    if set(sd) != set(ref_sd):
        problems.append(
            f"{what}: full_state_dict keys differ: missing {sorted(set(ref_sd) - set(sd))}, "
            f"extra {sorted(set(sd) - set(ref_sd))}"
        )
    for key in sorted(set(sd) & set(ref_sd)):
        a, b = sd[key], ref_sd[key]
        if a.shape != b.shape:
            problems.append(f"{what}: {key} has shape {tuple(a.shape)}, expected {tuple(b.shape)}")
            continue
        diff = (a.double() - b.double()).abs().max().item()
        if optimizer == "adamw":
            if diff > ADAMW_ATOL:
                problems.append(f"{what}: {key} differs by {diff:.2e} after AdamW (tolerance {ADAMW_ATOL})")
        else:
            scale = b.abs().max().item()
            if diff > SGD_RTOL * scale:
                problems.append(
                    f"{what}: {key} differs by {diff:.2e} = {diff / scale:.1e} × max|{key}| after SGD"
                )
    return problems


# ------------------------------------------------------------------------------- collective counts


class CollectiveLog:
    """Every collective the runtime issues while the log is open: ``(kind, direction, numel)``.

    A module running its captured step program (``pm.step``) issues exactly the collective nodes
    of the forward and backward programs each time they run; ``StepProgram.count`` is called as
    each program runs, and the log appends that program's collectives with their sizes read off
    the graph (an all-gather: the local piece). A module without a step program falls back to the
    Python-level ``AxisGroup.note`` (kinds and directions, no sizes). Use as a context manager.
    """

    def __init__(self) -> None:
        self.calls: list[list[Any]] = []
        self._patched: list[tuple[Any, str, Any]] = []

    def __enter__(self) -> CollectiveLog:
        from autopar.program import collectives as C
        from autopar.program import records as S

        def count(step: Any, direction: str, _orig=S.StepProgram.count) -> None:
            self.calls.extend([c.kind, c.direction, c.numel] for c in step.calls.get(direction, ()))
            _orig(step, direction)

        def note(ax: Any, kind: str, direction: str, _orig=C.AxisGroup.note) -> None:
            if ax.counting:
                self.calls.append([kind, direction, None])
            _orig(ax, kind, direction)

        self._patch(S.StepProgram, "count", count)
        self._patch(C.AxisGroup, "note", note)
        return self

    def _patch(self, owner: Any, name: str, value: Any) -> None:
        self._patched.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    def __exit__(self, *exc: Any) -> None:
        for owner, name, orig in reversed(self._patched):
            setattr(owner, name, orig)
        self._patched.clear()


def regathered_params(pm: Any) -> int:
    """All-gathers the backward program issues on a parameter shard it read from forward (ZeRO-3
    gathering again in backward instead of keeping the gathered copy)."""
    if pm.step is None:
        return 0
    joint_primals = [n.name for n in pm.step.joint.graph.nodes if n.op == "placeholder"]
    params = {joint_primals[i] for i in pm.step.grad_primals}
    passthrough = {
        "view",
        "reshape",
        "_unsafe_view",
        "contiguous",
        "clone",
        "_to_copy",
        "t",
        "permute",
        "alias",
    }
    count = 0
    for n in pm.step.backward.graph.nodes:
        if n.op != "call_function" or "all_gather_into_tensor" not in str(n.target):
            continue
        src = n.args[0]
        while src.op == "call_function" and src.target.__name__.split(".")[0] in passthrough:
            src = src.args[0]
        count += src.op == "placeholder" and src.name in params
    return count


def gathers_in_flight(pm: Any) -> tuple[int, int]:
    """``(most all-gathers in flight at once in the step's forward program, gathers issued on the
    functional op's coalesced path)``: the ZeRO-3 prefetch keeps a layer's gathers in flight
    together; on gloo none may take the coalesced path (``passes.gather_buffers``)."""
    if pm.step is None:
        return 0, 0
    fc = __import__("torch").ops._c10d_functional
    flight: set[Any] = set()
    most = coalesced = 0
    for prog in (pm.step.forward, pm.step.backward):
        for n in prog.graph.nodes:
            coalesced += n.target is fc.all_gather_into_tensor.default
            if n.op == "call_function" and "all_gather_into_tensor" in str(n.target):
                flight.add(n)
            elif n.target is fc.wait_tensor.default:
                flight.discard(n.args[0])
            if prog is pm.step.forward:
                most = max(most, len(flight))
    return most, coalesced


def count_calls(calls: list, kind: str, direction: str, numel: int | None = None) -> int:
    """How many of a ``CollectiveLog``'s calls are ``kind`` in ``direction`` (of ``numel`` elements)."""
    return sum(1 for k, d, n in calls if k == kind and d == direction and (numel is None or n == numel))

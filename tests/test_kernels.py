"""The fused kernels of ``autopar.program.kernels`` on one process, under Triton's interpreter.

``tests/conftest.py`` sets ``TRITON_INTERPRET=1`` before anything imports triton, so every kernel
runs on the CPU block by block; ``test_the_kernels_run_here`` fails (rather than letting the rest
pass on the eager fallback) if they do not. Each family is checked forward and backward at fp32
(≤ 1e-5) against two eager compositions: one written here with plain torch ops, and the family's
``*_reference`` (what the fusion pass replaces). Shapes have tails (sizes not a multiple of the
block), odd row counts, and forced small blocks (``block_size``) so the looped paths run too.
Also: every ``autopar::*`` op passes ``torch.library.opcheck``; ``make_fx`` of forward and
backward records each fused op as one node each way, and so does the whole-step trace
(``passes.joint.trace_joint``), whose partitioned programs then run the kernels and match eager;
the eager fallback (what CPU training runs without the interpreter, or without triton) is checked
in subprocesses; and every kernel compiles for an H100 (sm_90) with Triton's compiler and bundled
ptxas — no GPU needed — so errors the interpreter cannot see (it runs kernels as Python) fail here.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from autopar.program import kernels as K

# The interpreter computes in NumPy, which warns where ``exp`` overflows to inf (σ of a large
# negative value: 1 / (1 + inf) = 0, as on a GPU) and where the side of a ``tl.where`` not taken
# is NaN (the −inf guards of the cross-entropy).
pytestmark = [
    pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
]

TOL = {"atol": 1e-5, "rtol": 1e-5}
BF16_TOL = {"atol": 3e-2, "rtol": 2e-2}
ops = torch.ops.autopar


def _close(a: torch.Tensor, b: torch.Tensor, what: str, tol: dict = TOL) -> None:
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} ≠ {tuple(b.shape)}"
    assert a.dtype == b.dtype, f"{what}: dtype {a.dtype} ≠ {b.dtype}"
    torch.testing.assert_close(a, b, **tol, msg=lambda m: f"{what}: {m}")


def _grads(outs: tuple[torch.Tensor, ...], upstream: tuple[torch.Tensor, ...], inputs: list[torch.Tensor]):
    loss = sum((o.float() * u.float()).sum() for o, u in zip(outs, upstream))
    return torch.autograd.grad(loss, inputs)


def _leaf(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).requires_grad_(True)


def _check_family(fused, compositions, inputs, what, tol=TOL, seed=100):
    """Forward outputs and input gradients of ``fused(*inputs)`` against each composition's."""
    tensors = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    out = fused(*inputs)
    out = out if isinstance(out, tuple) else (out,)
    g = torch.Generator().manual_seed(seed)
    upstream = tuple(torch.randn(o.shape, generator=g).to(o.dtype) for o in out)
    got = _grads(out, upstream, tensors)
    for name, comp in compositions.items():
        ref = comp(*inputs)
        ref = ref if isinstance(ref, tuple) else (ref,)
        want = _grads(ref, upstream, tensors)
        for i, (a, b) in enumerate(zip(out, ref)):
            _close(a, b, f"{what} vs {name}: output {i}", tol)
        for i, (a, b) in enumerate(zip(got, want)):
            _close(a, b, f"{what} vs {name}: gradient of input {i}", tol)


def test_the_kernels_run_here():
    """Guards every other test: under the interpreter the fused ops run their Triton kernels."""
    assert os.environ.get("TRITON_INTERPRET") == "1", "tests/conftest.py should set TRITON_INTERPRET=1"
    assert K.backend(torch.zeros(1)) == "triton", "the Triton kernels do not run on the CPU here"
    assert K.available("cpu")
    assert K.backend(torch.zeros(1, device="meta")) == "eager"


# ------------------------------------------------------------------------- residual + LayerNorm


def _layer_norm_here(x, r, w, b, eps):
    s = x + r if r is not None else x
    mu = s.mean(-1, keepdim=True)
    var = ((s - mu) ** 2).mean(-1, keepdim=True)
    y = (s - mu) / torch.sqrt(var + eps)
    if w is not None:
        y = y * w
    if b is not None:
        y = y + b
    return y, s


NORM_SHAPES = [((5, 37), None), ((5, 37), 16), ((2, 3, 130), 32), ((7, 130), None)]


@pytest.mark.parametrize(("shape", "block"), NORM_SHAPES)
@pytest.mark.parametrize("residual", [True, False])
@pytest.mark.parametrize("affine", ["weight+bias", "weight", "none"])
def test_add_layer_norm(shape, block, residual, affine):
    n = shape[-1]
    x, r = _leaf(*shape, seed=1), _leaf(*shape, seed=2) if residual else None
    w = _leaf(n, seed=3) if affine != "none" else None
    b = _leaf(n, seed=4) if affine == "weight+bias" else None
    assert K.backend(x) == "triton"
    _check_family(
        lambda *a: K.add_layer_norm(*a, block_size=block),
        {"composition": _layer_norm_here, "reference": K.add_layer_norm_reference},
        [x, r, w, b, 1e-5],
        f"add_layer_norm {shape} block={block} residual={residual} {affine}",
    )


def test_add_layer_norm_without_residual_returns_x_and_gradients_add():
    x = _leaf(3, 20)
    out, s = K.add_layer_norm(x, None, None, None, 1e-5)
    assert s is x
    # The residual stream's gradient (here: s's) and the norm's both reach x.
    (gx,) = torch.autograd.grad(out.sum() + (s * 2).sum(), [x])
    (gref,) = torch.autograd.grad(F.layer_norm(x, (20,)).sum() + (x * 2).sum(), [x])
    _close(gx, gref, "gradient of x through both outputs")


def test_add_layer_norm_only_the_residual_stream_used():
    x, r = _leaf(3, 20, seed=1), _leaf(3, 20, seed=2)
    _out, s = K.add_layer_norm(x, r, None, None, 1e-5)
    gx, gr = torch.autograd.grad((s * 3).sum(), [x, r])
    _close(gx, torch.full_like(gx, 3.0), "dx")
    _close(gr, torch.full_like(gr, 3.0), "dresidual")


# --------------------------------------------------------------------------- residual + RMSNorm


def _rms_norm_here(x, r, w, eps):
    s = x + r if r is not None else x
    y = (s.double() / torch.sqrt((s.double() * s.double()).mean(-1, keepdim=True) + eps)).to(s.dtype)
    return (y * w if w is not None else y), s


@pytest.mark.parametrize(("shape", "block"), NORM_SHAPES)
@pytest.mark.parametrize("residual", [True, False])
@pytest.mark.parametrize("weight", [True, False])
def test_add_rms_norm(shape, block, residual, weight):
    x, r = _leaf(*shape, seed=1), _leaf(*shape, seed=2) if residual else None
    w = _leaf(shape[-1], seed=3) if weight else None
    _check_family(
        lambda *a: K.add_rms_norm(*a, block_size=block),
        {"composition": _rms_norm_here, "reference": K.add_rms_norm_reference},
        [x, r, w, 1e-6],
        f"add_rms_norm {shape} block={block} residual={residual} weight={weight}",
    )


def test_add_rms_norm_matches_transformers_llama_rms_norm():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(37, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(37))
    x, r = _leaf(5, 37, seed=1), _leaf(5, 37, seed=2)
    out, _ = K.add_rms_norm(x, r, norm.weight, norm.variance_epsilon, block_size=16)
    _close(out, norm(x + r), "LlamaRMSNorm")
    gx, gw = torch.autograd.grad(out.sum(), [x, norm.weight])
    rx, rw = torch.autograd.grad(norm(x + r).sum(), [x, norm.weight])
    _close(gx, rx, "dx")
    _close(gw, rw, "dweight")


# ----------------------------------------------------------------------------------- bias + GeLU


def _gelu_here(x, b, approximate):
    z = x + b if b is not None else x
    if approximate == "tanh":  # GPT-2's NewGELUActivation, written out
        return 0.5 * z * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (z + 0.044715 * torch.pow(z, 3.0))))
    return 0.5 * z * (1.0 + torch.erf(z / math.sqrt(2.0)))


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize(("shape", "block"), [((5, 37), None), ((3, 130), 64), ((2, 3, 37), 16)])
def test_bias_gelu(approximate, bias, shape, block):
    x = _leaf(*shape, seed=1) * 3  # values out to ±9: both tails of the GeLU
    x = x.detach().requires_grad_(True)
    b = _leaf(shape[-1], seed=2) if bias else None
    _check_family(
        lambda *a: K.bias_gelu(*a, block_size=block),
        {"composition": _gelu_here, "reference": K.bias_gelu_reference},
        [x, b, approximate],
        f"bias_gelu {approximate} bias={bias} {shape} block={block}",
    )


def test_bias_gelu_rejects_unknown_approximation():
    with pytest.raises(ValueError, match="approximate"):
        K.bias_gelu(torch.zeros(2, 3), None, "sigmoid")


# ---------------------------------------------------------------------------------------- SwiGLU


@pytest.mark.parametrize(("shape", "block"), [((5, 37), None), ((3, 130), 64), ((2, 3, 37), 16)])
def test_swiglu(shape, block):
    gate, up = _leaf(*shape, seed=1), _leaf(*shape, seed=2)
    _check_family(
        lambda *a: K.swiglu(*a, block_size=block),
        {"composition": lambda g, u: g * torch.sigmoid(g) * u, "reference": K.swiglu_reference},
        [gate, up],
        f"swiglu {shape} block={block}",
    )


def test_swiglu_broadcasts_outside_the_kernel():
    gate, up = _leaf(3, 1, 8, seed=1), _leaf(1, 5, 8, seed=2)
    _check_family(K.swiglu, {"reference": K.swiglu_reference}, [gate, up], "swiglu broadcast")


# ---------------------------------------------------------------------------------------- rotary


def _rotary_here(q, k, cos, sin):
    def one(x):
        x1, x2 = x.chunk(2, dim=-1)
        c1, c2 = cos.chunk(2, dim=-1)
        s1, s2 = sin.chunk(2, dim=-1)
        return torch.cat((x1 * c1 - x2 * s1, x2 * c2 + x1 * s2), dim=-1)

    return one(q), one(k)


def _cos_sin(b: int, s: int, d: int, form: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Position tables as transformers' LLaMA builds them (``emb = cat(freqs, freqs)``), with a
    per-batch offset so a ``[b, 1, s, d]`` table differs between batch entries."""
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    pos = torch.arange(s).float()[None, :] + torch.arange(b).float()[:, None] * 3
    emb = torch.cat([pos[..., None] * inv] * 2, dim=-1)  # [b, s, d]
    cos, sin = emb.cos()[:, None], emb.sin()[:, None]  # [b, 1, s, d]
    if form == "[1,1,s,d]":
        return cos[:1], sin[:1]
    if form == "[s,d]":
        return cos[0, 0], sin[0, 0]
    return cos, sin


@pytest.mark.parametrize("form", ["[b,1,s,d]", "[1,1,s,d]", "[s,d]"])
@pytest.mark.parametrize(("hq", "hk", "d"), [(4, 2, 16), (3, 3, 10), (2, 1, 6)])
@pytest.mark.parametrize("rows", [None, 4])
def test_rotary(form, hq, hk, d, rows):
    """``rows``: rows per program; 4 splits q's 2·hq·5 rows and k's into tiles with a short last one."""
    b, s = 2, 5
    q, k = _leaf(b, hq, s, d, seed=1), _leaf(b, hk, s, d, seed=2)
    cos, sin = _cos_sin(b, s, d, form)
    _check_family(
        lambda *a: K.rotary(*a, block_size=rows),
        {"composition": _rotary_here, "reference": K.rotary_reference},
        [q, k, cos, sin],
        f"rotary hq={hq} hk={hk} d={d} cos {form} rows={rows}",
    )


def test_rotary_reads_transposed_projections_through_strides():
    """q and k as attention makes them: ``[b, s, h, d]`` projections transposed to ``[b, h, s, d]``."""
    b, s, hq, hk, d = 2, 5, 4, 2, 8
    q = _leaf(b, s, hq, d, seed=1).transpose(1, 2)
    k = _leaf(b, s, hk, d, seed=2).transpose(1, 2)
    assert not q.is_contiguous()
    cos, sin = _cos_sin(b, s, d, "[b,1,s,d]")
    _check_family(
        lambda *a: K.rotary(*a, block_size=8),
        {"reference": K.rotary_reference},
        [q, k, cos, sin],
        "transposed",
    )


def test_rotary_matches_transformers_apply_rotary_pos_emb():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    q, k = _leaf(2, 4, 5, 8, seed=1), _leaf(2, 2, 5, 8, seed=2)
    cos, sin = _cos_sin(2, 5, 8, "[b,1,s,d]")
    want = apply_rotary_pos_emb(q, k, cos[:, 0], sin[:, 0])  # it unsqueezes dim 1 itself
    for i, (a, b) in enumerate(zip(K.rotary(q, k, cos, sin), want)):
        _close(a, b, f"apply_rotary_pos_emb output {i}")


# --------------------------------------------------------------------------------- cross-entropy


def _ce_here(logits, target, ignore_index, reduction):
    logp = logits - torch.logsumexp(logits, dim=-1, keepdim=True)
    valid = target != ignore_index
    picked = logp.gather(-1, torch.where(valid, target, 0).unsqueeze(-1)).squeeze(-1)
    loss = torch.where(valid, -picked, 0.0)
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / valid.sum()


def _targets(n: int, v: int, ignored: tuple[int, ...], ignore_index: int, seed: int = 5) -> torch.Tensor:
    t = torch.randint(0, v, (n,), generator=torch.Generator().manual_seed(seed))
    t[list(ignored)] = ignore_index
    return t


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize(("n", "v", "block"), [(7, 37, None), (7, 37, 16), (3, 130, 32), (5, 130, None)])
@pytest.mark.parametrize("ignore_index", [-100, 3])
def test_cross_entropy(reduction, n, v, block, ignore_index):
    logits = (_leaf(n, v, seed=1) * 4).detach().requires_grad_(True)
    target = _targets(n, v, (1, n - 1), ignore_index)
    _check_family(
        lambda x, t, i, r: K.cross_entropy(x, t, i, r, block_size=block),
        {"composition": _ce_here, "reference": K.cross_entropy_reference},
        [logits, target, ignore_index, reduction],
        f"cross_entropy {reduction} [{n}, {v}] block={block} ignore_index={ignore_index}",
    )


def test_cross_entropy_all_rows_ignored_is_nan_like_torch():
    logits = _leaf(3, 11)
    target = torch.full((3,), -100)
    assert torch.isnan(K.cross_entropy(logits, target)) and torch.isnan(F.cross_entropy(logits, target))
    _close(
        K.cross_entropy(logits, target, reduction="sum"),
        F.cross_entropy(logits, target, reduction="sum"),
        "sum",
    )


def test_cross_entropy_handles_minus_infinity_logits():
    """A masked vocabulary (−inf columns, here a whole first block) leaves the online softmax finite."""
    x = torch.randn(4, 40)
    x[:, :16] = float("-inf")
    target = torch.tensor([20, 39, 16, -100])
    got = K.cross_entropy(x, target, reduction="none", block_size=16)
    _close(got, F.cross_entropy(x, target, reduction="none"), "loss with −inf logits")


def test_vocab_parallel_cross_entropy_on_one_device():
    """No axes: the per-row loss of the local classes; targets outside ``[class_start,
    class_start + V)`` pick nothing (the owner of that class adds its logit in the all-reduce)."""
    logits = _leaf(6, 37, seed=1)
    start = 10
    target = torch.tensor([10, 46, 20, -100, 3, 60])  # 3 and 60: owned by another rank
    got = K.vocab_parallel_cross_entropy(logits, target, start, (), block_size=16)
    owned = (target >= start) & (target < start + 37)
    lse = torch.logsumexp(logits, -1)
    picked = logits.gather(-1, torch.where(owned, target - start, 0)[:, None])[:, 0]
    want = torch.where(target != -100, lse - torch.where(owned, picked, 0.0), 0.0)
    _close(got, want, "per-row loss")
    (g,) = torch.autograd.grad((got * torch.arange(6.0)).sum(), [logits])
    (gw,) = torch.autograd.grad((want * torch.arange(6.0)).sum(), [logits])
    _close(g, gw, "gradient")


# ------------------------------------------------------------------------------- bf16 and dtypes


def test_bf16_inputs_give_bf16_outputs_close_to_eager():
    x, r = _leaf(5, 37, dtype=torch.bfloat16, seed=1), _leaf(5, 37, dtype=torch.bfloat16, seed=2)
    w, b = _leaf(37, dtype=torch.bfloat16, seed=3), _leaf(37, dtype=torch.bfloat16, seed=4)
    _check_family(
        K.add_layer_norm, {"reference": K.add_layer_norm_reference}, [x, r, w, b, 1e-5], "LN bf16", BF16_TOL
    )
    _check_family(
        K.add_rms_norm, {"reference": K.add_rms_norm_reference}, [x, r, w, 1e-6], "RMS bf16", BF16_TOL
    )
    _check_family(K.bias_gelu, {"reference": K.bias_gelu_reference}, [x, b, "tanh"], "GeLU bf16", BF16_TOL)
    _check_family(K.swiglu, {"reference": K.swiglu_reference}, [x, r], "SwiGLU bf16", BF16_TOL)
    q, k = _leaf(2, 4, 5, 8, dtype=torch.bfloat16, seed=5), _leaf(2, 2, 5, 8, dtype=torch.bfloat16, seed=6)
    cos, sin = (t.bfloat16() for t in _cos_sin(2, 5, 8, "[b,1,s,d]"))
    _check_family(K.rotary, {"reference": K.rotary_reference}, [q, k, cos, sin], "rotary bf16", BF16_TOL)
    logits, target = _leaf(5, 37, dtype=torch.bfloat16, seed=7), _targets(5, 37, (2,), -100)
    _check_family(
        K.cross_entropy,
        {"reference": K.cross_entropy_reference},
        [logits, target, -100, "mean"],
        "CE bf16",
        BF16_TOL,
    )


# ------------------------------------------------------------------- custom ops: opcheck, make_fx


def _opcheck_cases() -> dict[str, tuple]:
    x, r, w, b = torch.randn(5, 37), torch.randn(5, 37), torch.randn(37), torch.randn(37)
    g = torch.randn(5, 37)
    _, s, mean, rstd = ops.add_layer_norm(x, r, w, b, 1e-5)
    _, s2, rstd2 = ops.add_rms_norm(x, r, w, 1e-6)
    q, k = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8)
    cos, sin = _cos_sin(2, 5, 8, "[1,1,s,d]")
    logits, target = torch.randn(7, 37), _targets(7, 37, (1,), -100)
    _, lse = ops.cross_entropy(logits, target, -100)
    row = torch.randn(7)
    return {
        "add_layer_norm": (ops.add_layer_norm, (x, r, w, b, 1e-5, 16)),
        "add_layer_norm (no residual, weight, bias)": (ops.add_layer_norm, (x, None, None, None, 1e-5)),
        "add_layer_norm_backward": (ops.add_layer_norm_backward, (g, g, s, w, b, mean, rstd, 16)),
        "add_rms_norm": (ops.add_rms_norm, (x, r, w, 1e-6, 16)),
        "add_rms_norm (no residual, weight)": (ops.add_rms_norm, (x, None, None, 1e-6)),
        "add_rms_norm_backward": (ops.add_rms_norm_backward, (g, None, s2, w, rstd2)),
        "bias_gelu": (ops.bias_gelu, (x, b, "tanh", 16)),
        "bias_gelu_backward": (ops.bias_gelu_backward, (g, x, b, "none")),
        "swiglu": (ops.swiglu, (x, r)),
        "swiglu_backward": (ops.swiglu_backward, (g, x, r)),
        "rotary": (ops.rotary, (q, k, cos, sin, 8)),
        "rotary_backward": (ops.rotary_backward, (q, k, cos, sin, torch.float32, torch.float32)),
        "cross_entropy": (ops.cross_entropy, (logits, target, -100, 16)),
        "cross_entropy_backward": (ops.cross_entropy_backward, (row, logits, target, lse, -100)),
        "vocab_parallel_cross_entropy_stats": (ops.vocab_parallel_cross_entropy_stats, (logits, target, 4)),
        "vocab_parallel_cross_entropy": (
            ops.vocab_parallel_cross_entropy,
            (logits, target, lse, row, 4, -100),
        ),
        "vocab_parallel_cross_entropy_backward": (
            ops.vocab_parallel_cross_entropy_backward,
            (row, logits, target, lse, 4, -100),
        ),
    }


_DIFFERENTIABLE = {
    "add_layer_norm": (0, 1, 2, 3),
    "add_rms_norm": (0, 1, 2),
    "bias_gelu": (0, 1),
    "swiglu": (0, 1),
    "rotary": (0, 1),
    "cross_entropy": (0,),
    "vocab_parallel_cross_entropy": (0,),
}


@pytest.mark.parametrize("case", list(_opcheck_cases()))
def test_opcheck(case):
    op, args = _opcheck_cases()[case]
    args = list(args)
    for i in _DIFFERENTIABLE.get(case.split(" ")[0], ()):
        if isinstance(args[i], torch.Tensor):
            args[i] = args[i].detach().requires_grad_(True)
    torch.library.opcheck(op, tuple(args))


def _traced_ops(fn, inputs: list[torch.Tensor]) -> Counter:
    """The ``autopar::*`` nodes of ``make_fx`` (fake tensors) of ``fn`` and its input gradients."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def step(*xs):
        outs = fn(*xs)
        outs = outs if isinstance(outs, tuple) else (outs,)
        loss = sum(o.float().sum() for o in outs)
        return torch.autograd.grad(loss, [x for x in xs if x.requires_grad])

    gm = make_fx(step, tracing_mode="fake")(*inputs)
    return Counter(
        n.target.name().split("::")[1].split(".")[0]
        for n in gm.graph.nodes
        if n.op == "call_function"
        and isinstance(n.target, torch._ops.OpOverload)
        and n.target.namespace == "autopar"
    )


def _req(*shape: int) -> torch.Tensor:
    return torch.randn(*shape).requires_grad_(True)


TRACE_CASES = {
    "add_layer_norm": (
        lambda x, r, w, b: K.add_layer_norm(x, r, w, b, 1e-5),
        lambda: [_req(2, 3, 8), _req(2, 3, 8), _req(8), _req(8)],
        {"add_layer_norm": 1, "add_layer_norm_backward": 1},
    ),
    "add_rms_norm": (
        lambda x, r, w: K.add_rms_norm(x, r, w, 1e-6),
        lambda: [_req(2, 3, 8), _req(2, 3, 8), _req(8)],
        {"add_rms_norm": 1, "add_rms_norm_backward": 1},
    ),
    "bias_gelu": (
        lambda x, b: K.bias_gelu(x, b, "tanh"),
        lambda: [_req(2, 3, 8), _req(8)],
        {"bias_gelu": 1, "bias_gelu_backward": 1},
    ),
    "swiglu": (K.swiglu, lambda: [_req(2, 3, 8), _req(2, 3, 8)], {"swiglu": 1, "swiglu_backward": 1}),
    "rotary": (
        lambda q, k: K.rotary(q, k, *_cos_sin(2, 5, 8, "[b,1,s,d]")),
        lambda: [_req(2, 4, 5, 8), _req(2, 2, 5, 8)],
        {"rotary": 1, "rotary_backward": 1},
    ),
    "cross_entropy": (
        lambda x: K.cross_entropy(x, _targets(6, 11, (2,), -100)),
        lambda: [_req(6, 11)],
        {"cross_entropy": 1, "cross_entropy_backward": 1},
    ),
    "vocab_parallel_cross_entropy": (
        lambda x: K.vocab_parallel_cross_entropy(x, _targets(6, 11, (2,), -100), 0, ()),
        lambda: [_req(6, 11)],
        {
            "vocab_parallel_cross_entropy_stats": 1,
            "vocab_parallel_cross_entropy": 1,
            "vocab_parallel_cross_entropy_backward": 1,
        },
    ),
}


@pytest.mark.parametrize("case", list(TRACE_CASES))
def test_make_fx_records_each_fused_op_as_one_node_each_way(case):
    fn, make_inputs, want = TRACE_CASES[case]
    assert _traced_ops(fn, make_inputs()) == Counter(want)


def test_whole_step_trace_has_the_fused_ops_and_its_partition_runs_them():
    """``passes.joint.trace_joint`` (the per-rank whole step) records one node per fused op each
    way, in the right phase; the partitioned forward and backward programs, run on real tensors
    (the kernels), give eager's loss and gradients."""
    from autopar.passes.joint import PHASE, partition, trace_joint

    target = _targets(6, 11, (2,), -100)
    cos, sin = _cos_sin(1, 3, 4, "[1,1,s,d]")

    def program(fused: bool):
        norm = K.add_rms_norm if fused else K.add_rms_norm_reference
        act = K.swiglu if fused else K.swiglu_reference
        rope = K.rotary if fused else K.rotary_reference
        ce = K.cross_entropy if fused else K.cross_entropy_reference

        def step(x, r, w, up, proj):
            h, s = norm(x, r, w, 1e-6)  # x, r: [2, 3, 8]
            q = h.view(1, 2, 3, 8)[..., :4].contiguous()
            q, k = rope(q, q * 0.5, cos, sin)
            a = act(h, h @ up)  # [2, 3, 8]
            logits = (a + s + torch.cat([q, k], -1).view(2, 3, 8)) @ proj  # [2, 3, 11]
            return (ce(logits.reshape(6, 11), target),)

        return step

    primals = [_leaf(2, 3, 8, seed=1), _leaf(2, 3, 8, seed=2), _leaf(8, seed=3), _leaf(8, 8, seed=4)]
    primals.append(_leaf(8, 11, seed=5))
    jp = trace_joint(program(True), [p.detach() for p in primals], grad_primals=range(5))
    phases = Counter(
        (n.target.name().split("::")[1].split(".")[0], str(n.meta[PHASE]))
        for n in jp.gm.graph.nodes
        if n.op == "call_function"
        and isinstance(n.target, torch._ops.OpOverload)
        and n.target.namespace == "autopar"
    )
    assert phases == Counter({
        ("add_rms_norm", "fwd"): 1, ("add_rms_norm_backward", "bwd"): 1,
        ("rotary", "fwd"): 1, ("rotary_backward", "bwd"): 1,
        ("swiglu", "fwd"): 1, ("swiglu_backward", "bwd"): 1,
        ("cross_entropy", "fwd"): 1, ("cross_entropy_backward", "bwd"): 1,
    })  # fmt: skip
    parts = partition(jp)
    real = [p.detach() for p in primals]
    fwd_out = parts.forward(*real)
    loss, saved = fwd_out[0], fwd_out[1:]
    grads = parts.backward(*saved, torch.ones(()))
    assert jp.grad_primals == (0, 1, 2, 3, 4) and len(grads) == 5
    ref = program(False)(*primals)[0]
    _close(loss, ref.detach(), "loss of the partitioned forward program")
    for i, (g, want) in enumerate(zip(grads, torch.autograd.grad(ref, primals))):
        _close(g, want, f"gradient {i} of the partitioned backward program")


# ------------------------------------------------------------------------------ eager fallback


def eager_fallback_errors() -> dict[str, float]:
    """Largest difference between each fused function and its reference, forward and backward,
    where the ops run their eager fallback (called in a process without the interpreter)."""
    errors: dict[str, float] = {}

    def record(name, fused, ref, inputs):
        tensors = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
        outs, refs = fused(*inputs), ref(*inputs)
        outs = outs if isinstance(outs, tuple) else (outs,)
        refs = refs if isinstance(refs, tuple) else (refs,)
        up = tuple(torch.randn(o.shape) for o in outs)
        pairs = list(zip(outs, refs)) + list(zip(_grads(outs, up, tensors), _grads(refs, up, tensors)))
        errors[name] = max(float((a.detach() - b.detach()).abs().max()) for a, b in pairs)

    x, r, w, b = _leaf(5, 37, seed=1), _leaf(5, 37, seed=2), _leaf(37, seed=3), _leaf(37, seed=4)
    errors["backend"] = 0.0 if K.backend(x) == "eager" else 1.0
    errors["has_triton"] = float(sys.modules["autopar.program.kernels._launch"].HAS_TRITON)
    record("add_layer_norm", K.add_layer_norm, K.add_layer_norm_reference, [x, r, w, b, 1e-5])
    record("add_rms_norm", K.add_rms_norm, K.add_rms_norm_reference, [x, r, w, 1e-6])
    record("bias_gelu erf", K.bias_gelu, K.bias_gelu_reference, [x, b, "none"])
    record("bias_gelu tanh", K.bias_gelu, K.bias_gelu_reference, [x, b, "tanh"])
    record("swiglu", K.swiglu, K.swiglu_reference, [x, r])
    q, k = _leaf(2, 4, 5, 8, seed=5), _leaf(2, 2, 5, 8, seed=6)
    record("rotary", K.rotary, K.rotary_reference, [q, k, *_cos_sin(2, 5, 8, "[b,1,s,d]")])
    target = _targets(5, 37, (1,), -100)
    record("cross_entropy", K.cross_entropy, K.cross_entropy_reference, [x, target, -100, "mean"])
    record(
        "vocab_parallel_cross_entropy",
        lambda lg, t: K.vocab_parallel_cross_entropy(lg, t, 0, ()),
        lambda lg, t: F.cross_entropy(lg, t, reduction="none"),
        [x, target],
    )
    return errors


@pytest.mark.timeout(120)
@pytest.mark.parametrize("where", ["interpreter off", "triton not installed"])
def test_eager_fallback(where):
    """CPU training without ``TRITON_INTERPRET``, or without triton at all: the fused ops compute
    the same values with torch ops (``backend`` says ``"eager"``)."""
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    hide = "import sys; sys.modules['triton'] = None; " if where == "triton not installed" else ""
    code = hide + "import json, test_kernels; print(json.dumps(test_kernels.eager_fallback_errors()))"
    here = Path(__file__).parent
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=here,
        env=env,
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    errors = json.loads(proc.stdout.strip().splitlines()[-1])
    assert errors.pop("backend") == 0.0, "the subprocess ran the Triton kernels, not the fallback"
    assert errors.pop("has_triton") == (0.0 if where == "triton not installed" else 1.0)
    assert len(errors) == 8
    bad = {name: e for name, e in errors.items() if not e <= 1e-5}
    assert not bad, f"eager fallback differs from the reference: {bad}"


# ------------------------------------------------------------------ GPU compilation, no GPU here


def _compile_cases() -> list[tuple[str, object, dict[str, str], dict[str, object], int]]:
    """One compilation per kernel and constexpr path: ``(name, kernel, signature, constexprs,
    num_warps)`` at bf16, the flags on, the shapes of the benchmark."""
    import sys as _sys

    mod = {
        n: _sys.modules[f"autopar.program.kernels.{n}"] for n in ("layer_norm", "rms_norm", "gelu", "swiglu")
    }
    mod |= {n: _sys.modules[f"autopar.program.kernels.{n}"] for n in ("rotary", "cross_entropy")}

    def sig(spec: str) -> dict[str, str]:
        return dict(item.split(":") for item in spec.split())

    ln_f = sig("X:*bf16 R:*bf16 W:*bf16 B:*bf16 Y:*bf16 S:*bf16 MEAN:*fp32 RSTD:*fp32 n_cols:i32 eps:fp32")
    ln_b = sig(
        "DY:*bf16 DS:*bf16 S:*bf16 W:*bf16 MEAN:*fp32 RSTD:*fp32 DX:*bf16 DW:*fp32 DB:*fp32 "
        "n_rows:i32 n_cols:i32 rows_per_program:i32"
    )
    rms_f = sig("X:*bf16 R:*bf16 W:*bf16 Y:*bf16 S:*bf16 RSTD:*fp32 n_cols:i32 eps:fp32")
    rms_b = sig(
        "DY:*bf16 DS:*bf16 S:*bf16 W:*bf16 RSTD:*fp32 DX:*bf16 DW:*fp32 n_rows:i32 n_cols:i32 rows_per_program:i32"
    )
    rot = sig(
        "Q:*bf16 K:*bf16 QO:*bf16 KO:*bf16 C:*bf16 S:*bf16 q_rows:i32 k_rows:i32 q_programs:i32 q_heads:i32 "
        "k_heads:i32 seq:i32 half:i32 sqb:i32 sqh:i32 sqs:i32 skb:i32 skh:i32 sks:i32 cos_batch_stride:i32"
    )
    ce_f = sig("X:*bf16 T:*i64 OUT0:*fp32 OUT1:*fp32 OUT2:*fp32 n_cols:i32 class_start:i32 ignore_index:i32")
    ce_b = sig("DLOSS:*fp32 X:*bf16 T:*i64 LSE:*fp32 DX:*bf16 n_cols:i32 class_start:i32 ignore_index:i32")
    cases = []
    for one, block in ((True, 4096), (False, 1024)):
        flags = {"BLOCK": block, "ONE_BLOCK": one}
        ln = mod["layer_norm"]
        rms = mod["rms_norm"]
        cases += [
            ("add_layer_norm fwd", ln._add_layer_norm_fwd_kernel, ln_f,
             {"HAS_RESIDUAL": True, "HAS_WEIGHT": True, "HAS_BIAS": True, **flags}, 8),
            ("add_layer_norm bwd", ln._add_layer_norm_bwd_kernel, ln_b,
             {"HAS_DS": True, "HAS_WEIGHT": True, "HAS_BIAS": True, **flags}, 16),
            ("add_rms_norm fwd", rms._add_rms_norm_fwd_kernel, rms_f,
             {"HAS_RESIDUAL": True, "HAS_WEIGHT": True, **flags}, 8),
            ("add_rms_norm bwd", rms._add_rms_norm_bwd_kernel, rms_b, {"HAS_DS": True, "HAS_WEIGHT": True, **flags}, 16),
        ]  # fmt: skip
    gelu, swiglu = mod["gelu"], mod["swiglu"]
    for tanh in (True, False):
        cases += [
            ("bias_gelu fwd", gelu._bias_gelu_fwd_kernel, sig("X:*bf16 B:*bf16 Y:*bf16 n_elements:i64 n_cols:i32"),
             {"HAS_BIAS": True, "TANH": tanh, "BLOCK": 1024}, 4),
            ("bias_gelu bwd", gelu._bias_gelu_bwd_kernel,
             sig("DY:*bf16 X:*bf16 B:*bf16 DX:*bf16 n_elements:i64 n_cols:i32"),
             {"HAS_BIAS": True, "TANH": tanh, "BLOCK": 1024}, 4),
        ]  # fmt: skip
    cases += [
        ("swiglu fwd", swiglu._swiglu_fwd_kernel, sig("G:*bf16 U:*bf16 Y:*bf16 n_elements:i64"), {"BLOCK": 1024}, 4),
        ("swiglu bwd", swiglu._swiglu_bwd_kernel, sig("DY:*bf16 G:*bf16 U:*bf16 DG:*bf16 DU:*bf16 n_elements:i64"),
         {"BLOCK": 1024}, 4),
        ("rotary fwd", mod["rotary"]._rotary_kernel, rot, {"BACKWARD": False, "BLOCK": 64, "ROWS": 32}, 8),
        ("rotary bwd", mod["rotary"]._rotary_kernel, rot, {"BACKWARD": True, "BLOCK": 64, "ROWS": 32}, 8),
        ("cross_entropy fwd", mod["cross_entropy"]._ce_fwd_kernel, ce_f, {"LOCAL": False, "BLOCK": 32768}, 32),
        ("vocab-parallel stats", mod["cross_entropy"]._ce_fwd_kernel, ce_f, {"LOCAL": True, "BLOCK": 32768}, 32),
        ("cross_entropy bwd", mod["cross_entropy"]._ce_bwd_kernel, ce_b, {"BLOCK": 32768}, 32),
    ]  # fmt: skip
    return cases


def gpu_compile_errors() -> dict[str, object]:
    """Compile every kernel for an H100 (sm_90) with Triton's own compiler and bundled ptxas, no
    GPU needed (called in a process without the interpreter): the front-end errors (types,
    unsupported constructs) the interpreter, which runs the kernels as Python, cannot see."""
    import inspect
    import traceback

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if "constexprs" not in inspect.signature(ASTSource).parameters:
        return {"unsupported": f"triton {triton.__version__}: ASTSource takes no constexprs"}
    target = GPUTarget("cuda", 90, 32)
    errors: dict[str, str] = {}
    done = 0
    cases = _compile_cases()
    for name, kernel, signature, constexprs, warps in cases:
        src = ASTSource(
            kernel, {**signature, **dict.fromkeys(constexprs, "constexpr")}, constexprs=constexprs
        )
        try:
            triton.compile(src, target=target, options={"num_warps": warps})
            done += 1
        except Exception as e:
            errors[f"{name} {constexprs}"] = "".join(traceback.format_exception(e))[-1500:]
    return {"cases": len(cases), "compiled": done, "errors": errors}


@pytest.mark.timeout(240)
def test_the_kernels_compile_for_an_h100_without_a_gpu():
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    code = "import json, test_kernels; print(json.dumps(test_kernels.gpu_compile_errors()))"
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=Path(__file__).parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=230,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if "unsupported" in result:
        pytest.skip(result["unsupported"])
    assert not result["errors"], "\n\n".join(f"{k}:\n{v}" for k, v in result["errors"].items())
    # 4 norm kernels × 2 paths, GeLU 2 × 2 forms, SwiGLU 2, rotary 2, cross-entropy 3.
    assert result["compiled"] == result["cases"] == 19

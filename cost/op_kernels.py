"""What one aten op launches: the kernels eager PyTorch runs for an op of the captured
(pre-dispatch) graph, forward and backward (:func:`op_kernels`), each a
:class:`~autopar.cost.compute.Kernel` that ``autopar.cost.compute.kernel_time`` times.

Words:

* **op kernels** — a ``linear`` is one GEMM forward and two backward (one for each input's
  gradient, plus a reduction for its bias); ``layer_norm`` one memory pass forward and two
  backward; a view none; a cast one copy; an op whose output needs no gradient no backward.
* **GEMM dimensions** — ``(m, n, k, batch)``: rows and columns of the output, the reduction
  length, and the batch of a batched GEMM (:func:`einsum_gemm_dims` for ``einsum``'s pairs, which
  ATen runs as one ``bmm``: ``sumproduct_pair`` in ``native/Linear.cpp``); a convolution as its
  implicit GEMM (rows = batch × output positions; NVIDIA, "Convolutional Layers User's Guide").

Each op family's kernels follow what its ATen and cuDNN/cuBLAS implementation launches; the
reasons are written where each family is handled.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from autopar.cost.compute import (
    BACKWARD_FLOP_RATIO,
    Kernel,
    KernelKind,
    OpKernels,
    TensorArg,
    itemsize,
    op_flops,
)
from autopar.graph import OpFamily, op_info

__all__ = ["einsum_gemm_dims", "einsum_subscripts", "op_kernels"]


def _mem(nbytes: float) -> Kernel:
    return Kernel(KernelKind.MEMORY, nbytes)


def _gemm_dtype(dtype: str, tf32: bool) -> str:
    """The rate a GEMM on ``dtype`` operands runs at: ``"tfloat32"`` for float32 on TF32 tensor
    cores (``op_kernels``), else ``dtype``."""
    return "tfloat32" if tf32 and dtype == "float32" else dtype


def _gemm(m: int, n: int, k: int, batch: int, dtype: str) -> Kernel:
    size = itemsize(dtype)
    nbytes = float(batch) * (m * k + k * n + m * n) * size
    return Kernel(KernelKind.GEMM, nbytes, 2.0 * batch * m * n * k, dtype, m, n, k, batch)


def _gemm_dims(op: str, ins: Sequence[TensorArg], out: TensorArg) -> tuple[int, int, int, int, int, int]:
    """``(m, n, k, batch, a, b)``: GEMM dimensions and the positions of the two operands."""
    if op == "linear":
        x, w = ins[0], ins[1]
        k = x.shape[-1] if x.shape else 1
        return max(1, x.numel // max(k, 1)), w.shape[0] if len(w.shape) == 2 else 1, k, 1, 0, 1
    a_i, b_i = (1, 2) if op in ("addmm", "baddbmm") else (0, 1)
    a, b = ins[a_i].shape, ins[b_i].shape
    if op in ("_grouped_mm", "grouped_mm", "grouped_mm_fallback"):
        k = a[-1]
        n = out.shape[-1] if out.shape else 1
        return max(1, math.prod(a) // max(k, 1)), n, k, 1, a_i, b_i
    k = a[-1] if a else 1
    n = b[-1] if len(b) >= 2 else 1
    if len(b) <= 2:  # batch dims of a fold into its rows
        return max(1, math.prod(a) // max(k, 1)), n, k, 1, a_i, b_i
    m = a[-2] if len(a) >= 2 else 1
    batch = max(1, math.prod(out.shape[:-2])) if len(out.shape) > 2 else 1
    return m, n, k, batch, a_i, b_i


def _conv_dims(ins: Sequence[TensorArg], out: TensorArg, groups: int) -> tuple[int, int, int, int]:
    """Implicit-GEMM dimensions of a convolution: rows = batch × output positions, columns = output
    channels per group, reduction = input channels per group × kernel size; one GEMM per group.
    Its backward runs two more (NVIDIA, "Convolutional Layers User's Guide", §"Convolution
    Algorithms"): the data gradient with the input channels per group as columns and the output
    channels per group × kernel size reduced (its FLOPs the forward's: every multiply-add once),
    the weight gradient with the rows reduced."""
    w = ins[1].shape
    c_out = out.shape[1] if len(out.shape) > 1 else 1
    rows = out.numel // max(c_out, 1)
    return rows, max(1, c_out // groups), math.prod(w[1:]), groups


_GRAD_FREE_POINTWISE = frozenset(
    [
        "eq",
        "ne",
        "lt",
        "le",
        "gt",
        "ge",
        "__and__",
        "__or__",
        "bitwise_and",
        "bitwise_or",
        "bitwise_not",
        "logical_and",
        "logical_or",
        "logical_not",
        "isnan",
        "isinf",
        "sign",
        "floor",
        "ceil",
        "round",
        "floor_divide",
        "fmod",
        "remainder",
        "zeros_like",
        "ones_like",
        "full_like",
        "empty_like",
        "rand_like",
    ]
)
_PASS_THROUGH = frozenset(["contiguous", "clone", "alias", "detach"])
_CAST = frozenset(["to", "_to_copy", "type_as"])
_FREE_VIEW_BWD = frozenset(
    [
        "view",
        "reshape",
        "_unsafe_view",
        "unsqueeze",
        "squeeze",
        "flatten",
        "unflatten",
        "transpose",
        "swapaxes",
        "swapdims",
        "permute",
        "t",
        "numpy_T",
        "mT",
        "getitem",
        "cat",
        "concat",
        "stack",
        "alias",
    ]
)
_SLICE = frozenset(["slice", "narrow", "select"])
_SPLIT = frozenset(["split", "split_with_sizes", "chunk", "unbind"])
_FACTORY_EMPTY = frozenset(["empty_like", "new_empty", "empty"])


def einsum_subscripts(equation: str, ranks: Sequence[int]) -> tuple[list[str], str] | None:
    """Each operand's subscripts and the output's in ``torch.einsum``'s ``equation``, one letter per
    dimension (an ellipsis spelled out as letters of its own, broadcast from the right);
    ``None`` where the output is implicit or the equation does not match the operands' ranks."""
    eq = equation.replace(" ", "")
    if "->" not in eq:
        return None
    lhs, out = eq.split("->")
    terms = lhs.split(",")
    if len(terms) != len(ranks):
        return None
    spare = iter(c for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZ" if c not in eq)
    ell = ""
    spelled = []
    for term, rank in zip(terms, ranks):
        if "..." in term:
            n = rank - (len(term) - 3)
            if n < 0:
                return None
            while len(ell) < n:
                ell = next(spare) + ell  # broadcast dims line up from the right
            term = term.replace("...", ell[len(ell) - n :])
        if len(term) != rank:
            return None
        spelled.append(term)
    if "..." in out:
        out = out.replace("...", ell)
    return spelled, out


def einsum_gemm_dims(equation: str, shapes: Sequence[Sequence[int]]) -> tuple[int, int, int, int] | None:
    """A two-operand ``einsum`` as the GEMM it runs (``torch.einsum`` permutes and reshapes its
    operands to one ``bmm``: ``sumproduct_pair`` in ATen's ``native/Linear.cpp``):
    ``(m, n, k, batch)``, the products of the sizes of the letters in the first operand and the
    output only, the second and the output only, both operands but not the output (the
    contraction), and all three. ``None`` for other forms (one operand, three, implicit output)."""
    parsed = einsum_subscripts(equation, [len(s) for s in shapes]) if len(shapes) == 2 else None
    if parsed is None:
        return None
    (a, b), out = parsed
    size: dict[str, int] = {}
    for t, s in zip((a, b), shapes):
        for c, d in zip(t, s):
            size[c] = max(size.get(c, 1), d)  # a broadcast dimension: the larger

    def prod(letters: set[str]) -> int:
        return math.prod(size[c] for c in letters)

    sa, sb, so = set(a), set(b), set(out)
    return prod((sa - sb) & so), prod((sb - sa) & so), prod((sa & sb) - so), prod(sa & sb & so)


def op_kernels(
    op: str,
    ins: Sequence[TensorArg],
    outs: Sequence[TensorArg],
    *,
    requires_grad: bool,
    alias: bool = False,
    causal: bool | float = False,
    masked: bool = False,
    groups: int = 1,
    grad_contributions: int = 1,
    tf32: bool = False,
    equation: str | None = None,
) -> OpKernels:
    """The kernels eager PyTorch runs for aten op ``op`` (packet name) forward and backward.

    ``ins``: tensor arguments in call order (``grad`` set on those a gradient is computed for);
    ``outs``: tensor results. ``requires_grad``: a gradient flows into the op's output (so its
    backward runs). ``alias``: the output shares its input's memory (a view, a cast to the same
    dtype, ``contiguous`` of a contiguous tensor): no kernel. ``causal``/``masked``: attention under
    a causal mask (or the fraction of pairs it keeps, ``op_flops``) / under another explicit mask
    (read by the kernel, no skipping).
    ``grad_contributions``: how many consumers send this op's output a gradient; autograd adds them
    (one addition kernel per extra contribution). ``tf32``: float32 matmuls run on the TF32 tensor
    cores (``torch.get_float32_matmul_precision()`` "high" or "medium"); float32 convolutions always
    do (cuDNN's default, ``torch.backends.cudnn.allow_tf32``). Otherwise a float32 GEMM runs at the
    device's plain FP32 rate (``DeviceSpec.peak_flops["float32"]``). ``equation``: an ``einsum``'s,
    whose two operands run as one GEMM (``einsum_gemm_dims``).
    """
    info = op_info(op)
    fam = info.family
    out = outs[0] if outs else TensorArg((), "float32")
    out_bytes = sum(o.nbytes for o in outs)
    in_bytes = sum(i.nbytes for i in ins)
    fwd: list[Kernel] = []
    bwd: list[Kernel] = []
    grads = [i for i in ins if i.grad]

    if fam is OpFamily.ASSERT or op == "getitem":
        return OpKernels()
    dims = einsum_gemm_dims(equation, [i.shape for i in ins]) if op == "einsum" and equation else None
    if (fam is OpFamily.MATMUL and len(ins) >= 2) or dims is not None:
        m, n, k, batch, a_i, b_i = (*dims, 0, 1) if dims is not None else _gemm_dims(op, ins, out)
        dtype = _gemm_dtype(ins[a_i].dtype, tf32)
        fwd.append(_gemm(m, n, k, batch, dtype))  # a bias is added in the GEMM's epilogue
        if requires_grad:
            if ins[a_i].grad:  # dA = dC · Bᵀ: rows m, columns k, reduction n
                bwd.append(_gemm(m, k, n, batch, dtype))
            if ins[b_i].grad:  # dB = Aᵀ · dC: rows k, columns n, reduction m
                bwd.append(_gemm(k, n, m, batch, dtype))
            bias = [i for j, i in enumerate(ins) if j not in (a_i, b_i) and i.grad]
            bwd.extend(_mem(out.nbytes + b.nbytes) for b in bias)  # bias gradient: a sum over rows
    elif fam is OpFamily.CONV and len(ins) >= 2:
        m, n, k, g = _conv_dims(ins, out, groups)
        dtype = _gemm_dtype(ins[0].dtype, True)
        x = ins[0]
        # Tensor cores take channels innermost (NHWC): cuDNN transposes a channels-first input,
        # and the output back, around each convolution, forward and backward (NVIDIA,
        # "Convolutional Layers User's Guide", "Tensor Layouts In Memory"; channels-last
        # training is ~30 % faster on ResNet-50, MosaicML's Composer "Channels Last" method card).
        # PyTorch runs a convolution channels-last where its input or its weight is
        # (``cudnn_conv_suggest_memory_format``), its output too, so a model converted with
        # ``model.to(memory_format=torch.channels_last)`` stays so through its normalizations.
        flip = len(x.shape) >= 4 and not (x.channels_last or ins[1].channels_last)
        if flip:
            fwd.append(Kernel(KernelKind.MEMORY, 2 * (x.nbytes + out.nbytes), tensor_cores=dtype))
        fwd.append(_gemm(m, n, k, g, dtype))
        if flip and requires_grad:  # dY in; dX out; the input again for the weight gradient
            moved = out.nbytes + x.nbytes * (int(x.grad) + int(ins[1].grad))
            bwd.append(Kernel(KernelKind.MEMORY, 2 * moved, tensor_cores=dtype))
        if requires_grad:
            if ins[0].grad:  # dgrad: columns the input channels, reduction output channels × kernel
                w = ins[1].shape
                c_in, taps = (w[1], math.prod(w[2:])) if len(w) > 1 else (1, 1)
                bwd.append(_gemm(m, c_in, n * taps, g, dtype))
            if ins[1].grad:
                bwd.append(_gemm(k, n, m, g, dtype))
            if len(ins) > 2 and ins[2].grad:
                bwd.append(_mem(out.nbytes))
    elif fam is OpFamily.ATTENTION and len(ins) >= 3:
        q, kk, v = ins[0], ins[1], ins[2]
        flops, _ = op_flops(op, [q.shape, kk.shape, v.shape], out.shape, causal=causal)
        io = q.nbytes + kk.nbytes + v.nbytes + out.nbytes
        mask = ins[3].nbytes if masked and len(ins) > 3 else 0.0
        s_k, d = kk.shape[-2], q.shape[-1]
        fwd.append(
            Kernel(KernelKind.ATTENTION, io + mask, flops, q.dtype, seq=s_k, head_dim=d, causal=bool(causal))
        )
        if requires_grad:
            ratio = BACKWARD_FLOP_RATIO["attention"]
            bwd.append(_mem(2 * out.nbytes))  # D = rowsum(dO ∘ O)
            bwd.append(
                Kernel(
                    KernelKind.ATTENTION,
                    2 * io + mask,
                    ratio * flops,
                    q.dtype,
                    seq=s_k,
                    head_dim=d,
                    causal=bool(causal),
                    backward=True,
                )
            )
            if q.grad:  # dQ accumulated in fp32, converted at the end
                bwd.append(_mem(q.numel * 4 + q.nbytes))
    elif fam is OpFamily.NORM:
        x = ins[0]
        fwd.append(_mem(x.nbytes + out.nbytes))
        if requires_grad:
            if x.grad:
                bwd.append(_mem(out.nbytes + 2 * x.nbytes))
            if any(i.grad for i in ins[1:]):  # weight/bias gradients: a second pass over dY and X
                bwd.append(_mem(out.nbytes + x.nbytes))
    elif fam is OpFamily.BATCH_NORM:
        x = ins[0]
        fwd.append(_mem(2 * x.nbytes + out.nbytes))
        if requires_grad:
            bwd.append(_mem(2 * out.nbytes + 3 * x.nbytes))
    elif fam is OpFamily.SOFTMAX:
        fwd.append(_mem(ins[0].nbytes + out.nbytes))
        if requires_grad and ins[0].grad:
            bwd.append(_mem(2 * out.nbytes + ins[0].nbytes))
    elif fam is OpFamily.REDUCTION:
        fwd.append(_mem(in_bytes + out_bytes))
        if requires_grad and ins and ins[0].grad and op != "sum":  # sum's gradient is a broadcast view
            bwd.append(_mem(out_bytes + ins[0].nbytes + (ins[0].nbytes if info.saves_inputs else 0.0)))
    elif fam is OpFamily.EMBEDDING:
        w, idx = ins[0], ins[1]
        fwd.append(_mem(idx.nbytes + 2 * out.nbytes))
        if requires_grad and w.grad:  # zero the table, sort the ids, add the rows in
            bwd.append(_mem(w.nbytes))
            bwd.append(_mem(4 * idx.nbytes))
            bwd.append(_mem(2 * out.nbytes + idx.nbytes))
    elif fam is OpFamily.LOSS:
        x = ins[0]
        if op == "mse_loss":
            fwd.append(_mem(in_bytes + out_bytes))
            bwd.extend(_mem(in_bytes + i.nbytes) for i in grads if requires_grad)
        else:  # (log-)softmax over classes, then the negative log-likelihood of the targets
            fwd.append(_mem(2 * x.nbytes))
            fwd.append(_mem(sum(i.nbytes for i in ins[1:]) + out_bytes))
            if requires_grad and x.grad:
                bwd.append(_mem(x.nbytes))  # nll backward: zeros, then the targets' entries
                bwd.append(_mem(3 * x.nbytes))  # log-softmax backward
    elif fam is OpFamily.VIEW:
        if not alias:  # a copy (reshape of an expanded tensor, cat, pad, …)
            fwd.append(_mem(in_bytes + out_bytes))
        if requires_grad:
            if op == "expand":
                bwd.extend(_mem(out.nbytes + i.nbytes) for i in grads)  # sum over the broadcast dims
            elif op in _SLICE:
                bwd.extend(_mem(i.nbytes) for i in grads)  # zeros of the input's size
                bwd.append(_mem(2 * out.nbytes))  # the gradient copied into them
            elif op in _SPLIT:
                bwd.extend(_mem(2 * i.nbytes) for i in grads)  # the parts' gradients concatenated
            elif op in ("pad", "constant_pad_nd", "repeat", "repeat_interleave") or (
                op not in _FREE_VIEW_BWD and not alias
            ):
                bwd.extend(_mem(out.nbytes + i.nbytes) for i in grads)
    elif fam is OpFamily.POINTWISE:
        if op in _FACTORY_EMPTY:
            pass
        elif not alias:
            fwd.append(_mem(in_bytes + out_bytes))
        if requires_grad and op not in _GRAD_FREE_POINTWISE:
            bwd.extend(_pointwise_bwd(op, ins, out, alias))
    elif fam is OpFamily.ROUTING:
        fwd.append(_mem(in_bytes + out_bytes))
        if requires_grad:  # scatter the gradient back: zeros of the input's size, then the rows
            for i in grads:
                bwd.append(_mem(i.nbytes))
                bwd.append(_mem(2 * out.nbytes))
    else:  # factories, unknown ops
        if op not in _FACTORY_EMPTY and out_bytes > 0:
            fwd.append(_mem(in_bytes + out_bytes))
        if requires_grad:
            bwd.extend(_mem(out_bytes + in_bytes) for _ in grads)
    if requires_grad and grad_contributions > 1:
        bwd.extend(_mem(3 * out.nbytes) for _ in range(grad_contributions - 1))
    return OpKernels(tuple(fwd), tuple(bwd))


def _pointwise_bwd(op: str, ins: Sequence[TensorArg], out: TensorArg, alias: bool) -> list[Kernel]:
    """Backward kernels of a pointwise op, one per input that gets a gradient."""
    out_b = out.nbytes
    ks: list[Kernel] = []
    for j, i in enumerate(ins):
        if not i.grad:
            continue
        if op in _PASS_THROUGH or (op in _CAST and alias):
            continue  # the gradient passes through unchanged
        if op in _CAST:
            ks.append(_mem(out_b + i.nbytes))  # cast back
            continue
        broadcast = i.numel < out.numel
        if op in ("add", "add_") or (op in ("sub", "sub_") and j == 0):
            if broadcast:
                ks.append(_mem(out_b + i.nbytes))  # sum over the broadcast dims
            continue
        if op in ("sub", "sub_", "rsub", "neg"):
            ks.append(_mem(out_b + i.nbytes))
            continue
        others = sum(x.nbytes for k, x in enumerate(ins) if k != j)
        saved = others if len(ins) > 1 else i.nbytes  # the other operands, or the input itself
        ks.append(_mem(out_b + saved + out_b))  # grad ∘ f'(…), written at the output's size
        if broadcast:
            ks.append(_mem(out_b + i.nbytes))  # then reduced to the input's shape
    return ks

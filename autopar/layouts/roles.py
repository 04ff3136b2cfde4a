"""Megatron-LM's weight roles, recognised by graph structure (not by names).

Walking the graph in order, every matmul whose weight is a parameter is

* **row-parallel** (weight split along its input features, output ``Partial``, one all-reduce
  after it) when every nearest upstream parameter matmul is column-parallel and the path from
  them passes no normalization — the second matmul of an MLP, the attention output projection;
* **column-parallel** (weight split along its output features) otherwise — QKV, MLP up/gate, and
  the LM head, which is thereby vocabulary-parallel.

Embedding tables are vocabulary-parallel (split along rows). GPT-2's ``Conv1D`` stores weights as
``[in, out]`` (``addmm``), ``nn.Linear`` as ``[out, in]`` (``linear``): the split dimension follows
the op, so both come out right. ``expert_weights`` finds the experts of mixture-of-experts regions
(``autopar.rules.routing``); ``residual_adds`` the additions a sequence-parallel layout splits.
"""

from __future__ import annotations

import torch
from torch.fx import Node

from autopar.graph import OpFamily, op_family, op_info, op_name
from autopar.ir import TENSOR
from autopar.rules.moe_regions import moe_regions
from autopar.rules.routing import grouped_mm_operands

__all__ = [
    "expert_weights",
    "is_rms_mean",
    "megatron_weight_roles",
    "norm_scales",
    "residual_adds",
    "weight_of",
]


def is_weight_matmul(node: Node) -> bool:
    """A matmul a weight can enter as a plain matrix (``bmm``/``baddbmm`` take batched operands)."""
    return op_family(node) is OpFamily.MATMUL and op_name(node) not in ("bmm", "baddbmm")


def is_norm(node: Node) -> bool:
    """A normalization on the path: layer/RMS/group/batch norm, or an RMSNorm written out (rsqrt)."""
    return op_family(node) in (OpFamily.NORM, OpFamily.BATCH_NORM) or op_name(node) == "rsqrt"


def weight_of(node: Node) -> tuple[Node | None, Node | None, int, int]:
    """(weight, bias, out-feature dim, in-feature dim) of a matmul with a parameter weight."""
    name = op_name(node)
    a = node.args
    if name == "linear":
        w, b, out_d, in_d = a[1], (a[2] if len(a) > 2 else None), 0, 1
    elif name == "addmm":
        w, b, out_d, in_d = a[2], a[0], 1, 0
    else:
        w, b, out_d, in_d = a[1], None, 1, 0
        if isinstance(w, Node) and _is_transpose_2d(w):
            # ``x @ self.weight.T`` (transformers' Falcon): an ``[out, in]`` weight read transposed.
            w, out_d, in_d = w.args[0], 0, 1
    info = w.meta.get(TENSOR) if isinstance(w, Node) else None
    if info is None or info.kind != "param" or len(info.shape) != 2:
        return None, None, 0, 0
    binfo = b.meta.get(TENSOR) if isinstance(b, Node) else None
    return w, (b if binfo is not None and binfo.kind == "param" else None), out_d, in_d


def _is_transpose_2d(node: Node) -> bool:
    """``t``, ``transpose`` or ``permute`` swapping the two dimensions of a matrix."""
    if node.op != "call_function" or not isinstance(node.args[0], Node):
        return False
    val = node.args[0].meta.get("val")
    if val is None or val.dim() != 2:
        return False
    name = op_name(node)
    return name in ("t", "transpose", "swapaxes", "swapdims", "numpy_T", "mT") or (
        name == "permute" and list(node.args[1]) in ([1, 0], [-1, -2])
    )


def megatron_weight_roles(graph: torch.fx.Graph) -> dict[str, str]:
    """``{param_fqn: "col" | "row" | "col_bias" | "vocab"}`` by the structural rule above."""
    role_of_matmul: dict[Node, str] = {}
    # For each node: set of nearest upstream param-matmuls, and whether a norm lies on the way.
    upstream: dict[Node, tuple[frozenset, bool]] = {}
    roles: dict[str, str] = {}
    for n in graph.nodes:
        if n.op != "call_function":
            upstream[n] = (frozenset(), False)
            continue
        ups: set[Node] = set()
        norm = False
        for i in n.all_input_nodes:
            u, nm = upstream.get(i, (frozenset(), False))
            ups |= u
            norm |= nm
        name = op_name(n)
        if is_norm(n):
            norm = True
        w, b, out_d, in_d = weight_of(n) if is_weight_matmul(n) else (None, None, 0, 0)
        if w is not None:
            x = n.args[1] if name == "addmm" else n.args[0]
            xu, xnorm = upstream.get(x, (frozenset(), False))
            is_row = bool(xu) and not xnorm and all(role_of_matmul.get(m) == "col" for m in xu)
            role = "row" if is_row else "col"
            role_of_matmul[n] = role
            if role == "col" and w.meta[TENSOR].shape[out_d] == 1:
                # One output per token (a gate: Qwen-MoE's and Megatron-Core's shared-expert gate,
                # a (1, hidden) weight Megatron-Core keeps whole on every tensor-parallel rank):
                # nothing to split; whole, and no row-parallel reader.
                role_of_matmul[n] = "whole"
                upstream[n] = (frozenset({n}), False)
                continue
            fqn = w.meta[TENSOR].fqn
            roles[fqn] = f"{role}:{out_d if role == 'col' else in_d}"
            if b is not None:
                roles[b.meta[TENSOR].fqn] = "col_bias" if role == "col" else "row_bias"
            upstream[n] = (frozenset({n}), False)
            continue
        if name == "embedding":
            w = n.args[0]
            info = w.meta.get(TENSOR) if isinstance(w, Node) else None
            if info is not None and info.kind == "param" and info.fqn not in roles:
                # Position embeddings (indexed by positions, not tokens) stay to the solver.
                idx = n.args[1]
                iinfo = idx.meta.get(TENSOR) if isinstance(idx, Node) else None
                if iinfo is not None and iinfo.kind == "input":
                    roles[info.fqn] = "vocab"
        upstream[n] = (frozenset(ups), norm)
    return roles


def expert_weights(graph: torch.fx.Graph) -> dict[str, int]:
    """``{param_fqn: number of experts}`` for the experts' weights of every mixture-of-experts
    region (``autopar.rules.moe_regions.moe_regions``): a grouped matmul's weight, followed back
    through views and casts to its parameter, whose dimension 0 is the experts."""
    out = {}
    for region in moe_regions(graph):
        for e in region.experts:
            w = grouped_mm_operands(e)[1]
            while w.op == "call_function" and (op_family(w) is OpFamily.VIEW or op_info(w).identity_like):
                w = w.args[0]
            info = w.meta.get(TENSOR)
            if info is not None and info.kind == "param" and info.shape[0] == region.num_experts:
                out[info.fqn] = region.num_experts
    return out


def residual_adds(graph: torch.fx.Graph, roles: dict[str, str]) -> set[Node]:
    """The additions that put a row-parallel matmul's output back into the residual stream.

    From each row-parallel matmul, follow single-use views, casts and dropouts to the first
    ``add``. Megatron-LM all-reduces right before it (or, with sequence parallelism,
    reduce-scatters), so the residual stream is replicated (sequence-split) on the tensor axis.
    """
    out: set[Node] = set()
    for n in graph.nodes:
        if not is_weight_matmul(n):
            continue
        w, _, _, _ = weight_of(n)
        if w is None or not roles.get(w.meta[TENSOR].fqn, "").startswith("row"):
            continue
        v = n
        while len(v.users) == 1:
            (u,) = v.users
            if u.op != "call_function":
                break
            if op_name(u) == "add":
                out.add(u)
                break
            if not op_info(u).identity_like:
                break
            v = u
    return out


def is_rms_mean(node: Node) -> bool:
    """The mean of an RMSNorm: over the last dim of a pow(x, 2)."""
    src = node.args[0]
    return isinstance(src, Node) and op_name(src) == "pow"


def norm_scales(graph: torch.fx.Graph, roles: dict[str, str]) -> set[Node]:
    """The pointwise ops that scale a written-out normalization by its own weight (an RMSNorm's
    ``weight * x`` as transformers writes it): a trainable one-dimensional parameter no matmul
    reads (not in ``roles``), reached through views and casts, multiplying or shifting a value
    computed from something else. Megatron-LM runs them with the rest of the norm: replicated on
    the tensor axis, or split along the sequence with sequence parallelism."""
    out: set[Node] = set()
    for n in graph.nodes:
        info = n.meta.get(TENSOR)
        if n.op != "placeholder" or info is None or info.kind != "param" or not info.requires_grad:
            continue
        if len(info.shape) != 1 or info.fqn in roles:
            continue
        frontier = list(n.users)
        while frontier:
            u = frontier.pop()
            if u.op != "call_function":
                continue
            if op_info(u).identity_like:
                frontier.extend(u.users)
            elif op_family(u) is OpFamily.POINTWISE and op_name(u) in ("mul", "add"):
                out.add(u)
    return out

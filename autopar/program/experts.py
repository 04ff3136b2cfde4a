"""Expert parallelism at run time: the grouped matmul, and the dispatch/combine all-to-alls.

Words (those of Megatron-LM's token dispatcher, ``megatron/core/transformer/moe/token_dispatcher.py``,
and DeepSpeed-MoE, Rajbhandari et al., ICML 2022):

* **grouped rows** — a ``[S, K]`` tensor whose rows are (token, slot) pairs sorted by the expert
  they were routed to; ``offs[e]`` is the end of expert ``e``'s rows (a cumulative count).
* **route** — an int64 ``[2, n, E_l]`` tensor for one mesh axis of ``n`` devices with ``E_l``
  experts each: ``route[0][d, e]`` rows this device sends to expert ``e`` of device ``d``,
  ``route[1][s, e]`` rows it receives from device ``s`` for its own expert ``e``. The send counts
  come from the local ``offs``; the receive counts from one all-to-all of them (the counts are
  exchanged first, so the rows' all-to-all is dropless: every row reaches its expert).
* **dispatch** — grouped rows on the token side → the rows of this device's experts, from every
  device, regrouped by local expert (an all-to-all with uneven splits, then a local permutation);
  **combine** is its inverse. Each is the other's backward.

Tracing: the splits are read from the route (``tolist``), which under ``make_fx`` with fake
tensors gives unbacked symbolic sizes; the all-to-alls are functional collectives
(``_c10d_functional.all_to_all_single``) completed by ``wait_tensor``, so a traced training step
has them as graph nodes like every other collective, and the number of rows a device receives is
a symbolic size ``R`` that every tensor on the expert side carries.

``grouped_mm`` is a grouped matmul for any dtype (``torch._grouped_mm`` takes bf16 only), as a
``torch.library`` custom op with a fake implementation and a backward, so models written with it
export and plan like those using ``torch._grouped_mm`` or transformers' fallback.
"""

from __future__ import annotations

import torch

from autopar.program.collectives import AxisGroup

__all__ = ["combine", "dispatch", "expert_offsets", "grouped_mm", "route"]

_fc = torch.ops._c10d_functional


# ------------------------------------------------------------------------------ grouped matmul


@torch.library.custom_op("autopar::grouped_mm", mutates_args=())
def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``out[rows of group g] = x[rows of group g] @ w[g]``; ``offs[g]`` ends group ``g``'s rows.

    ``x`` is ``[S, K]``, ``w`` ``[G, K, N]``, ``offs`` ``[G]`` (integers, non-decreasing); rows
    past ``offs[-1]`` are zero in the output."""
    out = x.new_zeros(x.shape[0], w.shape[2])
    start = 0
    for g, end in enumerate(offs.tolist()):
        end = int(end)
        if end > start:
            out[start:end] = x[start:end] @ w[g]
        start = end
    return out


@grouped_mm.register_fake
def _(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    torch._check(
        x.shape[1] == w.shape[1], lambda: f"grouped_mm: x has {x.shape[1]} columns, w {w.shape[1]} rows"
    )
    return x.new_empty(x.shape[0], w.shape[2])


@torch.library.custom_op("autopar::grouped_mm_backward", mutates_args=())
def _grouped_mm_backward(
    x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, g: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    gx = torch.zeros_like(x)
    gw = torch.zeros_like(w)
    start = 0
    for e, end in enumerate(offs.tolist()):
        end = int(end)
        if end > start:
            gx[start:end] = g[start:end] @ w[e].T
            gw[e] = x[start:end].T @ g[start:end]
        start = end
    return gx, gw


@_grouped_mm_backward.register_fake
def _(
    x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, g: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), torch.empty_like(w)


def _gmm_setup(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
    x, w, offs = inputs
    ctx.save_for_backward(x, w, offs)


def _gmm_backward(ctx, g):  # type: ignore[no-untyped-def]
    x, w, offs = ctx.saved_tensors
    gx, gw = _grouped_mm_backward(x, w, offs, g)
    return gx, gw, None


grouped_mm.register_autograd(_gmm_backward, setup_context=_gmm_setup)


# ------------------------------------------------------------------------------ route, dispatch


def _a2a(x: torch.Tensor, out_splits: list, in_splits: list, ax: AxisGroup, direction: str) -> torch.Tensor:
    ax.note("all_to_all", direction)
    return _fc.wait_tensor(_fc.all_to_all_single(x.contiguous(), out_splits, in_splits, ax.group_name))


def route(offs: torch.Tensor, ax: AxisGroup) -> torch.Tensor:
    """The route (module docstring) from this device's cumulative counts ``offs`` over all
    ``E = n·E_l`` experts: one all-to-all of ``n·E_l`` counts."""
    n = ax.size
    counts = torch.diff(offs.to(torch.int64), prepend=offs.new_zeros(1, dtype=torch.int64))
    send = counts.view(n, -1)
    recv = _a2a(send, [1] * n, [1] * n, ax, "fwd").view(n, -1)
    return torch.stack([send, recv])


def expert_offsets(r: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cumulative counts of this device's experts over the rows it received (its grouped matmul's
    ``offs``)."""
    return torch.cumsum(r[1].sum(0), 0).to(dtype)


def _splits(r: torch.Tensor) -> tuple[list, list]:
    """(rows sent to each device, rows received from each device), as Python (or symbolic) ints."""
    sent = r[0].sum(1).tolist()
    recv = r[1].sum(1).tolist()
    for s in (*sent, *recv):
        torch._check_is_size(s)
    return sent, recv


def _by_expert(r: torch.Tensor, rows: int, device: torch.device) -> torch.Tensor:
    """The permutation that regroups received rows (ordered by source device, then expert) by
    local expert, then source (Megatron-LM's ``sort_chunks_by_idxs``)."""
    n, e_l = r.shape[1], r.shape[2]
    ends = torch.cumsum(r[1].reshape(-1), 0)
    chunk = torch.searchsorted(ends, torch.arange(rows, device=device), right=True)
    key = (chunk % e_l) * n + chunk // e_l
    return torch.argsort(key, stable=True)


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, r, ax):  # type: ignore[override]
        sent, recv = _splits(r)
        got = _a2a(x, recv, sent, ax, "fwd")
        order = _by_expert(r, got.shape[0], got.device)
        ctx.args = (sent, recv, ax)
        ctx.save_for_backward(order)
        return got[order]

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        sent, recv, ax = ctx.args
        (order,) = ctx.saved_tensors
        back = torch.empty_like(g).index_put_((order,), g)
        return _a2a(back, sent, recv, ax, "bwd"), None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, r, ax):  # type: ignore[override]
        sent, recv = _splits(r)
        order = _by_expert(r, y.shape[0], y.device)
        back = torch.empty_like(y).index_put_((order,), y)
        ctx.args = (sent, recv, ax)
        ctx.save_for_backward(order)
        return _a2a(back, sent, recv, ax, "fwd")

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        sent, recv, ax = ctx.args
        (order,) = ctx.saved_tensors
        got = _a2a(g, recv, sent, ax, "bwd")
        return got[order], None, None


def dispatch(x: torch.Tensor, r: torch.Tensor, ax: AxisGroup) -> torch.Tensor:
    """Grouped rows of this device's tokens → the rows of its experts (module docstring)."""
    if x.requires_grad and torch.is_grad_enabled():
        return _Dispatch.apply(x, r, ax)
    sent, recv = _splits(r)
    got = _a2a(x, recv, sent, ax, "fwd")
    return got[_by_expert(r, got.shape[0], got.device)]


def combine(y: torch.Tensor, r: torch.Tensor, ax: AxisGroup) -> torch.Tensor:
    """The rows of this device's experts → back to the devices (and order) they came from."""
    if y.requires_grad and torch.is_grad_enabled():
        return _Combine.apply(y, r, ax)
    sent, recv = _splits(r)
    back = torch.empty_like(y).index_put_((_by_expert(r, y.shape[0], y.device),), y)
    return _a2a(back, sent, recv, ax, "fwd")

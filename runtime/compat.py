"""The one place that knows which torch.distributed names each torch version has.

torch 2.13 deprecates ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` in favour of
``all_gather_single`` / ``reduce_scatter_single``, which 2.11 (the GPU machine) lacks. Everything
else in autopar calls these three functions.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["all_gather_into", "all_to_all_into", "reduce_scatter_into"]

_AG_SINGLE = getattr(dist, "all_gather_single", None)
_RS_SINGLE = getattr(dist, "reduce_scatter_single", None)


def all_gather_into(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup) -> None:
    """``out`` (n·k elements) ← the concatenation of every rank's ``inp`` (k elements), rank order."""
    if _AG_SINGLE is not None:
        _AG_SINGLE(out, inp, group=group)
    else:
        dist.all_gather_into_tensor(out, inp, group=group)


def reduce_scatter_into(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup) -> None:
    """``out`` ← chunk ``rank`` of the sum over ranks of ``inp`` (split along dim 0)."""
    if _RS_SINGLE is not None:
        _RS_SINGLE(out, inp, group=group)
    else:
        dist.reduce_scatter_tensor(out, inp, group=group)


def all_to_all_into(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup) -> None:
    """Chunk ``j`` of ``inp`` (dim 0) goes to rank ``j``; chunk ``j`` of ``out`` comes from rank ``j``."""
    dist.all_to_all_single(out, inp, group=group)

"""Gloo's all-gathers into buffers the program allocates: the workaround for a heap fault of
torch's gloo backend.

Words: an *issue* node starts a functional collective (``torch.ops._c10d_functional``) and its
*wait* (``wait_tensor``) completes it (``passes.overlap``). The functional
``all_gather_into_tensor(x, n, group)`` allocates its own output; its ``out=`` form,
``all_gather_into_tensor_out(x, n, group, out=buf)``, writes into ``buf`` and returns it, and
``wait_tensor`` completes either the same way (the work is registered on the output's storage).

The fault. On gloo the two forms take different paths inside torch (``Functional.cpp``):
``all_gather_into_tensor`` calls ``ProcessGroupGloo::allgather_into_tensor_coalesced`` (added by
pytorch/pytorch#118910, which funnels it into ``allgather_coalesced``), whose work
(``AsyncAllgatherCoalescedWork``) allocates a flat output on gloo's worker thread and copies it into
the caller's tensor there; the ``out=`` form calls ``ProcessGroupGloo::_allgather_base``
(``AsyncAllgatherWork``, the path ``dist.all_gather_into_tensor`` takes). With several of the first
in flight on one group, processes abort now and then with glibc's ``malloc(): unaligned tcache
chunk detected``. ``examples/gloo_inflight_gathers.py`` shows it in plain torch, with no autopar
(4 processes, 8 gathers of a layer's shards in flight; figures in the module docstring there):
the coalesced path aborts, the ``_allgather_base`` path — through ``out=`` or through
``async_op=True`` — does not. No upstream report of it was found (pytorch/pytorch's issues, searched
for the message and the ops); where in the coalesced work the heap is written is not known.

``gather_into_buffers`` therefore rewrites each ``all_gather_into_tensor`` issue on a gloo group
(the process group's own backend where this process has it: a plan made for GPUs may be tried on
CPU processes) into ``new_empty`` (the buffer, of the gathered shape) and
``all_gather_into_tensor_out`` into it, in the same place; its wait and users are unchanged. It
runs after the passes that move collectives (``passes.overlap``), so they see one node per issue,
and it lets those passes keep several gathers in flight on gloo as on NCCL (where the functional
op's path is NCCL's own and the program is unchanged).
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.fx import GraphModule

from autopar.passes import PassContext

__all__ = ["gather_into_buffers"]

log = logging.getLogger("autopar.passes")

aten = torch.ops.aten
_fc = torch.ops._c10d_functional


def _on_gloo(group: str, cluster: object) -> bool:
    """Whether the process group named ``group`` is gloo's: the group itself where this process
    has it (a plan made for GPUs may be run on CPU processes to try it), else the cluster's
    backend (``Cluster.backend``)."""
    try:
        return dist.get_backend(_resolve_process_group(group)) == "gloo"
    except Exception:  # no such group in this process (a program built without one)
        return getattr(cluster, "backend", None) == "gloo"


def gather_into_buffers(gm: GraphModule, ctx: PassContext) -> GraphModule:
    """Every ``all_gather_into_tensor`` issue on a gloo group becomes a buffer and
    ``all_gather_into_tensor_out`` into it (module docstring); the others are left as they are."""
    cluster = getattr(ctx, "cluster", None)
    g = gm.graph
    rewritten = 0
    for n in list(g.nodes):
        if n.op != "call_function" or n.target is not _fc.all_gather_into_tensor.default:
            continue
        x, size, group = n.args
        if not _on_gloo(group, cluster):
            continue
        val = n.meta.get("val")
        if val is not None:
            shape = list(val.shape)
        else:  # the gathered shape: the shard's, its first dimension times the group's size
            xv = x.meta["val"]
            shape = [xv.shape[0] * size, *xv.shape[1:]]
        with g.inserting_before(n):
            buf = g.call_function(aten.new_empty.default, (x, shape))
            issue = g.call_function(_fc.all_gather_into_tensor_out.default, (x, size, group), {"out": buf})
        buf.meta.update({k: v for k, v in n.meta.items() if k != "val"})
        issue.meta.update(n.meta)
        if val is not None:
            buf.meta["val"] = val
        n.replace_all_uses_with(issue)
        g.erase_node(n)
        rewritten += 1
    if rewritten:
        log.info("gather_into_buffers: %d all-gathers write into buffers (gloo)", rewritten)
        g.lint()
        gm.recompile()
    return gm

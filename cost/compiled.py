"""Memory traffic of a training step compiled by Inductor (``parallelize(..., compile=True)``):
each chain of memory-bound ops runs as one generated kernel that reads what the chain reads from
outside once and writes what is read outside once, where eager PyTorch runs one kernel per op
and goes through device memory between them (``autopar.cost.op_kernels``).

Source: Ansel et al., "PyTorch 2: Faster Machine Learning Through Dynamic Python Bytecode
Transformation and Graph Compilation", ASPLOS 2024, §5 (TorchInductor): pointwise, reduction
and scatter nodes of the ATen graph are lowered to a loop-level IR and *fused* into one Triton
kernel where they read or write the same buffers ("vertical" fusion of producer into consumer,
"horizontal" fusion of siblings over the same iteration space, reductions with their pointwise
prologue and epilogue); matrix multiplications and convolutions stay calls to cuBLAS/cuDNN
("extern kernels"), as do custom ops (our fused Triton kernels are ``torch.library`` custom ops:
opaque to it); views become index arithmetic (no kernel, no copy). Nodes are never fused when
that would make a kernel depend on itself through an extern kernel (the scheduler's cycle
check). AOTAutograd's min-cut partitioner (same paper, §4; Horace He's "min-cut rematerialization"
note, 2022) saves the cheap memory-bound intermediates' *inputs* and recomputes the
intermediates in backward, so a chain's backward reads its boundary again instead of values it
wrote in forward.

Words:

* **chain** — a group of memory-bound ops one generated kernel computes
  (``autopar.passes.chains``: maximal connected groups of pointwise, reduction, norm, softmax and
  view/copy ops between compute-bound ones, never across a path through one).
* **boundary** — what a chain reads that an op outside it made (an activation, a parameter, a
  matmul's output) and what it writes that an op outside it reads (a value fed to a matmul or to a
  fused kernel, a graph output). Views inside a chain are free and pass their source through.
* **share** — a member's part of its chain's traffic, so that a sharded strategy costs each
  member on its own local shapes (``autopar.passes.strategies``) and the chain's cost is their
  sum: the external values it reads first, its output if it crosses the boundary.
* **launch** — one kernel's fixed cost (``DeviceSpec.kernel_overhead``), charged once per
  chain forward (at its first member) and once per chain backward (at its first member a gradient
  flows through), plus once for the reduction over the rows that gives a member's broadcast
  inputs their gradients (a norm's weight and bias: its own kernel). The host's per-op cost of
  eager PyTorch (``DeviceSpec.host_overhead``, which only the single-device eager reference
  charges: ``autopar.cost.step``) does not apply either: one generated wrapper issues a
  program's kernels, so the per-launch cost above is all that is left of it.

Bytes of a member's share (``s`` its tensors' bytes; ``B`` an input broadcast to the output's
shape):

* forward: ``Σ s(external inputs it reads first) + [boundary output] · s(out)``;
* backward (a gradient flows into it): the external inputs again where the chain's backward
  needs values (``r = 1``: some member's derivative reads its operands, and they are recomputed
  from the chain's inputs; a chain of casts, additions and copies has ``r = 0``),
  ``+ Σ s(their gradients)`` for those that take one and are not broadcast (once where the
  derivative hands all of them the same gradient: ``add``),
  ``+ [boundary output] · k · s(out)`` (its ``k`` gradients from outside the chain, added as they
  are read); the gradients of its broadcast inputs are one reduction over the rows of its own
  (a norm's weight and bias together), reading ``(1 + r) · s(out)`` (the incoming gradient, and
  the operand it multiplies) and writing ``Σ s(B)``; where that is all the member's backward
  does, it reads the incoming gradient there only. A view costs nothing, but where a view of an
  external value is read by ``k > 1`` ops outside the chain, its ``k`` gradients are added up in
  one kernel: ``(k + 1) · s(out)``, where eager PyTorch adds them pairwise (``k − 1`` kernels of
  ``3 · s(out)``).

All of it is memory-bound and timed as any memory kernel (``autopar.cost.compute.kernel_time``:
the roofline of Williams, Waterman and Patterson, CACM 2009).

Calibration (``tests/test_compiled_cost.py``; one H100, torch 2.11, the 1B LLaMA of
``examples/gpu_checks.py``, world size 1): without the fused kernels the compiled step is
predicted at 149.1 ms against ``torch.compile(model)``'s measured 146.51 ms; with them, 145.17
against the per-rank program compiled, 151.91 ms measured. The measured gain of compiling the
program with the kernels (0.954 of 159.18 ms) is mostly eager work of the per-rank program the
eager costs never charged (they predict 145.47 ms for it): this model gives 0.998.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from autopar.cost.compute import Kernel, KernelKind, OpKernels, TensorArg, itemsize

__all__ = ["ChainShare", "chain_share_kernels"]


@dataclass(frozen=True, slots=True)
class ChainShare:
    """What a member's share of its chain's kernels depends on (module docstring: share), found
    by ``autopar.passes.chains`` (its role's ``share``)."""

    reads: tuple[bool, ...]
    """Per tensor argument (``autopar.passes.annotate.ordered_tensor_args``): an external value
    this member reads first in its chain."""
    writes: bool
    """Its output is read outside the chain (directly or through views in it)."""
    extern_grads: int
    """Gradients it receives from outside the chain."""
    launch_fwd: bool
    """It carries the chain's forward launch (its first member)."""
    launch_bwd: bool
    """It carries the chain's backward launch (its first member a gradient flows through)."""
    reread: bool = True
    """The chain's backward needs values: some member's derivative reads its operands
    (``autopar.passes.annotate.saved_inputs``, or it keeps its output), recomputed from the
    chain's external inputs, so they are read again."""
    view: bool = False
    """A view (no kernel of its own); ``extern_grads`` then counts the gradients a view of an
    external value receives from outside, which one generated kernel adds up."""
    shared_grad: bool = False
    """Its derivative hands each input the same gradient (``add``), written once."""


def _full_bytes(t: TensorArg) -> float:
    """Bytes of ``t`` materialized (a gradient of an expanded view has its full size)."""
    return float(t.numel * itemsize(t.dtype))


def chain_share_kernels(
    args: Sequence[TensorArg],
    outs: Sequence[TensorArg],
    share: ChainShare,
    *,
    requires_grad: bool,
) -> OpKernels:
    """One member's share of its chain's kernels (module docstring). ``args``/``outs``: its
    tensor arguments (``grad`` set on those that take a gradient) and results, global or local
    shapes; ``share``: its part of the chain (``share.reads[j]``: ``args[j]`` is an external value
    it reads first); ``requires_grad``: a gradient flows into its output. A view is free, but the
    ``extern_grads > 1`` gradients of a view of an external value are added up in one kernel
    (read each, write the sum)."""
    out_bytes = sum(o.nbytes for o in outs)
    if share.view:
        k = share.extern_grads if requires_grad else 0
        return OpKernels((), (Kernel(KernelKind.MEMORY, (k + 1) * out_bytes),) if k > 1 else ())
    out_numel = max((o.numel for o in outs), default=1)
    external = [a for a, r in zip(args, share.reads) if r]
    fwd_bytes = sum(a.nbytes for a in external) + (out_bytes if share.writes else 0.0)
    fwd = (
        (Kernel(KernelKind.MEMORY, fwd_bytes, launches=int(share.launch_fwd)),)
        if fwd_bytes or share.launch_fwd
        else ()
    )
    if not requires_grad:
        return OpKernels(fwd)

    def broadcast(a: TensorArg) -> bool:  # an expanded view or a smaller operand: summed over rows
        return a.numel < out_numel or a.nbytes < _full_bytes(a)

    whole = [a for a in external if a.grad and not broadcast(a)]
    summed = [a for a in external if a.grad and broadcast(a)]
    flows_on = any(a.grad and not r for a, r in zip(args, share.reads))  # into the chain's other members
    incoming = out_bytes * share.extern_grads if share.writes and (whole or flows_on or not summed) else 0.0
    written = (
        max((_full_bytes(a) for a in whole), default=0.0)
        if share.shared_grad
        else sum(map(_full_bytes, whole))
    )
    bwd_bytes = (sum(a.nbytes for a in external) if share.reread else 0.0) + incoming + written
    bwd = (Kernel(KernelKind.MEMORY, bwd_bytes, launches=int(share.launch_bwd)),) if bwd_bytes else ()
    if summed:  # one reduction over the rows for all of them (a norm's weight and bias together)
        bwd += (Kernel(KernelKind.MEMORY, out_bytes * (1 + share.reread) + sum(a.nbytes for a in summed)),)
    return OpKernels(fwd, bwd)

"""Kernel fusion: groups of ATen ops that one fused kernel of ``autopar.program.kernels`` computes,
found by graph structure (ops and data flow, never module or node names), in the captured graph
(where the cost model charges them as one kernel) and in this rank's program (where the group is
replaced by a call of the kernel).

Words:

* **group** — the nodes one fused kernel replaces (:class:`FusionGroup`): its **members**, the
  fused op's **inputs** (values computed outside the group) and **outputs** (members whose values
  the fused op returns; a value read under several names — an identity cast of the residual
  stream — lists each). A member read outside the group other than through an output blocks the
  match: the fused kernel would not compute that value.
* **anchor** — the member that carries the fused kernel's cost in the planner's per-node costs
  (``autopar.cost.fused_traffic``); the other members cost nothing.
* **kinds** (``autopar.ir.FusionKind``) and the spellings matched:

  - ``add_layer_norm`` — ``aten.layer_norm``/``native_layer_norm`` over the last dimension, with
    the ``add`` of two same-shaped activations that feeds it (the residual add: its output, the
    residual stream, is usually read again by the next residual add, and is the fused op's
    second output);
  - ``add_rms_norm`` — transformers' ``LlamaRMSNorm`` (LLaMA, Mistral, Qwen2): optional cast to
    float32, ``pow(·, 2)``, ``mean(-1, keepdim=True)``, ``add eps``, ``rsqrt``, ``mul``, optional
    cast back to the input dtype, optional ``mul`` by a weight; also ``aten.rms_norm``
    (``F.rms_norm``); each with the residual add before it. A cast to float32 of a float32 value
    is the identity, so it may be read outside (it is the residual stream under another name);
  - ``bias_gelu`` — ``aten.gelu`` (either approximation), and GPT-2's ``NewGELUActivation`` written
    out (``0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))``), after an ``add`` of a bias or after a
    ``linear``/``addmm`` with a bias (reached through views that keep the last dimension): that
    bias moves into the fused op and the GEMM runs without it, as Megatron-LM's
    ``bias_gelu_impl`` does;
  - ``swiglu`` — ``silu(gate) · up``;
  - ``rotary`` — transformers' ``q·cos + rotate_half(q)·sin`` with ``rotate_half(x) = cat(−x₂, x₁)``
    from two slices of the last dimension, for q and k reading the same cos and sin (constants:
    no gradient), paired in program order;
  - ``cross_entropy`` — ``aten.cross_entropy_loss`` (no class weights or smoothing),
    ``log_softmax`` + ``nll_loss``, and in this rank's program the lowering's
    ``autopar.program.local_ops.sharded_cross_entropy`` (``sharded_nll_loss`` of a ``log_softmax``),
    whose vocabulary-parallel form then runs ``vocab_parallel_cross_entropy``.

Passes:

* ``annotate_fusions`` (planning, ``autopar.planner.GRAPH_PASSES``) writes each group on its
  members (``node.meta["autopar.fusion"]``) and all of them on the graph (``gm.meta``), when
  fusion is assumed (:func:`fusion_assumed`: a GPU cluster, and neither ``fuse_kernels`` nor
  ``annotate_fusions`` disabled); ``annotate_cost`` and the strategies then charge each group its
  fused kernel (:func:`fused_kernels`) and count what it saves for backward.
* ``fuse_kernels`` (rank program) rewrites this rank's forward program before the whole step is
  traced (an entry of ``autopar.passes.rank_compiler.RANK_COMPILER``, before ``trace_joint``; a
  pipeline's stage programs each), so the traced step records one node per fused
  forward op and one per backward op. It runs where the kernels run (``autopar.program.kernels
  .available``: CUDA with Triton, or Triton's interpreter on the CPU) and leaves the program as it
  is elsewhere, saying why.

Modules: ``matching`` (the group record and what every matcher asks of a node), one matcher
module per kernel family (``layer_norm_match``, ``rms_norm_match``, ``gelu_match``,
``swiglu_match``, ``rotary_match``, ``cross_entropy_match``), ``find_groups`` (the matchers run
over a graph), ``annotate_groups`` (the planning pass and the cost model's questions) and
``kernel_rewrite`` (the rank-program pass).
"""

from autopar.ir import FusionKind
from autopar.passes.fusion.annotate_groups import (
    annotate_fusions,
    fused_kernels,
    fused_saved_bytes,
    fusion_assumed,
    fusion_role,
    saved_by_group,
)
from autopar.passes.fusion.find_groups import find_fusions, fusion_counts, fusion_plan
from autopar.passes.fusion.kernel_rewrite import apply_fusions, fuse_kernels, kernels_run
from autopar.passes.fusion.matching import FUSION, FUSIONS, FusionGroup

__all__ = [
    "FUSION",
    "FUSIONS",
    "FusionGroup",
    "FusionKind",
    "annotate_fusions",
    "apply_fusions",
    "find_fusions",
    "fuse_kernels",
    "fused_kernels",
    "fused_saved_bytes",
    "fusion_assumed",
    "fusion_counts",
    "fusion_plan",
    "fusion_role",
    "kernels_run",
    "saved_by_group",
]

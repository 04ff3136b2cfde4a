"""Hand-written layouts as constrained plans: the baselines autopar is compared against.

``megatron`` fixes the weights to Megatron-LM's tensor-parallel pattern (Shoeybi et al., arXiv
1909.08053 §3) and lets the solver place everything else, so the result is a point of the same
search space ``autopar.plan`` explores — the auto plan can only match or beat it.

The pattern is recognised by structure, not by names. Walking the graph in order, every matmul
whose weight is a parameter is

* **row-parallel** (weight split along its input features, output ``Partial``, one all-reduce
  after it) when every nearest upstream parameter matmul is column-parallel and the path from
  them passes no normalization — the second matmul of an MLP, the attention output projection;
* **column-parallel** (weight split along its output features) otherwise — QKV, MLP up/gate, and
  the LM head, which is thereby vocabulary-parallel.

Embedding tables are vocabulary-parallel (split along rows). GPT-2's ``Conv1D`` stores weights as
``[in, out]`` (``addmm``), ``nn.Linear`` as ``[out, in]`` (``linear``): the split dimension follows
the op, so both come out right. Weights are used where they lie (never gathered). With
``sequence_parallel=True`` normalizations and the residual additions after row-parallel layers run
split along the sequence on the tensor axis (Korthikanti et al., arXiv 2205.05198); without it they
run replicated there, as in the original Megatron-LM.

Mixture-of-experts layers (``autopar.rules.routing``) get Megatron-LM's expert parallelism: their
experts split by expert over an ``ep`` axis carved out of the data-parallel ranks (expert tensor
parallel size 1). The **distributed optimizer** (Megatron-LM's ``--use-distributed-optimizer``)
splits each weight's optimizer state over its **data-parallel ranks** — the ranks that hold the
same slice of it and run different tokens: ``dp / ep`` and ``ep`` for dense weights, ``dp / ep``
and ``tp`` for experts. ``best_megatron`` tunes these knobs with the others (its docstring says
how the search is pruned).

Modules: ``roles`` (the structural rule), ``megatron_layout`` (the layouts), ``best``
(``best_megatron``).
"""

from autopar.layouts.best import KNOBS, best_megatron
from autopar.layouts.fsdp_layout import fsdp
from autopar.layouts.megatron_layout import megatron, megatron_mesh
from autopar.layouts.roles import expert_weights, megatron_weight_roles
from autopar.layouts.static_bytes import megatron_static_bytes

__all__ = [
    "KNOBS",
    "best_megatron",
    "expert_weights",
    "fsdp",
    "megatron",
    "megatron_mesh",
    "megatron_static_bytes",
    "megatron_weight_roles",
]

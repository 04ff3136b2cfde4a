"""Inside one repeated layer: what its forward + backward time goes to (attention, MLP, norms,
collectives), read off the plan's nodes and reshards.

Words:

* **repeated layer** — the layer class with the most copies in the plan's summary
  (``autopar.display.layer_rows``: ``blocks.0–7`` folds eight), measured on its first copy
  (``blocks.0``).
* **part** — ``attention``, ``MLP``, ``norms`` or ``other`` compute. A node belongs to the part
  its module's name says, below the layer (``attn``, ``self_attn``, ``attention``; ``mlp``,
  ``ffn``, ``feed_forward``, ``moe``, ``experts``; ``norm``, ``ln_1``, ``layernorm``); a node
  whose module says none (a GPT block's ``fc`` and ``proj`` sit directly in the block, its GeLU
  in the block itself) belongs to its **residual branch**: the layer's ops between two residual
  adds (adds in the layer's own module), an attention branch when it computes attention (scaled
  dot-product attention, a softmax), else an MLP branch when it multiplies by a weight. Norm ops
  are norms wherever they sit; residual adds and anything else are ``other``. A fused kernel's
  time is on its anchor node (``plan.fusions``), so it counts where that node sits.
* **collectives** — the layer's communication on the compute's critical path: collectives inside
  its ops (``NodePlan.comm_time``) and the reshards into them (tensor- and sequence-parallel
  gathers and reductions, the backward all-reduce of an activation's gradient).
  **gradient reduction** — its weights' data-parallel gradient reduction and ZeRO parameter
  gathers, which the simulator overlaps with the backward (``autopar.simulate``).
  **optimizer step** — its weights' update of their local shards, the share the solver charges
  each weight (``autopar.passes.strategies``; ``1/m`` of it per micro-batch).

Times are one layer's forward + backward on one device: per micro-batch for a plan with several
micro-batches (its nodes are planned for one micro-batch), per step otherwise.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from autopar.display import layer_rows, unit_of
from autopar.planfile import NodePlan, Plan

__all__ = ["PARTS", "LayerBreakdown", "LayerPart", "layer_breakdown"]

PARTS = ("attention", "MLP", "norms", "other", "collectives", "gradient reduction", "optimizer step")
"""The parts in the order they are drawn."""

_ATTENTION = ("attn", "attention")
_MLP = ("mlp", "ffn", "feed_forward", "feedforward", "moe", "expert")
_NORM = re.compile(r"(norm|^ln(_?\w*\d)?$|^ln_)", re.IGNORECASE)
_ATTENTION_OPS = ("attention", "softmax")
_MATMUL_OPS = ("linear", "mm", "addmm", "bmm", "matmul", "einsum", "baddbmm")
_ADD_OPS = ("add", "add_")


@dataclass(frozen=True, slots=True)
class LayerPart:
    """One part of a layer (module docstring): its time and what it is made of."""

    name: str
    """One of ``PARTS``."""
    time: float
    """Seconds, forward + backward."""
    of: tuple[str, ...]
    """The modules (relative to the layer) whose ops it sums, or the collectives' kinds."""


@dataclass(frozen=True, slots=True)
class LayerBreakdown:
    """One repeated layer's time by part (module docstring)."""

    layer: str
    """The copy measured, e.g. ``blocks.0``."""
    layer_class: str
    count: int
    """Copies of the layer in the plan."""
    per: str
    """``"micro-batch"`` or ``"step"``: what the times are for."""
    parts: tuple[LayerPart, ...]
    """Every part of ``PARTS`` with time, in that order."""

    @property
    def total(self) -> float:
        return sum(p.time for p in self.parts)

    def __str__(self) -> str:
        lines = [
            f"inside one {self.layer_class} layer ({self.layer}, ×{self.count}), forward + backward per "
            f"{self.per}: {self.total * 1e6:.1f} µs"
        ]
        for p in self.parts:
            share = p.time / self.total if self.total > 0 else 0.0
            lines.append(f"  {p.name:<19} {p.time * 1e6:>9.1f} µs {share:>6.1%}  {', '.join(p.of)}")
        return "\n".join(lines)


def _keyword_part(rel: str) -> str | None:
    head = rel.split(".")[0].lower() if rel else ""
    if any(k in head for k in _ATTENTION):
        return "attention"
    if any(k in head for k in _MLP):
        return "MLP"
    if head and _NORM.search(head):
        return "norms"
    return None


def _branch_part(ops: list[NodePlan]) -> str:
    names = [n.op.lower() for n in ops]
    if any(a in op for op in names for a in _ATTENTION_OPS):
        return "attention"
    if any(op in _MATMUL_OPS for op in names):
        return "MLP"
    return "other"


def layer_breakdown(plan: Plan) -> LayerBreakdown | None:
    """The time inside ``plan``'s repeated layer by part (module docstring); ``None`` when no layer
    repeats."""
    rows = [r for r in layer_rows(plan) if r.layer_class not in ("<top>", "<inputs>")]
    by_class: dict[str, int] = {}
    for r in rows:
        by_class[r.layer_class] = by_class.get(r.layer_class, 0) + r.count
    repeated = [r for r in rows if by_class[r.layer_class] > 1]
    if not repeated:
        return None
    first = max(repeated, key=lambda r: (by_class[r.layer_class], r.compute + r.comm))
    first = next(r for r in rows if r.layer_class == first.layer_class)
    layer = unit_of(first.modules[0])[0] if first.modules else first.name
    ops = [n for n in plan.nodes if n.kind == "op" and unit_of(n.module)[0] == layer]
    names = {n.name for n in ops}

    # Residual branches: the ops between adds that sit in the layer's own module.
    branch_of: dict[str, str] = {}
    branch: list[NodePlan] = []
    for n in [*ops, None]:
        if n is None or (n.module == layer and n.op.lower() in _ADD_OPS):
            kind = _branch_part(branch)
            branch_of.update((m.name, kind) for m in branch)
            branch = []
        else:
            branch.append(n)

    time: dict[str, float] = dict.fromkeys(PARTS, 0.0)
    of: dict[str, list[str]] = {p: [] for p in PARTS}

    def add(part: str, t: float, what: str) -> None:
        time[part] += t
        if t > 0 and what not in of[part]:
            of[part].append(what)

    for n in ops:
        rel = n.module[len(layer) :].lstrip(".") or "(the layer itself)"
        if "norm" in n.op.lower():
            part = "norms"
        else:
            part = _keyword_part(rel) or branch_of.get(n.name, "other")
        add(part, n.compute_time, rel)
        if n.comm_time > 0:
            add("collectives", n.comm_time, next((c.split("(")[0] for c in n.comms if c), "in-op"))
    kind = {n.name: n.kind for n in plan.nodes}
    for r in plan.distinct_reshards():
        if r.consumer not in names or r.time <= 0:
            continue
        what = ", ".join(dict.fromkeys(c.split("(")[0] for c in r.collectives if not c.startswith("slice")))
        if r.grad_sync_axes and kind.get(r.producer) == "param":
            axes = "+".join(plan.mesh_axes[a] for a in r.grad_sync_axes if a < len(plan.mesh_axes))
            add("gradient reduction", r.time, f"over {axes}")
        else:
            add("collectives", r.time, what or "all_reduce (activation gradient)")
    for n in plan.nodes:  # its weights' share of the optimizer step (``passes.strategies``)
        if n.kind == "param" and n.fqn.startswith(layer + ".") and n.compute_time > 0:
            add("optimizer step", n.compute_time, n.fqn[len(layer) + 1 :])
    p = plan.pipeline
    per = "micro-batch" if p is not None and p.microbatches > 1 else "step"
    return LayerBreakdown(
        layer=layer,
        layer_class=first.layer_class,
        count=by_class[first.layer_class],
        per=per,
        parts=tuple(LayerPart(k, time[k], tuple(of[k])) for k in PARTS if time[k] > 0),
    )

"""Which repeated layers recompute or offload, and which ops a recomputation mode re-runs: the rule
the solver costs (``passes.strategies``) and the per-rank program applies (``passes.recompute``),
found by graph structure.

* **repeated layer** — an instance of a repeated module (``transformer.h.3``), in the order the
  forward first runs it; ``PlanConfig.recompute_layers`` and ``offload_activations`` count them.
* **attention scores** — the ``… × s × s`` product of queries and keys (neither a weight) and the
  same-shaped ops on it (scale, mask, softmax, dropout): what ``selective`` recomputes.
"""

from __future__ import annotations

from torch.fx import Graph, Node

from autopar.graph import OpFamily, op_info, op_name, outer_instance, tensor_inputs
from autopar.ir import TENSOR

__all__ = ["offloaded_layers", "recomputed", "recomputed_layers", "repeated_layers"]


def _square(node: Node) -> bool:
    shape = getattr(node.meta.get("val"), "shape", None)
    return shape is not None and len(shape) >= 3 and shape[-1] == shape[-2] and int(shape[-1]) > 1


def _attention_scores(node: Node, depth: int = 0) -> bool:
    """An attention-score tensor, found by structure: the ``… × s × s`` product of two activations
    (queries and keys: neither is a weight), or a same-shaped op on one (scaling, masking,
    softmax, dropout), or a view of one that regroups its leading dimensions (``baddbmm``'s
    ``(b·h) × s × s`` viewed as ``b × h × s × s``, as attention written out runs it)."""
    if depth > 12 or not _square(node):
        return False
    ins = tensor_inputs(node)
    if op_info(node).family is OpFamily.MATMUL:
        return len(ins) >= 2 and not any(_from_param(i) for i in ins[:2])
    first = ins[0] if ins else None
    if first is None:
        return False
    before, after = first.meta.get("val"), node.meta["val"]
    shape = getattr(before, "shape", None)
    regrouped = (
        op_info(node).family is OpFamily.VIEW
        and shape is not None
        and len(shape) >= 3
        and tuple(shape[-2:]) == tuple(after.shape[-2:])
        and before.numel() == after.numel()
    )
    if shape != after.shape and not regrouped:
        return False
    return _attention_scores(first, depth + 1)


def _from_param(node: Node, depth: int = 0) -> bool:
    """``node`` is a parameter, or views of one."""
    info = node.meta.get(TENSOR)
    if info is not None and info.kind == "param":
        return True
    if depth > 6 or node.op != "call_function" or op_info(node).family is not OpFamily.VIEW:
        return False
    ins = tensor_inputs(node)
    return bool(ins) and _from_param(ins[0], depth + 1)


def repeated_layers(graph: Graph) -> list[str]:
    """The model's repeated-layer instances (``transformer.h.3``: ``outer_instance`` of the nodes in
    a repeated layer), in the order the graph first runs them: the ordinals
    ``PlanConfig.recompute_layers`` counts."""
    seen: dict[str, None] = {}
    for n in graph.nodes:
        info = n.meta.get(TENSOR)
        if n.op == "call_function" and info is not None and "*" in info.layer:
            seen.setdefault(outer_instance(info.module), None)
    return list(seen)


def recomputed_layers(graph: Graph, layers: int | tuple[int, ...] | None) -> frozenset[str] | None:
    """The instances ``PlanConfig.recompute_layers`` names (``None``: every repeated layer): an
    int ``k`` the model's first ``k`` (all where it has fewer), a tuple those ordinals."""
    if layers is None:
        return None
    names = repeated_layers(graph)
    picks = range(min(layers, len(names))) if isinstance(layers, int) else layers
    outside = sorted(i for i in picks if not 0 <= i < len(names))
    if outside:
        raise ValueError(
            f"recompute_layers names layers {outside}, but the model has {len(names)} repeated layers "
            f"(ordinals 0 to {len(names) - 1}, in the order the forward runs them)"
        )
    return frozenset(names[i] for i in picks)


def offloaded_layers(graph: Graph, count: int | None) -> frozenset[str] | None:
    """The instances ``PlanConfig.offload_activations`` offloads: the model's first ``count``
    repeated layers (all where it has fewer); ``None`` for none."""
    if not count:
        return None
    return frozenset(repeated_layers(graph)[:count])


def recomputed(node: Node, mode: str, layers: frozenset[str] | None = None) -> bool:
    """Whether recomputation ``mode`` recomputes ``node`` in backward instead of saving it — the
    rule ``autopar.passes.recompute.recompute_layers`` applies to the per-rank program: inside a
    repeated layer, ``full``: every node but the layer's outputs (values read outside it);
    ``selective``: the attention-score tensors (``_attention_scores``: the attention dropout among
    them); never in-place writes. The runtime pass recomputes the program nodes lowered from
    exactly these.

    Random ops (dropout) are recomputed like the rest: the program records the generator's state
    before the forward draw and replays it in backward (``autopar.program.rng``), so no dropout mask
    is kept — as Korthikanti et al.'s formulas assume (``autopar.cost.memory``: full recomputation
    keeps only the layer's input, selective no attention-dropout mask). The state kept instead, a
    few KB per random op (5 KB on a CPU, 16 bytes on CUDA), is not counted.

    ``layers``: the repeated-layer instances the mode applies to (``recomputed_layers``; ``None``:
    every one), as Megatron-LM's ``--recompute-num-layers`` recomputes some layers and keeps the
    activations of the others."""
    if mode not in ("full", "selective") or node.op != "call_function":
        return False
    info = node.meta.get(TENSOR)
    if info is None or "*" not in info.layer:
        return False
    if layers is not None and outer_instance(info.module) not in layers:
        return False
    if op_info(node).writes or op_name(node).endswith("_"):
        return False
    if mode == "selective":
        return _attention_scores(node)
    inst = outer_instance(info.module)
    for u in node.users:
        ui = u.meta.get(TENSOR)
        if u.op == "output" or ui is None or outer_instance(ui.module) != inst:
            return False
    return True

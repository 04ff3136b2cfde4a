"""Graph vocabulary shared by every layer: which nodes are tensors, what an op is called, and the
one table of op facts (``OPS``) that the cost passes, the rules, the layouts and the lowering read.

Words:

* **op name** — the aten packet name of a ``call_function`` node (``linear`` for
  ``aten.linear.default``), see :func:`op_name`.
* **family** — what kind of work an op does (:class:`OpFamily`): the cost formulas
  (``autopar.cost.compute``), the rules (``autopar.rules``) and the layouts dispatch on it.
* **op facts** — :class:`OpInfo`: the family plus what autograd keeps for backward (its
  derivative formula in ``tools/autograd/derivatives.yaml``), whether the op is cheap enough to
  *follow* its producer's layout (Alpa's follow heuristic), whether it only reshapes, casts or
  copies its input (``identity_like``), and which argument holds a shape the lowering must make
  local.

This module imports nothing from autopar but ``torch``: it is the bottom of the package.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch.fx import GraphModule, Node

__all__ = [
    "OPS",
    "OpFamily",
    "OpInfo",
    "is_tensor_node",
    "is_view",
    "mutates",
    "op_family",
    "op_info",
    "op_name",
    "outer_instance",
    "output_node",
    "read_by_lookup",
    "returned_scalars",
    "tensor_inputs",
    "tensor_outputs",
    "tensor_val",
    "uses_through",
    "written_inputs",
]


class OpFamily(enum.Enum):
    """What kind of work an op does."""

    MATMUL = "matmul"
    ATTENTION = "attention"
    CONV = "conv"
    NORM = "norm"
    """Per-row normalizations (layer norm, RMS norm, group norm)."""
    BATCH_NORM = "batch_norm"
    POINTWISE = "pointwise"
    VIEW = "view"
    REDUCTION = "reduction"
    SOFTMAX = "softmax"
    EMBEDDING = "embedding"
    LOSS = "loss"
    ROUTING = "routing"
    """Mixture-of-experts routing and indexing: top-k, sort, histograms, scatters and gathers."""
    ASSERT = "assert"
    """Shape and metadata assertions export inserts; they compute nothing and are lowered away."""
    OTHER = "other"


@dataclass(frozen=True, slots=True)
class OpInfo:
    """Facts about one aten op (see module docstring)."""

    family: OpFamily
    saves_inputs: bool = False
    """Autograd keeps (some of) the op's inputs for backward."""
    saves_output: bool = False
    """Autograd keeps the op's output for backward."""
    cheap: bool = False
    """A one-input op cheap enough to follow its producer's layout (no solver variable)."""
    identity_like: bool = False
    """The value passes through unchanged up to shape, dtype or a dropout mask."""
    shape_arg: int | None = None
    """Position of an argument holding the output shape (made local by the lowering)."""
    writes: tuple[int, ...] = ()
    """Positions of arguments the op writes into although its schema does not mark them (batch
    norm updates its running statistics in place when training); see :func:`written_inputs`."""


def _table() -> dict[str, OpInfo]:
    F = OpFamily
    t: dict[str, OpInfo] = {}

    def put(names: str, info: OpInfo) -> None:
        for n in names.split():
            t[n] = info

    put("mm addmm bmm baddbmm matmul linear", OpInfo(F.MATMUL, saves_inputs=True))
    # Grouped matmuls of mixture-of-experts layers: rows grouped by expert, one weight per group
    # (``aten._grouped_mm``, ``F.grouped_mm``, transformers' ``grouped_mm_fallback``).
    put("_grouped_mm grouped_mm grouped_mm_fallback", OpInfo(F.MATMUL, saves_inputs=True))
    put(
        "scaled_dot_product_attention _scaled_dot_product_flash_attention_for_cpu "
        "_scaled_dot_product_efficient_attention _scaled_dot_product_flash_attention "
        "_scaled_dot_product_cudnn_attention",
        OpInfo(F.ATTENTION, saves_inputs=True, saves_output=True),
    )
    put("convolution conv1d conv2d conv3d", OpInfo(F.CONV, saves_inputs=True))
    put("layer_norm rms_norm native_layer_norm group_norm", OpInfo(F.NORM, saves_inputs=True))
    put(
        "_native_batch_norm_legit_functional _native_batch_norm_legit_no_training _native_batch_norm_legit",
        OpInfo(F.BATCH_NORM, saves_inputs=True),
    )
    put("batch_norm native_batch_norm instance_norm", OpInfo(F.BATCH_NORM, saves_inputs=True, writes=(3, 4)))
    # Pointwise ops whose derivative reads their input (and follow their producer when unary).
    put("gelu silu relu erf abs", OpInfo(F.POINTWISE, saves_inputs=True, cheap=True))
    # Their derivatives read their output only (autograd's TanhBackward0 and the like save ``result``).
    put("rsqrt sqrt exp tanh sigmoid", OpInfo(F.POINTWISE, saves_output=True, cheap=True))
    put("pow", OpInfo(F.POINTWISE, saves_inputs=True, cheap=True))
    put(
        "mul div log sin cos where masked_fill maximum minimum softplus hardswish mish elu "
        "leaky_relu clamp reciprocal square",
        OpInfo(F.POINTWISE, saves_inputs=True),
    )
    put("neg", OpInfo(F.POINTWISE, cheap=True))
    put("mul_ div_ masked_fill_ clamp_", OpInfo(F.POINTWISE, saves_inputs=True))
    put("add_ sub_", OpInfo(F.POINTWISE))
    put("dropout", OpInfo(F.POINTWISE, cheap=True, identity_like=True))
    put("native_dropout", OpInfo(F.POINTWISE, identity_like=True))
    put(
        "add sub rsub eq ne lt le gt ge __and__ __or__ bitwise_and bitwise_or bitwise_not "
        "logical_and logical_or logical_not fmod remainder lerp addcmul addcdiv tril triu floor_divide "
        "clamp_min clamp_max hardtanh hardsigmoid isnan isinf sign floor ceil round log1p expm1 "
        "gelu_ relu_ silu_ zeros_like ones_like full_like empty_like rand_like",
        OpInfo(F.POINTWISE),
    )
    put(
        "to _to_copy type_as clone contiguous alias detach",
        OpInfo(F.POINTWISE, cheap=True, identity_like=True),
    )
    put("view reshape _unsafe_view", OpInfo(F.VIEW, cheap=True, identity_like=True, shape_arg=1))
    put("expand broadcast_to", OpInfo(F.VIEW, cheap=True, shape_arg=1))
    put(
        "unsqueeze squeeze flatten transpose swapaxes swapdims permute t numpy_T mT",
        OpInfo(F.VIEW, cheap=True),
    )
    put("unflatten", OpInfo(F.VIEW))
    put("getitem", OpInfo(F.VIEW, cheap=True))
    put(
        "slice narrow select split split_with_sizes chunk unbind cat concat stack pad constant_pad_nd",
        OpInfo(F.VIEW),
    )
    put("new_ones new_zeros new_empty new_full", OpInfo(F.OTHER, shape_arg=1))
    put("sum mean argmax argmin any all cumsum", OpInfo(F.REDUCTION))
    put("amax amin prod var std norm logsumexp cumprod", OpInfo(F.REDUCTION, saves_inputs=True))
    put("_softmax softmax _log_softmax log_softmax", OpInfo(F.SOFTMAX, saves_output=True))
    put("embedding", OpInfo(F.EMBEDDING, saves_inputs=True))
    put(
        "cross_entropy_loss nll_loss nll_loss_nd nll_loss_forward mse_loss",
        OpInfo(F.LOSS, saves_inputs=True),
    )
    put(
        "topk sort argsort histc bincount index_put index_put_ index_add index_add_ scatter "
        "scatter_add scatter_add_ scatter_reduce repeat repeat_interleave one_hot",
        OpInfo(F.ROUTING),
    )
    put("index gather", OpInfo(F.ROUTING, saves_inputs=True))
    put(
        "_assert_tensor_metadata _assert_scalar sym_constrain_range_for_size _assert_async",
        OpInfo(F.ASSERT),
    )
    return t


OPS: dict[str, OpInfo] = _table()
"""Op name -> facts. Ops not listed are :attr:`OpFamily.OTHER` with no facts set."""

_UNKNOWN = OpInfo(OpFamily.OTHER)


def op_name(node: Node) -> str:
    """The aten packet name of a call (``linear`` for ``aten.linear.default``), else the node op."""
    t = node.target
    if node.op != "call_function":
        return node.op
    packet = getattr(t, "overloadpacket", None)
    if packet is not None:
        return packet.__name__
    return getattr(t, "__name__", str(t))


def op_info(node_or_name: Node | str) -> OpInfo:
    """The facts of an op (by node or by op name); placeholders and unknown ops get no facts."""
    if isinstance(node_or_name, Node):
        if node_or_name.op != "call_function":
            return _UNKNOWN
        node_or_name = op_name(node_or_name)
    return OPS.get(node_or_name, _UNKNOWN)


def op_family(node: Node) -> OpFamily:
    return op_info(node).family


def read_by_lookup(node: Node) -> bool:
    """Whether ``node`` (a weight) is the table of an embedding lookup, directly or through views:
    its gradient then has a row per index looked up (``autopar.grad_compression``)."""
    todo, seen = [node], {node}
    while todo:
        n = todo.pop()
        for u in n.users:
            if u in seen or u.op != "call_function":
                continue
            seen.add(u)
            family = op_family(u)
            if family is OpFamily.EMBEDDING and u.args and u.args[0] is n:
                return True
            if family is OpFamily.VIEW:
                todo.append(u)
    return False


def outer_instance(path: str) -> str:
    """The outermost repeated-module instance a module path lies in: ``transformer.h.3`` for
    ``transformer.h.3.attn.c_proj`` (the path up to its first numeric component); the path itself
    when it lies in no repeated module."""
    parts = path.split(".")
    for i, p in enumerate(parts):
        if p.isdigit():
            return ".".join(parts[: i + 1])
    return path


def written_inputs(node: Node) -> list[Node]:
    """The argument nodes ``node`` writes into: those its schema marks ``Tensor(a!)`` (``add_``,
    ``index_put_``) and those of :attr:`OpInfo.writes` (batch norm's running statistics, only when
    it is training, its sixth argument)."""
    if node.op != "call_function":
        return []
    out: list[Node] = []
    schema = getattr(node.target, "_schema", None)
    positions = set()
    if schema is not None:
        positions |= {
            i for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write
        }
    info = op_info(node)
    if info.writes and len(node.args) > 5 and node.args[5] is True:
        positions |= set(info.writes)
    for i in sorted(positions):
        if i < len(node.args) and isinstance(node.args[i], Node) and node.args[i] not in out:
            out.append(node.args[i])
    return out


def mutates(n: Node) -> bool:
    """True for an op that writes into one of its arguments (``add_``, a training ``batch_norm``
    updating its running statistics)."""
    schema = getattr(n.target, "_schema", None) if n.op == "call_function" else None
    return schema is not None and any(
        a.alias_info is not None and a.alias_info.is_write for a in schema.arguments
    )


def output_node(gm: GraphModule) -> Node:
    """The graph's ``output`` node."""
    return next(n for n in reversed(gm.graph.nodes) if n.op == "output")


def returned_scalars(gm: GraphModule) -> dict[Node, int]:
    """The scalar tensors the graph returns (a loss), with their item sizes: a per-rank program
    returns each whole on every device (``autopar.cost.reshard_cost.scalar_output_cost``)."""
    out: dict[Node, int] = {}
    for i in output_node(gm).all_input_nodes:
        val = i.meta.get("val")
        if isinstance(val, torch.Tensor) and val.dim() == 0:
            out[i] = val.element_size()
    return out


def is_tensor_node(n: Node) -> bool:
    return isinstance(n.meta.get("val"), torch.Tensor)


def is_view(node: Node) -> bool:
    """``node`` is a call of a view op (its output aliases its first input)."""
    return node.op == "call_function" and op_family(node) is OpFamily.VIEW


def uses_through(value: Node, follow: Callable[[Node, Node], bool]) -> Iterator[tuple[Node, Node]]:
    """Every use ``(v, u)`` (``u`` uses ``v``) of ``value`` and of the nodes reached from it through
    the uses ``follow(v, u)`` accepts (views, casts); each node is walked once."""
    stack, seen = [value], set()
    while stack:
        v = stack.pop()
        if v in seen:
            continue
        seen.add(v)
        for u in v.users:
            yield v, u
            if follow(v, u):
                stack.append(u)


def tensor_val(node: object) -> torch.Tensor | None:
    """The tensor value ``node`` carries in ``meta["val"]``; None for a non-node or non-tensor."""
    v = node.meta.get("val") if isinstance(node, Node) else None
    return v if isinstance(v, torch.Tensor) else None


def tensor_inputs(node: Node) -> list[Node]:
    """The distinct tensor-valued producer nodes of ``node``, in first-use order."""
    return [n for n in node.all_input_nodes if is_tensor_node(n)]


def tensor_outputs(node: Node) -> list[torch.Tensor]:
    """The tensors ``node`` produces, flattened (most ops: one)."""
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return [val]
    if isinstance(val, (list, tuple)):
        return [v for v in val if isinstance(v, torch.Tensor)]
    return []


_RANDOM_OPS = ("rand", "bernoulli", "normal", "multinomial", "uniform", "exponential", "poisson")


def is_random(node: Node) -> bool:
    """``node`` draws random numbers: sampling ops, dropout with a non-zero probability in training
    mode (``dropout(x, 0.0, True)`` is the identity), and fused attention with a non-zero
    ``dropout_p`` (its kernel draws the mask itself). Backward ops (``native_dropout_backward``)
    draw nothing."""
    if node.op != "call_function":
        return False
    name = op_name(node)
    if name.endswith("_backward"):
        return False
    schema = getattr(node.target, "_schema", None)
    names = [a.name for a in schema.arguments] if schema is not None else []
    if "dropout_p" in names:
        i = names.index("dropout_p")
        p = node.args[i] if len(node.args) > i else node.kwargs.get("dropout_p", 0.0)
        return not (isinstance(p, (int, float)) and p == 0)
    if "dropout" in name:
        p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5)
        train = (
            node.args[2]
            if len(node.args) > 2
            else node.kwargs.get("train", node.kwargs.get("training", True))
        )
        return not (isinstance(p, (int, float)) and p == 0) and train is not False
    return any(r in name for r in _RANDOM_OPS)


@contextlib.contextmanager
def recompiled_once(gm: GraphModule) -> Iterator[None]:
    """Rewrites of ``gm`` inside recompile it once, on leaving: each ``gm.recompile()`` they call is
    deferred (a recompile writes the Python code of every node: 0.2 s at 2 500 nodes, and
    canonicalizing a capture called it up to seven times)."""
    asked: list[bool] = []
    gm.recompile = lambda: asked.append(True)  # type: ignore[method-assign]
    try:
        yield
    finally:
        del gm.recompile
        if asked:
            gm.recompile()

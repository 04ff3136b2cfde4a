"""Index inputs: the user inputs a graph uses as indices, and the ranges their values must lie in.

Sharded lookups and losses would silently mask ids the single-device model rejects (an id past a
vocabulary shard is simply another shard's), so the capture records, per user input, the bound of
every table it indexes (``index_bounds``) and the runtime checks each batch against them; a
position table shorter than the example's sequence is refused at capture
(``check_position_tables``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from autopar.graph import OpFamily, op_info, op_name, uses_through

__all__ = ["IndexBound", "check_position_tables", "index_bounds"]


@dataclass(frozen=True, slots=True)
class IndexBound:
    """A user input used as indices: valid values are ``0 <= v < bound`` (or ``ignore``)."""

    bound: int
    ignore: int | None
    """A value allowed besides the range (cross-entropy's ``ignore_index``), or None."""
    what: str
    """What the values index, for messages: ``"the embedding table (64 rows)"``."""


def index_bounds(graph: torch.fx.Graph, inputs: dict[str, str]) -> dict[str, list[IndexBound]]:
    """For each user input (placeholder name -> path in ``inputs``) that reaches, through views and
    casts, the indices of an ``embedding`` or the targets of a cross-entropy/NLL loss: the range
    its values must lie in."""
    out: dict[str, list[IndexBound]] = {}
    for ph in graph.nodes:
        if ph.op != "placeholder" or ph.name not in inputs:
            continue
        bounds: list[IndexBound] = []
        for n, u in uses_through(ph, _same_value):
            name = op_name(u)
            if name == "embedding" and len(u.args) > 1 and u.args[1] is n:
                rows = int(u.args[0].meta["val"].shape[0])
                bounds.append(IndexBound(rows, None, f"the embedding table ({rows} rows)"))
            elif (
                op_info(u).family is OpFamily.LOSS
                and name != "mse_loss"
                and len(u.args) > 1
                and u.args[1] is n
            ):
                logits = u.args[0].meta["val"]
                classes = int(logits.shape[1] if logits.dim() > 1 else logits.shape[0])
                ignore = u.args[4] if len(u.args) > 4 else u.kwargs.get("ignore_index", -100)
                bounds.append(IndexBound(classes, int(ignore), f"the loss's {classes} classes"))
        if bounds:
            out[inputs[ph.name]] = sorted(set(bounds), key=lambda b: (b.bound, b.what))
    return out


def _same_value(value: torch.fx.Node, user: torch.fx.Node) -> bool:
    """``user`` passes ``value``'s values on unchanged (a view or a cast of it as its data)."""
    if user.op != "call_function" or not user.args or user.args[0] is not value:
        return False
    info = op_info(user)
    return info.family is OpFamily.VIEW or info.identity_like


_SAME_VALUES = frozenset(
    [
        "view",
        "reshape",
        "_unsafe_view",
        "unsqueeze",
        "squeeze",
        "expand",
        "clone",
        "contiguous",
        "alias",
        "_to_copy",
        "to",
        "flatten",
        "permute",
        "transpose",
        "t",
        "detach",
        "lift_fresh_copy",
    ]
)
"""Ops whose output holds exactly the values of their input (rearranged, repeated or cast)."""


def _value_range(node: torch.fx.Node) -> tuple[int, int] | None:
    """``(smallest, largest)`` value of an integer tensor computed from ``arange`` by shifts and
    rearrangements alone; None when it depends on anything else (a user input, a slice)."""
    from autopar.graph import op_name

    if node.op != "call_function":
        return None
    name = op_name(node)
    args = node.args
    if name == "arange":
        ints = [a for a in args if isinstance(a, int)]
        if len(ints) != len(args) or not ints:
            return None
        start, end, step = (
            (0, ints[0], 1) if len(ints) == 1 else (ints[0], ints[1], ints[2] if len(ints) > 2 else 1)
        )
        count = max(0, -(-(end - start) // step))
        if count == 0 or step <= 0:
            return None
        return start, start + step * (count - 1)
    if (
        name in ("add", "sub")
        and len(args) == 2
        and isinstance(args[1], int)
        and isinstance(args[0], torch.fx.Node)
    ):
        r = _value_range(args[0])
        shift = args[1] if name == "add" else -args[1]
        return None if r is None else (r[0] + shift, r[1] + shift)
    if name in _SAME_VALUES and args and isinstance(args[0], torch.fx.Node):
        return _value_range(args[0])
    return None


def check_position_tables(graph: torch.fx.Graph, params: dict[str, str]) -> None:
    """Refuse a batch whose sequences are longer than the model supports: an embedding table read
    at positions the model computes itself (``arange``, not a user input) that has fewer rows
    than the largest position. Eager training would fail with ``IndexError`` on the first step;
    planning would say nothing."""
    from autopar.graph import op_name

    for n in graph.nodes:
        if n.op != "call_function" or len(n.args) < 2 or not isinstance(n.args[1], torch.fx.Node):
            continue
        if op_name(n) != "embedding" or not isinstance(n.args[0], torch.fx.Node):
            continue
        r = _value_range(n.args[1])
        rows = (
            int(n.args[0].meta["val"].shape[0])
            if isinstance(n.args[0].meta.get("val"), torch.Tensor)
            else None
        )
        if r is None or rows is None or r[1] < rows:
            continue
        table = params.get(n.args[0].name, n.args[0].name)
        raise ValueError(
            f"sequence too long for the model: its position table {table} has {rows} rows, so it supports "
            f"sequences of at most {rows} tokens, but the example batch needs positions up to {r[1]} "
            f"({r[1] + 1} tokens): use sequences of at most {rows} tokens, or configure the model with a "
            f"longer context (more rows in {table})"
        )

"""Placements: how one tensor is laid out over one mesh axis (the DTensor vocabulary).

Words used throughout autopar:

* **mesh** — the devices arranged as an N-D grid, ``mesh_shape`` (row-major, last axis innermost,
  so the last axis spans the devices that are closest together).
* **placement** — for one tensor and one mesh axis: ``Replicate`` ("R", every device on the axis
  holds the whole tensor), ``Shard(d)`` ("S(d)", the tensor is cut into equal pieces along
  dimension ``d``, device ``i`` of the axis holds piece ``i``) or ``Partial`` ("P", every device
  holds a full-size tensor and the true value is their sum).
* **spec** — a tuple with one placement per mesh axis: the layout of a tensor on the whole mesh.
  When two axes shard the same dimension, the first axis takes the outer split (as DTensor does).
* **reshard** — changing a tensor's spec between a producer and a consumer: an all-gather,
  reduce-scatter, all-reduce, all-to-all or a free local slice (see ``autopar.cost.comm``).

``Shard`` carries ``blocks``: ``Shard(d, blocks=k)`` views dimension ``d`` as ``k`` equal blocks
and shards each block separately, device ``i`` holding piece ``i`` of every block, concatenated.
This is the layout of a fused weight (GPT-2's QKV ``c_attn``, a fused gate/up projection) whose
output is later split into ``k`` parts: each part then comes out plainly sharded with no
communication, as Megatron-LM arranges its fused QKV weight. It prints as ``S(d)`` in
``Plan.param_placements`` (the user-level question is only *which dimension is split*) and as
``S(d)x3`` in the detailed plan.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "Partial",
    "Placement",
    "Replicate",
    "Shard",
    "Spec",
    "format_spec",
    "local_shape",
    "parse_placement",
    "parse_spec",
    "shard_slices",
    "spec_problem",
]


@dataclass(frozen=True, slots=True)
class Replicate:
    """Every device on the axis holds the whole tensor."""

    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True, slots=True)
class Shard:
    """Device ``i`` of the axis holds piece ``i`` of dimension ``dim`` (of each of ``blocks`` blocks)."""

    dim: int
    blocks: int = 1

    def __str__(self) -> str:
        return f"S({self.dim})" if self.blocks == 1 else f"S({self.dim})x{self.blocks}"


@dataclass(frozen=True, slots=True)
class Partial:
    """Every device holds a full-size tensor; the value is their sum."""

    def __str__(self) -> str:
        return "P"


Placement = Replicate | Shard | Partial
Spec = tuple[Placement, ...]

R = Replicate()
P = Partial()

_SHARD_RE = re.compile(r"^S\((-?\d+)\)(?:x(\d+))?$")


def parse_placement(text: str) -> Placement:
    """Parse ``"R"``, ``"P"``, ``"S(d)"`` or ``"S(d)xk"``."""
    text = text.strip()
    if text == "R":
        return R
    if text == "P":
        return P
    m = _SHARD_RE.match(text)
    if m is None:
        raise ValueError(f"cannot parse placement {text!r}: expected 'R', 'P', 'S(d)' or 'S(d)xk'")
    return Shard(int(m.group(1)), int(m.group(2) or 1))


def parse_spec(texts: Sequence[str] | str) -> Spec:
    if isinstance(texts, str):
        texts = (texts,)
    return tuple(parse_placement(t) for t in texts)


def format_spec(spec: Spec, short: bool = False) -> tuple[str, ...]:
    """One string per mesh axis; ``short`` drops the block count (``S(1)x3`` -> ``S(1)``)."""
    out = []
    for p in spec:
        if short and isinstance(p, Shard):
            out.append(f"S({p.dim})")
        else:
            out.append(str(p))
    return tuple(out)


def shard_factor(spec: Spec, mesh_shape: Sequence[int], dim: int) -> int:
    """How many pieces dimension ``dim`` is cut into under ``spec``."""
    f = 1
    for p, n in zip(spec, mesh_shape):
        if isinstance(p, Shard) and p.dim == dim:
            f *= n
    return f


def local_shape(shape: Sequence[int], spec: Spec, mesh_shape: Sequence[int]) -> tuple[int, ...]:
    """The shape each device holds. Raises ``ValueError`` when a dimension does not divide."""
    out = list(shape)
    for p, n in zip(spec, mesh_shape):
        if isinstance(p, Shard):
            if p.dim >= len(out) or out[p.dim] % (n * p.blocks) != 0:
                raise ValueError(
                    f"dimension {p.dim} of shape {tuple(shape)} does not divide into {n}x{p.blocks}"
                )
            out[p.dim] //= n
    return tuple(out)


def spec_problem(
    shape: Sequence[int],
    spec: Spec,
    mesh_shape: Sequence[int] | None = None,
    axis_names: Sequence[str] | None = None,
) -> str | None:
    """Why ``spec`` is not a layout of a tensor of ``shape`` (on ``mesh_shape``), in words with
    the arithmetic, or ``None``. Without ``mesh_shape`` only what holds on any mesh is checked:
    every sharded dimension exists."""
    shape = tuple(shape)
    for p in spec:
        if isinstance(p, Shard) and not 0 <= p.dim < len(shape):
            have = f"dimensions 0..{len(shape) - 1}" if shape else "no dimensions (a scalar)"
            return f"dimension {p.dim} does not exist: shape {shape} has {have}"
        if isinstance(p, Shard) and p.blocks < 1:
            return f"{p} has {p.blocks} blocks; a block count is at least 1"
    if mesh_shape is None:
        return None
    if len(spec) != len(mesh_shape):
        return f"{len(spec)} placement(s) for a mesh of {len(mesh_shape)} axes {tuple(mesh_shape)}"
    cur = list(shape)
    for a, (p, n) in enumerate(zip(spec, mesh_shape)):
        if not isinstance(p, Shard):
            continue
        name = f"mesh axis {a}" + (f" ({axis_names[a]})" if axis_names else "") + f" of {n} devices"
        pieces = n * p.blocks
        if cur[p.dim] % pieces:
            what = f"{n} pieces" if p.blocks == 1 else f"{p.blocks} blocks × {n} pieces = {pieces}"
            return (
                f"{p} on {name} cuts dimension {p.dim} (size {cur[p.dim]}"
                + (f" here, {shape[p.dim]} before earlier axes cut it" if cur[p.dim] != shape[p.dim] else "")
                + f") into {what}, and {cur[p.dim]} / {pieces} = {cur[p.dim] / pieces:g} is not whole: "
                f"a sharded dimension's size must divide by the devices (and blocks) it is cut into"
            )
        cur[p.dim] //= n
    return None


def divides(shape: Sequence[int], spec: Spec, mesh_shape: Sequence[int]) -> bool:
    """True when ``spec`` cuts ``shape`` into equal pieces on ``mesh_shape``."""
    cur = list(shape)
    for p, n in zip(spec, mesh_shape):
        if isinstance(p, Shard):
            if p.dim < 0 or p.dim >= len(cur) or cur[p.dim] % (n * p.blocks) != 0:
                return False
            cur[p.dim] //= n
    return True


def shard_slices(
    shape: Sequence[int], spec: Spec, mesh_shape: Sequence[int], coord: Sequence[int]
) -> list[list[tuple[int, int]]]:
    """For device ``coord``: per dimension, the list of ``(start, stop)`` ranges it holds.

    A plain shard holds one range per dimension; ``Shard(d, blocks=k)`` holds ``k`` ranges of
    dimension ``d`` that are concatenated locally. Axes are applied in order, the first axis
    taking the outer split.
    """
    ranges: list[list[tuple[int, int]]] = [[(0, s)] for s in shape]
    for p, n, c in zip(spec, mesh_shape, coord):
        if not isinstance(p, Shard):
            continue
        new = []
        for lo, hi in ranges[p.dim]:
            size = hi - lo
            block = size // p.blocks
            piece = block // n
            for b in range(p.blocks):
                start = lo + b * block + c * piece
                new.append((start, start + piece))
        ranges[p.dim] = new
    return ranges


def is_replicated(spec: Spec) -> bool:
    return all(isinstance(p, Replicate) for p in spec)

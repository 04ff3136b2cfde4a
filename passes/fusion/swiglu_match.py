"""The ``swiglu`` matcher (kernel: ``autopar.program.kernels.swiglu``): ``silu(gate) · up``."""

from __future__ import annotations

from torch.fx import Node

from autopar.ir import FusionKind
from autopar.passes.fusion.matching import (
    Match,
    is_aten,
    readers_of,
    same_tensor,
)


def match_swiglu(s: Node) -> Match | None:
    if not is_aten(s, "silu") or not isinstance(s.args[0], Node):
        return None
    rs = readers_of(s)
    if len(rs) != 1 or not is_aten(rs[0], "mul") or len(rs[0].args) != 2:
        return None
    m = rs[0]
    up = m.args[1] if m.args[0] is s else m.args[0]
    if (
        not isinstance(up, Node)
        or up is s
        or not (same_tensor(up, m) and same_tensor(s, m) and same_tensor(s.args[0], s))
    ):
        return None
    return Match(FusionKind.SWIGLU, [s, m], [s.args[0], up], [[m]], m)

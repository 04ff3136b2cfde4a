"""This rank's shards of the model's tensors: what each input of the rank's program is bound to, and
the local pieces of the parameters and buffers, cut from the full tensors as the plan lays them
out (``ParallelModule`` materializes only these; a tensor on the ``meta`` device gets an empty
local piece of the right shape).

Words: a **binding** is what one placeholder of the captured program (and so of the rank's
program, which keeps its placeholders in order) is fed: ``("param", fqn)``, ``("buffer", fqn)``,
``("input", path)`` or ``("const", name)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from autopar.capture import Captured
from autopar.placement import Replicate, Shard, Spec, local_shape, parse_spec, shard_slices
from autopar.planfile import Plan

__all__ = ["Bindings", "bind_placeholders", "get_path", "local_shard", "materialize", "set_path"]


def local_shard(
    full: torch.Tensor, spec: Spec, mesh_shape: Sequence[int], coord: Sequence[int]
) -> torch.Tensor:
    """This rank's piece of ``full`` under ``spec`` (blocks concatenated); ``full`` itself when
    ``spec`` shards nothing, else a new contiguous tensor."""
    if all(not isinstance(p, Shard) for p in spec):
        return full
    ranges = shard_slices(tuple(full.shape), spec, mesh_shape, coord)
    out = full
    for d, rs in enumerate(ranges):
        if len(rs) == 1 and rs[0] == (0, full.shape[d]):
            continue
        out = torch.cat([out.narrow(d, lo, hi - lo) for lo, hi in rs], dim=d)
    return out.contiguous()


def materialize(
    full: torch.Tensor, spec: Spec, mesh: Sequence[int], coord: Sequence[int], device: torch.device
) -> torch.Tensor:
    """This rank's piece of ``full`` on ``device``, a tensor of its own (empty where ``full`` is on
    the ``meta`` device)."""
    if full.device.type == "meta":
        return torch.empty(local_shape(tuple(full.shape), spec, mesh), dtype=full.dtype, device=device)
    return local_shard(full.detach(), spec, mesh, coord).to(device).clone()


def set_path(
    root: nn.Module, fqn: str, value: torch.Tensor, *, buffer: bool = False, persistent: bool = True
) -> None:
    """Register ``value`` at ``fqn`` under ``root``, making the modules on the way."""
    *path, last = fqn.split(".")
    mod = root
    for part in path:
        if part not in mod._modules:
            mod.add_module(part, nn.Module())
        mod = mod._modules[part]
    if buffer:
        mod.register_buffer(last, value, persistent=persistent)
    else:
        mod.register_parameter(last, value)  # type: ignore[arg-type]


def get_path(root: nn.Module, fqn: str) -> torch.Tensor:
    """The tensor at ``fqn`` under ``root``."""
    *path, last = fqn.split(".")
    mod = root
    for part in path:
        mod = mod._modules[part]
    return getattr(mod, last)


@dataclass
class Bindings:
    """What each placeholder of the program is bound to, and the plan's layout of each (module
    docstring). Keys of ``specs`` and ``shapes``: a parameter's or buffer's FQN, ``"input:" +
    path`` for a user input."""

    bindings: list[tuple[str, str]] = field(default_factory=list)
    """``(kind, key)`` of every placeholder, in order."""
    specs: dict[str, Spec] = field(default_factory=dict)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """Global shapes."""
    input_dtypes: dict[str, torch.dtype] = field(default_factory=dict)
    """``"input:" + path`` -> the dtype the program was captured with."""
    dtypes_of: dict[str, torch.dtype] = field(default_factory=dict)
    """Parameter or buffer FQN (or placeholder name) -> its dtype."""
    input_specs: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """User input path -> the spec each rank's shard of it has."""
    params: list[str] = field(default_factory=list)
    """Parameter FQNs in placeholder order, each once (tied weights: the first name)."""
    buffers: list[str] = field(default_factory=list)


def bind_placeholders(cap: Captured, plan: Plan) -> Bindings:
    """The bindings of ``cap``'s placeholders under ``plan`` (module docstring)."""
    mesh = tuple(plan.mesh_shape)
    by_name = {n.name: n for n in plan.nodes}
    b = Bindings()
    for node in cap.graph.nodes:
        if node.op != "placeholder":
            continue
        name = node.name
        spec = parse_spec(by_name[name].outputs[0]) if name in by_name else tuple(Replicate() for _ in mesh)
        val = node.meta.get("val")
        shape = tuple(val.shape) if isinstance(val, torch.Tensor) else ()
        if isinstance(val, torch.Tensor):
            b.dtypes_of[cap.params.get(name, cap.buffers.get(name, name))] = val.dtype
        if name in cap.params or name in cap.buffers:
            kind, fqn = ("param", cap.params[name]) if name in cap.params else ("buffer", cap.buffers[name])
            b.specs[fqn], b.shapes[fqn] = spec, shape
            names = b.params if kind == "param" else b.buffers
            if fqn not in names:
                names.append(fqn)
            b.bindings.append((kind, fqn))
        elif name in cap.inputs:
            path = cap.inputs[name]
            b.specs["input:" + path], b.shapes["input:" + path] = spec, shape
            b.input_specs[path] = tuple(str(p) for p in spec)
            if isinstance(val, torch.Tensor):
                b.input_dtypes["input:" + path] = val.dtype
            b.bindings.append(("input", path))
        elif name in cap.constants:
            b.bindings.append(("const", name))
        else:
            raise RuntimeError(f"placeholder {name} is neither parameter, buffer, input nor constant")
    return b

"""Device groups of a mesh laid over a cluster: the mesh numbered row-major over the cluster's first
devices, its last axis innermost, so a set of mesh axes splits the devices into groups (one per
coordinate of the other axes). ``autopar.cluster`` asks which nodes and racks a group spans;
``mesh_arithmetic`` writes a mesh's size for error messages."""

from __future__ import annotations

import math

__all__ = ["device_groups", "members_per_node", "mesh_arithmetic"]


def device_groups(mesh_shape: tuple[int, ...], axes: tuple[int, ...]) -> list[list[int]]:
    """The device groups mesh axes ``axes`` form together: each group's device numbers, the mesh
    numbered row-major over the first devices of the cluster."""
    shape = tuple(mesh_shape)
    strides = [math.prod(shape[a + 1 :]) for a in range(len(shape))]
    offsets = [0]
    for a in axes:
        offsets = [o + i * strides[a] for o in offsets for i in range(shape[a])]
    bases = [0]
    for a in (a for a in range(len(shape)) if a not in axes):
        bases = [b + i * strides[a] for b in bases for i in range(shape[a])]
    return [[b + o for o in offsets] for b in bases]


def mesh_arithmetic(mesh_shape: tuple[int, ...]) -> str:
    """``"4 × 3 = 12"`` for a 2-D mesh, ``"(16,) = 16 devices"`` for a 1-D one."""
    total = math.prod(mesh_shape)
    if len(mesh_shape) == 1:
        return f"({mesh_shape[0]},) = {total} devices"
    return " × ".join(str(n) for n in mesh_shape) + f" = {total}"


def members_per_node(devices: list[int], gpus_per_node: int) -> dict[int, int]:
    """Node -> how many of ``devices`` (cluster ranks, numbered node-major) it holds."""
    per_node: dict[int, int] = {}
    for d in devices:
        per_node[d // gpus_per_node] = per_node.get(d // gpus_per_node, 0) + 1
    return per_node

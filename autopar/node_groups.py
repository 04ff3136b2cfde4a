"""Node groups of a mixed cluster (``autopar.cluster.Cluster.node_groups``): consecutive nodes of
one device kind each, and the **floor** — the device a rank of any group is held to where ranks
work in lockstep (the slowest kind by large-matmul throughput, with the smallest memory of any).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from autopar.devices import DeviceSpec, Link, check_count, link_from_dict, link_to_dict

__all__ = ["NodeGroup", "floor_device", "matmul_rate"]


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeGroup:
    """Consecutive nodes of one device kind in a mixed cluster (``Cluster.node_groups``)."""

    device: DeviceSpec
    nodes: int
    intra_node: Link
    """The group's link between devices of one node (its NVLink generation)."""

    def __post_init__(self) -> None:
        object.__setattr__(
            self,
            "nodes",
            check_count("NodeGroup", "nodes", self.nodes, fix="give the group's number of machines"),
        )
        for what, v, cls in (("device", self.device, DeviceSpec), ("intra_node", self.intra_node, Link)):
            if not isinstance(v, cls):
                raise ValueError(f"NodeGroup: {what} must be a {cls.__name__}, got {type(v).__name__}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "device": self.device.to_dict(),
            "nodes": self.nodes,
            "intra_node": link_to_dict(self.intra_node),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> NodeGroup:
        return cls(
            device=DeviceSpec.from_dict(d["device"]),
            nodes=d["nodes"],
            intra_node=link_from_dict(d["intra_node"]),
        )


def matmul_rate(d: DeviceSpec) -> float:
    """A device's large bf16 matmul throughput (what orders device kinds by speed)."""
    return d.flops_for("bfloat16") * d.compute_efficiency


def floor_device(devices: list[DeviceSpec]) -> DeviceSpec:
    """The device a rank of any of ``devices`` is held to in lockstep (module docstring: floor):
    the slowest by large-matmul throughput, with the smallest memory of them."""
    slow = min(devices, key=matmul_rate)
    memory = min(d.memory for d in devices)
    if len({d.name for d in devices}) == 1:
        return replace(slow, memory=memory)
    return replace(
        slow, memory=memory, name=f"{slow.name} (floor of {'+'.join(dict.fromkeys(d.name for d in devices))})"
    )

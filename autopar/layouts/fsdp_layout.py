"""FSDP's layout (ZeRO-3, and HSDP's hybrid sharding) as a constrained plan (``autopar.layouts`` says
what it fixes): every parameter stored sharded and gathered whole for each use, the batch split
over every device."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.fx import Node

from autopar.audit import audited
from autopar.capture import Captured, capture
from autopar.cluster import Cluster
from autopar.config import PlanConfig
from autopar.graph import tensor_inputs
from autopar.ir import TENSOR, Strategy
from autopar.layouts.megatron_layout import from_batch
from autopar.placement import Replicate, Shard
from autopar.planfile import Plan
from autopar.planner import plan_captured

__all__ = ["fsdp"]


@audited
def fsdp(
    model: nn.Module,
    example_inputs: Any,
    cluster: Cluster,
    *,
    replicate: int = 1,
    config: PlanConfig | None = None,
    captured: Captured | None = None,
    **options: Any,
) -> Plan:
    """ZeRO-3 as PyTorch FSDP runs it (Zhao et al., VLDB 2023; Rajbhandari et al., arXiv
    1910.02054): one data-parallel axis over every device, the batch split along it, every
    parameter stored sharded along its largest dimension that divides (replicated when none
    does) and gathered whole for each use — no op reads a parameter shard — then freed and
    gathered again in backward (ZeRO stage 3), its gradient reduce-scattered.

    ``replicate``: hybrid sharding (HSDP, FSDP's ``HYBRID_SHARD``; torchtitan's
    ``data_parallel_replicate_degree``): the mesh ``(replicate, world / replicate)``, parameters
    sharded along the inner axis only (inside a node where ``world / replicate`` divides it) and
    replicated along the outer one, the batch split along both; a gradient is reduce-scattered
    inside its shard group, then all-reduced across the groups — the two-level reduction that keeps
    the gathers on the fast links.

    ``config`` (or its fields as keyword ``options``) holds the other planning options; the layout
    sets the mesh, the placements and the ZeRO stage."""
    world = cluster.world_size
    if isinstance(replicate, bool) or not isinstance(replicate, int) or replicate < 1 or world % replicate:
        raise ValueError(
            f"fsdp(replicate={replicate!r}): the replica groups must divide the {world} devices "
            f"(world = replicate × shard group size)"
        )
    shard = world // replicate
    cap = captured if captured is not None else capture(model, example_inputs)
    fixed: dict[str, tuple[str, ...]] = {}
    for name, p in model.named_parameters():
        dims = sorted(range(p.dim()), key=lambda d: -p.shape[d])
        d = next((d for d in dims if p.shape[d] % shard == 0), None)
        if d is not None and shard > 1:
            fixed[name] = ("R", f"S({d})") if replicate > 1 else (f"S({d})",)
        elif replicate > 1:
            fixed[name] = ("R", "R")
    for n in cap.user_input_nodes():  # the batch split (dimension 0), where it divides
        v = n.meta.get("val")
        if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] % world == 0:
            fixed[cap.inputs[n.name]] = ("S(0)", "S(0)") if replicate > 1 else ("S(0)",)

    batched = from_batch(cap)

    def gathered_for_use(node: Node, s: Strategy) -> bool:
        """Every parameter read whole, and the work done with it split over the devices: an op
        reading a parameter and a value computed from the batch reads that value sharded along
        every mesh axis (else
        gathering the batch and repeating the whole step on every device could price lower than
        reducing the gradients, on a small model, and the layout would not be FSDP)."""
        if node.op != "call_function":
            return True
        reads_param = False
        batch_specs = []
        for i, spec in zip(tensor_inputs(node), s.inputs):
            if spec is None:
                continue
            if i.meta[TENSOR].kind == "param":
                if not all(isinstance(p, Replicate) for p in spec):
                    return False
                reads_param = True
            elif i in batched:
                batch_specs.append(spec)
        return not (reads_param and batch_specs) or all(
            any(isinstance(sp[a], Shard) for sp in batch_specs) for a in range(len(batch_specs[0]))
        )

    config = PlanConfig.build(config, **options)
    return plan_captured(
        cap,
        cluster,
        config.with_fixed(fixed).replace(
            mesh_shape=(replicate, shard) if replicate > 1 else (world,), zero_stage=3
        ),
        node_constraint=gathered_for_use,
        layout=f"fsdp(dp={world})" if replicate == 1 else f"hsdp(replicate={replicate}, shard={shard})",
    )

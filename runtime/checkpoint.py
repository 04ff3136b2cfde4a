"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP) that resume under another plan.

Words:

* **canonical layout** — how a tensor is stored in a checkpoint: split along its first dimension
  that divides evenly over all ranks (``S(d)`` on every mesh axis, the first axis taking the
  outer split), replicated when none does. It is a plain ``DTensor`` layout, independent of the
  plan that trained the model; block-sharded weights (a fused QKV's ``S(0)x3``, which no DTensor
  placement expresses) are stored the same way.
* **save** — each rank reshards its parameters, buffers and optimizer state from the plan's
  layout to the canonical one with the program's collectives (``run_reshard``) and hands DCP
  ``DTensor`` views of its piece: every rank writes only its piece, nothing is gathered whole.
* **load** — the module (under any plan, mesh or world size) asks DCP for its own canonical
  pieces (DCP reads the overlapping parts of what was saved) and reshards them to its plan.

Optimizer state follows the parameters: a state tensor shaped like its parameter is stored in
the parameter's canonical layout (AdamW's moments), others (AdamW's ``step``) replicated.

A pipelined module (``plan.pipeline``) holds on each rank only the parameters its stages read,
laid out on its stage's mesh: each rank hands DCP DTensors on that mesh (the stage's devices at
this rank's pipeline coordinate), keyed by the model's own names, so the ranks of each stage write
their stage's pieces and nothing is gathered across stages; a weight two stages share (a tied
embedding and head) is written once (DCP keeps one copy of identical pieces). Loading works the
same way under any pipeline shape: a rank asks for what its stages hold, wherever it was saved.

Usage::

    dcp.save(pm.state_dict(optimizer=opt), checkpoint_id=path)       # or autopar.runtime.checkpoint.save
    sd = pm.state_dict(optimizer=opt)                                 # under the new plan
    dcp.load(sd, checkpoint_id=path)
    pm.load_state_dict(sd, optimizer=opt)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from autopar.placement import Replicate, Shard, Spec
from autopar.program.collectives import run_reshard

__all__ = ["canonical_spec", "load", "save"]

MODEL = "model."
OPTIM = "optim."


def canonical_spec(shape: Sequence[int], mesh_shape: Sequence[int]) -> Spec:
    """The canonical layout of a tensor of ``shape`` (see module docstring)."""
    world = math.prod(mesh_shape)
    for d, n in enumerate(shape):
        if n % world == 0 and n >= world:
            return tuple(Shard(d) for _ in mesh_shape)
    return tuple(Replicate() for _ in mesh_shape)


def _placements(spec: Spec) -> list[Any]:
    from torch.distributed.tensor import Replicate as DReplicate
    from torch.distributed.tensor import Shard as DShard

    return [DShard(p.dim) if isinstance(p, Shard) else DReplicate() for p in spec]


def stage_mesh(pm: Any) -> Any:
    """The ``DeviceMesh`` a checkpoint's DTensors of ``pm`` live on: its mesh, or for a pipelined
    module its stage's (the stage axes' groups over the ranks at this rank's pipeline coordinate,
    ranks numbered as ``autopar.runtime.world.mesh_axes`` lays out ``(pp, *stage mesh)``). Made
    from the existing groups: no collective."""
    if pm.pipeline is None:
        return pm.device_mesh
    from torch.distributed.device_mesh import DeviceMesh

    runner = pm.pipeline
    ranks = torch.arange(runner.pp.size * math.prod(pm._mesh)).reshape(runner.pp.size, *pm._mesh)
    return DeviceMesh.from_group(
        [ax.group for ax in pm.axes],
        pm.device.type,
        mesh=ranks[runner.pp.coord],
        mesh_dim_names=tuple(ax.name for ax in pm.axes),
    )


def to_canonical(pm: Any, local: torch.Tensor, shape: tuple[int, ...], spec: Spec, mesh: Any = None) -> Any:
    """A ``DTensor`` of this rank's canonical piece of a tensor held as ``spec``, on ``mesh``
    (default ``stage_mesh(pm)``)."""
    from torch.distributed.tensor import DTensor

    canon = canonical_spec(shape, pm._mesh)
    piece = run_reshard(local.detach(), shape, spec, canon, pm.axes).contiguous()
    stride = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
    return DTensor.from_local(
        piece,
        mesh if mesh is not None else stage_mesh(pm),
        _placements(canon),
        run_check=False,
        shape=torch.Size(shape),
        stride=stride,
    )


def from_canonical(pm: Any, dt: Any, shape: tuple[int, ...], spec: Spec) -> torch.Tensor:
    """This rank's local tensor under ``spec``, from its canonical piece ``dt``."""
    canon = canonical_spec(shape, pm._mesh)
    return run_reshard(dt.to_local(), shape, canon, spec, pm.axes)


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Give every parameter its optimizer state (as a first step does), so a checkpoint has
    tensors to load into: one step with zero gradients and a learning rate of zero, after which
    the loaded state replaces everything it touched."""
    if any(optimizer.state.get(p) for g in optimizer.param_groups for p in g["params"]):
        return
    saved_lr = [g["lr"] for g in optimizer.param_groups]
    saved_grads = []
    for g in optimizer.param_groups:
        g["lr"] = 0.0
        for p in g["params"]:
            saved_grads.append(p.grad)
            p.grad = torch.zeros_like(p)
    with torch.no_grad():
        optimizer.step()
    i = 0
    for g, lr in zip(optimizer.param_groups, saved_lr):
        g["lr"] = lr
        for p in g["params"]:
            p.grad = saved_grads[i]
            i += 1


def _device_param(optimizer: torch.optim.Optimizer, p: torch.Tensor) -> torch.Tensor:
    """The module parameter an optimizer's parameter stands for: itself, or the device parameter
    of a host master (``autopar.runtime.host_optimizer.HostOffloadOptimizer.device_param``)."""
    of = getattr(optimizer, "device_param", None)
    return of(p) if of is not None else p


def state_dict(pm: Any, optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """``pm``'s parameters, persistent buffers and ``optimizer``'s state as canonical DTensors."""
    out: dict[str, Any] = {}
    mesh = stage_mesh(pm)
    with torch.no_grad():
        for fqn in pm._state_fqns():
            local = pm._local(fqn)
            out[MODEL + fqn] = to_canonical(pm, local, pm._shapes[fqn], pm._specs[fqn], mesh)
        if optimizer is not None:
            init_optimizer_state(optimizer)
            names = {id(p): fqn for fqn, p in pm.named_local_parameters().items()}
            for g in optimizer.param_groups:
                for p in g["params"]:
                    fqn = names.get(id(_device_param(optimizer, p)))
                    if fqn is None:
                        raise ValueError("the optimizer holds a parameter that is not this module's")
                    for k, v in optimizer.state.get(p, {}).items():
                        key = f"{OPTIM}{fqn}.{k}"
                        if isinstance(v, torch.Tensor) and tuple(v.shape) == tuple(p.shape):
                            out[key] = to_canonical(pm, v, pm._shapes[fqn], pm._specs[fqn], mesh)
                        else:
                            out[key] = v.detach().clone() if isinstance(v, torch.Tensor) else v
    return out


def load_state_dict(pm: Any, sd: dict[str, Any], optimizer: torch.optim.Optimizer | None = None) -> None:
    """Copy a loaded canonical state (from ``state_dict`` then ``dcp.load``) into ``pm``'s shards
    and ``optimizer``'s state."""
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        for fqn in pm._state_fqns():
            dt = sd[MODEL + fqn]
            pm._local(fqn).copy_(from_canonical(pm, dt, pm._shapes[fqn], pm._specs[fqn]))
        if optimizer is not None:
            names = {id(p): fqn for fqn, p in pm.named_local_parameters().items()}
            for g in optimizer.param_groups:
                for p in g["params"]:
                    fqn = names[id(_device_param(optimizer, p))]
                    state = optimizer.state[p]
                    for k in list(state):
                        v = sd[f"{OPTIM}{fqn}.{k}"]
                        if isinstance(v, DTensor):
                            state[k] = from_canonical(pm, v, pm._shapes[fqn], pm._specs[fqn]).clone()
                        elif isinstance(v, torch.Tensor):
                            state[k] = v.to(state[k].device) if isinstance(state[k], torch.Tensor) else v
                        else:
                            state[k] = v
            refresh = getattr(optimizer, "masters_from_device", None)
            if refresh is not None:  # host copies of the weights just loaded (runtime.host_optimizer)
                refresh()


def save(pm: Any, checkpoint_id: str, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Write ``pm`` (and ``optimizer``) to ``checkpoint_id`` with DCP; every rank calls it."""
    import torch.distributed.checkpoint as dcp

    dcp.save(state_dict(pm, optimizer), checkpoint_id=checkpoint_id)


def load(pm: Any, checkpoint_id: str, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Read ``checkpoint_id`` into ``pm`` (and ``optimizer``) under ``pm``'s plan, whatever plan,
    mesh or world size wrote it; every rank calls it."""
    import torch.distributed.checkpoint as dcp

    sd = state_dict(pm, optimizer)
    dcp.load(sd, checkpoint_id=checkpoint_id)
    load_state_dict(pm, sd, optimizer)
    if dist.is_initialized():
        dist.barrier()

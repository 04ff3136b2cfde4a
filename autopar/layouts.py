"""Hand-written layouts as constrained plans: the baselines autopar is compared against.

``megatron`` fixes the weights to Megatron-LM's tensor-parallel pattern (Shoeybi et al., arXiv
1909.08053 §3) and lets the solver place everything else, so the result is a point of the same
search space ``autopar.plan`` explores — the auto plan can only match or beat it.

The pattern is recognised by structure, not by names. Walking the graph in order, every matmul
whose weight is a parameter is

* **row-parallel** (weight split along its input features, output ``Partial``, one all-reduce
  after it) when every nearest upstream parameter matmul is column-parallel and the path from
  them passes no normalization — the second matmul of an MLP, the attention output projection;
* **column-parallel** (weight split along its output features) otherwise — QKV, MLP up/gate, and
  the LM head, which is thereby vocabulary-parallel.

Embedding tables are vocabulary-parallel (split along rows). GPT-2's ``Conv1D`` stores weights as
``[in, out]`` (``addmm``), ``nn.Linear`` as ``[out, in]`` (``linear``): the split dimension follows
the op, so both come out right. Weights are used where they lie (never gathered). With
``sequence_parallel=True`` normalizations and the residual additions after row-parallel layers run
split along the sequence on the tensor axis (Korthikanti et al., arXiv 2205.05198); without it they
run replicated there, as in the original Megatron-LM.

Mixture-of-experts layers (``autopar.rules.routing``) get Megatron-LM's expert parallelism: their
experts split by expert over an ``ep`` axis carved out of the data-parallel ranks (expert tensor
parallel size 1). The **distributed optimizer** (Megatron-LM's ``--use-distributed-optimizer``)
splits each weight's optimizer state over its **data-parallel ranks** — the ranks that hold the
same slice of it and run different tokens: ``dp / ep`` and ``ep`` for dense weights, ``dp / ep``
and ``tp`` for experts. ``best_megatron`` tunes these knobs with the others (its docstring says
how the search is pruned).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.fx import Node

from autopar.audit import audited
from autopar.capture import Captured, capture
from autopar.cluster import Cluster
from autopar.config import PlanConfig
from autopar.cost.compute import itemsize
from autopar.cost.memory import StateBytes, state_bytes_per_param
from autopar.graph import OpFamily, op_family, op_info, op_name, tensor_inputs
from autopar.ir import TENSOR, Strategy
from autopar.microbatch import MicrobatchCaptures
from autopar.passes import PassContext, run_passes
from autopar.passes.annotate import annotate_tensors
from autopar.placement import Partial, Replicate, Shard
from autopar.planfile import Plan
from autopar.planner import InfeasibleError, plan_captured
from autopar.rules.routing import grouped_mm_operands, moe_regions

__all__ = [
    "KNOBS",
    "best_megatron",
    "expert_weights",
    "fsdp",
    "megatron",
    "megatron_mesh",
    "megatron_static_bytes",
    "megatron_weight_roles",
]

log = logging.getLogger("autopar.layouts")


def _is_weight_matmul(node: Node) -> bool:
    """A matmul a weight can enter as a plain matrix (``bmm``/``baddbmm`` take batched operands)."""
    return op_family(node) is OpFamily.MATMUL and op_name(node) not in ("bmm", "baddbmm")


def _is_norm(node: Node) -> bool:
    """A normalization on the path: layer/RMS/group/batch norm, or an RMSNorm written out (rsqrt)."""
    return op_family(node) in (OpFamily.NORM, OpFamily.BATCH_NORM) or op_name(node) == "rsqrt"


def _weight_of(node: Node) -> tuple[Node | None, Node | None, int, int]:
    """(weight, bias, out-feature dim, in-feature dim) of a matmul with a parameter weight."""
    name = op_name(node)
    a = node.args
    if name == "linear":
        w, b, out_d, in_d = a[1], (a[2] if len(a) > 2 else None), 0, 1
    elif name == "addmm":
        w, b, out_d, in_d = a[2], a[0], 1, 0
    else:
        w, b, out_d, in_d = a[1], None, 1, 0
        if isinstance(w, Node) and _is_transpose_2d(w):
            # ``x @ self.weight.T`` (transformers' Falcon): an ``[out, in]`` weight read transposed.
            w, out_d, in_d = w.args[0], 0, 1
    info = w.meta.get(TENSOR) if isinstance(w, Node) else None
    if info is None or info.kind != "param" or len(info.shape) != 2:
        return None, None, 0, 0
    binfo = b.meta.get(TENSOR) if isinstance(b, Node) else None
    return w, (b if binfo is not None and binfo.kind == "param" else None), out_d, in_d


def _is_transpose_2d(node: Node) -> bool:
    """``t``, ``transpose`` or ``permute`` swapping the two dimensions of a matrix."""
    if node.op != "call_function" or not isinstance(node.args[0], Node):
        return False
    val = node.args[0].meta.get("val")
    if val is None or val.dim() != 2:
        return False
    name = op_name(node)
    return name in ("t", "transpose", "swapaxes", "swapdims", "numpy_T", "mT") or (
        name == "permute" and list(node.args[1]) in ([1, 0], [-1, -2])
    )


def fsdp(
    model: nn.Module,
    example_inputs: Any,
    cluster: Cluster,
    *,
    config: PlanConfig | None = None,
    captured: Captured | None = None,
    **options: Any,
) -> Plan:
    """ZeRO-3 as PyTorch FSDP runs it (Zhao et al., VLDB 2023; Rajbhandari et al., arXiv
    1910.02054): one data-parallel axis over every device, the batch split along it, every
    parameter stored sharded along its largest dimension that divides (replicated when none
    does) and gathered whole for each use — no op reads a parameter shard — then freed and
    gathered again in backward (ZeRO stage 3), its gradient reduce-scattered.

    ``config`` (or its fields as keyword ``options``) holds the other planning options; the layout
    sets the mesh, the placements and the ZeRO stage."""
    world = cluster.world_size
    cap = captured if captured is not None else capture(model, example_inputs)
    fixed: dict[str, tuple[str, ...]] = {}
    for name, p in model.named_parameters():
        dims = sorted(range(p.dim()), key=lambda d: -p.shape[d])
        d = next((d for d in dims if p.shape[d] % world == 0), None)
        if d is not None:
            fixed[name] = (f"S({d})",)
    for n in cap.user_input_nodes():  # the batch split (dimension 0), where it divides
        v = n.meta.get("val")
        if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] % world == 0:
            fixed[cap.inputs[n.name]] = ("S(0)",)

    def gathered_for_use(node: Node, s: Strategy) -> bool:
        return node.op != "call_function" or all(
            spec is None or i.meta[TENSOR].kind != "param" or all(isinstance(p, Replicate) for p in spec)
            for i, spec in zip(tensor_inputs(node), s.inputs)
        )

    config = PlanConfig.build(config, **options)
    return plan_captured(
        cap,
        cluster,
        config.with_fixed(fixed).replace(mesh_shape=(world,), zero_stage=3),
        node_constraint=gathered_for_use,
        layout=f"fsdp(dp={world})",
    )


def megatron_weight_roles(graph: torch.fx.Graph) -> dict[str, str]:
    """``{param_fqn: "col" | "row" | "col_bias" | "vocab"}`` by the structural rule above."""
    role_of_matmul: dict[Node, str] = {}
    # For each node: set of nearest upstream param-matmuls, and whether a norm lies on the way.
    upstream: dict[Node, tuple[frozenset, bool]] = {}
    roles: dict[str, str] = {}
    for n in graph.nodes:
        if n.op != "call_function":
            upstream[n] = (frozenset(), False)
            continue
        ups: set[Node] = set()
        norm = False
        for i in n.all_input_nodes:
            u, nm = upstream.get(i, (frozenset(), False))
            ups |= u
            norm |= nm
        name = op_name(n)
        if _is_norm(n):
            norm = True
        w, b, out_d, in_d = _weight_of(n) if _is_weight_matmul(n) else (None, None, 0, 0)
        if w is not None:
            x = n.args[1] if name == "addmm" else n.args[0]
            xu, xnorm = upstream.get(x, (frozenset(), False))
            is_row = bool(xu) and not xnorm and all(role_of_matmul.get(m) == "col" for m in xu)
            role = "row" if is_row else "col"
            role_of_matmul[n] = role
            fqn = w.meta[TENSOR].fqn
            roles[fqn] = f"{role}:{out_d if role == 'col' else in_d}"
            if b is not None:
                roles[b.meta[TENSOR].fqn] = "col_bias" if role == "col" else "row_bias"
            upstream[n] = (frozenset({n}), False)
            continue
        if name == "embedding":
            w = n.args[0]
            info = w.meta.get(TENSOR) if isinstance(w, Node) else None
            if info is not None and info.kind == "param" and info.fqn not in roles:
                # Position embeddings (indexed by positions, not tokens) stay to the solver.
                idx = n.args[1]
                iinfo = idx.meta.get(TENSOR) if isinstance(idx, Node) else None
                if iinfo is not None and iinfo.kind == "input":
                    roles[info.fqn] = "vocab"
        upstream[n] = (frozenset(ups), norm)
    return roles


def megatron_mesh(dp: int, tp: int, ep: int = 1) -> tuple[tuple[int, ...], tuple[str, ...], dict[str, int]]:
    """``(mesh, axis names, {name: axis})`` of the Megatron layout with data-parallel size ``dp``,
    tensor-parallel size ``tp`` and expert-parallel size ``ep`` (module docstring of ``megatron``):
    ``(dp, tp)`` (``(tp,)`` when ``dp == 1``) or, with ``ep > 1``, ``(dp / ep, ep, tp)`` without
    its axes of size 1."""
    if ep > 1:
        kept = [(name, n) for name, n in (("dp", dp // ep), ("ep", ep), ("tp", tp)) if n > 1]
    else:
        kept = [("dp", dp), ("tp", tp)] if dp > 1 else [("tp", tp)]
    names = tuple(name for name, _ in kept)
    return tuple(n for _, n in kept), names, {name: a for a, name in enumerate(names)}


@audited
def megatron(
    model: nn.Module,
    example_inputs: Any,
    cluster: Cluster,
    tp: int,
    dp: int | None = None,
    sequence_parallel: bool = False,
    *,
    ep: int = 1,
    pp: int = 1,
    microbatches: int | None = None,
    schedule: str = "1f1b",
    virtual: int = 1,
    distributed_optimizer: bool = False,
    config: PlanConfig | None = None,
    captured: Captured | None = None,
    **options: Any,
) -> Plan:
    """The Megatron-LM layout with tensor-parallel size ``tp``, data-parallel size ``dp`` and
    expert-parallel size ``ep``.

    ``dp`` defaults to ``world_size / tp``. The mesh is ``(dp, tp)`` (``(tp,)`` when ``dp == 1``),
    the tensor axis innermost so it stays inside a node. With ``ep > 1`` (which must divide
    ``dp``: Megatron-LM carves the expert-parallel group out of the data-parallel one) the mesh is
    ``(dp / ep, ep, tp)`` (axes of size 1 dropped): every mixture-of-experts region
    (``autopar.rules.routing``) keeps its experts' weights split by expert along ``ep`` and used
    where they lie, so its tokens are dispatched to them and combined back by all-to-all;
    attention and the rest are data-parallel along ``ep``, as in Megatron-LM. Experts are not
    split along ``tp`` (expert tensor parallel size 1, Megatron-Core's
    ``expert_tensor_parallel_size=1``; the regions' modes cannot split an expert's own matmuls,
    so ``etp = tp`` is not expressible): each ``tp`` rank runs whole experts on the tokens it
    routes. The plan's axes are named ``dp``, ``ep``, ``tp`` after the layout.

    ``distributed_optimizer``: Megatron-LM's ``--use-distributed-optimizer`` (docs
    ``api-guide/dist_optimizer``): every parameter's optimizer state is split over its
    data-parallel ranks — ``dp / ep`` and ``ep`` for the dense weights, ``dp / ep`` and ``tp`` for
    the experts (their data-parallel group, ``tp · dp / ep`` ranks with expert tensor parallel
    size 1) — its gradients accumulated whole over the micro-batches and reduce-scattered once
    per step, its weights all-gathered once after the step. Planned as ZeRO stage 1 on those axes
    (``autopar.cost.memory``: Megatron's full-size gradient buffer; ``autopar.cost.reshard``: the
    reduce-scatter and all-gather, once per step in ``autopar.simulate``). Weights are still read
    whole on those axes (gathered), never split there.

    ``config`` (or its fields as keyword ``options``, e.g. ``memory_budget``) holds the other
    planning options; the layout sets the mesh and fixes the weights. ``captured``: the model
    already captured on ``example_inputs`` (with ``pp > 1``: on one micro-batch of them).

    With ``pp > 1`` the model is cut into ``pp · virtual`` pipeline stages as Megatron-LM cuts it:
    equal numbers of repeated layers per stage, the embedding with the first and the head with the
    last (``autopar.passes.stages.layer_cuts``; autopar's own plans balance the stages' cost
    instead), each stage laid out as above on ``world / pp`` devices, ``microbatches``
    micro-batches (default ``pp``) run under ``schedule`` (``autopar.schedule``). With ``pp = 1``
    and ``microbatches > 1``: gradient accumulation, Megatron-LM's ``--micro-batch-size`` below
    the per-rank batch (the micro-batches one after another, gradients reduced once).
    """
    if pp > 1 or (microbatches or 1) > 1:
        ((_, _, got),) = _megatron_pipelined(
            model, example_inputs, cluster, tp, dp, sequence_parallel, ep=ep, pp=pp,
            microbatches=microbatches or pp, schedules=[(schedule, virtual)],
            distributed_optimizer=distributed_optimizer, config=PlanConfig.build(config, **options),
            captured=captured,
        )  # fmt: skip
        if isinstance(got, str):
            raise InfeasibleError(got)
        return got
    world = cluster.world_size
    if dp is None:
        if world % tp:
            raise ValueError(f"tp={tp} does not divide the world size {world}")
        dp = world // tp
    if dp * tp != world:
        raise ValueError(f"tp({tp}) × dp({dp}) = {tp * dp} ≠ world size {world}")
    if ep < 1 or dp % ep:
        raise ValueError(
            f"ep={ep} must divide dp={dp} (the expert-parallel group lies inside the data-parallel one)"
        )
    config = PlanConfig.build(config, **options)
    cap = captured if captured is not None else capture(model, example_inputs)
    ctx = PassContext(captured=cap, cluster=cluster, config=config)
    run_passes(cap.gm, ctx, [annotate_tensors])
    roles = megatron_weight_roles(cap.gm.graph)
    experts = expert_weights(cap.gm.graph)
    if ep > 1 and not experts:
        raise ValueError(f"ep={ep}, but the model has no mixture-of-experts layer autopar recognises")
    for fqn, n in experts.items():
        if n % ep:
            raise ValueError(f"ep={ep} does not divide the {n} experts of {fqn}")
    if tp > 1:
        _check_tp_divides(cap.gm.graph, roles, tp, world)
    mesh, axis_names, axis = megatron_mesh(dp, tp, ep)
    t_axis = axis.get("tp")
    e_axis = axis.get("ep")
    fixed: dict[str, tuple[str, ...]] = {}
    split_dims: dict[str, set[int]] = {}
    for fqn, role in roles.items():
        if role.startswith(("col:", "row:")):
            tp_p = f"S({role.split(':')[1]})"
        elif role in ("col_bias", "vocab"):
            tp_p = "S(0)"
        else:  # row_bias
            tp_p = "R"
        spec = ["R"] * len(mesh)
        if t_axis is not None:
            spec[t_axis] = tp_p
        fixed[fqn] = tuple(spec)
        split_dims[fqn] = (
            {int(tp_p[2:-1])} if tp_p != "R" and t_axis is not None and mesh[t_axis] > 1 else set()
        )
    for fqn in experts:  # split by expert along ep; whole everywhere else (expert TP size 1)
        spec = ["R"] * len(mesh)
        if e_axis is not None:
            spec[e_axis] = "S(0)"
        fixed[fqn] = tuple(spec)
        split_dims[fqn] = {0}
    # Data-parallel axes of each parameter: what its optimizer state is split over under the
    # distributed optimizer, and where it is read whole.
    data_axes: dict[str, tuple[int, ...]] = {}
    flat_state: dict[str, tuple[int, ...]] = {}
    if distributed_optimizer:
        for n in cap.gm.graph.nodes:
            info = n.meta.get(TENSOR)
            if n.op != "placeholder" or info is None or info.kind != "param" or not info.requires_grad:
                continue
            own = (axis.get("dp"), t_axis if info.fqn in experts else e_axis)
            data_axes[info.fqn] = tuple(a for a in own if a is not None and mesh[a] > 1)
            spec = list(fixed.get(info.fqn, ("R",) * len(mesh)))
            fixed[info.fqn] = _distributed_optimizer_spec(
                info.shape, spec, split_dims.get(info.fqn, set()), data_axes[info.fqn], mesh
            )
            # Axes no dimension divides: Megatron shards the flat buffer there all the same.
            whole = tuple(a for a in data_axes[info.fqn] if fixed[info.fqn][a] == "R")
            if whole:
                flat_state[info.fqn] = whole
        config = config.replace(zero_stage=1, state_split=flat_state)
    used_where_they_lie = [a for a in (t_axis, e_axis) if a is not None]
    residual = residual_adds(cap.gm.graph, roles)
    # Grouped matmuls read their experts' weights through views (transformers transposes them):
    # each must run over its own device's experts along ep.
    expert_mms = {
        e: tensor_inputs(e).index(grouped_mm_operands(e)[1])
        for r in moe_regions(cap.gm.graph)
        for e in r.experts
    }

    def megatron_execution(node: Node, s: Strategy) -> bool:
        """Weights are used where they lie (no gathering), read whole on their data-parallel axes
        under the distributed optimizer; norms as Megatron runs them."""
        if node.op != "call_function":
            return True
        if node in expert_mms:
            for a, got in enumerate(s.inputs[expert_mms[node]]):
                if a == e_axis and not (isinstance(got, Shard) and got.dim == 0):
                    return False
                if a != e_axis and not isinstance(got, Replicate):
                    return False
        for j, i in enumerate(tensor_inputs(node)):
            info = i.meta.get(TENSOR)
            if info is None or info.kind != "param" or info.fqn not in fixed or s.inputs[j] is None:
                continue
            for a in used_where_they_lie:
                want, got = fixed[info.fqn][a], s.inputs[j][a]
                if want == "R" and not isinstance(got, (Replicate, Partial)):
                    return False
                if want != "R" and not (isinstance(got, Shard) and f"S({got.dim})" == want):
                    return False
            if any(not isinstance(s.inputs[j][a], Replicate) for a in data_axes.get(info.fqn, ())):
                return False
        is_norm = op_family(node) is OpFamily.NORM or (op_name(node) == "mean" and _is_rms_mean(node))
        if t_axis is None or (not is_norm and node not in residual):
            return True
        p = s.outputs[0][t_axis]
        if sequence_parallel:
            return isinstance(p, Shard) and p.dim == 1
        return isinstance(p, Replicate)

    knobs = [f"tp={tp}", f"dp={dp}"] + [f"ep={ep}"] * (ep > 1)
    knobs += ["sequence_parallel"] * sequence_parallel + ["distributed optimizer"] * distributed_optimizer
    plan = plan_captured(
        cap,
        cluster,
        config.with_fixed(fixed).replace(mesh_shape=mesh),
        node_constraint=megatron_execution,
        layout=f"megatron({', '.join(knobs)})",
    )
    plan.mesh_axes = axis_names
    if flat_state:
        plan.info["state_split"] = {fqn: math.prod(mesh[a] for a in axes) for fqn, axes in flat_state.items()}
    return plan


def _check_tp_divides(graph: torch.fx.Graph, roles: dict[str, str], tp: int, world: int) -> None:
    """Raise, before any planning, where tensor parallelism cannot split a weight Megatron-LM
    splits: the dimension it cuts must divide by ``tp``. Names every such weight with its
    arithmetic and the tensor-parallel sizes that would divide them all."""
    shapes = {
        n.meta[TENSOR].fqn: n.meta[TENSOR].shape
        for n in graph.nodes
        if n.op == "placeholder" and n.meta.get(TENSOR) is not None and n.meta[TENSOR].kind == "param"
    }
    split: dict[str, tuple[int, int]] = {}  # fqn -> (dim, size)
    for fqn, role in roles.items():
        if fqn not in shapes or role == "row_bias":
            continue
        d = int(role.split(":")[1]) if role.startswith(("col:", "row:")) else 0
        split[fqn] = (d, shapes[fqn][d])
    bad = {fqn: ds for fqn, ds in split.items() if ds[1] % tp}
    if not bad:
        return
    sizes = sorted({size for _, size in split.values()})
    fits = [t for t in range(1, world + 1) if world % t == 0 and all(size % t == 0 for size in sizes)]
    shown = [
        f"{fqn} {shapes[fqn]}: dimension {d} = {size}, {size} / {tp} = {size / tp:g}"
        for fqn, (d, size) in bad.items()
    ]
    more = f" (and {len(shown) - 4} more)" if len(shown) > 4 else ""
    raise ValueError(
        f"megatron(tp={tp}): tensor parallelism splits each column-parallel weight's output dimension, each "
        f"row-parallel weight's input dimension and the vocabulary into tp={tp} pieces, and {len(bad)} "
        f"weight(s) have a size that does not divide by {tp}: {'; '.join(shown[:4])}{more}. The sizes "
        f"tensor parallelism splits here are {sizes}; tp must divide all of them: tp in {fits} would "
        f"(on {world} devices), or change the model's hidden, head or vocabulary sizes to multiples of {tp}"
    )


def _distributed_optimizer_spec(
    shape: tuple[int, ...],
    spec: list[str],
    split: set[int],
    data_axes: tuple[int, ...],
    mesh: tuple[int, ...],
) -> tuple[str, ...]:
    """``spec`` (a parameter's tensor/expert-parallel placement) with its storage split along each
    of ``data_axes`` too, each on the largest dimension not split yet that divides evenly (``R``
    on an axis where none does: that axis keeps whole copies of the state)."""
    local = list(shape)
    for a, p in enumerate(spec):
        if p != "R":
            local[int(p[2:-1])] //= mesh[a]
    taken = set(split)
    for a in data_axes:
        dims = [d for d in range(len(local)) if d not in taken and local[d] % mesh[a] == 0]
        if dims:
            d = max(dims, key=lambda d: local[d])
            spec[a] = f"S({d})"
            local[d] //= mesh[a]
            taken.add(d)
    return tuple(spec)


def expert_weights(graph: torch.fx.Graph) -> dict[str, int]:
    """``{param_fqn: number of experts}`` for the experts' weights of every mixture-of-experts
    region (``autopar.rules.routing.moe_regions``): a grouped matmul's weight, followed back
    through views and casts to its parameter, whose dimension 0 is the experts."""
    out = {}
    for region in moe_regions(graph):
        for e in region.experts:
            w = grouped_mm_operands(e)[1]
            while w.op == "call_function" and (op_family(w) is OpFamily.VIEW or op_info(w).identity_like):
                w = w.args[0]
            info = w.meta.get(TENSOR)
            if info is not None and info.kind == "param" and info.shape[0] == region.num_experts:
                out[info.fqn] = region.num_experts
    return out


def residual_adds(graph: torch.fx.Graph, roles: dict[str, str]) -> set[Node]:
    """The additions that put a row-parallel matmul's output back into the residual stream.

    From each row-parallel matmul, follow single-use views, casts and dropouts to the first
    ``add``. Megatron-LM all-reduces right before it (or, with sequence parallelism,
    reduce-scatters), so the residual stream is replicated (sequence-split) on the tensor axis.
    """
    out: set[Node] = set()
    for n in graph.nodes:
        if not _is_weight_matmul(n):
            continue
        w, _, _, _ = _weight_of(n)
        if w is None or not roles.get(w.meta[TENSOR].fqn, "").startswith("row"):
            continue
        v = n
        while len(v.users) == 1:
            (u,) = v.users
            if u.op != "call_function":
                break
            if op_name(u) == "add":
                out.add(u)
                break
            if not op_info(u).identity_like:
                break
            v = u
    return out


def _is_rms_mean(node: Node) -> bool:
    """The mean of an RMSNorm: over the last dim of a pow(x, 2)."""
    src = node.args[0]
    return isinstance(src, Node) and op_name(src) == "pow"


def _megatron_pipelined(
    model: nn.Module,
    example_inputs: Any,
    cluster: Cluster,
    tp: int,
    dp: int | None,
    sequence_parallel: bool,
    *,
    ep: int,
    pp: int,
    microbatches: int,
    schedules: Sequence[tuple[str, int]],
    distributed_optimizer: bool,
    config: PlanConfig,
    captured: Captured | None,
) -> list[tuple[str, int, Plan | str]]:
    """``megatron`` with pipeline stages (see its docstring): one stage plan, then every
    ``(schedule, virtual)`` of ``schedules`` played around it — the plan, or why it does not fit."""
    from autopar.search import pipelined_candidates, stage_cluster

    sub = stage_cluster(cluster, pp)
    if sub is None:
        raise ValueError(
            f"pp={pp} does not cut {cluster.nodes} node(s) × {cluster.gpus_per_node} devices into equal stages"
        )
    if captured is None:
        captured = MicrobatchCaptures(model, example_inputs)(microbatches)
    budget = config.budget(cluster.device.memory)
    stage = megatron(
        model, None, sub, tp, dp, sequence_parallel, ep=ep, distributed_optimizer=distributed_optimizer,
        config=config.replace(memory_budget=budget * pp, mesh_shape=None, fixed={}), captured=captured,
    )  # fmt: skip
    out: list[tuple[str, int, Plan | str]] = []
    for schedule, virtual in schedules:
        label = f"pp={pp}, m={microbatches}, {schedule}{f', v={virtual}' if virtual > 1 else ''}"
        why: list[str] = []
        found = pipelined_candidates(
            stage,
            captured.gm,
            cluster,
            config.replace(schedule=schedule, virtual=virtual),
            pp,
            microbatches,
            budget,
            by_layers=True,
            why=why,
        )
        if not found:
            reasons = "; ".join(w.split(": ", 1)[-1] for w in why) or "no candidate"
            out.append((schedule, virtual, f"megatron(tp={tp}, {label}): {reasons}"))
            continue
        plan = found[0].plan
        plan.info["layout"] = stage.info.get("layout", "megatron").replace(
            "megatron(", f"megatron({label}, ", 1
        )
        plan.cluster = cluster.to_dict()
        plan.info["cluster_desc"] = cluster.describe()
        out.append((schedule, virtual, plan))
    return out


def megatron_static_bytes(
    params: Sequence[tuple[str, int, int, bool]],
    roles: dict[str, str],
    experts: dict[str, int],
    *,
    tp: int,
    dp: int,
    ep: int,
    pp: int,
    distributed_optimizer: bool,
    state: Callable[[int], StateBytes],
) -> float:
    """A lower bound on the training state (weights, gradients, optimizer state) one device of
    the Megatron layout holds: ``params`` are ``(name, elements, bytes per element, trainable)``,
    ``state(bytes per element)`` the per-parameter accounting (``autopar.cost.memory``: ZeRO's,
    Rajbhandari et al. Table 1). Each weight is split ``tp`` ways where Megatron splits it
    (``roles``), experts ``ep`` ways; under the distributed optimizer its gradient and optimizer
    state are further split over its data-parallel ranks (``dp`` for dense weights, ``dp · tp / ep``
    for experts) as ZeRO-2 counts them (``megatron``'s docstring); the pipeline's largest stage
    holds at least ``1/pp`` of the total. Exact splits may fall short where shapes do not divide,
    so the true figure is at least this."""
    total = 0.0
    for fqn, numel, nbytes, trainable in params:
        role = roles.get(fqn, "")
        split = ep if fqn in experts else (tp if role and role != "row_bias" else 1)
        n = numel / split
        if not trainable:
            total += n * nbytes
            continue
        s = state(nbytes)
        if distributed_optimizer:
            group = dp * tp // ep if fqn in experts else dp
            total += n * (s.weight + (s.grad + s.optimizer) / group)
        else:
            total += n * s.total
    return total / pp


KNOBS = {
    "tp": "tp",
    "pp": "pp",
    "ep": "ep",
    "microbatch_size": "mbs",
    "schedule": "schedule",
    "virtual": "v",
    "sequence_parallel": "sp",
    "recompute": "recompute",
    "distributed_optimizer": "distributed_optimizer",
}
"""The knobs ``best_megatron`` tunes (Megatron-LM's names) and their keys in
``plan.info["megatron_candidates"]``."""


@dataclass(eq=False)
class _Search:
    """One ``best_megatron`` run: the model, the knobs held, the candidates so far."""

    model: nn.Module
    example_inputs: Any
    cluster: Cluster
    config: PlanConfig
    fixed: dict[str, Any]
    args: tuple
    kwargs: dict
    captures: MicrobatchCaptures | None = None
    tried: list[dict[str, Any]] = field(default_factory=list)
    best: Plan | None = None

    @property
    def batch(self) -> int:
        """The global batch (sequences)."""
        from autopar.capture import batch_size

        return batch_size(self.args, self.kwargs) or 1

    def options(self, name: str, values: list[Any]) -> list[Any]:
        """``values`` to try for knob ``name``, or the one value it is held at."""
        return [self.fixed[name]] if name in self.fixed else values

    def captured(self, m: int) -> Captured:
        """The model captured on one of ``m`` micro-batches (shared by every candidate)."""
        if self.captures is None:
            self.captures = MicrobatchCaptures(self.model, (self.args, self.kwargs))
        return self.captures(m)

    def skip(self, why: str, **knobs: Any) -> None:
        """Record candidates not planned: knobs not given are the held value or ``None`` (any)."""
        row = {key: self.fixed.get(name) for name, key in KNOBS.items()}
        self.tried.append({**row, **knobs, "feasible": False, "skipped": True, "why": why})

    def plan(self, knobs: dict[str, Any], m: int, schedules: list[tuple[str, int]]) -> float:
        """Plan one candidate (one stage plan, every schedule around it), record each schedule;
        the fastest step that fits (``inf`` where none does)."""
        tp, pp, ep, sp, do = (knobs[k] for k in ("tp", "pp", "ep", "sp", "distributed_optimizer"))
        world = self.cluster.world_size
        dp = world // (tp * pp)
        config = self.config.replace(recompute=knobs["recompute"], pp=1)
        t0 = time.perf_counter()
        try:
            if pp == 1 and m == 1:
                got: list[tuple[str, int, Plan | str]] = [("1f1b", 1, megatron(
                    self.model, self.example_inputs, self.cluster, tp, dp, sp, ep=ep, distributed_optimizer=do,
                    config=config, captured=self.captured(1),
                ))]  # fmt: skip
            else:
                got = _megatron_pipelined(
                    self.model, self.example_inputs, self.cluster, tp, dp, sp, ep=ep, pp=pp, microbatches=m,
                    schedules=schedules, distributed_optimizer=do, config=config, captured=self.captured(m),
                )  # fmt: skip
        except (InfeasibleError, ValueError) as e:
            got = [(schedule, v, str(e)) for schedule, v in schedules]
        log.info("best_megatron: %s planned in %.1f s", knobs, time.perf_counter() - t0)
        fastest = math.inf
        for schedule, v, p in got:
            row = {**knobs, "schedule": schedule, "v": v}
            if isinstance(p, str):
                self.tried.append({**row, "feasible": False, "why": p.splitlines()[0][:200]})
                continue
            self.tried.append({**row, "feasible": True, "step_time": p.predicted.step_time})
            fastest = min(fastest, p.predicted.step_time)
            if self.best is None or p.predicted.step_time < self.best.predicted.step_time:
                self.best = p
        return fastest

    def recompute_ladder(
        self, base: dict[str, Any], m: int, schedules: list[tuple[str, int]], optimizers: list[bool]
    ) -> tuple[float, int]:
        """Pruning 2: recomputation levels lightest first, stopping at the first that fits, the
        distributed optimizer only where the layout does not fit without it. The fastest step
        and the index of the level that fit (``inf, -1`` where none does)."""
        levels = self.options("recompute", ["none", "selective", "full"])
        for k, rc in enumerate(levels):
            step = math.inf
            for do in optimizers:
                knobs = {**base, "recompute": rc, "distributed_optimizer": do}
                if step < math.inf:
                    self.skip(f"fits without the distributed optimizer at recompute={rc} (rule 2)", **knobs)
                    continue
                step = self.plan(knobs, m, schedules)
            if step < math.inf:
                for heavier in levels[k + 1 :]:
                    self.skip(f"recompute={rc} fits with the same knobs (rule 2)", **base, recompute=heavier)
                return step, k
        return math.inf, -1

    def tune_stage(self, tp: int, pp: int, ep: int, optimizers: list[bool], moe: bool) -> tuple[float, bool]:
        """Sequence parallelism (pruning 3), micro-batch size (pruning 4), recomputation and the
        distributed optimizer for one ``(tp, pp, ep)``: the fastest step (``inf`` where nothing
        fits), and whether a candidate fits at the lightest recomputation tried."""
        dp = self.cluster.world_size // (tp * pp)
        per_rank = self.batch // dp
        light, fastest = False, math.inf
        sps = [True] if moe and tp > 1 else ([False, True] if tp > 1 else [False])
        for sp in self.options("sequence_parallel", sps):
            # One stage: gradient accumulation over micro-batches of 1, 2, 4, 8 sequences, or the
            # whole per-rank batch at once.
            mbss = (
                sorted({b for b in (1, 2, 4, 8) if per_rank % b == 0} | {per_rank})
                if pp == 1
                else [b for b in (1, 2, 4, 8) if per_rank % b == 0 and per_rank // b >= pp]
            )
            mbss = self.options("microbatch_size", mbss)
            previous = math.inf
            for i, mbs in enumerate(mbss):
                base = {"tp": tp, "pp": pp, "ep": ep, "mbs": mbs, "sp": sp}
                if per_rank % mbs:
                    self.skip(
                        f"microbatch_size={mbs} does not divide the {per_rank} sequences per rank", **base
                    )
                    continue
                m = per_rank // mbs
                schedules = [("1f1b", 1)]
                if pp > 1:
                    schedules = [
                        (s, self.fixed.get("virtual", 2 if s == "interleaved" else 1))
                        for s in self.options("schedule", ["1f1b", "interleaved"])
                        if m >= pp and not (s == "interleaved" and m % pp)
                    ]
                if not schedules:
                    self.skip(f"{m} micro-batches do not fill {pp} stages", **base)
                    continue
                step, level = self.recompute_ladder(base, m, schedules, optimizers)
                light |= level == 0
                fastest = min(fastest, step)
                if step == math.inf or step >= previous:
                    why = (
                        f"microbatch_size={mbs} fits at no recomputation level (rule 4)"
                        if step == math.inf
                        else f"the step got slower from microbatch_size={mbss[i - 1]} to {mbs} (rule 4)"
                    )
                    for larger in mbss[i + 1 :]:
                        self.skip(why, **{**base, "mbs": larger})
                    break
                previous = step
        return fastest, light


@audited
def best_megatron(
    model: nn.Module,
    example_inputs: Any,
    cluster: Cluster,
    *,
    config: PlanConfig | None = None,
    **fixed: Any,
) -> Plan:
    """The fastest Megatron-LM layout that fits, as an expert tunes Megatron's knobs (``KNOBS``):
    tensor parallel size ``tp`` (powers of two up to a node), pipeline size ``pp`` (stages of whole
    nodes, or inside one), expert parallel size ``ep`` (models with mixture-of-experts regions
    only: powers of two dividing the data-parallel size and the experts — Megatron-LM's
    ``ep | dp`` — 1 included), micro-batch size ``microbatch_size`` (1, 2, 4, 8 sequences per
    data-parallel rank), ``schedule`` (1F1B, interleaved with ``virtual=2``),
    ``sequence_parallel``, ``recompute`` (none, selective, full) and ``distributed_optimizer``.
    Expert tensor parallel size stays 1 (``megatron`` cannot express ``etp = tp``). Any knob
    passed in ``fixed`` is held (e.g. ``tp=8, pp=4, ep=8, recompute="full"``). Every candidate is a
    ``megatron`` layout, planned and scored by the simulator (``plan.predicted.step_time``).

    The space is pruned as Megatron's own guides prune it (Narayanan et al., SC'21, arXiv
    2104.04473, §3.3 takeaways; Megatron-Core MoE's "guidelines for parallel mappings",
    ``megatron/core/transformer/moe/README.md``, also arXiv 2603.07685 §9.1):

    1. **static memory** — a ``(tp, pp, ep, distributed_optimizer)`` whose training state alone
       exceeds the memory budget (``megatron_static_bytes``, a lower bound) is not planned;
    2. **recomputation** — levels are tried lightest first and, with the same other knobs, none
       heavier once one fits (recomputing only adds compute); the distributed optimizer only
       where the layout does not fit without it at that level (it saves memory, not time);
    3. **sequence parallelism** — a mixture-of-experts model with tensor parallelism runs it, as
       Megatron-LM requires ("When using MoE and tensor parallelism, sequence parallelism must
       be used"); dense models try both;
    4. **micro-batch size** — swept upward while the step gets faster, stopping at the first size
       that fits at no recomputation level (a larger one keeps more activations);
    5. **pipeline as short as fits** — for each ``(tp, ep)`` pipeline sizes are tried upward and
       none larger once one fits at the lightest recomputation (takeaway #2: the model-parallel
       size only as large as memory needs, the rest data parallelism; MoE guideline 1);
    6. **expert parallelism from the largest** — for each ``tp``, ``ep`` is tried from the largest
       down (MoE guideline 4: prefer EP; ``ep`` = the number of experts needs no local
       permutation) while the step gets faster, and stops at the first that fits nowhere (a
       smaller one keeps more experts per device).

    Rules 4–6 are the guides' experience, not proofs: they may skip a candidate that would have
    won. The schedules of one ``(pp, micro-batch size, …)`` share one stage plan, and each
    micro-batch count is captured once. ``plan.info["megatron_candidates"]`` lists every
    candidate planned (``feasible``, its ``step_time`` or ``why`` not) and every one skipped
    (``skipped: True`` and why; a knob it does not depend on is ``None``);
    ``plan.info["megatron_search_time"]`` the seconds the search took."""
    from autopar.capture import normalize_inputs
    from autopar.planner import detect_mixed_precision

    unknown = sorted(set(fixed) - set(KNOBS))
    if unknown:
        raise TypeError(f"best_megatron: unknown knob(s) {unknown}; known: {sorted(KNOBS)}")
    t_start = time.perf_counter()
    config = PlanConfig.build(config)
    args, kwargs = normalize_inputs(example_inputs)
    s = _Search(model, example_inputs, cluster, config, dict(fixed), args, kwargs)
    world, gpn, budget = cluster.world_size, cluster.gpus_per_node, config.budget(cluster.device.memory)
    whole = s.captured(1)
    run_passes(whole.gm, PassContext(captured=whole, cluster=cluster, config=config), [annotate_tensors])
    roles, experts = megatron_weight_roles(whole.gm.graph), expert_weights(whole.gm.graph)
    if fixed.get("ep", 1) > 1 and not experts:
        raise ValueError(
            f"ep={fixed['ep']}, but the model has no mixture-of-experts layer autopar recognises"
        )
    num_experts = math.gcd(*experts.values()) if experts else 1
    mixed = config.mixed_precision if config.mixed_precision is not None else detect_mixed_precision(whole)
    moments = itemsize(config.optimizer_state_dtype) if config.optimizer_state_dtype else None
    params = [
        (n.meta[TENSOR].fqn, math.prod(n.meta[TENSOR].shape), n.meta["val"].element_size(), n.meta[TENSOR].requires_grad)
        for n in whole.gm.graph.nodes
        if n.op == "placeholder" and TENSOR in n.meta and n.meta[TENSOR].kind == "param"
    ]  # fmt: skip

    def state(nbytes: int) -> StateBytes:
        return state_bytes_per_param(
            nbytes, optimizer=config.optimizer, master_weights=mixed, state_bytes=moments
        )

    def pipelines(tp: int, ep: int) -> float | None:
        """Pipeline sizes for one ``(tp, ep)``, smallest first (pruning 1 and 5): the fastest step
        (``inf`` where none fits), ``None`` where ``ep`` divides no data-parallel size."""
        fastest, applicable = math.inf, False
        pps = s.options("pp", [p for p in range(1, world // tp + 1) if (world // tp) % p == 0])
        for i, pp in enumerate(pps):
            dp = world // (tp * pp)
            if s.batch % dp or dp % ep:
                why = (
                    f"ep={ep} does not divide dp={dp}"
                    if dp % ep
                    else f"the batch of {s.batch} does not split over dp={dp}"
                )
                s.skip(why, tp=tp, pp=pp, ep=ep)
                continue
            applicable = True
            optimizers = []
            for do in s.options("distributed_optimizer", [False, True]):
                static = megatron_static_bytes(
                    params, roles, experts, tp=tp, dp=dp, ep=ep, pp=pp, distributed_optimizer=do, state=state
                )
                if static <= budget:
                    optimizers.append(do)
                    continue
                s.skip(
                    f"training state alone {static / 2**30:.1f} GiB per device > budget {budget / 2**30:.1f} GiB (rule 1)",
                    tp=tp, pp=pp, ep=ep, distributed_optimizer=do,
                )  # fmt: skip
            if not optimizers:
                continue
            step, light = s.tune_stage(tp, pp, ep, optimizers, bool(experts))
            fastest = min(fastest, step)
            if light:
                for larger in pps[i + 1 :]:
                    s.skip(f"pp={pp} fits at the lightest recomputation (rule 5)", tp=tp, pp=larger, ep=ep)
                break
        return fastest if applicable else None

    eps = [e for e in (64, 32, 16, 8, 4, 2) if e <= min(num_experts, world) and num_experts % e == 0] + [1]
    eps = s.options("ep", eps if experts else [1])
    for tp in s.options("tp", [t for t in (1, 2, 4, 8, 16) if t <= gpn and world % t == 0]):
        previous, previous_ep = math.inf, None
        for k, ep in enumerate(eps):  # largest first, while the step gets faster (rule 6)
            step = pipelines(tp, ep)
            if step is None:
                continue
            if step == math.inf or step >= previous:
                why = (
                    f"ep={ep} fits nowhere: a smaller ep keeps more experts per device (rule 6)"
                    if step == math.inf
                    else f"the step got slower from ep={previous_ep} to {ep} (rule 6)"
                )
                for smaller in eps[k + 1 :]:
                    s.skip(why, tp=tp, ep=smaller)
                break
            previous, previous_ep = step, ep
    if s.best is None:
        planned = [t for t in s.tried if not t.get("skipped")]
        raise InfeasibleError(
            "no Megatron-LM layout fits:\n  " + "\n  ".join(f"{t}" for t in (planned or s.tried)[:20])
        )
    s.best.info["megatron_candidates"] = s.tried
    s.best.info["megatron_search_time"] = time.perf_counter() - t_start
    return s.best

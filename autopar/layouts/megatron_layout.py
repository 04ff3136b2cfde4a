"""Megatron-LM's layout as a constrained plan (``autopar.layouts`` says what it fixes).

``megatron`` fixes the weights to the roles ``autopar.layouts.roles`` finds and lets the solver
place everything else; ``megatron_pipelined`` is the same over pipeline stages;
``block_recompute_layers`` the layers Megatron-LM's block recomputation method recomputes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.fx import Node

from autopar.audit import audited
from autopar.capture import Captured, capture
from autopar.cluster import Cluster
from autopar.config import PlanConfig, stage_plan_budget
from autopar.graph import OpFamily, op_family, op_info, op_name, tensor_inputs, tensor_outputs
from autopar.ir import TENSOR, Rewrite, Strategy
from autopar.layouts.roles import (
    expert_weights,
    is_rms_mean,
    megatron_weight_roles,
    norm_scales,
    residual_adds,
)
from autopar.microbatch import MicrobatchCaptures
from autopar.passes import PassContext, run_passes
from autopar.passes.annotate import annotate_tensors
from autopar.placement import Partial, Replicate, Shard
from autopar.planfile import Plan
from autopar.planner import InfeasibleError, plan_captured
from autopar.rules.moe_regions import moe_regions
from autopar.rules.routing import grouped_mm_operands

CP_COMM_TYPES = {None: "", "all_gather": "sequence", "a2a": "heads", "p2p": "ring"}
"""Megatron-Core's ``cp_comm_type`` values ``megatron`` expresses, and how its attention splits
along the context axis: the queries' sequence (keys and values gathered), the heads, or queries,
keys and values alike with the keys and values passed around a ring."""

__all__ = [
    "CP_COMM_TYPES",
    "block_recompute_layers",
    "from_batch",
    "megatron",
    "megatron_mesh",
    "megatron_pipelined",
]


def megatron_mesh(
    dp: int, tp: int, ep: int = 1, cp: int = 1
) -> tuple[tuple[int, ...], tuple[str, ...], dict[str, int]]:
    """``(mesh, axis names, {name: axis})`` of the Megatron layout with data-parallel size ``dp``,
    tensor-parallel size ``tp``, expert-parallel size ``ep`` and context-parallel size ``cp``
    (module docstring of ``megatron``): ``(dp, cp, tp)`` or, with ``ep > 1``,
    ``(dp / ep, ep, cp, tp)``, without their axes of size 1 (``(tp,)`` when every other is 1) —
    Megatron-Core's rank order, tensor ranks innermost, then context, then expert, then data."""
    if ep > 1:
        kept = [(name, n) for name, n in (("dp", dp // ep), ("ep", ep), ("cp", cp), ("tp", tp)) if n > 1]
    else:
        kept = [(name, n) for name, n in (("dp", dp), ("cp", cp)) if n > 1] + [("tp", tp)]
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
    cp: int = 1,
    cp_comm_type: str | None = None,
    pp: int = 1,
    microbatches: int | None = None,
    schedule: str = "1f1b",
    virtual: int = 1,
    distributed_optimizer: bool = False,
    recompute_num_layers: int | None = None,
    config: PlanConfig | None = None,
    captured: Captured | None = None,
    **options: Any,
) -> Plan:
    """The Megatron-LM layout with tensor-parallel size ``tp``, data-parallel size ``dp`` and
    expert-parallel size ``ep``.

    ``dp`` defaults to ``world_size / tp``. The mesh is ``(dp, tp)`` (``(tp,)`` when ``dp == 1``),
    the tensor axis innermost so it stays inside a node. Each data-parallel rank trains on its own
    sequences: every batched input is split along its batch over ``dp`` (where the batch divides)
    and every floating-point value computed from the batch stays split there; weights outside the
    tensor-parallel roles (norms, biases, position tables) are whole on every rank.

    With ``ep > 1`` (which must divide ``dp``: Megatron-LM carves the expert-parallel group out of
    the data-parallel one) the mesh is ``(dp / ep, ep, tp)`` (axes of size 1 dropped): every mixture-of-experts region
    (``autopar.rules.routing``) keeps its experts' weights split by expert along ``ep`` and used
    where they lie, so its tokens are dispatched to them and combined back by all-to-all;
    attention and the rest are data-parallel along ``ep``, as in Megatron-LM. Experts are not
    split along ``tp`` (expert tensor parallel size 1, Megatron-Core's
    ``expert_tensor_parallel_size=1``; the regions' modes cannot split an expert's own matmuls,
    so ``etp = tp`` is not expressible): each ``tp`` rank runs whole experts on the tokens it
    routes. The plan's axes are named ``dp``, ``ep``, ``cp``, ``tp`` after the layout.

    ``cp``: context parallelism (Megatron-Core's ``--context-parallel-size``), a ``cp`` axis
    between ``dp`` and ``tp`` (``dp`` defaults to ``world / (tp · cp)``). Every batched input is
    split along its dimension 1 — its sequence — over ``cp``, and every floating-point value
    computed from the batch stays split there (none is computed whole on every context rank);
    weights are whole along ``cp`` and their gradients reduced over it as over ``dp``. Attention
    is the only op that needs other tokens: the solver picks, per layer, its all-gather form (the
    keys and values gathered along ``cp``, each rank attending with its own queries) or its
    all-to-all form (the sequence traded for heads, DeepSpeed Ulysses) or its ring (the keys and
    values passed around the axis while each rank attends to them, Megatron-Core's default),
    whichever costs less (``autopar.rules.attention``). ``cp_comm_type`` fixes the form as
    Megatron-Core's flag does: ``"all_gather"``, ``"a2a"`` or ``"p2p"``. With
    ``ep > 1`` as well the mesh is ``(dp / ep, ep, cp, tp)``, Megatron-Core's default rank order
    (``tp-cp-ep-dp``): the expert-parallel group inside the data-parallel one, each batched input's
    batch split over ``dp / ep`` and ``ep`` together, its sequence over ``cp``; a
    mixture-of-experts region dispatches the tokens of its context rank along ``ep``.

    ``distributed_optimizer``: Megatron-LM's ``--use-distributed-optimizer`` (docs
    ``api-guide/dist_optimizer``): every parameter's optimizer state is split over its
    data-parallel ranks — ``dp / ep`` and ``ep`` for the dense weights, ``dp / ep`` and ``tp`` for
    the experts (their data-parallel group, ``tp · dp / ep`` ranks with expert tensor parallel
    size 1) — its gradients accumulated whole over the micro-batches and reduce-scattered once
    per step, its weights all-gathered once after the step. Planned as ZeRO stage 1 on those axes
    (``autopar.cost.memory``: Megatron's full-size gradient buffer; ``autopar.cost.reshard_cost``: the
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

    ``recompute_num_layers=N`` with ``recompute="full"``: Megatron-LM's ``--recompute-method block
    --recompute-num-layers N``, the first ``N`` repeated layers of every pipeline stage (of the
    ``pp · virtual``) recompute and the others keep their activations (``block_recompute_layers``).
    """
    if recompute_num_layers is not None:
        pipelined = pp > 1 or (microbatches or 1) > 1
        if captured is None:
            captured = (
                MicrobatchCaptures(model, example_inputs)(microbatches or pp)
                if pipelined
                else capture(model, example_inputs)
            )
        config = PlanConfig.build(config, **options)
        options = {}
        layers = block_recompute_layers(captured, cluster, config, recompute_num_layers, pp * virtual)
        config = config.replace(recompute_layers=layers)
    if pp > 1 or (microbatches or 1) > 1:
        ((_, _, got),) = megatron_pipelined(
            model, example_inputs, cluster, tp, dp, sequence_parallel, ep=ep, cp=cp, cp_comm_type=cp_comm_type, pp=pp,
            microbatches=microbatches or pp, schedules=[(schedule, virtual)],
            distributed_optimizer=distributed_optimizer, config=PlanConfig.build(config, **options),
            captured=captured,
        )  # fmt: skip
        if isinstance(got, str):
            raise InfeasibleError(got)
        return got
    world = cluster.world_size
    if cp < 1:
        raise ValueError(f"cp={cp} must be a positive integer")
    if cp_comm_type not in CP_COMM_TYPES:
        raise ValueError(
            f"cp_comm_type={cp_comm_type!r}: expected one of {sorted(k for k in CP_COMM_TYPES if k)} or None "
            "(the solver picks per layer); Megatron-Core's hierarchical 'a2a+p2p' is not expressible yet"
        )
    if dp is None:
        if world % (tp * cp):
            sizes = f"tp={tp}" + (f" × cp={cp} = {tp * cp}" if cp > 1 else "")
            raise ValueError(f"{sizes} does not divide the world size {world}")
        dp = world // (tp * cp)
    if dp * cp * tp != world:
        sizes = f"tp({tp})" + (f" × cp({cp})" if cp > 1 else "")
        raise ValueError(f"{sizes} × dp({dp}) = {tp * cp * dp} ≠ world size {world}")
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
    mesh, axis_names, axis = megatron_mesh(dp, tp, ep, cp)
    t_axis = axis.get("tp")
    e_axis = axis.get("ep")
    c_axis = axis.get("cp")
    fixed: dict[str, tuple[str, ...]] = _batch_split_inputs(cap, mesh, axis, cp)
    # The axes the batch is split over (dp and ep, where the batch divides) and the context axis:
    # every floating-point value computed from the batch stays split there (never gathered and
    # computed whole on every data-parallel or context rank, which Megatron-LM never does).
    data_split = [
        a
        for a in (axis.get("dp"), e_axis)
        if a is not None and any(spec[a] == "S(0)" for spec in fixed.values())
    ]
    batch_axes = [a for a in (*data_split, c_axis) if a is not None and mesh[a] > 1]
    batch_ops = _batch_ops(cap) if batch_axes else set()
    split_dims: dict[str, set[int]] = {}
    for fqn, role in roles.items():
        if role.startswith(("col:", "row:")):
            tp_p = f"S({role.split(':')[1]})"
        elif role in ("col_bias", "vocab"):
            tp_p = "S(0)"
        else:  # row_bias
            tp_p = "R"
        spec = ["R"] * len(mesh)
        if t_axis is not None and mesh[t_axis] > 1:  # tp = 1 keeps an axis of one device: whole there
            spec[t_axis] = tp_p
        fixed[fqn] = tuple(spec)
        split_dims[fqn] = {int(tp_p[2:-1])} if t_axis is not None and spec[t_axis] != "R" else set()
    for n in cap.gm.graph.nodes:  # every other weight (norms, biases, position tables) whole
        info = n.meta.get(TENSOR)
        if n.op == "placeholder" and info is not None and info.kind == "param" and info.fqn not in roles:
            fixed[info.fqn] = ("R",) * len(mesh)
            split_dims[info.fqn] = set()
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
            own = (axis.get("dp"), c_axis, t_axis if info.fqn in experts else e_axis)
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
    scales = norm_scales(cap.gm.graph, roles)
    # Grouped matmuls read their experts' weights through views (transformers transposes them):
    # each must run over its own device's experts along ep.
    expert_mms = {
        e: tensor_inputs(e).index(grouped_mm_operands(e)[1])
        for r in moe_regions(cap.gm.graph)
        for e in r.experts
    }

    def whole_on_cp(node: Node) -> tuple[int, ...]:
        """The context axis, for a view (a reshape, a broadcast, a slice: no arithmetic): it may
        run on the whole sequence there, so a gather across ``cp`` can sit on
        whichever side of it moves fewer bytes. The loss reads the logits through a flatten of
        (batch, sequence) that no single split of both survives; with the flatten whole on ``cp``,
        the logits are gathered once and sliced for the loss (a free slice, an all-gather of its
        gradient) instead of gathered, made partial and reduce-scattered."""
        if c_axis is None or node.op != "call_function":
            return ()
        info = op_info(op_name(node))
        return (c_axis,) if info.family is OpFamily.VIEW else ()

    def megatron_execution(node: Node, s: Strategy) -> bool:
        """Weights are used where they lie (no gathering), read whole on their data-parallel axes
        under the distributed optimizer; norms as Megatron runs them; values computed from the
        batch split along the data-parallel and context axes."""
        if node.op != "call_function":
            return True
        if node in batch_ops and not all(s.split[a] for a in batch_axes if a not in whole_on_cp(node)):
            return False
        if c_axis is not None and cp_comm_type and op_family(node) is OpFamily.ATTENTION:
            q = s.inputs[0][c_axis]
            seq = node.args[0].meta["val"].dim() - 2
            ring = s.rewrites[c_axis] is Rewrite.RING_ATTENTION
            form = CP_COMM_TYPES[cp_comm_type]
            if form in ("sequence", "ring") and not (isinstance(q, Shard) and q.dim == seq):
                return False
            if (form == "ring") != ring and form != "heads":
                return False
            if CP_COMM_TYPES[cp_comm_type] == "heads" and not (isinstance(q, Shard) and q.dim == seq - 1):
                return False
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
        is_norm = (
            op_family(node) is OpFamily.NORM
            or (op_name(node) == "mean" and is_rms_mean(node))
            or node in scales
        )
        if t_axis is None or (not is_norm and node not in residual):
            return True
        p = s.outputs[0][t_axis]
        if sequence_parallel:
            return isinstance(p, Shard) and p.dim == 1
        return isinstance(p, Replicate)

    knobs = [f"tp={tp}", f"dp={dp}"] + [f"ep={ep}"] * (ep > 1) + [f"cp={cp}"] * (cp > 1)
    knobs += [f"cp_comm_type={cp_comm_type}"] * (cp > 1 and cp_comm_type is not None)
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


def _batch_split_inputs(
    cap: Captured, mesh: tuple[int, ...], axis: dict[str, int], cp: int
) -> dict[str, tuple[str, ...]]:
    """The batched inputs' placements: the batch (dimension 0) split over the data-parallel ranks
    (the ``dp`` and ``ep`` axes) where it divides — each data-parallel rank trains on its own
    sequences, as Megatron-LM's data loader hands them out — and under context parallelism the
    sequence (dimension 1) over ``cp``; whole on ``tp``. Batched: an input of two or more
    dimensions. Raises where ``cp`` does not divide an input's sequence."""
    out: dict[str, tuple[str, ...]] = {}
    c_axis = axis.get("cp")
    for n in cap.user_input_nodes():
        v = n.meta.get("val")
        if not isinstance(v, torch.Tensor) or v.dim() < 2:
            continue
        spec = ["R"] * len(mesh)
        data = [axis[a] for a in ("dp", "ep") if a in axis]  # ep: a group inside the data-parallel one
        if data and v.shape[0] % math.prod(mesh[a] for a in data) == 0:
            for a in data:
                spec[a] = "S(0)"
        if c_axis is None:
            out[cap.inputs[n.name]] = tuple(spec)
            continue
        if v.shape[1] % cp:
            raise ValueError(
                f"megatron(cp={cp}): context parallelism splits each batched input's sequence (its "
                f"dimension 1) over cp={cp}, and input {cap.inputs[n.name]!r} of shape {tuple(v.shape)} has "
                f"{v.shape[1]} positions: {v.shape[1]} / {cp} = {v.shape[1] / cp:g}; use a cp that divides it"
            )
        spec[c_axis] = "S(1)"
        out[cap.inputs[n.name]] = tuple(spec)
    return out


def from_batch(cap: Captured) -> set[Node]:
    """The user inputs and every value computed from them (the layouts keep these split)."""
    out: set[Node] = set(cap.user_input_nodes())
    for n in cap.gm.graph.nodes:
        if any(i in out for i in n.all_input_nodes):
            out.add(n)
    return out


def _batch_ops(cap: Captured) -> set[Node]:
    """The ops that compute or read a floating-point value of more than one element computed
    from the batch: none runs whole on every data-parallel or context rank (integer
    bookkeeping, such as shifting the labels, may)."""
    inputs = set(cap.user_input_nodes())
    values = {
        n
        for n in from_batch(cap) - inputs
        if any(o.is_floating_point() and o.numel() > 1 for o in tensor_outputs(n))
    }
    return values | {n for n in cap.gm.graph.nodes if any(i in values for i in n.all_input_nodes)}


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
    of ``data_axes`` too, each on the largest dimension not split yet that divides evenly, else on
    the largest one another data axis splits that still divides (Megatron-Core shards the state
    over data and context ranks together, ``data_parallel_group_with_cp``: the gradient is
    reduce-scattered over both, each axis moving its share, where a whole copy on one axis would
    all-reduce the whole gradient there); ``R`` on an axis where none does (that axis keeps whole
    copies of the state)."""
    local = list(shape)
    for a, p in enumerate(spec):
        if p != "R":
            local[int(p[2:-1])] //= mesh[a]
    taken = set(split)
    data: set[int] = set()
    for a in data_axes:
        dims = [d for d in range(len(local)) if d not in taken and local[d] % mesh[a] == 0]
        dims = dims or [d for d in data if local[d] % mesh[a] == 0]
        if dims:
            d = max(dims, key=lambda d: local[d])
            spec[a] = f"S({d})"
            local[d] //= mesh[a]
            taken.add(d)
            data.add(d)
    return tuple(spec)


def block_recompute_layers(
    cap: Captured, cluster: Cluster, config: PlanConfig, n: int, stages: int
) -> tuple[int, ...]:
    """The repeated-layer ordinals Megatron-LM's block method recomputes with
    ``--recompute-num-layers n`` (``megatron_core.transformer.transformer_block``: in each of the
    ``stages`` model chunks, its first ``n`` layers), the chunks cut at equal layer counts."""
    from autopar.passes.strategies import repeated_layers

    if config.recompute != "full":
        raise ValueError(
            f"recompute_num_layers={n} is Megatron-LM's --recompute-num-layers, which applies to full "
            f"recomputation: give recompute='full', got {config.recompute!r}"
        )
    run_passes(cap.gm, PassContext(captured=cap, cluster=cluster, config=config), [annotate_tensors])
    total = len(repeated_layers(cap.gm.graph))
    if not total or total % stages:
        raise ValueError(
            f"recompute_num_layers: the model's {total} repeated layers do not cut into pp × virtual = "
            f"{stages} equal stages"
        )
    chunk = total // stages
    if not 1 <= n <= chunk:
        raise ValueError(
            f"recompute_num_layers={n}: each of the {stages} stages has {total} / {stages} = {chunk} layers; "
            f"give 1 to {chunk}"
        )
    return tuple(i for i in range(total) if i % chunk < n)


def megatron_pipelined(
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
    cp: int = 1,
    cp_comm_type: str | None = None,
    distributed_optimizer: bool,
    config: PlanConfig,
    captured: Captured | None,
) -> list[tuple[str, int, Plan | str]]:
    """``megatron`` with pipeline stages (see its docstring): one stage plan, then every
    ``(schedule, virtual)`` of ``schedules`` played around it — the plan, or why it does not fit."""
    from autopar.pipelined import pipelined_candidates, stage_cluster

    sub = stage_cluster(cluster, pp)
    if sub is None:
        raise ValueError(
            f"pp={pp} does not cut {cluster.nodes} node(s) × {cluster.gpus_per_node} devices into equal stages"
        )
    if captured is None:
        captured = MicrobatchCaptures(model, example_inputs)(microbatches)
    config = config.resolved(cluster.device.memory)
    budget = config.memory_budget
    stage = megatron(
        model, None, sub, tp, dp, sequence_parallel, ep=ep, cp=cp, cp_comm_type=cp_comm_type, distributed_optimizer=distributed_optimizer,
        config=config.replace(memory_budget=stage_plan_budget(budget, pp), mesh_shape=None, fixed={}), captured=captured,
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

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
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.fx import Node

from autopar.capture import Captured, capture
from autopar.cluster import Cluster
from autopar.config import PlanConfig
from autopar.graph import OpFamily, op_family, op_info, op_name, tensor_inputs
from autopar.ir import TENSOR, Strategy
from autopar.passes import PassContext, run_passes
from autopar.passes.annotate import annotate_tensors
from autopar.placement import Partial, Replicate, Shard
from autopar.planfile import Plan
from autopar.planner import InfeasibleError, plan_captured
from autopar.rules.routing import grouped_mm_operands, moe_regions

__all__ = ["best_megatron", "expert_weights", "megatron", "megatron_weight_roles"]


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
    ``expert_tensor_parallel_size=1``): each ``tp`` rank runs whole experts on the tokens it
    routes. ``config`` (or its fields as keyword ``options``, e.g. ``memory_budget``) holds the
    other planning options; the layout sets the mesh and fixes the weights.

    With ``pp > 1`` the model is cut into ``pp · virtual`` pipeline stages (at its seams, balanced
    by compute: ``autopar.passes.stages``; Megatron-LM cuts equal layer counts, which is this for
    equal layers), each stage laid out as above on ``world / pp`` devices, ``microbatches``
    micro-batches (default ``pp``) run under ``schedule`` (``autopar.schedule``).
    """
    if pp > 1:
        return _megatron_pipelined(
            model, example_inputs, cluster, tp, dp, sequence_parallel, ep=ep, pp=pp,
            microbatches=microbatches or pp, schedule=schedule, virtual=virtual,
            config=PlanConfig.build(config, **options),
        )  # fmt: skip
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
    if ep > 1:  # (dp / ep, ep, tp) without its axes of size 1
        sizes = [n for n in (dp // ep, ep, tp) if n > 1]
        mesh = tuple(sizes)
        e_axis = 1 if dp > ep else 0
        t_axis = e_axis + 1 if tp > 1 else None
    else:
        mesh = (dp, tp) if dp > 1 else (tp,)
        t_axis, e_axis = len(mesh) - 1, None
    fixed: dict[str, tuple[str, ...]] = {}
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
    for fqn in experts:  # split by expert along ep; whole everywhere else (expert TP size 1)
        spec = ["R"] * len(mesh)
        if e_axis is not None:
            spec[e_axis] = "S(0)"
        fixed[fqn] = tuple(spec)
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
        """Weights are used where they lie (no gathering); norms as Megatron runs them."""
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
            if info is not None and info.kind == "param" and info.fqn in fixed and s.inputs[j] is not None:
                for a in used_where_they_lie:
                    want, got = fixed[info.fqn][a], s.inputs[j][a]
                    if want == "R" and not isinstance(got, (Replicate, Partial)):
                        return False
                    if want != "R" and not (isinstance(got, Shard) and f"S({got.dim})" == want):
                        return False
        is_norm = op_family(node) is OpFamily.NORM or (op_name(node) == "mean" and _is_rms_mean(node))
        if t_axis is None or (not is_norm and node not in residual):
            return True
        p = s.outputs[0][t_axis]
        if sequence_parallel:
            return isinstance(p, Shard) and p.dim == 1
        return isinstance(p, Replicate)

    name = f"megatron(tp={tp}, dp={dp}{f', ep={ep}' if ep > 1 else ''}{', sequence_parallel' if sequence_parallel else ''})"
    return plan_captured(
        cap,
        cluster,
        config.with_fixed(fixed).replace(mesh_shape=mesh),
        node_constraint=megatron_execution,
        layout=name,
    )


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
    schedule: str,
    virtual: int,
    config: PlanConfig,
) -> Plan:
    """``megatron`` with pipeline stages (see its docstring)."""
    from autopar.capture import normalize_inputs
    from autopar.search import microbatch_inputs, pipelined_candidates, stage_cluster

    sub = stage_cluster(cluster, pp)
    if sub is None:
        raise ValueError(
            f"pp={pp} does not cut {cluster.nodes} node(s) × {cluster.gpus_per_node} devices into equal stages"
        )
    args, kwargs = normalize_inputs(example_inputs)
    cap = capture(model, microbatch_inputs(args, kwargs, microbatches))
    budget = config.budget(cluster.device.memory)
    stage = megatron(
        model, None, sub, tp, dp, sequence_parallel, ep=ep,
        config=config.replace(memory_budget=budget * pp, mesh_shape=None, fixed={}), captured=cap,
    )  # fmt: skip
    found = pipelined_candidates(
        stage, cap.gm, cluster, config.replace(schedule=schedule, virtual=virtual), pp, microbatches, budget
    )
    if not found:
        raise InfeasibleError(
            f"megatron(tp={tp}, pp={pp}, {schedule}, m={microbatches}): the stages do not fit the memory "
            f"budget, or the model has fewer than {pp * virtual - 1} seams to cut at"
        )
    plan = found[0].plan
    plan.info["layout"] = stage.info.get("layout", "megatron").replace(
        "megatron(",
        f"megatron(pp={pp}, m={microbatches}, {schedule}{f', v={virtual}' if virtual > 1 else ''}, ",
        1,
    )
    plan.cluster = cluster.to_dict()
    plan.info["cluster_desc"] = cluster.describe()
    return plan


def best_megatron(
    model: nn.Module,
    example_inputs: Any,
    cluster: Cluster,
    *,
    config: PlanConfig | None = None,
    **fixed: Any,
) -> Plan:
    """The fastest Megatron-LM layout that fits, as an expert tunes Megatron's knobs: tensor
    parallel size ``tp`` (powers of two up to a node), pipeline size ``pp`` (stages of whole nodes,
    or inside one), micro-batch size ``microbatch_size`` (1, 2, 4, 8 sequences per data-parallel
    rank), ``schedule`` (1F1B, interleaved with ``virtual=2``), ``sequence_parallel`` and
    ``recompute`` (none, selective, full). Any knob passed in ``fixed`` is held (e.g. ``tp=8,
    pp=4, recompute="full"``). Every candidate is a ``megatron`` layout, planned and scored by the
    simulator (``plan.predicted.step_time``); ``plan.info["megatron_candidates"]`` lists them."""
    from autopar.capture import normalize_inputs
    from autopar.search import batch_size

    known = {"tp", "pp", "microbatch_size", "schedule", "virtual", "sequence_parallel", "recompute"}
    unknown = sorted(set(fixed) - known)
    if unknown:
        raise TypeError(f"best_megatron: unknown knob(s) {unknown}; known: {sorted(known)}")
    config = PlanConfig.build(config)
    world, gpn = cluster.world_size, cluster.gpus_per_node
    args, kwargs = normalize_inputs(example_inputs)
    batch = batch_size(args, kwargs) or 1

    def options(name: str, values: list[Any]) -> list[Any]:
        return [fixed[name]] if name in fixed else values

    tps = options("tp", [t for t in (1, 2, 4, 8, 16) if t <= gpn and world % t == 0])
    tried: list[dict[str, Any]] = []
    best: Plan | None = None
    for tp in tps:
        for pp in options("pp", [p for p in range(1, world // tp + 1) if (world // tp) % p == 0]):
            dp = world // (tp * pp)
            if batch % dp:
                continue
            per_rank = batch // dp
            mbss = options("microbatch_size", [b for b in (1, 2, 4, 8) if per_rank % b == 0])
            if pp == 1:
                mbss = [per_rank]  # one stage: the whole per-rank batch at once
            for mbs in mbss:
                m = per_rank // mbs
                if pp > 1 and m < pp:
                    continue
                scheds = options("schedule", ["1f1b", "interleaved"] if pp > 1 else ["1f1b"])
                for sched in scheds:
                    v = fixed.get("virtual", 2 if sched == "interleaved" else 1)
                    if sched == "interleaved" and m % pp:
                        continue
                    for sp in options("sequence_parallel", [False, True] if tp > 1 else [False]):
                        for rc in options("recompute", ["none", "selective", "full"]):
                            knobs = {
                                "tp": tp,
                                "pp": pp,
                                "mbs": mbs,
                                "schedule": sched,
                                "v": v,
                                "sp": sp,
                                "recompute": rc,
                            }
                            try:
                                p = megatron(
                                    model, example_inputs, cluster, tp, dp, sp, pp=pp, microbatches=m,
                                    schedule=sched, virtual=v, config=config.replace(recompute=rc, pp=1),
                                )  # fmt: skip
                            except (InfeasibleError, ValueError) as e:
                                tried.append(
                                    {**knobs, "feasible": False, "why": str(e).splitlines()[0][:200]}
                                )
                                continue
                            tried.append({**knobs, "feasible": True, "step_time": p.predicted.step_time})
                            if best is None or p.predicted.step_time < best.predicted.step_time:
                                best = p
    if best is None:
        raise InfeasibleError("no Megatron-LM layout fits:\n  " + "\n  ".join(f"{t}" for t in tried[:20]))
    best.info["megatron_candidates"] = tried
    return best

"""Memory per device before launch: training state under each ZeRO stage and saved activations
under each recomputation mode, per pipeline stage, for a Megatron-style layout (``autopar memory``).

Words:

* **layout** — ``dp × tp × pp`` devices (:class:`MemorySetup`): the batch split ``dp`` ways, the
  weights of Megatron-LM's column/row-parallel matmuls (found by graph structure,
  ``autopar.layouts.megatron_weight_roles``) split ``tp`` ways, the layers cut into ``pp`` stages
  of equal layer counts (Megatron's rule; embeddings on the first stage, the head on the last).
* **training state** — parameters, gradients and optimizer state per parameter, the arithmetic of
  ``autopar.cost.memory`` (ZeRO, Rajbhandari et al. arXiv 1910.02054 §3.1 and §5: bf16 weights
  with fp32 master weights and AdamW moments are 2 + 2 + 12 = 16 bytes per parameter; ZeRO-1
  shards the 12 across the ``dp`` devices, 4 + 12/N; ZeRO-2 also the gradients, 2 + 14/N; ZeRO-3
  everything, 16/N).
* **activations** — what autograd saves for backward, from the captured graph
  (``autopar.passes.annotate``: each node's ``saved_bytes``, global shapes) scaled to one
  micro-batch on one device: divided by ``dp`` and by the micro-batch count, and by ``tp`` inside
  tensor-parallel regions (from a column-parallel matmul to the row-parallel one; everywhere with
  sequence parallelism, Korthikanti et al. arXiv 2205.05198 §4).
* **recomputation** — ``none``; ``selective`` (Korthikanti et al.: attention's ``s × s`` score,
  softmax and dropout tensors are recomputed, the matmul inputs kept; with a fused attention op,
  which saves no ``s × s`` tensor, it equals ``none``); ``full`` (each layer keeps only its input,
  and one layer's activations are live again while its backward runs).
* **in flight** — micro-batches whose activations a stage holds at once: all ``m`` under GPipe,
  ``min(pp − i, m)`` on stage ``i`` under 1F1B (Narayanan et al. arXiv 2104.04473 §2.2).

Not counted: temporary buffers (a ZeRO-3 layer's gathered weights, collectives' staging buffers,
logits' fp32 copies beyond what autograd saves) and the allocator's fragmentation — the reserve
of ``PlanConfig.memory_reserve`` is for those. A plan (``autopar plan``) accounts memory per op
under its actual layout; this estimate answers "what fits" before planning.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

import torch
from torch.fx import Node

from autopar.capture import Captured
from autopar.cluster import Cluster
from autopar.cost.memory import training_state_bytes
from autopar.display import fmt_bytes, unit_of
from autopar.graph import OpFamily, op_family, op_info
from autopar.ir import COST, TENSOR
from autopar.layouts import megatron_weight_roles

__all__ = ["RECOMPUTE", "ZERO_STAGES", "MemoryEstimate", "MemorySetup", "StageMemory", "estimate_memory"]

RECOMPUTE = ("none", "selective", "full")
ZERO_STAGES = (0, 1, 2, 3)
SCHEDULES = ("1f1b", "gpipe")


@dataclass(frozen=True, kw_only=True, slots=True)
class MemorySetup:
    """The layout and training options memory is estimated for (see module docstring)."""

    dp: int = 1
    """Data-parallel devices (the batch and, under ZeRO, the training state are split this way)."""
    tp: int = 1
    """Tensor-parallel devices (Megatron-LM's column/row-parallel weights)."""
    pp: int = 1
    """Pipeline stages."""
    microbatches: int | None = None
    """Micro-batches per step (each ``batch / dp / microbatches`` sequences); default ``pp``."""
    zero_stage: int = 0
    """0 (plain data parallelism), 1, 2 or 3."""
    recompute: str = "none"
    """``none``, ``selective`` or ``full``."""
    sequence_parallel: bool = False
    """Norms, dropouts and residuals split along the sequence on the tensor axis."""
    schedule: str = "1f1b"
    """``1f1b`` or ``gpipe``: how many micro-batches each stage keeps in flight."""
    optimizer: str = "adamw"
    """Optimizer whose state is counted (``autopar.cost.memory.OPTIMIZER_BYTES_PER_PARAM``)."""
    mixed_precision: bool | None = None
    """fp32 master weights for bf16/fp16 parameters; None: when the parameters are bf16/fp16."""
    optimizer_state_dtype: str | None = None
    """dtype of the optimizer's moments (``"bfloat16"``: ZeRO's 12 / 5 / 3.25 / 1.5 bytes per
    parameter at N = 8 with the fp32 master kept); None: fp32 under mixed precision, else the
    parameters' dtype (``autopar.cost.memory.state_bytes_per_param``)."""

    def __post_init__(self) -> None:
        if self.optimizer_state_dtype not in (None, "float32", "bfloat16", "float16"):
            raise ValueError(
                f"MemorySetup: optimizer_state_dtype must be 'float32', 'bfloat16', 'float16' or None, "
                f"got {self.optimizer_state_dtype!r}"
            )
        for name in ("dp", "tp", "pp"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"MemorySetup: {name} must be a positive integer, got {v!r}")
        m = self.microbatches
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
            raise ValueError(f"MemorySetup: microbatches must be a positive integer, got {m!r}")
        if self.zero_stage not in ZERO_STAGES:
            raise ValueError(f"MemorySetup: zero_stage must be 0, 1, 2 or 3, got {self.zero_stage!r}")
        if self.recompute not in RECOMPUTE:
            raise ValueError(
                f"MemorySetup: recompute must be one of {', '.join(RECOMPUTE)}, got {self.recompute!r}"
            )
        if self.schedule not in SCHEDULES:
            raise ValueError(
                f"MemorySetup: schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}"
            )

    @property
    def devices(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def state_bytes(self) -> int | None:
        """Bytes per element of an optimizer moment (None: the default rule)."""
        sizes = {"float32": 4, "bfloat16": 2, "float16": 2}
        return sizes[self.optimizer_state_dtype] if self.optimizer_state_dtype else None

    @property
    def num_microbatches(self) -> int:
        return self.microbatches if self.microbatches is not None else self.pp


@dataclass(frozen=True, kw_only=True, slots=True)
class StageMemory:
    """Bytes one device of a pipeline stage holds."""

    stage: int
    units: tuple[str, ...]
    """The stage's layers and other modules (``autopar.display`` units), in execution order."""
    num_params: int
    """Parameter elements this device holds before ZeRO (its stage's, after tensor parallelism)."""
    parameters: float
    gradients: float
    optimizer: float
    """Optimizer state, with the fp32 master weights under mixed precision."""
    activations: float
    """Saved activations of all micro-batches in flight."""
    activations_per_microbatch: float
    in_flight: int

    @property
    def training_state(self) -> float:
        return self.parameters + self.gradients + self.optimizer

    @property
    def total(self) -> float:
        return self.training_state + self.activations


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryEstimate:
    """Memory per device of every pipeline stage under one setup."""

    setup: MemorySetup
    stages: tuple[StageMemory, ...]
    num_params: int
    """Parameters of the whole model (tied ones once)."""
    param_bytes: int
    """Bytes of one parameter element (2 for bf16)."""
    mixed_precision: bool
    micro_batch: int
    """Sequences per micro-batch on one device."""

    @property
    def peak(self) -> StageMemory:
        """The stage that needs the most memory."""
        return max(self.stages, key=lambda s: s.total)

    def bytes_per_param(self) -> tuple[float, str]:
        """Training-state bytes per parameter held, and the formula (``"4 + 12/8"``)."""
        pb = self.param_bytes
        opt = (
            training_state_bytes(
                1,
                pb,
                optimizer=self.setup.optimizer,
                mixed_precision=self.mixed_precision,
                state_bytes=self.setup.state_bytes,
            )
            - 2 * pb
        )
        z, n = self.setup.zero_stage, self.setup.dp
        parts = [(pb, z >= 3), (pb, z >= 2), (opt, z >= 1)]
        whole = sum(b for b, sharded in parts if not sharded or n == 1)
        split = sum(b for b, sharded in parts if sharded and n > 1)
        value = whole + split / n
        text = " + ".join([_num(whole)] * bool(whole) + [f"{_num(split)}/{n}"] * bool(split))
        return value, text


def _num(x: float) -> str:
    return f"{x:g}"


def estimate_memory(cap: Captured, cluster: Cluster, setup: MemorySetup) -> MemoryEstimate:
    """Memory per device of every stage of ``cap``'s model under ``setup`` (see module docstring).

    ``cap`` is captured on one global batch; the annotation passes are run on it if needed."""
    _annotate(cap, cluster)
    graph = cap.gm.graph
    m = setup.num_microbatches
    batch = _batch_size(cap)
    if batch % (setup.dp * m):
        raise ValueError(
            f"the batch of {batch} does not split into dp({setup.dp}) × {m} micro-batch(es) = "
            f"{setup.dp * m} equal parts: use a batch that is a multiple of {setup.dp * m}"
        )
    micro = batch // (setup.dp * m)
    scale = 1.0 / (setup.dp * m)
    units, order = _units(graph)
    layers = [u for u in order if unit_of(u)[2] is not None]
    if setup.pp > 1 and len(layers) % setup.pp:
        raise ValueError(
            f"{len(layers)} layers do not split into pp={setup.pp} stages of equal layer counts: use a pp "
            f"that divides {len(layers)}"
        )
    stage_of = _stages(order, layers, setup.pp)
    roles = megatron_weight_roles(graph)
    split_by_tp = _tensor_parallel_values(graph, roles) if setup.tp > 1 else set()
    seq = _seq_len(cap)
    # Activations per micro-batch, per unit.
    saved: dict[str, float] = defaultdict(float)
    for n in graph.nodes:
        cost, info = n.meta.get(COST), n.meta.get(TENSOR)
        if cost is None or info is None or not cost.saved_bytes or n.op != "call_function":
            continue
        b = cost.saved_bytes * scale
        if setup.tp > 1 and (setup.sequence_parallel or n in split_by_tp):
            b /= setup.tp
        if setup.recompute == "selective" and seq and sum(1 for d in info.shape if d == seq) >= 2:
            continue  # an s × s attention tensor: recomputed
        saved[unit_of(info.module)[0] if info.module else "<top>"] += b
    if setup.recompute == "full":
        kept = {
            u: _layer_input_bytes(units[u]) * scale / (setup.tp if setup.sequence_parallel else 1)
            for u in layers
        }
    # Parameters per unit, after tensor parallelism.
    params: dict[str, float] = defaultdict(float)
    total_params = 0
    for n in graph.nodes:
        if n.op != "placeholder" or n.name not in cap.params:
            continue
        fqn = cap.params[n.name]
        numel = math.prod(n.meta["val"].shape)
        total_params += numel
        owner = fqn.rsplit(".", 1)[0] if "." in fqn else ""
        role = roles.get(fqn, "")
        div = setup.tp if role.startswith(("col:", "row:")) or role in ("col_bias", "vocab") else 1
        params[unit_of(owner)[0] if owner else "<top>"] += numel / div
    pb = _param_bytes(cap)
    mixed = setup.mixed_precision if setup.mixed_precision is not None else pb < 4
    z, n = setup.zero_stage, setup.dp
    stages = []
    for s in range(setup.pp):
        mine = [u for u in order if stage_of[u] == s]
        numel = sum(params[u] for u in mine)
        p_shards, g_shards, o_shards = (n if z >= 3 else 1), (n if z >= 2 else 1), (n if z >= 1 else 1)
        total = training_state_bytes(
            numel, pb, optimizer=setup.optimizer, mixed_precision=mixed, state_bytes=setup.state_bytes,
            param_shards=p_shards, grad_shards=g_shards, optimizer_shards=o_shards,
        )  # fmt: skip
        parameters, gradients = numel * pb / p_shards, numel * pb / g_shards
        if setup.recompute == "full":
            layer_units = [u for u in mine if u in kept]
            act = sum(saved[u] for u in mine if u not in kept) + sum(kept[u] for u in layer_units)
            live_again = max((saved[u] for u in layer_units), default=0.0)  # the layer being back-propagated
        else:
            act = sum(saved[u] for u in mine)
            live_again = 0.0
        in_flight = m if setup.schedule == "gpipe" else min(setup.pp - s, m)
        stages.append(
            StageMemory(
                stage=s,
                units=tuple(mine),
                num_params=int(numel),
                parameters=parameters,
                gradients=gradients,
                optimizer=total - parameters - gradients,
                activations=act * in_flight + live_again,
                activations_per_microbatch=act,
                in_flight=in_flight,
            )
        )
    return MemoryEstimate(
        setup=setup, stages=tuple(stages), num_params=total_params, param_bytes=pb, mixed_precision=mixed,
        micro_batch=micro,
    )  # fmt: skip


def _annotate(cap: Captured, cluster: Cluster) -> None:
    if all(COST in n.meta for n in cap.gm.graph.nodes if n.op == "call_function"):
        return
    from autopar.passes import PassContext, run_passes
    from autopar.planner import GRAPH_PASSES

    run_passes(cap.gm, PassContext(captured=cap, cluster=cluster), GRAPH_PASSES)


def _batch_size(cap: Captured) -> int:
    for n in cap.user_input_nodes():
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor) and val.dim() > 0:
            return int(val.shape[0])
    raise ValueError("the example inputs have no tensor with a batch dimension")


def _seq_len(cap: Captured) -> int | None:
    for n in cap.user_input_nodes():
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor) and val.dim() == 2 and not val.is_floating_point():
            return int(val.shape[1])
    return None


def _param_bytes(cap: Captured) -> int:
    for n in cap.gm.graph.nodes:
        if n.op == "placeholder" and n.name in cap.params:
            val = n.meta["val"]
            if val.is_floating_point():
                return val.element_size()
    return 4


def _units(graph: torch.fx.Graph) -> tuple[dict[str, list[Node]], list[str]]:
    """Op nodes per unit, and the units in execution order (``autopar.display.unit_of``)."""
    units: dict[str, list[Node]] = defaultdict(list)
    order: list[str] = []
    for n in graph.nodes:
        info = n.meta.get(TENSOR)
        if n.op != "call_function" or info is None:
            continue
        u = unit_of(info.module)[0] if info.module else "<top>"
        if u not in units:
            order.append(u)
        units[u].append(n)
    return units, order


def _stages(order: list[str], layers: list[str], pp: int) -> dict[str, int]:
    """Stage of every unit: layers in ``pp`` equal runs; what comes before the first layer on the
    first stage, what comes after the last on the last, anything between with the layer before."""
    per = max(1, len(layers) // pp) if layers else 1
    index = {u: min(i // per, pp - 1) for i, u in enumerate(layers)}
    out, current = {}, 0
    for u in order:
        if u in index:
            current = index[u]
        out[u] = current
    if layers:
        last = order.index(layers[-1])
        for u in order[last + 1 :]:
            out[u] = pp - 1
    return out


def _tensor_parallel_values(graph: torch.fx.Graph, roles: dict[str, str]) -> set[Node]:
    """Values split along the tensor axis under Megatron's layout without sequence parallelism:
    from each column-parallel matmul's output forward to the row-parallel matmuls' inputs."""
    col: set[Node] = set()
    row: set[Node] = set()
    for n in graph.nodes:
        info = n.meta.get(TENSOR)
        role = roles.get(info.fqn, "") if info is not None and info.kind == "param" else ""
        if not role.startswith(("col:", "row:")):
            continue
        frontier = list(n.users)  # the matmuls reading the weight, through transposes and casts
        while frontier:
            u = frontier.pop()
            if op_family(u) is OpFamily.MATMUL:
                (col if role.startswith("col:") else row).add(u)
            elif op_family(u) is OpFamily.VIEW or op_info(u).identity_like:
                frontier.extend(u.users)
    inside: set[Node] = set()
    stack = list(col)
    while stack:
        v = stack.pop()
        if v in inside:
            continue
        inside.add(v)
        stack.extend(u for u in v.users if u not in row and u.op == "call_function")
    return inside


def _layer_input_bytes(nodes: list[Node]) -> float:
    """Bytes of a layer's input (its largest floating-point value read from outside the layer):
    what full recomputation keeps."""
    mine = set(nodes)
    best = 0.0
    for n in nodes:
        for i in n.all_input_nodes:
            info, val = i.meta.get(TENSOR), i.meta.get("val")
            if i in mine or info is None or info.kind in ("param", "buffer"):
                continue
            if isinstance(val, torch.Tensor) and val.is_floating_point():
                best = max(best, float(val.numel() * val.element_size()))
    return best


def format_estimates(estimates: dict[tuple[int, str], MemoryEstimate], budget: float) -> str:
    """The ``autopar memory`` tables: training state per ZeRO stage, activations per stage and
    recomputation mode, and the total of the worst stage for each pair against ``budget``."""
    zeros = sorted({z for z, _ in estimates})
    modes = [r for r in RECOMPUTE if any(rr == r for _, rr in estimates)]
    any_est = next(iter(estimates.values()))
    s0 = any_est.setup
    lines = []
    name = {0: "no ZeRO", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}
    lines.append("training state per device (worst stage)")
    lines.append(f"  {'':<9} {'params':>11} {'grads':>11} {'optimizer':>11} {'total':>11}  bytes/param")
    for z in zeros:
        e = estimates[(z, modes[0])]
        p = e.peak
        bpp, formula = e.bytes_per_param()
        lines.append(
            f"  {name[z]:<9} {fmt_bytes(p.parameters):>11} {fmt_bytes(p.gradients):>11} {fmt_bytes(p.optimizer):>11} "
            f"{fmt_bytes(p.training_state):>11}  {bpp:g}" + (f" = {formula}" if "/" in formula else "")
        )
    sched = (
        "all micro-batches in flight (GPipe)"
        if s0.schedule == "gpipe"
        else "1F1B: pp − stage micro-batches in flight"
    )
    lines.append("")
    lines.append(
        f"activations per device (micro-batch of {any_est.micro_batch} sequence(s)"
        + (f"; {sched}" if s0.pp > 1 else "")
        + ")"
    )
    lines.append(f"  {'stage':<8} {'in flight':>9} " + " ".join(f"{r:>11}" for r in modes))
    for s in range(s0.pp):
        e0 = estimates[(zeros[0], modes[0])]
        row = [fmt_bytes(estimates[(zeros[0], r)].stages[s].activations) for r in modes]
        lines.append(f"  {s:<8} {e0.stages[s].in_flight:>9} " + " ".join(f"{x:>11}" for x in row))
    lines.append("")
    lines.append(f"total per device, worst stage (budget {fmt_bytes(budget)}: ✓ fits, ✗ does not)")
    lines.append(f"  {'':<9} " + " ".join(f"{r:>13}" for r in modes))
    for z in zeros:
        cells = []
        for r in modes:
            t = estimates[(z, r)].peak.total
            cells.append(f"{fmt_bytes(t)} {'✓' if t <= budget else '✗'}")
        lines.append(f"  {name[z]:<9} " + " ".join(f"{c:>13}" for c in cells))
    return "\n".join(lines)

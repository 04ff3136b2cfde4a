"""Pipeline stages: this rank's program cut at the plan's stage boundaries, and each stage's whole
step (forward, input-gradient and weight-gradient programs).

Words:

* **stage** — a contiguous part of the model (by the plan's ``stage_of``: captured node ->
  stage index ``0 … S−1``); with ``v`` virtual stages per rank, rank ``r`` of ``p`` holds stages
  ``r, r + p, …`` (Megatron-LM's interleaved assignment).
* **boundary value** — a value computed by one stage and read by a later one. It is sent from
  its producer to every stage that reads it, directly (a residual or an encoder output that
  skips stages goes straight to its reader). Its gradient travels back the same way.
* **stage program** — the nodes of one stage as a forward program: ``(primals…, received…) ->
  (sent…, outputs…)``; the model's outputs (a loss) come out of the last stage.
* **stage step** — the stage program traced with its backward (``passes.joint``) and split into a
  forward program, an input-gradient program (``B``: the gradients of the received values, which
  the previous stages are waiting for) and a weight-gradient program (``W``: the parameters'
  gradients), as zero-bubble schedules run them (Qi et al., ICLR 2024); other schedules run
  ``B`` and ``W`` back to back.
* **deferred reduction** — with several micro-batches, a weight gradient that is all-reduced over
  the data-parallel axes (and only returned) is reduced once per step, not once per micro-batch:
  every ``W`` but the stage's last runs a *local* weight-gradient program that returns the
  unreduced values, which the runner sums; the last ``W`` adds that sum in before its
  all-reduces (PyTorch DDP's ``no_sync`` and Megatron-LM's gradient accumulation: the reduction
  overlaps only the last micro-batch's backward). ``defer_reductions`` builds the two programs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch.fx import Graph, GraphModule, Node

from autopar.capture import Captured
from autopar.ir import COMPRESS_CAST, TWO_LEVEL
from autopar.passes.joint import JointProgram, subprogram
from autopar.planfile import Plan
from autopar.program.records import RankStages, StageStep

__all__ = [
    "STAGE",
    "RankStages",
    "StageProgram",
    "StageStep",
    "assign_stages",
    "cut_stages",
    "defer_reductions",
    "differentiable_values",
    "params_held",
    "split_backward",
    "stage_holders",
    "stage_inputs",
    "stage_step",
]

STAGE = "autopar.stage"
SOURCE = "autopar.source"


@dataclass
class StageProgram:
    """One stage's forward program and how it connects to the others."""

    stage: int
    gm: GraphModule
    primals: tuple[int, ...]
    """Indices (into the whole program's placeholders) of the primals this stage reads."""
    received: tuple[str, ...]
    """Boundary values this stage reads, by the name of their node in the whole program."""
    sent: tuple[str, ...]
    """Boundary values this stage computes for later stages."""
    producer: dict[str, int] = field(default_factory=dict)
    """Received value -> the stage that computes it."""
    readers: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """Sent value -> the stages that read it."""
    num_outputs: int = 0
    """The model's outputs this stage returns after the sent values (the last stage: all)."""


BOUNDARY = ("stage", "primals", "received", "sent", "producer", "readers", "num_outputs")
"""The fields of a ``StageProgram`` its step record (``StageStep``) takes over as they are: which
stage it is and how it connects to the others (``stage_step``)."""


def _stage(n: Node) -> int | None:
    return n.meta.get(STAGE)


def cut_stages(program: GraphModule, num_stages: int) -> list[StageProgram]:
    """Cut ``program`` (lowered with ``stage_of``, values propagated with ``propagate_fake``) into
    its stages (see module docstring). Raises ``ValueError`` when a stage reads a value of a later
    stage (the cut is not a pipeline)."""
    g = program.graph
    phs = [n for n in g.nodes if n.op == "placeholder"]
    out = next(n for n in g.nodes if n.op == "output")
    last = num_stages - 1

    def stage_of(n: Node) -> int:
        s = _stage(n)
        if s is None:  # a node emitted for no captured node: with its first reader
            readers = [u for u in n.users if u.op != "output"]
            s = min((stage_of(u) for u in readers), default=last)
            n.meta[STAGE] = s
        return s

    compute = [n for n in g.nodes if n.op == "call_function"]
    for n in compute:
        stage_of(n)
    # Boundary values: a stage's value read by another stage (or returned by the model).
    readers: dict[Node, set[int]] = {}
    for n in compute:
        s = stage_of(n)
        for u in n.users:
            t = last if u is out else stage_of(u) if u.op == "call_function" else s
            if t < s:
                raise ValueError(
                    f"stage {t} reads {n.name}, computed by the later stage {s}: the stage cut is not a pipeline "
                    f"(every value must flow to the same or a later stage)"
                )
            if t != s:
                readers.setdefault(n, set()).add(t)
    stages = []
    for s in range(num_stages):
        sg = Graph()
        env: dict[Node, Node] = {}
        mine = [n for n in compute if stage_of(n) == s]
        used_primals = sorted(
            {phs.index(i) for n in mine for i in n.all_input_nodes if i.op == "placeholder"}
            | ({phs.index(o) for o in out.all_input_nodes if o.op == "placeholder"} if s == last else set())
        )
        for i in used_primals:
            env[phs[i]] = sg.placeholder(phs[i].name)
            env[phs[i]].meta.update(phs[i].meta)
        received = [
            i for n in mine for i in n.all_input_nodes if i.op == "call_function" and stage_of(i) != s
        ]
        if s == last:
            received += [i for i in out.all_input_nodes if i.op == "call_function" and stage_of(i) != s]
        received = list(dict.fromkeys(received))
        for r in received:
            env[r] = sg.placeholder(f"recv_{r.name}")
            env[r].meta.update(r.meta)

        def arg(x: Node, env: dict[Node, Node] = env, sg: Graph = sg) -> Node:
            if x not in env and x.op == "get_attr":
                env[x] = sg.get_attr(x.target)
            return env[x]

        for n in mine:
            env[n] = sg.node_copy(n, arg)
        sent = [n for n in mine if n in readers]
        outs: list[object] = [env[n] for n in sent]
        num_outputs = 0
        if s == last:
            model_outs = out.args[0]
            flat = list(model_outs) if isinstance(model_outs, (tuple, list)) else [model_outs]
            outs += [arg(o) if isinstance(o, Node) else o for o in flat]
            num_outputs = len(flat)
        sg.output(tuple(outs))
        sg.lint()
        stages.append(
            StageProgram(
                stage=s,
                gm=GraphModule(program, sg, class_name=f"Stage{s}Program"),
                primals=tuple(used_primals),
                received=tuple(r.name for r in received),
                sent=tuple(n.name for n in sent),
                producer={r.name: stage_of(r) for r in received},
                readers={n.name: tuple(sorted(readers[n])) for n in sent},
                num_outputs=num_outputs,
            )
        )
    return stages


# ------------------------------------------------------------------------------------ stage steps


def split_backward(jp: JointProgram, num_primals: int) -> tuple:
    """Split the joint program ``jp`` (``passes.joint.JointProgram``) into forward, input-gradient
    and weight-gradient programs: backward nodes that the gradients of placeholders ``>=
    num_primals`` (received values) need form ``B``; the rest (parameter gradients) form ``W``."""
    from autopar.graph import output_node
    from autopar.ir import PHASE, Phase

    gm = jp.gm
    out = output_node(gm)
    outs = list(out.args[0])
    grads = outs[jp.num_outputs :]
    pos = {p: i for i, p in enumerate(jp.grad_primals)}
    input_grads = [grads[pos[p]] for p in jp.grad_primals if p >= num_primals]
    weight_grads = [grads[pos[p]] for p in jp.grad_primals if p < num_primals]
    fwd = [n for n in gm.graph.nodes if n.op != "output" and n.meta.get(PHASE) == Phase.FWD]
    bwd = [n for n in gm.graph.nodes if n.op != "output" and n.meta.get(PHASE) == Phase.BWD]
    fwd_set, bwd_set = set(fwd), set(bwd)
    need_i: set[Node] = set()
    stack = [g for g in input_grads if isinstance(g, Node) and g in bwd_set]
    while stack:
        n = stack.pop()
        if n in need_i or n not in bwd_set:
            continue
        need_i.add(n)
        stack.extend(n.all_input_nodes)
    tangents = [n for n in bwd if n.op == "placeholder"]
    b_nodes = [n for n in bwd if n in need_i or n.op == "placeholder"]
    w_nodes = [n for n in bwd if n not in need_i and n.op != "placeholder"]

    def reads(nodes: list[Node], pool: set[Node]) -> list[Node]:
        seen: dict[Node, None] = {}
        for n in nodes:
            for i in n.all_input_nodes:
                if i in pool:
                    seen[i] = None
        return list(seen)

    saved_i = reads(b_nodes, fwd_set)
    saved_w_nodes = reads(w_nodes, fwd_set) + [
        g for g in weight_grads if isinstance(g, Node) and g in fwd_set
    ]
    saved_w_nodes = list(dict.fromkeys(saved_w_nodes))
    passed = reads(w_nodes, set(b_nodes)) + [g for g in weight_grads if isinstance(g, Node) and g in need_i]
    passed = list(dict.fromkeys(passed))
    saved = list(dict.fromkeys(saved_i + saved_w_nodes))

    primal_phs = [n for n in fwd if n.op == "placeholder"]
    forward = subprogram(gm, "StageForward", primal_phs, fwd, [*outs[: jp.num_outputs], *saved])
    backward_input = subprogram(
        gm, "StageBackwardInput", saved_i + tangents, b_nodes, [*input_grads, *passed]
    )
    backward_weight = subprogram(gm, "StageBackwardWeight", saved_w_nodes + passed, w_nodes, weight_grads)
    return (
        forward,
        backward_input,
        backward_weight,
        len(saved_i),
        tuple(saved.index(s) for s in saved_w_nodes),
    )


def stage_inputs(
    sp: StageProgram, primals: Sequence[object], trainable: Sequence[int], differentiable: set[str] | None
) -> tuple[list[object], list[int]]:
    """``(examples, grad)``: example values of stage ``sp``'s inputs — the whole program's primals
    it reads (``primals``: one per placeholder of the whole program; only shapes are read), then
    the values it receives (their recorded values) — and which of them get a gradient: the
    trainable parameters among them (``trainable``: indices into the whole program's primals)
    and the floating-point received values a gradient flows back through (``differentiable``)."""
    phs = [n for n in sp.gm.graph.nodes if n.op == "placeholder"]
    n = len(sp.primals)
    examples = [primals[i] for i in sp.primals] + [phs[n + k].meta["val"] for k in range(len(sp.received))]
    floats = [
        n + k
        for k, r in enumerate(sp.received)
        if isinstance(examples[n + k], torch.Tensor)
        and examples[n + k].is_floating_point()
        and (differentiable is None or r in differentiable)
    ]
    params = [j for j, i in enumerate(sp.primals) if i in set(trainable)]
    return examples, params + floats


def stage_step(
    sp: StageProgram,
    jp: JointProgram,
    examples: Sequence[object],
    differentiable: set[str] | None = None,
    microbatches: int = 1,
) -> StageStep:
    """Stage ``sp``'s step record from its traced step ``jp`` (rewritten by the rank-program
    passes; ``examples``: its inputs, ``stage_inputs``), split into forward, input-gradient and
    weight-gradient programs (see module docstring). ``differentiable``: the boundary values a
    gradient flows back through (``differentiable_values``): the stage computes gradients for the
    received ones among them, and must be handed gradients for exactly the sent ones among them
    (else the ranks would wait for each other forever); ``microbatches`` > 1: data-parallel
    gradient reductions are deferred to the stage's last micro-batch (``defer_reductions``)."""
    from autopar.passes.joint import mark_phases_keep

    mark_phases_keep(jp)
    if differentiable is not None:
        want = {i for i, v in enumerate(sp.sent) if v in differentiable}
        got = {i for i in jp.tangent_outputs if i < len(sp.sent)}
        if want != got:
            names = sorted(sp.sent[i] for i in want ^ got)
            raise RuntimeError(
                f"stage {sp.stage}: autograd and the graph disagree on whether a gradient flows back through "
                f"{names}; the pipeline cannot be cut there (report this with the model)"
            )
    fwd, bwd_i, bwd_w, n_saved_i, saved_w = split_backward(jp, len(sp.primals))
    local_w, last_w, deferred = defer_reductions(bwd_w) if microbatches > 1 else (None, bwd_w, 0)
    return StageStep(
        **{f: getattr(sp, f) for f in BOUNDARY},
        forward=fwd,
        backward_input=bwd_i,
        backward_weight=last_w,
        backward_weight_local=local_w,
        num_deferred=deferred,
        joint=jp.gm,
        num_saved_i=n_saved_i,
        saved_w=saved_w,
        tangent_outputs=jp.tangent_outputs,
        received_grads=tuple(p - len(sp.primals) for p in jp.grad_primals if p >= len(sp.primals)),
        param_grads=tuple(p for p in jp.grad_primals if p < len(sp.primals)),
        received_meta=[
            (tuple(examples[len(sp.primals) + k].shape), examples[len(sp.primals) + k].dtype)
            for k in range(len(sp.received))
        ],
    )


def defer_reductions(bwd_w: GraphModule) -> tuple[GraphModule | None, GraphModule, int]:
    """``(local, last, k)``: the weight-gradient program ``bwd_w`` split for gradient accumulation
    (module docstring, deferred reduction). The ``k`` deferred reductions are the all-reduce
    (sum) issues whose waited result reaches only the outputs, through views (data-parallel
    weight gradients and their buckets, ``passes.overlap.bucket_gradients``).

    * ``local(*inputs) -> (*grads, *unreduced)``: the gradients the reductions produce are
      ``None``; ``unreduced`` are the ``k`` values the all-reduces would have summed.
    * ``last(*inputs, *sums) -> grads``: ``bwd_w`` with each reduction's input increased by the
      matching sum of the earlier micro-batches' unreduced values before it is all-reduced.

    ``(None, bwd_w, 0)`` when nothing is deferred."""
    from autopar.passes.collective_nodes import is_issue, is_wait, only_returned
    from autopar.program.compression import PowerSGDReduce

    def deferrable(g: Graph) -> list[Node]:
        out = output_node_of(g)
        return [
            n
            for n in g.nodes
            if (
                is_issue(n)
                and n.target is torch.ops._c10d_functional.all_reduce.default
                and n.args[1] == "sum"
                and len(n.users) == 1
                and is_wait(next(iter(n.users)))
                and only_returned(next(iter(n.users)), out)
            )
            or (is_issue(n) and n.meta.get(TWO_LEVEL, False))
            or (
                n.op == "call_module"
                and isinstance(g.owning_module.get_submodule(n.target), PowerSGDReduce)
                and only_returned(n, out)
            )
        ]

    def summed(issue: Node) -> Node:
        """The value a deferred reduction sums: its input, or before a compression's cast
        (``passes.compress``) the gradient in its own precision."""
        x = issue.args[0]
        return x.args[0] if x.meta.get(COMPRESS_CAST) else x

    def output_node_of(g: Graph) -> Node:
        return next(n for n in reversed(g.nodes) if n.op == "output")

    if not deferrable(bwd_w.graph):
        return None, bwd_w, 0

    # The last micro-batch: sums in before the all-reduces.
    last = GraphModule(bwd_w, _copy_graph(bwd_w.graph), class_name="StageBackwardWeightLast")
    issues = deferrable(last.graph)
    phs = [n for n in last.graph.nodes if n.op == "placeholder"]
    sums = []
    with last.graph.inserting_after(phs[-1]):
        for k in reversed(range(len(issues))):
            sums.insert(0, last.graph.placeholder(f"deferred_sum_{k}"))
    for issue, acc in zip(issues, sums):
        x = summed(issue)
        reader = issue if x is issue.args[0] else issue.args[0]
        acc.meta.update({k: v for k, v in x.meta.items() if k == "val"})
        with last.graph.inserting_before(reader):
            added = last.graph.call_function(torch.ops.aten.add.Tensor, (x, acc))
        added.meta.update({k: v for k, v in reader.meta.items() if k != COMPRESS_CAST})
        added.meta.update({k: v for k, v in x.meta.items() if k == "val"})
        reader.update_arg(0, added)
    last.graph.lint()
    last.recompile()

    # Every other micro-batch: no reduction, the unreduced values returned.
    local = GraphModule(bwd_w, _copy_graph(bwd_w.graph), class_name="StageBackwardWeightLocal")
    g = local.graph
    issues = deferrable(g)
    out = output_node_of(g)
    reduced: set[Node] = set()
    stack = [i if i.op == "call_module" else next(iter(i.users)) for i in issues]
    while stack:
        n = stack.pop()
        if n in reduced or n is out:
            continue
        reduced.add(n)
        stack.extend(n.users)
    grads = [None if isinstance(r, Node) and r in reduced else r for r in out.args[0]]
    unreduced = [summed(i) for i in issues]
    out.args = ((*grads, *unreduced),)
    for n in reversed(list(g.nodes)):  # collectives count as side effects: erase them by hand
        if (n in reduced or n in issues) and not n.users:
            g.erase_node(n)
    g.eliminate_dead_code()
    g.lint()
    local.recompile()
    return local, last, len(unreduced)


def _copy_graph(g: Graph) -> Graph:
    new = Graph()
    env: dict[Node, Node] = {}
    out = new.graph_copy(g, env)
    new.output(out)
    return new


_NO_GRAD = frozenset(("detach", "detach_", "alias_no_grad"))


def differentiable_values(program: GraphModule, trainable: Sequence[int]) -> set[str]:
    """Names of the values of ``program`` a gradient flows back through: floating-point values
    computed from a trainable parameter (every rank computes the same set from the whole program,
    so a stage and the stages it talks to agree on which boundary values carry gradients)."""
    phs = [n for n in program.graph.nodes if n.op == "placeholder"]
    rg = {phs[i] for i in trainable}
    for n in program.graph.nodes:
        if n.op != "call_function" or str(getattr(n.target, "__name__", n.target)).split(".")[0] in _NO_GRAD:
            continue
        v = n.meta.get("val")
        if isinstance(v, torch.Tensor) and not v.is_floating_point():
            continue
        if any(i in rg for i in n.all_input_nodes):
            rg.add(n)
    return {n.name for n in rg}


def assign_stages(num_stages: int, pp: int) -> dict[int, int]:
    """Stage -> pipeline coordinate: stage ``s`` on coordinate ``s mod pp`` (with ``v`` stages per
    rank, rank ``r`` holds ``r, r + pp, …``: Megatron-LM's interleaved assignment)."""
    if num_stages % pp:
        raise ValueError(f"{num_stages} stages do not spread evenly over pp={pp} ranks")
    return {s: s % pp for s in range(num_stages)}


def stage_holders(
    stages: Sequence[StageProgram], roles: Sequence[tuple[str, str]], stage_coord: dict[int, int]
) -> dict[str, list[int]]:
    """Parameter or buffer name -> the pipeline coordinates whose stages read it (several: a tied
    weight, whose gradients the runtime sums between them). ``roles``: ``(kind, name)`` of each
    primal of the whole program."""
    holders: dict[str, list[int]] = {}
    for sp in stages:
        for i in sp.primals:
            kind, name = roles[i]
            if kind in ("param", "buffer"):
                holders.setdefault(name, [])
                if stage_coord[sp.stage] not in holders[name]:
                    holders[name].append(stage_coord[sp.stage])
    return holders


def params_held(cap: Captured, plan: Plan, coord: int) -> set[str] | None:
    """The parameters and buffers (FQNs) pipeline coordinate ``coord``'s stages read, which its
    rank holds (``None``: every one, a plan without pipeline). Read off the captured graph as the
    lowering tags its program (``passes.lower``: each node emitted for a captured node is in that
    node's stage, one without a stage in the stage before it), so it is known before lowering.
    Raises ``ValueError`` where a pipeline rank would hold no parameter (the same on every rank)."""
    from autopar.graph import OpFamily, op_family

    pipe = plan.pipeline
    if pipe is None:
        return None
    reads: list[set[str]] = [set() for _ in range(pipe.pp)]
    params: list[set[str]] = [set() for _ in range(pipe.pp)]
    stage = 0
    for node in cap.graph.nodes:
        if node.op not in ("call_function", "output"):
            continue
        stage = pipe.stage_of.get(node.name, stage)
        if node.op == "call_function" and op_family(node) is OpFamily.ASSERT:
            continue  # left out of the program
        for i in node.all_input_nodes:
            if i.op == "placeholder" and (i.name in cap.params or i.name in cap.buffers):
                reads[stage % pipe.pp].add(cap.params.get(i.name, cap.buffers.get(i.name)))
                if i.name in cap.params:
                    params[stage % pipe.pp].add(i.name)
    empty = [c for c in range(pipe.pp) if not params[c]]
    if empty:  # the same on every rank: each raises, none waits
        raise ValueError(
            f"pipeline rank(s) {empty} of this plan hold no parameter (their stages read none): "
            f"torch.optim.AdamW(pm.parameters()) would raise 'optimizer got an empty parameter list' there. "
            f"autopar's stage cuts never make such a stage (autopar.passes.stages): plan again, or with fewer "
            f"pipeline stages"
        )
    return reads[coord]

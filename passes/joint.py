"""The whole training step as one per-rank program: forward and backward in one fx graph.

The lowering (``passes.lower``) gives this rank's *forward* program, whose collectives are
autograd Functions (``autopar.program.collectives``). ``trace_joint`` runs that program and
``torch.autograd.grad`` under ``make_fx`` with fake tensors, recording every op either direction
executes — the forward's collectives and their backward conjugates alike — as nodes of one graph,
each collective issued (``_c10d_functional.*``) and completed by an explicit ``wait_tensor`` node.
Passes then reorder and rewrite that graph (``passes.overlap``: bucketing, prefetch, wait
sinking; ``passes.recompute``); ``partition`` finally splits it into the forward and backward
programs the runtime runs around the user's ``loss.backward()`` (``step_program``: the step
record). The per-rank compiler (``passes.rank_compiler``) runs these in order.

Words:

* **primal** — an input of the program: a parameter, buffer, user input or lifted constant, in
  the order of the forward program's placeholders.
* **tangent** — the gradient arriving for one output of the forward program (for a loss: the
  scalar ``loss.backward()`` passes, 1.0 by default).
* **joint program** — ``(primals…, tangents…) -> (outputs…, gradients…)``: the gradients of the
  primals that require one (parameters), in order.
* **phase** — every node is ``fwd`` (needed for the outputs) or ``bwd`` (the rest), written as
  ``node.meta["autopar.phase"]``. A node a pass moves or copies into backward becomes ``bwd``.
* **saved values** — forward values the backward program reads: the forward program returns them
  after its outputs, the backward program takes them before the tangents.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch.fx import Graph, GraphModule, Node

from autopar.graph import mutates, output_node
from autopar.ir import PHASE, RANK, Phase, PrimalInfo, RankInfo
from autopar.program.records import StepProgram

__all__ = [
    "PHASE",  # the joint program's records are autopar.ir's, named here too
    "RANK",
    "JointProgram",
    "Partitioned",
    "Phase",
    "PrimalInfo",
    "RankInfo",
    "mark_phases",
    "partition",
    "step_program",
    "subprogram",
    "trace_joint",
]


@dataclass
class JointProgram:
    """A traced training step (see module docstring)."""

    gm: GraphModule
    num_primals: int
    num_outputs: int
    """Outputs of the forward program (the first outputs of ``gm``)."""
    grad_primals: tuple[int, ...]
    """Primal indices whose gradient ``gm`` returns after the outputs, in this order."""
    tangent_outputs: tuple[int, ...]
    """Output indices that take a tangent, in the order of the tangent placeholders."""
    info: dict[str, object] = field(default_factory=dict)

    @property
    def code(self) -> str:
        return self.gm.code


def _is_float_tensor(x: object) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point()


@torch.library.custom_op("autopar::tangent_of", mutates_args=())
def tangent_of(output: torch.Tensor) -> torch.Tensor:
    """A stand-in, while ``trace_joint`` traces, for the tangent arriving for ``output`` (a value
    like it, contiguous: the gradient a next pipeline stage sends, or autograd passes, is); ``trace_joint``
    turns each call into a tangent placeholder, so no program runs it."""
    return torch.empty_like(output, memory_format=torch.contiguous_format)


@tangent_of.register_fake
def _(output: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(output, memory_format=torch.contiguous_format)


def trace_joint(
    program: GraphModule, primals: Sequence[torch.Tensor | object], grad_primals: Sequence[int]
) -> JointProgram:
    """Trace ``program`` (this rank's forward program) and its backward into one graph.

    ``primals`` are example values of the program's inputs (real or fake; only shapes, dtypes and
    devices are read); ``grad_primals`` the indices of those that get gradients (trainable
    parameters). Tracing uses fake tensors: no collective runs and no memory is allocated.

    One trace: which outputs carry a gradient, and so take a tangent, is read while tracing (an
    output that requires grad); each tangent is traced as ``tangent_of(output)`` and becomes a
    placeholder after the primals' (``_tangent_placeholders``), as if it had been an input.
    """
    import torch.fx.traceback as fx_traceback
    from torch.fx._lazy_graph_module import _use_lazy_graph_module
    from torch.fx.experimental.proxy_tensor import make_fx

    num_primals = len(primals)
    used: list[int] = []
    traced: dict[str, object] = {}

    def joint(*args: object) -> tuple:
        ps = list(args)
        for i in grad_primals:
            ps[i] = ps[i].detach().requires_grad_(True)
        with torch.enable_grad():
            # Run node by node so each traced node keeps its source's ``meta["custom"]``
            # (the captured node it was lowered from: recomputation finds layers by it).
            outs = (
                torch.fx.Interpreter(program).run(*ps) if isinstance(program, GraphModule) else program(*ps)
            )
        flat = list(outs) if isinstance(outs, (tuple, list)) else [outs]
        tangent_outputs = tuple(
            i for i, o in enumerate(flat) if _is_float_tensor(o) and o.requires_grad and o.grad_fn is not None
        )
        traced.update(num_outputs=len(flat), tangent_outputs=tangent_outputs)
        diff = [flat[i] for i in tangent_outputs]
        ts = [tangent_of(o.detach()) for o in diff]
        params = [ps[i] for i in grad_primals]
        grads = torch.autograd.grad(diff, params, ts, allow_unused=True) if diff else [None] * len(params)
        used.clear()
        used.extend(i for i, g in zip(grad_primals, grads) if g is not None)
        return (
            *[o.detach() if isinstance(o, torch.Tensor) else o for o in flat],
            *[g for g in grads if g is not None],
        )

    # A lazy GraphModule (torch.fx's, as AOTAutograd makes them): the rank-program passes that
    # rewrite it each call ``recompile()``, but its Python code is generated once, where it is
    # first run or read (``gm.code``), not after every pass.
    with fx_traceback.preserve_node_meta(), _use_lazy_graph_module(True):
        gm = make_fx(joint, tracing_mode="fake", _allow_non_fake_inputs=True)(*primals)
    _tangent_placeholders(gm)
    _strip_detach_noise(gm)
    jp = JointProgram(
        gm=gm,
        num_primals=num_primals,
        num_outputs=traced["num_outputs"],  # type: ignore[arg-type]
        grad_primals=tuple(used),
        tangent_outputs=traced["tangent_outputs"],  # type: ignore[arg-type]
    )
    mark_phases(jp)
    return jp


def _tangent_placeholders(gm: GraphModule) -> None:
    """Each ``tangent_of`` node of a traced joint step becomes a placeholder, in order, after the
    primals' placeholders (``trace_joint``)."""
    marks = [
        n
        for n in gm.graph.nodes
        if n.op == "call_function" and n.target is torch.ops.autopar.tangent_of.default
    ]
    anchor = [n for n in gm.graph.nodes if n.op == "placeholder"][-1]
    for k, mark in enumerate(marks):
        with gm.graph.inserting_after(anchor):
            ph = gm.graph.placeholder(f"tangent_{k}")
        for key in ("val", "tensor_meta"):
            if key in mark.meta:
                ph.meta[key] = mark.meta[key]
        mark.replace_all_uses_with(ph)
        gm.graph.erase_node(mark)
        anchor = ph


def _strip_detach_noise(gm: GraphModule) -> None:
    """Drop ``detach`` nodes autograd records around saved values: they copy no data and would
    only clutter the program."""
    for n in list(gm.graph.nodes):
        if n.op == "call_function" and n.target is torch.ops.aten.detach.default:
            n.replace_all_uses_with(n.args[0])
            gm.graph.erase_node(n)
    gm.graph.lint()
    gm.recompile()


def placeholders(jp: JointProgram) -> tuple[list[Node], list[Node]]:
    """(primal placeholders, tangent placeholders) of ``jp.gm``."""
    phs = [n for n in jp.gm.graph.nodes if n.op == "placeholder"]
    return phs[: jp.num_primals], phs[jp.num_primals :]


def _forward_mutations(gm: GraphModule, num_primals: int) -> list[Node]:
    """In-place ops run by the forward: they mutate a value that does not depend on a tangent and
    come before the first node that does (the trace records forward before backward). Their
    result may be unused — the write is what matters — so they are forward roots."""
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    tangent_dep: set[Node] = set(phs[num_primals:])
    first_bwd = None
    out = []
    for i, n in enumerate(gm.graph.nodes):
        if n.op in ("placeholder", "output"):
            continue
        if any(a in tangent_dep for a in n.all_input_nodes):
            tangent_dep.add(n)
            if first_bwd is None:
                first_bwd = i
            continue
        if first_bwd is None and mutates(n):
            out.append(n)
    return out


def mark_phases(jp: JointProgram) -> None:
    """Write ``Phase`` on every node: ``fwd`` for what the outputs need (placeholders of primals
    included) and the forward's in-place writes, ``bwd`` for everything else (tangents and what
    depends on them, and forward-only ops that backward alone reads)."""
    out = output_node(jp.gm)
    outs = out.args[0]
    fwd: set[Node] = set()
    stack = [o for o in outs[: jp.num_outputs] if isinstance(o, Node)]
    stack += _forward_mutations(jp.gm, jp.num_primals)
    primals, _ = placeholders(jp)
    fwd.update(primals)
    while stack:
        n = stack.pop()
        if n in fwd:
            continue
        fwd.add(n)
        stack.extend(n.all_input_nodes)
    for n in jp.gm.graph.nodes:
        if n.op == "output":
            continue
        n.meta[PHASE] = Phase.FWD if n in fwd else Phase.BWD
    _getitems_follow_their_source(jp.gm)


def _getitems_follow_their_source(gm: GraphModule) -> None:
    """An element of a forward op's tuple output is a forward value (what gets saved is the
    element, never the tuple)."""
    for n in gm.graph.nodes:
        if is_getitem(n) and n.args[0].meta.get(PHASE) == Phase.FWD:
            n.meta[PHASE] = Phase.FWD


@dataclass
class Partitioned:
    """The forward and backward programs of a joint program."""

    forward: GraphModule
    """``primals -> (outputs…, saved…)``."""
    backward: GraphModule
    """``(saved…, tangents…) -> gradients`` (in ``JointProgram.grad_primals`` order)."""
    num_outputs: int
    saved: tuple[str, ...]
    """Names of the saved values (forward nodes or primals read by backward)."""


def partition(jp: JointProgram) -> Partitioned:
    """Split ``jp`` by phase: forward nodes run in the forward program, the others in backward;
    every forward value a backward node reads is saved (returned by forward, passed to backward)."""
    g = jp.gm.graph
    out = output_node(jp.gm)
    outs = list(out.args[0])
    fwd_nodes = [n for n in g.nodes if n.op != "output" and n.meta.get(PHASE) == Phase.FWD]
    bwd_nodes = [n for n in g.nodes if n.op != "output" and n.meta.get(PHASE) == Phase.BWD]
    fwd_set = set(fwd_nodes)
    grads = outs[jp.num_outputs :]
    saved: list[Node] = []
    seen: set[Node] = set()
    for n in bwd_nodes:
        for i in n.all_input_nodes:
            if i in fwd_set and i not in seen:
                seen.add(i)
                saved.append(i)
    for gnode in grads:  # a gradient that is a forward value (rare: a constant zero) is saved too
        if isinstance(gnode, Node) and gnode in fwd_set and gnode not in seen:
            seen.add(gnode)
            saved.append(gnode)
    return Partitioned(
        forward=subprogram(jp.gm, "ForwardProgram", [], fwd_nodes, [*outs[: jp.num_outputs], *saved]),
        backward=subprogram(jp.gm, "BackwardProgram", saved, bwd_nodes, grads),
        num_outputs=jp.num_outputs,
        saved=tuple(s.name for s in saved),
    )


def subprogram(
    gm: GraphModule, class_name: str, inputs: Sequence[Node], body: Sequence[Node], results: Sequence[object]
) -> GraphModule:
    """A program of ``gm``'s nodes: a placeholder for each of ``inputs`` (same name and meta), then
    the nodes of ``body`` in order (``gm``'s placeholders among them copied as placeholders; those
    already among ``inputs`` skipped), returning ``results``. Every node ``body`` reads must be
    among ``inputs`` or earlier in ``body``."""
    g = Graph()
    env: dict[Node, Node] = {}
    for i in inputs:
        env[i] = g.placeholder(i.name)
        env[i].meta.update(i.meta)
    for n in body:
        if n not in env:
            env[n] = g.node_copy(n, lambda x: env[x])
    g.output(tuple(env[r] if isinstance(r, Node) else r for r in results))
    g.lint()
    return GraphModule(gm, g, class_name=class_name)


def is_getitem(n: Node) -> bool:
    return n.op == "call_function" and n.target is operator.getitem


# ---------------------------------------------------------------------------------- the step


def step_program(jp: JointProgram, passes: Sequence[str] = ()) -> StepProgram:
    """The step record of ``jp`` (its graph rewritten by the rank-program passes, ``passes``
    naming those that ran): phases of the nodes the passes added, then ``partition``."""
    mark_phases_keep(jp)
    parts = partition(jp)
    return StepProgram(
        joint=jp.gm,
        forward=parts.forward,
        backward=parts.backward,
        num_outputs=jp.num_outputs,
        grad_primals=jp.grad_primals,
        tangent_outputs=jp.tangent_outputs,
        passes=tuple(passes),
    )


def mark_phases_keep(jp: JointProgram) -> None:
    """Phase nodes a pass added without one (copies inherit the phase a pass gave them)."""
    missing = [n for n in jp.gm.graph.nodes if n.op != "output" and PHASE not in n.meta]
    if missing:
        fwd_needed: set[Node] = set()
        stack = [o for o in output_node(jp.gm).args[0][: jp.num_outputs] if isinstance(o, Node)]
        stack += [n for n in jp.gm.graph.nodes if mutates(n) and n.meta.get(PHASE) == Phase.FWD]
        while stack:
            n = stack.pop()
            if n not in fwd_needed:
                fwd_needed.add(n)
                stack.extend(n.all_input_nodes)
        for n in missing:
            n.meta[PHASE] = Phase.FWD if n in fwd_needed else Phase.BWD
    _getitems_follow_their_source(jp.gm)

"""The last pass of the per-rank compiler: each program of this rank's step compiled by Inductor.

``parallelize(..., compile=True)`` runs this after the step record is built
(``passes.rank_compiler``: its ``compile`` pass calls ``compile_agreed``): every program of the
record is handed to Inductor
(``torch._inductor.compile_fx.compile_fx``) once, and the compiled callable is stored beside the
graph in the record's ``compiled`` (``autopar.program.records``), which the runtime then runs in
its place. The graphs themselves are left as they are: ``pm.code`` prints them and the collectives
are counted from them.

Words:

* **program** — one fx graph of a step record: a ``StepProgram``'s ``forward`` and ``backward``,
  a ``StageStep``'s ``forward``, ``backward_input``, ``backward_weight`` (and
  ``backward_weight_local``). Its nodes are ATen ops, the fused kernels' ``autopar::`` custom ops,
  and collectives as PyTorch's functional collectives: an issue
  (``torch.ops._c10d_functional.all_reduce`` …) and its ``wait_tensor``.
* **flat boundary** — Inductor takes and returns tensors and numbers only, while a program may
  pass a tuple across (a pipeline stage's input-gradient program hands a ``native_layer_norm``
  backward's tuple to its weight-gradient program): the compiled copy takes each such tuple as
  its elements and returns them one by one, and the compiled program packs and unpacks them, so
  it is called exactly as the graph is.
* **example inputs** — fake tensors of the shapes, strides and dtypes the trace recorded on the
  program's placeholders (``meta["val"]``): compiling allocates nothing and runs no collective.
* **guard** — the compiled program is specialized to those shapes (the plan fixes every shape:
  no dynamic shapes, nothing to recompile). Each call checks its inputs against them: another
  shape or dtype is refused with an error naming the program and the input; another layout
  (strides) of the right shape is copied into the compiled layout.

Why Inductor sees the programs as they are: the collectives are already the functional
collectives Inductor lowers natively (a collective kernel per issue, a wait per ``wait_tensor``,
each where the program put it — ``passes.overlap`` chose that order and no reordering pass of
Inductor's is turned on), and the fused Triton kernels are ``torch.library`` custom ops with fake
implementations, which Inductor calls as opaque kernels. Every rank of a group compiles the same
program with the same settings, so they issue their collectives in the same order. Random ops
keep eager PyTorch's generator (``fallback_random``): the compiled step draws what the eager step
draws, so a plan trains the same compiled or not. A program calling a plain Python function
(the RNG replay of recomputation, ``autopar.program.rng``) is refused rather than compiled:
Inductor cannot lower it, and a re-trace through it could bake the generator state it reads into a
constant.

Why ``compile_fx`` on the graphs rather than ``torch.compile``: the programs are ATen graphs with no
Python left to trace, so Dynamo would add per-call guards and a first-call compile without
adding anything; compiling at ``parallelize`` time lets every rank agree on the outcome (all
compiled, or all eager) before the first step, and times the compilation on its own.
"""

from __future__ import annotations

import copy
import logging
import operator
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.fx import GraphModule

from autopar.program.records import CompileReport, StageStep, StepProgram

__all__ = ["CompileError", "CompiledProgram", "compile_agreed", "compile_program", "compile_records"]

log = logging.getLogger("autopar.passes")

INDUCTOR_OPTIONS: dict[str, Any] = {"fallback_random": True}
"""Inductor settings every program is compiled with (see module docstring)."""


class CompileError(RuntimeError):
    """Inductor could not compile a program; the message names the program and the cause."""


class CompiledProgram:
    """A program compiled by Inductor, called like the graph it was compiled from (see the guard in
    the module docstring)."""

    __slots__ = ("_fn", "in_arity", "name", "out_arity", "seconds", "signature")

    def __init__(
        self,
        name: str,
        fn: Callable[..., Any],
        signature: Sequence[tuple[torch.Size, tuple[int, ...], torch.dtype, torch.device] | None],
        seconds: float,
        in_arity: Sequence[int | None] = (),
        out_arity: Sequence[int | None] = (),
    ) -> None:
        self.name = name
        self.in_arity = tuple(in_arity)
        """Per input of the graph: ``None`` (one value) or the length of the tuple it passes."""
        self.out_arity = tuple(out_arity)
        """Per output of the graph: ``None`` (one value) or the length of the tuple it returns."""
        self._fn = fn
        """``compile_fx``'s callable for a plain graph: positional inputs, as the graph takes them
        (its ``_boxed_call`` attribute is copied from the inner function and does not apply)."""
        self.signature = tuple(signature)
        """Per input: ``(shape, stride, dtype, device)`` it was compiled for, ``None`` for a number."""
        self.seconds = seconds
        """Seconds Inductor took."""

    def __repr__(self) -> str:
        return f"CompiledProgram({self.name}, {len(self.signature)} inputs, compiled in {self.seconds:.1f} s)"

    def __call__(self, *args: Any) -> Any:
        if self.in_arity:
            args = tuple(_flatten(args, self.in_arity))
        if len(args) != len(self.signature):
            raise TypeError(f"compiled {self.name}: {len(args)} inputs, compiled for {len(self.signature)}")
        conformed = list(args)
        for i, (x, sig) in enumerate(zip(args, self.signature)):
            if sig is None or not isinstance(x, torch.Tensor):
                continue
            shape, stride, dtype, device = sig
            if x.shape != shape or x.dtype != dtype or x.device != device:
                raise ValueError(
                    f"compiled {self.name}: input {i} is {tuple(x.shape)} {x.dtype} on {x.device}, but the "
                    f"program was compiled for {tuple(shape)} {dtype} on {device}: the plan fixes every shape "
                    f"(feed batches of the planned shape, or parallelize again for the new one)"
                )
            if x.stride() != stride and _strides_matter(shape, x.stride(), stride):
                conformed[i] = torch.empty_strided(shape, stride, dtype=dtype, device=device).copy_(x)
        outs = self._fn(*conformed)
        return tuple(_pack(outs, self.out_arity)) if self.out_arity else outs


def _flatten(values: Sequence[Any], arity: Sequence[int | None]) -> list[Any]:
    flat: list[Any] = []
    for v, k in zip(values, arity):
        if k is None:
            flat.append(v)
        else:
            flat.extend(v)
    return flat


def _pack(flat: Sequence[Any], arity: Sequence[int | None]) -> list[Any]:
    out: list[Any] = []
    at = 0
    for k in arity:
        if k is None:
            out.append(flat[at])
            at += 1
        else:
            out.append(tuple(flat[at : at + k]))
            at += k
    return out


def _strides_matter(shape: Sequence[int], got: Sequence[int], want: Sequence[int]) -> bool:
    """Whether two strides of one shape lay its elements out differently (a dimension of size 1
    may have any stride)."""
    return any(n > 1 and a != b for n, a, b in zip(shape, got, want))


def _check_ops(gm: GraphModule, name: str) -> None:
    """Refuse a program Inductor would compile wrongly or not at all: a node calling anything but
    an operator (see module docstring), or a graph without recorded shapes."""
    for n in gm.graph.nodes:
        if n.op == "call_function":
            if isinstance(n.target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
                continue
            if n.target is operator.getitem:
                continue
            what = getattr(n.target, "__qualname__", repr(n.target))
            raise CompileError(
                f"{name}: node {n.name} calls the Python function {what}, which Inductor cannot compile "
                f"faithfully ({n.format_node()})"
            )
        if n.op in ("call_module", "call_method"):
            raise CompileError(
                f"{name}: node {n.name} is a {n.op} ({n.format_node()}); expected ATen ops only"
            )


def _example_inputs(gm: GraphModule, name: str) -> tuple[list[Any], list[Any]]:
    """Fake example inputs from the placeholders' recorded values, and the guard's signature."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    examples: list[Any] = []
    signature: list[Any] = []
    for n in gm.graph.nodes:
        if n.op != "placeholder":
            continue
        v = n.meta.get("val")
        if isinstance(v, torch.Tensor):
            shape, stride = tuple(v.shape), tuple(v.stride())
            if not all(isinstance(d, int) for d in (*shape, *stride)):
                raise CompileError(
                    f"{name}: input {n.name} has a data-dependent shape {shape} (a MoE dispatch's rows); "
                    f"Inductor compiles fixed shapes only here"
                )
            with mode:
                examples.append(torch.empty_strided(shape, stride, dtype=v.dtype, device=v.device))
            signature.append((torch.Size(shape), stride, v.dtype, v.device))
        elif isinstance(v, (int, float, bool)) or v is None:
            examples.append(v)
            signature.append(None)
        else:
            raise CompileError(f"{name}: input {n.name} has no recorded value (meta['val']) to compile for")
    return examples, signature


def _flat_boundary(gm: GraphModule, name: str) -> tuple[list[int | None], list[int | None]]:
    """Rewrite ``gm`` (a copy) so that no placeholder or output is a tuple (see module docstring,
    flat boundary); return the arities of the original inputs and outputs (all ``None``: nothing
    changed)."""
    g = gm.graph
    in_arity: list[int | None] = []
    for ph in [n for n in g.nodes if n.op == "placeholder"]:
        v = ph.meta.get("val")
        if not isinstance(v, (tuple, list)):
            in_arity.append(None)
            continue
        if any(u.target is not operator.getitem for u in ph.users) or any(e is None for e in v):
            raise CompileError(f"{name}: input {ph.name} is a tuple used other than by indexing")
        parts = []
        with g.inserting_before(ph):
            for k, e in enumerate(v):
                part = g.placeholder(f"{ph.name}_{k}")
                part.meta["val"] = e
                parts.append(part)
        for u in list(ph.users):
            u.replace_all_uses_with(parts[u.args[1]])
            g.erase_node(u)
        g.erase_node(ph)
        in_arity.append(len(v))
    out = next(n for n in reversed(g.nodes) if n.op == "output")
    results, out_arity = [], []
    for r in out.args[0]:
        v = r.meta.get("val") if isinstance(r, torch.fx.Node) else None
        if not isinstance(v, (tuple, list)):
            results.append(r)
            out_arity.append(None)
            continue
        with g.inserting_before(out):
            for k, e in enumerate(v):
                if e is None:
                    results.append(None)
                    continue
                item = g.call_function(operator.getitem, (r, k))
                item.meta["val"] = e
                results.append(item)
        out_arity.append(len(v))
    out.args = (tuple(results),)
    g.lint()
    gm.recompile()
    tuples = any(k is not None for k in (*in_arity, *out_arity))
    return (in_arity, out_arity) if tuples else ([], [])


def compile_program(gm: GraphModule, name: str) -> CompiledProgram:
    """``gm`` compiled by Inductor for the shapes its placeholders record (``gm`` itself is left
    unchanged); raises :class:`CompileError` naming ``name`` and the cause."""
    from torch._inductor.compile_fx import compile_fx

    _check_ops(gm, name)
    work = GraphModule(gm, copy.deepcopy(gm.graph), class_name=type(gm).__name__)
    in_arity, out_arity = _flat_boundary(work, name)
    examples, signature = _example_inputs(work, name)
    t0 = time.perf_counter()
    try:
        fn = compile_fx(work, examples, config_patches=dict(INDUCTOR_OPTIONS))
    except Exception as exc:  # re-raised naming the program: the caller falls back to eager
        text = str(exc).strip().splitlines()
        first = text[0] if text else ""
        raise CompileError(f"{name}: {type(exc).__name__}: {first[:300]}") from exc
    seconds = time.perf_counter() - t0
    log.info("compile: %s compiled by Inductor in %.1f s", name, seconds)
    return CompiledProgram(name, fn, signature, seconds, in_arity, out_arity)


def _programs(record: StepProgram | StageStep) -> list[tuple[str, str]]:
    """``(label, attribute)`` of every program of ``record``."""
    if isinstance(record, StepProgram):
        return [("forward", "forward"), ("backward", "backward")]
    names = ["forward", "backward_input", "backward_weight"]
    if record.backward_weight_local is not None:
        names.append("backward_weight_local")
    return [(f"stage {record.stage} {a}", a) for a in names]


def compile_records(records: Sequence[StepProgram | StageStep]) -> dict[str, float]:
    """Compile every program of ``records`` (a rank's ``StepProgram``, or its pipeline stages'
    ``StageStep``s) into their ``compiled``; return Inductor's seconds per program. Compile them
    before the runtime binds them (``autopar.runtime.step_runner.bind_step`` routes waits through a Python
    monitor). On failure every record's ``compiled`` is emptied (all run eagerly) and
    :class:`CompileError` names the program."""
    seconds: dict[str, float] = {}
    done: list[StepProgram | StageStep] = []
    try:
        for record in records:
            done.append(record)
            for label, attr in _programs(record):
                prog = compile_program(getattr(record, attr), label)
                record.compiled[attr] = prog
                seconds[label] = prog.seconds
    except CompileError:
        for record in done:
            record.compiled.clear()
        raise
    log.info("compile: %d programs in %.1f s", len(seconds), sum(seconds.values()))
    return seconds


def compile_agreed(records: Sequence[StepProgram | StageStep], group: Any = None) -> CompileReport:
    """Compile ``records`` (``compile_records``) and agree with every rank of ``group`` (``None``:
    the default group) on the outcome in one all-gather: all compiled, or — where any rank could
    not compile, or has no step to compile — all eager (every record's ``compiled`` emptied), with
    one warning naming the first such rank, its program and the error (every rank warns the same;
    ``parallelize`` shows rank 0's). Every rank must call this."""
    import warnings

    import torch.distributed as dist

    failure, seconds = "", {}
    if not records:
        failure = (
            "no training step was captured as a program (nothing trainable, or a backward that could not be "
            "traced: see the warning before this one)"
        )
    else:
        try:
            seconds = compile_records(records)
        except CompileError as exc:
            failure = str(exc)
    every: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, failure, group=group)
    failed = [(r, f) for r, f in enumerate(every) if f]
    if not failed:
        report = CompileReport(compiled=True, seconds=seconds)
        log.info("compile=True: %s", report)
        return report
    for record in records:
        record.compiled.clear()
    rank, why = failed[0]
    others = f" (and on rank(s) {[r for r, _ in failed[1:]]})" if len(failed) > 1 else ""
    reason = f"rank {rank}: {why}{others}"
    warnings.warn(
        f"autopar: compile=True, but Inductor could not compile the step on {reason}; every rank runs "
        f"the eager programs (correct, not compiled)",
        stacklevel=2,
    )
    return CompileReport(compiled=False, seconds=seconds, reason=reason)

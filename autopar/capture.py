"""Capture: an ``nn.Module`` and one example batch become an ATen-level fx graph.

We use ``torch.export.export(..., strict=False)``: it traces through Python (so transformers'
GPT-2 and LLaMA, which ``torch.fx.symbolic_trace`` cannot trace, are captured), produces ATen ops
with a FakeTensor ``val`` on every node, and lifts parameters and buffers to placeholders whose
model names are in the graph signature. Meta-device models and inputs work, so a model far larger
than this machine's memory can be planned.

**Micro-batches.** A pipelined plan or gradient accumulation runs the graph of one micro-batch
(the global batch cut into ``m`` equal parts along dimension 0). ``MicrobatchCaptures`` gives
that graph for any ``m``: the model is exported once with its batch dimension symbolic, and each
micro-batch's graph is that export *specialised* — the batch symbol replaced by its value in every
size argument, every node's ``val`` propagated again with fake tensors — which takes a fraction of
an export (0.8 s against 3–6 s for GPT-3 175B). A model that cannot be exported with a symbolic
batch (its code branches on the batch size) is exported once per micro-batch count instead. The
planner and the runtime both take micro-batch graphs from here, so a plan's node names and
fingerprint are the ones the runtime captures.

``Captured`` keeps what later stages need: the graph, which placeholder is which parameter /
buffer / user input (and all the names a tied parameter goes by), and how to rebuild the model's
output structure from the graph's flat outputs.

**Canonical graph.** What export records depends in places on the device the model is traced on,
and a plan made on the meta device must run on the real model, so ``canonicalize`` rewrites each
such place into one form (the values are the same) and the fingerprint is taken after it:

* ``Tensor.contiguous()`` records nothing when its input's strides already are contiguous, and
  the strides are the device kernel's choice (scaled-dot-product attention returns (batch, heads,
  seq, dim)-contiguous output on the meta device, (batch, seq, heads, dim)-strided on CPU and
  CUDA, so ``y.transpose(1, 2).contiguous()`` is a copy on one and nothing on the other).
  ``drop_layout_copies`` removes every ``contiguous`` in the default memory format and turns the
  ``view`` reading through it into ``reshape``; the fingerprint reads the two as one op (the
  per-rank program makes every ``view`` a ``reshape`` anyway, ``passes.lower``).
* A Python number written into a tensor (``x[:, 0] = 0``) is a lifted constant tensor and
  ``fill_`` on CPU and CUDA, ``scalar_tensor`` expanded and ``copy_``-ed on the meta device.
  ``canonical_scalars`` makes both ``scalar_tensor`` then ``fill_``.
* A slice that keeps its whole dimension (``hidden[:, slice(-k, None)]`` with ``k = 0``, the
  ``x[:]`` of a dimension) is recorded by export only where it cannot prove the slice whole:
  with a symbolic batch it is kept on the batch dimension, with concrete sizes it is not. It is
  the identity, yet a slice rule may not split the dimension it slices, so a micro-batch graph
  would run everything after it replicated over data parallelism. ``drop_identity_slices``
  removes every ``slice`` whose output is its input's size, and every ``alias`` (what export
  writes for the same slice where it sees it whole).
* Node names are numbered again in graph order (``linear``, ``linear_1``, …), so a node removed or
  added above does not rename every node of its op below it.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import linecache
import logging
import re
import sys
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

__all__ = [
    "CaptureError",
    "Captured",
    "IndexBound",
    "MicrobatchCaptures",
    "batch_size",
    "capture",
    "check_loss_output",
    "check_position_tables",
    "index_bounds",
    "input_paths",
    "microbatch_inputs",
    "normalize_inputs",
    "traced_by",
]

log = logging.getLogger("autopar.capture")


class CaptureError(RuntimeError):
    """The model could not be exported; the message names the module or op and suggests a fix.
    ``exporter_output`` keeps what the exporter printed meanwhile (its partial graph, warnings)."""

    exporter_output: str = ""


@dataclass(frozen=True, slots=True)
class IndexBound:
    """A user input used as indices: valid values are ``0 <= v < bound`` (or ``ignore``)."""

    bound: int
    ignore: int | None
    """A value allowed besides the range (cross-entropy's ``ignore_index``), or None."""
    what: str
    """What the values index, for messages: ``"the embedding table (64 rows)"``."""


@dataclass
class Captured:
    """The captured program of one model on one example batch."""

    gm: torch.fx.GraphModule
    params: dict[str, str]
    """placeholder name -> parameter FQN (the first name of a tied parameter)."""
    buffers: dict[str, str]
    """placeholder name -> buffer FQN."""
    inputs: dict[str, str]
    """placeholder name -> user input path (``"args[0]"`` or ``"input_ids"``)."""
    param_aliases: dict[str, list[str]]
    """parameter FQN -> every name it has in ``model.state_dict()`` (tied weights have several)."""
    out_spec: Any
    """pytree spec of the model's output."""
    in_spec: Any
    """pytree spec of ``(args, kwargs)``."""
    constants: dict[str, Any] = field(default_factory=dict)
    """placeholder name -> lifted constant tensor."""
    fingerprint: str = ""
    """Hash of the graph's ops and shapes: a Plan records it to refuse a mismatched model."""
    index_inputs: dict[str, list[IndexBound]] = field(default_factory=dict)
    """User input path -> the ranges its values must lie in (``index_bounds``): sharded lookups
    and losses would silently mask ids the single-device model rejects, so the runtime checks."""

    @property
    def graph(self) -> torch.fx.Graph:
        return self.gm.graph

    def user_input_nodes(self) -> list[torch.fx.Node]:
        return [n for n in self.graph.nodes if n.op == "placeholder" and n.name in self.inputs]


def normalize_inputs(example_inputs: Any) -> tuple[tuple, dict]:
    """Accept a tensor, a tuple/list of positional args, a dict of keyword args, or ``(args, kwargs)``."""
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,), {}
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    if (
        isinstance(example_inputs, tuple)
        and len(example_inputs) == 2
        and isinstance(example_inputs[0], (tuple, list))
        and isinstance(example_inputs[1], dict)
    ):
        return tuple(example_inputs[0]), dict(example_inputs[1])
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    raise TypeError(
        f"example_inputs must be a tensor, a tuple of positional inputs, a dict of keyword inputs or "
        f"(args, kwargs); got {type(example_inputs).__name__}"
    )


def _explain_export_failure(model: nn.Module, exc: BaseException) -> str:
    """Name the module or op the exporter failed in, quote its reason, suggest a fix."""
    reason = str(exc).strip().splitlines()
    reason_text = "\n    ".join(reason[:8])
    where = ""
    # The innermost frame of the user's code, named by the module whose method it runs: a frame
    # whose ``self`` is one of the model's submodules names that exact instance.
    module_names = {
        id(mod): f"{name or '<root>'} ({type(mod).__name__})" for name, mod in model.named_modules()
    }
    frames = []
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:  # the exception and what it was raised from
        seen.add(id(e))
        frames.extend(traceback.walk_tb(e.__traceback__))
        e = e.__cause__ or e.__context__
    for frame, lineno in reversed(frames):
        filename = frame.f_code.co_filename
        if "site-packages/torch" in filename:
            continue
        line = linecache.getline(filename, lineno).strip()
        owner = module_names.get(id(frame.f_locals.get("self")))
        if owner is not None:
            where = f"in module {owner} at {filename}:{lineno}: {line}"
            break
        if not where:
            where = f"at {filename}:{lineno} in {frame.f_code.co_name}: {line}"
    op = re.search(r"(aten\.[\w.]+|torch\.ops\.[\w.]+)", str(exc))
    op_text = f" (op {op.group(1)})" if op else ""
    hint = (
        "data-dependent control flow or shapes cannot be exported: compute on tensors without "
        "Python branches on their values (torch.where / torch.cond), pass shapes that are fixed, "
        "and for transformers models build the config with use_cache=False"
    )
    if "Unsupported" in type(exc).__name__ or "not supported" in str(exc):
        hint = "replace the unsupported call with a tensor op, or register it as a custom op (torch.library)"
    devices = re.search(r"found at least two devices, (\w+(?::\d+)?) and (\w+(?::\d+)?)", str(exc))
    if devices:
        hint = (
            f"the computation mixes tensors on {devices.group(1)} and {devices.group(2)}: put the example "
            "inputs on the model's device (for a model on the meta device, torch.empty(..., device='meta')), "
            "and create tensors inside forward on an input's device (device=x.device)"
        )
    return f"torch.export could not capture the model {where}{op_text}.\n  exporter said:\n    {reason_text}\n  fix: {hint}"


class _ExporterOutput:
    """Holds back what the exporter writes while it runs (the partial FX graph it prints to stderr
    on failure, its loggers' warnings): replayed when the export succeeds, attached to the
    ``CaptureError`` (``exporter_output``) when it fails, so autopar's message comes first and alone."""

    def __init__(self) -> None:
        self.stderr = io.StringIO()
        self.records: list[logging.LogRecord] = []
        self._handlers: list[logging.Handler] = []
        self._redirect = contextlib.redirect_stderr(self.stderr)

    def filter(self, record: logging.LogRecord) -> bool:
        self.records.append(record)
        return False

    def __enter__(self) -> _ExporterOutput:
        names = [n for n in logging.root.manager.loggerDict if n == "torch" or n.startswith("torch.")]
        for name in ["torch", *names]:
            logger = logging.getLogger(name)
            for h in logger.handlers:
                if h not in self._handlers:
                    h.addFilter(self)
                    self._handlers.append(h)
        self._redirect.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._redirect.__exit__(*exc)
        for h in self._handlers:
            h.removeFilter(self)

    def replay(self) -> None:
        sys.stderr.write(self.stderr.getvalue())
        for r in self.records:
            logging.getLogger(r.name).handle(r)

    def text(self) -> str:
        lines = [logging.Formatter("%(levelname)s %(name)s: %(message)s").format(r) for r in self.records]
        return "\n".join([*lines, self.stderr.getvalue()]).strip()


@contextlib.contextmanager
def _no_stack_traces() -> Any:
    """Tracing without a Python stack trace per node (``torch.fx.config.do_not_emit_stack_traces``,
    where this torch has it): nothing here reads ``node.stack_trace``, and extracting one per node
    was a fifth of an export (LLaMA-3-8B: 3.0 s -> 2.4 s, with a symbolic batch 6.3 s -> 5.0 s).
    An export that fails is explained from its exception, not from these."""
    config = torch.fx.config
    if not hasattr(config, "do_not_emit_stack_traces"):
        yield
        return
    before = config.do_not_emit_stack_traces
    config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        config.do_not_emit_stack_traces = before


def _export(model: nn.Module, args: tuple, kwargs: dict, dynamic_shapes: Any = None) -> Any:
    """``torch.export.export`` (non-strict), its failure explained (``_explain_export_failure``)."""
    held = _ExporterOutput()
    try:
        with held, _no_stack_traces():
            ep = torch.export.export(model, args, kwargs, dynamic_shapes=dynamic_shapes, strict=False)
    except Exception as exc:  # re-raised with context: which module, which op, what to do
        err = CaptureError(_explain_export_failure(model, exc))
        err.exporter_output = held.text()
        raise err from exc
    held.replay()
    return ep


def capture(model: nn.Module, example_inputs: Any) -> Captured:
    """Export ``model`` on ``example_inputs`` into an ATen fx graph (see module docstring)."""
    args, kwargs = normalize_inputs(example_inputs)
    ep = _export(model, args, kwargs)
    return _captured(model, ep, ep.graph_module, args, kwargs)


def _captured(model: nn.Module, ep: Any, gm: torch.fx.GraphModule, args: tuple, kwargs: dict) -> Captured:
    """``Captured`` for the graph ``gm`` of the export ``ep`` (its own graph or a specialisation of
    it) on the inputs ``args``/``kwargs``: placeholders named, tied parameters merged, checked."""
    sig = ep.graph_signature
    params, buffers, inputs, constants = {}, {}, {}, {}
    user_paths = input_paths(args, kwargs)
    user_i = 0
    for spec in sig.input_specs:
        name = spec.arg.name if hasattr(spec.arg, "name") else None
        kind = spec.kind.name
        if kind == "PARAMETER":
            params[name] = spec.target
        elif kind == "BUFFER":
            buffers[name] = spec.target
        elif kind in ("CONSTANT_TENSOR", "CUSTOM_OBJ"):
            constants[name] = ep.constants.get(spec.target)
        elif kind == "USER_INPUT":
            if name is not None:
                inputs[name] = user_paths[user_i] if user_i < len(user_paths) else name
            user_i += 1
        else:
            raise CaptureError(f"unsupported graph input kind {kind} for {name}")
    aliases: dict[str, list[str]] = {}
    by_id: dict[int, str] = {}
    first_of: dict[str, str] = {}
    for fqn, p in model.named_parameters(remove_duplicate=False):
        first = by_id.setdefault(id(p), fqn)
        aliases.setdefault(first, []).append(fqn)
        first_of[fqn] = first
    _merge_tied_placeholders(gm, params, first_of)
    canonicalize(gm, constants)
    # Constant tensors lifted by export become attributes so the graph module runs by itself.
    for name, value in constants.items():
        if isinstance(value, torch.Tensor):
            gm.register_buffer(f"_const_{name}", value, persistent=False)
    cap = Captured(
        gm=gm,
        params=params,
        buffers=buffers,
        inputs=inputs,
        param_aliases=aliases,
        out_spec=ep.call_spec.out_spec,
        in_spec=ep.call_spec.in_spec,
        constants=constants,
    )
    cap.fingerprint = graph_fingerprint(gm.graph)
    cap.index_inputs = index_bounds(gm.graph, inputs)
    check_position_tables(gm.graph, params)
    if any(p.requires_grad for p in model.parameters()):
        check_loss_output(gm.graph)
    return cap


def traced_by(cap: Captured) -> str:
    """``"torch 2.13.0 on meta"``: the torch that exported the graph and the device it traced on
    (a plan records it; ``passes.lower.program_difference`` names both when a plan meets another
    program)."""
    dev = next(
        (v.device.type for n in cap.graph.nodes if isinstance(v := n.meta.get("val"), torch.Tensor)), "?"
    )
    return f"torch {torch.__version__} on {dev}"


def batch_size(args: tuple, kwargs: dict) -> int | None:
    """The global batch: dimension 0 of the user's tensor inputs (``None`` without one)."""
    for x in (*args, *kwargs.values()):
        if isinstance(x, torch.Tensor) and x.dim() > 0:
            return int(x.shape[0])
    return None


def microbatch_inputs(args: tuple, kwargs: dict, m: int) -> tuple[tuple, dict]:
    """The first of ``m`` micro-batches of a global batch (every tensor cut along dimension 0)."""

    def cut(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.dim() > 0:
            if x.shape[0] % m:
                raise ValueError(
                    f"a batch of {x.shape[0]} does not cut into {m} equal micro-batches; use a micro-batch count "
                    f"dividing {x.shape[0]}"
                )
            return x[: x.shape[0] // m]
        return x

    return tuple(cut(a) for a in args), {k: cut(v) for k, v in kwargs.items()}


class MicrobatchCaptures:
    """The graphs of ``model`` on the micro-batches of one global batch ``example_inputs``, by
    micro-batch count ``m`` (module docstring: micro-batches). ``m = 1`` is ``capture`` itself.
    Graphs are cached, so every candidate of a search shares them."""

    def __init__(self, model: nn.Module, example_inputs: Any, whole: Captured | None = None) -> None:
        """``whole``: the model already captured on the whole batch (``m = 1``)."""
        self.model = model
        self.args, self.kwargs = normalize_inputs(example_inputs)
        self._graphs: dict[int, Captured] = {1: whole} if whole is not None else {}
        self._symbolic: Any = None
        self.symbolic_failure: str | None = None
        """Why the model could not be exported with a symbolic batch (then each ``m`` is exported)."""

    def __call__(self, m: int) -> Captured:
        if m not in self._graphs:
            micro = microbatch_inputs(self.args, self.kwargs, m) if m > 1 else (self.args, self.kwargs)
            cap = None
            if m > 1 and self.symbolic_failure is None:
                cap = self._specialised(m, *micro)
            self._graphs[m] = cap if cap is not None else capture(self.model, micro)
        return self._graphs[m]

    def _symbolic_export(self) -> Any:
        """The export with dimension 0 of every batched tensor input one symbol ``batch``."""
        if self._symbolic is None:
            import inspect

            from torch.export import Dim

            batch = Dim("batch")
            bound = inspect.signature(self.model.forward).bind(*self.args, **self.kwargs)

            def spec(v: Any) -> Any:
                return {0: batch} if isinstance(v, torch.Tensor) and v.dim() > 0 else None

            shapes = {k: pytree.tree_map(spec, v) for k, v in bound.arguments.items()}
            self._symbolic = _export(self.model, self.args, self.kwargs, dynamic_shapes=shapes)
        return self._symbolic

    def _specialised(self, m: int, args: tuple, kwargs: dict) -> Captured | None:
        """The symbolic export specialised to one of ``m`` micro-batches; ``None`` (and
        ``symbolic_failure`` set) where the model cannot be exported with a symbolic batch."""
        try:
            ep = self._symbolic_export()
            batch = batch_size(args, kwargs)
            if batch is None:
                raise ValueError("no tensor input with a batch dimension")
            gm = specialise_batch(ep.graph_module, batch)
        except Exception as exc:  # a branch on the batch size, a shape the symbol cannot take
            self.symbolic_failure = f"{type(exc).__name__}: {_first_line(exc)}"
            log.info("exporting each micro-batch by itself: no symbolic batch (%s)", self.symbolic_failure)
            return None
        return _captured(self.model, ep, gm, args, kwargs)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


def specialise_batch(symbolic: torch.fx.GraphModule, batch: int) -> torch.fx.GraphModule:
    """A copy of ``symbolic`` (an export whose user inputs' dimension 0 is one symbol) for the
    batch ``batch``: integer nodes (``sym_size`` and arithmetic on it) replaced by their values
    in their users' arguments, then every node's ``val`` propagated again by fake tensors."""
    import sympy
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(symbolic.graph, {}))
    gm = torch.fx.GraphModule(symbolic, graph)
    symbols: dict[Any, int] = {}
    for n in gm.graph.nodes:
        v = n.meta.get("val")
        if (
            n.op == "placeholder"
            and isinstance(v, torch.Tensor)
            and v.dim() > 0
            and isinstance(v.shape[0], torch.SymInt)
        ):
            symbols[v.shape[0].node.expr] = batch
    if not symbols:
        raise ValueError("the export has no symbolic batch dimension (it was specialised)")

    def value(x: Any) -> Any:
        if isinstance(x, torch.SymInt):
            expr = x.node.expr
            if isinstance(expr, int):
                return expr
            expr = sympy.sympify(expr.xreplace(symbols))
            if not expr.is_number:
                raise ValueError(f"size {x} depends on symbols other than the batch")
            return int(expr)
        return x

    for n in list(gm.graph.nodes):
        v = n.meta.get("val")
        if n.op == "call_function" and isinstance(v, (torch.SymInt, torch.SymBool, torch.SymFloat)):
            if not isinstance(v, torch.SymInt):
                raise ValueError(f"{n.name} computes a symbolic {type(v).__name__} from the batch size")
            const = value(v)
            for u in list(n.users):
                u.args = pytree.tree_map(lambda a, n=n, c=const: c if a is n else a, u.args)
                u.kwargs = pytree.tree_map(lambda a, n=n, c=const: c if a is n else a, u.kwargs)
            gm.graph.erase_node(n)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fakes = []
    with mode:
        for n in gm.graph.nodes:
            if n.op != "placeholder":
                continue
            v = n.meta.get("val")
            if not isinstance(v, torch.Tensor):
                fakes.append(value(v))
                continue
            shape = [value(s) for s in v.shape]
            stride = [value(s) for s in v.stride()]
            t = torch.empty_strided(shape, stride, dtype=v.dtype, device=v.device)
            fakes.append(t.requires_grad_(v.requires_grad) if v.is_floating_point() else t)
    gm.recompile()
    with _no_progress_thread():
        FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*fakes)
    # FakeTensorProp leaves two marks an export does not: it stores each value detached (give
    # every node back the ``requires_grad`` its export recorded, where gradients flow), and it
    # gives the output node a ``val``, which made the planner take the graph's outputs (the
    # logits beside the loss) as a tensor it must deliver whole, so every micro-batch graph ran
    # its LM head and loss replicated over data parallelism.
    grads = {n.name: _val(n) is not None and _val(n).requires_grad for n in symbolic.graph.nodes}
    for n in gm.graph.nodes:
        if n.op == "output":
            n.meta.pop("val", None)
            continue
        v = _val(n)
        if v is not None and grads.get(n.name) and not v.requires_grad and v.is_floating_point():
            n.meta["val"] = v.requires_grad_(True)
    return gm


@contextlib.contextmanager
def _no_progress_thread() -> Any:
    """``torch.fx.Interpreter.run`` makes a (disabled) tqdm bar, and tqdm's first bar starts a
    monitor thread; a process with a second thread may not fork, so the planner would solve its
    meshes one after another (``autopar.planner._attempt_all``). Keep tqdm from starting it."""
    try:
        from tqdm import tqdm
    except ImportError:
        yield
        return
    interval = tqdm.monitor_interval
    tqdm.monitor_interval = 0
    try:
        yield
    finally:
        tqdm.monitor_interval = interval


def check_loss_output(graph: torch.fx.Graph) -> None:
    """Refuse a forward with nothing to train from: no floating-point tensor among its outputs (a
    loss turned into a Python number by ``.item()``, an integer prediction)."""
    out = next(n for n in reversed(graph.nodes) if n.op == "output")
    leaves = [x for x in pytree.tree_leaves(out.args) if isinstance(x, torch.fx.Node)]
    vals = [x.meta.get("val") for x in leaves]
    if any(isinstance(v, torch.Tensor) and v.is_floating_point() for v in vals):
        return
    items = [x for x in leaves if x.op == "call_function" and "item" in str(x.target)]
    if items:
        what = "a Python number: .item() turned its loss into a number that no gradient flows through"
    elif not leaves:
        what = "no tensor"
    else:
        what = (
            "no floating-point tensor ("
            + ", ".join(
                sorted({type(v).__name__ if not isinstance(v, torch.Tensor) else str(v.dtype) for v in vals})
            )
            + ")"
        )
    raise ValueError(
        f"the model's forward returns {what}; autopar plans training, which calls backward on the loss: "
        f"return the loss tensor itself (no .item(), float() or .tolist())"
    )


def _merge_tied_placeholders(
    gm: torch.fx.GraphModule, params: dict[str, str], first_of: dict[str, str]
) -> None:
    """Export lifts a tied parameter once per name; keep one placeholder per parameter (named by
    its first name in ``named_parameters`` order) so it has one placement and is counted once."""
    kept: dict[str, torch.fx.Node] = {}
    by_name = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}
    for ph_name, fqn in list(params.items()):
        first = first_of.get(fqn, fqn)
        node = by_name[ph_name]
        if first not in kept:
            kept[first] = node
            params[ph_name] = first
            continue
        node.replace_all_uses_with(kept[first])
        gm.graph.erase_node(node)
        del params[ph_name]
    gm.recompile()


def input_paths(args: tuple, kwargs: dict) -> list[str]:
    """Names of the user inputs in export's order: ``args[i]`` then keyword names."""
    out = []
    for prefix, tree in (("args", args), ("", kwargs)):
        leaves, _ = pytree.tree_flatten_with_path(tree)
        for path, leaf in leaves:
            if isinstance(leaf, torch.Tensor) or leaf is None or isinstance(leaf, (int, float, bool)):
                key = pytree.keystr(path)
                out.append(f"args{key}" if prefix else key.strip("[]'\""))
    return out


def canonicalize(gm: torch.fx.GraphModule, constants: dict[str, Any]) -> None:
    """The captured graph in its device-independent form (module docstring: canonical graph);
    ``constants`` (lifted constant placeholder name -> tensor) loses the constants no longer read."""
    drop_layout_copies(gm)
    drop_identity_slices(gm)
    canonical_scalars(gm, constants)
    renumber_names(gm)


def canonical_scalars(gm: torch.fx.GraphModule, constants: dict[str, Any]) -> int:
    """A Python number written into a tensor, in one form: ``lift_fresh_copy`` of a 0-d lifted
    constant becomes ``scalar_tensor`` of its value, and ``copy_`` of a 0-d value expanded to
    the destination becomes ``fill_`` (module docstring). Returns how many nodes were rewritten."""
    aten = torch.ops.aten
    graph = gm.graph
    done = 0
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is aten.lift_fresh_copy.default and _is_placeholder(node.args[0]):
            const = node.args[0]
            value = _scalar_value(constants.get(const.name))
            if value is None:
                continue
            dtype = constants[const.name].dtype
            with graph.inserting_before(node):
                new = graph.create_node(
                    "call_function",
                    aten.scalar_tensor.default,
                    (value,),
                    {"dtype": dtype},
                    name="scalar_tensor",
                )
            new.meta = dict(node.meta)
            node.replace_all_uses_with(new)
            graph.erase_node(node)
            if not const.users:
                graph.erase_node(const)
                del constants[const.name]
            done += 1
        elif node.target is aten.copy_.default and len(node.args) == 2 and not node.kwargs:
            dst, src = node.args
            chain = []
            while isinstance(src, torch.fx.Node) and src.target in (aten.expand.default, aten.view.default):
                if len(src.users) != 1:
                    break
                chain.append(src)
                src = src.args[0]
            sv, dv = _val(src), _val(dst)
            if (
                not chain
                or getattr(src, "target", None) is not aten.scalar_tensor.default
                or sv is None
                or dv is None
                or sv.dim() != 0
                or sv.dtype != dv.dtype
            ):
                continue
            with graph.inserting_before(node):
                new = graph.create_node("call_function", aten.fill_.Tensor, (dst, src), name="fill_")
            new.meta = dict(node.meta)
            node.replace_all_uses_with(new)
            graph.erase_node(node)
            for n in chain:
                graph.erase_node(n)
            done += 1
    if done:
        gm.recompile()
    return done


def _is_placeholder(x: Any) -> bool:
    return isinstance(x, torch.fx.Node) and x.op == "placeholder"


def _val(node: Any) -> torch.Tensor | None:
    v = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _scalar_value(t: Any) -> bool | int | float | None:
    """The Python number a 0-d constant tensor holds (``None`` if it is not one, or is fake)."""
    if not isinstance(t, torch.Tensor) or t.dim() != 0 or t.is_complex():
        return None
    inner = getattr(t, "constant", None)  # a fake tensor of a real constant
    try:
        return (inner if isinstance(inner, torch.Tensor) else t).item()
    except Exception:  # a fake tensor without its value
        return None


def renumber_names(gm: torch.fx.GraphModule) -> None:
    """Every node but the placeholders named again, in graph order, as fx names a new graph's nodes
    (``view``, ``view_1``, …): the same ops in the same order get the same names whatever was
    removed or added above them."""
    from torch.fx.graph import _name_regex

    old = gm.graph
    new = torch.fx.Graph(owning_module=gm, tracer_cls=old._tracer_cls)
    new._codegen = old._codegen
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in old.nodes:
        if node.op in ("placeholder", "output"):
            name = node.name
        else:
            match = _name_regex.match(node.name)
            name = match.group(1) if match else node.name
        copy = new.create_node(
            node.op, node.target, torch.fx.map_arg(node.args, env.__getitem__),
            torch.fx.map_arg(node.kwargs, env.__getitem__), name=name, type_expr=node.type,
        )  # fmt: skip
        copy.meta = node.meta
        env[node] = copy
    gm.graph = new
    gm.recompile()


def drop_layout_copies(gm: torch.fx.GraphModule) -> int:
    """Remove each ``contiguous`` (default memory format) whose result nothing writes into, and
    turn every ``view`` that reads it, directly or through other views, into ``reshape`` (module
    docstring: canonical graph). Returns how many were removed."""
    from autopar.graph import OpFamily, op_family

    aten = torch.ops.aten
    dropped = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not aten.contiguous.default:
            continue
        fmt = node.kwargs.get("memory_format", node.args[1] if len(node.args) > 1 else None)
        src = node.args[0]
        if fmt not in (None, torch.contiguous_format) or not isinstance(src, torch.fx.Node):
            continue
        if _written(node):
            continue  # an in-place write into the copy must not reach its source
        frontier, seen = list(node.users), set()
        while frontier:
            u = frontier.pop()
            if u in seen or u.op != "call_function":
                continue
            seen.add(u)
            if u.target is aten.view.default:
                u.target = aten.reshape.default
            elif op_family(u) is OpFamily.VIEW:
                frontier.extend(u.users)
        node.replace_all_uses_with(src)
        gm.graph.erase_node(node)
        dropped += 1
    if dropped:
        gm.recompile()
    return dropped


def drop_identity_slices(gm: torch.fx.GraphModule) -> int:
    """Remove each ``slice`` (step 1) whose output has its input's shape, and each ``alias``: the
    identity (module docstring: canonical graph; export writes ``x[:, 0:]`` as ``alias`` where it
    sees the slice whole, as ``slice`` where the size is a symbol). One that something writes
    into stays, as ``drop_layout_copies`` keeps a written copy (the two are read alike only where
    nothing writes). Returns how many were removed."""
    aten = torch.ops.aten
    dropped = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in (aten.slice.Tensor, aten.alias.default):
            continue
        src = node.args[0]
        step = node.args[4] if len(node.args) > 4 else node.kwargs.get("step", 1)
        step = 1 if node.target is aten.alias.default else step
        out, inp = _val(node), _val(src) if isinstance(src, torch.fx.Node) else None
        if step != 1 or out is None or inp is None or tuple(out.shape) != tuple(inp.shape):
            continue
        if _written(node):
            continue
        node.replace_all_uses_with(src)
        gm.graph.erase_node(node)
        dropped += 1
    if dropped:
        gm.recompile()
    return dropped


def _written(value: torch.fx.Node) -> bool:
    """Something writes into ``value`` in place, directly or through views of it."""
    from autopar.graph import OpFamily, op_family, written_inputs

    stack, seen = [value], set()
    while stack:
        v = stack.pop()
        if v in seen:
            continue
        seen.add(v)
        for u in v.users:
            if v in written_inputs(u):
                return True
            if u.op == "call_function" and op_family(u) is OpFamily.VIEW:
                stack.append(u)
    return False


SAME_OPS = {torch.ops.aten.reshape.default: torch.ops.aten.view.default}
"""Ops the fingerprint (and ``passes.lower.program_difference``) reads as one:
``drop_layout_copies`` makes a ``view`` a ``reshape`` on one device where the other recorded
no copy."""


def graph_fingerprint(graph: torch.fx.Graph) -> str:
    """A hash of every node's kind, name, op and output shape: the program a plan was made for."""
    h = hashlib.sha256()
    for n in graph.nodes:
        val = n.meta.get("val")
        shape = tuple(val.shape) if isinstance(val, torch.Tensor) else ""
        target = SAME_OPS.get(n.target, n.target) if n.op == "call_function" else n.target
        h.update(f"{n.op}|{n.name}|{target}|{shape}\n".encode())
    return h.hexdigest()[:16]


def index_bounds(graph: torch.fx.Graph, inputs: dict[str, str]) -> dict[str, list[IndexBound]]:
    """For each user input (placeholder name -> path in ``inputs``) that reaches, through views and
    casts, the indices of an ``embedding`` or the targets of a cross-entropy/NLL loss: the range
    its values must lie in."""
    from autopar.graph import OpFamily, op_info, op_name

    out: dict[str, list[IndexBound]] = {}
    for ph in graph.nodes:
        if ph.op != "placeholder" or ph.name not in inputs:
            continue
        bounds: list[IndexBound] = []
        frontier, seen = [ph], set()
        while frontier:
            n = frontier.pop()
            if n in seen:
                continue
            seen.add(n)
            for u in n.users:
                name = op_name(u)
                info = op_info(u)
                if name == "embedding" and len(u.args) > 1 and u.args[1] is n:
                    rows = int(u.args[0].meta["val"].shape[0])
                    bounds.append(IndexBound(rows, None, f"the embedding table ({rows} rows)"))
                elif (
                    info.family is OpFamily.LOSS and name != "mse_loss" and len(u.args) > 1 and u.args[1] is n
                ):
                    logits = u.args[0].meta["val"]
                    classes = int(logits.shape[1] if logits.dim() > 1 else logits.shape[0])
                    ignore = u.args[4] if len(u.args) > 4 else u.kwargs.get("ignore_index", -100)
                    bounds.append(IndexBound(classes, int(ignore), f"the loss's {classes} classes"))
                elif (
                    u.op == "call_function"
                    and (info.family is OpFamily.VIEW or info.identity_like)
                    and isinstance(u.args[0], torch.fx.Node)
                    and u.args[0] is n
                ):
                    frontier.append(u)
        if bounds:
            out[inputs[ph.name]] = sorted(set(bounds), key=lambda b: (b.bound, b.what))
    return out


_SAME_VALUES = frozenset(
    [
        "view",
        "reshape",
        "_unsafe_view",
        "unsqueeze",
        "squeeze",
        "expand",
        "clone",
        "contiguous",
        "alias",
        "_to_copy",
        "to",
        "flatten",
        "permute",
        "transpose",
        "t",
        "detach",
        "lift_fresh_copy",
    ]
)
"""Ops whose output holds exactly the values of their input (rearranged, repeated or cast)."""


def _value_range(node: torch.fx.Node) -> tuple[int, int] | None:
    """``(smallest, largest)`` value of an integer tensor computed from ``arange`` by shifts and
    rearrangements alone; None when it depends on anything else (a user input, a slice)."""
    from autopar.graph import op_name

    if node.op != "call_function":
        return None
    name = op_name(node)
    args = node.args
    if name == "arange":
        ints = [a for a in args if isinstance(a, int)]
        if len(ints) != len(args) or not ints:
            return None
        start, end, step = (
            (0, ints[0], 1) if len(ints) == 1 else (ints[0], ints[1], ints[2] if len(ints) > 2 else 1)
        )
        count = max(0, -(-(end - start) // step))
        if count == 0 or step <= 0:
            return None
        return start, start + step * (count - 1)
    if (
        name in ("add", "sub")
        and len(args) == 2
        and isinstance(args[1], int)
        and isinstance(args[0], torch.fx.Node)
    ):
        r = _value_range(args[0])
        shift = args[1] if name == "add" else -args[1]
        return None if r is None else (r[0] + shift, r[1] + shift)
    if name in _SAME_VALUES and args and isinstance(args[0], torch.fx.Node):
        return _value_range(args[0])
    return None


def check_position_tables(graph: torch.fx.Graph, params: dict[str, str]) -> None:
    """Refuse a batch whose sequences are longer than the model supports: an embedding table read
    at positions the model computes itself (``arange``, not a user input) that has fewer rows
    than the largest position. Eager training would fail with ``IndexError`` on the first step;
    planning would say nothing."""
    from autopar.graph import op_name

    for n in graph.nodes:
        if n.op != "call_function" or len(n.args) < 2 or not isinstance(n.args[1], torch.fx.Node):
            continue
        if op_name(n) != "embedding" or not isinstance(n.args[0], torch.fx.Node):
            continue
        r = _value_range(n.args[1])
        rows = (
            int(n.args[0].meta["val"].shape[0])
            if isinstance(n.args[0].meta.get("val"), torch.Tensor)
            else None
        )
        if r is None or rows is None or r[1] < rows:
            continue
        table = params.get(n.args[0].name, n.args[0].name)
        raise ValueError(
            f"sequence too long for the model: its position table {table} has {rows} rows, so it supports "
            f"sequences of at most {rows} tokens, but the example batch needs positions up to {r[1]} "
            f"({r[1] + 1} tokens): use sequences of at most {rows} tokens, or configure the model with a "
            f"longer context (more rows in {table})"
        )

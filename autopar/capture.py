"""Capture: an ``nn.Module`` and one example batch become an ATen-level fx graph.

We use ``torch.export.export(..., strict=False)``: it traces through Python (so transformers'
GPT-2 and LLaMA, which ``torch.fx.symbolic_trace`` cannot trace, are captured), produces ATen ops
with a FakeTensor ``val`` on every node, and lifts parameters and buffers to placeholders whose
model names are in the graph signature. Meta-device models and inputs work, so a model far larger
than this machine's memory can be planned.


**Micro-batches** (``autopar.microbatch``): a pipelined plan or gradient accumulation runs the
graph of one micro-batch, specialised from one export with a symbolic batch (of the model cut to
one of each kind of its repeated layers where it has them, ``autopar.cut_export``: ``capture`` then keeps the
export as the exporter gave it, ``Captured.raw``).

``Captured`` keeps what later stages need: the graph, which placeholder is which parameter /
buffer / user input (and all the names a tied parameter goes by), and how to rebuild the model's
output structure from the graph's flat outputs.


The graph is put in its device-independent form (``autopar.canonical``) before its fingerprint is
taken, and the user inputs used as indices get their valid ranges (``autopar.input_bounds``).

**No KV cache.** A training step has no use for the key-value cache of generation, and
``transformers`` models build one by default (their configs say ``use_cache=True``): the cache
object in the output is no type the exporter knows, and filling it keeps every layer's keys and
values alive. While exporting, every ``config`` of the model's modules that says
``use_cache=True`` says ``False`` (as ``transformers`` itself does for a model trained with
gradient checkpointing) and is set back after, so a model built from its default config is
captured as it trains. An input ``use_cache=True`` the user passes is left as given.
"""

from __future__ import annotations

import contextlib
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

from autopar.canonical import canonicalize, graph_fingerprint
from autopar.cut_export import repeated_lists
from autopar.graph import recompiled_once
from autopar.input_bounds import IndexBound, check_position_tables, index_bounds

__all__ = [
    "CaptureError",
    "Captured",
    "RawExport",
    "batch_size",
    "capture",
    "captured_from",
    "check_loss_output",
    "export_program",
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


@dataclass
class RawExport:
    """An export and a copy of its graph made before ``captured_from`` rewrote it."""

    program: Any
    """The ``torch.export.ExportedProgram`` (its signature names the copy's placeholders)."""
    graph_module: torch.fx.GraphModule


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
    raw: RawExport | None = None
    """The export as the exporter gave it, kept (by ``capture``) where the model has repeated
    layers: its micro-batch graphs are read from it (``autopar.cut_export``)."""

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
        "and for transformers models do not pass use_cache=True"
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


@contextlib.contextmanager
def _no_kv_cache(model: nn.Module) -> Any:
    """Every module ``config`` of ``model`` that says ``use_cache=True`` says ``False`` inside the
    block, and ``True`` again after it (module docstring: no KV cache)."""
    configs = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if getattr(config, "use_cache", None) is True:
            configs[id(config)] = config
    for config in configs.values():
        config.use_cache = False
    if configs:
        log.info(
            "capture: use_cache=False on %d config(s) while exporting (a training step keeps no KV cache)",
            len(configs),
        )
    try:
        yield
    finally:
        for config in configs.values():
            config.use_cache = True


def export_program(model: nn.Module, args: tuple, kwargs: dict, dynamic_shapes: Any = None) -> Any:
    """``torch.export.export`` (non-strict) with no KV cache (module docstring), its failure
    explained (``_explain_export_failure``)."""
    held = _ExporterOutput()
    try:
        with held, _no_stack_traces(), _no_kv_cache(model):
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
    ep = export_program(model, args, kwargs)
    raw = None
    if repeated_lists(model):  # kept for the micro-batch graphs (``Captured.raw``)
        graph = torch.fx.Graph()
        graph.output(graph.graph_copy(ep.graph_module.graph, {}))
        raw = RawExport(ep, torch.fx.GraphModule(ep.graph_module, graph))
    cap = captured_from(model, ep, ep.graph_module, args, kwargs)
    cap.raw = raw
    return cap


def captured_from(model: nn.Module, ep: Any, gm: torch.fx.GraphModule, args: tuple, kwargs: dict) -> Captured:
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
    with recompiled_once(gm):
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
    _check_fixed_shapes(gm)
    cap.fingerprint = graph_fingerprint(gm.graph)
    cap.index_inputs = index_bounds(gm.graph, inputs)
    check_position_tables(gm.graph, params)
    if any(p.requires_grad for p in model.parameters()):
        check_loss_output(gm.graph)
    return cap


def _check_fixed_shapes(gm: torch.fx.GraphModule) -> None:
    """Refuse a graph with a tensor whose size depends on the input's values (a boolean mask's
    selection, ``nonzero``): the exporter keeps such a size as a symbol with no value, and a plan
    needs every size. The error names the first such op, its module and its source line."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    found = [
        n
        for n in gm.graph.nodes
        if isinstance(n.meta.get("val"), torch.Tensor) and free_unbacked_symbols(n.meta["val"])
    ]
    # Name an aten op (the boolean index), not the exporter's ``getitem`` of its count.
    for n in sorted(found, key=lambda n: not isinstance(n.target, torch._ops.OpOverload))[:1]:
        val = n.meta["val"]
        stack = list((n.meta.get("nn_module_stack") or {}).values())
        module = f" in module {stack[-1][0] or '<root>'} ({stack[-1][1].rsplit('.', 1)[-1]})" if stack else ""
        lines = [ln.strip() for ln in (n.meta.get("stack_trace") or "").strip().splitlines()]
        source = f", at {lines[-2]}: {lines[-1]}" if len(lines) >= 2 and "torch/fx" not in lines[-2] else ""
        raise CaptureError(
            f"the model computes a tensor whose size depends on its inputs' values: {n.target} gives "
            f"{tuple(val.shape)}{module}{source}. autopar plans every tensor's size before training, so "
            "it cannot plan this one.\n  fix: select with a fixed number of elements — index by "
            "positions (x[torch.arange(b), idx], torch.gather) instead of a boolean mask (x[mask]), or "
            "torch.where(mask, x, 0) to keep the shape"
        )


def traced_by(cap: Captured) -> str:
    """``"torch 2.13.0 on meta"``: the torch that exported the graph and the device it traced on
    (a plan records it; ``passes.plan_check.program_difference`` names both when a plan meets another
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


def _leaves_by_path(args: tuple, kwargs: dict) -> list[tuple[str, Any]]:
    """``(path, leaf)`` of every leaf of the inputs in export's order: ``args[i]`` then keyword
    names."""
    out = []
    for prefix, tree in (("args", args), ("", kwargs)):
        for path, leaf in pytree.tree_flatten_with_path(tree)[0]:
            key = pytree.keystr(path)
            out.append((f"args{key}" if prefix else key.strip("[]'\""), leaf))
    return out


def input_paths(args: tuple, kwargs: dict) -> list[str]:
    """Names of the user inputs in export's order: ``args[i]`` then keyword names."""
    return [
        path
        for path, leaf in _leaves_by_path(args, kwargs)
        if isinstance(leaf, torch.Tensor) or leaf is None or isinstance(leaf, (int, float, bool))
    ]


def capture_difference(cap: Captured, model: nn.Module, args: tuple, kwargs: dict) -> str | None:
    """How ``cap`` is not a capture of ``model`` on the inputs ``args``/``kwargs`` (the first
    difference found, in words), or None where it is one: the same parameters (names, shapes,
    dtypes) and the same user inputs (paths, shapes, dtypes). Parameter values are not compared:
    a capture holds none."""
    placeholders = {n.name: n for n in cap.graph.nodes if n.op == "placeholder"}

    def described(v: Any) -> str:
        return f"{tuple(v.shape)} {v.dtype}" if isinstance(v, torch.Tensor) else repr(v)

    def differs(ph: str, value: Any) -> str | None:
        held = placeholders[ph].meta.get("val") if ph in placeholders else None
        if not isinstance(value, torch.Tensor) or not isinstance(held, torch.Tensor):
            return None
        same = tuple(held.shape) == tuple(value.shape) and held.dtype == value.dtype
        return None if same else f"the capture has {described(held)}, the model {described(value)}"

    fqns = {fqn: ph for ph, fqn in cap.params.items()}
    firsts: dict[int, str] = {}
    for fqn, p in model.named_parameters(remove_duplicate=False):
        if firsts.setdefault(id(p), fqn) != fqn:
            continue  # a tied name: the capture holds the first
        if fqn not in fqns:
            return f"parameter {fqn!r} is not in the capture"
        why = differs(fqns[fqn], p)
        if why:
            return f"parameter {fqn!r}: {why}"
    if len(firsts) != len(fqns):
        extra = sorted(set(fqns) - {fqn for fqn, _ in model.named_parameters()})
        return f"the capture has parameters the model lacks: {extra[:3]}"
    values = dict(_leaves_by_path(args, kwargs))
    for ph, path in cap.inputs.items():
        if path not in values:
            return f"input {path!r} of the capture is not among these inputs ({', '.join(values) or 'none'})"
        why = differs(ph, values[path])
        if why:
            return f"input {path!r}: {why.replace('the model', 'these inputs')}"
    return None

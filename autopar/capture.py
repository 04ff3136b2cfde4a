"""Capture: an ``nn.Module`` and one example batch become an ATen-level fx graph.

We use ``torch.export.export(..., strict=False)``: it traces through Python (so transformers'
GPT-2 and LLaMA, which ``torch.fx.symbolic_trace`` cannot trace, are captured), produces ATen ops
with a FakeTensor ``val`` on every node, and lifts parameters and buffers to placeholders whose
model names are in the graph signature. Meta-device models and inputs work, so a model far larger
than this machine's memory can be planned.

``Captured`` keeps what later stages need: the graph, which placeholder is which parameter /
buffer / user input (and all the names a tied parameter goes by), and how to rebuild the model's
output structure from the graph's flat outputs.
"""

from __future__ import annotations

import hashlib
import re
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

__all__ = ["CaptureError", "Captured", "capture", "normalize_inputs"]


class CaptureError(RuntimeError):
    """The model could not be exported; the message names the module or op and suggests a fix."""


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
    tb = traceback.extract_tb(exc.__traceback__)
    where = ""
    # Find the innermost frame that belongs to the user's model code (not torch internals).
    module_files = {}
    for name, mod in model.named_modules():
        f = getattr(type(mod).forward, "__code__", None)
        if f is not None:
            module_files.setdefault((f.co_filename, f.co_name), f"{name or '<root>'} ({type(mod).__name__})")
    for fr in reversed(tb):
        if "/torch/" in fr.filename and "site-packages/torch" in fr.filename:
            continue
        key = (fr.filename, fr.name)
        if key in module_files:
            where = f"in module {module_files[key]} at {fr.filename}:{fr.lineno}: {fr.line}"
            break
        if not where:
            where = f"at {fr.filename}:{fr.lineno} in {fr.name}: {fr.line}"
    op = re.search(r"(aten\.[\w.]+|torch\.ops\.[\w.]+)", str(exc))
    op_text = f" (op {op.group(1)})" if op else ""
    hint = (
        "data-dependent control flow or shapes cannot be exported: compute on tensors without "
        "Python branches on their values (torch.where / torch.cond), pass shapes that are fixed, "
        "and for transformers models build the config with use_cache=False"
    )
    if "Unsupported" in type(exc).__name__ or "not supported" in str(exc):
        hint = "replace the unsupported call with a tensor op, or register it as a custom op (torch.library)"
    return f"torch.export could not capture the model {where}{op_text}.\n  exporter said:\n    {reason_text}\n  fix: {hint}"


def capture(model: nn.Module, example_inputs: Any) -> Captured:
    """Export ``model`` on ``example_inputs`` into an ATen fx graph (see module docstring)."""
    args, kwargs = normalize_inputs(example_inputs)
    try:
        ep = torch.export.export(model, args, kwargs, strict=False)
    except Exception as exc:  # re-raised with context: which module, which op, what to do
        raise CaptureError(_explain_export_failure(model, exc)) from exc
    sig = ep.graph_signature
    gm = ep.graph_module
    params, buffers, inputs, constants = {}, {}, {}, {}
    user_paths = _input_paths(args, kwargs)
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
    for fqn, p in model.named_parameters(remove_duplicate=False):
        first = by_id.setdefault(id(p), fqn)
        aliases.setdefault(first, []).append(fqn)
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
    return cap


def _input_paths(args: tuple, kwargs: dict) -> list[str]:
    leaves, _ = pytree.tree_flatten_with_path((args, kwargs))
    out = []
    for path, leaf in leaves:
        if isinstance(leaf, torch.Tensor) or leaf is None or isinstance(leaf, (int, float, bool)):
            out.append(pytree.keystr(path))
    return out


def graph_fingerprint(graph: torch.fx.Graph) -> str:
    h = hashlib.sha256()
    for n in graph.nodes:
        val = n.meta.get("val")
        shape = tuple(val.shape) if isinstance(val, torch.Tensor) else ""
        h.update(f"{n.op}|{n.name}|{n.target}|{shape}\n".encode())
    return h.hexdigest()[:16]

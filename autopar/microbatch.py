"""Micro-batch graphs: the program of one micro-batch for any micro-batch count.

**Micro-batches.** A pipelined plan or gradient accumulation runs the graph of one micro-batch
(the global batch cut into ``m`` equal parts along dimension 0). ``MicrobatchCaptures`` gives
that graph for any ``m``: the model is exported once with its batch dimension symbolic, and each
micro-batch's graph is that export *specialised* — the batch symbol replaced by its value in every
size argument and in every node's ``val`` — which takes a fraction of an export (0.6 s against
5–7 s for LLaMA-3-8B's whole-batch capture). A model with repeated layers is exported with a
symbolic batch cut to one layer of each kind, and its micro-batch graphs are the whole batch's concrete export
with the sizes read from that (``autopar.cut_export``: 2.6 s against 10–17 s for LLaMA-3-8B's
32 layers); where its layers differ, the whole model is exported with a symbolic batch. A model
that cannot be exported with a symbolic batch (its code branches on the batch size) is exported
once per micro-batch count instead. The planner and the runtime both take micro-batch graphs from
here, so a plan's node names and fingerprint are the ones the runtime captures.

"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from autopar.capture import (
    Captured,
    batch_size,
    capture,
    captured_from,
    export_program,
    microbatch_inputs,
    normalize_inputs,
)
from autopar.cut_export import cut_lists, plan_cuts, repeated_lists, specialise_aligned
from autopar.graph import tensor_val

__all__ = ["MicrobatchCaptures", "specialise_batch"]

log = logging.getLogger("autopar.capture")


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
        self._cut: Any = None  # the cut model's export with a symbolic batch (``_aligned``)
        self.symbolic_failure: str | None = None
        """Why the model could not be exported with a symbolic batch (then each ``m`` is exported)."""
        self.cut_failure: str | None = None
        """Why the micro-batch graphs are not read from the cut model (``autopar.cut_export``;
        then from an export of the whole model with a symbolic batch)."""

    def __call__(self, m: int) -> Captured:
        if m not in self._graphs:
            micro = microbatch_inputs(self.args, self.kwargs, m) if m > 1 else (self.args, self.kwargs)
            cap = None
            if m > 1 and self.symbolic_failure is None:
                cap = self._specialised(m, *micro)
            self._graphs[m] = cap if cap is not None else capture(self.model, micro)
        return self._graphs[m]

    def _batch_shapes(self) -> dict[str, Any]:
        """``dynamic_shapes`` making dimension 0 of every batched tensor input one symbol ``batch``."""
        import inspect

        from torch.export import Dim

        batch = Dim("batch")
        bound = inspect.signature(self.model.forward).bind(*self.args, **self.kwargs)

        def spec(v: Any) -> Any:
            return {0: batch} if isinstance(v, torch.Tensor) and v.dim() > 0 else None

        return {k: pytree.tree_map(spec, v) for k, v in bound.arguments.items()}

    def _symbolic_export(self) -> Any:
        """The export with dimension 0 of every batched tensor input one symbol ``batch``."""
        if self._symbolic is None:
            self._symbolic = export_program(
                self.model, self.args, self.kwargs, dynamic_shapes=self._batch_shapes()
            )
        return self._symbolic

    def _aligned(self, batch: int) -> tuple[Any, torch.fx.GraphModule] | None:
        """The whole batch's concrete export and its graph at ``batch`` read from the cut model
        (module docstring: cut model); ``None`` (and ``cut_failure`` set) where it cannot be."""
        if self.cut_failure is not None:
            return None
        lists = repeated_lists(self.model)
        whole = self(1) if lists else None
        if whole is None or whole.raw is None:
            self.cut_failure = "no repeated layers" if not lists else "the whole batch's export was not kept"
            return None
        cuts = plan_cuts(whole.raw.graph_module.graph, lists)
        if not cuts:
            self.cut_failure = "no list of layers repeats its layers' ops"
            return None
        try:
            if self._cut is None:
                with cut_lists(self.model, {name: c.keep for name, c in cuts.items()}):
                    self._cut = export_program(
                        self.model, self.args, self.kwargs, dynamic_shapes=self._batch_shapes()
                    )
            whole_batch = batch_size(self.args, self.kwargs)
            assert whole_batch is not None
            cut = self._cut.graph_module
            at = _sizes_at(_batch_symbols(cut, batch), _batch_symbols(cut, whole_batch))
            views = _Views()

            def make_val(key: torch.Tensor, sizes: torch.Tensor, value: Callable[[Any], int]) -> Any:
                v = views(key, sizes, value)
                return v.requires_grad_(True) if key.requires_grad and v.is_floating_point() else v

            inputs = set(self._cut.graph_signature.user_inputs)
            gm = specialise_aligned(whole.raw.graph_module, cut, cuts, inputs, at, make_val)
        except Exception as exc:  # NotAligned, or the cut model cannot be exported
            self.cut_failure = f"{type(exc).__name__}: {_first_line(exc)}"
            log.info("exporting the whole model with a symbolic batch: %s", self.cut_failure)
            return None
        for n in gm.graph.nodes:
            if n.op == "output":
                n.meta.pop("val", None)
        gm.recompile()
        return whole.raw.program, gm

    def _specialised(self, m: int, args: tuple, kwargs: dict) -> Captured | None:
        """The symbolic export specialised to one of ``m`` micro-batches (read from the cut model
        where it can be, ``_aligned``); ``None`` (and ``symbolic_failure`` set) where the model
        cannot be exported with a symbolic batch."""
        try:
            batch = batch_size(args, kwargs)
            if batch is None:
                raise ValueError("no tensor input with a batch dimension")
            aligned = self._aligned(batch)
            if aligned is not None:
                return captured_from(self.model, aligned[0], aligned[1], args, kwargs)
            ep = self._symbolic_export()
            gm = specialise_batch(ep.graph_module, batch)
        except Exception as exc:  # a branch on the batch size, a shape the symbol cannot take
            self.symbolic_failure = f"{type(exc).__name__}: {_first_line(exc)}"
            log.info("exporting each micro-batch by itself: no symbolic batch (%s)", self.symbolic_failure)
            return None
        return captured_from(self.model, ep, gm, args, kwargs)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


def specialise_batch(symbolic: torch.fx.GraphModule, batch: int) -> torch.fx.GraphModule:
    """A copy of ``symbolic`` (an export whose user inputs' dimension 0 is one symbol) for the
    batch ``batch``: integer nodes (``sym_size`` and arithmetic on it) replaced by their values
    in their users' arguments, then every node's ``val`` evaluated at the batch
    (``_substitute_vals``; propagated again through the ops by fake tensors where a value is not
    one it reads)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(symbolic.graph, {}))
    gm = torch.fx.GraphModule(symbolic, graph)
    at = _sizes_at(_batch_symbols(gm, batch))

    def value(x: Any) -> Any:
        return at(x, False)

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
    try:
        _substitute_vals(gm, mode, value)
    except _NotSubstituted as why:  # propagate every value again through the ops
        log.info("specialising by fake-tensor propagation: %s", why)
        _propagate_vals(gm, mode, value)
    gm.recompile()
    # Both leave two marks an export does not: each value is stored detached (give every node back
    # the ``requires_grad`` its export recorded, where gradients flow), and FakeTensorProp gives
    # the output node a ``val``, which made the planner take the graph's outputs (the
    # logits beside the loss) as a tensor it must deliver whole, so every micro-batch graph ran
    # its LM head and loss replicated over data parallelism.
    grads = {n.name: tensor_val(n) is not None and tensor_val(n).requires_grad for n in symbolic.graph.nodes}
    for n in gm.graph.nodes:
        if n.op == "output":
            n.meta.pop("val", None)
            continue
        v = tensor_val(n)
        if v is not None and grads.get(n.name) and not v.requires_grad and v.is_floating_point():
            n.meta["val"] = v.requires_grad_(True)
    return gm


def _batch_symbols(gm: torch.fx.GraphModule, batch: int) -> dict[Any, int]:
    """The batch symbol(s) of an export with a symbolic batch (dimension 0 of its user inputs),
    each bound to ``batch``."""
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
    return symbols


def _sizes_at(micro: dict[Any, int], whole: dict[Any, int] | None = None) -> Callable[[Any, bool], int]:
    """``at(x, w)``: size ``x`` (an ``int`` or a ``SymInt`` of the batch) evaluated with the
    symbols bound as in ``micro`` (``w`` false) or ``whole``; each expression once."""
    import sympy

    cache: dict[tuple[Any, bool], int] = {}

    def at(x: Any, w: bool) -> Any:
        if not isinstance(x, torch.SymInt):
            return x
        expr = x.node.expr
        if isinstance(expr, int):
            return expr
        key = (expr, w)
        if key not in cache:
            bound = sympy.sympify(expr.xreplace(whole if w and whole is not None else micro))
            if not bound.is_number:
                raise ValueError(f"size {x} depends on symbols other than the batch")
            cache[key] = int(bound)
        return cache[key]

    return at


class _Views:
    """Concrete fake values on meta bases, one base per storage of the values they stand for, so
    that values sharing a storage in the export share one here (``passes.annotate.is_alias``)."""

    def __init__(self, mode: Any = None) -> None:
        from torch._subclasses.fake_tensor import FakeTensorMode

        self.mode = mode if mode is not None else FakeTensorMode(allow_non_fake_inputs=True)
        self.bases: dict[int, torch.Tensor] = {}

    def __call__(self, key: torch.Tensor, sizes: torch.Tensor, value: Callable[[Any], int]) -> Any:
        """The value with the storage of ``key`` and the sizes, strides and offset of ``sizes``
        read through ``value``."""
        from torch._subclasses.fake_tensor import FakeTensor

        if not isinstance(sizes, FakeTensor) or sizes.layout is not torch.strided or sizes.is_quantized:
            raise _NotSubstituted(f"a {sizes.layout} {type(sizes).__name__} value")
        k = key.untyped_storage()._cdata
        base = self.bases.get(k)
        if base is None:
            nbytes = value(sizes.untyped_storage().nbytes())
            if nbytes % sizes.element_size():
                raise _NotSubstituted("a storage of a size no element divides")
            base = self.bases[k] = torch.empty(
                nbytes // sizes.element_size(), dtype=sizes.dtype, device="meta"
            )
        if base.dtype != sizes.dtype:
            raise _NotSubstituted("a storage read as two dtypes")
        # A view of the base on the meta device, wrapped as the fake tensor the ops would have
        # given (dispatching ``as_strided`` through the fake mode took as long as the ops).
        view = base.as_strided(
            [value(x) for x in sizes.shape], [value(x) for x in sizes.stride()], value(sizes.storage_offset())
        )
        return FakeTensor(self.mode, view, sizes.device)


class _NotSubstituted(Exception):
    """A value ``_substitute_vals`` does not read (``specialise_batch`` propagates instead)."""


def _substitute_vals(gm: torch.fx.GraphModule, mode: Any, value: Callable[[Any], Any]) -> None:
    """Every node's ``val`` made concrete by evaluating its symbolic sizes, strides and storage
    offset at the batch (``value``), without running the ops: the values a propagation through
    the ops would give, since the export's sizes are the ops' own size formulas in the batch
    symbol, at a tenth of its time (0.3 s against 3 s on LLaMA-3-8B's 2 500 nodes). Values that
    share a storage in the export share one in the copy (``passes.annotate.is_alias`` reads it):
    each storage is one base tensor, every value on it a strided view of the base."""
    views = _Views(mode)
    out: dict[torch.fx.Node, Any] = {}

    def concrete(v: Any) -> Any:
        if isinstance(v, (torch.SymFloat, torch.SymBool)):
            raise _NotSubstituted(f"a symbolic {type(v).__name__}")
        if not isinstance(v, (torch.SymInt, torch.Tensor)):
            return v
        try:
            return value(v) if isinstance(v, torch.SymInt) else views(v, v, value)
        except ValueError as e:  # a size of another symbol (an unbacked one, data-dependent)
            raise _NotSubstituted(str(e)) from None

    for n in gm.graph.nodes:
        if "val" in n.meta and n.op != "output":
            out[n] = pytree.tree_map(concrete, n.meta["val"])
    for n, v in out.items():
        n.meta["val"] = v


def _propagate_vals(gm: torch.fx.GraphModule, mode: Any, value: Callable[[Any], Any]) -> None:
    """Every node's ``val`` by running the graph on fake inputs of the batch's sizes."""
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

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


@contextlib.contextmanager
def _no_progress_thread() -> Any:
    """``torch.fx.Interpreter.run`` makes a (disabled) tqdm bar, and tqdm's first bar starts a
    monitor thread; a process with a second thread may not fork, so the planner would solve its
    meshes one after another (``autopar.mesh_pool.solve_meshes``). Keep tqdm from starting it."""
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

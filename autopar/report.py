"""Reports a person reads: ``explain`` (a graph or a plan as a table), ``compare`` (two plans side
by side) and ``html_report`` (one self-contained HTML file with the pictures of ``autopar.viz``).

Words:

* **fresh capture** — ``autopar.capture(model, inputs)`` before any pass ran: ``explain`` runs the
  annotation passes on it (tensor facts and single-device costs on ``cluster``'s device; with a
  ``mesh``, also the strategies the solver would choose from), so every column has a value.
* **comparison** — two plans of the same model and batch, each a column: predicted step time,
  compute, communication, memory per device, bytes per mesh axis, and their ratios.
* **report** — an HTML page with no external resource (images are embedded as ``data:`` URIs, the
  style is inline), so it opens offline and can be mailed as one file.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from autopar import display
from autopar.capture import Captured, capture
from autopar.cluster import Cluster
from autopar.ir import COST, TENSOR
from autopar.planfile import Plan

__all__ = ["explain"]

DEFAULT_DEVICE = "H100-SXM"
"""The device ``explain`` costs a fresh capture on when no cluster is given."""


def explain(
    obj: Any,
    example_inputs: Any = None,
    *,
    cluster: Cluster | None = None,
    mesh: Sequence[int] | None = None,
    max_rows: int | None = None,
) -> str:
    """Print any stage as a table (see module docstring).

    ``obj`` is a ``Plan`` (every node: its specs, rewrites, times, memory), a ``Captured`` (the
    graph, annotated as needed), a model with ``example_inputs`` (captured first), or an
    annotated ``torch.fx.GraphModule``. ``cluster`` (default one ``H100-SXM``) prices the ops;
    ``mesh`` (e.g. ``(8,)``) adds the number of strategies each node has on that mesh.
    """
    if isinstance(obj, Plan):
        return display.plan_summary(obj) + "\n\n" + display.plan_nodes_table(obj, max_rows=max_rows)
    if isinstance(obj, torch.nn.Module) and not isinstance(obj, torch.fx.GraphModule):
        if example_inputs is None:
            raise TypeError("explain(model, example_inputs): a model needs one example batch to be captured")
        obj = capture(obj, example_inputs)
    if isinstance(obj, Captured):
        if cluster is None:
            n = math.prod(mesh) if mesh is not None else 1
            cluster = Cluster.preset(DEFAULT_DEVICE, gpus_per_node=min(n, 8), nodes=-(-n // 8))
        _annotate(obj, cluster, mesh)
        where = f"costs on one {cluster.device.name}"
        if mesh is not None:
            where += f", strategies on mesh {tuple(mesh)}"
        return display.graph_table(obj.gm, max_rows=max_rows, title=f"captured graph ({where})")
    if isinstance(obj, torch.fx.GraphModule):
        annotated = any(TENSOR in n.meta or COST in n.meta for n in obj.graph.nodes)
        title = (
            ""
            if annotated
            else "not annotated: pass autopar.capture(...)'s result (or the model and its inputs) to annotate"
        )
        return display.graph_table(obj, max_rows=max_rows, title=title)
    raise TypeError(
        f"explain takes a Plan, a Captured, a model with example inputs or a GraphModule; got {type(obj).__name__}"
    )


def _annotate(cap: Captured, cluster: Cluster, mesh: Sequence[int] | None) -> None:
    from autopar.mesh import Mesh
    from autopar.passes import PassContext, run_passes
    from autopar.passes.strategies import annotate_strategies
    from autopar.planner import GRAPH_PASSES, detect_mixed_precision

    mixed = detect_mixed_precision(cap)
    ctx = PassContext(captured=cap, cluster=cluster, mixed_precision=mixed)
    run_passes(cap.gm, ctx, GRAPH_PASSES)
    if mesh is not None:
        m = Mesh(tuple(mesh), cluster)
        run_passes(
            cap.gm,
            PassContext(captured=cap, cluster=cluster, mesh=m, mixed_precision=mixed),
            [annotate_strategies],
        )

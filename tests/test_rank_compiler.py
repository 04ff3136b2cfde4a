"""The per-rank compiler (``autopar.passes.rank_compiler``) is one list of named passes, held as data:
each entry has its kind's one signature, the list runs in the documented order, any pass but the
required ones is turned off by name, and every pass is logged with its node counts and time.

One process: rank 0 of a 2-device data-parallel plan compiled on fake tensors (the axis group's
name is made up; tracing never reaches a process group), so no collective runs.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

import _runtime_helpers as H
import pytest
import torch

import autopar
from autopar.capture import capture, normalize_inputs
from autopar.passes import PassContext
from autopar.passes.overlap import RANK_PASSES
from autopar.passes.rank_compiler import KINDS, RANK_COMPILER, RankPass, RankTarget, compile_rank, uncounted
from autopar.program.collectives import AxisGroup
from autopar.program.records import RankStep
from autopar.runtime.inputs import leaves_by_path
from autopar.runtime.shards import bind_placeholders, local_shard

ORDER = (
    "lower",
    "cut_stages",
    "fuse_kernels",
    "trace_joint",
    *(p.__name__ for p in RANK_PASSES),
    "split_step",
)
"""The brief of the pipeline: the required stages and the rank-program passes, in this order."""


def test_the_compiler_is_a_tuple_of_named_passes_each_with_its_kinds_one_signature():
    assert isinstance(RANK_COMPILER, tuple) and all(isinstance(p, RankPass) for p in RANK_COMPILER)
    names = [p.name for p in RANK_COMPILER]
    assert len(set(names)) == len(names), names
    assert [n for n in names if n in ORDER] == list(ORDER)
    assert names[-1] == "compile"
    for p in RANK_COMPILER:
        assert p.kind in KINDS, p
        params = [
            q
            for q in inspect.signature(p.run).parameters.values()
            if q.default is inspect.Parameter.empty
            and q.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        ]
        first = {"program": "gm", "record": "build"}[p.kind]
        assert [q.name for q in params] == [first, "ctx"], (p.name, [q.name for q in params])
    assert {p.name for p in RANK_COMPILER if p.required} == {
        "lower",
        "cut_stages",
        "trace_joint",
        "split_step",
    }


class _NamedAxis(AxisGroup):
    @property
    def group_name(self) -> str:
        return f"axis{self.axis}"


@pytest.fixture(scope="module")
def dp2() -> tuple[Any, ...]:
    model, inputs = H.build("gpt")
    plan = H.make_plan("dp", model, inputs, 2)
    return model, inputs, plan, capture(model, inputs)


def _target(model: Any, inputs: Any, plan: autopar.Plan, cap: Any) -> RankTarget:
    """Rank 0's target: its shards of the parameters and of the batch as the examples."""
    ax = _NamedAxis(axis=0, name=plan.mesh_axes[0], size=2, coord=0, group=None)
    b = bind_placeholders(cap, plan)
    full = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    leaves = leaves_by_path(*normalize_inputs(inputs))
    examples = []
    for kind, key in b.bindings:
        if kind == "const":
            examples.append(cap.constants[key])
            continue
        value = full[key] if kind in ("param", "buffer") else leaves[key]
        spec = b.specs[key if kind != "input" else "input:" + key]
        examples.append(local_shard(value.detach(), spec, plan.mesh_shape, (0,)))
    trainable = tuple(
        i for i, (kind, key) in enumerate(b.bindings) if kind == "param" and full[key].requires_grad
    )
    return RankTarget(
        plan=plan, axes=(ax,), device=torch.device("cpu"), roles=tuple(b.bindings), examples=tuple(examples),
        trainable=trainable,
    )  # fmt: skip


def test_a_rank_compiles_to_one_step_record_every_pass_logged_and_disabled_by_name(dp2, caplog):
    model, inputs, plan, cap = dp2
    target = _target(model, inputs, plan, cap)
    config = autopar.PlanConfig(disable=("sink_waits",))
    with caplog.at_level(logging.DEBUG, logger="autopar.passes"):
        record = compile_rank(
            target, PassContext(captured=cap, cluster=autopar.Cluster.local(2), config=config)
        )
    assert isinstance(record, RankStep) and record.step is not None and record.stages is None
    assert record.passes == tuple(p.name for p in RANK_COMPILER if p.name != "sink_waits")
    assert record.step.passes == tuple(p.__name__ for p in RANK_PASSES if p.__name__ != "sink_waits")
    assert record.program.code  # the lowered forward program, what pm.forward_code prints
    assert "all_reduce" in record.step.joint.code and "wait_tensor" in record.step.joint.code
    assert "pass sink_waits: disabled" in caplog.text
    for p in RANK_COMPILER:
        if p.name not in ("sink_waits", "compile"):  # compile: not asked for, so it does nothing
            assert f"pass {p.name}: " in caplog.text and " nodes, " in caplog.text, p.name
    assert "bucket_gradients: " in caplog.text  # the data-parallel gradients were bucketed
    assert not target.axes[0].counts, "compiling is not a step: no collective counted"
    assert target.axes[0].counting


def test_a_required_pass_cannot_be_disabled(dp2):
    model, inputs, plan, cap = dp2
    config = autopar.PlanConfig(disable=("trace_joint",))
    with pytest.raises(ValueError, match=r"disable=\['trace_joint'\].*cannot build a step"):
        compile_rank(
            _target(model, inputs, plan, cap),
            PassContext(captured=cap, cluster=autopar.Cluster.local(2), config=config),
        )


def test_uncounted_restores_each_axis():
    a = AxisGroup(axis=0, name="dp", size=2, coord=0, group=None)
    b = AxisGroup(axis=1, name="tp", size=2, coord=0, group=None, counting=False)
    with uncounted([a, b]):
        a.note("all_reduce", "fwd")
        assert not a.counting and not b.counting
    assert a.counting and not b.counting and not a.counts


def _transposed_program(w: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    h = (x @ w).view(2, 4, 6)
    return h.transpose(1, 2) * 2.0, (h * h).sum()  # a non-contiguous output, and a loss


def test_the_traced_step_takes_contiguous_tangents_as_the_runtime_sends_them() -> None:
    """A tangent is traced as the contiguous gradient a next pipeline stage sends, whatever the
    output's strides: traced against the output's own strides, the backward kept a ``view`` a
    contiguous gradient cannot take (a vision pipeline failed so)."""
    from autopar.passes.joint import placeholders, trace_joint

    w, x = torch.randn(5, 6), torch.randn(8, 5)
    jp = trace_joint(_transposed_program, [w, x], [0])
    assert jp.tangent_outputs == (0, 1) and jp.num_outputs == 2 and jp.grad_primals == (0,)
    _, tangents = placeholders(jp)
    assert [tuple(t.meta["val"].shape) for t in tangents] == [(2, 6, 4), ()]
    assert all(t.meta["val"].is_contiguous() for t in tangents)
    assert not any(n.target is torch.ops.autopar.tangent_of.default for n in jp.gm.graph.nodes)

    g_out, g_loss = torch.randn(2, 6, 4), torch.tensor(0.5)
    *outs, g_w = jp.gm(w, x, g_out, g_loss)
    wr = w.clone().requires_grad_(True)
    out, loss = _transposed_program(wr, x)
    (ref,) = torch.autograd.grad([out, loss], [wr], [g_out, g_loss])
    torch.testing.assert_close(outs[0], out.detach())
    torch.testing.assert_close(g_w, ref)

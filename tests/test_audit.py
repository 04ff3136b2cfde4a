"""The plan audit (``autopar.audit``): replicated work per mesh axis and pipeline stage, ops
without a sharding rule, communication against its bound, and MFU against the device's peak —
on hand-built plans, on plans of a small GPT (``autopar.plan``, ``layouts.megatron``) and on a
pipelined LLaMA, where the LM head and loss once ran replicated over dp."""

from __future__ import annotations

import dataclasses
import json
import math
import time
import warnings

import pytest
import torch

import autopar
from autopar.audit import REPLICATED_WARN, Audit, AuditWarning, audit, record
from autopar.models import GPT, GPTConfig
from autopar.planfile import NodePlan, PipelinePlan, Plan, Predicted, ReshardPlan
from autopar.rules.base import has_rule_for

pytestmark = pytest.mark.filterwarnings("ignore:autopar. no sharding rule")

A100 = autopar.Cluster.preset("A100-80GB", gpus_per_node=8, nodes=1)


# ------------------------------------------------------------------------------ hand-built plans
def _node(name: str, op: str, kind: str = "op", *, spec: tuple[str, ...] = ("R",), shape=(8, 16),
          inputs: tuple[str, ...] = ("x",), compute: float = 1e-3, module: str = "m") -> NodePlan:  # fmt: skip
    split = tuple(p != "R" for p in spec)
    return NodePlan(
        name=name, op=op, module=module, kind=kind, fqn=name if kind != "op" else "",
        inputs=tuple(spec for _ in inputs), input_names=inputs, outputs=(spec,), rewrites=("",) * len(spec),
        comms=("",) * len(spec), split=split, shape=shape, compute_time=compute, comm_time=0.0, memory=0.0,
    )  # fmt: skip


def _plan(nodes: list[NodePlan], mesh=(4,), axes=("dp",), step: float = 1.0, cluster=None, **kw) -> Plan:
    compute = sum(n.compute_time for n in nodes)
    return Plan(
        mesh_shape=mesh, mesh_axes=axes, nodes=nodes, params={}, param_aliases={}, inputs={},
        reshards=kw.pop("reshards", []), predicted=Predicted(step_time=step, compute_time=compute, comm_time=0.0,
        memory_per_device=0.0, comm_bytes_per_axis=kw.pop("comm", (0.0,) * len(mesh)), optimal=True),
        cluster=A100.to_dict() if cluster is None else cluster, fingerprint="x", info=kw.pop("info", {}), **kw,
    )  # fmt: skip


def _toy(loss_spec: tuple[str, ...] = ("R",), loss_compute: float = 1e-3) -> list[NodePlan]:
    """An input split over dp, a 9 ms linear split with it, a loss of ``loss_spec``, a cheap op
    and an op whose shape does not divide 4 ways (both replicated)."""
    return [
        _node("x", "placeholder", "input", spec=("S(0)",), inputs=(), compute=0.0),
        _node("linear", "linear", spec=("S(0)",), compute=9e-3),
        _node(
            "loss", "cross_entropy_loss", spec=loss_spec, compute=loss_compute, inputs=("linear",), module=""
        ),
        _node("cheap", "add", compute=2e-6, inputs=("linear",)),
        _node("odd", "mul", shape=(3, 5), compute=1e-3, inputs=("odd_in",)),
        _node("odd_in", "placeholder", "input", shape=(3, 5), inputs=(), compute=0.0),
    ]


def test_has_rule_for_names_ops_as_a_plan_records_them():
    assert has_rule_for("linear") and has_rule_for("getitem") and has_rule_for("grouped_mm_fallback")
    assert not has_rule_for("searchsorted") and not has_rule_for("no_such_op")


def test_replicated_work_is_the_stages_share_of_ops_that_could_split():
    """The loss runs whole on each of the 4 dp devices: 1 ms of 11 ms. The cheap op (one
    launch) and the op with no dimension divisible by 4 are not counted."""
    a = audit(_plan(_toy()))
    (dp,) = a.replicated
    assert dp.axis == "dp" and dp.size == 4 and dp.stage == 0
    assert dp.share == pytest.approx(1e-3 / (9e-3 + 1e-3 + 2e-6 + 1e-3))
    assert dp.ops == (("<top>: cross_entropy_loss", pytest.approx(dp.share)),)
    (f,) = [f for f in a.findings if f.kind == "replicated_work"]
    assert f.severity == "warning" and dp.share > REPLICATED_WARN
    assert "runs replicated over dp (4 devices" in f.message and "cross_entropy_loss" in f.message
    # Split over dp, nothing is flagged.
    clean = audit(_plan(_toy(loss_spec=("S(0)",))))
    assert clean.replicated[0].share == 0.0 and not clean.warnings


def test_small_replicated_work_is_info_and_axes_of_size_one_are_skipped():
    a = audit(_plan(_toy(loss_compute=1e-4)))
    assert a.replicated[0].share < REPLICATED_WARN
    assert [f.severity for f in a.findings if f.kind == "replicated_work"] == ["info"]
    nodes = [dataclasses.replace(n, inputs=tuple((*s, "R") for s in n.inputs), outputs=tuple((*s, "R") for s in n.outputs),
                                 split=(*n.split, False)) for n in _toy()]  # fmt: skip
    two = audit(_plan(nodes, mesh=(4, 1), axes=("dp", "tp")))
    assert [r.axis for r in two.replicated] == ["dp"]


def test_work_that_does_not_depend_on_the_batch_is_not_counted():
    """A position embedding's lookup of ``arange``: every device needs the whole table."""
    wpe = _node("wpe", "placeholder", "param", shape=(128, 64), inputs=(), compute=0.0)
    pos = _node("arange", "arange", shape=(128,), inputs=(), compute=2e-6)
    lookup = _node("embedding_1", "embedding", inputs=("wpe", "arange"), shape=(128, 64), compute=1e-3)
    assert audit(_plan([*_toy(loss_spec=("S(0)",)), wpe, pos, lookup])).replicated[0].share == 0.0


def test_replication_that_saves_a_larger_weight_gradient_reduction_is_not_counted():
    """An embedding lookup run whole on every dp device needs no reduction of its weight's
    gradient over dp (its 64 MiB table): splitting the 0.3 ms lookup would save less than the
    all-reduce it adds (0.34 ms on NVLink)."""
    table = _node("wte", "placeholder", "param", shape=(16384, 1024), inputs=(), compute=0.0)
    lookup = _node("embedding", "embedding", inputs=("wte", "x"), shape=(8, 16, 1024), compute=3e-4)
    a = audit(_plan([*_toy(loss_spec=("S(0)",)), table, lookup]))
    assert a.replicated[0].share == 0.0
    # Were the weight's gradient reduced over dp anyway, the lookup is wasted work.
    sync = ReshardPlan(producer="wte", consumer="other", src=("R",), dst=("R",), collectives=(),
                       grad_sync_axes=(0,), time=0.0, bytes_per_axis=(0.0,))  # fmt: skip
    assert (
        audit(_plan([*_toy(loss_spec=("S(0)",)), table, lookup], reshards=[sync])).replicated[0].share
        > REPLICATED_WARN
    )


def test_a_small_models_loss_kept_whole_over_a_slow_link_is_priced_and_not_called_waste():
    """On two local gloo processes (60 µs a message) a tiny GPT's loss is cheaper whole on each
    device than split: splitting saves ~20 µs of compute, and the split loss must be all-reduced
    (the program returns it whole), 120 µs. The prediction charges that all-reduce, as the solver
    does (before, the plan forced split predicted a faster step than the optimum's), and the audit
    does not call the whole loss waste: split all of it, the axis's replicated work would save less
    than one collective there."""
    from autopar.audit_figures import collective_floors, replicated_work
    from autopar.cost.reshard_cost import scalar_output_cost
    from autopar.mesh import Mesh
    from autopar.placement import Partial

    torch.manual_seed(0)
    model = GPT(GPTConfig.tiny(n_layer=2, n_head=4, n_embd=32, vocab_size=64))
    ids = torch.randint(0, 64, (4, 16))
    cluster = autopar.Cluster.local(2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        whole = autopar.plan(model, (ids, ids.clone()), cluster, mesh_shape=(2,))
    assert not [w for w in caught if issubclass(w.category, AuditWarning)]
    split = autopar.plan(
        model,
        (ids, ids.clone()),
        cluster,
        mesh_shape=(2,),
        fixed={"args[0]": ("S(0)",), "args[1]": ("S(0)",)},
    )
    whole_loss, split_loss = (
        next(n for n in p.nodes if n.op == "cross_entropy_loss") for p in (whole, split)
    )
    assert whole_loss.outputs == (("R",),) and split_loss.outputs == (("P",),)
    reduce = scalar_output_cost(4, (Partial(),), Mesh((2,), cluster))
    assert reduce > 1e-4 and split_loss.comm_time == pytest.approx(reduce)
    assert whole.predicted.optimal and split.predicted.step_time > whole.predicted.step_time
    # The whole loss is replicated work the audit would count without the floor, and does not.
    floors = collective_floors(whole)
    assert floors == [pytest.approx(reduce)]
    by_name = {n.name: n for n in whole.nodes}
    total = {0: sum(n.compute_time for n in whole.nodes)}
    args = (whole, by_name, {}, total, frozenset({"cross_entropy_loss", "view", "linear"}), None, 0.0)
    assert replicated_work(*args)[0].share > REPLICATED_WARN
    assert replicated_work(*args, floors=floors)[0].share == 0.0
    assert Audit.from_dict(whole.info["audit"]).replicated[0].share == 0.0


def _bn_cnn() -> torch.nn.Module:
    """Four convolutions, each with a training BatchNorm, and a classifier."""
    layers: list[torch.nn.Module] = []
    for c_in in (3, 8, 8, 8):
        layers += [
            torch.nn.Conv2d(c_in, 8, 3, padding=1, bias=False),
            torch.nn.BatchNorm2d(8),
            torch.nn.ReLU(),
        ]
    return torch.nn.Sequential(*layers, torch.nn.Flatten(), torch.nn.LazyLinear(10))


def test_a_small_cnns_batch_norms_kept_whole_over_a_slow_link_are_not_called_waste():
    """A batch norm splits its batch only by synchronizing its statistics (a collective inside
    the op). On two local gloo processes (60 µs a message) a tiny CNN is cheaper whole on each
    device than split: each of its four batch norms would pay a gather and a reduce-scatter. The
    audit counts one collective per such op on top of the one any split pays, so it does not call
    the whole model waste; with collectives a hundred times cheaper it does."""
    from autopar.audit_figures import collective_floors, replicated_work
    from autopar.rules.base import rule_names

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = _bn_cnn()

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.cross_entropy(self.body(x), y)

    torch.manual_seed(0)
    model = Net()
    batch = (torch.randn(8, 3, 8, 8), torch.randint(0, 10, (8,)))
    model(*batch)  # materialize the lazy classifier
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = autopar.plan(model, batch, autopar.Cluster.local(2), mesh_shape=(2,))
    bns = [n for n in plan.nodes if n.op == "batch_norm"]
    assert len(bns) == 4 and all(n.outputs[0] == ("R",) for n in bns)
    assert not [w for w in caught if issubclass(w.category, AuditWarning)]
    floors = collective_floors(plan)
    assert floors is not None
    by_name = {n.name: n for n in plan.nodes}
    total = {0: sum(n.compute_time for n in plan.nodes)}
    args = (plan, by_name, {}, total, rule_names(), None, 0.0)
    assert replicated_work(*args, floors=floors)[0].share == 0.0
    # One collective's floor alone would call the replicated convolutions waste.
    work = sum(n.compute_time for n in plan.nodes if n.op in ("conv2d", "batch_norm")) / 2
    assert work > floors[0]
    assert replicated_work(*args, floors=[f / 100 for f in floors])[0].share > REPLICATED_WARN


def test_channels_first_convolutions_on_tensor_cores_are_named_with_the_fix():
    """cuDNN transposes a channels-first tensor around every convolution it runs on tensor cores:
    a CNN planned in PyTorch's default layout on A100s spends a quarter of its compute there, and
    the audit says so with the fix; the same model converted to channels-last pays none, and on a
    device without tensor cores for its dtype (float32 on V100s) there is nothing to say."""

    def planned(layout: torch.memory_format, device: str) -> autopar.Plan:
        with torch.device("meta"):
            model = torch.nn.Sequential(
                *[
                    m
                    for c_in in (3, 64, 64, 64)
                    for m in (torch.nn.Conv2d(c_in, 64, 3, padding=1), torch.nn.ReLU())
                ],
                torch.nn.AdaptiveAvgPool2d(1),
                torch.nn.Flatten(),
                torch.nn.Linear(64, 10),
            )
        model = model.to(memory_format=layout)
        x = torch.empty(256, 3, 64, 64, device="meta").to(memory_format=layout)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            plan = autopar.plan(model, (x,), autopar.Cluster.preset(device, 2), mesh_shape=(2,))
        plan.info["caught"] = [str(w.message) for w in caught if issubclass(w.category, AuditWarning)]
        return plan

    first = planned(torch.contiguous_format, "A100-80GB")
    (finding,) = [f for f in Audit.from_dict(first.info["audit"]).findings if f.kind == "layout"]
    assert finding.severity == "warning" and 0.1 < finding.share < 0.6, finding
    assert "memory_format=torch.channels_last" in finding.message
    assert any("channels-last" in m for m in first.info["caught"])
    last = planned(torch.channels_last, "A100-80GB")
    assert "layout_time" not in last.info
    assert not [f for f in Audit.from_dict(last.info["audit"]).findings if f.kind == "layout"]
    assert last.predicted.step_time < first.predicted.step_time * (1 - finding.share / 2)
    v100 = planned(torch.contiguous_format, "V100-32GB")
    assert "layout_time" not in v100.info


def test_pipelined_plans_take_the_share_per_stage():
    """The 1 ms loss is 1/11 of the step's compute but all of stage 1's: the last stage's share
    is what the audit reports (a pipeline's slowest stage sets the step)."""
    nodes = _toy()
    pipe = PipelinePlan(pp=2, microbatches=2, schedule="1f1b", virtual=1,
                        stage_of={n.name: 1 if n.name == "loss" else 0 for n in nodes})  # fmt: skip
    a = audit(_plan(nodes, pipeline=pipe, cluster={}))
    assert a.replicated[0].stage == 1 and a.replicated[0].share == pytest.approx(1.0)
    assert "stage 1's compute" in a.findings[0].message


def test_ops_without_a_rule_are_listed_with_their_share():
    nodes = [
        *_toy(loss_spec=("S(0)",)),
        _node("ss", "searchsorted", compute=1e-3),
        _node("ar", "arange", inputs=()),
    ]
    a = audit(_plan(nodes))
    assert a.unruled == ("searchsorted",)  # a factory (no tensor input) has nothing to shard
    assert a.unruled_share == pytest.approx(1e-3 / sum(n.compute_time for n in nodes))
    (f,) = [f for f in a.findings if f.kind == "unruled_ops"]
    assert f.severity == "warning" and "searchsorted" in f.message
    plan = _plan(nodes)
    record(plan, warn=False)  # print(plan) shows the audit recorded with the plan
    assert "ops without a sharding rule (run replicated): searchsorted" in str(plan)


def test_model_flops_count_matmuls_and_attention_three_times_per_microbatch():
    """``2·m·n·k`` per matmul, ``4·b·h·s·s·d`` per attention, ×3 for the backward, × micro-batches."""
    nodes = [
        _node("x", "placeholder", "input", shape=(4, 32, 64), inputs=(), compute=0.0),
        _node("w", "placeholder", "param", shape=(128, 64), inputs=(), compute=0.0),
        _node("lin", "linear", shape=(4, 32, 128), inputs=("x", "w")),
        _node("q", "view", shape=(4, 2, 32, 64), inputs=("lin",), compute=0.0),
        _node("attn", "scaled_dot_product_attention", shape=(4, 2, 32, 64), inputs=("q", "q", "q")),
    ]
    fwd = 2 * 4 * 32 * 128 * 64 + 4 * (4 * 2 * 32) * 32 * 64
    assert audit(_plan(nodes)).model_flops == 3 * fwd
    pipe = PipelinePlan(pp=1, microbatches=4, schedule="1f1b", virtual=1, stage_of={})
    assert audit(_plan(nodes, pipeline=pipe)).model_flops == 4 * 3 * fwd


def test_mfu_above_the_peak_is_an_error(gpt_plan):
    a = audit(gpt_plan)
    assert a.mfu is not None and 0 < a.mfu < 0.9 and not any(f.severity == "error" for f in a.findings)
    fast = dataclasses.replace(
        gpt_plan, predicted=dataclasses.replace(gpt_plan.predicted, step_time=1e-7), info=dict(gpt_plan.info)
    )
    b = audit(fast)
    assert b.mfu > 1 and b.worst == "error"
    (f,) = [f for f in b.findings if f.kind == "utilization"]
    assert f.severity == "error" and "a bug, not a result" in f.message and f.share == b.mfu
    record(fast, warn=False)
    assert "error: predicted MFU" in str(fast)


def test_communication_is_compared_with_its_bound(gpt_plan):
    """A data-parallel plan reduces each gradient once: its bytes are the bound's."""
    a = audit(gpt_plan)
    for c in a.comm:
        assert c.bound_bytes > 0 and c.gradient_bytes == c.bound_bytes and c.bound_time > 0
        assert c.ratio == pytest.approx(1.0, rel=0.05)
    # Ten times the bytes, worth more than 5 % of the step: a warning.
    loud = dataclasses.replace(
        gpt_plan,
        predicted=dataclasses.replace(
            gpt_plan.predicted,
            comm_bytes_per_axis=tuple(100 * b for b in gpt_plan.predicted.comm_bytes_per_axis),
        ),
    )
    assert any(f.kind == "communication" and f.severity == "warning" for f in audit(loud).findings)


# ------------------------------------------------------------------------------ planned models
@pytest.fixture(scope="module")
def gpt_batch():
    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=2, n_head=4, n_embd=256, vocab_size=1024, block_size=128))
    # 64 sequences: with 16, the LM head's GEMMs on 8 A100s are too small to fill the device, so
    # splitting it further saves nothing and the optimum keeps it whole on one axis.
    idx = torch.empty(64, 128, dtype=torch.long, device="meta")
    return model, (idx, idx.clone())


@pytest.fixture(scope="module")
def gpt_planned(gpt_batch):
    """``autopar.plan`` of a small float32 GPT on 8 A100s with TF32 matmuls, and the audit warnings
    it raised (under PyTorch's default "highest" precision its matmuls run 8× slower on the plain
    FP32 units, and this tiny model's best plan becomes tensor parallelism over both axes)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = autopar.plan(*gpt_batch, A100, pp=1, float32_matmul_precision="high")
    return plan, [str(w.message) for w in caught if issubclass(w.category, AuditWarning)]


@pytest.fixture(scope="module")
def gpt_plan(gpt_planned):
    return gpt_planned[0]


def test_autopar_plan_carries_its_audit_and_raises_no_warning(gpt_planned, tmp_path):
    gpt_plan, raised = gpt_planned
    assert raised == []
    stored = gpt_plan.info["audit"]
    assert json.loads(json.dumps(stored)) == stored  # plain JSON data
    assert Audit.from_dict(stored) == audit(gpt_plan)
    assert all(f["severity"] == "info" for f in stored["findings"])
    path = tmp_path / "plan.json"
    gpt_plan.save(path)
    loaded = autopar.Plan.load(path)
    assert loaded == gpt_plan and loaded.info["audit"] == stored
    assert "audit: MFU" in str(gpt_plan)


def test_megatron_with_sequence_parallelism_is_clean_and_without_it_norms_repeat_on_tp(gpt_batch):
    """Megatron-LM's tensor parallelism without sequence parallelism runs every LayerNorm whole on
    each tp device (Korthikanti et al. 2022, §4.2.2): the audit names them; with it, nothing."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sp = autopar.layouts.megatron(
            *gpt_batch, A100, tp=4, sequence_parallel=True, float32_matmul_precision="high"
        )
    assert not [w for w in caught if issubclass(w.category, AuditWarning)]
    assert all(r.share <= REPLICATED_WARN for r in Audit.from_dict(sp.info["audit"]).replicated)
    with pytest.warns(AuditWarning, match=r"replicated over tp .*layer_norm") as got:
        plain = autopar.layouts.megatron(*gpt_batch, A100, tp=4, float32_matmul_precision="high")
    assert len(got) == 1 and got[0].filename == __file__  # one warning, at the caller's line
    tp = Audit.from_dict(plain.info["audit"]).replicated[1]
    # Above the warning threshold, the norms among its three largest, beside the residual adds (no
    # longer fused with them: that kernel measured slower than eager).
    assert tp.axis == "tp" and tp.share > REPLICATED_WARN
    assert {"blocks.*.ln_1: layer_norm", "blocks.*.ln_2: layer_norm"} <= {op for op, _ in tp.ops}


def test_fsdp_is_audited_and_splits_the_work_with_every_gathered_weight(gpt_batch):
    """``layouts.fsdp`` is audited as ``layouts.megatron`` and ``autopar.plan`` are (it was not), and
    it is FSDP: the batch split over every device, nothing of the step repeated. Before, on this
    small model, the solver gathered the batch and repeated the whole step on each device (cheaper,
    it priced, than reducing the gradients): an axis that split nothing ("rep", 100 % repeated)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = autopar.layouts.fsdp(*gpt_batch, A100, float32_matmul_precision="high")
    assert not [w for w in caught if issubclass(w.category, AuditWarning)]
    stored = plan.info["audit"]
    assert stored is not None and Audit.from_dict(stored) == audit(plan)
    (dp,) = Audit.from_dict(stored).replicated
    assert (dp.axis, dp.size) == ("dp", 8) and dp.share <= REPLICATED_WARN
    assert set(plan.zero_stages().values()) == {3}
    assert "audit: MFU" in str(plan) and "TFLOP/s" in str(plan)


def _replicate_over(plan: Plan, axis: int, names: set[str]) -> Plan:
    """``plan`` with the nodes ``names`` run whole on every device of ``axis``."""

    def whole(spec):
        return None if spec is None else tuple("R" if a == axis else p for a, p in enumerate(spec))

    nodes = [
        dataclasses.replace(
            n, inputs=tuple(whole(s) for s in n.inputs), outputs=tuple(whole(s) for s in n.outputs),
            split=tuple(False if a == axis else s for a, s in enumerate(n.split)),
        ) if n.name in names else n
        for n in plan.nodes
    ]  # fmt: skip
    return dataclasses.replace(plan, nodes=nodes, info=dict(plan.info))


def _head_and_loss(plan: Plan) -> set[str]:
    """The LM head's matmul and every op after it (the loss)."""
    ops = [n for n in plan.nodes if n.kind == "op"]
    head = max(i for i, n in enumerate(ops) if "lm_head" in n.module)
    return {n.name for n in ops[head:]}


def test_lm_head_and_loss_replicated_over_dp_are_flagged_with_their_share(gpt_plan):
    names = _head_and_loss(gpt_plan)
    wasteful = _replicate_over(gpt_plan, 0, names)
    a = audit(wasteful)
    cheap = 4 * A100.device.kernel_overhead
    total = sum(n.compute_time for n in gpt_plan.nodes)
    head = sum(n.compute_time for n in wasteful.nodes if n.name in names and n.compute_time > cheap) / total
    before = audit(gpt_plan).replicated[0].share  # the position embedding's lookup, already whole on dp
    expected = before + head
    assert a.replicated[0].share == pytest.approx(expected) and head > 0.05
    assert a.replicated[0].ops[0][0] == "lm_head: linear"
    assert any(f.kind == "replicated_work" and f.severity == "warning" for f in a.findings)


@pytest.mark.timeout(180)
def test_pipelined_llama_audit_is_clean_and_catches_a_replicated_head(make_llama):
    """LLaMA in two pipeline stages of 2 micro-batches on 2 nodes × 8 A100s: every stage's work is
    split over dp (before the capture fix, the LM head and loss of the micro-batch graph ran whole
    on each of the 8 dp devices). The same plan with its head and loss made whole over dp is
    flagged on the last stage, with their share of that stage's compute."""
    model = make_llama(layers=2, hidden=256, heads=4, kv_heads=2, vocab_size=8192, meta=True)
    ids = torch.empty(16, 128, dtype=torch.long, device="meta")
    cluster = autopar.Cluster.preset("A100-80GB", gpus_per_node=8, nodes=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = autopar.layouts.megatron(model, {"input_ids": ids, "labels": ids.clone()}, cluster, tp=1, pp=2,
                                        microbatches=2)  # fmt: skip
    assert not [str(w.message) for w in caught if issubclass(w.category, AuditWarning)]
    a = Audit.from_dict(plan.info["audit"])
    assert a.replicated[0].axis == "dp" and a.replicated[0].share <= REPLICATED_WARN
    last = plan.pipeline.num_stages - 1
    names = {n for n in _head_and_loss(plan) if plan.pipeline.stage_of.get(n) == last}
    b = audit(_replicate_over(plan, 0, names))
    stage = sum(n.compute_time for n in plan.nodes if plan.pipeline.stage_of.get(n.name) == last)
    head = next(n for n in plan.nodes if n.name in names and n.op == "linear")
    assert b.replicated[0].stage == last and b.replicated[0].share >= head.compute_time / stage > 0.1
    assert b.warnings and "stage 1's compute runs replicated over dp" in b.warnings[0].message


def test_the_audit_of_a_32_layer_plan_takes_well_under_50_ms(gpt_plan):
    """A plan sixteen times as deep as the 2-layer GPT's (its blocks repeated), audited."""
    blocks = [n for n in gpt_plan.nodes if ".0." in n.module or n.module.endswith(".0")]
    extra = [
        dataclasses.replace(n, name=f"{n.name}_L{i}", module=n.module.replace(".0", f".{i}", 1))
        for i in range(2, 32)
        for n in blocks
    ]
    deep = dataclasses.replace(gpt_plan, nodes=[*gpt_plan.nodes, *extra], reshards=gpt_plan.reshards * 16)
    assert len(deep.nodes) > 1000
    audit(deep)
    t0 = time.perf_counter()
    audit(deep)
    assert time.perf_counter() - t0 < 0.05
    assert math.isfinite(audit(deep).replicated[0].share)

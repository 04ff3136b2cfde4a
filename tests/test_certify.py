"""Plans as certificates (``autopar.passes.certify``): lowering refuses a plan whose strategies its
ops do not allow or whose reshards do not connect producer to consumer, naming the node; plans
autopar makes pass; ``Plan.save``'s checksum catches an edited file."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import autopar
from autopar.models import GPT, GPTConfig
from autopar.passes.certify import CertificateError, certify
from autopar.passes.lower import lower
from autopar.program.collectives import AxisGroup
from autopar.runtime.launch import spawn

VOCAB, BATCH, SEQ = 64, 4, 16


def _gpt(n_layer: int = 2) -> tuple[GPT, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    model = GPT(GPTConfig.tiny(n_layer=n_layer, n_head=4, n_embd=32, vocab_size=VOCAB))
    return model, (torch.randint(0, VOCAB, (BATCH, SEQ)), torch.randint(0, VOCAB, (BATCH, SEQ)))


@pytest.fixture(scope="module")
def megatron():
    """The tiny GPT, its capture and the Megatron plan on 2 × 2 devices (dp × tp)."""
    model, inputs = _gpt()
    plan = autopar.layouts.megatron(model, inputs, autopar.Cluster.local(4), tp=2)
    return model, inputs, autopar.capture(model, inputs), plan


def _axes(plan, coord):
    return [
        AxisGroup(axis=a, name=name, size=n, coord=c, group=None)
        for a, (name, n, c) in enumerate(zip(plan.mesh_axes, plan.mesh_shape, coord))
    ]


def _with_node(plan, name, **changes):
    nodes = [dataclasses.replace(n, **changes) if n.name == name else n for n in plan.nodes]
    return dataclasses.replace(plan, nodes=nodes)


def _partial_output(plan):
    """The first matmul whose output is partial on some axis (row-parallel)."""
    return next(
        n
        for n in plan.nodes
        if n.op in ("mm", "addmm", "linear", "matmul") and any("P" in o for o in n.outputs)
    )


def test_plans_autopar_makes_are_certified(megatron):
    """Megatron (tensor- and vocabulary-parallel), the solver's own plan on a 2-D mesh, ZeRO-3
    (every parameter sharded), and a pipelined plan, each lowered for every rank."""
    model, inputs, cap, plan = megatron
    cluster = autopar.Cluster.local(4)
    auto = autopar.plan(model, inputs, cluster, mesh_shape=(2, 2))
    zero = autopar.layouts.fsdp(model, inputs, cluster)
    assert zero.zero_stages()
    for p in (plan, auto, zero):
        certify(cap.graph, p, cap.params)
        for coord in ((0, 0), (1, 1)):
            lower(cap, p, _axes(p, coord[: len(p.mesh_shape)]), device="cpu")
    piped = autopar.plan(model, inputs, cluster, pp=2, microbatches=2)
    assert piped.pipeline is not None
    micro = autopar.capture(model, tuple(x[: BATCH // 2] for x in inputs))
    assert micro.fingerprint == piped.fingerprint
    certify(micro.graph, piped, micro.params)


def test_a_partial_output_edited_to_replicated_is_refused_naming_the_node(megatron, tmp_path):
    """The issue's case: one node's output changed from ``P`` to ``R`` (valid syntax) loaded,
    lowered and trained to a slightly wrong loss; now the file's checksum says it was edited, and
    a deliberate load is refused by lowering, naming the node and why."""
    _, _, cap, plan = megatron
    node = _partial_output(plan)
    path = tmp_path / "plan.json"
    plan.save(path)
    d = json.loads(path.read_text())
    (entry,) = [n for n in d["nodes"] if n["name"] == node.name]
    entry["outputs"][0] = ["R" if p == "P" else p for p in entry["outputs"][0]]
    path.write_text(json.dumps(d, indent=1))
    with pytest.raises(ValueError, match=r"plan\.json: edited after autopar wrote it"):
        autopar.Plan.load(path)
    edited = autopar.Plan.load(path, verify=False)
    with pytest.raises(CertificateError, match=rf"at node {node.name} \({node.op} in {node.module}\)") as err:
        lower(cap, edited, _axes(edited, (0, 0)), device="cpu")
    assert "give (P)" in str(err.value) and "not (R) as the plan says" in str(err.value), str(err.value)


def test_a_reshard_whose_source_disagrees_with_its_producer_is_refused(megatron):
    _, _, cap, plan = megatron
    r = next(r for r in plan.reshards if r.src != r.dst)
    other = tuple("R" if p != "R" else "S(0)" for p in r.src)
    reshards = [dataclasses.replace(x, src=other) if x is r else x for x in plan.reshards]
    with pytest.raises(
        CertificateError, match=rf"at node {r.consumer} .*starts from .*but {r.producer} gives"
    ):
        certify(cap.graph, dataclasses.replace(plan, reshards=reshards), cap.params)
    dropped = [x for x in plan.reshards if x is not r]
    with pytest.raises(CertificateError, match=rf"at node {r.consumer} .*no reshard between them"):
        certify(cap.graph, dataclasses.replace(plan, reshards=dropped), cap.params)


def test_a_consumer_reading_another_layout_than_its_reshard_delivers_is_refused(megatron):
    """A consumer's input spec edited (to one its op also allows) no longer matches the reshard."""
    _, _, cap, plan = megatron
    r = next(r for r in plan.reshards if r.src != r.dst)
    consumer = plan.node(r.consumer)
    j = consumer.input_names.index(r.producer)
    inputs = list(consumer.inputs)
    inputs[j] = r.src  # reads the producer as it is, while the plan still reshards it
    with pytest.raises(CertificateError, match=rf"at node {r.consumer} "):
        certify(cap.graph, _with_node(plan, r.consumer, inputs=tuple(inputs)), cap.params)


def test_other_edits_are_refused(megatron):
    """A dropped rewrite, a sharding that does not divide, a ZeRO stage on an activation, a
    parameter table that disagrees with its node, a node the program lacks."""
    _, _, cap, plan = megatron
    loss = next(n for n in plan.nodes if any(n.rewrites))
    with pytest.raises(CertificateError, match=rf"at node {loss.name} "):
        certify(cap.graph, _with_node(plan, loss.name, rewrites=("",) * len(loss.rewrites)), cap.params)
    w = next(n for n in plan.nodes if n.kind == "param" and len(n.shape) == 1)
    bad = tuple(f"S({len(w.shape)})" for _ in w.outputs[0])
    with pytest.raises(CertificateError, match=rf"at node {w.name} "):
        certify(cap.graph, _with_node(plan, w.name, outputs=(bad,)), cap.params)
    op = next(n for n in plan.nodes if n.kind == "op")
    with pytest.raises(CertificateError, match=rf"at node {op.name} .*ZeRO stage"):
        certify(cap.graph, _with_node(plan, op.name, zero_stage=3), cap.params)
    p = next(n for n in plan.nodes if n.kind == "param" and "S(0)" in n.outputs[0])
    table = {**plan.params, p.fqn: tuple("R" for _ in p.outputs[0])}
    with pytest.raises(CertificateError, match=rf"at node {p.name} .*params table places {p.fqn}"):
        certify(cap.graph, dataclasses.replace(plan, params=table), cap.params)
    ghost = dataclasses.replace(op, name="not_a_node")
    with pytest.raises(CertificateError, match="node not_a_node is not in this program"):
        certify(cap.graph, dataclasses.replace(plan, nodes=[*plan.nodes, ghost]), cap.params)


def _edited_worker(rank: int, world: int, text: str) -> str:
    import time

    model, inputs = _gpt()
    plan = autopar.Plan.from_dict(json.loads(text))
    t0 = time.monotonic()
    try:
        autopar.parallelize(model, autopar.Cluster.local(world), inputs, plan=plan, timeout=30)
    except CertificateError as e:
        return f"{time.monotonic() - t0:.1f}|{e}"
    return "accepted"


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_every_rank_refuses_an_edited_plan_identically(megatron):
    """``parallelize`` on 4 gloo processes: every rank refuses the edited plan with the same
    message, before any collective (none waits for another)."""
    _, _, _, plan = megatron
    node = _partial_output(plan)
    outputs = tuple(tuple("R" if p == "P" else p for p in o) for o in node.outputs)
    text = json.dumps(_with_node(plan, node.name, outputs=outputs).to_dict())
    results = spawn(_edited_worker, 4, text, timeout=150)
    assert all(r != "accepted" for r in results), results
    messages = {r.split("|", 1)[1] for r in results}
    assert len(messages) == 1 and f"at node {node.name}" in messages.pop()

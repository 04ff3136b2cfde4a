"""Recomputing random ops: a dropout is recomputed in backward by replaying the generator state
its forward draw recorded (``autopar.program.rng``), so no dropout mask is kept — as Megatron-LM's
full recomputation does.

* pure: ``run_with_rng_state`` draws what ``run_and_save_rng_state`` drew and leaves the generator
  as it found it; dead-code elimination keeps a forward draw whose outputs are unused;
* graph: ``passes.strategies.recomputed`` counts dropout inside a repeated layer as recomputed
  under ``full`` and attention dropout under ``selective``, and the planned memory drops by
  exactly the masks' bytes;
* runs (1 and 2 gloo processes, plans saved as JSON and loaded by the workers): the project's GPT
  and GPT-2 with dropout 0.1 train 3 AdamW steps under ``full`` and ``selective`` with the losses
  and parameters of the same plan under ``none``, bit for bit, and leave the generator where it
  would be (the next draw is the same).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import _runtime_helpers as H
import pytest
import torch

import autopar
from autopar.program.rng import run_and_save_rng_state, run_with_rng_state
from autopar.runtime.launch import spawn

pytestmark = pytest.mark.filterwarnings("ignore:autopar")

P = 0.1
MODES = ("none", "full", "selective")


def build(kind: str, seed: int = 0) -> tuple[torch.nn.Module, Any]:
    """Tiny models with dropout ``P`` everywhere: ``gpt`` (``autopar.models.GPT``, fused attention,
    residual and embedding dropout), ``gpt-math`` (its scores materialised, attention dropout on
    them) and ``gpt2-eager`` (transformers' GPT-2, eager attention: resid, attn and embd pdrop)."""
    torch.manual_seed(seed)
    ids = torch.randint(0, H.VOCAB, (H.BATCH, H.SEQ))
    if kind in ("gpt", "gpt-math"):
        from autopar.models import GPT, GPTConfig

        cfg = GPTConfig.tiny(n_layer=2, n_head=4, n_embd=32, vocab_size=H.VOCAB, dropout=P)
        if kind == "gpt-math":
            cfg = dataclasses.replace(cfg, attention="math")
        return GPT(cfg), (ids, torch.randint(0, H.VOCAB, (H.BATCH, H.SEQ)))
    if kind == "gpt2-eager":
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(
            n_layer=2, n_embd=32, n_head=4, vocab_size=H.VOCAB, n_positions=32,
            resid_pdrop=P, embd_pdrop=P, attn_pdrop=P, use_cache=False, bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
        model = GPT2LMHeadModel(cfg)
        model.config._attn_implementation = "eager"
        return model, {"input_ids": ids, "labels": ids.clone()}
    raise ValueError(kind)


# ------------------------------------------------------------------------------ pure


def test_replay_draws_the_same_and_leaves_the_generator_alone():
    x = torch.full((64,), 0.5)
    torch.manual_seed(7)
    state, first = run_and_save_rng_state(torch.bernoulli, x)
    after_forward = torch.get_rng_state()
    again_state, again = run_with_rng_state(state, torch.bernoulli, x)
    assert again_state is state and torch.equal(again, first)
    assert torch.equal(torch.get_rng_state(), after_forward)
    # an explicit generator is the one recorded and replayed; the default one is untouched
    g = torch.Generator().manual_seed(3)
    state, first = run_and_save_rng_state(torch.rand, 8, generator=g)
    default_before, g_before = torch.get_rng_state(), g.get_state()
    _, again = run_with_rng_state(state, torch.rand, 8, generator=g)
    assert torch.equal(again, first)
    assert torch.equal(g.get_state(), g_before) and torch.equal(torch.get_rng_state(), default_before)


def test_dead_code_elimination_keeps_a_forward_draw():
    g = torch.fx.Graph()
    x = g.placeholder("x")
    dropout = torch.ops.aten.native_dropout.default
    draw = g.call_function(run_and_save_rng_state, (dropout, x, 0.5, True))  # result unused
    state = g.call_function(torch.get_rng_state)
    g.call_function(run_with_rng_state, (state, dropout, x, 0.5, True))  # result unused
    g.output(x)
    g.eliminate_dead_code()
    targets = [n.target for n in g.nodes if n.op == "call_function"]
    assert draw.target in targets  # it advances the generator: a side effect
    assert run_with_rng_state not in targets  # it puts the generator back: removable when unused


# ------------------------------------------------------------------------------ graph


def _recompute_sources(kind: str, mode: str) -> tuple[Any, frozenset[str]]:
    from autopar.capture import capture
    from autopar.config import PlanConfig
    from autopar.passes import PassContext
    from autopar.passes.rank_compiler import recompute_info

    model, inputs = build(kind)
    cap = capture(model, inputs)
    info = recompute_info(
        PassContext(captured=cap, cluster=autopar.Cluster.local(1), config=PlanConfig()), mode
    )
    return cap, info["recompute_sources"]


@pytest.mark.parametrize("kind", ["gpt-math", "gpt2-eager"])
def test_dropout_counts_as_recomputed(kind):
    from autopar.graph import is_random, outer_instance
    from autopar.ir import TENSOR

    cap, full = _recompute_sources(kind, "full")
    _, selective = _recompute_sources(kind, "selective")
    drops = [n for n in cap.gm.graph.nodes if is_random(n)]
    in_layer = [n for n in drops if "*" in n.meta[TENSOR].layer]
    attention = [n for n in in_layer if n.meta["val"].shape[-1] == n.meta["val"].shape[-2] == H.SEQ]
    assert len(in_layer) == 3 * 2 and len(drops) == len(in_layer) + 1, [n.name for n in drops]
    # full: every dropout inside a layer (the embeddings' dropout is outside any: kept)
    assert {n.name for n in drops if n.name in full} == {n.name for n in in_layer}
    assert all(outer_instance(n.meta[TENSOR].module) for n in in_layer)
    # selective: the attention dropout, on the s × s scores (GPT's math attention reaches them
    # through baddbmm's (b·h) × s × s viewed as b × h × s × s)
    assert len(attention) == 2
    assert {n.name for n in drops if n.name in selective} == {n.name for n in attention}


def test_full_recomputation_keeps_no_dropout_mask():
    """GPT with dropout under full recomputation plans exactly the masks' bytes (one byte per
    element of both residual-branch dropouts of every layer) below the old rule, which kept them."""
    from autopar.graph import op_name
    from autopar.models import GPT, GPTConfig
    from autopar.passes import strategy_cost

    layers, hidden, seq, batch = 4, 256, 256, 8
    with torch.device("meta"):
        model = GPT(
            GPTConfig(n_layer=layers, n_head=8, n_embd=hidden, block_size=seq, vocab_size=4096, dropout=P)
        )
    ids = torch.empty(batch, seq, dtype=torch.long, device="meta")
    cluster = autopar.Cluster.preset("A100-80GB", gpus_per_node=1)

    def plan(mode: str) -> float:
        return autopar.plan(
            model, (ids, ids), cluster, recompute=mode, mesh_shape=(1,)
        ).predicted.memory_per_device

    full, none = plan("full"), plan("none")
    rule = strategy_cost.recomputed
    with (
        pytest.MonkeyPatch.context() as mp
    ):  # the old rule, where strategies are priced: random ops never recomputed
        mp.setattr(
            strategy_cost,
            "recomputed",
            lambda n, m, layers=None: op_name(n) != "dropout" and rule(n, m, layers),
        )
        kept = plan("full")
    assert full < kept < none
    assert kept - full == 2 * batch * seq * hidden * layers


# ------------------------------------------------------------------------------ runs


def _saved_bytes(step: Any) -> int:
    out = next(n for n in reversed(step.forward.graph.nodes) if n.op == "output")
    vals = [a.meta.get("val") for a in out.args[0][step.num_outputs :] if hasattr(a, "meta")]
    return sum(math.prod(v.shape) * v.element_size() for v in vals if isinstance(v, torch.Tensor))


def rng_worker(rank: int, world: int, cases: list[tuple[str, str, str]]) -> dict[str, Any]:
    """Train every ``(kind, layout, plan path)`` under each recomputation mode from the same
    weights and seed; the losses, parameters, generator state and next draw of each run."""
    H.quiet()
    out: dict[str, Any] = {}
    for kind, layout, path in cases:
        model, inputs = build(kind)
        initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
        plan = autopar.Plan.load(path)
        cap = autopar.capture(model, inputs)  # every mode's module built from one export
        for mode in MODES:
            pm = autopar.parallelize(
                model,
                autopar.Cluster.local(world),
                inputs,
                plan=dataclasses.replace(plan, recompute=mode),
                captured=cap,
            )
            pm.load_full_state_dict(initial)
            torch.manual_seed(1234 + rank)
            losses = H.train(pm, inputs, H.make_optimizer("adamw", pm.parameters()))
            programs = [pm.step] if pm.step is not None else list(pm.pipeline.steps.values())
            code = "\n".join(s.joint.code for s in programs)
            out[f"{kind} {layout} {mode}"] = {
                "losses": losses,
                "params": pm.full_state_dict(),
                "rng": torch.get_rng_state(),
                "next": torch.rand(4),
                "replays": code.count("run_with_rng_state("),
                "saved": sum(_saved_bytes(s) for s in programs) if pm.step is not None else None,
            }
    return out


def _plans(world: int, kinds: list[str], tmp: Path) -> list[tuple[str, str, str]]:
    """Plans (under ``full``) saved as JSON: what the workers load."""
    cluster = autopar.Cluster.local(world)
    cases = []
    for kind in kinds:
        model, inputs = build(kind)
        layouts = {"auto": autopar.plan(model, inputs, cluster, recompute="full")}
        if world == 2:
            layouts["megatron"] = autopar.layouts.megatron(model, inputs, cluster, tp=2, recompute="full")
            if kind == "gpt":
                layouts["pp2"] = autopar.plan(
                    model, inputs, cluster, recompute="full", pp=2, microbatches=2, schedule="1f1b"
                )
        for layout, plan in layouts.items():
            path = tmp / f"{kind}-{layout}-{world}.json"
            plan.save(path)
            cases.append((kind, layout, str(path)))
    return cases


def _compare(results: list[dict[str, Any]]) -> list[str]:
    problems = []
    for rank, res in enumerate(results):
        for key, got in res.items():
            kind, layout, mode = key.split()
            if mode == "none":
                continue
            ref = res[f"{kind} {layout} none"]
            what = f"{key} rank {rank}"
            for i, (a, b) in enumerate(zip(got["losses"], ref["losses"])):
                if abs(a - b) > 1e-5 * abs(b):
                    problems.append(f"{what}: loss {i} {a} vs {b} without recomputation")
            for name, v in ref["params"].items():
                if not torch.equal(got["params"][name], v):
                    err = ((got["params"][name] - v).abs().max() / v.abs().max().clamp_min(1e-12)).item()
                    if err > 1e-5:
                        problems.append(f"{what}: {name} differs (rel {err:.2e})")
            if not torch.equal(got["rng"], ref["rng"]) or not torch.equal(got["next"], ref["next"]):
                problems.append(f"{what}: the generator is not where the run without recomputation left it")
            if mode == "full" and got["replays"] == 0:
                problems.append(f"{what}: no dropout replayed in backward")
            if mode == "selective" and kind == "gpt2-eager" and got["replays"] == 0:
                problems.append(f"{what}: the attention dropout is not replayed in backward")
            if got["saved"] is not None and mode == "full" and not got["saved"] < ref["saved"]:
                problems.append(f"{what}: saves {got['saved']} bytes, none saves {ref['saved']}")
    return problems


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_recomputed_dropout_trains_exactly_on_one_process(tmp_path):
    cases = _plans(1, ["gpt", "gpt-math", "gpt2-eager"], tmp_path)
    results = spawn(rng_worker, 1, cases, timeout=280)
    problems = _compare(results)
    assert not problems, "\n".join(problems)


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_recomputed_dropout_trains_exactly_on_two_processes(tmp_path):
    cases = _plans(2, ["gpt", "gpt2-eager"], tmp_path)
    results = spawn(rng_worker, 2, cases, timeout=560)
    problems = _compare(results)
    assert not problems, "\n".join(problems)

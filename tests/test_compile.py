"""``parallelize(..., compile=True)``: the per-rank step programs compiled by Inductor
(``autopar.passes.compile``) train as one process does.

* One process: a hand-built program compiled and its guard (a wrong shape refused, another layout
  copied into the compiled one); a program calling a Python function refused by name.
* Two gloo processes, one spawn: our tiny GPT under Megatron tensor parallelism (collectives in
  the forward and backward programs; the replicated weights' gradients all-reduced in buckets),
  ZeRO-3 (gathers and reduce-scatters) and a two-stage pipeline, each compiled, three AdamW
  steps against one process (``_runtime_helpers.compare_training``'s tolerances: losses within a
  relative 1e-5); then the Megatron plan again with a compile failure on one rank only, after
  which both ranks run eagerly, one warning on rank 0 names the rank that failed, and training
  is still right.

Inductor compiles C++ on the CPU: each plan costs tens of seconds of compilation per rank, so the
plans share one spawn, the model is the runtime tests' two-layer GPT, and pure data parallelism
(gradient buckets all-reduced, which the Megatron layout's programs hold too) is not compiled
here. The fallback plan is one compiled before: rank 0 compiles it again from Inductor's cache.
"""

from __future__ import annotations

import operator
import warnings
from typing import Any

import _runtime_helpers as H
import pytest
import torch
from torch.fx import Graph, GraphModule

from autopar.runtime.launch import spawn

pytestmark = pytest.mark.filterwarnings("ignore:autopar. no sharding rule")

LAYOUTS = ("megatron", "zero3", "pp2")


def _add_mul() -> GraphModule:
    """``(x, y) -> (x + y, None, (x + y) * y)`` on 4 × 8 float tensors, as the trace records them
    (``None``: a gradient a weight-gradient program does not compute)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    g = Graph()
    x, y = g.placeholder("x"), g.placeholder("y")
    with FakeTensorMode() as mode:
        for ph in (x, y):
            ph.meta["val"] = mode.from_tensor(torch.empty(4, 8))
    s = g.call_function(torch.ops.aten.add.Tensor, (x, y))
    p = g.call_function(torch.ops.aten.mul.Tensor, (s, y))
    g.output((s, None, p))
    return GraphModule(torch.nn.Module(), g)


@pytest.mark.timeout(180)
def test_compiled_program_matches_the_graph_and_guards_its_inputs():
    from autopar.passes.compile import compile_program

    gm = _add_mul()
    prog = compile_program(gm, "forward")
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    got = prog(x, y)
    assert got[1] is None
    for a, b in zip(got, gm(x, y)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    xt = torch.randn(8, 4).t()  # the right shape, another layout: copied into the compiled one
    for a, b in zip(prog(xt, y), gm(xt, y)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"compiled forward: input 0 is \(4, 9\).*compiled for \(4, 8\)"):
        prog(torch.randn(4, 9), y)
    assert prog.seconds > 0


def test_a_python_function_in_a_program_is_refused_by_name():
    from autopar.passes.compile import CompileError, compile_program

    gm = _add_mul()
    out = next(n for n in gm.graph.nodes if n.op == "output")
    with gm.graph.inserting_before(out):
        extra = gm.graph.call_function(operator.neg, (out.args[0][0],))  # a plain Python function
    out.args = ((*out.args[0], extra),)
    gm.recompile()
    with pytest.raises(CompileError, match=r"backward: node neg calls the Python function neg"):
        compile_program(gm, "backward")


# ------------------------------------------------------------------------------------ two processes


def _plans(world: int) -> dict[str, Any]:
    import autopar

    model, inputs = H.build("gpt")
    plans = {mode: H.make_plan(mode, model, inputs, world) for mode in ("megatron", "zero3")}
    plans["pp2"] = autopar.plan(
        model, inputs, autopar.Cluster.local(world), pp=2, microbatches=2, schedule="1f1b"
    )
    return plans


def compile_worker(rank: int, world: int, plans: dict[str, Any]) -> dict[str, Any]:
    """Each layout compiled and trained three AdamW steps; then the Megatron plan again with
    compilation failing on rank 1 only."""
    H.quiet()
    import autopar
    import autopar.passes.compile as compile_pass

    model, inputs = H.build("gpt")
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    cluster = autopar.Cluster.local(world)
    results: dict[str, Any] = {}
    for mode, plan in plans.items():
        pm = autopar.parallelize(model, cluster, inputs, plan=plan, compile=True)
        pm.load_full_state_dict(initial)
        programs = [pm.step] if pm.step is not None else list(pm.pipeline.steps.values())
        losses = H.train(pm, inputs, H.make_optimizer("adamw", pm.parameters()))
        results[mode] = {
            "report": pm.compiled,
            "compiled": sorted(k for p in programs for k in p.compiled),
            "training": (losses, pm.full_state_dict()),
        }

    real = compile_pass.compile_program

    def fails_on_rank_1(gm: Any, name: str) -> Any:
        if rank == 1:
            raise compile_pass.CompileError(f"{name}: injected failure")
        return real(gm, name)

    compile_pass.compile_program = fails_on_rank_1
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pm = autopar.parallelize(model, cluster, inputs, plan=plans["megatron"], compile=True)
    finally:
        compile_pass.compile_program = real
    pm.load_full_state_dict(initial)
    losses = H.train(pm, inputs, H.make_optimizer("adamw", pm.parameters()))
    results["fallback"] = {
        "report": pm.compiled,
        "compiled": sorted(pm.step.compiled),
        "warnings": [str(w.message) for w in caught if "compile=True" in str(w.message)],
        "training": (losses, pm.full_state_dict()),
    }
    return results


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_compiled_steps_train_like_one_process_and_a_failure_falls_back_everywhere():
    plans = _plans(2)
    assert plans["pp2"].pipeline is not None and plans["pp2"].pipeline.pp == 2
    ref = H.reference("gpt", "adamw")
    results = spawn(compile_worker, 2, plans, timeout=560)
    for rank, res in enumerate(results):
        for mode in LAYOUTS:
            r = res[mode]
            assert r["report"].compiled, (rank, mode, r["report"])
            assert r["compiled"], (rank, mode, "no program ran compiled")
            assert r["report"].total_seconds > 0
            problems = H.compare_training(ref, r["training"], "adamw", f"rank {rank} {mode} compiled")
            assert not problems, problems
        fb = res["fallback"]
        assert not fb["report"].compiled and fb["compiled"] == [], (rank, fb["report"])
        assert "rank 1: forward: injected failure" in fb["report"].reason
        problems = H.compare_training(ref, fb["training"], "adamw", f"rank {rank} after the fallback")
        assert not problems, problems
    # One warning in all: rank 0's (parallelize silences the other ranks' identical warnings).
    assert len(results[0]["fallback"]["warnings"]) == 1, results[0]["fallback"]["warnings"]
    assert "rank 1: forward: injected failure" in results[0]["fallback"]["warnings"][0]
    assert results[1]["fallback"]["warnings"] == []

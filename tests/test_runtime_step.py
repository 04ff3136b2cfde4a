"""The whole training step as one per-rank program, on 2 gloo processes: what ``pm.code`` shows,
the step's timing, and the fallback for a model whose backward cannot be traced."""

from __future__ import annotations

import warnings
from typing import Any

import _runtime_helpers as H
import pytest
import torch
from torch import nn

import autopar
from autopar.runtime.launch import spawn

pytestmark = pytest.mark.filterwarnings("ignore:autopar. no sharding rule")


@torch.library.custom_op("autopar_test::opaque_scale", mutates_args=())
def opaque_scale(x: torch.Tensor) -> torch.Tensor:
    """A custom op (as a user's kernel library registers one): ``2·x``."""
    return x * 2


@opaque_scale.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def _opaque_backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
    # Reads a value on the host: fine eagerly, impossible to trace with fake tensors, so a model
    # using this op cannot have its backward captured into the per-rank program.
    scale = 2.0 if g.abs().max().item() >= 0 else 0.0
    return g * scale


opaque_scale.register_autograd(_opaque_backward)


class OpaqueMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((self.b(opaque_scale(torch.relu(self.a(x)))) - y) ** 2).mean()


def _opaque(seed: int = 0) -> tuple[nn.Module, tuple]:
    torch.manual_seed(seed)
    return OpaqueMLP(), (torch.randn(8, 8), torch.randn(8, 4))


def step_worker(rank: int, world: int) -> dict[str, Any]:
    H.quiet()
    out: dict[str, Any] = {}
    cluster = autopar.Cluster.local(world)
    # 1. A model whose backward cannot be traced: one warning, and it still trains exactly.
    model, inputs = _opaque()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pm = autopar.parallelize(model, cluster, inputs)
    out["opaque_captured"] = pm.step is not None
    out["opaque_warnings"] = [str(w.message) for w in caught if "could not be captured" in str(w.message)]
    out["opaque_losses"] = H.train(pm, inputs, torch.optim.SGD(pm.parameters(), lr=0.1))
    # 2. Megatron layout: the joint program shows both directions' collectives, issue and wait.
    model, inputs = H.build("gpt")
    plan = autopar.layouts.megatron(model, inputs, cluster, tp=world)
    pm = autopar.parallelize(model, cluster, inputs, plan=plan)
    out["code"] = pm.code
    out["forward_code"] = pm.forward_code
    out["calls"] = {d: [(c.kind, c.numel) for c in calls] for d, calls in pm.step.calls.items()}
    # 3. Step timing: one StepTimes per step.
    pm.step.enable_timing()
    losses = H.train(pm, inputs, H.make_optimizer("adamw", pm.parameters()), steps=2)
    out["times"] = [(t.step, t.exposed_comm) for t in pm.step.times]
    out["timed_losses"] = losses
    return out


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    return spawn(step_worker, 2, timeout=300)


@pytest.mark.distributed
@pytest.mark.timeout(320)
def test_untraceable_backward_falls_back_with_one_warning_and_trains_exactly(runs):
    model, inputs = _opaque()
    ref = H.train(model, inputs, torch.optim.SGD(model.parameters(), lr=0.1))
    for rank, r in enumerate(runs):
        assert r["opaque_captured"] is False
        # Once, not once per rank: rank 0 shows it (every rank runs the same code).
        assert len(r["opaque_warnings"]) == (1 if rank == 0 else 0), (rank, r["opaque_warnings"])
        for a, b in zip(r["opaque_losses"], ref):
            assert abs(a - b) <= 1e-5 * abs(b)
    assert "DataDependent" in runs[0]["opaque_warnings"][0] or "item" in runs[0]["opaque_warnings"][0]


@pytest.mark.distributed
@pytest.mark.timeout(320)
def test_pm_code_is_the_whole_step_with_every_collective_issued_and_waited(runs):
    r = runs[0]
    code, fwd = r["code"], r["forward_code"]
    issues = code.count("_c10d_functional.all_reduce.default")
    waits = code.count("_c10d_functional.wait_tensor.default")
    # Two layers × (g after attention and MLP forward; f before QKV and MLP input backward) plus
    # the LM head's input (column-parallel) and the loss: all issued and completed by a wait.
    assert issues >= 8 and waits >= issues
    assert "threshold_backward" in code or "gelu_backward" in code  # the backward is in it
    assert "gelu_backward" not in fwd
    fwd_ar = [n for k, n in r["calls"]["fwd"] if k == "all_reduce"]
    bwd_ar = [n for k, n in r["calls"]["bwd"] if k == "all_reduce"]
    assert len(fwd_ar) >= 4 and len(bwd_ar) >= 4
    batch_tokens_times_width = H.BATCH * H.SEQ * 32
    assert fwd_ar.count(batch_tokens_times_width) >= 4  # g moves a whole [B, T, C] activation


@pytest.mark.distributed
@pytest.mark.timeout(320)
def test_step_timing_records_step_and_exposed_communication(runs):
    for r in runs:
        assert len(r["times"]) == 2
        for step, exposed in r["times"]:
            assert 0 < exposed < step

"""A plan saved as JSON runs where OR-Tools cannot be imported: the runtime reads only the Plan.

The pytest process plans (with the solver) and saves the plan; the spawned workers start with a
``sitecustomize`` (on ``PYTHONPATH``) that installs a meta-path finder refusing ``ortools``, so the
block is in place before anything — ``autopar`` included — is imported. They load the plan, build
the ParallelModule, train, and report that ``ortools`` never got into ``sys.modules``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import _runtime_helpers as H
import pytest

import autopar
from autopar.runtime.launch import spawn

SITECUSTOMIZE = '''"""Written by tests/test_runtime_saved_plan.py: this interpreter has no OR-Tools."""
import importlib.abc
import sys


class NoOrtools(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname == "ortools" or fullname.startswith("ortools."):
            raise ImportError(f"{fullname} is blocked: this process stands for a machine without OR-Tools")
        return None


sys.meta_path.insert(0, NoOrtools())
'''

pytestmark = pytest.mark.filterwarnings("ignore:autopar. no sharding rule")

KIND, WORLD = "gpt2", 2


def saved_plan_worker(rank: int, world: int, path: str) -> dict[str, object]:
    blocked = any(type(f).__name__ == "NoOrtools" for f in sys.meta_path)
    loaded_early = "ortools" in sys.modules
    try:
        import ortools  # noqa: F401

        importable = True
    except ImportError:
        importable = False
    H.quiet()
    plan = autopar.Plan.load(path)
    model, inputs = H.build(KIND)
    pm = autopar.parallelize(model, autopar.Cluster.local(world), inputs, plan=plan)
    losses = H.train(pm, inputs, H.make_optimizer("sgd", pm.parameters()), steps=2)
    return {
        "blocked": blocked,
        "importable": importable,
        "loaded_early": loaded_early,
        "loaded_at_end": "ortools" in sys.modules,
        "losses": losses,
        "state": pm.full_state_dict(),
        "layout": pm.plan.info.get("layout"),
    }


@pytest.mark.distributed
@pytest.mark.timeout(150)
def test_saved_plan_trains_in_processes_without_ortools(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, inputs = H.build(KIND)
    plan = autopar.layouts.megatron(model, inputs, autopar.Cluster.local(WORLD), tp=WORLD)
    path = tmp_path / "gpt2.plan.json"
    plan.save(path)
    site = tmp_path / "no_ortools"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)
    )

    results = spawn(saved_plan_worker, WORLD, str(path), timeout=120, fresh=True)  # reads PYTHONPATH

    ref_losses, ref_state = H.reference(KIND, "sgd", steps=2)
    for rank, res in enumerate(results):
        assert res["blocked"] and not res["importable"], f"rank {rank}: OR-Tools was not blocked"
        assert not res["loaded_early"] and not res["loaded_at_end"], f"rank {rank} imported ortools"
        assert res["layout"] == plan.info["layout"]
        problems = H.compare_training(
            (ref_losses, ref_state), (res["losses"], res["state"]), "sgd", f"rank {rank}"
        )
        assert not problems, "\n".join(problems)


def meta_plan_worker(rank: int, world: int, path: str, kind: str) -> dict[str, object]:
    H.quiet()
    plan = autopar.Plan.load(path)
    model, inputs = H.build(kind)
    pm = autopar.parallelize(model, autopar.Cluster.local(world), inputs, plan=plan)
    losses = H.train(pm, inputs, H.make_optimizer("sgd", pm.parameters()), steps=2)
    return {"losses": losses, "state": pm.full_state_dict()}


@pytest.mark.distributed
@pytest.mark.timeout(240)
@pytest.mark.parametrize(("kind", "options"), [("gpt", {}), ("llama", {"pp": 2, "microbatches": 2})])
def test_a_plan_made_on_the_meta_device_trains_the_real_model(
    tmp_path: Path, kind: str, options: dict[str, int]
) -> None:
    """The way a large model is planned: built on the meta device (no memory), planned, saved; then
    the real model on real processes runs that plan, and trains as one device does. Both models'
    attention writes ``contiguous`` copies that only the CPU kernels' strides elide, which made
    the two captures differ until capture's canonical graph."""
    import torch

    with torch.device("meta"):
        meta_model, meta_inputs = H.build(kind)
    plan = autopar.plan(meta_model, meta_inputs, autopar.Cluster.local(WORLD), **options)
    assert next(meta_model.parameters()).device.type == "meta"
    path = tmp_path / f"{kind}.plan.json"
    plan.save(path)

    results = spawn(meta_plan_worker, WORLD, str(path), kind, timeout=200)

    ref_losses, ref_state = H.reference(kind, "sgd", steps=2)
    for rank, res in enumerate(results):
        problems = H.compare_training(
            (ref_losses, ref_state), (res["losses"], res["state"]), "sgd", f"rank {rank}"
        )
        assert not problems, "\n".join(problems)

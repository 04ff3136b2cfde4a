"""A Plan is data: an exact JSON round trip, and loading it needs neither OR-Tools nor the model
(``autopar.runtime`` runs plans on machines where the solver is not installed)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

import autopar

pytestmark = pytest.mark.filterwarnings("ignore:autopar. no sharding rule")


def _plan_2d(make_gpt2, batch, cluster):
    """A plan with every kind of content: 2-D mesh, S(d), S(d)xk, P, reshards, rewrites."""
    return autopar.layouts.megatron(make_gpt2(), batch(8, 32, 256), cluster, tp=4)


def test_save_load_round_trip_is_exact(tmp_path, gpt2_plan):
    path = tmp_path / "plan.json"
    gpt2_plan.save(path)
    loaded = autopar.Plan.load(path)
    assert loaded == gpt2_plan
    assert loaded.to_dict() == gpt2_plan.to_dict()
    assert loaded.param_placements() == gpt2_plan.param_placements()
    assert loaded.predicted == gpt2_plan.predicted
    assert str(loaded) == str(gpt2_plan)


@pytest.mark.timeout(120)
def test_round_trip_of_a_2d_plan_with_partials_and_blocks(tmp_path, make_gpt2, batch, a100x8):
    plan = _plan_2d(make_gpt2, batch, a100x8)
    text = json.dumps(plan.to_dict())
    assert plan.mesh_shape == (2, 4) and '"P"' in text and "x3" in text and plan.reshards
    path = tmp_path / "plan.json"
    plan.save(path)
    loaded = autopar.Plan.load(path)
    assert loaded == plan and loaded.to_dict() == plan.to_dict()
    assert loaded.nodes == plan.nodes and loaded.reshards == plan.reshards
    # equality is by content: a changed placement is a different plan
    changed = autopar.Plan.load(path)
    name = next(iter(changed.params))
    changed.params[name] = ("S(0)", "S(0)")
    assert changed != plan


def test_unknown_format_is_refused(tmp_path, gpt2_plan):
    d = gpt2_plan.to_dict()
    d["format"] = 99
    with pytest.raises(ValueError, match="format 99"):
        autopar.Plan.from_dict(d)


_LOAD_WITHOUT_ORTOOLS = """
import importlib.abc, json, sys

class NoOrtools(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "ortools" or name.startswith("ortools."):
            raise ImportError(f"{name} is blocked for this test")
        return None

sys.meta_path.insert(0, NoOrtools())
import autopar
try:
    import ortools  # noqa: F401
except ImportError:
    pass
else:
    raise SystemExit("the blocker did not block ortools")
plan = autopar.Plan.load(sys.argv[1])
print(json.dumps({"mesh": list(plan.mesh_shape), "plan": plan.to_dict()}))
"""

_IMPORTS_NO_ORTOOLS = """
import sys
import autopar
import autopar.runtime
plan = autopar.Plan.load(sys.argv[1])
plan.param_placements()
str(plan)
loaded = sorted(m for m in sys.modules if m == "ortools" or m.startswith("ortools."))
print("ortools modules:", loaded)
sys.exit(1 if loaded else 0)
"""


def _python(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True, timeout=120
    )


@pytest.mark.timeout(180)
def test_plan_loads_where_ortools_cannot_be_imported(tmp_path, gpt2_plan):
    path = tmp_path / "plan.json"
    gpt2_plan.save(path)
    run = _python(_LOAD_WITHOUT_ORTOOLS, str(path))
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["mesh"] == [8]
    assert out["plan"] == json.loads(json.dumps(gpt2_plan.to_dict()))


@pytest.mark.timeout(180)
def test_importing_autopar_and_its_runtime_does_not_import_ortools(tmp_path, gpt2_plan):
    path = tmp_path / "plan.json"
    gpt2_plan.save(path)
    run = _python(_IMPORTS_NO_ORTOOLS, str(path))
    assert run.returncode == 0, run.stdout + run.stderr
    assert "ortools modules: []" in run.stdout


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (lambda d: d.update(mesh_shape="2"), "'mesh_shape'"),
        (lambda d: d.update(mesh_shape=[2.5]), "'mesh_shape'"),
        (lambda d: d.update(mesh_axes=["dp", "tp"]), "'mesh_axes'"),
        (lambda d: d["params"].update({next(iter(d["params"])): ["R", "R"]}), "params["),
        (lambda d: d["params"].update({next(iter(d["params"])): ["Q"]}), "params["),
        (lambda d: d["nodes"][3].update(outputs=[["S(x)"]]), ").outputs[0]"),
        (lambda d: d["predicted"].update(step_time=float("nan")), "'predicted.step_time'"),
        (lambda d: d.update(recompute="sometimes"), "'recompute'"),
        (lambda d: d.pop("fingerprint"), "no field 'fingerprint'"),
    ],
)
def test_every_field_is_validated_and_the_error_names_it(tmp_path, gpt2_plan, edit, field):
    d = json.loads(json.dumps(gpt2_plan.to_dict()))  # as read from a file: lists, not tuples
    edit(d)
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(d))
    with pytest.raises(ValueError) as e:
        autopar.Plan.load(path, verify=False)
    assert str(path) in str(e.value) and field in str(e.value), str(e.value)

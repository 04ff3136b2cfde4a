"""The package's imports run one way, from the API down to data (read with ``ast``, function-level
imports included, laid out as installed: ``passes/`` is ``autopar.passes`` and so on).

Layers, bottom to top — a module may import its own group or any lower layer, never a higher one,
and the two groups of layer 2 never import each other:

0. data — placements, the typed node records, graph helpers and the op table, the cluster, the
   captured program, reshard steps, the Plan record, the strategy graph, schedules, example models;
1. cost — every formula (``autopar.cost``), the mesh with its collective costs, the config;
2. rules (``autopar.rules``) | runtime (``autopar.runtime``: executes a plan; never imports the
   planner, the solver, the rules or the planning passes);
3. passes (``autopar.passes``: planning passes and rank-program passes);
4. the solver (a pure function of the strategy graph);
5. the planner, the layouts and the simulator;
6. the API (``autopar.api``, the package root, the command line, reports).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = {"autopar": ROOT / "autopar", "autopar.passes": ROOT / "passes",
                "autopar.cost": ROOT / "cost", "autopar.runtime": ROOT / "runtime"}  # fmt: skip

LEVEL = {"data": 0, "cost": 1, "rules": 2, "runtime": 2, "passes": 3, "solver": 4, "planner": 5, "api": 6}
DATA = {"placement", "graph", "ir", "cluster", "capture", "reshard", "planfile", "strategy_graph", "display",
        "schedule", "models"}  # fmt: skip
COST = {"mesh", "config"}
PLANNER = {"planner", "layouts", "simulate", "search"}


def group_of(module: str) -> str:
    parts = module.split(".")
    if module == "autopar":
        return "api"
    sub = parts[1]
    if sub in ("cost", "passes", "runtime", "rules"):
        return sub
    if sub in DATA:
        return "data"
    if sub in COST:
        return "cost"
    if sub == "solver":
        return "solver"
    if sub in PLANNER:
        return "planner"
    return "api"


def modules() -> dict[str, Path]:
    out = {}
    for pkg, d in PACKAGE_DIRS.items():
        for f in sorted(d.rglob("*.py")):
            rel = f.relative_to(d).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            if pkg == "autopar" and parts and parts[0] in ("passes", "cost", "runtime"):
                continue
            out[".".join([pkg, *parts])] = f
    return out


def imports(path: Path, module: str) -> list[tuple[str, int]]:
    tree = ast.parse(path.read_text())
    found = []
    is_pkg = path.name == "__init__.py"
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")[: len(module.split(".")) - node.level + (1 if is_pkg else 0)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.append((target, node.lineno))
            found += [(f"{target}.{a.name}", node.lineno) for a in node.names]
    return [(t, line) for t, line in found if t == "autopar" or t.startswith("autopar.")]


def resolve(target: str, known: dict[str, Path]) -> str | None:
    """The module an import names (``from autopar.x import y`` names ``autopar.x`` unless ``y`` is
    itself a module)."""
    while target and target not in known:
        target = target.rpartition(".")[0]
    return target or None


def test_imports_run_from_the_api_down_to_data():
    known = modules()
    assert "autopar.runtime.module" in known and "autopar.passes.lower" in known
    violations = []
    for mod, path in known.items():
        g = group_of(mod)
        for target, line in imports(path, mod):
            t = resolve(target, known)
            if t is None or t == mod:
                continue
            tg = group_of(t)
            if tg == g or LEVEL[tg] < LEVEL[g]:
                continue
            violations.append(f"{path.relative_to(ROOT)}:{line}: {mod} ({g}) imports {t} ({tg})")
    assert not violations, "imports against the layering:\n" + "\n".join(violations)


def test_the_layer_check_catches_an_upward_import(tmp_path):
    """The walker itself: a runtime module importing the planner is reported."""
    f = tmp_path / "bad.py"
    f.write_text("def f():\n    from autopar.planner import plan_captured\n")
    known = modules()
    (target, _), *_ = imports(f, "autopar.runtime.bad")
    t = resolve(target, known)
    assert t == "autopar.planner"
    assert LEVEL[group_of(t)] > LEVEL[group_of("autopar.runtime.bad")]


def test_every_module_has_a_layer():
    for mod in modules():
        assert group_of(mod) in LEVEL

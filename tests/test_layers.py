"""The package's imports run one way, from the API down to data, and never in a circle (read with
``ast``, function-level imports included, laid out as installed: ``passes/`` is ``autopar.passes``
and so on, as setup.py maps them).

Layers, bottom to top — a module may import its own group or any lower layer, never a higher one,
and two groups of one layer never import each other:

0. data — placements, the typed node records (``autopar.ir``), graph helpers and the op table, the
   cluster, its devices and node groups, the captured program, reshard steps, the Plan record, the strategy graph, schedules,
   example models, the reference data;
1. cost — every formula (``autopar.cost``), the mesh with its collective costs, the config |
   program (``autopar.program``: what a per-rank program calls — collectives on a mesh axis, the
   local forms of sharded ops, expert dispatch, the RNG replay, the fused kernels — and the
   records the rank-program passes build, ``StepProgram`` and ``StageStep``);
2. rules (``autopar.rules``) | runtime (``autopar.runtime``: runs what the passes built);
3. passes (``autopar.passes``: planning passes and rank-program passes);
4. the solver (a pure function of the strategy graph);
5. the planner, the layouts, the simulator and the plan audit;
6. the API (``autopar.api``, the package root, the command line, reports).

Two arrows the layers alone would allow are forbidden (``APART``): a pass never imports the
runtime (what a pass builds is a record of ``autopar.program``, which the runtime only runs), and
the runtime never imports the cost model (it measures; fitting measurements to the model's forms
is ``autopar.cost``'s). The runtime therefore imports data and the program layer only.

Circles: no module imports, directly or through others, a module that imports it
(``test_no_import_cycles``). Imports under ``if TYPE_CHECKING:`` never run and are left out of
that check (they still count for the layers).
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = {"autopar": ROOT / "autopar", "autopar.passes": ROOT / "passes",
                "autopar.cost": ROOT / "cost", "autopar.runtime": ROOT / "runtime",
                "autopar.reference_data": ROOT / "reference"}  # fmt: skip

LEVEL = {"data": 0, "cost": 1, "program": 1, "rules": 2, "runtime": 2, "passes": 3, "solver": 4, "planner": 5,
         "api": 6}  # fmt: skip
APART = {
    ("passes", "runtime"): "a pass builds records of autopar.program; the runtime runs them",
    ("runtime", "cost"): "the runtime measures; autopar.cost fits and predicts",
}
"""Group pairs whose arrow the levels allow but the design forbids, and why."""
DATA = {"placement", "graph", "ir", "cluster", "devices", "capture", "canonical", "causal_mask", "microbatch", "cut_export", "input_bounds", "reshard",
        "planfile", "strategy_graph", "display", "summary_lines", "text_units", "cluster_profile", "mesh_groups", "schedule", "models", "reference_data",
        "grad_compression", "node_groups", "plan_schema"}  # fmt: skip
COST = {"mesh", "config"}
PLANNER = {
    "planner",
    "second_look",
    "mesh_pool",
    "plan_record",
    "pipelined",
    "layouts",
    "simulate",
    "search",
    "plan_search",
    "refine",
    "dp_shares",
    "audit",
    "audit_figures",
}


def group_of(module: str) -> str:
    parts = module.split(".")
    if module == "autopar":
        return "api"
    sub = parts[1]
    if sub in ("cost", "passes", "runtime", "rules", "program"):
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


def may_import(group: str, target: str) -> bool:
    """Whether a module of ``group`` may import one of ``target`` (module docstring)."""
    if group == target:
        return True
    return (group, target) not in APART and LEVEL[target] < LEVEL[group]


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


@functools.cache
def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


def _type_checking_only(tree: ast.AST) -> set[int]:
    """ids of the import nodes under ``if TYPE_CHECKING:`` (they never run)."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = node.test
            name = (
                test.id
                if isinstance(test, ast.Name)
                else test.attr
                if isinstance(test, ast.Attribute)
                else ""
            )
            if name == "TYPE_CHECKING":
                skip |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return skip


def imports(path: Path, module: str, *, run_only: bool = False) -> list[tuple[str, int]]:
    """``(name, line)`` of every ``autopar`` import of the file, module-level and inside functions
    (``run_only``: not those under ``if TYPE_CHECKING:``). ``from a.b import c`` names ``a.b.c``,
    which ``resolve`` shortens to the module it is in (``a.b`` unless ``c`` is itself a module)."""
    tree = _parse(path)
    skip = _type_checking_only(tree) if run_only else set()
    found = []
    is_pkg = path.name == "__init__.py"
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")[: len(module.split(".")) - node.level + (1 if is_pkg else 0)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found += [(f"{target}.{a.name}", node.lineno) for a in node.names]
    return [(t, line) for t, line in found if t == "autopar" or t.startswith("autopar.")]


def resolve(target: str, known: Mapping[str, Path]) -> str | None:
    """The module an import names (``from autopar.x import y`` names ``autopar.x`` unless ``y`` is
    itself a module)."""
    while target and target not in known:
        target = target.rpartition(".")[0]
    return target or None


def import_graph(known: Mapping[str, Path], *, run_only: bool = False) -> dict[str, dict[str, int]]:
    """Module -> {module it imports: first line}."""
    edges: dict[str, dict[str, int]] = {}
    for mod, path in known.items():
        for target, line in imports(path, mod, run_only=run_only):
            t = resolve(target, known)
            if t is not None and t != mod:
                edges.setdefault(mod, {}).setdefault(t, line)
    return edges


def cycles(edges: Mapping[str, Mapping[str, int]]) -> list[list[str]]:
    """One circle through each strongly connected group of modules (Tarjan), as
    ``[a, b, …, a]``; none when the imports form a DAG."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(edges):
        if v not in index:
            visit(v)
    out = []
    for group in groups:
        start = min(group)
        path, seen = [start], {start}
        while True:  # follow arrows inside the group until one closes the circle
            nxt = sorted(w for w in edges[path[-1]] if w in group)
            back = [w for w in nxt if w in seen]
            if back:
                out.append([*path[path.index(back[0]) :], back[0]])
                break
            path.append(nxt[0])
            seen.add(nxt[0])
    return out


def violations(known: Mapping[str, Path]) -> list[str]:
    out = []
    for mod, path in known.items():
        g = group_of(mod)
        seen = set()
        for target, line in imports(path, mod):
            t = resolve(target, known)
            if t is None or t == mod or may_import(g, group_of(t)) or (t, line) in seen:
                continue
            seen.add((t, line))
            tg = group_of(t)
            why = APART.get((g, tg), "an upward import")
            where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
            out.append(f"{where}:{line}: {mod} ({g}) imports {t} ({tg}): {why}")
    return out


def test_imports_run_from_the_api_down_to_data():
    known = modules()
    assert "autopar.runtime.module" in known and "autopar.passes.lower" in known
    found = violations(known)
    assert not found, "imports against the layering:\n" + "\n".join(found)


def test_no_import_cycles():
    """No module reaches itself through the imports (module-level and function-level alike)."""
    found = cycles(import_graph(modules(), run_only=True))
    assert not found, "import circles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_the_layer_check_catches_an_upward_import(tmp_path):
    """The walker itself: a runtime module importing the planner is reported."""
    f = tmp_path / "bad.py"
    f.write_text("def f():\n    from autopar.planner import plan_captured\n")
    known = modules()
    (target, _), *_ = imports(f, "autopar.runtime.bad")
    t = resolve(target, known)
    assert t == "autopar.planner"
    assert not may_import(group_of("autopar.runtime.bad"), group_of(t))


@pytest.mark.parametrize(
    ("module", "source", "reason"),
    [
        (
            "autopar.passes.bad",
            "from autopar.runtime.module import ParallelModule\n",
            "the runtime runs them",
        ),
        ("autopar.runtime.bad", "def f():\n    import autopar.cost.compute\n", "autopar.cost fits"),
        ("autopar.runtime.bad", "from autopar.passes.lower import lower\n", "upward"),
        ("autopar.program.bad", "from autopar.runtime.monitor import StepMonitor\n", "upward"),
    ],
)
def test_the_layer_check_catches_a_forbidden_arrow(tmp_path, module, source, reason):
    """A pass importing the runtime, the runtime importing the cost model or the passes, the
    program layer importing the runtime: each is reported, with why."""
    f = tmp_path / "bad.py"
    f.write_text(source)
    known = {**modules(), module: f}
    found = [v for v in violations(known) if f" {module} " in v]
    assert len(found) == 1 and reason in found[0], found


def test_the_cycle_check_finds_a_circle(tmp_path):
    """``cycles`` on a made-up graph: a -> b -> c -> a and d <-> e are found, f -> a is not a circle."""
    edges = {"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"e": 1}, "e": {"d": 1}, "f": {"a": 1}}
    assert sorted(cycles(edges)) == [["a", "b", "c", "a"], ["d", "e", "d"]]
    assert cycles({"a": {"b": 1}, "b": {}}) == []
    # and through files: two modules importing each other inside functions
    (tmp_path / "x.py").write_text("def f():\n    from autopar.y import g\n")
    (tmp_path / "y.py").write_text("def g():\n    import autopar.x\n")
    (tmp_path / "z.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import autopar.x\n"
    )
    known = {f"autopar.{n}": tmp_path / f"{n}.py" for n in "xyz"}
    assert cycles(import_graph(known, run_only=True)) == [["autopar.x", "autopar.y", "autopar.x"]]
    assert "autopar.x" not in import_graph(known, run_only=True).get("autopar.z", {})


def test_every_module_has_a_layer():
    for mod in modules():
        assert group_of(mod) in LEVEL


def test_the_walker_reads_the_package_as_setup_py_installs_it():
    """``PACKAGE_DIRS`` is setup.py's ``PACKAGE_DIR``: every folder the wheel maps is checked."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    (mapping,) = [
        ast.literal_eval(n.value)
        for n in tree.body
        if isinstance(n, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "PACKAGE_DIR" for t in n.targets)
    ]
    assert {k: ROOT / v for k, v in mapping.items()} == PACKAGE_DIRS

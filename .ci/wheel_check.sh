#!/usr/bin/env bash
# What users install is what we test: build the wheel, install it (not editable) into a fresh virtual
# environment outside the checkout, and from a directory outside the checkout import every layer,
# read the reference data, plan a model and train one step on 2 local gloo processes with the
# installed `autopar` command. The editable test run (.ci/run) cannot see a package or a data file
# the wheel leaves out; this does.
#
#   bash .ci/wheel_check.sh            # after `pip install torch ortools` (the venv borrows them)
#
# The venv is made with --system-site-packages so torch and OR-Tools are not downloaded again; the
# check asserts that `autopar` itself is imported from the venv, not from an editable checkout.
set -euo pipefail

cd "$(dirname "$0")/.."
SRC=$PWD
WORK=$(mktemp -d "${TMPDIR:-/tmp}/autopar-wheel.XXXXXX")
trap 'rm -rf "$WORK"' EXIT

step() { printf '\n==> wheel: %s\n' "$*"; }
start=$SECONDS

# A copy of the files git knows (tracked, or new and not ignored): a stale build/ in the checkout
# would otherwise put modules that no longer exist into the wheel.
step "copy the sources to $WORK/src"
mkdir "$WORK/src"
git ls-files -z --cached --others --exclude-standard |
    tar --null --ignore-failed-read -T - -cf - | tar -xf - -C "$WORK/src"

step "pip wheel (no deps)"
python -m pip wheel "$WORK/src" --no-deps -w "$WORK/dist" -q
WHEEL=$(ls "$WORK"/dist/autopar-*.whl)
echo "$WHEEL"
python -m zipfile -l "$WHEEL" | awk 'NR > 1 {print $1}' | grep -E '(^autopar/(rules|program/kernels)/__init__\.py|\.csv)$'

step "fresh venv, wheel installed with the solver extra"
python -m venv --system-site-packages --without-pip "$WORK/venv"  # its pip: the system's
VPY="$WORK/venv/bin/python"
"$VPY" -m pip install -q "$WHEEL[solver]"

mkdir "$WORK/run"
cd "$WORK/run"
export PYTHONPATH=

step "import every module from the installed package (cwd $PWD)"
"$VPY" - "$WORK/venv" <<'EOF'
import importlib
import pkgutil
import sys
from pathlib import Path

import autopar
from autopar.reference import REFERENCE_DIR, read_matmul_rows, read_step_rows

# Every module of the installed package (autopar.__main__ would run the command line).
venv = Path(sys.argv[1]).resolve()
names = [m.name for m in pkgutil.walk_packages(autopar.__path__, "autopar.") if m.name != "autopar.__main__"]
for name in ["autopar", *names]:
    where = Path(importlib.import_module(name).__file__).resolve()
    assert venv in where.parents, f"{name} imported from {where}, not from the venv {venv}"
assert {"autopar.rules", "autopar.program.kernels", "autopar.passes.lower", "autopar.runtime.module"} <= set(names)
assert venv in REFERENCE_DIR.parents, REFERENCE_DIR
print(f"{len(names) + 1} modules imported from {Path(autopar.__file__).parent}")
print(f"reference data: {sorted(p.name for p in REFERENCE_DIR.glob('*.csv'))}")
print(f"{len(read_matmul_rows())} matmul rows, {len(read_step_rows())} training-step rows")
EOF

step "autopar plan gpt2 (2 layers, 2 devices)"
"$WORK/venv/bin/autopar" plan gpt2 --gpus-per-node 2 --batch 4 --seq 128 --layers 2 -q -o "$WORK/run/plan.json" |
    sed -n '1,3p;$p'
test -s "$WORK/run/plan.json"

step "autopar train gpt-tiny on 2 local processes, 1 step"
"$WORK/venv/bin/autopar" train gpt-tiny --local 2 --steps 1 -q --timeout 300 | sed -n '1,3p;$p'

step "wheel check passed in $((SECONDS - start)) s"

"""Pictures and the offline HTML report (``autopar.viz``, ``autopar.report``): the report is one
self-contained file — rendered here in a real headless browser (Debian's Chromium), which must
find every section and decode every embedded picture — and the pictures draw the same rows as
``print(plan)``."""

from __future__ import annotations

import html
import re
import shutil
import subprocess

import pytest
import torch

import autopar
from autopar import viz
from autopar.estimate import MemorySetup, estimate_memory
from autopar.models import GPT, GPTConfig
from autopar.report import compare, html_report

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
SECTIONS = ("model", "cluster", "plan", "pictures", "layers", "comparison", "measured", "planning")


def _browser() -> str | None:
    return next((b for b in map(shutil.which, BROWSERS) if b), None)


@pytest.fixture(scope="module")
def plans():
    """A tiny GPT on 4 A100s: autopar's plan and Megatron's tp=2 layout."""
    torch.manual_seed(0)
    model = GPT(GPTConfig.tiny(n_layer=3))
    idx = torch.randint(0, 128, (8, 32))
    cluster = autopar.Cluster.preset("A100-80GB", gpus_per_node=4)
    auto = autopar.plan(model, (idx, idx.clone()), cluster, mesh_shape=(2, 2))
    auto.info["workload"] = {"model": "gpt-tiny", "batch": 8, "seq": 32}
    megatron = autopar.layouts.megatron(model, (idx, idx.clone()), cluster, tp=2)
    return auto, megatron


@pytest.fixture(scope="module")
def report(plans, tmp_path_factory):
    auto, megatron = plans
    run = {"world": 4, "cluster": "4 local processes", "fingerprint": auto.fingerprint, "step_times": [0.2, 0.1, 0.1],
           "median_step_time": 0.1, "peak_memory_per_device": 3 * 2**20}  # fmt: skip
    path = tmp_path_factory.mktemp("report") / "report.html"
    return html_report(auto, path, baseline=megatron, baseline_name="megatron:tp=2", measured=run)


def test_the_report_is_one_self_contained_file(report):
    text = report.read_text()
    assert text.startswith("<!DOCTYPE html>")
    for section in SECTIONS:
        assert f'<section id="{section}">' in text, section
    # Nothing to fetch: no external URL anywhere, every image inline.
    assert not re.search(r"""(src|href)\s*=\s*["'](https?:|//)""", text)
    images = re.findall(r'<img [^>]*src="([^"]+)"', text)
    assert len(images) == 3 and all(src.startswith("data:image/png;base64,") for src in images)
    assert "gpt-tiny" in text and "Comparison with megatron:tp=2" in text and "step time (median)" in text


def test_the_report_renders_in_a_headless_browser(report, tmp_path):
    browser = _browser()
    if browser is None:
        pytest.skip(
            "no Chromium to render the HTML report in (Debian: apt-get install -y chromium; .ci/run installs it "
            "where it may)"
        )
    flags = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        f"--user-data-dir={tmp_path}",
    ]
    dom = subprocess.run(
        [browser, *flags, "--dump-dom", report.as_uri()], capture_output=True, text=True, timeout=120
    ).stdout
    body = re.search(r"<body([^>]*)>", dom)
    assert body, dom[:500]
    # The page's own check, run by the browser after load: every picture decoded.
    assert 'data-images="3"' in body.group(1) and 'data-images-ok="3"' in body.group(1), body.group(1)
    for section in SECTIONS:
        assert f'id="{section}"' in dom, section
    shot = tmp_path / "page.png"
    subprocess.run(
        [browser, *flags, f"--screenshot={shot}", "--window-size=1200,3000", report.as_uri()],
        capture_output=True, timeout=120,
    )  # fmt: skip
    assert shot.exists() and shot.stat().st_size > 20_000  # a page with pictures, not a blank one


def test_pictures_draw_every_summary_row(plans, tmp_path):
    import matplotlib.image as mpimg

    auto, megatron = plans
    paths = viz.plan_figures(auto, tmp_path)
    assert [p.name for p in paths] == ["time_per_layer.png", "memory_per_layer.png"]
    for p in paths:
        assert mpimg.imread(p).shape[0] > 200
    # one bar label per row of print(plan), in the same order
    svg = viz.time_per_layer(auto, tmp_path / "t.svg").read_text()
    rows = [r.name for r in autopar.display.layer_rows(auto)]
    assert all(html.escape(name, quote=False) in svg for name in rows)
    both = viz.compare_plans(auto, megatron, tmp_path / "cmp.png", names=("autopar", "megatron"))
    assert mpimg.imread(both).shape[1] > 800


def test_memory_estimate_picture(tmp_path):
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(GPTConfig.tiny(n_layer=2))
    idx = torch.empty(8, 32, dtype=torch.long, device="meta")
    cap = autopar.capture(model, (idx, idx.clone()))
    cluster = autopar.Cluster.preset("A100-80GB", gpus_per_node=4)
    est = {(z, r): estimate_memory(cap, cluster, MemorySetup(dp=4, zero_stage=z, recompute=r))
           for z in (0, 3) for r in ("none", "full")}  # fmt: skip
    path = viz.memory_estimate(est, tmp_path / "m.png", budget=2**20)
    assert path.read_bytes()[:4] == b"\x89PNG"


def test_compare_says_which_plan_is_faster(plans):
    auto, megatron = plans
    c = compare(auto, megatron, names=("autopar", "megatron"))
    text = str(c)
    assert c.same_program and "per layer (compute + comm)" in text and "blocks.* ×3" in text
    fast = "autopar" if auto.predicted.step_time < megatron.predicted.step_time else "megatron"
    assert c.verdict().startswith(f"{fast} is predicted") or "equally fast" in c.verdict()
    ratio = megatron.predicted.step_time / auto.predicted.step_time
    assert f"×{ratio:.2f}" in text

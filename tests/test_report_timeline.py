"""The simulated step drawn per pipeline rank (``autopar.step_trace``, ``autopar.step_draw``,
``autopar.layer_breakdown``) in the HTML report, in ``autopar simulate``'s text and in ``autopar
compare --report``: a tiny GPT on 8 A100s as Megatron-LM's interleaved pipeline (pp=4, v=2, 8
micro-batches, dp=2), its drawn idle gaps checked against the simulator's bubble, the page opened
offline in headless Chromium and its screenshot read where the timeline lies."""

from __future__ import annotations

import itertools
import re
import shutil
import subprocess

import pytest
import torch

import autopar
from autopar.layer_breakdown import layer_breakdown
from autopar.models import GPT, GPTConfig
from autopar.report import html_report
from autopar.step_trace import step_trace

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
PP, V, M = 4, 2, 8


@pytest.fixture(scope="module")
def plans():
    """Megatron-LM's interleaved pipeline (pp=4, v=2, dp=2) of an 8-layer tiny GPT on 8 A100s, and,
    to compare with, pp=2 × tp=2 under 1F1B."""
    with torch.device("meta"):
        model = GPT(GPTConfig.tiny(n_layer=8))
    idx = torch.empty(16, 32, dtype=torch.long, device="meta")
    cluster = autopar.Cluster.preset("A100-80GB", gpus_per_node=8)
    inputs = (idx, idx.clone())
    interleaved = autopar.layouts.megatron(model, inputs, cluster, tp=1, pp=PP, virtual=V, schedule="interleaved",
                                           microbatches=M)  # fmt: skip
    interleaved.info["workload"] = {"model": "gpt-tiny", "batch": 16, "seq": 32}
    other = autopar.layouts.megatron(
        model, inputs, cluster, tp=2, pp=2, microbatches=M, sequence_parallel=True
    )
    return interleaved, other


@pytest.fixture(scope="module")
def report(plans, tmp_path_factory):
    return html_report(plans[0], tmp_path_factory.mktemp("report") / "report.html")


def _timelines(text: str) -> list[str]:
    return re.findall(r'<svg class="timeline".*?</svg>', text, flags=re.S)


def _bars(svg: str) -> list[dict[str, str]]:
    """Every drawn bar's attributes."""
    return [
        dict(re.findall(r'([\w-]+)="([^"]*)"', m)) for m in re.findall(r"<rect (class=\"bar [^>]*)>", svg)
    ]


def test_the_trace_is_the_simulated_step(plans):
    plan = plans[0]
    trace = step_trace(plan)
    sim = autopar.simulate(plan)
    assert len(trace.tracks) == PP and trace.virtual == V and trace.microbatches == M
    assert trace.step_time == pytest.approx(plan.predicted.step_time, rel=1e-9)
    # The idle gaps are the simulator's bubble, as the plan records it.
    assert trace.idle_share() == pytest.approx(plan.info["simulated"]["bubble_fraction"], rel=1e-9)
    for t in trace.tracks:
        lane = t.compute
        assert lane[0].start == 0 and lane[-1].end == pytest.approx(trace.step_time)
        assert all(
            a.end == pytest.approx(b.start, abs=1e-15) for a, b in itertools.pairwise(lane)
        )  # no gap, no overlap
        passes = {(b.kind, b.stage, b.microbatch) for b in lane if b.kind in "FBW"}
        stages = range(t.rank, PP * V, PP)
        assert passes == {(k, s, i) for k in "FBW" for s in stages for i in range(M)}
        assert max(b for _, b in t.memory) == t.peak_memory == sim.timeline.peak_memory[t.rank]
    # Every stage boundary between ranks sends forward and back: 2 per micro-batch.
    sends = [b for t in trace.tracks for b in t.p2p if b.kind == "send"]
    assert len(sends) == 2 * M * (PP * V - 1)


def test_the_report_draws_the_step_per_rank(plans, report):
    text = report.read_text()
    assert '<section id="step">' in text
    (svg,) = _timelines(text)
    assert 'data-ranks="4"' in svg
    bars = _bars(svg)
    for r in range(PP):
        mine = [b for b in bars if b["data-rank"] == str(r)]
        for kind in "FBW":
            got = sorted(int(b["data-mb"]) for b in mine if b["class"] == f"bar {kind}")
            assert got == sorted(list(range(M)) * V), (r, kind)
        assert {b["data-chunk"] for b in mine if b["class"] == "bar F"} == {"0", "1"}
        assert any(b["class"] == "bar idle" for b in mine)
        assert any(b["class"] in ("bar send", "bar recv") for b in mine)
    # Micro-batch numbers written on the bars.
    labels = re.findall(r'<text class="mb"[^>]*>(\d+)</text>', svg)
    assert {int(x) for x in labels} == set(range(M))
    # The drawn idle share (pixel widths) is the simulator's bubble fraction.
    width = {
        k: sum(float(b["width"]) for b in bars if b["class"] == f"bar {k}") for k in ("idle", "F", "B", "W")
    }
    drawn = width["idle"] / sum(width.values())
    assert drawn == pytest.approx(plans[0].info["simulated"]["bubble_fraction"], abs=2e-3)
    # Memory over the step per rank, and one layer's time by part.
    assert len(re.findall(r'<path class="memory" data-rank', text)) == PP
    parts = set(re.findall(r'data-part="([^"]+)"', text))
    assert {"attention", "MLP", "norms"} <= parts


def test_the_layer_breakdown_adds_up_to_the_layer(plans):
    plan = plans[1]  # tp=2 with sequence parallelism: collectives inside the layer
    b = layer_breakdown(plan)
    assert b is not None and b.layer == "blocks.0" and b.count == 8 and b.per == "micro-batch"
    names = [p.name for p in b.parts]
    assert names[:3] == ["attention", "MLP", "norms"] and "collectives" in names
    layer = next(r for r in autopar.display.layer_rows(plan) if r.name.startswith("blocks.0"))
    # blocks.0's time is its row's mean (the folded copies differ only in what reaches the first)
    assert b.total == pytest.approx((layer.compute + layer.comm) / layer.count, rel=1e-4)


def _browser() -> str:
    browser = next((b for b in map(shutil.which, BROWSERS) if b), None)
    if browser is None:
        pytest.skip("no Chromium to render the HTML report in (Debian: apt-get install -y chromium)")
    return browser


def test_the_timeline_renders_offline_in_a_headless_browser(report, tmp_path):
    import matplotlib.image as mpimg

    browser = _browser()
    flags = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        f"--user-data-dir={tmp_path / 'profile'}",
        "--window-size=1200,2600",
        # Offline: every request that would leave the machine fails, so the page must need none.
        "--proxy-server=http://127.0.0.1:9",
        "--host-resolver-rules=MAP * ~NOTFOUND",
    ]
    dom = subprocess.run([browser, *flags, "--dump-dom", report.as_uri()], capture_output=True, text=True,
                         timeout=60).stdout  # fmt: skip
    body = re.search(r"<body([^>]*)>", dom)
    assert body, dom[:500]
    attrs = dict(re.findall(r'([\w-]+)="([^"]*)"', body.group(1)))
    assert attrs["data-images"] == attrs["data-images-ok"]  # every embedded picture decoded
    assert attrs["data-timelines"] == "1"
    drawn = len(_bars(_timelines(report.read_text())[0]))
    assert int(attrs["data-timeline-bars"]) == drawn
    x, y, w, h = map(int, attrs["data-timeline-box"].split(","))
    assert w > 800 and h > 4 * 40 and y + h < 2600, attrs["data-timeline-box"]
    shot = tmp_path / "page.png"
    subprocess.run(
        [browser, *flags, f"--screenshot={shot}", report.as_uri()], capture_output=True, timeout=60
    )
    image = mpimg.imread(shot)[y : y + h, x : x + w, :3]
    assert image.shape[0] == h and image.shape[1] == w

    def share(colour: str) -> float:
        rgb = torch.tensor([int(colour[i : i + 2], 16) / 255 for i in (1, 3, 5)])
        return float(((torch.from_numpy(image.copy()) - rgb).abs().max(dim=-1).values < 0.03).float().mean())

    # Where the timeline lies, the screenshot shows its forward, backward and idle bars.
    assert share("#4c72b0") > 0.02 and share("#c44e52") > 0.02 and share("#ececec") > 0.02
    assert float(image.std()) > 0.1  # not a blank region


def test_simulate_prints_the_timeline_as_text(plans, tmp_path, capsys):
    from autopar.cli import main

    path = tmp_path / "pp4.json"
    plans[0].save(path)
    assert main(["--quiet", "simulate", str(path), "--width", "120"]) == 0
    out = capsys.readouterr().out
    rows = re.findall(r"^rank (\d)    (.{120})$", out, flags=re.M)
    assert [int(r) for r, _ in rows] == list(range(PP))
    for _, row in rows:
        assert set("FBWfbw") <= set(row) and "." in row and "O" in row
    assert out.count("\n  mb  ") == PP and out.count("\n  p2p ") == PP
    assert "legend: F forward" in out and "lower case: a rank's later model chunks" in out
    # The idle columns before the last pass ends are the bubble, to a column's resolution.
    end = round(120 * step_trace(plans[0]).compute_end / plans[0].predicted.step_time)
    idle = sum(row[:end].count(".") for _, row in rows) / (PP * end)
    assert idle == pytest.approx(plans[0].info["simulated"]["bubble_fraction"], abs=0.03)
    assert "inside one blocks layer (blocks.0, ×8)" in out and "attention" in out


def test_compare_writes_both_steps_into_one_report(plans, tmp_path, capsys):
    from autopar.cli import main

    a, b = tmp_path / "interleaved.json", tmp_path / "tp2.json"
    plans[0].save(a)
    plans[1].save(b)
    out = tmp_path / "compare.html"
    assert main(["--quiet", "compare", str(a), str(b), "--report", str(out)]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    text = out.read_text()
    svgs = _timelines(text)
    assert len(svgs) == 3  # the plan's own step, then both side by side in the comparison
    assert re.findall(r'<div class="step-of" data-plan="([^"]+)"', text) == ["interleaved.json", "tp2.json"]
    assert "Comparison with tp2.json" in text
    assert [re.search(r'data-ranks="(\d+)"', s).group(1) for s in svgs[1:]] == ["4", "2"]
    # One time scale for both: the slower step spans the whole axis, the faster one less.
    ends = [max(float(x["x"]) + float(x["width"]) for x in _bars(s)) for s in svgs[1:]]
    steps = [p.predicted.step_time for p in plans]
    slow = steps.index(max(steps))
    assert ends[slow] == pytest.approx(1000 - 16, abs=0.5)
    assert ends[1 - slow] == pytest.approx(120 + 864 * min(steps) / max(steps), abs=0.5)

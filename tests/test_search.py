"""The 3D search's walk over pipeline sizes, on made-up step times (no model is planned).

``PipelineSearch.ascending`` stops after two slower sizes or one far slower; ``PipelineSearch.pipelines_first``
(``pp="auto"`` where the whole batch does not fit one stage) plans gradient accumulation after the
pipelines, and not at all where their step falls with depth.
"""

from __future__ import annotations

import math

import pytest

import autopar
from autopar.config import PlanConfig
from autopar.search import FAR_SLOWER, PipelineSearch, _Size

INF = math.inf
PRUNED = "pruned"


class _Made(PipelineSearch):
    """A search whose sizes have the given step times (``INF``: does not fit; ``PRUNED``: proven
    far slower than the best so far) and that records which it planned."""

    def __init__(self, steps: dict[int, float | str]) -> None:
        super().__init__(None, autopar.Cluster.preset("H100-SXM", nodes=8), PlanConfig(), 64)  # type: ignore[arg-type]
        self.steps = steps
        self.planned: list[int] = []
        self.best_step = INF

    def best(self) -> float:
        return self.best_step

    def size(self, pp: int, then: int | None = None) -> _Size:
        self.planned.append(pp)
        step = self.steps[pp]
        if step == PRUNED:
            return _Size(pruned=True)
        assert isinstance(step, float)
        self.best_step = min(self.best_step, step)
        return _Size(step)


def test_where_the_whole_batch_does_not_fit_pipelines_go_first_and_accumulation_last():
    """Steps falling from pp = 2 to pp = 4: the fastest lies deeper, accumulation is not planned;
    rising: it is, after the pipelines; the pipelines stop as ``ascending`` does."""
    search = _Made({1: 3.0, 2: 2.8, 4: 2.2, 8: 2.0})  # LLaMA-3-8B fp32's shape of the steps
    search.pipelines_first([1, 2, 4, 8])
    assert search.planned == [2, 4, 8] and search.best_step == 2.0
    assert any(r["pp"] == 1 and "falls from pp=2 to pp=4" in r["skipped"] for r in search.tried)
    search = _Made({1: 19.1, 2: 17.3, 4: 18.9, 8: 20.7, 16: 21.9})  # GPT-3 175B's
    search.pipelines_first([1, 2, 4, 8, 16])
    assert search.planned == [2, 4, 8, 1] and search.best_step == 17.3
    search = _Made({1: 1.0, 2: INF, 4: 2.0, 8: 3.0})  # the smallest pipeline does not fit
    search.pipelines_first([1, 2, 4, 8])
    assert search.planned == [2, 4, 8, 1] and search.best_step == 1.0


@pytest.mark.parametrize("steps", [[1.0, 1.1, 1.2, 0.5], [1.0, 2.0, 0.5, 0.4], [1.0, 0.9, 0.8, 0.7]])
def test_ascending_stops_after_two_slower_sizes_or_one_far_slower(steps):
    sizes = [2, 4, 8, 16]
    search = _Made(dict(zip(sizes, steps)))
    search.best_step = 1.0  # the one-stage plan
    search.ascending(sizes)
    best, slower, expected = 1.0, 0, []
    for pp, s in zip(sizes, steps):
        if slower >= 2:
            break
        expected.append(pp)
        slower = 2 if s > FAR_SLOWER * best else slower + 1 if s > best else 0
        best = min(best, s)
    assert search.planned == expected


def test_a_size_proven_far_slower_ends_the_ascent():
    search = _Made({2: 1.1, 4: PRUNED, 8: 0.5})
    search.best_step = 1.0
    search.ascending([2, 4, 8])
    assert search.planned == [2, 4]


@pytest.mark.parametrize(("recompute_at_2", "counts"), [("none", [2]), ("selective", [2, 4, 8])])
def test_a_slower_accumulation_count_ends_the_counts_unless_it_recomputed(
    monkeypatch, recompute_at_2, counts
):
    """``PipelineSearch.size(1)`` over 2, 4, 8 micro-batches (the candidates made up, nothing planned):
    2 is slower than the whole batch's 1.0 s. Keeping every activation, it ends the counts; having
    had to recompute (``recompute="auto"``), it does not: 4 and 8 may fit without, and here do,
    faster (Table 1's row 1)."""
    from types import SimpleNamespace

    import autopar.pipelined as pipelined_mod
    import autopar.search as search_mod
    from autopar.pipelined import Scored

    made = {2: (1.2, recompute_at_2), 4: (0.95, "none"), 8: (0.9, "none")}
    monkeypatch.setattr(search_mod, "plan_captured", lambda cap, *a, **k: cap)
    monkeypatch.setattr(search_mod, "seams", lambda gm: [])
    monkeypatch.setattr(
        pipelined_mod,
        "pipelined_candidates",
        lambda spmd, gm, cluster, config, pp, m, budget: [
            Scored(SimpleNamespace(recompute=made[m][1]), made[m][0], f"pp=1 m={m}")
        ],
    )
    cluster = autopar.Cluster.preset("H100-SXM", nodes=8)
    search = PipelineSearch(
        lambda m: SimpleNamespace(gm=None, info={}), cluster, PlanConfig(recompute="auto"), 64
    )  # type: ignore[arg-type]
    search.scored = [Scored(SimpleNamespace(recompute="selective"), 1.0, "pp=1")]
    search.size(1)
    assert [r["microbatches"] for r in search.tried if "step_time" in r] == counts
    assert any("were slower" in r.get("skipped", "") for r in search.tried) == (recompute_at_2 == "none")


def test_pipelined_candidates_are_screened_at_a_coarse_gap_and_refined_only_where_they_may_win(monkeypatch):
    """Once a plan exists to beat, each micro-batch count's stage plan is solved at ``SCREEN_GAP``
    first, and again at the configured ``relative_gap`` only where its step less that gap could
    beat the best: 1.2 s against 1.0 s stays screened (and says so), 1.03 s is refined (1.03 ×
    0.95 < 1.0) and its refined 0.99 s wins."""
    from types import SimpleNamespace

    import autopar.pipelined as pipelined_mod
    import autopar.search as search_mod
    from autopar.pipelined import Scored
    from autopar.search import SCREEN_GAP

    gaps: list[tuple[int, float]] = []

    def plan_captured(cap, cluster, config, **kw):
        gap = config.screen_gap if config.screen_gap is not None else config.relative_gap
        gaps.append((cap.m, gap))
        return SimpleNamespace(m=cap.m, gap=gap, info={})

    steps = {(2, SCREEN_GAP): 1.2, (4, SCREEN_GAP): 1.03, (4, 0.005): 0.99}
    monkeypatch.setattr(search_mod, "plan_captured", plan_captured)
    monkeypatch.setattr(search_mod, "seams", lambda gm: [])
    monkeypatch.setattr(
        pipelined_mod,
        "pipelined_candidates",
        lambda spmd, gm, cluster, config, pp, m, budget: [
            Scored(SimpleNamespace(recompute="selective"), steps[(spmd.m, spmd.gap)], f"pp=1 m={m}")
        ],
    )
    cluster = autopar.Cluster.preset("H100-SXM", nodes=8)
    config = PlanConfig(recompute="auto", microbatches=None)
    search = PipelineSearch(lambda m: SimpleNamespace(gm=None, m=m), cluster, config, 64)  # type: ignore[arg-type]
    search.scored = [Scored(SimpleNamespace(recompute="selective"), 1.0, "pp=1")]
    monkeypatch.setattr(search, "counts", lambda pp: [2, 4])
    search.size(1)
    assert gaps == [(2, SCREEN_GAP), (4, SCREEN_GAP), (4, 0.005)]
    rows = {r["microbatches"]: r for r in search.tried if "step_time" in r}
    assert rows[2]["screened_gap"] == SCREEN_GAP and rows[2]["step_time"] == 1.2
    assert "screened_gap" not in rows[4] and rows[4]["step_time"] == 0.99
    assert search.best() == 0.99
    # Where no plan exists yet there is nothing to screen against: the configured gap at once.
    gaps.clear()
    search = PipelineSearch(lambda m: SimpleNamespace(gm=None, m=m), cluster, config, 64)  # type: ignore[arg-type]
    monkeypatch.setattr(search, "counts", lambda pp: [4])
    search.size(1)
    assert gaps == [(4, 0.005)]


def test_a_screened_solve_already_within_the_gap_is_not_solved_again():
    """``_solved_to``: every mesh that fits solved within the configured gap or pruned by a cutoff
    kept at it: the screened plan is what a solve at that gap gives."""
    from types import SimpleNamespace

    from autopar.search import _solved_to

    def plan(*rows):
        return SimpleNamespace(info={"meshes_tried": list(rows)})

    fits = {"mesh": [8, 8], "feasible": True, "gap": 0.002}
    assert _solved_to(plan({"mesh": [64], "feasible": False}, fits), 0.005)
    assert not _solved_to(plan(fits | {"gap": 0.03}), 0.005)
    # A mesh pruned by a cutoff kept at the configured gap is one a solve at that gap prunes too.
    assert _solved_to(plan(fits, {"mesh": [16, 4], "feasible": False, "pruned": "cutoff"}), 0.005)
    assert not _solved_to(plan(), 0.005)

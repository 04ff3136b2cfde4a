"""The 3D search's walk over pipeline sizes, on made-up step times (no model is planned).

``_Search.bisect`` (``pp="auto"`` where the whole batch does not fit one stage) must find the
fastest size of any unimodal step, planning about ``2·log₂`` of the sizes; sizes that do not fit
push it toward the ones that do, and two neighbours that both do not fit make it plan the rest.
``_Search.ascending`` stops after two slower sizes or one far slower.
"""

from __future__ import annotations

import itertools
import math
import random

import pytest

import autopar
from autopar.config import PlanConfig
from autopar.search import FAR_SLOWER, _Search, _Size

INF = math.inf
PRUNED = "pruned"


class _Made(_Search):
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


def _unimodal(rng: random.Random, n: int) -> list[float]:
    """Strictly decreasing then strictly increasing, the turn anywhere."""
    turn = rng.randrange(n)
    out, v = [0.0] * n, 1.0
    out[turn] = v
    for i in range(turn - 1, -1, -1):
        v += rng.uniform(0.01, 1)
        out[i] = v
    v = 1.0
    for i in range(turn + 1, n):
        v += rng.uniform(0.01, 1)
        out[i] = v
    return out


@pytest.mark.parametrize("n", range(1, 9))
def test_bisection_finds_the_fastest_size_of_a_unimodal_step_in_few_plans(n):
    rng = random.Random(n)
    sizes = [2**i for i in range(n)]
    for _ in range(20):
        steps = _unimodal(rng, n)
        search = _Made(dict(zip(sizes, steps)))
        search.bisect(sizes)
        assert search.best_step == min(steps), (steps, search.planned)
        assert len(search.planned) == len(set(search.planned))
        assert len(search.planned) <= 2 * math.ceil(math.log2(n)) + 1 if n > 1 else search.planned == [1]
        skipped = {r["pp"] for r in search.tried if "skipped" in r}
        assert skipped == set(sizes) - set(search.planned)


def test_sizes_that_do_not_fit_push_the_bisection_to_those_that_do():
    search = _Made({1: INF, 2: INF, 4: 3.0, 8: 2.0, 16: 2.5})
    search.bisect([1, 2, 4, 8, 16])
    assert search.best_step == 2.0
    search = _Made({1: 2.0, 2: 1.5, 4: INF, 8: INF})  # deeper does not fit (too few seams, say)
    search.bisect([1, 2, 4, 8])
    assert search.best_step == 1.5


def test_two_neighbours_that_do_not_fit_make_the_bisection_plan_the_rest():
    """Whether deeper pipelines hold less depends on the model (weights or activations): with no
    slope to follow, every size left is planned."""
    search = _Made({1: 1.0, 2: INF, 4: INF, 8: INF})
    search.bisect([1, 2, 4, 8])
    assert search.best_step == 1.0 and sorted(search.planned) == [1, 2, 4, 8]


def test_a_size_proven_far_slower_counts_as_slower():
    search = _Made({1: 1.0, 2: 1.2, 4: PRUNED, 8: PRUNED})
    search.bisect([1, 2, 4, 8])
    assert search.best_step == 1.0 and 8 not in search.planned


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


def test_every_order_of_three_sizes_is_bisected_to_its_minimum():
    for steps in itertools.permutations([1.0, 2.0, 3.0]):
        if steps == (2.0, 3.0, 1.0) or steps == (1.0, 3.0, 2.0):  # not unimodal
            continue
        search = _Made(dict(zip([1, 2, 4], steps)))
        search.bisect([1, 2, 4])
        assert search.best_step == 1.0, steps

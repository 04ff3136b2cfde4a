"""Pipeline schedules as data (``autopar.schedule``) and the timeline that plays them
(``autopar.cost.timeline``): every schedule is complete and deadlock-free, keeps the activations
its paper says, and its played bubble matches the published closed forms."""

from __future__ import annotations

import pytest

from autopar.cost.timeline import StageCost, play
from autopar.schedule import SCHEDULES, format_schedule, make_schedule, max_in_flight, validate_schedule

GRID = [(pp, m) for pp in (1, 2, 3, 4, 8) for m in (1, 2, 4, 8, 16) if m >= pp]


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize(("pp", "m"), GRID)
def test_every_schedule_runs_each_action_once_without_deadlock(name, pp, m):
    vs = (1, 2, 3) if name == "interleaved" else (1,)
    for v in vs:
        if name == "interleaved" and m % pp:
            with pytest.raises(ValueError, match="multiple of pp"):
                make_schedule(name, pp, m, v)
            continue
        acts = make_schedule(name, pp, m, v)  # validates: complete, ordered, no deadlock
        assert sum(len(a) for a in acts) == 3 * pp * v * m


def test_a_deadlocking_order_is_refused():
    acts = make_schedule("1f1b", 2, 2)
    # Rank 1 waits for micro-batch 1's forward before running micro-batch 0's backward, which
    # rank 0 needs before it sends micro-batch 1's: a cycle.
    bad = [acts[0], [("F", 1, 1), ("F", 1, 0), ("B", 1, 0), ("W", 1, 0), ("B", 1, 1), ("W", 1, 1)]]
    bad[0] = [("F", 0, 0), ("B", 0, 0), ("W", 0, 0), ("F", 0, 1), ("B", 0, 1), ("W", 0, 1)]
    with pytest.raises(ValueError, match="deadlocks"):
        validate_schedule(bad, 2, 2)
    with pytest.raises(ValueError, match="missing"):
        validate_schedule([acts[0][:-1], acts[1]], 2, 2)


@pytest.mark.parametrize(("pp", "m"), [(4, 8), (2, 8), (8, 16)])
def test_activations_in_flight(pp, m):
    """GPipe keeps every micro-batch; 1F1B at most ``pp − r`` on rank ``r`` (Narayanan et al. 2021
    §2.2); ZB-H1 no more than 1F1B's first rank."""
    assert [max_in_flight(a) for a in make_schedule("gpipe", pp, m)] == [m] * pp
    assert [max_in_flight(a) for a in make_schedule("1f1b", pp, m)] == [pp - r for r in range(pp)]
    assert max(max_in_flight(a) for a in make_schedule("zb-h1", pp, m)) <= pp


def _equal(n: int, f: float, b: float, w: float) -> list[StageCost]:
    return [StageCost(forward=f, backward_input=b, backward_weight=w) for _ in range(n)]


@pytest.mark.parametrize(("pp", "m"), [(2, 4), (4, 8), (4, 16), (8, 8)])
def test_played_bubble_matches_the_closed_forms(pp, m):
    """Equal stages, backward fused (``W`` free): GPipe and 1F1B take ``(m + p − 1)(f + b)``, the
    bubble ``(p − 1)/m`` of the ideal (Huang et al. 2019; Narayanan et al. 2021 §2.2.1);
    interleaving ``v`` stages per rank divides the bubble by ``v`` (§2.2.2)."""
    f, b = 1.0, 2.0
    for name in ("gpipe", "1f1b"):
        tl = play(make_schedule(name, pp, m), _equal(pp, f, b, 0.0))
        assert tl.step_time == pytest.approx((m + pp - 1) * (f + b)), name
        assert (tl.step_time - m * (f + b)) / (m * (f + b)) == pytest.approx((pp - 1) / m)
    v = 2
    tl = play(make_schedule("interleaved", pp, m, v), _equal(pp * v, f / v, b / v, 0.0))
    assert tl.step_time == pytest.approx(m * (f + b) + (pp - 1) * (f + b) / v)


def test_zero_bubble_and_transfers():
    """Splitting ``W`` from ``B`` shortens the backward chain: ZB-H1 is no slower than 1F1B and
    idles less when ``W`` is large; a transfer between ranks delays every dependent action."""
    stages = _equal(4, 1.0, 1.0, 1.0)
    one = play(make_schedule("1f1b", 4, 8), stages)
    zb = play(make_schedule("zb-h1", 4, 8), stages)
    assert zb.step_time <= one.step_time + 1e-12
    slow = [StageCost(forward=1.0, backward_input=1.0, backward_weight=1.0, send=0.5) for _ in range(4)]
    assert play(make_schedule("1f1b", 4, 8), slow).step_time > one.step_time


def test_gradient_reduction_overlaps_backward_but_not_its_last_bucket():
    """One stage, one micro-batch: a reduction shorter than the backward costs only its last
    bucket after it; a longer one shows the excess. It starts with the backward (``B`` then
    ``W``: the gradients appear as the backward runs), not with ``W``."""
    short = [StageCost(forward=1.0, backward_input=1.0, backward_weight=1.0, grad_sync=0.8, sync_chunks=4)]
    tl = play(make_schedule("1f1b", 1, 1), short)
    assert tl.step_time == pytest.approx(3.0 + 0.2)
    long = [StageCost(forward=1.0, backward_input=1.0, backward_weight=1.0, grad_sync=5.0, sync_chunks=4)]
    assert play(make_schedule("1f1b", 1, 1), long).step_time == pytest.approx(1.0 + 5.0)


def test_a_reduction_without_overlap_takes_the_computes_time():
    """``overlap=False`` (CPU processes filling the cores, ``Cluster.overlap_comm``): the reduction
    runs after the weight gradient on the rank's own time; with two micro-batches it still runs
    once, after the last."""
    one = [StageCost(forward=1.0, backward_input=1.0, backward_weight=1.0, grad_sync=0.8, sync_chunks=4)]
    tl = play(make_schedule("1f1b", 1, 1), one, overlap=False)
    assert tl.step_time == pytest.approx(3.8) and tl.exposed_sync == [pytest.approx(0.8)]
    tl = play(make_schedule("1f1b", 1, 2), one, overlap=False)
    assert tl.step_time == pytest.approx(6.8)
    assert play(make_schedule("1f1b", 1, 2), one).step_time == pytest.approx(6.2)  # last bucket only


def test_zero3_forward_gathers_overlap_the_forward_on_the_reduction_stream():
    """A ZeRO-3 stage's forward gathers run beside its ``F`` (prefetched a layer ahead): a short
    gather costs the ``F`` nothing, a long one holds it until its last gather plus the last
    layer's share of the ``F``; they share one stream with the backward's traffic, and without
    overlap the ``F`` waits for them."""
    zs = dict(forward=1.0, backward_input=1.0, backward_weight=1.0, sync_chunks=4)
    short = [StageCost(**zs, forward_gather=0.5, microbatch_sync=1.0)]
    assert play(make_schedule("1f1b", 1, 1), short).step_time == pytest.approx(3.0 + 0.25)
    long = [StageCost(**zs, forward_gather=2.0)]
    tl = play(make_schedule("1f1b", 1, 1), long)
    assert tl.events[("F", 0, 0)][2] == pytest.approx(2.0 + 0.25) and tl.step_time == pytest.approx(4.25)
    # Two micro-batches: the second forward's gathers queue behind the first backward's traffic.
    both = [StageCost(**zs, forward_gather=1.0, microbatch_sync=3.0)]
    tl = play(make_schedule("1f1b", 1, 2), both)
    # F0 [0, 1.25] (gather until 1), B0 [1.25, 2.25], W0 [2.25, 3.25] with its traffic [1.25, 4.25],
    # F1's gather [4.25, 5.25]: F1 ends at 5.5, not 4.25.
    assert tl.events[("F", 0, 1)][2] == pytest.approx(5.5)
    assert play(make_schedule("1f1b", 1, 1), long, overlap=False).step_time == pytest.approx(5.0)


def test_peak_memory_follows_the_schedule():
    stages = [StageCost(forward=1, backward_input=1, backward_weight=1, activation=10.0, static=100.0)] * 4
    gp = play(make_schedule("gpipe", 4, 8), stages)
    ofob = play(make_schedule("1f1b", 4, 8), stages)
    assert gp.peak_memory == [100.0 + 80.0] * 4
    assert ofob.peak_memory == [100.0 + 10.0 * (4 - r) for r in range(4)]


def test_schedules_print_as_data():
    text = format_schedule(make_schedule("1f1b", 2, 2))
    assert text.splitlines()[0] == "rank 0: F0.0 F0.1 B0.0 W0.0 B0.1 W0.1"
    assert text.splitlines()[1] == "rank 1: F1.0 B1.0 W1.0 F1.1 B1.1 W1.1"
    with pytest.raises(ValueError, match="unknown pipeline schedule"):
        make_schedule("pipedream", 2, 2)
    with pytest.raises(ValueError, match="interleaved"):
        make_schedule("1f1b", 2, 2, v=2)

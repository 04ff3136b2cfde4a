"""Issue 22 item 1: the ZeRO-3 prefetch pass on gloo, under stress.

``prefetch_params`` is skipped on gloo because processes were seen to die of heap corruption
(``malloc(): unaligned tcache chunk detected``, about one run in four of two successive ZeRO-3
modules on 4 processes). This test forces the pass on and trains two ZeRO-3 modules in turn on 4
gloo processes (``examples/stress_zero3_prefetch.py``, one run of it): a crash on any rank fails it
(``spawn`` names the rank). The fault is torch's gloo backend with several collectives in flight
on one group (``examples/gloo_inflight_gathers.py`` reproduces it in plain torch; see the skip
reason), so while the pass stays off on gloo this test fails by design now and then: it runs
only when asked (``AUTOPAR_STRESS=1``), as the check before turning the pass on for gloo (a torch
with the fault fixed, or a workaround). One run costs 1–5 minutes on a 2-core machine; for a
crash rate run the example with ``--runs``.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.filterwarnings("ignore:autopar. no sharding rule")

_EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "stress_zero3_prefetch.py"


def _example():
    spec = importlib.util.spec_from_file_location("stress_zero3_prefetch", _EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.distributed
@pytest.mark.timeout(600)
@pytest.mark.skipif(
    os.environ.get("AUTOPAR_STRESS") != "1",
    reason="issue 22 item 1: torch's gloo backend corrupts the heap now and then with several gathers in "
    "flight on one group (examples/gloo_inflight_gathers.py, prefetch_params' docstring), so the pass is off "
    "on gloo and this run may abort; minutes per run: opt in with AUTOPAR_STRESS=1",
)
def test_two_zero3_modules_with_prefetch_forced_on_gloo_do_not_crash():
    ex = _example()
    res = ex.one_run(4, (3, 64, 16), 5, True)
    losses = res[0]
    assert len(losses) == 10
    # the two modules are the same model from the same plan: they train identically on every rank
    for r in res:
        assert r == pytest.approx(losses, rel=1e-5)
    assert losses[0::2] == pytest.approx(losses[1::2], rel=1e-5)

"""Issue 22 item 1: the ZeRO-3 prefetch pass on gloo, under stress.

With several all-gathers in flight on one group, torch's gloo backend corrupts the heap now and then
(``malloc(): unaligned tcache chunk detected``) through the functional all-gather's own path
(``examples/gloo_inflight_gathers.py`` reproduces it in plain torch); ``passes.gather_buffers``
issues every gather on gloo through the path that does not, and ``prefetch_params`` runs on gloo.
This test trains two ZeRO-3 modules in turn on 4 gloo processes with the prefetch on
(``examples/stress_zero3_prefetch.py``, one run of it): a crash on any rank fails it (``spawn``
names the rank). One run catches the fault, were it back, about one time in four, and costs a
minute or more on a 2-core machine, so it runs only when asked (``AUTOPAR_STRESS=1``); the suite
checks the workaround every time, deterministically, by the programs' structure
(``test_runtime_training``: a layer's gathers in flight together, none on the coalesced path).
For a crash rate run the example with ``--runs`` (``--coalesced`` shows the fault without the
workaround).
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
    reason="issue 22 item 1's stress run (two ZeRO-3 modules, prefetch on, 4 gloo processes): a minute or "
    "more per run: opt in with AUTOPAR_STRESS=1",
)
def test_two_zero3_modules_with_prefetch_on_gloo_do_not_crash():
    ex = _example()
    res = ex.one_run(4, (3, 64, 16), 5, True)
    losses = res[0]
    assert len(losses) == 10
    # the two modules are the same model from the same plan: they train identically on every rank
    for r in res:
        assert r == pytest.approx(losses, rel=1e-5)
    assert losses[0::2] == pytest.approx(losses[1::2], rel=1e-5)

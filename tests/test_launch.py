"""``autopar.runtime.launch.spawn``: ranks forked from the preloaded fork server behave as
spawned ones would — they see the parent's environment and standard streams as they are at the
call (not as they were when the server started), and ``fresh=True`` starts new interpreters."""

from __future__ import annotations

import os
import sys

import pytest

from autopar.runtime.launch import spawn


def _env_worker(rank: int, world: int, key: str) -> dict[str, object]:
    print(f"rank {rank} writes to the parent's stdout", flush=True)
    print(f"rank {rank} writes to the parent's stderr", file=sys.stderr, flush=True)
    return {"value": os.environ.get(key), "pid": os.getpid()}


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_ranks_see_the_environment_and_streams_of_the_call(capfd, monkeypatch) -> None:
    spawn(_env_worker, 1, "AUTOPAR_TEST_UNSET", timeout=60)  # the server exists before the setting
    capfd.readouterr()
    monkeypatch.setenv("AUTOPAR_TEST_LAUNCH", "set after the fork server started")
    results = spawn(_env_worker, 2, "AUTOPAR_TEST_LAUNCH", timeout=60)
    out, err = capfd.readouterr()
    assert [r["value"] for r in results] == ["set after the fork server started"] * 2
    assert len({r["pid"] for r in results} | {os.getpid()}) == 3
    for rank in (0, 1):
        assert f"rank {rank} writes to the parent's stdout" in out, out
        assert f"rank {rank} writes to the parent's stderr" in err, err
    monkeypatch.delenv("AUTOPAR_TEST_LAUNCH")
    assert [r["value"] for r in spawn(_env_worker, 2, "AUTOPAR_TEST_LAUNCH", timeout=60)] == [None, None]


def _sitecustomize_worker(rank: int, world: int) -> bool:
    return bool(getattr(sys, "autopar_test_sitecustomize", False))


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_fresh_ranks_start_new_interpreters(tmp_path, monkeypatch, capfd) -> None:
    assert spawn(_sitecustomize_worker, 1, timeout=60) == [False]  # the server exists before the setting
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import sys\nsys.autopar_test_sitecustomize = True\n")
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)
    )
    assert spawn(_sitecustomize_worker, 2, timeout=100, fresh=True) == [True, True]
    assert spawn(_sitecustomize_worker, 2, timeout=60) == [False, False]  # forked: no interpreter start
    capfd.readouterr()
    monkeypatch.setenv("AUTOPAR_TEST_LAUNCH", "fresh")
    assert [r["value"] for r in spawn(_env_worker, 2, "AUTOPAR_TEST_LAUNCH", timeout=100, fresh=True)] == [
        "fresh"
    ] * 2
    out, err = capfd.readouterr()
    assert "rank 1 writes to the parent's stdout" in out and "rank 1 writes to the parent's stderr" in err, (
        out,
        err,
    )

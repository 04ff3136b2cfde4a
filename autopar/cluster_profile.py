"""Calibration profiles and this machine's host: what ``Cluster.with_profile``, ``Cluster.from_profile``
and ``Cluster.local`` read. A **profile** is the JSON ``autopar.runtime.calibrate`` writes — the
device's and links' measured figures under ``device`` and the links' names, with its ``version`` —
checked here before a cluster takes its figures (``autopar.cluster`` re-exports these names)."""

from __future__ import annotations

import json
import os
from dataclasses import fields
from typing import Any

from autopar.devices import DeviceSpec, HostSpec, Link

__all__ = ["PROFILE_VERSION", "load_profile", "local_host"]


PROFILE_VERSION = 1
"""Version of the profile JSON ``autopar.runtime.calibrate`` writes and ``load_profile`` reads."""


def local_host(device: DeviceSpec, processes: int) -> HostSpec:
    """The host of ``processes`` CPU processes on this machine (``Cluster.local``): its own memory.
    Each process's share of the host's bandwidth is its device's, its optimizer step on the host
    runs as fast as on its device, and "offloading" is a copy within the same memory (read and
    write: half the bandwidth memory-bound kernels reach)."""
    eff = device.optimizer_efficiency or device.memory_efficiency
    return HostSpec(
        name="this machine",
        memory=device.memory * processes,
        memory_bandwidth=device.memory_bandwidth * processes,
        link=Link(name="memcpy", bandwidth=device.achieved_bandwidth / 2, latency=1e-6),
        optimizer_efficiency=eff,
    )


def load_profile(profile: str | os.PathLike[str] | dict[str, Any]) -> dict[str, Any]:
    """A calibration profile (``autopar.runtime.calibrate``), from a JSON file or as given,
    checked: its version, and that its device figures are ``DeviceSpec`` fields."""
    if isinstance(profile, dict):
        prof = profile
    else:
        with open(profile) as f:
            prof = json.load(f)
    if prof.get("version") != PROFILE_VERSION:
        raise ValueError(
            f"calibration profile version {prof.get('version')!r} is not {PROFILE_VERSION}: measure again "
            "with autopar.runtime.calibrate"
        )
    known = {f.name for f in fields(DeviceSpec)}
    unknown = sorted(set(prof.get("device", {})) - known)
    if unknown:
        raise ValueError(f"calibration profile: unknown device field(s) {unknown}; known: {sorted(known)}")
    return prof

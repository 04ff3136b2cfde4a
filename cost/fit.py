"""Fitting measurements to the cost model's forms, so the cost layer owns every formula (the
measurements themselves come from ``autopar.runtime.calibrate`` or reference files).

* ``fit_alpha_beta`` — ``t = α + β·S`` (the collectives of ``autopar.cost.comm``), least squares
  on *relative* error (each point weighted by ``1/t²``: sizes span orders of magnitude and an
  unweighted fit is decided by the largest alone), both coefficients non-negative.
* ``fit_matmul_curve`` — the GEMM efficiency curve of ``autopar.cost.compute``:
  ``e(K) = e_max · K / (K + K½)`` is linear in ``1/K`` after inversion,
  ``1/e = 1/e_max + (K½/e_max) · 1/K``, fitted by least squares on measured ``(m, n, k, seconds)``.
* ``fit_bandwidth`` — bytes/s of a memory-bound kernel from ``(bytes, seconds)`` points:
  ``t = t₀ + bytes/B`` by ``fit_alpha_beta``, ``t₀`` being the fixed per-kernel time.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["fit_alpha_beta", "fit_bandwidth", "fit_matmul_curve"]


def _weighted_line(xs: Sequence[float], ys: Sequence[float], ws: Sequence[float]) -> tuple[float, float]:
    """Weighted least squares ``y = a + b·x``; ``(a, b)``."""
    sw = sum(ws)
    mx = sum(w * x for w, x in zip(ws, xs)) / sw
    my = sum(w * y for w, y in zip(ws, ys)) / sw
    var = sum(w * (x - mx) ** 2 for w, x in zip(ws, xs))
    b = sum(w * (x - mx) * (y - my) for w, x, y in zip(ws, xs, ys)) / var if var > 0 else 0.0
    return my - b * mx, b


def fit_alpha_beta(sizes: Sequence[float], times: Sequence[float]) -> tuple[float, float]:
    """``(α, β)`` of ``t = α + β·S`` minimising relative error, with ``α, β ≥ 0``.

    Raises ``ValueError`` when the points do not determine a positive slope (times that do not grow
    with size: measure larger sizes), instead of returning a bandwidth of "infinity".
    """
    if len(sizes) != len(times) or len(sizes) < 2:
        raise ValueError(f"fit_alpha_beta needs at least two (size, time) points, got {len(sizes)}")
    if any(t <= 0 for t in times):
        raise ValueError(f"fit_alpha_beta: times must be positive, got {list(times)}")
    ws = [1.0 / (t * t) for t in times]
    alpha, beta = _weighted_line(sizes, times, ws)
    if alpha < 0:  # the line through the origin: β = Σ w·S·t / Σ w·S²
        alpha = 0.0
        beta = sum(w * s * t for w, s, t in zip(ws, sizes, times)) / sum(w * s * s for w, s in zip(ws, sizes))
    if beta <= 0:
        raise ValueError(
            f"fit_alpha_beta: times {[f'{t:.3g}' for t in times]} do not grow with sizes {list(sizes)}; "
            "the bandwidth is not measurable from these points (measure larger buffers)"
        )
    return alpha, beta


def fit_bandwidth(nbytes: Sequence[float], times: Sequence[float]) -> tuple[float, float]:
    """``(t₀, bytes/s)`` of memory-bound kernels: ``t = t₀ + bytes / B``."""
    t0, beta = fit_alpha_beta(nbytes, times)
    return t0, 1.0 / beta


def fit_matmul_curve(points: Sequence[tuple[int, int, int, float]], peak: float) -> tuple[float, float]:
    """``(e_max, K½)`` of the GEMM curve from measured ``(m, n, k, seconds)`` on a device of
    ``peak`` FLOP/s (module docstring). With one distinct ``K`` (or efficiencies that do not grow
    with it) the curve is flat: ``K½ = 0`` and ``e_max`` their mean."""
    if not points:
        raise ValueError("fit_matmul_curve needs at least one measured matmul")
    inv_e = [t * peak / (2.0 * m * n * k) for m, n, k, t in points]
    inv_k = [1.0 / k for _, _, k, _ in points]
    if len({k for _, _, k, _ in points}) < 2:
        return 1.0 / (sum(inv_e) / len(inv_e)), 0.0
    a, b = _weighted_line(inv_k, inv_e, [1.0] * len(points))
    if b <= 0 or a <= 0:
        return 1.0 / (sum(inv_e) / len(inv_e)), 0.0
    e_max = 1.0 / a
    if not math.isfinite(e_max) or e_max > 1.0:
        e_max = 1.0
    return e_max, b * e_max

"""Fitting measured costs to the α-β model: ``t = α + β·S`` (the form of ``autopar.cost.comm``).

Measurements come from ``autopar.runtime.calibrate``; the fit lives here so that the cost layer
owns every formula and never imports the runtime.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["fit_alpha_beta"]


def fit_alpha_beta(sizes: Sequence[float], times: Sequence[float]) -> tuple[float, float]:
    """Least-squares ``t = α + β·S`` with both coefficients clamped at zero."""
    n = len(sizes)
    mx, my = sum(sizes) / n, sum(times) / n
    var = sum((x - mx) ** 2 for x in sizes)
    beta = sum((x - mx) * (y - my) for x, y in zip(sizes, times)) / var if var > 0 else 0.0
    beta = max(beta, 1e-15)
    alpha = max(my - beta * mx, 0.0)
    return alpha, beta

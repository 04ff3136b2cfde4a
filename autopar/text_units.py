"""Numbers as the printed plans write them: seconds, bytes in binary units, counts. One place, so
the summary, the tables, the report and the command line agree (``autopar.display`` re-exports
them)."""

from __future__ import annotations

__all__ = ["fmt_bytes", "fmt_count", "fmt_time"]


def fmt_time(t: float) -> str:
    """Seconds as ``1.23 s``, ``4.56 ms`` or ``7.8 µs``."""
    if t >= 1:
        return f"{t:.2f} s"
    if t >= 1e-3:
        return f"{t * 1e3:.2f} ms"
    return f"{t * 1e6:.1f} µs"


def fmt_bytes(b: float) -> str:
    """Bytes in binary units (``1.50 GiB``)."""
    for unit, f in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(b) >= f:
            return f"{b / f:.2f} {unit}"
    return f"{b:.0f} B"


def fmt_count(n: float) -> str:
    """A count as ``121K``, ``124M``, ``8.03B``."""
    for unit, f in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= f:
            return f"{n / f:.3g}{unit}"
    return f"{n:.0f}"

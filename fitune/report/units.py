"""Units for the HTML reports: one unit per chart or table, picked from the largest number it shows.

fitune computes in integer bytes; these helpers only format them (1024-based, labelled KiB / MiB / GiB).
"""

from __future__ import annotations

import math

BYTE_UNITS = (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024), ("B", 1))


def byte_unit(scale_bytes: float) -> tuple[str, int]:
    """The unit for numbers up to `scale_bytes`: GiB from 1 GiB, MiB from 1 MiB, KiB from 1 KiB, else bytes.

    Returns (name, bytes per unit), e.g. ("GiB", 1073741824).
    """
    ref = abs(scale_bytes) if scale_bytes is not None and math.isfinite(scale_bytes) else 0
    for name, size in BYTE_UNITS:
        if ref >= size:
            return name, size
    return "B", 1


def format_bytes(n_bytes: float | None, scale_bytes: float | None = None) -> str:
    """'21.95 GiB', '3.69 MiB', '512 B': in the unit of `scale_bytes` (default: of `n_bytes` itself).

    Bytes are shown whole; other units with two decimals. None (not measured) gives "n/a".
    """
    if n_bytes is None or not math.isfinite(n_bytes):
        return "n/a"
    name, size = byte_unit(n_bytes if scale_bytes is None else scale_bytes)
    if size == 1:
        return f"{n_bytes:,.0f} B"
    return f"{n_bytes / size:,.2f} {name}"


def format_value(x: float | None, digits: int = 4) -> str:
    """A plain number: thousands separated when large, `digits` significant digits when small; None gives "n/a"."""
    if x is None or not math.isfinite(x):
        return "n/a"
    if x == 0:
        return "0"
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    return f"{x:.{digits}g}"


def nice_ticks(max_value: float, count: int = 5) -> list[float]:
    """Round axis ticks from 0 to at least `max_value` (1, 2 or 5 times a power of ten apart)."""
    if not max_value or max_value <= 0 or not math.isfinite(max_value):
        return [0.0, 1.0]
    raw = max_value / count
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 2.5, 5, 10) if m * power >= raw)
    n = math.ceil(max_value / step - 1e-9)
    return [i * step for i in range(n + 1)]

"""Byte units. fitune computes in integer bytes and converts only for display, always as GiB (1024**3)."""

from __future__ import annotations

import re

GiB = 1024**3
MiB = 1024**2

_MEMORY_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(GiB|MiB|GB|MB|G|M)\s*$", re.IGNORECASE)


def parse_memory_bytes(text: str) -> int | None:
    """Parse "24GiB", "23.4GiB", "24576MiB" (1024-based) into bytes; None when `text` is not a memory amount.

    "GB"/"MB" are rejected on purpose by returning None from `_MEMORY_RE`'s strict units below: fitune's
    budgets are 1024-based and a silent 7 % difference is worse than an error.
    """
    m = _MEMORY_RE.match(text)
    if not m:
        return None
    value, unit = float(m.group(1)), m.group(2).lower()
    if value > 1 << 60:  # 400 digits of GiB: not a memory amount (and float('1e400') is inf, which no int holds)
        return None
    if unit in ("gib", "g"):
        return int(round(value * GiB))
    if unit in ("mib", "m"):
        return int(round(value * MiB))
    return None  # GB / MB: ambiguous, the caller explains


def is_decimal_unit(text: str) -> bool:
    m = _MEMORY_RE.match(text)
    return bool(m) and m.group(2).lower() in ("gb", "mb")


def gib(n_bytes: int | float) -> str:
    """Format bytes as GiB with two decimals, e.g. '21.99 GiB'."""
    return f"{n_bytes / GiB:.2f} GiB"


def human_bytes(n_bytes: int | float, scale: int | float | None = None) -> str:
    """GiB for GPU-sized numbers; MiB when `scale` (the largest number shown alongside) is under 1 GiB."""
    ref = abs(scale if scale is not None else n_bytes)
    if ref >= GiB:
        return f"{n_bytes / GiB:.2f} GiB"
    return f"{n_bytes / MiB:.2f} MiB"


def count_text(n: int | float) -> str:
    """A parameter count as people write it: 8.03B, 3.41M, 41.2K, 512 (a tiny model is never "0.00B")."""
    for scale, suffix, digits in ((1e9, "B", 2), (1e6, "M", 2), (1e3, "K", 1)):
        if abs(n) >= scale:
            return f"{n / scale:.{digits}f}{suffix}"
    return f"{int(n)}"

"""Figures over token lengths: histogram, percentiles, and what padding costs under each way of batching. Pure."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Sequence

PADDING_STRATEGIES = ("max_length", "dynamic", "packing")
"""The ways of batching `padding_costs` compares, in its order."""


@dataclass(frozen=True)
class HistogramBin:
    """Records whose token count n lies in low_tokens <= n <= high_tokens."""

    low_tokens: int
    high_tokens: int
    count: int


@dataclass(frozen=True)
class PaddingCost:
    """What one way of batching costs over the epoch: token positions computed vs real tokens."""

    strategy: str
    """max_length | dynamic | packing."""
    slot_tokens: int
    """Token positions the model computes (real + padding)."""
    real_tokens: int

    @property
    def padding_tokens(self) -> int:
        return self.slot_tokens - self.real_tokens

    @property
    def padding_share(self) -> float:
        return self.padding_tokens / self.slot_tokens if self.slot_tokens else 0.0


def padding_costs(lengths: Sequence[int], seq_len: int, batch_size: int) -> list[PaddingCost]:
    """Token positions computed for one epoch in the given order, each length cut at seq_len: padding every
    sequence to seq_len (max_length), padding each batch of batch_size to its longest (dynamic, what fitune's
    BatchStream does), and packing back to back into rows of seq_len (only the last row padded; a lower bound of
    the best-fit packing `pack` does, which never splits an example)."""
    clipped = [min(n, seq_len) for n in lengths]
    real = sum(clipped)
    to_max = len(clipped) * seq_len
    dynamic = sum(len(b) * max(b) for b in (clipped[i:i + batch_size] for i in range(0, len(clipped), batch_size)))
    packed = math.ceil(real / seq_len) * seq_len
    return [PaddingCost("max_length", to_max, real), PaddingCost("dynamic", dynamic, real),
            PaddingCost("packing", packed, real)]


def histogram(lengths: Sequence[int]) -> list[HistogramBin]:
    """Power-of-two bins: 1-32, 33-64, 65-128, ... up to the longest (and a 0-0 bin first if any length is 0)."""
    if not lengths:
        return []
    bins, low, high = [], 1, 32
    longest = max(lengths)
    while True:
        bins.append(HistogramBin(low, high, sum(low <= n <= high for n in lengths)))
        if high >= longest:
            break
        low, high = high + 1, high * 2
    zero = sum(n == 0 for n in lengths)
    if zero:
        bins.insert(0, HistogramBin(0, 0, zero))
    return bins


def percentile(sorted_xs: Sequence[int], q: float) -> int:
    """The nearest-rank q-quantile of an ascending list (q in [0, 1]): a value of the list, never interpolated."""
    return sorted_xs[min(len(sorted_xs) - 1, max(0, math.ceil(q * len(sorted_xs)) - 1))]


def length_stats(lengths: Sequence[int]) -> dict[str, float]:
    """min, median, mean, p90, p99, max of `lengths`; {} when there are none."""
    xs = sorted(lengths)
    if not xs:
        return {}
    return {"min": xs[0], "median": statistics.median(xs), "mean": statistics.fmean(xs),
            "p90": percentile(xs, 0.90), "p99": percentile(xs, 0.99), "max": xs[-1]}

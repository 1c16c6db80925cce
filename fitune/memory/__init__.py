"""The analytic memory estimator: pure Python, no torch import."""

from .estimate import MemoryEstimate, PhaseEstimate, estimate

__all__ = ["MemoryEstimate", "PhaseEstimate", "estimate"]

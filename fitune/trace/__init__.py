"""The trace engine (`--engine trace`): the real HF recipe on fake tensors, memory measured by category.

Importing this package does not import torch.
"""

from fitune.trace.engine import TraceResult, trace_training_step
from fitune.trace.support import TraceModelError, TraceUnsupportedError

__all__ = ["TraceModelError", "TraceResult", "TraceUnsupportedError", "trace_training_step"]

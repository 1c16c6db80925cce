"""The trace engine (`--engine trace`): the real HF recipe on fake tensors, memory measured by category.

Importing this package does not import torch.
"""

from fitune.trace.engine import TraceResult, TraceUnsupportedError, trace_training_step

__all__ = ["TraceResult", "TraceUnsupportedError", "trace_training_step"]

"""fitune: make LLM fine-tuning fit, and run fast, on the GPU you have.

Nothing runs at import: the estimator is pure Python; torch-based parts import torch lazily.
"""

__version__ = "0.1.0"


def oom_report(*args, **kwargs):
    """`with fitune.oom_report(model=..., setup=..., gpu="rtx4090"):` - an OOM becomes a post-mortem (see
    fitune.runtime.oom.oom_report). Imports torch only when used."""
    from .runtime.oom import oom_report as _oom_report

    return _oom_report(*args, **kwargs)

"""fitune: make LLM fine-tuning fit, and run fast, on the GPU you have.

Nothing runs at import: the estimator is pure Python; torch-based parts import torch lazily.
"""

__version__ = "0.1.0"

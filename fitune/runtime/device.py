"""The device and its allocator: dtype names, where to run, PyTorch's allocator settings and budget.

torch is imported inside the functions: `configure_allocator` must run before CUDA starts, and importing this
module costs nothing.
"""

from __future__ import annotations

import gc
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..setup import TrainSetup

#: fitune's dtype names -> torch's (the one map: `torch_dtype("bf16")` is torch.bfloat16).
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def torch_dtype(name: str):
    """The torch dtype of a fitune dtype name (bf16, fp16, fp32)."""
    import torch

    return getattr(torch, DTYPES[name])


def pick_device() -> str:
    """"cuda" when a CUDA GPU is visible, else "cpu"."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def configure_allocator(s: TrainSetup) -> dict[str, str]:
    """Set PYTORCH_CUDA_ALLOC_CONF for `s` before CUDA starts; returns what was added. A key the user already set
    wins.

    - expandable_segments:True when `s.expandable_segments` (freed blocks are not stranded between live ones).

    Offloaded checkpoints need no setting: their host buffers are exact-size (fitune/runtime/techniques/offload.py
    `PinnedPool`), not PyTorch's power-of-two pinned blocks.
    """
    added: dict[str, str] = {}
    current = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    if s.expandable_segments and "expandable_segments" not in current:
        added["expandable_segments"] = "True"
    if added:
        items = [current] if current else []
        items += [f"{k}:{v}" for k, v in added.items()]
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ",".join(items)
    return added


def limit_allocator(budget_bytes: int | None) -> None:
    """Cap PyTorch's CUDA allocator at `budget_bytes` (a smaller card's budget on a bigger GPU); None lifts the
    cap. Past it, allocations fail with OutOfMemoryError as they would on that card."""
    import torch

    total_bytes = torch.cuda.get_device_properties(0).total_memory
    fraction = 1.0 if budget_bytes is None else min(1.0, budget_bytes / total_bytes)
    torch.cuda.set_per_process_memory_fraction(fraction)


def release_memory(device: str) -> None:
    """Collect Python garbage and give the allocator's cached blocks back (after an OOM, between runs)."""
    gc.collect()
    if device == "cuda":
        import torch

        torch.cuda.empty_cache()


"""The device and its allocator: dtype names, where to run, PyTorch's allocator settings and budget.

torch is imported inside the functions: `configure_allocator` must run before CUDA starts, and importing this
module costs nothing.
"""

from __future__ import annotations

import gc
import os
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..setup import TrainSetup

#: fitune's dtype names -> torch's (the one map: `torch_dtype("bf16")` is torch.bfloat16).
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}

#: Offloaded checkpoints larger than this get exact-size pinned host blocks (see configure_allocator).
EXACT_PINNED_ABOVE_MB = 64


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

    - expandable_segments:True when `s.expandable_segments` (freed blocks are not stranded between live ones);
    - with offloaded checkpoints, pinned_max_round_threshold_mb: PyTorch's pinned-memory allocator rounds every
      block up to a power of two by default, so a 1.17 GB checkpoint (143k tokens x 8 KiB) holds 2 GiB of host
      RAM (measured: bench/results/issue5/). Blocks above the threshold get their exact size. The option is parsed
      by PyTorch 2.13's allocator config (c10/core/AllocatorConfig.h, pull 171662); fitune sets it from 2.13 on
      and leaves older versions, which may reject the key, with the rounding (fitune estimate notes it). Not yet
      measured on a GPU: the GPU machine has PyTorch 2.11.
    """
    added: dict[str, str] = {}
    current = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    if s.expandable_segments and "expandable_segments" not in current:
        added["expandable_segments"] = "True"
    if s.checkpointed_layers_mode == "offload" and "pinned_max_round_threshold" not in current \
            and exact_pinned_supported():
        added["pinned_max_round_threshold_mb"] = str(EXACT_PINNED_ABOVE_MB)
    if added:
        items = [current] if current else []
        items += [f"{k}:{v}" for k, v in added.items()]
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ",".join(items)
    return added


def exact_pinned_supported() -> bool:
    """Whether this PyTorch knows pinned_max_round_threshold_mb (checked in 2.13's allocator config)."""
    import torch

    version = re.match(r"(\d+)\.(\d+)", torch.__version__)
    return bool(version) and (int(version.group(1)), int(version.group(2))) >= (2, 13)


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


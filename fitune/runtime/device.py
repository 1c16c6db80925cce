"""The device and its allocator: dtype names, where to run, PyTorch's allocator settings and budget.

torch is imported inside the functions: `configure_allocator` must run before CUDA starts, and importing this
module costs nothing.
"""

from __future__ import annotations

import ctypes
import gc
import os
import time
from typing import TYPE_CHECKING

from ..errors import ConfigError

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


def matmul_gflops(dtype_name: str, size: int = 256, seconds: float = 0.1) -> float:
    """The CPU's rate at multiplying two `size` x `size` matrices in `dtype_name`, measured now (GFLOP/s): one
    warm-up product, then products until `seconds` have passed."""
    import torch

    a = torch.ones(size, size, dtype=torch_dtype(dtype_name))
    a @ a
    start, products = time.perf_counter(), 0
    while True:
        a @ a
        products += 1
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return 2 * size ** 3 * products / elapsed / 1e9


#: A half-precision matmul this many times slower than fp32 on the CPU is said, with `dtype: fp32` as the way out.
SLOW_HALF_PRECISION_RATIO = 2.0


def cpu_training_notice(dtype_name: str, measure=matmul_gflops) -> list[str]:
    """What `fitune train` says when it trains on the CPU: that no CUDA GPU is visible and why it may be (a CPU-only
    build of PyTorch, or a CUDA build that sees no GPU), and, for bf16 / fp16, how much slower this CPU multiplies
    matrices in that dtype than in fp32, measured now (CPUs without bf16 instructions emulate it: 1.34 against 157
    GFLOP/s on the 2-core AMD EPYC of fitune's CI, bench/results/cpu/matmul.jsonl).
    `measure(dtype_name)` gives a dtype's GFLOP/s (tests pass their own)."""
    import torch

    cuda = torch.version.cuda
    why = (f"torch {torch.__version__} is a CPU-only build; for the GPU install a CUDA build "
           "(https://pytorch.org/get-started/locally/)" if cuda is None else
           f"torch {torch.__version__} is built for CUDA {cuda} but sees no GPU: check `nvidia-smi` and "
           "CUDA_VISIBLE_DEVICES")
    lines = [f"no CUDA GPU is visible ({why}): training runs on the CPU"]
    if dtype_name in ("bf16", "fp16"):
        half, single = measure(dtype_name), measure("fp32")
        if half * SLOW_HALF_PRECISION_RATIO < single:
            lines.append(f"this CPU multiplies {dtype_name} matrices {single / half:,.0f}x slower than fp32 ({half:,.1f} "
                         f"against {single:,.1f} GFLOP/s, measured now): for a run on the CPU set `dtype: fp32` "
                         "(--dtype fp32)")
    return lines


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


CAP_MODE_ENV = "FITUNE_CAP_MODE"
"""`ballast`: `limit_allocator` takes the GPU memory beyond the budget with one cudaMalloc outside PyTorch's allocator
(the GPU must be this process's alone) instead of setting PyTorch's memory fraction. Unset: the fraction."""

_BALLAST: list = []  # (libcudart, device pointer, bytes) held by limit_allocator in ballast mode


def limit_allocator(budget_bytes: int | None) -> None:
    """Cap PyTorch's CUDA allocator at `budget_bytes` (a smaller card's budget on a bigger GPU); None lifts the
    cap. Past it, allocations fail with OutOfMemoryError as they would on that card.

    The default sets PyTorch's memory fraction, which is stricter than a smaller card with expandable segments: a
    request that misses the cache fails the fraction check when the mapped bytes plus the whole request exceed the
    cap (c10/cuda/CUDACachingAllocator.cpp `alloc_block`), though mapping only what the free end of the segment lacks
    would fit, and the allocator then empties its cache and retries. On the card itself only the physical memory
    stops the mapping. FITUNE_CAP_MODE=ballast (`CAP_MODE_ENV`) behaves as the card: the memory beyond the budget is
    taken once, outside PyTorch, once cuBLAS is up (a first matmul): the kernels loaded later take from the budget, as
    on the card (fitune/specs/gpu.py `kernel_images_bytes`)."""
    import torch

    _release_ballast()
    mode = os.environ.get(CAP_MODE_ENV, "")
    if mode not in ("", "ballast"):
        raise ConfigError(f"{CAP_MODE_ENV}={mode}: not a cap mode; set it to ballast (the memory beyond the budget "
                          "taken outside PyTorch, the GPU this process's alone) or unset it (PyTorch's memory fraction)")
    if budget_bytes is not None and mode == "ballast":
        torch.cuda.set_per_process_memory_fraction(1.0)
        _hold_ballast(budget_bytes)
        return
    total_bytes = torch.cuda.get_device_properties(0).total_memory
    fraction = 1.0 if budget_bytes is None else min(1.0, budget_bytes / total_bytes)
    torch.cuda.set_per_process_memory_fraction(fraction)


def ballast_bytes(free_bytes: int, budget_bytes: int, reserved_bytes: int) -> int:
    """What ballast mode takes: the GPU's free memory less what PyTorch's allocator may still reserve."""
    return max(0, free_bytes - max(0, budget_bytes - reserved_bytes))


def _cudart():
    """The CUDA runtime library PyTorch loaded (found in this process's memory map), through ctypes."""
    with open("/proc/self/maps", encoding="utf-8") as f:
        paths = sorted({line.split()[-1] for line in f if "libcudart.so" in line})
    if not paths:
        raise RuntimeError(f"{CAP_MODE_ENV}=ballast: no libcudart.so loaded in this process; unset it to cap with "
                           "PyTorch's memory fraction")
    return ctypes.CDLL(paths[0])


def _hold_ballast(budget_bytes: int) -> None:
    import torch

    torch.cuda.init()
    warm = torch.ones(16, 16, device="cuda", dtype=torch.bfloat16)
    (warm @ warm).sum().item()  # cuBLAS up, as the card's context constant counts it (fitune/specs/gpu.py)
    del warm
    free_bytes, _ = torch.cuda.mem_get_info()
    n = ballast_bytes(free_bytes, budget_bytes, torch.cuda.memory_reserved())
    if not n:
        return
    lib, ptr = _cudart(), ctypes.c_void_p()
    rc = lib.cudaMalloc(ctypes.byref(ptr), ctypes.c_size_t(n))
    if rc != 0:
        raise RuntimeError(f"{CAP_MODE_ENV}=ballast: cudaMalloc of {n} bytes failed (error {rc}); is the GPU shared?")
    _BALLAST.append((lib, ptr, n))


def _release_ballast() -> None:
    while _BALLAST:
        lib, ptr, _ = _BALLAST.pop()
        lib.cudaFree(ptr)


def ballast_held_bytes() -> int:
    """Bytes ballast mode holds now (0 without it)."""
    return sum(n for _, _, n in _BALLAST)


def outside_allocator_bytes() -> int:
    """Device memory in use that this process's caching allocator does not hold, less the ballast: the CUDA
    context, the kernel images loaded so far (lazily, as kernels are first used), cuDNN / cuBLAS handles, and any
    other process on the GPU. `total - free - reserved - ballast` (torch.cuda.mem_get_info, one driver call)."""
    import torch

    free_bytes, total_bytes = torch.cuda.mem_get_info()
    return total_bytes - free_bytes - torch.cuda.memory_reserved() - ballast_held_bytes()


def release_memory(device: str) -> None:
    """Collect Python garbage and give the allocator's cached blocks back (after an OOM, between runs)."""
    gc.collect()
    if device == "cuda":
        import torch

        torch.cuda.empty_cache()


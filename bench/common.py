"""What the GPU benchmark scripts share: capping the allocator, and timing training steps (the runtime's) under it."""

from __future__ import annotations

import gc
import time


def cap_allocator(cap: str | None, device: str) -> None:
    """Limit PyTorch's allocator to a GPU's budget (`rtx4090`, `23.4GiB`), as a smaller card would."""
    if device != "cuda" or not cap:
        return
    from fitune.runtime.device import limit_allocator
    from fitune.specs.gpu import resolve_gpu

    limit_allocator(resolve_gpu(cap).allocator_budget_bytes)


def timed_steps(run_step, steps: int, tokens_per_step: int, device: str) -> dict:
    """Run `run_step()` `steps` times; fits / tokens_per_s (mean of the steps after the first) / CUDA peaks.

    An out-of-memory error is a result (fits: False), any other error propagates.
    """
    import torch

    from fitune.runtime.oom import is_oom

    cuda = device == "cuda"
    rec: dict = {}
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        retries0 = torch.cuda.memory_stats().get("num_alloc_retries", 0)
    times = []
    try:
        for _ in range(steps):
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            run_step()
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        rec["fits"] = True
        rec["tokens_per_s"] = tokens_per_step / (sum(times[1:]) / len(times[1:]) if len(times) > 1 else times[0])
    except Exception as exc:  # noqa: BLE001 - an OOM is a result here
        if not is_oom(exc):
            raise
        rec["fits"] = False
        rec["error"] = str(exc).splitlines()[0][:200]
    if cuda:
        rec["peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
        rec["peak_reserved_bytes"] = torch.cuda.max_memory_reserved()
        rec["num_alloc_retries"] = torch.cuda.memory_stats().get("num_alloc_retries", 0) - retries0
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return rec


def training_step(model, opt, ids, chunked_loss: bool, micro_batch_size: int | None = None) -> float:
    """One optimizer step on `ids` (labels = inputs) through fitune's runtime step (`fitune train`'s):
    transformers' loss or fitune's chunked loss; with `micro_batch_size` below the batch, gradients accumulate
    over micro-batches of that many rows (each micro-batch's mean loss / their number)."""
    from fitune.runtime.step import train_step

    micro = ids.split(micro_batch_size or ids.shape[0])
    return train_step(model, opt, micro, loss="chunked" if chunked_loss else "hf").loss

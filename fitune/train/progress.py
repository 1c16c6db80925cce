"""`fitune train`'s progress bar: the loss, the last eval loss, tokens/s, and the run's memory peak against its budget.

 37%|███▋  | 37/100 [00:12<00:21, 2.95step/s, loss 2.1034, eval 2.2051, 5123 tok/s, peak 18.2/23.4 GiB (reserved 19.0)]

The text after the counts is `postfix(...)`, a pure function. The memory part says what it measures:
- CUDA: `peak A/B GiB (reserved R)`: A is the highest `torch.cuda.max_memory_allocated()` of the steps so far (the
  loop resets the peak every step), R the highest reserved peak, B the budget: the allocator budget of the run's
  `cap` (the card it behaves as), else the GPU's whole memory. The budget limits what the allocator reserves, so R is
  the number that runs into it.
- CPU: `rss peak N GiB`: the process's peak resident memory (getrusage), which holds the model, the optimizer, the
  data and Python itself; there is no budget to compare it with.
Imports tqdm when a bar is drawn, torch only to read the GPU's size.
"""

from __future__ import annotations

import logging
import sys

from ..specs.gpu import resolve_gpu
from ..units import GiB


def memory_text(peak_allocated_bytes: int | None = None, peak_reserved_bytes: int | None = None,
                budget_bytes: int | None = None, rss_peak_bytes: int | None = None) -> str:
    """The memory part of the bar: `peak 18.2/23.4 GiB (reserved 19.0)` on CUDA, `rss peak 1.3 GiB` on the CPU, ""
    when nothing is known. GiB with one decimal."""
    if peak_allocated_bytes is not None:
        text = f"peak {peak_allocated_bytes / GiB:.1f}"
        text += f"/{budget_bytes / GiB:.1f} GiB" if budget_bytes else " GiB"
        if peak_reserved_bytes is not None:
            text += f" (reserved {peak_reserved_bytes / GiB:.1f})"
        return text
    if rss_peak_bytes is not None:
        return f"rss peak {rss_peak_bytes / GiB:.1f} GiB"
    return ""


def postfix(loss: float, tokens_per_s: float, eval_loss: float | None = None, memory: str = "") -> str:
    """`loss 2.1034, eval 2.2051, 5123 tok/s, <memory>`; the eval part once there is an eval loss (ASCII only:
    any stderr encoding can print it)."""
    parts = [f"loss {loss:.4f}"]
    if eval_loss is not None:
        parts.append(f"eval {eval_loss:.4f}")
    parts.append(f"{tokens_per_s:.0f} tok/s")
    if memory:
        parts.append(memory)
    return ", ".join(parts)


def rss_peak_bytes() -> int | None:
    """This process's peak resident set size, bytes (None where getrusage is missing: Windows)."""
    try:
        import resource
    except ImportError:  # pragma: no cover - Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # macOS counts bytes, Linux KiB


def memory_budget_bytes(device: str, cap=None) -> int | None:
    """What the bar compares the CUDA peak with: the cap's allocator budget, else the GPU's memory; None off CUDA."""
    if not device.startswith("cuda"):
        return None
    if cap:
        return resolve_gpu(str(cap)).allocator_budget_bytes
    # torch, tqdm: optional, imported where used (estimate, plan and doctor SCRIPT never load them)
    import torch

    return torch.cuda.get_device_properties(torch.device(device)).total_memory  # "cuda": the current GPU


class TrainBar:
    """A tqdm bar on stderr, one tick per optimizer step; `update` takes the step's metrics.jsonl line."""

    def __init__(self, total: int, start: int, device: str = "cpu", budget_bytes: int | None = None):
        from tqdm.auto import tqdm

        self.device = device
        self.budget_bytes = budget_bytes
        self.eval_loss: float | None = None
        self.peak_allocated_bytes: int | None = None
        self.peak_reserved_bytes: int | None = None
        self._last: dict | None = None
        self.bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True, file=sys.stderr)

    def update(self, line: dict) -> None:
        for key in ("peak_allocated_bytes", "peak_reserved_bytes"):  # per-step peaks: keep the run's highest
            if line.get(key) is not None:
                setattr(self, key, max(getattr(self, key) or 0, line[key]))
        self._last = line
        self.bar.set_postfix_str(self.text(), refresh=False)
        self.bar.update(1)

    def set_eval_loss(self, loss: float) -> None:
        self.eval_loss = loss
        if self._last is not None:
            self.bar.set_postfix_str(self.text(), refresh=False)  # drawn with the next tick, or on close

    def text(self) -> str:
        line = self._last or {}
        if self.device.startswith("cuda"):
            memory = memory_text(self.peak_allocated_bytes, self.peak_reserved_bytes, self.budget_bytes)
        else:
            memory = memory_text(rss_peak_bytes=rss_peak_bytes())
        return postfix(line.get("loss", float("nan")), line.get("tokens_per_s", 0.0), self.eval_loss, memory)

    def close(self) -> None:
        self.bar.close()


class NoBar:
    """--no-progress (or no tqdm): no bar; with `log_every`, a line every `log_every` steps (and the last) through
    the `fitune` logger, which `fitune train` shows on stderr: `step 20/100: loss 2.1034, eval 2.2051, 5123 tok/s`."""

    def __init__(self, total_steps: int = 0, log_every: int | None = None):
        self.total_steps, self.log_every, self.eval_loss = total_steps, log_every, None

    def update(self, line: dict) -> None:
        step = line.get("step")
        if not self.log_every or not isinstance(step, int) or (step % self.log_every and step != self.total_steps):
            return
        text = postfix(line.get("loss", float("nan")), line.get("tokens_per_s", 0.0), self.eval_loss, "")
        logging.getLogger("fitune").info("step %d/%d: %s", step, self.total_steps, text)

    def set_eval_loss(self, loss: float) -> None:
        self.eval_loss = loss

    def close(self) -> None:
        pass


def progress_bar(total_steps: int, start_step: int, enabled: bool, device: str = "cpu", cap=None,
                 log_every: int | None = None) -> TrainBar | NoBar:
    """The bar of a run of `total_steps` optimizer steps resumed at `start_step`; `cap`: the run's `cap` key.
    Without a bar, a line every `log_every` steps (the config's `log_every`; None: nothing)."""
    if not enabled:
        return NoBar(total_steps, log_every)
    try:
        return TrainBar(total_steps, start_step, device, memory_budget_bytes(device, cap))
    except ImportError:  # pragma: no cover - tqdm comes with transformers, which training needs
        return NoBar(total_steps, log_every)

"""OOM post-mortem: turn "CUDA out of memory. Tried to allocate 1.96 GiB" into what filled the card.

`with fitune.oom_report(model=..., setup=..., gpu=...):` around a training loop: on an out-of-memory error it
prints the failed request, what was live by category and by source line, the estimate for the same setup and the
single changes that would fit, then exits with status 1 instead of a traceback. Inside `fitune profile` the
MemoryTracker supplies exact categories; around the user's own loop, fitune reads the CUDA allocator's snapshot
(with source lines when it recorded the allocation history, which the context manager turns on).
"""

from __future__ import annotations

import contextlib
import re
import sys
from dataclasses import dataclass, field

from ..memory import estimate
from ..memory.suggest import suggest_changes
from ..specs.gpu import resolve_gpu
from ..specs.model import load_model_spec
from ..units import GiB, MiB, human_bytes

_REQUEST_RE = re.compile(r"Tried to allocate ([\d.]+) (GiB|MiB|KiB|B)")
_UNITS = {"GiB": GiB, "MiB": MiB, "KiB": 1024, "B": 1}


@dataclass
class OomReport:
    """What an out-of-memory error tells, and what fitune adds to it. Sizes in bytes."""

    message: str
    requested_bytes: int | None
    live_bytes: int
    live_by_category: dict[str, int]
    top_sources: list[tuple[str, int]]
    reserved_bytes: int | None = None
    budget_bytes: int | None = None
    phase: str | None = None
    estimate_peak_allocated_bytes: int | None = None
    estimate_peak_reserved_bytes: int | None = None
    estimate_breakdown: dict[str, int] = field(default_factory=dict)
    suggestions: list[tuple[str, int]] = field(default_factory=list)

    def to_json(self) -> dict:
        return {
            "message": self.message, "requested_bytes": self.requested_bytes, "live_bytes": self.live_bytes,
            "live_by_category": self.live_by_category,
            "top_sources": [{"source": s, "bytes": b} for s, b in self.top_sources],
            "reserved_bytes": self.reserved_bytes, "budget_bytes": self.budget_bytes, "phase": self.phase,
            "estimate_peak_allocated_bytes": self.estimate_peak_allocated_bytes,
            "estimate_peak_reserved_bytes": self.estimate_peak_reserved_bytes,
            "estimate_breakdown": self.estimate_breakdown,
            "suggestions": [{"change": c, "peak_reserved_bytes": b} for c, b in self.suggestions],
        }


def is_oom(exc: BaseException) -> bool:
    try:
        import torch

        if isinstance(exc, torch.OutOfMemoryError):
            return True
    except ImportError:  # pragma: no cover
        pass
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()


def requested_bytes(message: str) -> int | None:
    m = _REQUEST_RE.search(message)
    return int(float(m.group(1)) * _UNITS[m.group(2)]) if m else None


def build_report(exc: BaseException, tracker=None, model_spec=None, setup=None, gpu=None, model=None,
                 device: str = "cuda") -> OomReport:
    """Collect the post-mortem: from `tracker` (exact categories) or from the CUDA allocator's snapshot."""
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if tracker is not None:
        if tracker.phase == "forward":  # what forward made so far is mostly what autograd keeps for backward
            tracker._relabel_forward_survivors()
        by_cat = tracker.live_by_category()
        live = sum(by_cat.values())
        top = tracker.live_by_source(8)
        phase = tracker.phase
    else:
        by_cat, top, live = _from_cuda_snapshot(model)
        phase = None
    rep = OomReport(message=message, requested_bytes=requested_bytes(str(exc)), live_bytes=live,
                    live_by_category=by_cat, top_sources=top, phase=phase)
    try:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            rep.reserved_bytes = torch.cuda.memory_reserved()
            if tracker is not None:
                seen = sum(v for k, v in by_cat.items() if k != "workspaces")
                rep.live_by_category["workspaces"] = max(0, torch.cuda.memory_allocated() - seen)
                rep.live_bytes = torch.cuda.memory_allocated()
    except Exception:  # noqa: BLE001 - a post-mortem must not fail on its way out
        pass
    if gpu is not None:
        rep.budget_bytes = gpu.allocator_budget_bytes
    if model_spec is not None and setup is not None:
        try:
            est = estimate(model_spec, setup, gpu, device=device)
            rep.estimate_peak_allocated_bytes = est.peak_allocated_bytes
            rep.estimate_peak_reserved_bytes = est.peak_reserved_bytes
            rep.estimate_breakdown = dict(est.breakdown)
            if gpu is not None:
                rep.suggestions = [(s.change + (" (with allocator retries)" if s.retries else ""), s.peak_reserved_bytes)
                                   for s in suggest_changes(model_spec, setup, gpu, est)]
        except Exception as e:  # noqa: BLE001
            rep.estimate_breakdown = {"error": str(e)}  # type: ignore[dict-item]
    return rep


def _from_cuda_snapshot(model) -> tuple[dict[str, int], list[tuple[str, int]], int]:
    """Live blocks of the CUDA allocator, grouped by the innermost useful source line (when history was on)."""
    by_cat: dict[str, int] = {}
    by_src: dict[str, int] = {}
    live = 0
    try:
        import torch

        if not torch.cuda.is_available():
            return by_cat, [], 0
        snap = torch.cuda.memory._snapshot()
        params = {}
        if model is not None:
            for p in model.parameters():
                params[p.untyped_storage().data_ptr()] = "adapter_weights" if p.requires_grad else "weights"
                if p.grad is not None:
                    params[p.grad.untyped_storage().data_ptr()] = "gradients"
        for seg in snap.get("segments", []):
            addr = seg["address"]
            for b in seg["blocks"]:
                if b["state"] == "active_allocated":
                    live += b["size"]
                    cat = params.get(addr, "activations and temporaries")
                    by_cat[cat] = by_cat.get(cat, 0) + b["size"]
                    src = _frame_label(b.get("frames") or [])
                    by_src[src] = by_src.get(src, 0) + b["size"]
                addr += b["size"]
    except Exception:  # noqa: BLE001
        pass
    return by_cat, sorted(by_src.items(), key=lambda kv: -kv[1])[:8], live


_KEEP = ("transformers/", "peft/", "bitsandbytes/", "torch/nn/", "torch/optim/")


def _frame_label(frames: list[dict]) -> str:
    for fr in frames:
        fn = fr.get("filename", "")
        for k in _KEEP:
            i = fn.find(k)
            if i >= 0:
                return f"{fn[i:]}:{fr.get('line')} ({fr.get('name')})"
    for fr in frames:
        if "site-packages" not in fr.get("filename", "") and fr.get("filename", "").endswith(".py"):
            return f"{fr['filename']}:{fr.get('line')} ({fr.get('name')})"
    return "(no Python frame: autograd backward or allocator internals)"


def format_report(rep: OomReport) -> str:
    scale = max(rep.live_bytes, rep.budget_bytes or 0, rep.estimate_peak_allocated_bytes or 0)

    def gib(n: int) -> str:
        return human_bytes(n, scale)

    lines = ["fitune: out of memory - post-mortem", f"  error: {rep.message}"]
    if rep.requested_bytes is not None:
        lines.append(f"  failed request: {gib(rep.requested_bytes)}" + (f" during {rep.phase}" if rep.phase else ""))
    budget = f" of a {gib(rep.budget_bytes)} budget" if rep.budget_bytes else ""
    lines.append(f"  live when it failed: {gib(rep.live_bytes)}{budget}"
                 + (f" (reserved {gib(rep.reserved_bytes)})" if rep.reserved_bytes is not None else ""))
    lines.append("  what filled it, by category:")
    for k, v in sorted(rep.live_by_category.items(), key=lambda kv: -kv[1]):
        if v:
            est = rep.estimate_breakdown.get(k) if isinstance(rep.estimate_breakdown.get(k), int) else None
            lines.append(f"    {k:28s} {gib(v):>11s}" + (f"   (estimate at its peak: {gib(est)})" if est is not None else ""))
    if rep.top_sources:
        lines.append("  largest sources:")
        for src, b in rep.top_sources:
            lines.append(f"    {gib(b):>11s}  {src}")
    if rep.estimate_peak_reserved_bytes is not None:
        lines.append(f"  fitune estimate for this setup: {gib(rep.estimate_peak_allocated_bytes)} allocated, "
                     f"{gib(rep.estimate_peak_reserved_bytes)} reserved at the peak")
    if rep.suggestions:
        lines.append("  changes that fit (one at a time):")
        for change, b in rep.suggestions:
            lines.append(f"    {change}  ->  {gib(b)} reserved")
    return "\n".join(lines)


@contextlib.contextmanager
def oom_report(model=None, setup=None, gpu=None, model_spec=None, tracker=None, exit_code: int | None = 1,
               stream=None, record_history: bool = True):
    """Context manager: print a post-mortem instead of a traceback when the block runs out of memory.

    Args:
        model: the torch model (to tell weights and gradients apart in the CUDA snapshot).
        setup, model_spec, gpu: a TrainSetup, ModelSpec and GpuSpec (or names) to add fitune's estimate and the
            changes that would fit.
        tracker: a MemoryTracker, for exact categories.
        exit_code: exit with this status after the report (None: re-raise the error after printing).
        record_history: on CUDA, record allocation stacks so the report can name source lines.
    """
    stream = stream or sys.stderr
    recording = False
    if record_history:
        try:
            import torch

            if torch.cuda.is_available():
                torch.cuda.memory._record_memory_history(max_entries=100_000)
                recording = True
        except Exception:  # noqa: BLE001
            recording = False
    if isinstance(model_spec, str):
        model_spec = load_model_spec(model_spec)
    if isinstance(gpu, str):
        gpu = resolve_gpu(gpu)
    try:
        yield
    except BaseException as exc:  # noqa: BLE001 - filtered right below
        if not is_oom(exc):
            raise
        rep = build_report(exc, tracker=tracker, model_spec=model_spec, setup=setup, gpu=gpu, model=model)
        print(format_report(rep), file=stream)
        if exit_code is None:
            raise
        raise SystemExit(exit_code) from None
    finally:
        if recording:
            import torch

            torch.cuda.memory._record_memory_history(enabled=None)


def report_oom(exc: BaseException, **kwargs) -> OomReport:
    """Print the post-mortem of an OOM already caught (for callbacks); returns the report."""
    rep = build_report(exc, **kwargs)
    print(format_report(rep), file=sys.stderr)
    return rep

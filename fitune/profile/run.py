"""`profile()`: run real training steps of a TrainSetup, measure memory per phase and per category, compare with
the estimate, and explain an OOM. Imports torch lazily (inside the functions)."""

from __future__ import annotations

import contextlib
import gc
import os
import time
from dataclasses import dataclass, field

from ..errors import ConfigError
from ..memory import estimate
from ..perf.flops import mfu
from ..runtime import optim  # optim.build_optimizer: looked up when called (tests wrap it)
from ..runtime.device import configure_allocator, limit_allocator, outside_allocator_bytes
from ..runtime.oom import build_report, is_oom
from ..setup import TrainSetup
from ..specs.gpu import GpuSpec, cuda_context_bytes
from ..specs.model import ModelSpec
from .tracker import CATEGORIES, MemoryTracker, downsample

PHASES = ("forward", "backward", "optimizer")


@dataclass
class PhaseMeasurement:
    peak_allocated_bytes: int
    peak_reserved_bytes: int | None
    by_category: dict[str, int]


@dataclass
class ProfileResult:
    """A measured run. Sizes in bytes, times in seconds."""

    model: str
    setup: TrainSetup
    device: str
    steps: int
    cap_bytes: int | None
    phases: dict[str, PhaseMeasurement]
    peak_phase: str
    peak_allocated_bytes: int
    peak_reserved_bytes: int | None
    breakdown: dict[str, int]
    estimate_breakdown: dict[str, int]
    estimate_peak_allocated_bytes: int
    estimate_peak_reserved_bytes: int
    step_time_s: float
    tokens_per_s: float
    tokens_per_step: int
    mfu: float | None
    num_alloc_retries: int | None
    fragmentation_bytes: int | None
    timeline: list[tuple[float, str, int]] = field(default_factory=list)
    """(t_s, phase, live_bytes) at every allocation and free the tracker saw (what --plot draws)."""
    oom: dict | None = None
    memory_timeline: list = field(default_factory=list)
    """The timeline --json prints: at most tracker.MAX_TIMELINE_POINTS `Sample`s (tracker.downsample), with the
    allocator's allocated and reserved bytes on CUDA."""
    estimate_timeline: list = field(default_factory=list)
    """The estimate's replayed tape (memory/tape.py `TapePoint`s) for one step: what the report draws over the
    measured timeline."""
    outside_allocator_bytes: int | None = None
    """CUDA: GPU memory in use outside PyTorch's allocator after the steps (the CUDA context, the kernels loaded,
    libraries' state; fitune/runtime/device.py `outside_allocator_bytes`), bytes."""
    estimate_context_bytes: int | None = None
    """CUDA: what the estimate's budget leaves for that on this GPU's generation (specs/gpu.py `cuda_context_bytes`)."""

    def to_json(self) -> dict:
        return {
            "model": self.model, "setup": self.setup.to_dict(), "device": self.device, "steps": self.steps,
            "cap_bytes": self.cap_bytes,
            "peak_allocated_bytes": self.peak_allocated_bytes, "peak_reserved_bytes": self.peak_reserved_bytes,
            "peak_phase": self.peak_phase,
            "phases": {p: {"peak_allocated_bytes": m.peak_allocated_bytes, "peak_reserved_bytes": m.peak_reserved_bytes,
                           "breakdown": m.by_category} for p, m in self.phases.items()},
            "breakdown": self.breakdown,
            "outside_allocator_bytes": self.outside_allocator_bytes,
            "estimate": {"peak_allocated_bytes": self.estimate_peak_allocated_bytes,
                         "peak_reserved_bytes": self.estimate_peak_reserved_bytes,
                         "cuda_context_bytes": self.estimate_context_bytes,
                         "breakdown": self.estimate_breakdown,
                         "timeline": [{"event": p.event, "phase": p.phase, "label": p.label,
                                       "allocated_bytes": p.allocated_bytes, "breakdown": p.by_category}
                                      for p in self.estimate_timeline]},
            "difference_bytes": {k: self.breakdown.get(k, 0) - self.estimate_breakdown.get(k, 0)
                                 for k in self.estimate_breakdown if k != "allocator_overhead"},
            "step_time_s": self.step_time_s, "tokens_per_step": self.tokens_per_step,
            "tokens_per_s": self.tokens_per_s, "mfu": self.mfu,
            "num_alloc_retries": self.num_alloc_retries, "fragmentation_bytes": self.fragmentation_bytes,
            "oom": self.oom,
            "timeline": [{"t_s": round(x.t_s, 6), "phase": x.phase, "live_bytes": x.live_bytes,
                          "allocated_bytes": x.allocated_bytes, "reserved_bytes": x.reserved_bytes,
                          "breakdown": x.breakdown()}
                         for x in self.memory_timeline],
        }


def profile(model_spec: ModelSpec, setup: TrainSetup, source: str | None = None, steps: int = 3,
            device: str = "cuda", cap: GpuSpec | None = None, gpu: GpuSpec | None = None,
            progress=None) -> ProfileResult:
    """Run `steps` training steps of `setup` and measure them: the runtime's one step, the one `fitune train` runs
    (`setup.stack == "hf"`: the HF recipe's forward and transformers' loss; PEFT's LoRA in both stacks).

    Args:
        source: where the model comes from (a model folder, a config.json or the catalog name).
        cap: limit PyTorch's allocator to this GPU's budget (CUDA: set_per_process_memory_fraction; CPU: the
            tracker raises OutOfMemoryError past it).
        gpu: the GPU whose peak FLOP/s MFU is computed against (defaults to `cap`).
    Raises:
        OutOfMemoryError is not raised: an OOM is returned in `result.oom` (a post-mortem) with what was measured.
    """
    # torch: optional, imported where used (estimate, plan and doctor SCRIPT never load it)
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("no CUDA GPU here; use --device cpu (tiny models) or run on a GPU machine")
    configure_allocator(setup)  # effective when CUDA has not started yet
    est = estimate(model_spec, setup, cap or gpu, device=device)
    cuda = device == "cuda"
    cap_bytes = cap.allocator_budget_bytes if cap is not None else None
    if cuda:
        torch.cuda.empty_cache()
        if cap_bytes is not None:
            limit_allocator(cap_bytes)
    model, opt, ids = _build_run(model_spec, setup, source, device)
    gc.collect()
    retries0 = torch.cuda.memory_stats().get("num_alloc_retries", 0) if cuda else None
    phases: dict[str, PhaseMeasurement] = {}
    tracker = MemoryTracker(model, opt, cap_bytes=None if cuda else cap_bytes, allocator_counters=cuda)
    times, oom = _run_steps(model, opt, ids, setup, steps, tracker, phases, cuda, progress,
                            post_mortem=dict(model_spec=model_spec, setup=setup, gpu=cap or gpu, device=device))
    retries = (torch.cuda.memory_stats().get("num_alloc_retries", 0) - retries0) if cuda else None
    result = _result(model_spec, setup, device, cap_bytes, cap or gpu, est, phases, times, tracker, oom, retries)
    if cuda:  # after the steps: the kernels they used are loaded
        result.outside_allocator_bytes = outside_allocator_bytes()
        result.estimate_context_bytes = cuda_context_bytes("{}.{}".format(*torch.cuda.get_device_capability()))
    del model, opt, ids
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        if cap_bytes is not None:
            limit_allocator(None)
    return result


def _build_run(model_spec: ModelSpec, setup: TrainSetup, source: str | None, device: str):
    """The model prepared for `setup` (LoRA, quantization, techniques), its optimizer and one batch of token ids."""
    import torch

    from ..runtime.model import build_model_for_setup, prepare_model
    # a model folder with weights loads them; a catalog name or config.json gets random weights on `device`
    source = source or model_spec.name
    model = build_model_for_setup(source if os.path.isdir(source) else model_spec, setup, device)
    model = prepare_model(model, setup)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = optim.build_optimizer(setup.optimizer, trainable, lr=1e-4)  # each optimizer's default weight decay
    ids = torch.randint(0, model_spec.vocab_size, (setup.batch_size, setup.seq_len_tokens), device=device)
    return model, opt, ids


def _run_steps(model, opt, ids, setup: TrainSetup, steps: int, tracker, phases: dict, cuda: bool, progress,
               post_mortem: dict) -> tuple[list[float], dict | None]:
    """Run the steps under the tracker, recording each phase's peak into `phases`: (the step times in seconds, the
    OOM post-mortem as JSON or None). An OOM ends the run; anything else propagates."""
    import torch

    from ..runtime.step import train_step

    times: list[float] = []
    oom = None

    @contextlib.contextmanager
    def measured(phase: str):
        """Around each phase of the step: the tracker's categories and the CUDA peaks of that phase alone."""
        tracker.set_phase(phase)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        yield
        if cuda:
            torch.cuda.synchronize()
        _record_phase(phases, phase, tracker, cuda)

    try:
        with tracker:
            for step in range(steps):
                if cuda:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                # the step `fitune train` runs; --stack hf: the HF recipe's forward (transformers' loss)
                train_step(model, opt, [ids], loss=setup.loss, recipe=setup.stack == "hf", phase=measured,
                           keep_outputs=setup.keep_outputs)
                tracker.end_step()
                times.append(time.perf_counter() - t0)
                if progress:
                    progress(step + 1, steps)
    except Exception as exc:  # noqa: BLE001 - an OOM becomes a post-mortem; anything else propagates
        if not is_oom(exc):
            raise
        rep = build_report(exc, tracker=tracker, model=model, **post_mortem)
        oom = rep.to_json()
        if tracker.phase in PHASES:
            _record_phase(phases, tracker.phase, tracker, cuda)
    return times, oom


def _result(model_spec: ModelSpec, setup: TrainSetup, device: str, cap_bytes: int | None, gpu: GpuSpec | None, est,
            phases: dict, times: list[float], tracker, oom: dict | None, retries: int | None) -> ProfileResult:
    """The measurements, the step time and MFU (against `gpu`), beside the estimate."""
    cuda = device == "cuda"
    peak_phase = max(phases, key=lambda p: phases[p].peak_allocated_bytes) if phases else "forward"
    peak = phases.get(peak_phase)
    step_time = min(times[1:] or times) if times else float("nan")
    tokens = setup.tokens_per_step
    tps = tokens / step_time if times else 0.0
    peak_tflops = gpu.peak_bf16_tflops if gpu is not None else None
    return ProfileResult(
        model=model_spec.name, setup=setup, device=device, steps=len(times), cap_bytes=cap_bytes,
        phases=phases, peak_phase=peak_phase,
        peak_allocated_bytes=peak.peak_allocated_bytes if peak else 0,
        peak_reserved_bytes=max((m.peak_reserved_bytes or 0) for m in phases.values()) if cuda and phases else None,
        breakdown=dict(peak.by_category) if peak else dict.fromkeys(CATEGORIES, 0),
        estimate_breakdown=dict(est.breakdown), estimate_peak_allocated_bytes=est.peak_allocated_bytes,
        estimate_peak_reserved_bytes=est.peak_reserved_bytes,
        step_time_s=step_time, tokens_per_s=tps, tokens_per_step=tokens,
        mfu=mfu(tps, model_spec, setup, peak_tflops) if times and cuda else None,
        num_alloc_retries=retries,
        fragmentation_bytes=(peak.peak_reserved_bytes - peak.peak_allocated_bytes) if cuda and peak else None,
        timeline=[(s.t_s, s.phase, s.live_bytes) for s in tracker.samples],
        oom=oom,
        memory_timeline=downsample(tracker.samples),
        estimate_timeline=est.timeline(),
    )


def _record_phase(phases: dict, phase: str, tracker, cuda: bool) -> None:
    """Keep the largest peak of each phase over the steps, with the tracker's categories at that peak."""
    import torch

    rec = tracker.phase_peaks.get(phase)
    by_cat = dict(rec.by_category) if rec else {}
    if cuda:
        alloc, reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
        seen = sum(by_cat.values())
        by_cat["workspaces"] = max(0, alloc - seen)  # what the allocator handed out that no tensor op made
    else:
        alloc, reserved = (rec.live_bytes if rec else 0), None
    cur = phases.get(phase)
    if cur is None or alloc > cur.peak_allocated_bytes:
        phases[phase] = PhaseMeasurement(alloc, reserved, by_cat)
    tracker.phase_peaks.pop(phase, None)

"""`RunMonitor`: checks inside the user's own training run (plain loops; `fitune.integrations.hf` wraps it for
the HF Trainer).

What it watches, step by step:
- checkpointing: forward hooks count each decoder layer's calls per forward pass: 1 without recompute, 2 when
  checkpointing recomputes in backward. Checkpointing switched on but one call per pass means it does nothing.
- memory per phase (forward, backward, optimizer) from a memory probe: CUDA's allocator counters on a GPU; on the
  CPU only the live tensor bytes after each step (no peaks). Compared with fitune's estimate when given one.
- numerics: non-finite losses and gradients; a GradScaler whose scale keeps falling or collapses (fp16).
- the allocator: `num_alloc_retries` growing (cudaMalloc failed, the cache was flushed and the call retried).
- leaks: live bytes after the step rising in every one of N consecutive steps.
- an OOM inside `monitor.watch()`: the post-mortem of `fitune.runtime.oom` when available.

Findings are collected as data (`findings()`); nothing here prints. Every public method and hook swallows its own
errors (logging one warning) so that the monitor can never stop the user's training.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..memory import estimate
from ..runtime.layers import find_decoder_layers
from ..runtime.oom import is_oom
from ..specs import load_model_spec
from ..units import MiB, gib, human_bytes
from .findings import ERROR, WARNING, Finding, sort_findings

logger = logging.getLogger(__name__)

PHASES = ("forward", "backward", "optimizer", "step")
"""Phase peaks are keyed by these; "step" is a whole step when the loop reported no phase boundary."""
RECOMPUTE_RATIO = 1.5
"""Decoder-layer calls per layer per forward pass at or above which the layers were recomputed in backward."""


def _guarded(method):
    """Run a monitor method or hook so that no error of the monitor's reaches the training loop."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        if self._failed:
            return None
        try:
            return method(self, *args, **kwargs)
        except Exception as exc:
            self._stop(exc)
            return None

    return wrapper


@dataclass(frozen=True)
class MemorySample:
    """What a memory probe reads at one point of a step. None where the probe cannot tell."""

    allocated_bytes: int | None
    """Bytes held by live tensors now."""
    peak_allocated_bytes: int | None
    """The highest `allocated_bytes` since the probe's previous reading."""
    reserved_bytes: int | None = None
    alloc_retries: int | None = None
    """The allocator's cumulative count of cudaMalloc retries (`torch.cuda.memory_stats()['num_alloc_retries']`)."""


MemoryProbe = Callable[[str], "MemorySample | None"]
"""Called at "step_begin", "forward", "backward" and "optimizer" (the end of the phase of that name); returns a
MemorySample, or None when it does not measure at that point."""


def cuda_probe(device: torch.device | int | None = None) -> MemoryProbe:
    """Read CUDA's allocator counters, then reset the peak so each reading covers one phase.

    Note: this resets `torch.cuda.max_memory_allocated()` for the whole process at every phase boundary.
    """

    def probe(point: str) -> MemorySample:
        stats = torch.cuda.memory_stats(device)
        sample = MemorySample(
            allocated_bytes=torch.cuda.memory_allocated(device),
            peak_allocated_bytes=torch.cuda.max_memory_allocated(device),
            reserved_bytes=torch.cuda.memory_reserved(device),
            alloc_retries=int(stats.get("num_alloc_retries", 0)),
        )
        torch.cuda.reset_peak_memory_stats(device)
        return sample

    return probe


def live_tensor_bytes() -> int:
    """Bytes of the distinct storages of every tensor the garbage collector can reach (CPU best effort).

    Misses tensors only autograd holds (saved for backward), so it suits between-step readings, not peaks. Takes
    about 0.2 s in a process with transformers loaded.
    """
    seen: dict[tuple, int] = {}
    for obj in gc.get_objects():
        try:
            # type(), not isinstance(): isinstance reads obj.__class__, which some module proxies warn about
            if not issubclass(type(obj), torch.Tensor) or obj.is_meta or obj.layout != torch.strided:
                continue
            storage = obj.untyped_storage()
            seen[(obj.device.type, obj.device.index, storage.data_ptr())] = storage.nbytes()
        except Exception:  # fake, functional or otherwise storage-less tensors
            continue
    return sum(seen.values())


def cpu_probe() -> MemoryProbe:
    """On the CPU: live tensor bytes after each step only; no phase peaks."""

    def probe(point: str) -> MemorySample | None:
        if point != "optimizer":
            return None
        return MemorySample(allocated_bytes=live_tensor_bytes(), peak_allocated_bytes=None)

    return probe


@dataclass(frozen=True)
class MonitorLimits:
    """When the monitor speaks up."""

    leak_window_steps: int = 5
    """Consecutive steps whose post-step live bytes must each rise for a leak."""
    leak_min_growth_bytes: int = 64 * MiB
    """... by at least this much in total over the window."""
    warmup_steps: int = 1
    """Steps ignored by the leak check (the first step creates the optimizer state)."""
    min_loss_scale: float = 1.0
    """A GradScaler scale below this has collapsed: small fp16 gradients underflow to zero."""
    overflow_run_steps: int = 3
    """This many consecutive steps with a falling scale (each one skipped) is reported."""
    scale_warmup_steps: int = 10
    """Steps in which GradScaler normally searches its scale down from 65536 (not reported)."""
    peak_tolerance: float = 0.10
    """A measured phase peak above the estimate by more than this fraction ..."""
    peak_tolerance_bytes: int = 256 * MiB
    """... and by more than this many bytes is reported."""
    check_gradients: bool = True
    """Check after backward that every gradient is finite (one reduction per step)."""


@dataclass
class StepRecord:
    """What one optimizer step looked like. Sizes in bytes; None where not measured."""

    step: int
    forwards: int = 0
    """Top-level forward passes of the model (micro-batches) in the step."""
    layer_calls: int = 0
    """Forward calls of all decoder layers in the step, recomputation included."""
    checkpointing: bool | None = None
    """`model.is_gradient_checkpointing` during the step."""
    phase_peak_bytes: dict[str, int] = field(default_factory=dict)
    post_step_bytes: int | None = None
    alloc_retries: int | None = None
    loss: float | None = None
    loss_scale: float | None = None
    grads_finite: bool | None = None
    grad_norm: float | None = None


class RunMonitor:
    """Watches a training run. For a plain loop::

        monitor = RunMonitor(model, setup=TrainSetup(...), model_name="llama-3.1-8b")  # estimate optional
        with monitor.watch():                       # OOM post-mortem
            model.train()
            for batch in loader:
                monitor.step_begin()
                loss = model(**batch).loss
                monitor.after_forward()
                loss.backward()
                monitor.after_backward()
                optimizer.step(); optimizer.zero_grad()
                monitor.step_end(loss)              # scaler=scaler with fp16 AMP
        for f in monitor.findings(): ...
        monitor.close()

    Args:
        model: the module trained (a PEFT model is fine); its decoder layers are found by class
            (transformers' GradientCheckpointingLayer) or as the longest ModuleList of one class, or pass `layers`.
        setup, model_name: a TrainSetup and a catalog name / config.json, to compare phase peaks with the estimate.
        estimate: a ready `MemoryEstimate` instead of setup + model_name.
        memory_probe: see `MemoryProbe`; default: CUDA counters when the model is on a GPU, else `cpu_probe()`.
        limits: thresholds (`MonitorLimits`).
        expect_checkpointing: override `model.is_gradient_checkpointing` (for checkpointing applied by hand).
        phase_hooks: mark forward boundaries from the model's own forward hooks instead of `after_forward()` /
            `after_backward()` calls (what the HF callback uses).
    """

    def __init__(self, model: torch.nn.Module, *, setup=None, model_name: str | None = None, estimate=None,
                 memory_probe: MemoryProbe | None = None, limits: MonitorLimits | None = None,
                 layers: list[torch.nn.Module] | None = None, expect_checkpointing: bool | None = None,
                 phase_hooks: bool = False):
        self.model = model
        self.limits = limits or MonitorLimits()
        self.steps: list[StepRecord] = []
        self.oom: Finding | None = None
        self._setup, self._model_name, self._estimate = setup, model_name, estimate
        self._probe = memory_probe or _default_probe(model)
        self._expect_checkpointing = expect_checkpointing
        self._phase_hooks = phase_hooks
        self._current: StepRecord | None = None
        self._phase: str | None = None
        self._failed = False
        self._layers = list(layers) if layers is not None else find_decoder_layers(model)
        self._handles = [model.register_forward_pre_hook(self._on_model_forward_begin)]
        if phase_hooks:
            self._handles.append(model.register_forward_hook(self._on_model_forward_end))
        self._handles += [layer.register_forward_pre_hook(self._on_layer_call) for layer in self._layers]

    # ---- the step, as the training loop reports it -----------------------------------------------------------
    @_guarded
    def step_begin(self) -> None:
        self._current = StepRecord(step=len(self.steps))
        self._phase = "forward"
        self._probe("step_begin")  # resets the peak: what ran between steps is not this step's

    @_guarded
    def after_forward(self) -> None:
        if self._current is not None and self._phase == "forward":
            self._close_phase("forward")
            self._phase = "backward"

    @_guarded
    def after_backward(self) -> None:
        if self._current is None or self._phase != "backward":
            return
        self._close_phase("backward")
        self._phase = "optimizer"
        if self.limits.check_gradients:
            finite = _grads_finite(self.model)
            if finite is not None:
                prev = self._current.grads_finite
                self._current.grads_finite = finite if prev is None else (prev and finite)

    @_guarded
    def step_end(self, loss=None, scaler=None) -> None:
        """End of the optimizer step.

        Args:
            loss: the step's loss, a tensor (read with .item(): one synchronisation) or a number.
            scaler: a torch GradScaler (anything with get_scale() and is_enabled()) when training with fp16 AMP.
        """
        rec = self._current
        if rec is None:
            return
        # The last reading belongs to the phase in progress: "optimizer" normally; "backward" (backward plus the
        # optimizer step) when the loop reported no after_backward(); "step" when it reported no boundary at all.
        phase = {"optimizer": "optimizer", "backward": "backward"}.get(self._phase, "step")
        sample = self._probe("optimizer")
        if sample is not None:
            if sample.peak_allocated_bytes is not None:
                rec.phase_peak_bytes[phase] = max(rec.phase_peak_bytes.get(phase, 0), sample.peak_allocated_bytes)
            rec.post_step_bytes = sample.allocated_bytes
            rec.alloc_retries = sample.alloc_retries
        if loss is not None:
            rec.loss = float(loss.detach().float().item() if isinstance(loss, torch.Tensor) else loss)
        if scaler is not None and (not hasattr(scaler, "is_enabled") or scaler.is_enabled()):
            rec.loss_scale = float(scaler.get_scale())
        rec.checkpointing = self._checkpointing_on()
        self.steps.append(rec)
        self._current, self._phase = None, None

    @_guarded
    def record_loss(self, loss: float | None = None, grad_norm: float | None = None) -> None:
        """Attach a logged loss / gradient norm to the last finished step (the HF callback's on_log)."""
        if not self.steps:
            return
        if loss is not None:
            self.steps[-1].loss = float(loss)
        if grad_norm is not None:
            self.steps[-1].grad_norm = float(grad_norm)

    # ---- OOM ---------------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def watch(self):
        """Run the training inside: a CUDA out-of-memory error gets a post-mortem, then propagates unchanged."""
        try:
            yield self
        except Exception as exc:
            if is_oom(exc):  # torch.OutOfMemoryError, or a RuntimeError saying "out of memory" (cuBLAS, NCCL)
                self.handle_oom(exc)
            raise

    def handle_oom(self, exc: BaseException) -> str:
        """Record the OOM as a finding and return the post-mortem text (also logged)."""
        where = f"step {self._current.step}, {self._phase or 'outside a step'}" if self._current else "before any step"
        text = ""
        try:
            from ..runtime.oom import format_report, report_oom  # fitune's OOM post-mortem
        except ImportError:
            report_oom = None
        if report_oom is not None:
            try:
                extra = {}
                if self._setup is not None and self._model_name:
                    extra = {"setup": self._setup, "model_spec": load_model_spec(self._model_name)}
                text = format_report(report_oom(exc, model=self.model, **extra))  # report_oom prints it too
            except Exception as inner:  # the post-mortem must not hide the OOM: fall back below
                logger.warning("fitune doctor: fitune.runtime.oom.report_oom failed: %r", inner)
        if not text:
            text = (f"CUDA out of memory ({where}): {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}. "
                    "fitune's OOM post-mortem (fitune.runtime.oom) did not run here; the per-phase peaks of the "
                    "steps before are in this monitor's report, and `fitune estimate` shows what the setup needs.")
            logger.warning("fitune doctor: %s", text)
        self.oom = Finding("cuda-oom", None, ERROR, f"CUDA out of memory at {where}.",
                           "see the post-mortem; `fitune estimate MODEL ... --gpu YOURS` lists changes that fit",
                           text)
        return text

    # ---- results -----------------------------------------------------------------------------------------------
    @property
    def checkpointing_recomputes(self) -> bool | None:
        """True when decoder layers ran more than once per forward pass (recomputed in backward); None before any
        step with a forward pass was observed."""
        ratios = [r for r in (self._layer_ratio(s) for s in self.steps) if r is not None]
        if not ratios:
            return None
        return max(ratios) >= RECOMPUTE_RATIO

    def layer_calls_per_forward(self) -> list[float | None]:
        return [self._layer_ratio(s) for s in self.steps]

    def findings(self) -> list[Finding]:
        out: list[Finding] = []
        for check in (self._check_checkpointing, self._check_leak, self._check_numerics, self._check_loss_scale,
                      self._check_retries, self._check_estimate):
            try:
                out.extend(check())
            except Exception as exc:  # a broken check must not hide the others
                logger.warning("fitune doctor: run check %s failed: %s", check.__name__, exc)
        if self.oom is not None:
            out.append(self.oom)
        return sort_findings(out)

    def summary_lines(self) -> list[str]:
        """What the run looked like, for the report (numbers only where measured)."""
        lines = [f"{len(self.steps)} steps observed, {len(self._layers)} decoder layers hooked"]
        ratios = [r for r in self.layer_calls_per_forward() if r is not None]
        if ratios:
            on = any(s.checkpointing for s in self.steps)
            lines.append(f"checkpointing {'on' if on else 'off'}: {max(ratios):.1f} decoder-layer calls per forward "
                         f"pass ({'recomputed in backward' if self.checkpointing_recomputes else 'no recompute'})")
        peaks = self._phase_peaks()
        if peaks:
            est = self._estimate_phases()
            lines.append("peak allocated per phase (max over steps): " + ", ".join(
                f"{p} {gib(v)}" + (f" (estimate {gib(est[p])})" if est and p in est else "")
                for p, v in peaks.items()))
        else:
            lines.append("phase peaks: not measured (no CUDA device)")
        post = [s.post_step_bytes for s in self.steps if s.post_step_bytes is not None]
        if post:
            top = max(post)
            lines.append(f"live after each step: {human_bytes(post[0], top)} first, {human_bytes(post[-1], top)} last, "
                         f"{human_bytes(top, top)} max")
        scales = [s.loss_scale for s in self.steps if s.loss_scale is not None]
        if scales:
            lines.append(f"loss scale: {scales[0]:g} first, {scales[-1]:g} last, {min(scales):g} min")
        return lines

    def close(self) -> None:
        """Remove every hook (the monitor keeps its records)."""
        for h in self._handles:
            h.remove()
        self._handles = []

    # ---- checks --------------------------------------------------------------------------------------------------
    def _check_checkpointing(self) -> list[Finding]:
        observed = [(s, r) for s in self.steps if (r := self._layer_ratio(s)) is not None]
        on = [(s, r) for s, r in observed if s.checkpointing]
        if not on or any(r >= RECOMPUTE_RATIO for _, r in on):
            return []
        return [Finding(
            "checkpointing-not-recomputing", None, ERROR,
            f"gradient checkpointing is enabled, but in {len(on)} steps each decoder layer ran "
            f"{on[-1][1]:.1f} time(s) per forward pass: nothing was recomputed in backward, so every activation was "
            "kept as if checkpointing were off.",
            "call model.train() before training (transformers checkpoints only in training mode); with "
            "torch.utils.checkpoint use use_reentrant=False; check that gradients flow "
            "(model.enable_input_require_grads())",
            "measured in this run: forward calls of the decoder layers counted with forward hooks",
            ("C15",))]

    def _check_leak(self) -> list[Finding]:
        lim = self.limits
        series = [(s.step, s.post_step_bytes) for s in self.steps[lim.warmup_steps:] if s.post_step_bytes is not None]
        n = lim.leak_window_steps
        for i in range(len(series) - n + 1):
            window = series[i:i + n]
            values = [v for _, v in window]
            rising = all(b > a for a, b in zip(values, values[1:]))
            if rising and values[-1] - values[0] >= lim.leak_min_growth_bytes:
                grown = values[-1] - values[0]

                def size(n: int) -> str:
                    return human_bytes(n, values[-1])

                return [Finding(
                    "memory-grows-every-step", None, WARNING,
                    f"live memory after the step rose in each of steps {window[0][0]}-{window[-1][0]}, by "
                    f"{size(grown)} in total ({size(values[0])} -> {size(values[-1])}, {size(grown // (n - 1))} per "
                    "step): something keeps tensors from every step, and the run will run out of memory later.",
                    "look for tensors kept across steps: losses accumulated without .item(), outputs appended to a "
                    "list, a growing cache or history; `fitune doctor SCRIPT` flags the common ones",
                    f"measured in this run: live bytes after each step ({_probe_name(self._probe)})")]
        return []

    def _check_numerics(self) -> list[Finding]:
        out = []
        bad_loss = [s.step for s in self.steps if s.loss is not None and not math.isfinite(s.loss)]
        if bad_loss:
            out.append(Finding("loss-not-finite", None, ERROR,
                               f"the loss was NaN or infinite at steps {_steps_text(bad_loss)}.",
                               "lower the learning rate; use bf16 instead of fp16; check the data for empty examples "
                               "(all labels -100 gives a NaN mean)",
                               "measured in this run: the loss passed to step_end() / logged by Trainer"))
        unscaled = [s.step for s in self.steps if s.loss_scale is None and
                    (s.grads_finite is False or (s.grad_norm is not None and not math.isfinite(s.grad_norm)))]
        if unscaled:
            out.append(Finding("gradients-not-finite", None, ERROR,
                               f"gradients were NaN or infinite at steps {_steps_text(unscaled)}, and no loss "
                               "scaler skipped those steps: the weights took NaN updates.",
                               "bf16 instead of fp16; gradient clipping (max_grad_norm); a lower learning rate",
                               "measured in this run: torch.isfinite over every gradient after backward"))
        return out

    def _check_loss_scale(self) -> list[Finding]:
        lim = self.limits
        scaled = [s for s in self.steps if s.loss_scale is not None]
        if not scaled:
            return []
        out = []
        low = [s for s in scaled if s.loss_scale < lim.min_loss_scale]
        if low:
            out.append(Finding(
                "loss-scale-collapse", None, ERROR,
                f"the fp16 loss scale fell to {min(s.loss_scale for s in low):g} (below {lim.min_loss_scale:g}) from "
                f"step {low[0].step}: gradients overflow even unscaled, or the scale never recovers; small gradients "
                "underflow to zero and the loss falls slowly or not at all.",
                "train in bf16 (bf16=True) if the GPU supports it; otherwise lower the learning rate and check for "
                "a layer whose activations exceed fp16's 65504",
                "measured in this run: GradScaler.get_scale() after each step", ("C19",)))
        drops = [b.step for a, b in zip(scaled, scaled[1:])
                 if b.loss_scale < a.loss_scale and b.step >= lim.scale_warmup_steps]
        run = _longest_consecutive(drops)
        if len(run) >= lim.overflow_run_steps:
            out.append(Finding(
                "fp16-overflow-steps", None, WARNING,
                f"the fp16 loss scale fell in {len(drops)} steps after warm-up, {len(run)} in a row (steps "
                f"{run[0]}-{run[-1]}): each fall means inf/NaN gradients and a skipped optimizer step.",
                "bf16 instead of fp16 where the GPU has it (no loss scaling); else a lower learning rate",
                "measured in this run: GradScaler.get_scale() after each step", ("C19",)))
        return out

    def _check_retries(self) -> list[Finding]:
        counts = [s.alloc_retries for s in self.steps if s.alloc_retries is not None]
        if len(counts) < 2 or counts[-1] <= counts[0]:
            return []
        return [Finding(
            "allocator-retries", None, WARNING,
            f"PyTorch's caching allocator retried {counts[-1] - counts[0]} allocations during the run: cudaMalloc "
            "failed, it freed its cache and tried again. The run is at the memory limit (one step from an OOM) and "
            "each retry synchronises the GPU.",
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (less fragmentation), or lower the peak "
            "(`fitune estimate ... --gpu` lists changes that fit)",
            "measured in this run: torch.cuda.memory_stats()['num_alloc_retries']")]

    def _check_estimate(self) -> list[Finding]:
        est = self._estimate_phases()
        peaks = self._phase_peaks()
        if not est or not peaks:
            return []
        lim = self.limits
        out = []
        for phase, measured in peaks.items():
            expected = max(est.values()) if phase == "step" else est.get(phase)
            if expected is None:
                continue
            over = measured - expected
            if over > lim.peak_tolerance_bytes and over > lim.peak_tolerance * expected:
                out.append(Finding(
                    "peak-above-estimate", None, WARNING,
                    f"the {phase} peak reached {gib(measured)}, {gib(over)} (+{100 * over / expected:.0f} %) above "
                    f"fitune's estimate of {gib(expected)} for this setup: the script holds something the setup "
                    "does not describe.",
                    "check that the setup matches the script (batch, sequence length, checkpointing, LoRA targets, "
                    "dtype); then look for tensors kept alive (outputs, logits) or padding beyond the sequence length",
                    "measured in this run (torch.cuda.max_memory_allocated per phase) vs fitune estimate "
                    "(its error against measured runs: docs/accuracy.md)"))
        return out

    # ---- helpers -------------------------------------------------------------------------------------------------
    def _estimate_phases(self) -> dict[str, int] | None:
        if self._estimate is None and self._setup is not None and self._model_name:
            self._estimate = estimate(load_model_spec(self._model_name), self._setup)
        if self._estimate is None:
            return None
        return {p: ph.peak_allocated_bytes for p, ph in self._estimate.phases.items()}

    def _phase_peaks(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for s in self.steps:
            for p, v in s.phase_peak_bytes.items():
                out[p] = max(out.get(p, 0), v)
        return {p: out[p] for p in PHASES if p in out}

    def _layer_ratio(self, s: StepRecord) -> float | None:
        if not self._layers or s.forwards == 0:
            return None
        return s.layer_calls / (s.forwards * len(self._layers))

    def _checkpointing_on(self) -> bool | None:
        if self._expect_checkpointing is not None:
            return self._expect_checkpointing
        value = getattr(self.model, "is_gradient_checkpointing", None)
        return bool(value) if value is not None else None

    def _close_phase(self, phase: str) -> None:
        sample = self._probe(phase)
        if sample is not None and sample.peak_allocated_bytes is not None and self._current is not None:
            prev = self._current.phase_peak_bytes.get(phase, 0)
            self._current.phase_peak_bytes[phase] = max(prev, sample.peak_allocated_bytes)

    def _in_training_forward(self) -> bool:
        """A forward inside a reported step with autograd on (eval mode included: a loop may forget train())."""
        return self._current is not None and torch.is_grad_enabled()

    @_guarded
    def _on_model_forward_begin(self, module, args):
        if not self._in_training_forward():
            return
        if self._phase_hooks and self._phase == "backward":  # next micro-batch: the previous backward ended
            self._close_phase("backward")
            self._phase = "forward"
        self._current.forwards += 1

    @_guarded
    def _on_model_forward_end(self, module, args, output):
        if self._in_training_forward() and self._phase == "forward":
            self._close_phase("forward")
            self._phase = "backward"

    @_guarded
    def _on_layer_call(self, module, args):
        if self._current is not None:
            self._current.layer_calls += 1

    def _stop(self, exc: Exception) -> None:
        """After an internal error: log once, remove the hooks, and ignore every later call."""
        self._failed = True
        logger.warning("fitune doctor: run checks stopped after an internal error (training continues): %r", exc)
        with contextlib.suppress(Exception):
            self.close()


def _default_probe(model: torch.nn.Module) -> MemoryProbe:
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    if device.type == "cuda":
        return cuda_probe(device)
    return cpu_probe()


def _probe_name(probe) -> str:
    qual = getattr(probe, "__qualname__", "")
    if qual.startswith("cuda_probe"):
        return "torch.cuda.memory_allocated"
    if qual.startswith("cpu_probe"):
        return "bytes of the tensors the garbage collector reaches"
    return "the memory probe passed to RunMonitor"


def _grads_finite(model: torch.nn.Module) -> bool | None:
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads:
        return None
    flags = torch.stack([torch.isfinite(g).all() for g in grads])
    return bool(flags.all().item())  # one synchronisation per step


def _longest_consecutive(steps: list[int]) -> list[int]:
    best: list[int] = []
    run: list[int] = []
    for s in steps:
        run = run + [s] if run and s == run[-1] + 1 else [s]
        if len(run) > len(best):
            best = run
    return best


def _steps_text(steps: list[int], limit: int = 8) -> str:
    text = ", ".join(str(s) for s in steps[:limit])
    return text + (f" (and {len(steps) - limit} more)" if len(steps) > limit else "")


__all__ = ["MemorySample", "MemoryProbe", "MonitorLimits", "RunMonitor", "StepRecord", "cpu_probe", "cuda_probe",
           "find_decoder_layers", "live_tensor_bytes"]

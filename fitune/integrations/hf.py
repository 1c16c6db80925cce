"""`FituneCallback`: fitune doctor's run checks inside a Hugging Face `Trainer` (or TRL's trainers).

    from fitune.integrations.hf import FituneCallback

    callback = FituneCallback()        # or FituneCallback(setup=TrainSetup(...), model_name="llama-3.1-8b")
    trainer = Trainer(..., callbacks=[callback])
    with callback.watch():                           # optional: a post-mortem if the run dies of CUDA OOM
        trainer.train()
    callback.findings                                # list[fitune.doctor.Finding]; also logged at train end

What it checks is `fitune.doctor.runtime.RunMonitor`'s list: checkpointing that recomputes, per-phase peaks (and
the estimate, when given a setup), non-finite losses and gradient norms, the fp16 loss scale (from the
accelerate-wrapped optimizer's scaler), allocator retries, memory growing every step. The report is logged on the
"fitune.doctor" logger at `report_level` (WARNING by default, so it shows without any logging set-up). Any error
inside the callback is logged once and switches the callback off; it never stops training.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os

from transformers import TrainerCallback

from ..doctor.findings import Finding
from ..doctor.report import count_text, format_findings
from ..doctor.runtime import MemoryProbe, MonitorLimits, RunMonitor
from ..runtime.oom import is_oom

logger = logging.getLogger("fitune.doctor")

REPORT_FILE = "fitune_doctor.json"


def _safe(method):
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        if self.disabled:
            return None
        try:
            method(self, *args, **kwargs)
        except Exception as exc:
            self.disabled = True
            logger.warning("fitune doctor: callback switched off after an internal error (training continues): %r",
                           exc)
        return None  # never change the Trainer's control flow

    return wrapper


class FituneCallback(TrainerCallback):
    """Runs `RunMonitor` over a Trainer's steps.

    Args:
        setup, model_name: a `fitune.setup.TrainSetup` and a catalog name / config.json, to compare the phase peaks
            with fitune's estimate.
        memory_probe: overrides the memory reading (default: CUDA counters on a GPU, live tensors on the CPU).
        limits: `MonitorLimits` thresholds.
        report_level: logging level of the end-of-training report.
        write_report: also write the findings as JSON to `<output_dir>/fitune_doctor.json`.
    """

    def __init__(self, *, setup=None, model_name: str | None = None, memory_probe: MemoryProbe | None = None,
                 limits: MonitorLimits | None = None, report_level: int = logging.WARNING, write_report: bool = False):
        self.setup, self.model_name = setup, model_name
        self.memory_probe, self.limits = memory_probe, limits
        self.report_level, self.write_report = report_level, write_report
        self.monitor: RunMonitor | None = None
        self.findings: list[Finding] = []
        self.report = ""
        self.disabled = False

    @_safe
    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is None:
            return
        if self.monitor is not None:  # a second trainer.train(): start afresh
            self.monitor.close()
        self.monitor = RunMonitor(model, setup=self.setup, model_name=self.model_name,
                                  memory_probe=self.memory_probe, limits=self.limits, phase_hooks=True)

    @_safe
    def on_step_begin(self, args, state, control, **kwargs):
        if self.monitor is not None:
            self.monitor.step_begin()

    @_safe
    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.monitor is not None:
            self.monitor.after_backward()

    @_safe
    def on_step_end(self, args, state, control, optimizer=None, **kwargs):
        if self.monitor is not None:
            # accelerate's AcceleratedOptimizer carries the GradScaler of fp16 runs
            self.monitor.step_end(scaler=getattr(optimizer, "scaler", None))

    @_safe
    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.monitor is not None and logs:
            self.monitor.record_loss(loss=logs.get("loss"), grad_norm=logs.get("grad_norm"))
            self._put_in_trainer_logs(state, logs)

    def _put_in_trainer_logs(self, state, logs: dict) -> None:
        """The findings so far and the last step's peak, in the Trainer's own logs: numbers in `logs` (what the
        loggers after this callback receive), and the findings' rule ids in `state.log_history` (trainer_state.json)."""
        findings = self.monitor.findings()
        numbers = {"fitune/findings": len(findings)}
        last = self.monitor.steps[-1] if self.monitor.steps else None
        if last is not None and last.phase_peak_bytes:
            numbers["fitune/peak_allocated_gib"] = round(max(last.phase_peak_bytes.values()) / 2**30, 3)
        logs.update(numbers)
        if state.log_history:
            state.log_history[-1].update(numbers, **{"fitune/finding_rules": sorted({f.rule for f in findings})})

    @_safe
    def on_train_end(self, args, state, control, **kwargs):
        self._finish(getattr(args, "output_dir", None))

    @contextlib.contextmanager
    def watch(self):
        """Wrap `trainer.train()`: on CUDA out-of-memory, report the post-mortem and the findings so far, re-raise."""
        try:
            yield self
        except Exception as exc:
            if not is_oom(exc):  # torch.OutOfMemoryError, or a RuntimeError saying "out of memory"
                raise
            with contextlib.suppress(Exception):
                if self.monitor is not None:
                    self.monitor.handle_oom(exc)
                    self._finish(None)
                else:
                    logger.warning("fitune doctor: CUDA out of memory before the first step: %s", exc)
            raise

    def _finish(self, output_dir: str | None) -> None:
        if self.monitor is None:
            return
        self.findings = self.monitor.findings()
        lines = [f"fitune doctor (run): {count_text(self.findings)}"]
        lines += [f"  {line}" for line in self.monitor.summary_lines()]
        if self.findings:
            lines += ["", format_findings(self.findings)]
        self.report = "\n".join(lines)
        logger.log(self.report_level, "%s", self.report)
        if self.write_report and output_dir:
            os.makedirs(output_dir, exist_ok=True)
            with open(os.path.join(output_dir, REPORT_FILE), "w", encoding="utf-8") as f:
                json.dump([x.to_dict() for x in self.findings], f, indent=2)
        self.monitor.close()

"""Experiment loggers for a training run: TensorBoard event files and Weights & Biases.

`make_loggers(("tensorboard",), output_dir, run_name, config)` returns objects with `.log(step, scalars)` and
`.close()`; the training loop calls them once per step with the numbers it writes to metrics.jsonl. Each backend
is imported only when asked for.
"""

from __future__ import annotations

import difflib
import json
import math
import os

from ..errors import ConfigError, FituneError
from ..runtime.needs import logger_need, packages_problem

KNOWN_LOGGERS = ("tensorboard", "wandb")
"""What `report_to` may name; "none" (or nothing) means no logger."""


def _numbers(scalars: dict) -> dict[str, float]:
    """The finite numbers among `scalars` (metrics.jsonl also holds flags and None on the CPU)."""
    out = {}
    for k, v in scalars.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        if math.isfinite(v):
            out[k] = float(v)
    return out


def _missing(name: str) -> str:
    """The message for a logger whose package is not installed (the one `fitune train` gives before loading)."""
    return packages_problem([logger_need(name)], [name])


class TensorBoardLogger:
    """Scalars as TensorBoard event files in `log_dir` (`tensorboard --logdir OUTPUT_DIR/tensorboard`)."""

    def __init__(self, log_dir: str, config: dict):
        try:
            # torch, wandb: optional, imported where used (estimate, plan and doctor SCRIPT never load them)
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise FituneError(f"{_missing('tensorboard')} ({exc})") from exc
        self.log_dir = log_dir
        self.writer = SummaryWriter(log_dir=log_dir, flush_secs=10)  # a live `tensorboard` sees steps within 10 s
        self.writer.add_text("config", "```\n" + json.dumps(config, indent=2, default=str) + "\n```", 0)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        for name, value in _numbers(scalars).items():
            self.writer.add_scalar(name, value, step)

    def close(self) -> None:
        self.writer.close()


class WandbLogger:
    """A Weights & Biases run; offline (files under OUTPUT_DIR/wandb, `wandb sync` later) without WANDB_API_KEY."""

    def __init__(self, output_dir: str, run_name: str, config: dict):
        try:
            import wandb
        except ImportError:
            raise FituneError(f"{_missing('wandb')} (or drop wandb from report_to)") from None
        # an explicit WANDB_MODE wins; without an API key nothing can be uploaded, so stay offline
        mode = os.environ.get("WANDB_MODE") or (None if os.environ.get("WANDB_API_KEY") else "offline")
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "fitune"), name=run_name, config=config,
                              dir=output_dir, mode=mode)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(_numbers(scalars), step=step)

    def close(self) -> None:
        self.run.finish()


def make_loggers(report_to: tuple[str, ...], output_dir: str, run_name: str, config: dict) -> list:
    """One logger per name in `report_to` (tensorboard, wandb; "none" for none).

    Args:
        report_to: logger names, e.g. ("tensorboard", "wandb").
        output_dir: the run's output folder; TensorBoard writes to OUTPUT_DIR/tensorboard, wandb to OUTPUT_DIR/wandb.
        run_name: the run's name in the logger's UI.
        config: the run's settings, recorded with the run.

    Raises:
        ConfigError: an unknown name (all of them listed, each with the closest known one).
        FituneError: a logger's package is not installed (the message names the pip command).
    """
    names = [n.strip().lower() for n in report_to if n and n.strip()]
    names = [n for n in dict.fromkeys(names) if n != "none"]
    problems = []
    for n in names:
        if n not in KNOWN_LOGGERS:
            close = difflib.get_close_matches(n, KNOWN_LOGGERS, n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            problems.append(f"report_to: {n!r} is not a known logger (known: {', '.join(KNOWN_LOGGERS)}, none){hint}")
    if problems:
        raise ConfigError(problems)
    loggers: list = []
    try:
        for n in names:
            if n == "tensorboard":
                loggers.append(TensorBoardLogger(os.path.join(output_dir, "tensorboard"), config))
            elif n == "wandb":
                os.makedirs(output_dir, exist_ok=True)
                loggers.append(WandbLogger(output_dir, run_name, config))
    except BaseException:
        for lg in loggers:  # the ones already started do not leak open files or runs
            lg.close()
        raise
    return loggers

"""Experiment loggers: TensorBoard event files read back with TensorBoard's own reader, wandb offline without a
key, clear errors for unknown names and missing packages."""

import sys
import types

import pytest

from fitune.errors import ConfigError, FituneError
from fitune.train.loggers import KNOWN_LOGGERS, make_loggers

STEPS = [(1, {"loss": 3.5, "lr": 1e-4, "tokens_per_s": 9000.5, "peak_allocated_bytes": None, "grad_checkpointing": False}),
         (2, {"loss": 3.25, "lr": 2e-4, "tokens_per_s": 9100.0, "eval_loss": 3.4}),
         (3, {"loss": 3.0, "lr": 2e-4, "tokens_per_s": 9050.0})]


def test_tensorboard_event_file_holds_the_scalars(tmp_path):
    pytest.importorskip("torch.utils.tensorboard", reason="tensorboard is not installed (make test installs it)")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (logger,) = make_loggers(("tensorboard",), str(tmp_path), "run-1", {"lr": 2e-4, "method": "lora"})
    for step, scalars in STEPS:
        logger.log(step, scalars)
    logger.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert set(events.Tags()["scalars"]) == {"loss", "lr", "tokens_per_s", "eval_loss"}  # None and flags left out
    for name in ("loss", "lr", "tokens_per_s"):
        got = [(e.step, e.value) for e in events.Scalars(name)]
        want = [(step, s[name]) for step, s in STEPS]
        assert [g[0] for g in got] == [w[0] for w in want]
        assert [g[1] for g in got] == pytest.approx([w[1] for w in want], rel=1e-6)  # stored as float32
    assert [(e.step, e.value) for e in events.Scalars("eval_loss")] == [(2, pytest.approx(3.4))]
    assert events.Tags()["tensors"] == ["config/text_summary"]  # the run's settings, as text


def test_no_logger(tmp_path):
    assert make_loggers((), str(tmp_path), "r", {}) == []
    assert make_loggers(("none",), str(tmp_path), "r", {}) == []


def test_unknown_names_are_listed_with_a_suggestion(tmp_path):
    with pytest.raises(ConfigError, match=r"'tensorbord' is not a known logger .*did you mean tensorboard\?") as e:
        make_loggers(("tensorbord", "wandbb"), str(tmp_path), "r", {})
    assert "did you mean wandb?" in str(e.value) and len(e.value.problems) == 2
    assert KNOWN_LOGGERS == ("tensorboard", "wandb")


def test_wandb_missing_names_the_pip_command(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    with pytest.raises(FituneError, match="pip install wandb"):
        make_loggers(("wandb",), str(tmp_path), "r", {})


def _fake_wandb(calls):
    class Run:
        def log(self, scalars, step):
            calls.append(("log", step, scalars))

        def finish(self):
            calls.append(("finish",))

    def init(**kw):
        calls.append(("init", kw))
        return Run()

    return types.SimpleNamespace(init=init)


def test_wandb_is_offline_without_an_api_key(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setitem(sys.modules, "wandb", _fake_wandb(calls))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    (logger,) = make_loggers(("wandb",), str(tmp_path), "run-7", {"lr": 1e-4})
    logger.log(1, STEPS[0][1])
    logger.close()
    kw = calls[0][1]
    assert kw["mode"] == "offline" and kw["name"] == "run-7" and kw["config"] == {"lr": 1e-4}
    assert kw["dir"] == str(tmp_path)
    assert calls[1] == ("log", 1, {"loss": 3.5, "lr": 1e-4, "tokens_per_s": 9000.5})
    assert calls[2] == ("finish",)
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    make_loggers(("wandb",), str(tmp_path), "run-8", {})
    assert calls[-1][1]["mode"] is None  # online: wandb's own default


def test_a_failing_logger_closes_the_ones_already_started(tmp_path, monkeypatch):
    pytest.importorskip("torch.utils.tensorboard", reason="tensorboard is not installed")
    monkeypatch.setitem(sys.modules, "wandb", None)
    closed = []
    import fitune.train.loggers as loggers

    real_close = loggers.TensorBoardLogger.close
    monkeypatch.setattr(loggers.TensorBoardLogger, "close", lambda self: (closed.append(1), real_close(self)))
    with pytest.raises(FituneError, match="pip install wandb"):
        make_loggers(("tensorboard", "wandb"), str(tmp_path), "r", {})
    assert closed == [1]

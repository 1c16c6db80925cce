"""Progress on stderr: `fitune train`'s bar (loss, eval loss, memory against the budget) and the bars of long
`plan` searches and `--data` scans (only on a terminal after a second, or forced with FITUNE_PROGRESS=1)."""

import io
import json

import pytest

from fitune.cli.main import main
from fitune.cli.progress import ENV, bar_wanted, progress_callback
from fitune.train.progress import NoBar, memory_text, postfix, progress_bar

GiB = 1024**3


# ---- the train bar's text: pure functions ----------------------------------------------------------------------


def test_cuda_memory_is_the_peak_against_the_budget_with_the_reserved_peak():
    text = memory_text(int(18.2 * GiB), int(19.04 * GiB), int(23.4 * GiB))
    assert text == "peak 18.2/23.4 GiB (reserved 19.0)"


def test_memory_without_a_budget_or_reserved_counter_says_only_what_is_known():
    assert memory_text(int(1.5 * GiB)) == "peak 1.5 GiB"
    assert memory_text(rss_peak_bytes=int(1.26 * GiB)) == "rss peak 1.3 GiB"
    assert memory_text() == ""


def test_postfix_shows_the_eval_loss_once_there_is_one():
    assert postfix(2.10344, 5123.4) == "loss 2.1034, 5123 tok/s"
    assert postfix(2.10344, 5123.4, eval_loss=2.20509, memory="peak 18.2/23.4 GiB (reserved 19.0)") == (
        "loss 2.1034, eval 2.2051, 5123 tok/s, peak 18.2/23.4 GiB (reserved 19.0)")


def test_the_cuda_bar_keeps_the_highest_peak_of_the_run():
    pytest.importorskip("tqdm")
    from fitune.train.progress import TrainBar

    bar = TrainBar(3, 0, device="cuda", budget_bytes=24 * GiB)
    bar.bar.fp = io.StringIO()  # nothing on the test's stderr
    bar.update({"loss": 2.0, "tokens_per_s": 100.0, "peak_allocated_bytes": 10 * GiB, "peak_reserved_bytes": 11 * GiB})
    bar.update({"loss": 1.5, "tokens_per_s": 100.0, "peak_allocated_bytes": 8 * GiB, "peak_reserved_bytes": 9 * GiB})
    bar.set_eval_loss(1.75)
    assert bar.text() == "loss 1.5000, eval 1.7500, 100 tok/s, peak 10.0/24.0 GiB (reserved 11.0)"
    bar.close()


def test_no_progress_draws_nothing():
    bar = progress_bar(10, 0, enabled=False)
    assert isinstance(bar, NoBar)
    bar.update({"loss": 1.0}), bar.set_eval_loss(1.0), bar.close()


# ---- when the CLI draws a bar ---------------------------------------------------------------------------------------


def test_a_bar_only_on_a_terminal_unless_forced(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setattr("sys.stderr", io.StringIO())  # not a terminal
    assert bar_wanted() == (False, 1.0)
    monkeypatch.setenv(ENV, "1")
    assert bar_wanted() == (True, 0.0)
    assert bar_wanted(enabled=False)[0] is False  # --json
    monkeypatch.setenv(ENV, "0")
    assert bar_wanted()[0] is False


def test_the_callback_counts_and_restarts_for_a_new_total(monkeypatch):
    pytest.importorskip("tqdm")
    monkeypatch.setenv(ENV, "1")
    err = io.StringIO()
    monkeypatch.setattr("sys.stderr", err)
    with progress_callback("test: working", "item") as progress:
        for i in range(6):
            progress(i, 5 if i < 5 else 2)  # a second stage of 2 items
    text = err.getvalue()
    assert "test: working" in text and "item" in text
    with progress_callback("test: json", "item", enabled=False) as progress:
        assert progress is None


def test_a_quick_answer_on_a_terminal_draws_nothing(monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.delenv(ENV, raising=False)
    err = Terminal()
    monkeypatch.setattr("sys.stderr", err)
    with progress_callback("test: quick", "item") as progress:
        for i in range(100):
            progress(i, 100)  # well within the second a bar waits for
    assert err.getvalue() == ""


def test_plan_search_reports_every_setup_it_visits():
    from fitune.plan import PlanRequest, plan
    from fitune.specs.gpu import resolve_gpu
    from fitune.specs.model import load_model_spec

    calls = []
    req = PlanRequest(model=load_model_spec("llama-3.1-8b"), gpu=resolve_gpu("rtx4090"), seq_len_tokens=1024,
                      batch_size=4)
    result = plan(req, progress=lambda done, total: calls.append((done, total)))
    totals = {t for _, t in calls}
    assert len(totals) == 1 and calls[-1] == (totals.pop(),) * 2
    assert [d for d, _ in calls] == sorted(d for d, _ in calls)  # never goes back
    assert result.plans


def test_plan_shows_its_search_on_stderr_when_forced_and_never_with_json(monkeypatch, capsys):
    pytest.importorskip("tqdm")
    monkeypatch.setenv(ENV, "1")
    args = ["plan", "llama-3.1-8b", "--gpu", "rtx4090", "--seq-len", "1024", "--batch-size", "8"]
    assert main(args) == 0
    out, err = capsys.readouterr()
    assert "plan: searching" in err and "setup" in err
    assert "plan: searching" not in out  # the answer on stdout stays clean
    assert main(args + ["--json"]) == 0
    out, err = capsys.readouterr()
    assert err == "" and json.loads(out)["fits"]


def test_records_report_how_far_a_pass_has_come():
    from fitune.data.read import Records
    from fitune.data.scan import PROGRESS_EVERY, counting

    records = Records([(i + 1, {"text": "x"}) for i in range(PROGRESS_EVERY * 2 + 5)], "data.jsonl")
    calls = []
    counted = counting(records, lambda done, total: calls.append((done, total)))
    assert counted.path == "data.jsonl" and len(counted) == len(records)
    assert list(counted) == list(records)
    n = len(records)
    assert calls == [(0, n), (PROGRESS_EVERY, n), (2 * PROGRESS_EVERY, n), (n, n)]
    assert counting(records, None) is records


# ---- end to end on the CPU, with tiny models ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    pytest.importorskip("tqdm")
    from tiny import make_chat_data, make_model_folder

    root = tmp_path_factory.mktemp("progress")
    model = make_model_folder(str(root / "model"))
    data = make_chat_data(str(root / "train.jsonl"), n=300)
    eval_data = make_chat_data(str(root / "eval.jsonl"), n=8, seed=1)
    return root, model, data, eval_data


def test_train_bar_shows_the_last_eval_loss_and_the_memory_peak(workspace, capsys):
    from fitune.config import config_from_dict
    from fitune.train.loop import train

    root, model, data, eval_data = workspace
    cfg = config_from_dict({"model": model, "data": {"path": data, "format": "chat", "eval_path": eval_data},
                            "method": "lora", "seq_len": 32, "batch_size": 4, "max_steps": 6, "eval_every": 3,
                            "output_dir": str(root / "run"), "dtype": "fp32", "seed": 3}, "test")
    result = train(cfg, progress=True)
    err = capsys.readouterr().err
    last = err.split("\r")[-1]  # the bar as it was left
    assert "6/6" in last
    assert f"eval {result.eval_losses[6]:.4f}" in last and f"loss {result.losses[-1]:.4f}" in last
    assert "rss peak" in last and "GiB" in last  # the CPU has no budget: the process's peak resident memory


def test_doctor_data_shows_its_encoding_when_forced(workspace, monkeypatch, capsys):
    root, model, data, _ = workspace
    monkeypatch.setenv(ENV, "1")
    assert main(["doctor", "--data", data, "--tokenizer", model, "--seq-len", "64"]) == 0
    out, err = capsys.readouterr()
    assert "doctor: encoding" in err and "record" in err and "300/300" in err
    assert main(["doctor", "--data", data, "--tokenizer", model, "--seq-len", "64", "--json"]) == 0
    out, err = capsys.readouterr()
    assert "doctor: encoding" not in err and json.loads(out)["records"] == 300


def test_plan_data_shows_its_encoding_when_forced(workspace, monkeypatch, capsys):
    root, model, data, _ = workspace
    monkeypatch.setenv(ENV, "1")
    assert main(["plan", model, "--gpu", "rtx4090", "--data", data]) == 0
    err = capsys.readouterr().err
    assert "plan: encoding --data" in err and "300/300" in err


def test_without_a_bar_log_every_prints_a_line_every_n_steps_and_the_last(caplog):
    """`log_every` (it was accepted and ignored: issue 34's every-key test found it): with --no-progress a line
    every N steps and at the last step, through the fitune logger."""
    import logging

    bar = progress_bar(10, 0, enabled=False, log_every=3)
    with caplog.at_level(logging.INFO, logger="fitune"):
        for step in range(1, 11):
            if step == 5:
                bar.set_eval_loss(1.5)
            bar.update({"step": step, "loss": 2.0 + step / 100, "tokens_per_s": 100.0})
    lines = [r.getMessage() for r in caplog.records if r.name == "fitune"]
    assert [line.split(":")[0] for line in lines] == ["step 3/10", "step 6/10", "step 9/10", "step 10/10"]
    assert lines[0] == "step 3/10: loss 2.0300, 100 tok/s" and "eval 1.5000" in lines[1]
    caplog.clear()
    quiet = progress_bar(10, 0, enabled=False)  # no log_every: nothing, as before
    with caplog.at_level(logging.INFO, logger="fitune"):
        quiet.update({"step": 10, "loss": 1.0, "tokens_per_s": 1.0})
    assert not caplog.records

"""`fitune train` loses nothing and runs nothing from a checkpoint: no pickle, one run per output_dir (lock, run
identity, --overwrite), retention of this run's checkpoints only, no write through a link, time-based checkpoints,
Ctrl-C pressed twice and three times, and --resume with a changed config. A tiny random Llama on the CPU."""

import json
import os
import pickle
import signal
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("yaml")

from fitune.cli.main import main  # noqa: E402
from fitune.config import config_from_dict  # noqa: E402
from fitune.train import checkpoint  # noqa: E402
from fitune.train.loop import TrainingInterrupted, train  # noqa: E402
from fitune.train.outdir import OutputDirError  # noqa: E402

from tiny import make_chat_data, make_model_folder, write_config  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("safety")
    return make_model_folder(str(root / "model")), make_chat_data(str(root / "train.jsonl"), n=48)


def _doc(workspace, out, **over) -> dict:
    model, data = workspace
    doc = {"model": model, "data": {"path": data, "format": "chat"}, "method": "lora",
           "lora": {"rank": 8, "alpha": 16, "targets": ["q_proj", "v_proj"]}, "seq_len": 32, "batch_size": 4,
           "grad_accum": 1, "max_steps": 4, "lr": 5e-3, "output_dir": str(out), "dtype": "fp32",
           "schedule": "constant", "seed": 3}
    doc.update(over)
    return doc


def _cfg(workspace, out, **over):
    return config_from_dict(_doc(workspace, out, **over), "test")


def _yaml(workspace, tmp_path, out, **over) -> str:
    return write_config(str(tmp_path / f"{os.path.basename(str(out))}.yaml"), **_doc(workspace, out, **over))


def _steps(out) -> list[dict]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if '"loss"' in line]


def _run_id(out) -> str:
    with open(os.path.join(out, "run.json")) as f:
        return json.load(f)["run_id"]


def _checkpoints(out) -> list[str]:
    return sorted(os.listdir(os.path.join(out, "checkpoints")))


# ---- no pickle ------------------------------------------------------------------------------------------------


class _Payload:
    """What an attacker adds to a checkpoint: unpickling it creates the marker file (could be any command)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_pickle_placed_in_a_checkpoint_never_runs(workspace, tmp_path, capsys, caplog):
    out, marker = tmp_path / "run", str(tmp_path / "PWNED")
    train(_cfg(workspace, out, save_every=2), progress=False)
    last = os.path.join(out, "checkpoints", "step-000004")
    payload = pickle.dumps({"python": 1, "torch": torch.zeros(1), "x": _Payload(marker)})
    pickle.loads(payload)  # the payload is live: unpickling it runs it
    assert os.path.exists(marker)
    os.remove(marker)
    for name in ("rng.pt", "optimizer.pt", "scheduler.pt"):  # the files an older fitune unpickled
        with open(os.path.join(last, name), "wb") as f:
            f.write(payload)

    # a checkpoint of this format never opens them: resume runs and the payload does not
    result = train(_cfg(workspace, out, save_every=2, max_steps=6), resume=True, progress=False)
    assert result.steps == 6 and not os.path.exists(marker)
    assert "ignoring optimizer.pt, rng.pt, scheduler.pt" in caplog.text

    # an old-format (pickle) checkpoint is refused with a message, not loaded
    old = os.path.join(out, "checkpoints", "step-000006")
    state_file = os.path.join(old, "trainer_state.json")
    state = json.load(open(state_file))
    state.pop("format")
    json.dump(state, open(state_file, "w"))
    for name in ("rng.json", "optimizer.json", "scheduler.json"):
        os.remove(os.path.join(old, name))
    with open(os.path.join(old, "rng.pt"), "wb") as f:
        f.write(payload)
    config = _yaml(workspace, tmp_path, out, save_every=2, max_steps=8)
    assert main(["train", config, "--resume", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "pickle" in err and "--overwrite" in err and "Traceback" not in err
    assert not os.path.exists(marker)


# ---- one run per output_dir ---------------------------------------------------------------------------------


def test_a_fresh_run_refuses_another_runs_folder_and_overwrite_moves_it_aside(workspace, tmp_path, capsys):
    out = tmp_path / "run"
    config = _yaml(workspace, tmp_path, out, max_steps=3)
    assert main(["train", config, "--no-progress"]) == 0
    first = _run_id(out)
    capsys.readouterr()

    assert main(["train", config, "--no-progress"]) == 2  # the same command again: never appended to the run
    err = capsys.readouterr().err
    assert f"already holds run {first}" in err and "--resume" in err and "--overwrite" in err
    assert [line["step"] for line in _steps(out)] == [1, 2, 3]

    assert main(["train", config, "--no-progress", "--overwrite"]) == 0
    aside = [d for d in os.listdir(tmp_path) if d.startswith("run.old-")]
    assert len(aside) == 1 and _run_id(tmp_path / aside[0]) == first
    assert _run_id(out) != first
    assert [line["step"] for line in _steps(out)] == [1, 2, 3]  # the new run's lines only
    assert _checkpoints(out) == ["step-000003"]

    assert main(["train", config, "--no-progress", "--resume", "--overwrite"]) == 2
    assert "give one" in capsys.readouterr().err


def test_retention_deletes_only_this_runs_checkpoints(workspace, tmp_path):
    other = tmp_path / "other"
    train(_cfg(workspace, other, max_steps=2, save_every=1, keep_checkpoints=5), progress=False)
    out = tmp_path / "run"
    train(_cfg(workspace, out, max_steps=2, save_every=1, keep_checkpoints=2), progress=False)
    # another run's checkpoints with higher step numbers land in this run's folder (copied by hand, say)
    import shutil

    for step, name in ((1, "step-000100"), (2, "step-000200")):
        shutil.copytree(os.path.join(other, "checkpoints", f"step-{step:06d}"), os.path.join(out, "checkpoints", name))

    result = train(_cfg(workspace, out, max_steps=5, save_every=1, keep_checkpoints=2), resume=True, progress=False)
    assert result.steps == 5 and [line["step"] for line in _steps(out)] == [1, 2, 3, 4, 5]  # resumed its own step 2
    assert _checkpoints(out) == ["step-000004", "step-000005", "step-000100", "step-000200"]


def test_a_second_run_is_locked_out_and_a_dead_runs_lock_is_taken_over(workspace, tmp_path, capsys):
    out = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom fitune.train.outdir import open_run\n"
                               "open_run(sys.argv[1], {})\nprint('locked', flush=True)\ntime.sleep(120)", str(out)],
        cwd=REPO, env={**os.environ, "PYTHONPATH": REPO}, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        config = _yaml(workspace, tmp_path, out, max_steps=2)
        assert main(["train", config, "--no-progress", "--overwrite"]) == 2
        err = capsys.readouterr().err
        assert f"in use by another fitune run (pid {holder.pid}" in err
    finally:
        holder.kill()  # like kill -9: its lock file stays behind, naming a dead pid
        holder.wait()
    assert str(holder.pid) in open(os.path.join(out, "fitune.lock")).read()
    assert main(["train", config, "--no-progress", "--overwrite"]) == 0
    assert f"taking over the lock of {os.path.realpath(out)} left by pid {holder.pid}" in capsys.readouterr().err
    assert not os.path.exists(os.path.join(out, "fitune.lock"))  # released at the end


@pytest.mark.parametrize("link", ["metrics.jsonl", "adapter", "checkpoints/step-000001"])
def test_a_link_out_of_output_dir_is_refused_not_followed(workspace, tmp_path, capsys, link):
    out = tmp_path / "run"
    train(_cfg(workspace, out, max_steps=2, save_every=1, keep_checkpoints=1), progress=False)
    outside = tmp_path / "outside"
    outside.mkdir()
    victim = outside / "precious.txt"
    victim.write_text("keep me\n")
    target = victim if link == "metrics.jsonl" else outside
    planted = os.path.join(out, link)
    if os.path.isdir(planted):
        import shutil

        shutil.rmtree(planted)
    elif os.path.exists(planted):
        os.remove(planted)
    os.symlink(target, planted)

    config = _yaml(workspace, tmp_path, out, max_steps=4, save_every=1, keep_checkpoints=1)
    assert main(["train", config, "--resume", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "is a symbolic link" in err and "Traceback" not in err
    assert sorted(os.listdir(outside)) == ["precious.txt"] and victim.read_text() == "keep me\n"
    with pytest.raises(OutputDirError, match="symbolic link"):
        from fitune.train.outdir import RunFolder

        RunFolder(os.path.realpath(out), "x").inside(*link.split("/"))


# ---- checkpoints on a clock ---------------------------------------------------------------------------------


def test_checkpoints_are_written_on_a_clock_and_at_the_end(workspace, tmp_path):
    timed = tmp_path / "timed"
    train(_cfg(workspace, timed, max_steps=3, save_every_minutes=1e-6, keep_checkpoints=5), progress=False)
    assert _checkpoints(timed) == ["step-000001", "step-000002", "step-000003"]
    default = tmp_path / "default"  # save_every unset, 30 minutes not reached: still the end-of-run checkpoint
    train(_cfg(workspace, default, max_steps=3), progress=False)
    assert _checkpoints(default) == ["step-000003"]


# ---- Ctrl-C -------------------------------------------------------------------------------------------------


def _ctrl_c_at_step_5(step, micro):
    if step == 4 and micro == 0:  # the first Ctrl-C, during the 5th step
        os.kill(os.getpid(), signal.SIGINT)


@pytest.fixture(scope="module")
def reference_losses(workspace, tmp_path_factory):
    out = tmp_path_factory.mktemp("ref") / "run"
    train(_cfg(workspace, out, max_steps=8, save_every=3), progress=False)
    return [line["loss"] for line in _steps(out)]


def test_a_second_ctrl_c_waits_for_the_checkpoint_in_flight(workspace, tmp_path, monkeypatch, capsys, reference_losses):
    def second_press(tmp):
        if tmp.endswith("step-000005.tmp"):  # the interrupt checkpoint is being written
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(checkpoint, "_before_publish", second_press)
    out = tmp_path / "run"
    with pytest.raises(TrainingInterrupted, match="interrupted at step 5"):
        train(_cfg(workspace, out, max_steps=8, save_every=3), fault=_ctrl_c_at_step_5, progress=False)
    err = capsys.readouterr().err
    assert "finishing the checkpoint of step 5 being written first" in err
    assert _checkpoints(out) == ["step-000003", "step-000005"]
    monkeypatch.undo()
    train(_cfg(workspace, out, max_steps=8, save_every=3), resume=True, progress=False)
    assert [line["loss"] for line in _steps(out)] == pytest.approx(reference_losses, rel=1e-6, abs=1e-7)


def test_a_third_ctrl_c_aborts_and_the_last_complete_checkpoint_stays(workspace, tmp_path, monkeypatch, capsys,
                                                                      reference_losses):
    def two_more_presses(tmp):
        if tmp.endswith("step-000005.tmp"):
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(checkpoint, "_before_publish", two_more_presses)
    out = tmp_path / "run"
    with pytest.raises(TrainingInterrupted, match="aborted at step 5; resume from .*step-000003"):
        train(_cfg(workspace, out, max_steps=8, save_every=3), fault=_ctrl_c_at_step_5, progress=False)
    assert "aborting (the last complete checkpoint" in capsys.readouterr().err
    assert _checkpoints(out) == ["step-000003", "step-000005.tmp"]  # the cut write stays a .tmp, never resumed
    monkeypatch.undo()
    train(_cfg(workspace, out, max_steps=8, save_every=3), resume=True, progress=False)
    assert "step-000005.tmp" not in _checkpoints(out)
    losses = [line["loss"] for line in _steps(out)]  # steps 4-5 of the aborted run were dropped, trained again
    assert losses == pytest.approx(reference_losses, rel=1e-6, abs=1e-7)


# ---- --resume with a changed config -------------------------------------------------------------------------


def test_resume_applies_a_changed_lr_and_says_so(workspace, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", _yaml(workspace, tmp_path, out, max_steps=3), "--no-progress"]) == 0
    config = _yaml(workspace, tmp_path, out, max_steps=5, lr=1e-3)
    assert main(["train", config, "--resume", "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "--resume: lr changed from 0.005 to 0.001 since the checkpoint; applied" in err
    assert "--resume: max_steps changed from 3 to 5 since the checkpoint; applied" in err
    assert [line["lr"] for line in _steps(out)] == pytest.approx([5e-3] * 3 + [1e-3] * 2)  # the schedule uses it
    saved = checkpoint.read_state(os.path.join(out, "checkpoints", "step-000005"))["config"]
    assert saved["lr"] == 1e-3


def test_resume_refuses_changes_it_cannot_apply_by_name(workspace, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", _yaml(workspace, tmp_path, out, max_steps=2), "--no-progress"]) == 0
    capsys.readouterr()
    config = _yaml(workspace, tmp_path, out, max_steps=4, batch_size=2,
                   lora={"rank": 16, "alpha": 16, "targets": ["q_proj", "v_proj"]})
    assert main(["train", config, "--resume", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert ("--resume: lora.rank changed from 8 to 16 since the checkpoint; a resumed run keeps the saved value: "
            "start a new run with --overwrite, or restore lora.rank: 8") in err
    assert "batch_size changed from 4 to 2" in err and "Traceback" not in err
    assert [line["step"] for line in _steps(out)] == [1, 2]


def test_a_resumed_run_drops_the_metrics_lines_it_trains_again(tmp_path):
    from fitune.train.outdir import open_run

    folder = open_run(str(tmp_path / "run"), {})
    try:
        with open(os.path.join(folder.root, "metrics.jsonl"), "w") as f:  # killed while writing step 4's line
            f.write('{"step": 1, "loss": 3}\n{"step": 2, "loss": 2}\n{"step": 2, "eval_loss": 2}\n'
                    '{"step": 3, "loss": 1}\n{"step": 4, "lo')
        with folder.open_metrics(through_step=2) as metrics:  # the newest checkpoint is of step 2
            metrics.write('{"step": 3, "loss": 1}\n')
    finally:
        folder.close()
    assert [json.loads(line)["step"] for line in open(os.path.join(folder.root, "metrics.jsonl"))] == [1, 2, 2, 3]


def test_a_fresh_run_that_fails_before_its_first_step_can_simply_be_started_again(workspace, tmp_path, capsys):
    """Bad data is found after the run took its folder: the folder keeps nothing of it (no run.json), so the
    same command works once the data is fixed, without --overwrite."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": "not a list of turns"}\n' * 3, encoding="utf-8")
    out = tmp_path / "out"
    yaml_path = _yaml(workspace, tmp_path, out, data={"path": str(bad), "format": "chat"})
    assert main(["train", yaml_path, "--no-progress"]) == 2
    assert not os.path.exists(out / "run.json")
    yaml_path = _yaml(workspace, tmp_path, out, max_steps=1)
    assert main(["train", yaml_path, "--no-progress"]) == 0
    assert [s["step"] for s in _steps(out)] == [1]

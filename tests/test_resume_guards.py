"""`--resume` verifies, never trusts (issue 35, part C): a manifest of each checkpoint's files (links, FIFOs,
swapped or edited files refused, the newest sound checkpoint taken, said), crafted JSON refused by file and key,
base weights and data hashed into the run's identity, a lock that survives deleting fitune.lock, and a crash's
leftover run.json.tmp that blocks neither a fresh start nor a resume. A tiny random Llama on the CPU."""

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("yaml")

from fitune.cli.main import main  # noqa: E402
from fitune.train import checkpoint, identity  # noqa: E402

from tiny import make_chat_data, make_model_folder, write_config  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("guards")
    return make_model_folder(str(root / "model")), make_chat_data(str(root / "train.jsonl"), n=48)


def _yaml(workspace, tmp_path, out, **over) -> str:
    model, data = workspace
    doc = {"model": model, "data": {"path": data, "format": "chat"}, "method": "lora",
           "lora": {"rank": 8, "alpha": 16, "targets": ["q_proj", "v_proj"]}, "seq_len": 32, "batch_size": 4,
           "grad_accum": 1, "max_steps": 4, "lr": 5e-3, "output_dir": str(out), "dtype": "fp32",
           "schedule": "constant", "seed": 3, "save_every": 2, "keep_checkpoints": 3}
    doc.update(over)
    return write_config(str(tmp_path / f"{os.path.basename(str(out))}.yaml"), **doc)


def _step(out, n: int) -> str:
    return os.path.join(out, "checkpoints", f"step-{n:06d}")


@pytest.fixture
def finished_run(workspace, tmp_path, capsys):
    """A finished 4-step run with checkpoints at steps 2 and 4, and the config that resumes it to step 6."""
    out = str(tmp_path / "run")
    assert main(["train", _yaml(workspace, tmp_path, out), "--no-progress"]) == 0
    capsys.readouterr()
    return out, _yaml(workspace, tmp_path, out, max_steps=6)


# ---- 1. the manifest ------------------------------------------------------------------------------------------


def test_each_checkpoint_has_a_manifest_of_its_files(finished_run):
    out, _ = finished_run
    path = _step(out, 4)
    manifest = json.load(open(os.path.join(path, "manifest.json")))["files"]
    assert sorted(manifest) == sorted(f for f in os.listdir(path) if f != "manifest.json")
    state = manifest["trainer_state.json"]
    assert state["size_bytes"] == os.path.getsize(os.path.join(path, "trainer_state.json"))
    assert state["sha256"] == checkpoint._sha256_of(os.path.join(path, "trainer_state.json"))
    assert checkpoint.verify(path) is None


def test_a_file_swapped_for_a_link_to_another_steps_file_falls_back_to_the_older_checkpoint(finished_run, capsys):
    out, config = finished_run
    weights = os.path.join(_step(out, 4), "trainable.safetensors")
    os.remove(weights)
    os.symlink(os.path.join(_step(out, 2), "trainable.safetensors"), weights)  # the swap: wrong weights
    assert main(["train", config, "--resume", "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert ("checkpoint step-000004 is damaged (trainable.safetensors: a symbolic link); resuming from step-000002"
            in err)
    steps = [json.loads(line)["step"] for line in open(os.path.join(out, "metrics.jsonl")) if '"loss"' in line]
    assert steps == [1, 2, 3, 4, 5, 6]  # steps 3 and 4 trained again from step 2


def test_a_file_whose_content_changed_is_named_and_none_sound_exits_2(finished_run, capsys):
    out, config = finished_run
    for n in (2, 4):
        with open(os.path.join(_step(out, n), "scheduler.json"), "r+b") as f:
            f.write(b"[")  # same size, other bytes
    assert main(["train", config, "--resume", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "checkpoint step-000004 is damaged (scheduler.json: its SHA-256 differs" in err
    assert "checkpoint step-000002 is damaged (scheduler.json: its SHA-256 differs" in err
    assert "Traceback" not in err and err.count("error:") == 1


def test_a_step_trained_again_replaces_its_damaged_checkpoint(finished_run, capsys):
    out, config = finished_run
    with open(os.path.join(_step(out, 4), "scheduler.json"), "a") as f:
        f.write(" ")  # damaged (size and hash), run id and step intact
    assert main(["train", config, "--resume", "--no-progress"]) == 0
    assert "checkpoint step-000004 is damaged (scheduler.json: " in capsys.readouterr().err
    assert checkpoint.verify(_step(out, 4)) is None  # written again, not kept as it was
    assert os.path.isdir(_step(out, 4) + ".damaged")  # the damaged one moved aside, not deleted
    assert [n for n, _ in checkpoint.list_checkpoints(out)] == [2, 4, 6]  # and never taken for a checkpoint


def test_a_checkpoint_without_a_manifest_is_accepted_with_a_note(finished_run, capsys, caplog):
    out, config = finished_run
    os.remove(os.path.join(_step(out, 4), "manifest.json"))  # as an earlier fitune wrote it
    assert main(["train", config, "--resume", "--no-progress"]) == 0
    assert "has no manifest.json (written by an earlier fitune): its files are not verified" in caplog.text
    assert "damaged" not in capsys.readouterr().err


# ---- 2. reads that cannot hang, JSON that cannot crash --------------------------------------------------------


def test_a_fifo_as_trainer_state_is_refused_promptly(finished_run, capsys):
    out, config = finished_run
    state = os.path.join(_step(out, 4), "trainer_state.json")
    os.remove(state)
    os.mkfifo(state)  # an open() for reading would wait for a writer forever
    assert main(["train", config, "--resume", "--no-progress"]) == 0
    assert ("checkpoint step-000004 is damaged (trainer_state.json: not a regular file); resuming from step-000002"
            in capsys.readouterr().err)


def test_dev_zero_linked_as_trainer_state_is_refused(finished_run, capsys):
    out, config = finished_run
    for n in (2, 4):
        state = os.path.join(_step(out, n), "trainer_state.json")
        os.remove(state)
        os.symlink("/dev/zero", state)  # a read that never ends
    assert main(["train", config, "--resume", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "step-000004 is damaged (trainer_state.json: a symbolic link)" in err and "Traceback" not in err


@pytest.mark.parametrize("make", ["fifo", "dev_zero"])
def test_a_fifo_or_dev_zero_as_metrics_jsonl_is_refused(finished_run, capsys, make):
    out, config = finished_run
    metrics = os.path.join(out, "metrics.jsonl")
    os.remove(metrics)
    os.mkfifo(metrics) if make == "fifo" else os.symlink("/dev/zero", metrics)
    assert main(["train", config, "--resume", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "metrics.jsonl" in err and "Traceback" not in err
    assert ("not a regular file" if make == "fifo" else "is a symbolic link") in err


@pytest.mark.parametrize("edit, key", [
    (lambda s: s.pop("data"), "'data'"),
    (lambda s: s.update(step="4"), "'step'"),
    (lambda s: s.update(step=10**400), "'step'"),
    (lambda s: s.update(plan_changes=[{"micro_batch_size": "x"}]), "'plan_changes[0]'"),
    (lambda s: s.update(config=[1]), "'config'"),
])
def test_crafted_trainer_state_json_names_the_file_and_the_key(finished_run, capsys, edit, key):
    out, config = finished_run
    for n in (2, 4):  # crafted in both checkpoints, manifest updated: nothing sound to fall back on
        path = _step(out, n)
        state = json.load(open(os.path.join(path, "trainer_state.json")))
        edit(state)
        json.dump(state, open(os.path.join(path, "trainer_state.json"), "w"))
        json.dump(checkpoint._manifest_of(path), open(os.path.join(path, "manifest.json"), "w"))
    assert main(["train", config, "--resume", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"step-000004/trainer_state.json: key {key}" in err and "Traceback" not in err


# ---- 3. the run's identity: base weights and data ------------------------------------------------------------


def test_run_json_records_hashes_of_the_weights_and_the_data(finished_run, workspace):
    out, _ = finished_run
    recorded = json.load(open(os.path.join(out, "run.json")))["identity"]
    model, data = workspace
    assert recorded == identity.fingerprint(model, data)
    assert recorded["base_weights"]["model.safetensors"].startswith("sha256:")
    assert recorded["data"] == {"train.jsonl": identity.file_digest(data)}


def _copy_workspace(workspace, tmp_path):
    model, data = workspace
    shutil.copytree(model, tmp_path / "model")
    shutil.copy(data, tmp_path / "train.jsonl")
    return str(tmp_path / "model"), str(tmp_path / "train.jsonl")


def test_replaced_base_weights_refuse_a_resume_by_name(workspace, tmp_path, capsys):
    mine = _copy_workspace(workspace, tmp_path)
    out = str(tmp_path / "run")
    assert main(["train", _yaml(mine, tmp_path, out), "--no-progress"]) == 0
    make_model_folder(mine[0], seed=1)  # same names, same sizes, other weights
    config = _yaml(mine, tmp_path, out, max_steps=6)
    assert main(["train", config, "--resume", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert ("the base model's weights changed since the run started (model.safetensors); resume with "
            "--allow-changed to continue anyway") in err and "Traceback" not in err


def test_data_edited_keeping_token_counts_refuses_a_resume_by_name(workspace, tmp_path, capsys):
    mine = _copy_workspace(workspace, tmp_path)
    out = str(tmp_path / "run")
    assert main(["train", _yaml(mine, tmp_path, out), "--no-progress"]) == 0
    text = open(mine[1]).read()
    swapped = text.replace("blue", "\0").replace("red", "blue").replace("\0", "red")  # a word for a word: each
    assert swapped != text and len(swapped.split()) == len(text.split())  # record keeps its (word-level) token count
    open(mine[1], "w").write(swapped)
    config = _yaml(mine, tmp_path, out, max_steps=6)
    assert main(["train", config, "--resume", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "the training data changed since the run started (train.jsonl)" in err and "Traceback" not in err


def test_allow_changed_resumes_on_replaced_weights_and_says_so(workspace, tmp_path, capsys):
    mine = _copy_workspace(workspace, tmp_path)
    out = str(tmp_path / "run")
    assert main(["train", _yaml(mine, tmp_path, out), "--no-progress"]) == 0
    make_model_folder(mine[0], seed=1)
    config = _yaml(mine, tmp_path, out, max_steps=6)
    import yaml

    from fitune.config import config_from_dict
    from fitune.train.loop import train

    cfg = config_from_dict(yaml.safe_load(open(config)), "test")
    result = train(cfg, resume=True, progress=False, allow_changed=True)
    assert result.steps == 6
    assert ("--allow-changed: the base model's weights changed since the run started (model.safetensors); "
            "continuing anyway" in capsys.readouterr().err)


# ---- 4. the lock survives deleting fitune.lock ----------------------------------------------------------------


def test_deleting_fitune_lock_mid_run_does_not_let_a_second_run_in(workspace, tmp_path, capsys):
    out = str(tmp_path / "run")
    config = _yaml(workspace, tmp_path, out, max_steps=100000, save_every=100000)
    first = subprocess.Popen([sys.executable, "-m", "fitune", "train", config, "--no-progress"], cwd=REPO,
                             env={**os.environ, "PYTHONPATH": REPO}, stdout=subprocess.DEVNULL,
                             stderr=open(tmp_path / "first.log", "w"))
    try:
        metrics = os.path.join(out, "metrics.jsonl")
        for _ in range(1200):  # until it trains (its first metrics line)
            if first.poll() is not None or (os.path.exists(metrics) and os.path.getsize(metrics) > 0):
                break
            time.sleep(0.1)
        assert first.poll() is None, open(tmp_path / "first.log").read()[-2000:]
        os.remove(os.path.join(out, "fitune.lock"))  # the deletion mid-run
        assert main(["train", config, "--resume", "--lr", "0.001", "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert f"is in use by another fitune run (pid {first.pid}" in err
        assert first.poll() is None  # still the only run in the folder
    finally:
        first.kill()
        first.wait()


# ---- 5. a crash's leftover run.json.tmp -----------------------------------------------------------------------


@pytest.mark.parametrize("with_lock", [False, True])
def test_a_leftover_run_json_tmp_blocks_neither_a_fresh_start_nor_a_resume(workspace, tmp_path, capsys, with_lock):
    out = tmp_path / "run"
    out.mkdir()
    (out / "run.json.tmp").write_text('{"run_id": "2026')  # the crash cut the first write of run.json short
    if with_lock:
        (out / "fitune.lock").write_text('{"pid": 999999999}\n')
    config = _yaml(workspace, tmp_path, out)
    assert main(["train", config, "--resume", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "holds no run to continue; start without --resume" in err and "Traceback" not in err
    assert main(["train", config, "--no-progress"]) == 0  # the fresh start the message asked for
    assert not (out / "run.json.tmp").exists() and (out / "run.json").exists()


def test_allow_changed_is_a_train_flag(tmp_path, monkeypatch):
    """`fitune train --allow-changed` reaches train(..., allow_changed=True) (the library side is tested above)."""
    import fitune.train.loop as loop
    from fitune.cli.main import main
    from tiny import make_chat_data, make_model_folder

    seen = {}

    def fake_train(cfg, **kwargs):
        seen.update(kwargs)
        raise KeyboardInterrupt  # stops the command right there (exit 130)

    monkeypatch.setattr(loop, "train", fake_train)
    folder = make_model_folder(str(tmp_path / "model"))
    data = make_chat_data(str(tmp_path / "train.jsonl"), n=4)
    config = tmp_path / "run.yaml"
    config.write_text(f"model: {folder}\ndata:\n  path: {data}\nmax_steps: 1\noutput_dir: {tmp_path / 'out'}\n")
    main(["train", str(config), "--allow-changed", "--no-progress"])
    assert seen.get("allow_changed") is True


def test_allow_changed_reaches_every_rank_of_a_multi_gpu_launch(tmp_path, monkeypatch):
    """`fitune train --gpus 2 --resume --allow-changed`: the torchrun command each rank runs carries the flag (each
    rank checks the identity), and the CLI hands it to launch()."""
    import fitune.parallel.launch as launch_mod
    from fitune.parallel.launch import command

    cmd = command("/tmp/c.yaml", 2, resume=True, overwrite=False, progress=False, allow_changed=True)
    assert cmd[5:] == ["-m", "fitune", "train", "/tmp/c.yaml", "--resume", "--allow-changed", "--no-progress"]
    assert "--allow-changed" not in command("/tmp/c.yaml", 2, resume=True, overwrite=False, progress=False)

    seen = {}

    def fake_launch(cfg, **kwargs):
        seen.update(kwargs)
        return 0

    monkeypatch.setattr(launch_mod, "launch", fake_launch)
    monkeypatch.setenv("FITUNE_CPU_RANKS", "1")  # two gloo ranks on the CPU: the launch path without GPUs
    folder = make_model_folder(str(tmp_path / "model"))
    data = make_chat_data(str(tmp_path / "train.jsonl"), n=4)
    config = tmp_path / "run.yaml"
    config.write_text(f"model: {folder}\ndata:\n  path: {data}\nmax_steps: 1\ngpus: 2\n"
                      f"output_dir: {tmp_path / 'out'}\n")
    assert main(["train", str(config), "--resume", "--allow-changed", "--no-progress"]) == 0
    assert seen.get("allow_changed") is True and seen.get("resume") is True


def _hub_snapshot(cache, kind: str, repo_id: str, commit: str, files: dict[str, bytes]) -> str:
    """A Hub cache entry as huggingface_hub writes it: refs/main -> commit, snapshot files linked to blobs."""
    import hashlib

    repo = cache / f"{kind}--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for name, content in files.items():
        blob = repo / "blobs" / hashlib.sha256(content).hexdigest()
        blob.write_bytes(content)
        (snapshot / name).symlink_to(os.path.relpath(blob, snapshot))
    return str(snapshot)


def test_a_hub_model_and_data_set_are_identified_by_revision_and_blob(tmp_path, monkeypatch):
    """A Hub id is no longer left out of the identity: a new revision of the model pulled into the cache, or a
    different data set snapshot, is a change named on resume; the weights are not read (blob names)."""
    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    _hub_snapshot(cache, "models", "acme/tiny", "a" * 40, {"config.json": b"{}", "model.safetensors": b"w1"})
    _hub_snapshot(cache, "datasets", "acme/chat", "c" * 40, {"train.jsonl": b'{"text": "hi"}\n'})
    first = identity.fingerprint("acme/tiny", "acme/chat")
    import hashlib

    assert first["base_weights"] == {"model.safetensors": "blob:" + hashlib.sha256(b"w1").hexdigest(),
                                     "@revision": "a" * 40}
    assert first["data"]["@revision"] == "c" * 40 and first["data"]["train.jsonl"].startswith("blob:")
    assert identity.changes(first, identity.fingerprint("acme/tiny", "acme/chat")) == []

    _hub_snapshot(cache, "models", "acme/tiny", "b" * 40, {"config.json": b"{}", "model.safetensors": b"w2"})
    found = identity.changes(first, identity.fingerprint("acme/tiny", "acme/chat"))
    assert found == ["the base model's weights changed since the run started (@revision, model.safetensors)"]
    with pytest.raises(identity.ConfigError, match="--allow-changed"):
        identity.check(first, identity.fingerprint("acme/tiny", "acme/chat"), allow_changed=False)


def test_a_hub_model_downloaded_after_the_start_is_not_called_changed(tmp_path, monkeypatch):
    """Not in the cache when the run started (downloaded at load): recorded as such, and not compared on resume."""
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    before = identity.fingerprint("acme/tiny", "")
    assert before["base_weights"] == {"@revision": identity.NOT_CACHED}
    _hub_snapshot(cache, "models", "acme/tiny", "a" * 40, {"model.safetensors": b"w1"})
    assert identity.changes(before, identity.fingerprint("acme/tiny", "")) == []

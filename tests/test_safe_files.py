"""Issue 35, part A: no write follows a link or replaces a non-regular file, no read waits forever, and a report
given numbers that are not numbers gets one message (exit 2), never a traceback.

Commands that could hang (a FIFO, an endless device) run as real processes with a timeout, so a regression fails
the test instead of blocking the suite."""

from __future__ import annotations

import errno
import json
import os
import stat
import subprocess
import sys

import pytest

from fitune.cli.main import main
from fitune.files import (UnsafeFileError, atomic_folder, atomic_writer, open_output_stream, open_regular,
                          write_keeping_previous, write_text_atomic)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
POSIX = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes and /dev are POSIX")
PLAN = ["plan", "llama-3.1-8b", "--gpu", "rtx4090"]


def _fitune(args: list[str], cwd: str, timeout_s: float = 60) -> subprocess.CompletedProcess:
    """A real `fitune` process: a hang raises TimeoutExpired (the test fails) instead of blocking the suite."""
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "fitune", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=timeout_s, env=env, stdin=subprocess.DEVNULL)


def _refused(proc: subprocess.CompletedProcess, *words: str) -> str:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("fitune ")]
    assert len(lines) == 1, proc.stderr  # one message
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]


@pytest.fixture(scope="module")
def estimate_json(tmp_path_factory) -> str:
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["estimate", "llama-3.1-8b", "--gpu", "rtx4090", "--json"]) == 0
    path = tmp_path_factory.mktemp("est") / "est.json"
    path.write_text(buf.getvalue())
    return str(path)


def _victim(tmp_path) -> tuple[str, dict]:
    """A file outside the folder written to, and its state (contents, mtime) to compare after."""
    outside = tmp_path / "outside"
    outside.mkdir()
    victim = outside / "precious.txt"
    victim.write_text("keep me\n")
    return str(victim), {"text": "keep me\n", "mtime": victim.stat().st_mtime_ns}


def _unchanged(victim: str, before: dict) -> bool:
    return open(victim).read() == before["text"] and os.stat(victim).st_mtime_ns == before["mtime"]


# ---- temporary names: never predictable, never followed -------------------------------------------------------


def test_links_planted_at_the_old_temp_names_are_not_followed(tmp_path, monkeypatch, capsys, estimate_json):
    """The old writers used NAME.tmp<pid> (report, plan) and .NAME.tmp<pid> (export): links planted at both, for
    the pid the process has, are left alone and the page is written."""
    victim, before = _victim(tmp_path)
    monkeypatch.setattr(os, "getpid", lambda: 4242)
    out = tmp_path / "page.html"
    for name in ("page.html.tmp4242", ".page.html.tmp4242"):
        os.symlink(victim, tmp_path / name)
    assert main(["report", "estimate", estimate_json, "-o", str(out)]) == 0
    assert _unchanged(victim, before)
    assert out.read_text().startswith("<!DOCTYPE html>") and not out.is_symlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".page.html.tmp4242", "outside", "page.html",
                                                          "page.html.tmp4242"]


def test_the_temp_file_is_created_with_o_excl_under_an_unpredictable_name(tmp_path, monkeypatch):
    """Every file the writer creates is opened with O_CREAT | O_EXCL | O_NOFOLLOW, under a new random name each
    time; a link planted at the name it draws first makes it draw another, never write through the link."""
    import tempfile

    victim, before = _victim(tmp_path)
    opened = []
    real_open = os.open

    def spy(path, flags, *rest, **kw):
        opened.append((os.fspath(path), flags))
        return real_open(path, flags, *rest, **kw)

    monkeypatch.setattr(os, "open", spy)
    target = str(tmp_path / "page.html")
    write_text_atomic(target, "one")
    write_text_atomic(target, "two")
    created = [(p, f) for p, f in opened if f & os.O_CREAT]
    assert len(created) == 2 and created[0][0] != created[1][0]
    for path, flags in created:
        assert flags & os.O_EXCL and flags & os.O_NOFOLLOW, path
        assert os.path.dirname(path) == str(tmp_path) and os.path.basename(path).startswith(".page.html.")
    # a link waiting at the first name drawn: O_EXCL fails on it, the next name is used
    names = iter(["planted1", "fresh0001"])
    monkeypatch.setattr(tempfile, "_get_candidate_names", lambda: names)
    os.symlink(victim, tmp_path / ".page.html.planted1.tmp")
    write_text_atomic(target, "three")
    assert open(target).read() == "three" and _unchanged(victim, before)
    assert os.readlink(tmp_path / ".page.html.planted1.tmp") == victim


def test_a_target_that_becomes_a_link_during_the_write_is_refused(tmp_path):
    victim, before = _victim(tmp_path)
    target = tmp_path / "page.html"
    target.write_text("old")
    with pytest.raises(UnsafeFileError, match=r"page.html is a symbolic link \(to .*precious.txt\), not a regular "):
        with atomic_writer(str(target), what="--html") as f:
            f.write(b"new")
            target.unlink()
            os.symlink(victim, target)
    assert _unchanged(victim, before) and os.readlink(target) == victim
    assert sorted(p.name for p in tmp_path.iterdir()) == ["outside", "page.html"]  # no temporary file left


def test_the_written_file_keeps_the_mode_of_the_one_it_replaces(tmp_path):
    target = tmp_path / "plan.yaml"
    target.write_text("old")
    os.chmod(target, 0o640)
    write_text_atomic(str(target), "new")
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o640
    fresh = tmp_path / "fresh.html"
    old_umask = os.umask(0o022)
    try:
        write_text_atomic(str(fresh), "x")
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE(os.stat(fresh).st_mode) == 0o644  # as open(path, "w") would make it, not mkstemp's 0600


# ---- devices, FIFOs, links as the target ----------------------------------------------------------------------


@POSIX
@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_html_onto_dev_full_is_refused_and_the_device_stays(tmp_path):
    proc = _fitune(["estimate", "llama-3.1-8b", "--gpu", "rtx4090", "--html", "/dev/full"], str(tmp_path))
    _refused(proc, "--html /dev/full is a character device, not a regular file")
    assert stat.S_ISCHR(os.stat("/dev/full").st_mode)


@POSIX
@pytest.mark.parametrize("argv", [["estimate", "llama-3.1-8b", "--gpu", "rtx4090", "--html", "FIFO"],
                                  ["report", "estimate", "EST", "-o", "FIFO"],
                                  PLAN + ["--write", "FIFO"],
                                  PLAN + ["--html", "FIFO"]],
                         ids=["estimate--html", "report-o", "plan--write", "plan--html"])
def test_writing_onto_a_fifo_returns_at_once_with_exit_2(tmp_path, estimate_json, argv):
    fifo = str(tmp_path / "out.html")
    os.mkfifo(fifo)
    argv = [fifo if a == "FIFO" else estimate_json if a == "EST" else a for a in argv]
    flag = argv[argv.index(fifo) - 1]
    _refused(_fitune(argv, str(tmp_path)), f"{flag} {fifo} is a named pipe (FIFO), not a regular file")
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)  # not replaced by a regular file


@pytest.mark.parametrize("flag", ["--write", "--html"])
def test_plan_onto_a_symlink_is_refused_and_its_target_untouched(tmp_path, capsys, flag):
    victim, before = _victim(tmp_path)
    link = tmp_path / "plan.yaml"
    os.symlink(victim, link)
    assert main(PLAN + [flag, str(link)]) == 2
    err = capsys.readouterr().err
    assert f"{flag} {link} is a symbolic link (to {victim}), not a regular file: fitune never writes through a " \
           "link" in err and "Traceback" not in err
    assert _unchanged(victim, before) and os.readlink(link) == victim


def test_export_force_onto_a_symlink_is_refused(tmp_path, capsys):
    victim, before = _victim(tmp_path)
    link = tmp_path / "model.gguf"
    os.symlink(victim, link)
    assert main(["export", str(tmp_path), "--gguf", "f16", "--out", str(link), "--force"]) == 2
    assert f"--out {link} is a symbolic link" in capsys.readouterr().err
    assert _unchanged(victim, before)


@POSIX
def test_generate_out_onto_a_fifo_or_a_link_planted_after_the_check(tmp_path, capsys):
    fifo = str(tmp_path / "out.jsonl")
    os.mkfifo(fifo)
    assert main(["generate", str(tmp_path), "--prompt", "hi", "--out", fifo]) == 2  # before any model is loaded
    assert f"--out {fifo} is a named pipe (FIFO)" in capsys.readouterr().err
    victim, before = _victim(tmp_path)
    link = tmp_path / "late.jsonl"
    os.symlink(victim, link)
    with pytest.raises(UnsafeFileError, match="is a symbolic link"):
        open_output_stream(str(link))
    assert _unchanged(victim, before)


# ---- merge's output folder --------------------------------------------------------------------------------------


def test_merge_out_as_a_link_to_an_empty_folder_is_refused(tmp_path, capsys):
    empty = tmp_path / "elsewhere"
    empty.mkdir()
    link = tmp_path / "merged"
    os.symlink(empty, link)
    assert main(["merge", str(tmp_path), "--out", str(link)]) == 2
    assert f"--out {link} is a symbolic link (to {empty}), not a folder" in capsys.readouterr().err
    assert os.listdir(empty) == []


def test_a_folder_written_whole_is_refused_onto_a_link_planted_meanwhile(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = tmp_path / "merged"
    with pytest.raises(UnsafeFileError, match="is a symbolic link"):
        with atomic_folder(str(out)) as tmp:
            assert os.path.dirname(tmp) == str(tmp_path) and os.path.basename(tmp).startswith(".merged.")
            (tmp_path / "merged").symlink_to(elsewhere)
            open(os.path.join(tmp, "config.json"), "w").write("{}")
    assert os.listdir(elsewhere) == [] and sorted(os.listdir(tmp_path)) == ["elsewhere", "merged"]
    with atomic_folder(str(tmp_path / "fresh")) as tmp:
        open(os.path.join(tmp, "config.json"), "w").write("{}")
    assert os.listdir(tmp_path / "fresh") == ["config.json"]


# ---- a report that would overwrite its own input ----------------------------------------------------------------


@pytest.mark.parametrize("output", [None, "page.html", "./sub/../page.html", "link.html"],
                         ids=["default", "same-name", "other-path", "link-to-it"])
def test_a_report_never_overwrites_its_own_input(tmp_path, capsys, estimate_json, output, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sub").mkdir()
    page = tmp_path / "page.html"
    page.write_text(open(estimate_json).read())  # the estimate's JSON, saved under an .html name
    os.link(page, tmp_path / "link.html")  # a hard link: the same file under another name
    argv = ["report", "estimate", "page.html"] + (["-o", output] if output else [])
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "is INPUT page.html itself: the page would overwrite what it is made from" in err
    assert page.read_text() == open(estimate_json).read()


# ---- plan --write: a full disk, the .bak ------------------------------------------------------------------------


def test_plan_write_on_a_full_disk_keeps_the_old_plan_and_leaves_nothing(tmp_path, capsys, monkeypatch):
    plan = tmp_path / "plan.yaml"
    plan.write_text("# hand-edited\nmodel: mine\n")
    real_write = os.write

    def full(fd, data):
        if fd > 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", full)
    assert main(PLAN + ["--write", str(plan)]) == 2
    err = capsys.readouterr().err
    assert f"fitune plan: error: --write {plan}: could not write it (No space left on device); it was left as it " \
           "was, no temporary file remains: free some space" in err and "Traceback" not in err
    assert plan.read_text() == "# hand-edited\nmodel: mine\n"
    assert os.listdir(tmp_path) == ["plan.yaml"]  # no .bak, no temporary file


def test_plan_write_keeps_the_old_file_under_its_name_until_the_new_one_is_complete(tmp_path, capsys, monkeypatch):
    plan = tmp_path / "plan.yaml"
    plan.write_text("old: 1\n")
    seen = []
    real_replace = os.replace

    def replace(src, dst):  # the moment the new file takes the name: the old one is still there, and kept
        seen.append((open(dst).read(), open(f"{dst}.bak").read()))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    assert write_keeping_previous(str(plan), "new: 2\n") == f"{plan}.bak"
    assert seen == [("old: 1\n", "old: 1\n")]
    assert plan.read_text() == "new: 2\n" and (tmp_path / "plan.yaml.bak").read_text() == "old: 1\n"
    assert write_keeping_previous(str(plan), "new: 2\n") is None  # same contents: nothing kept
    assert write_keeping_previous(str(plan), "third: 3\n") == f"{plan}.bak.1"


# ---- reading: FIFOs and endless devices are refused, never waited on ---------------------------------------------


def _run_dir(tmp_path, metrics: str) -> str:
    run = tmp_path / "run"
    run.mkdir()
    if metrics == "fifo":
        os.mkfifo(run / "metrics.jsonl")
    elif metrics == "dev-zero":
        os.symlink("/dev/zero", run / "metrics.jsonl")
    return str(run)


@POSIX
@pytest.mark.parametrize("metrics, said", [("fifo", "is a named pipe (FIFO), not a regular file"),
                                           ("dev-zero", "is a symbolic link (to /dev/zero) out of")])
def test_report_train_on_a_fifo_or_dev_zero_metrics_exits_2_promptly(tmp_path, metrics, said):
    run = _run_dir(tmp_path, metrics)
    _refused(_fitune(["report", "train", run, "-o", str(tmp_path / "r.html")], str(tmp_path)),
             f"{run}/metrics.jsonl {said}")
    assert not os.path.exists(tmp_path / "r.html")


@POSIX
def test_open_regular_refuses_a_fifo_and_a_device_without_blocking(tmp_path):
    fifo = tmp_path / "in.json"
    os.mkfifo(fifo)
    code = ("import sys; from fitune.files import open_regular, UnsafeFileError\n"
            "for p in sys.argv[1:]:\n"
            "    try: open_regular(p)\n"
            "    except UnsafeFileError as e: print(e)\n")
    env = {**os.environ, "PYTHONPATH": ROOT}
    proc = subprocess.run([sys.executable, "-c", code, str(fifo), "/dev/zero"], capture_output=True, text=True,
                          timeout=30, env=env)
    assert proc.stdout.splitlines() == [
        f"INPUT {fifo} is a named pipe (FIFO), not a regular file: reading it would wait forever or never end; "
        "pass a regular file",
        "INPUT /dev/zero is a character device, not a regular file: reading it would wait forever or never end; "
        "pass a regular file"], proc.stderr
    regular = tmp_path / "x.json"
    regular.write_text("{}")
    with open_regular(str(regular)) as f:  # a regular file reads as ever (blocking mode restored)
        assert f.read() == "{}"


@POSIX
@pytest.mark.parametrize("argv", [["report", "estimate", "FIFO", "-o", "out.html"],
                                  ["report", "estimate", "EST", "--measured", "FIFO", "-o", "out.html"],
                                  ["generate", ".", "--prompts", "FIFO"]],
                         ids=["report-input", "report-measured", "generate-prompts"])
def test_reading_a_fifo_input_exits_2_promptly(tmp_path, estimate_json, argv):
    fifo = str(tmp_path / "in.json")
    os.mkfifo(fifo)
    argv = [fifo if a == "FIFO" else estimate_json if a == "EST" else a for a in argv]
    _refused(_fitune(argv, str(tmp_path)), fifo)


@POSIX
def test_a_fifo_among_a_model_folders_files_is_refused_before_loading(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    os.mkfifo(model / "model.safetensors")
    _refused(_fitune(["generate", str(model), "--prompt", "hi"], str(tmp_path)),
             f"{model}/model.safetensors is a named pipe (FIFO), not a regular file")


# ---- report: numbers that are not numbers -----------------------------------------------------------------------


def _edited(estimate_json: str, tmp_path, name: str, edit) -> str:
    doc = json.load(open(estimate_json))
    edit(doc)
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    return str(path)


@pytest.mark.parametrize("edit, said", [
    (lambda d: d.update(peak_allocated_bytes="1000"), "peak_allocated_bytes is '1000' (a string), not a number"),
    (lambda d: d["breakdown"].update(weights="16 GiB"), "breakdown.weights is '16 GiB' (a string), not a number"),
    (lambda d: d["setup"].update(batch_size="2"), "setup.batch_size is '2' (a string), not a number"),
    (lambda d: d.update(total_params=1e308), "total_params is 1e+308, beyond any number fitune writes"),
    (lambda d: d["gpu"].update(total_bytes=10**30), "gpu.total_bytes is an integer of 31 digits, beyond any number"),
    (lambda d: d["breakdown"].update(weights=float("nan")), "breakdown.weights is NaN"),
], ids=["bytes-string", "breakdown-string", "setup-string", "1e308", "huge-int", "nan-bytes"])
def test_report_estimate_with_numbers_that_are_not_numbers(tmp_path, capsys, estimate_json, edit, said):
    path = _edited(estimate_json, tmp_path, "est.json", edit)
    assert main(["report", "estimate", path, "-o", str(tmp_path / "o.html")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"fitune report: error: {path} is not the unedited JSON of `fitune estimate --json`: "
                          f"{said}"), err


def test_report_with_an_integer_of_5000_digits(tmp_path, capsys, estimate_json):
    path = tmp_path / "est.json"
    doc = json.load(open(estimate_json))
    path.write_text(json.dumps(doc).replace(f'"total_params": {doc["total_params"]}', '"total_params": 1' + "0" * 5000))
    assert main(["report", "estimate", str(path), "-o", str(tmp_path / "o.html")]) == 2
    err = capsys.readouterr().err
    assert f"INPUT {path} holds a number no fitune output holds" in err and "Traceback" not in err


@pytest.mark.parametrize("line, said", [
    ({"step": 1e308, "loss": 1.0}, "metrics.jsonl:3: step is 1e+308, beyond any number fitune writes"),
    ({"step": "3", "loss": "0.5"}, "metrics.jsonl:3: step is '3' (a string), not a number; loss is '0.5'"),
    ({"step": 3, "loss": 1.0, "peak_reserved_bytes": [1]}, "metrics.jsonl:3: peak_reserved_bytes is a list"),
], ids=["1e308-steps", "strings", "list"])
def test_report_train_with_numbers_that_are_not_numbers(tmp_path, capsys, line, said):
    run = tmp_path / "run"
    run.mkdir()
    lines = [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5}, line]
    (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert main(["report", "train", str(run)]) == 2
    err = capsys.readouterr().err
    assert said in err and "Traceback" not in err and err.count("\n") == 1
    assert not (run / "report.html").exists()


def test_report_train_with_steps_too_close_for_a_float_finishes(tmp_path):
    """Steps of 1e17 + 1, + 2, ...: a tick step below the numbers' precision once looped forever."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": 10**17 + i, "loss": 1e17 + 16 * i}) + "\n"
                                               for i in range(1, 5)))
    proc = _fitune(["report", "train", str(run)], str(tmp_path), timeout_s=60)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert (run / "report.html").read_text().startswith("<!DOCTYPE html>")

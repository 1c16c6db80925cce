"""Issue 18's "nothing is lost": `fitune train` killed with `kill -9` at random moments, interrupted with Ctrl-C
pressed twice (the second press at varied delays, and the moment a checkpoint's `.tmp` folder appears), started
ten times at once in one output_dir, and stopped by a full disk. Each run either resumes to the losses and the
adapter of the uninterrupted run, bit for bit, or is refused before it starts.

A tiny random Llama on the CPU. Each run is a real process, killed and signalled by its pid; to keep the 70+
processes cheap they are forked from a "zygote" that imported torch, transformers and peft once (a process start
costs 3-5 s of imports, a fork 0.3 s). The zygote runs `fitune.cli.main.main(argv)` exactly as `fitune train` does.
The random moments come from a seeded generator (the kill times are still wall-clock, so which phase a kill lands
in varies from run to run; every kill is checked the same way).
"""

import dataclasses
import errno
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("yaml")

from safetensors.torch import load_file  # noqa: E402

from fitune.cli.main import main  # noqa: E402
from fitune.config import TrainConfig, config_from_dict  # noqa: E402
from fitune.errors import ConfigError  # noqa: E402
from fitune.specs import optimizers as optimizer_specs  # noqa: E402
from fitune.train import checkpoint, outdir  # noqa: E402
from fitune.train.loop import train  # noqa: E402

from tiny import make_chat_data, make_model_folder, write_config  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 24
"""Steps of every run here: each kill chain, interrupt chain and concurrent start trains these."""

KILLS = 50
DOUBLE_CTRL_C = 20
CONCURRENT = 10


# ---- the zygote: real processes for the price of a fork ------------------------------------------------------

ZYGOTE = r'''
import json, os, sys, time, traceback
os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
import torch, transformers, peft, safetensors.torch, yaml  # the imports every child would pay for, paid once
import fitune.cli.main, fitune.train.loop, fitune.data, fitune.runtime.model, fitune.runtime.step
from transformers.utils import logging as hf_logging
hf_logging.disable_progress_bar()

def child(cmd):
    fd = os.open(cmd["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    torch.set_num_threads(1)  # the same arithmetic in every child, and two chains fit on two cores
    while cmd.get("go") and not os.path.exists(cmd["go"]):  # concurrent starts: all released at once
        time.sleep(0.0005)
    if cmd.get("hold"):
        hold_before_restoring_ctrl_c(cmd["hold"])
    try:
        rc = fitune.cli.main.main(cmd["argv"])
    except SystemExit as exc:
        rc = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
        rc = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


def hold_before_restoring_ctrl_c(hold):
    """The double Ctrl-C test's rendezvous. Each press fitune's handler takes is counted in HOLD.presses (two
    SIGINTs sent back to back can merge into one: the test sends the second once the first was taken). When the run
    is over, still inside main() with the handler installed, the child writes HOLD.holding and waits for HOLD (the
    number of presses the test sent) until that many were handled; it writes their count to HOLD.handled, then lets
    the run restore the handlers and return. Every press the test sends therefore lands while main() runs, whatever
    the machine's load."""
    stop = fitune.train.loop._GracefulStop
    restore_all = stop.restore_all.__func__
    handle = stop._handle

    def counted(self, signum, frame):
        with open(hold + ".presses.part", "w") as f:
            f.write(str(self.presses + 1))
        os.replace(hold + ".presses.part", hold + ".presses")
        return handle(self, signum, frame)

    def held(cls):
        handled = lambda: sum(s.presses for s in cls._active)
        open(hold + ".holding", "w").close()
        deadline = time.monotonic() + 120
        while not os.path.exists(hold) and time.monotonic() < deadline:
            time.sleep(0.0005)
        sent = int(open(hold).read()) if os.path.exists(hold) else 0
        while handled() < sent and time.monotonic() < deadline:
            time.sleep(0.0005)  # a press the kernel holds for this process runs its handler here
        with open(hold + ".handled", "w") as f:
            f.write(str(handled()))
        restore_all(cls)

    stop.restore_all = classmethod(held)
    stop._handle = counted


exited = {}
for line in sys.stdin:
    cmd = json.loads(line)
    if "argv" in cmd:
        pid = os.fork()
        if pid == 0:
            child(cmd)
        reply = {"pid": pid}
    else:
        pid, deadline = cmd["wait"], time.monotonic() + cmd["timeout"]
        while pid not in exited:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                exited[pid] = os.waitstatus_to_exitcode(status)
            elif time.monotonic() >= deadline:
                break
            else:
                time.sleep(0.002)
        reply = {"rc": exited.get(pid)}
    print(json.dumps(reply), flush=True)
'''


class Zygote:
    """Starts `fitune <argv>` children (forked, imports done) and reports their exit codes."""

    def __init__(self):
        env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
        self.proc = subprocess.Popen([sys.executable, "-c", ZYGOTE], cwd=REPO, env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)

    def _ask(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, "the zygote died"
        return json.loads(line)

    def start(self, argv: list[str], log: str, go: str | None = None, hold: str | None = None) -> int:
        return self._ask(argv=argv, log=log, go=go, hold=hold)["pid"]

    def poll(self, pid: int) -> int | None:
        return self._ask(wait=pid, timeout=0)["rc"]

    def wait(self, pid: int, timeout: float = 120) -> int:
        rc = self._ask(wait=pid, timeout=timeout)["rc"]
        if rc is None:
            os.kill(pid, signal.SIGKILL)
            self._ask(wait=pid, timeout=10)
            raise AssertionError(f"child {pid} still running after {timeout} s")
        return rc

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def zygote():
    z = Zygote()
    yield z
    z.close()


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("crash")
    return str(root), make_model_folder(str(root / "model")), make_chat_data(str(root / "train.jsonl"), n=48)


def _doc(workspace, out, **over) -> dict:
    _, model, data = workspace
    doc = {"model": model, "data": {"path": data, "format": "chat"}, "method": "lora",
           "lora": {"rank": 8, "alpha": 16, "targets": ["q_proj", "v_proj"]}, "seq_len": 32, "batch_size": 4,
           "grad_accum": 1, "max_steps": STEPS, "lr": 5e-3, "output_dir": str(out), "dtype": "fp32",
           "schedule": "cosine", "warmup_steps": 3, "seed": 3, "save_every": 1, "keep_checkpoints": 2}
    doc.update(over)
    return doc


def _yaml(workspace, out, **over) -> str:
    return write_config(f"{out}.yaml", **_doc(workspace, out, **over))


# ---- what a run left behind ----------------------------------------------------------------------------------


def _lines(out) -> list[dict]:
    """metrics.jsonl's complete lines (a kill can tear the last one)."""
    path = os.path.join(out, "metrics.jsonl")
    try:
        with open(path, encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.endswith("\n")]
    except FileNotFoundError:  # not written yet, or moved aside this instant by a start with --overwrite
        return []


def _run_id(out) -> str | None:
    try:
        with open(os.path.join(out, "run.json"), encoding="utf-8") as f:
            return json.load(f)["run_id"]
    except (OSError, ValueError):
        return None


def _adapter(out) -> dict:
    return load_file(os.path.join(out, "adapter", "adapter_model.safetensors"))


def _check_every_checkpoint_is_complete(out) -> list[int]:
    """Every checkpoint folder without `.tmp` loads in full and belongs to the folder's run; returns their steps."""
    folder = os.path.join(out, "checkpoints")
    steps = []
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        if name.endswith(".tmp"):
            continue
        path = os.path.join(folder, name)
        state = checkpoint.read_state(path)
        assert state["run_id"] == _run_id(out), f"{path} is of run {state['run_id']}, the folder's is {_run_id(out)}"
        assert name == f"step-{state['step']:06d}"
        for file in os.listdir(path):
            if file.endswith(".safetensors"):
                load_file(os.path.join(path, file))
            elif file.endswith(".json"):
                json.load(open(os.path.join(path, file)))
        for needed in ("trainable.safetensors", "optimizer.json", "scheduler.json", "rng.json"):
            assert os.path.isfile(os.path.join(path, needed)), f"{path} lacks {needed}"
        steps.append(state["step"])
    return steps


def _how_to_continue(out) -> list[str]:
    """What a user does after the run died: --resume when it has a complete checkpoint, else start it again."""
    if not os.path.isdir(out) or not set(os.listdir(out)) - {"fitune.lock"}:
        return []
    return ["--resume"] if checkpoint.latest(out, _run_id(out)) else ["--overwrite"]


def _check_finished_like_the_reference(out, reference) -> None:
    """Losses, learning rates and token counts of every step equal the uninterrupted run's, each step once; the
    adapter and the last checkpoint are bitwise the same; nothing half-written is left."""
    lines, ref_lines = _lines(out), reference["lines"]
    assert [line["step"] for line in lines] == list(range(1, STEPS + 1))
    for key in ("loss", "lr", "tokens", "trained_tokens"):
        assert [line[key] for line in lines] == [line[key] for line in ref_lines], key
    got, want = _adapter(out), reference["adapter"]
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    last = load_file(os.path.join(out, "checkpoints", f"step-{STEPS:06d}", "trainable.safetensors"))
    assert all(torch.equal(last[k], reference["trainable"][k]) for k in reference["trainable"])
    assert _check_every_checkpoint_is_complete(out)[-1] == STEPS
    assert not [n for n in os.listdir(os.path.join(out, "checkpoints")) if n.endswith(".tmp")]
    assert not [n for n in os.listdir(out) if n.endswith((".tmp", ".old"))], os.listdir(out)
    assert not os.path.exists(os.path.join(out, "fitune.lock"))  # released


@pytest.fixture(scope="module")
def reference(workspace, zygote):
    """One uninterrupted run, in a child like every other run here."""
    out = os.path.join(workspace[0], "reference")
    pid = zygote.start(["train", _yaml(workspace, out), "--no-progress"], out + ".log")
    assert zygote.wait(pid) == 0, open(out + ".log").read()
    return {"lines": _lines(out), "adapter": _adapter(out),
            "trainable": load_file(os.path.join(out, "checkpoints", f"step-{STEPS:06d}", "trainable.safetensors"))}


def _wait_until(condition, pid, zygote, timeout=60.0) -> bool:
    """Poll `condition()` every millisecond until true (True), or the child exits first (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        if zygote.poll(pid) is not None:
            return False
        time.sleep(0.001)
    raise AssertionError("timed out")


def _training_started(out, since_step: int):
    """A step line newer than any before this child started: the child is training (past its set-up)."""
    return lambda: any(line.get("step", 0) > since_step for line in _lines(out)[-2:])


def _tmp_checkpoint(out):
    folder = os.path.join(out, "checkpoints")
    return lambda: os.path.isdir(folder) and any(n.endswith(".tmp") for n in os.listdir(folder))


# ---- kill -9 ---------------------------------------------------------------------------------------------------

KILL_MOMENTS = ("any", "step", "checkpoint-write")
"""any: a random time after the process starts (set-up included); step: a random time after it trained its first
step; checkpoint-write: the moment a `.tmp` checkpoint folder is there."""


def test_fifty_kill_9_at_random_moments_lose_nothing(workspace, zygote, reference):
    rng = random.Random(18)
    kills, chains, landed = 0, 0, {m: 0 for m in KILL_MOMENTS}
    while kills < KILLS:
        chains += 1
        out = os.path.join(workspace[0], f"kill-{chains}")
        config = _yaml(workspace, out, save_every=(1, 4)[chains % 2])  # 4: a kill costs steps that are trained again
        while True:
            started = max([line.get("step", 0) for line in _lines(out)], default=0)
            pid = zygote.start(["train", config, "--no-progress", *_how_to_continue(out)], out + ".log")
            moment = rng.choice(KILL_MOMENTS) if kills < KILLS else None
            if moment == "any":
                time.sleep(rng.uniform(0.0, 0.9))
                alive = zygote.poll(pid) is None
            elif moment == "step":
                alive = _wait_until(_training_started(out, started), pid, zygote)
                time.sleep(rng.uniform(0.0, 0.1))
            elif moment == "checkpoint-write":
                alive = _wait_until(_training_started(out, started), pid, zygote) and \
                    _wait_until(_tmp_checkpoint(out), pid, zygote)
            if moment is None or not alive:
                assert zygote.wait(pid) == 0, open(out + ".log").read()[-3000:]
                break
            os.kill(pid, signal.SIGKILL)
            if zygote.wait(pid) != -signal.SIGKILL:  # it had finished just before the signal
                break
            kills += 1
            landed[moment] += 1
            _check_every_checkpoint_is_complete(out)
        _check_finished_like_the_reference(out, reference)
    print(f"{kills} kill -9 in {chains} runs of {STEPS} steps: {landed}")
    assert kills == KILLS and all(landed.values())


# ---- Ctrl-C twice ----------------------------------------------------------------------------------------------


def _press(pid: int) -> bool:
    """Ctrl-C to `pid`; False when the process has already ended (the previous press stopped it)."""
    try:
        os.kill(pid, signal.SIGINT)
        return True
    except ProcessLookupError:
        return False


def _wait_for(conditions: dict, pid, zygote, timeout=60.0) -> str | None:
    """Poll every millisecond: the name of the first of `conditions` that holds, or None when the child exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for name, condition in conditions.items():
            if condition():
                return name
        if zygote.poll(pid) is not None:
            return None
        time.sleep(0.001)
    raise AssertionError("timed out")


def _taken(hold: str, n: int):
    """The child's Ctrl-C handler has taken `n` presses (the zygote's `hold_before_restoring_ctrl_c` counts them)."""
    def taken() -> bool:
        try:
            with open(hold + ".presses") as f:
                return int(f.read()) >= n
        except (OSError, ValueError):
            return False
    return taken


def _release(hold: str, presses: int) -> None:
    """Let a held child go on once `presses` presses have reached its handler (atomically: it reads the count)."""
    with open(hold + ".part", "w") as f:
        f.write(str(presses))
    os.replace(hold + ".part", hold)


def test_twenty_double_ctrl_c_keep_a_complete_checkpoint_and_resume_exactly(workspace, zygote, reference):
    """The second press comes a delay (s) after the first was taken, or the moment a `.tmp` checkpoint folder
    appears after it, or both presses (one after the other is taken) while a checkpoint / the adapter is written.
    Each child holds before it restores the Ctrl-C handlers (the zygote's `hold_before_restoring_ctrl_c`) until the
    test's presses were handled: both presses of every pair land while main() runs, and the child says it handled
    both."""
    rng = random.Random(20)
    seconds = [0.0, 0.0005, 0.002, 0.01, 0.03, 0.1]
    presses, chains, at_tmp = 0, 0, 0
    while presses < DOUBLE_CTRL_C:
        chains += 1
        out = os.path.join(workspace[0], f"ctrl-c-{chains}")
        config = _yaml(workspace, out, save_every=(1, 5)[chains % 2])
        for attempt in range(100):
            started = max([line.get("step", 0) for line in _lines(out)], default=0)
            log_path, hold = f"{out}.{attempt}.log", f"{out}.{attempt}.hold"
            holding = (lambda h: lambda: os.path.exists(h + ".holding"))(hold)
            pid = zygote.start(["train", config, "--no-progress", *_how_to_continue(out)], log_path, hold=hold)
            state = _wait_for({"training": _training_started(out, started), "over": holding}, pid, zygote)
            second = rng.choice([*seconds, "tmp", "tmp-both"]) if presses % 10 != 9 else "outputs"
            if presses < DOUBLE_CTRL_C and state == "training" and second in ("tmp-both", "outputs"):
                being_written = _tmp_checkpoint(out) if second == "tmp-both" else \
                    (lambda: os.path.isdir(os.path.join(out, "adapter.tmp")))
                state = _wait_for({"training": being_written, "over": holding}, pid, zygote)
                at_tmp += state == "training" and second == "tmp-both"
            if presses >= DOUBLE_CTRL_C or state != "training":  # nothing left to press: the run completes
                _release(hold, 0)
                assert zygote.wait(pid) == 0, open(log_path).read()[-3000:]
                break
            if second in ("tmp-both", "outputs"):
                assert _press(pid)
                assert _wait_for({"taken": _taken(hold, 1)}, pid, zygote) == "taken"
                assert _press(pid)
            else:
                time.sleep(rng.uniform(0.0, 0.05))
                assert _press(pid)
                assert _wait_for({"taken": _taken(hold, 1)}, pid, zygote) == "taken"  # then the second, on its own
                if second == "tmp":
                    at_tmp += _wait_for({"tmp": _tmp_checkpoint(out), "over": holding}, pid, zygote,
                                        timeout=10) == "tmp"
                else:
                    time.sleep(second)
                assert _press(pid)  # the child holds until both are handled: it cannot have ended
            _release(hold, 2)
            rc = zygote.wait(pid)
            log = open(log_path).read()
            assert open(hold + ".handled").read() == "2", log[-3000:]  # both reached fitune's handler in main()
            presses += 1
            if rc == 0:  # the presses came after the last step: the run is complete
                break
            assert rc == 130, log[-3000:]
            assert "aborted" not in log and "Traceback" not in log
            stopped = {int(n) for n in re.findall(r"interrupted at step (\d+)", log)}
            assert len(stopped) == 1, log[-3000:]
            stopped = stopped.pop()
            # the step it stopped at is checkpointed, complete; the run goes on from there
            assert _check_every_checkpoint_is_complete(out)[-1] == stopped
            assert checkpoint.latest(out, _run_id(out)).endswith(f"step-{stopped:06d}")
        _check_finished_like_the_reference(out, reference)
    print(f"{presses} double Ctrl-C in {chains} runs ({at_tmp} with a press while a .tmp folder was there)")
    assert presses == DOUBLE_CTRL_C and at_tmp


# ---- ten starts at once ------------------------------------------------------------------------------------------


def _start_together(zygote, out, argv, n) -> tuple[list[int], dict[int, int]]:
    go = out + ".go"
    if os.path.exists(go):
        os.remove(go)
    pids = [zygote.start(argv, f"{out}.{i}.log", go=go) for i in range(n)]
    open(go, "w").close()
    return pids, {}


def _lock_holder(out, timeout=60.0) -> int:
    """The pid fitune.lock names, once one does."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return json.load(open(os.path.join(out, "fitune.lock")))["pid"]
        except (OSError, ValueError, KeyError):
            time.sleep(0.001)
    raise AssertionError(f"no run took {out}")


def test_ten_concurrent_starts_one_runs_the_others_name_its_pid(workspace, zygote, reference):
    out = os.path.join(workspace[0], "together")
    config = _yaml(workspace, out)
    for round_, extra in enumerate((["--no-progress"], ["--no-progress", "--resume"])):
        pids, _ = _start_together(zygote, out, ["train", config, *extra], CONCURRENT)
        # The winner is paused until every other start has been refused: on a loaded machine a start can come so
        # late that the winner has already ended, and it would then meet the finished folder rather than the lock.
        holder = _lock_holder(out)
        os.kill(holder, signal.SIGSTOP)
        codes = {pid: zygote.wait(pid) for pid in pids if pid != holder}
        os.kill(holder, signal.SIGCONT)
        if round_ == 0:  # stop the winner midway, so that the second round has something to resume
            assert _wait_until(lambda: len(_lines(out)) >= 5, holder, zygote)
            os.kill(holder, signal.SIGINT)
        codes[holder] = zygote.wait(holder)
        winners = [pid for pid, rc in codes.items() if rc in (0, 130)]
        assert len(winners) == 1, codes
        for pid in set(pids) - set(winners):
            assert codes[pid] == 2
            err = open(f"{out}.{pids.index(pid)}.log").read()
            assert f"in use by another fitune run (pid {winners[0]} " in err, err
        assert codes[winners[0]] == (130, 0)[round_]
    lines = _lines(out)  # one run's lines, in order: none interleaved, none twice
    assert [line["step"] for line in lines] == list(range(1, STEPS + 1))
    _check_finished_like_the_reference(out, reference)


# ---- a full disk (in-process: ENOSPC injected where the writes happen) -------------------------------------------

DISK_STEPS = 6
"""save_every 2: a write failing at step 4 leaves step 2's checkpoint, and steps 3-4 are trained again."""


def _disk_doc(workspace, out, **over) -> dict:
    return _doc(workspace, out, **{"max_steps": DISK_STEPS, "save_every": 2, **over})


@pytest.fixture(scope="module")
def disk_reference(workspace):
    out = os.path.join(workspace[0], "disk-reference")
    train(config_from_dict(_disk_doc(workspace, out), "test"), progress=False)
    return {"lines": _lines(out), "adapter": _adapter(out)}


def _no_space(*_args, **_kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _fd_path(fd: int) -> str:
    return os.readlink(f"/proc/self/fd/{fd}")


def _full_disk(where: str, monkeypatch) -> None:
    """Make the write `where` fail the way a full disk makes it fail."""
    if where == "checkpoint weights":  # safetensors (Rust) reports the OS error as its own exception
        import safetensors
        import safetensors.torch

        real = safetensors.torch.save_file

        def save_file(tensors, path, *args, **kwargs):
            if "step-000004.tmp" in str(path):
                with open(path, "wb") as f:
                    f.write(b"\0" * 100)  # what fitted
                raise safetensors.SafetensorError('Error while serializing: IoError(Os { code: 28, kind: '
                                                  'StorageFull, message: "No space left on device" })')
            return real(tensors, path, *args, **kwargs)

        monkeypatch.setattr(safetensors.torch, "save_file", save_file)
    elif where == "checkpoint state":
        real_json = checkpoint._write_json
        monkeypatch.setattr(checkpoint, "_write_json", lambda path, obj: _no_space() if "step-000004.tmp" in path
                            and path.endswith("trainer_state.json") else real_json(path, obj))
    elif where in ("checkpoint fsync", "run.json"):  # the data reaches the disk at fsync: where ENOSPC can show
        real_fsync = os.fsync
        sign = "step-000004.tmp" if where == "checkpoint fsync" else "run.json.tmp"
        monkeypatch.setattr(os, "fsync", lambda fd: _no_space() if sign in _fd_path(fd) else real_fsync(fd))
    elif where == "metrics line":
        real_open = outdir.RunFolder.open_metrics

        class Full:
            def __init__(self, file):
                self.file = file

            def write(self, text):
                if '"step": 4,' in text:
                    _no_space()
                self.file.write(text)

            def __getattr__(self, name):
                return getattr(self.file, name)

        def open_metrics(self, through_step):
            metrics = real_open(self, through_step)
            metrics.file = Full(metrics.file)
            return metrics

        monkeypatch.setattr(outdir.RunFolder, "open_metrics", open_metrics)
    elif where == "adapter":
        import peft.peft_model

        monkeypatch.setattr(peft.peft_model, "safe_save_file", _no_space)


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="reads which file an fd is from /proc")
@pytest.mark.parametrize("where, kept", [("checkpoint weights", 2), ("checkpoint state", 2), ("checkpoint fsync", 2),
                                         ("metrics line", 2), ("adapter", 6), ("run.json", None)])
def test_a_full_disk_stops_the_run_with_what_to_do_and_resume_loses_nothing(workspace, disk_reference, tmp_path,
                                                                          monkeypatch, capsys, where, kept):
    out = str(tmp_path / "run")
    config = write_config(str(tmp_path / "run.yaml"), **_disk_doc(workspace, out))
    _full_disk(where, monkeypatch)
    assert main(["train", config, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "the disk is full" in err and "GiB free now" in err and "Traceback" not in err, err
    if kept is None:  # nothing trained yet: the folder is left as it was found, and the run starts again
        assert "start the run again" in err and os.listdir(out) == []
    else:
        assert "continue with --resume" in err
        assert _check_every_checkpoint_is_complete(out)[-1] == kept  # the newest complete checkpoint survives
        assert not [n for n in os.listdir(os.path.join(out, "checkpoints")) if n.endswith(".tmp")]  # space back
        assert not [n for n in os.listdir(out) if n.endswith(".tmp")]
    monkeypatch.undo()  # space freed
    assert main(["train", config, "--no-progress", *(["--resume"] if kept else [])]) == 0
    assert [line["loss"] for line in _lines(out)] == [line["loss"] for line in disk_reference["lines"]]
    got = _adapter(out)
    assert all(torch.equal(got[k], v) for k, v in disk_reference["adapter"].items())


# ---- durable: fsync before the rename ------------------------------------------------------------------------


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="reads which file an fd is from /proc")
def test_each_file_and_the_folder_are_fsynced_before_a_checkpoint_is_renamed(workspace, tmp_path, monkeypatch):
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", _fd_path(fd)))
        return real_fsync(fd)

    def replace(src, dst, **kwargs):
        src = os.path.realpath(src)
        files = [os.path.join(d, f) for d, _, fs in os.walk(src) for f in fs] if os.path.isdir(src) else []
        events.append(("replace", src, os.path.realpath(dst), files))
        return real_replace(src, dst, **kwargs)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    out = str(tmp_path / "run")
    train(config_from_dict(_doc(workspace, out, max_steps=3, save_every=1), "test"), progress=False)
    monkeypatch.undo()
    renames = [(i, e) for i, e in enumerate(events) if e[0] == "replace" and e[1] == e[2] + ".tmp" and e[3]]
    published = sorted(os.path.basename(e[2]) for _, e in renames)  # (prune's renames go the other way)
    assert published == ["adapter", "step-000001", "step-000002", "step-000003"]
    for i, (_, src, dst, files) in renames:
        before = {e[1] for e in events[:i] if e[0] == "fsync"}
        assert set(files) <= before, f"{dst}: not fsynced before the rename: {set(files) - before}"
        assert src in before  # the folder's entries
        assert ("fsync", os.path.dirname(dst)) in events[i + 1:]  # the rename itself


# ---- links: nothing written or deleted outside output_dir ----------------------------------------------------


@pytest.mark.parametrize("link", ["checkpoints", "run.json", "fitune.lock", "checkpoints/step-000002.tmp",
                                  "adapter.tmp", "metrics.jsonl.tmp", "checkpoints/step-000001/rng.json"])
def test_no_write_or_delete_follows_a_link_out_of_output_dir(workspace, tmp_path, capsys, link):
    out = str(tmp_path / "run")
    config = write_config(str(tmp_path / "run.yaml"), **_doc(workspace, out, max_steps=2, keep_checkpoints=2))
    assert main(["train", config, "--no-progress"]) == 0
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious.txt").write_text("keep me\n")
    (outside / "rng.json").write_text("{}\n")
    planted = os.path.join(out, *link.split("/"))
    if os.path.isdir(planted):
        shutil.rmtree(planted)
    elif os.path.exists(planted):
        os.remove(planted)
    os.symlink(outside / os.path.basename(link) if link.endswith(".json") else outside, planted)
    before = {p.name: (p.read_text(), p.stat().st_mtime_ns) for p in outside.iterdir()}
    capsys.readouterr()
    config = write_config(str(tmp_path / "run.yaml"), **_doc(workspace, out, max_steps=4, keep_checkpoints=2))
    rc = main(["train", config, "--no-progress", "--resume"])
    err = capsys.readouterr().err
    assert {p.name: (p.read_text(), p.stat().st_mtime_ns) for p in outside.iterdir()} == before
    assert rc == 0 or (rc == 2 and "is a symbolic link" in err and "Traceback" not in err), err


# ---- --resume: every config key applied or refused, by name --------------------------------------------------


def _every_key_changed() -> tuple[dict, dict]:
    """The flat YAML form (dotted keys, as checkpoints save it) of the default config and of one with every key
    changed: tests/test_schema.py's SAMPLE, a value different from the default for every field."""
    from fitune.config import ALL_KEYS, flat_values
    from fitune.schema import to_mapping
    from test_schema import SAMPLE

    values = {f: (v if v is not None else 2 if f == "epochs" else f"/changed/{f}") for f, v in SAMPLE.items()}
    keep_none = [f for f, v in flat_values(TrainConfig()).items() if v is not None]
    saved = checkpoint.flat_config(TrainConfig().to_dict())
    now = checkpoint.flat_config(to_mapping(values, ALL_KEYS, keep_none=keep_none))
    for key in set(saved) & set(now):  # the few SAMPLE leaves at their default (one valid value only, say)
        if saved[key] == now[key]:
            now[key] = f"changed-{now[key]}"
    return saved, now


def test_resume_applies_or_refuses_every_config_key_by_name():
    saved, now = _every_key_changed()
    keys = set(saved) | set(now)
    assert all(saved.get(k) != now.get(k) for k in keys)
    assert checkpoint.RESUME_APPLIES <= keys, f"not config keys: {checkpoint.RESUME_APPLIES - keys}"
    with pytest.raises(ConfigError) as refused:
        checkpoint.check_config_changes(saved, now)
    problems = refused.value.problems if hasattr(refused.value, "problems") else str(refused.value).splitlines()
    text = "\n".join(problems)
    applies = keys & checkpoint.RESUME_APPLIES
    for key in sorted(keys - applies):  # one sentence each, with both values and both ways out
        assert f"--resume: {key} changed from " in text and f"restore {key}: " in text, key
    assert len([p for p in problems if "changed from" in p]) == len(keys - applies)
    applied = checkpoint.check_config_changes(saved, {k: (now[k] if k in applies else v) for k, v in saved.items()}
                                              | {k: now[k] for k in applies if k not in saved})
    assert sorted(line.split(" ")[1] for line in applied) == sorted(applies)
    print(f"{len(keys)} config keys: {len(applies)} applied on --resume, {len(keys - applies)} refused")


def _optimizer_change(before: str, after: str) -> list[str]:
    """check_config_changes on the default config with only `optimizer` changed from `before` to `after`."""
    saved = checkpoint.flat_config(TrainConfig().to_dict())
    return checkpoint.check_config_changes(saved | {"optimizer": before}, saved | {"optimizer": after})


@pytest.mark.parametrize("before,after", [("adamw8bit", "paged_adamw8bit"), ("paged_adamw8bit", "adamw8bit"),
                                          ("adamw_bnb_8bit", "paged_adamw_8bit")])
def test_resume_applies_an_optimizer_change_that_keeps_the_same_state(before, after):
    """bitsandbytes' AdamW8bit and PagedAdamW8bit keep one state format (the registry's `state_format`): --resume
    applies the change and says why; the names may be aliases."""
    was, now = (optimizer_specs.canonical_name(n) for n in (before, after))
    assert _optimizer_change(before, after) == [
        f'--resume: optimizer changed from "{before}" to "{after}" since the checkpoint; applied: both keep the same '
        f"optimizer state ({optimizer_specs.get(now).state_format})"]
    assert optimizer_specs.get(was).state_format == optimizer_specs.get(now).state_format


@pytest.mark.parametrize("before,after", [("adamw_bnb_8bit", "adamw8bit"), ("adamw", "adamw_torch_fused"),
                                          ("paged_adamw_8bit", "paged_adamw8bit")])
def test_resume_reads_an_alias_as_the_same_optimizer(before, after):
    assert _optimizer_change(before, after) == []  # not a change: nothing to apply, nothing to refuse


@pytest.mark.parametrize("before,after", [("adamw", "adamw8bit"), ("adamw8bit", "adamw"), ("adamw", "paged_adamw8bit"),
                                          ("adamw", "sgd"), ("adafactor", "adamw"), ("sgd", "adafactor")])
def test_resume_refuses_an_optimizer_change_across_state_formats(before, after):
    """torch's AdamW and bitsandbytes' 8-bit AdamW (or any two optimizers of different state formats) cannot load
    each other's state: refused, naming the key, both values, why, and the two ways out."""
    was, now = optimizer_specs.get(before), optimizer_specs.get(after)
    with pytest.raises(ConfigError) as refused:
        _optimizer_change(before, after)
    assert str(refused.value) == (
        f'--resume: optimizer changed from "{before}" to "{after}" since the checkpoint; the saved optimizer state is '
        f"{before}'s ({was.state_format}), which {after} ({now.state_format}) cannot load; a resumed run keeps the "
        f'saved value: start a new run with --overwrite, or restore optimizer: "{before}"'), str(refused.value)


def test_resume_refuses_an_optimizer_the_registry_does_not_know():
    with pytest.raises(ConfigError, match='optimizer changed from "lion" to "adamw" since the checkpoint; "lion" is '
                                          'not an optimizer fitune knows; .* restore optimizer: "lion"'):
        _optimizer_change("lion", "adamw")


def test_resume_decides_every_optimizer_pair_by_the_registry():
    """Every ordered pair of registry entries: applied exactly when the two keep the same state format."""
    for was in optimizer_specs.REGISTRY:
        for now in optimizer_specs.REGISTRY:
            if was is now:
                assert _optimizer_change(was.name, now.name) == []
            elif was.state_format == now.state_format:
                assert len(_optimizer_change(was.name, now.name)) == 1
            else:
                with pytest.raises(ConfigError, match=f'from "{was.name}" to "{now.name}"'):
                    _optimizer_change(was.name, now.name)


def test_a_resumed_run_continues_with_an_optimizer_of_the_same_state(workspace, tmp_path, capsys, monkeypatch):
    """End to end on the CPU: a registry entry of AdamW's state format ("adamw_twin": another name for
    torch.optim.AdamW, as paged_adamw8bit is for adamw8bit's state) takes over a run at its checkpoint; the resumed
    run loads the saved moments into it and reproduces the uninterrupted run's losses bit for bit."""
    twin = dataclasses.replace(optimizer_specs.get("adamw"), name="adamw_twin", aliases=(), hf_optim="adamw_twin",
                               script_classes=("AdamWTwin",))
    monkeypatch.setattr(optimizer_specs, "REGISTRY", optimizer_specs.REGISTRY + (twin,))
    whole, out = str(tmp_path / "whole"), str(tmp_path / "run")
    train(config_from_dict(_doc(workspace, whole, max_steps=4), "test"), progress=False)
    train(config_from_dict(_doc(workspace, out, max_steps=2), "test"), progress=False)
    capsys.readouterr()
    cfg = config_from_dict(_doc(workspace, out, max_steps=4), "test")  # the YAML's choices were read at import
    train(dataclasses.replace(cfg, setup=cfg.setup.replace(optimizer="adamw_twin")), resume=True, progress=False)
    assert ('--resume: optimizer changed from "adamw" to "adamw_twin" since the checkpoint; applied: both keep the '
            "same optimizer state (torch AdamW)") in capsys.readouterr().err
    losses = [(line["step"], line["loss"]) for line in _lines(out) if "loss" in line]
    assert losses == [(line["step"], line["loss"]) for line in _lines(whole) if "loss" in line]
    assert len(losses) == 4
    assert checkpoint.read_state(os.path.join(out, "checkpoints", "step-000004"))["config"]["optimizer"] == "adamw_twin"


def test_a_resumed_run_takes_every_change_it_can_apply(workspace, tmp_path, capsys):
    out = str(tmp_path / "run")
    first = write_config(str(tmp_path / "a.yaml"), **_disk_doc(workspace, out, max_steps=3))
    assert main(["train", first, "--no-progress"]) == 0
    eval_data = make_chat_data(str(tmp_path / "eval.jsonl"), n=8, seed=1)
    doc = _disk_doc(workspace, out, max_steps=5, lr=1e-3, weight_decay=0.1, max_grad_norm=0.5, save_every=1,
                    save_every_minutes=60, keep_checkpoints=3, log_every=2, eval_every=2, merge=True,
                    grad_checkpointing="full", attn="eager", loss="chunked", tiled_mlp=True, lean_norm=True,
                    oom_guard=False)
    doc["data"]["eval_path"] = eval_data
    capsys.readouterr()
    assert main(["train", write_config(str(tmp_path / "b.yaml"), **doc), "--no-progress", "--resume"]) == 0
    err = capsys.readouterr().err
    for key in ("max_steps", "lr", "weight_decay", "max_grad_norm", "save_every", "save_every_minutes",
                "keep_checkpoints", "log_every", "eval_every", "merge", "grad_checkpointing", "attn", "loss",
                "tiled_mlp", "lean_norm", "oom_guard", "data.eval_path"):
        assert f"--resume: {key} changed from " in err and f"{key} changed" in err, key
    lines = [line for line in _lines(out) if "loss" in line]
    assert [line["step"] for line in lines] == [1, 2, 3, 4, 5] and lines[3]["lr"] < lines[2]["lr"] / 2
    assert any("eval_loss" in line for line in _lines(out)) and os.path.isdir(os.path.join(out, "merged"))
    assert checkpoint.read_state(os.path.join(out, "checkpoints", "step-000005"))["config"]["lr"] == 1e-3


# ---- bench/oom_guard.py on the CPU ------------------------------------------------------------------------------


def test_oom_guard_bench_continues_with_the_replanned_setup_and_matches_a_run_started_with_it(tmp_path, capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location("oom_guard", os.path.join(REPO, "bench", "oom_guard.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "oom_guard.jsonl"
    assert bench.main(["--device", "cpu", "--out", str(out), "--work", str(tmp_path / "work"), "--steps", "6",
                       "--oom-step", "3"]) == 0
    assert capsys.readouterr().out.startswith("# python3 bench/oom_guard.py --device cpu")
    a, b, compare = [json.loads(line) for line in out.read_text().splitlines()]
    assert a["steps_logged"] == [1, 2, 3, 4, 5, 6] and a["micro_batch_size"] == [8, 8, 4, 4, 4, 4]
    assert b["steps_logged"] == [3, 4, 5, 6] and b["micro_batch_size"] == [4, 4, 4, 4]
    assert compare["equal"] and compare["max_abs_loss_diff"] == 0.0  # no step lost, none trained twice

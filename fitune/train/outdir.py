"""One run per output folder: a lock, a run identity, and writes that never leave the folder.

    output_dir/
        fitune.lock               the pid of the run holding the folder (flock-ed while it runs, removed at its end)
                                  (output_dir itself is flock-ed too: deleting this file lets no second run in)
        run.json                  this run's id, start time and the config it started with
        metrics.jsonl             one line per step (and per evaluation)
        checkpoints/step-000010/  this run's resumable checkpoints (checkpoint.py)
        adapter/ | merged/ | model/   the end-of-run outputs, each written as `<name>.tmp/` then renamed

A fresh run refuses a folder that holds anything else (another run would mix its metrics, checkpoints and
retention with this one); `--overwrite` moves the old folder aside to `output_dir.old-<time>` first, `--resume`
continues the run that is there. Every path written or deleted is checked to be a real file or folder inside
`output_dir`: a symbolic link planted inside it (metrics.jsonl -> ~/.bashrc, checkpoints -> /) is refused, never
followed. `output_dir` itself may be a link the user made; it is resolved once, at the start.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import secrets
import shutil
import socket
import stat
import sys
import time
from dataclasses import dataclass

from ..errors import FituneError
from ..units import GiB

log = logging.getLogger(__name__)

LOCK_FILE = "fitune.lock"
RUN_FILE = "run.json"
METRICS_FILE = "metrics.jsonl"


class OutputDirError(FituneError):
    """output_dir is in use, holds another run, or contains a link fitune will not write through."""


@dataclass
class RunFolder:
    """An output folder this process holds: `root` is its resolved path; `run_id` names the run it contains."""

    root: str
    run_id: str
    _lock_fd: int | None = None
    identity: dict | None = None
    """run.json's "identity" (hashes of the base weights and the data, identity.py); None for an earlier run."""

    # ---- paths that stay inside ----------------------------------------------------------------------------

    def inside(self, *parts: str) -> str:
        """`root/parts...`, refused if any existing component below root is a symbolic link."""
        path = self.root
        for part in parts:
            if part in ("", ".", "..") or os.sep in part:
                raise OutputDirError(f"{part!r} is not a plain name inside output_dir {self.root}")
            path = os.path.join(path, part)
            _refuse_link(path)
        return path

    def real_dir(self, *parts: str) -> str:
        """A folder inside root, created if missing (never through a link)."""
        path = self.inside(*parts)
        if not os.path.isdir(path):
            os.mkdir(path)
        return path

    def remove_tree(self, path: str) -> None:
        """Delete a folder inside root; the folder itself must not be a link (rmtree never follows inner links)."""
        _refuse_link(path)
        if os.path.realpath(os.path.dirname(path)) != os.path.dirname(path) or not path.startswith(self.root + os.sep):
            raise OutputDirError(f"refusing to delete {path}: not directly inside output_dir {self.root}")
        if os.path.isdir(path):
            shutil.rmtree(path)

    def fresh_dir(self, *parts: str) -> str:
        """An empty `<name>.tmp` folder to write into; rename it into place with `publish`."""
        tmp = self.inside(*parts[:-1], parts[-1] + ".tmp")
        self.remove_tree(tmp)
        os.mkdir(tmp)
        return tmp

    @contextlib.contextmanager
    def writing(self, name: str):
        """`with folder.writing("adapter") as tmp:` write into `tmp`; published on success. A write that fails (a full
        disk) removes its `.tmp` and stops with what to do; the old `name` and the checkpoints stay as they were."""
        tmp = self.fresh_dir(name)
        try:
            yield tmp
        except Exception as exc:
            try:
                self.remove_tree(tmp)
            except OSError:  # pragma: no cover - the next write of `name` removes it
                pass
            if isinstance(exc, FituneError):
                raise
            raise OutputDirError(write_failed_message(tmp[: -len(".tmp")], exc)) from None
        self.publish(tmp)

    def publish(self, tmp: str) -> str:
        """Rename a complete `<name>.tmp` folder to `<name>`, replacing an older `<name>` (moved aside first, so a
        crash leaves one of the two complete)."""
        final = tmp[: -len(".tmp")]
        old = final + ".old"
        _refuse_link(final)
        self.remove_tree(old)
        if os.path.isdir(final):
            os.replace(final, old)
        fsync_tree(tmp)
        os.replace(tmp, final)
        fsync_dir(os.path.dirname(final))
        self.remove_tree(old)
        return final

    # ---- metrics.jsonl ------------------------------------------------------------------------------------

    def open_metrics(self, through_step: int):
        """metrics.jsonl for appending, first dropping lines of steps after `through_step` (a run killed after its
        last checkpoint logged steps the resumed run takes again)."""
        path = self.inside(METRICS_FILE)  # a link is refused here, whatever it points to (/dev/zero, ~/.bashrc)
        if os.path.lexists(path) and not stat.S_ISREG(os.lstat(path).st_mode):  # a FIFO would block the open
            raise OutputDirError(f"{path} is not a regular file (a FIFO or device); fitune appends only to a regular "
                                 "metrics.jsonl: remove it, or choose another output_dir")
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                lines = f.readlines()
            kept = [line for line in lines if line.endswith("\n") and _line_step(line) <= through_step]
            if len(kept) != len(lines):  # steps after the checkpoint, and a line torn by a kill
                log.info("metrics.jsonl: dropped %d lines of steps after %d (they are trained again)",
                         len(lines) - len(kept), through_step)
                write_file_atomic(self, METRICS_FILE, "".join(kept))
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | _O_NOFOLLOW | os.O_NONBLOCK, 0o644)
        os.set_blocking(fd, True)  # O_NONBLOCK only so that a FIFO swapped in just now fails the open, not hangs it
        return MetricsFile(os.fdopen(fd, "a", encoding="utf-8"), path)

    # ---- the lock -----------------------------------------------------------------------------------------

    def forget_if_nothing_trained(self) -> bool:
        """A fresh run that stopped before its first logged step (bad data, a model that does not load) leaves
        nothing to resume: remove its run.json (and an empty metrics file) so that the same command can start again
        without --overwrite. Returns whether it did; a folder with a checkpoint or a metrics line is left alone."""
        metrics = self.inside(METRICS_FILE)
        if os.path.isfile(metrics) and os.path.getsize(metrics) > 0:
            return False
        checkpoints = self.inside("checkpoints")
        if os.path.isdir(checkpoints) and os.listdir(checkpoints):
            return False
        for name in (METRICS_FILE, RUN_FILE):
            path = self.inside(name)
            if os.path.isfile(path):
                os.remove(path)
        return True

    def close(self) -> None:
        """Release the folder (remove our lock file, then drop the flock)."""
        if self._lock_fd is None:
            return
        _release_lock(self.root, self._lock_fd)
        self._lock_fd = None


class MetricsFile:
    """metrics.jsonl open for appending; a failed write (a full disk) stops the run with what to do, not a traceback.

    The lines of steps after the newest checkpoint are dropped and trained again on --resume, so a line lost here
    loses nothing."""

    def __init__(self, file, path: str):
        self.file = file
        self.path = path

    def write(self, text: str) -> None:
        try:
            self.file.write(text)
        except OSError as exc:
            raise OutputDirError(write_failed_message(self.path, exc)) from None

    def flush(self) -> None:
        try:
            self.file.flush()
        except OSError as exc:
            raise OutputDirError(write_failed_message(self.path, exc)) from None

    def close(self) -> None:
        try:
            self.file.close()
        except OSError:  # the buffered tail could not be written: those steps are trained again on --resume
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def write_failed_message(path: str, exc: BaseException, newest: str | None = "") -> str:
    """What a failed write says: the cause (a full disk, most often), what stays, and the next step.

    Args:
        newest: the run's newest complete checkpoint; None when it has none yet; "" when not known here.
    """
    text = str(exc) or type(exc).__name__
    full = (isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))) or \
        any(sign in text for sign in ("No space left", "StorageFull", "Disk quota", "QuotaExceeded"))
    then = "start the run again with --overwrite" if newest is None else "continue with --resume"
    if full:
        try:
            free = f"{shutil.disk_usage(os.path.dirname(path)).free / GiB:.1f} GiB free now"
        except OSError:
            free = "free space unknown"
        cause = f"the disk is full ({free})"
        fix = f"free space there (older runs' folders, or `keep_checkpoints: 1` to keep fewer), then {then}"
    else:
        cause = f"{type(exc).__name__}: {text}"
        fix = f"fix the cause, then {then}"
    if newest is None:
        kept = "No checkpoint of this run is complete yet"
    else:
        kept = (f"The newest complete checkpoint{', ' + newest + ',' if newest else ' in output_dir'} is untouched "
                "and --resume continues from it (steps after it are trained again)")
    return f"could not write {path}: {cause}. {kept}: {fix}"


def open_run(output_dir: str, config: dict, resume: bool = False, overwrite: bool = False,
             identity: dict | None = None) -> RunFolder:
    """Take `output_dir` for one run: lock it, check it holds this run (or nothing), refuse links inside it.

    Args:
        config: the run's config (TrainConfig.to_dict()), recorded in run.json for a fresh run.
        resume: continue the run in the folder (its run.json must be there).
        overwrite: a fresh run in a used folder moves the old contents to `output_dir.old-<time>` first.
        identity: hashes of the base weights and the data (identity.fingerprint), recorded in run.json for a fresh
            run; a resumed run's recorded ones are in `RunFolder.identity`.

    Raises:
        OutputDirError: in use by a live run (names its pid), holds another run without --resume / --overwrite,
            or contains a symbolic link.
    """
    if resume and overwrite:
        raise OutputDirError("--resume continues the run in output_dir and --overwrite moves it aside: give one")
    root = os.path.realpath(output_dir)  # a link the user made to output_dir itself is theirs: resolved once
    if resume and not os.path.isdir(root):
        raise OutputDirError(f"--resume: {output_dir} does not exist, so there is no run to continue; start without "
                             "--resume (or check output_dir)")
    if os.path.exists(root) and not os.path.isdir(root):
        raise OutputDirError(f"output_dir {output_dir} is a file, not a folder; choose another output_dir")
    os.makedirs(root, exist_ok=True)
    lock_fd = _acquire_lock(root)
    try:
        folder = RunFolder(root, "", lock_fd)
        _remove_leftover_tmp_files(root)  # a crash's run.json.tmp must not read as "a run is here" nor as "none"
        contents = sorted(set(os.listdir(root)) - {LOCK_FILE})
        if resume:
            folder.run_id, folder.identity = _read_run_id(folder, output_dir)
        elif contents:
            if not overwrite:
                raise OutputDirError(_used_folder_message(output_dir, root, contents))
            aside = _move_aside(root)
            print(f"fitune: --overwrite: moved the previous contents of {output_dir} to {aside}", file=sys.stderr)
            _release_lock(aside, lock_fd)  # the lock file went with the folder
            lock_fd = folder._lock_fd = None
            os.makedirs(root, exist_ok=True)  # another start may have made it meanwhile: the lock decides
            lock_fd = folder._lock_fd = _acquire_lock(root)
        _refuse_links_inside(folder)
        if not resume:
            folder.run_id = f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"
            write_file_atomic(folder, RUN_FILE, json.dumps(
                {"run_id": folder.run_id, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "config": config,
                 "identity": identity},
                indent=2) + "\n", newest=None)
        return folder
    except BaseException:
        if lock_fd is not None:
            _release_lock(root, lock_fd)
        raise


LEFTOVER_TMP_FILES = (RUN_FILE + ".tmp", METRICS_FILE + ".tmp")
"""Files `write_file_atomic` leaves when a crash cuts a write short: never complete, so removed at every start
(the lock says nobody writes them now)."""


def _remove_leftover_tmp_files(root: str) -> None:
    for name in LEFTOVER_TMP_FILES:
        path = os.path.join(root, name)
        if os.path.lexists(path) and not os.path.isdir(path):
            log.info("removing %s: a write cut short by a crash", path)
            os.unlink(path)  # a link itself, never its target


# ---- identity ---------------------------------------------------------------------------------------------


def _read_run_id(folder: RunFolder, output_dir: str) -> tuple[str, dict | None]:
    """run.json's run_id and identity (None when an earlier fitune wrote it without one)."""
    path = folder.inside(RUN_FILE)
    if not os.path.isfile(path) and not _listdir(os.path.join(folder.root, "checkpoints")):
        raise OutputDirError(f"--resume: {output_dir} holds no run to continue; start without --resume")
    if not os.path.isfile(path):
        raise OutputDirError(
            f"--resume: {output_dir} has no {RUN_FILE}, so it holds no run of this fitune version (an older fitune "
            "wrote pickle checkpoints, which are not loaded: they can run code); start a new run with --overwrite")
    if not stat.S_ISREG(os.lstat(path).st_mode):
        raise OutputDirError(f"--resume: {path} is not a regular file; start a new run with --overwrite")
    try:
        with open(os.open(path, os.O_RDONLY | _O_NOFOLLOW | os.O_NONBLOCK), encoding="utf-8") as f:
            doc = json.loads(f.read(64 * 1024 * 1024))
        run_id = doc["run_id"]
    except (ValueError, KeyError, TypeError, OSError) as exc:
        raise OutputDirError(f"--resume: {path} is not a fitune run file ({exc!r}); start a new run with --overwrite")
    if not isinstance(run_id, str) or not run_id:
        raise OutputDirError(f"--resume: {path} has no run_id; start a new run with --overwrite")
    identity = doc.get("identity")
    return run_id, identity if isinstance(identity, dict) else None


def _used_folder_message(output_dir: str, root: str, contents: list[str]) -> str:
    what = f"files fitune did not write ({', '.join(contents[:5])}{', ...' if len(contents) > 5 else ''})"
    run_file = os.path.join(root, RUN_FILE)
    if os.path.isfile(run_file) and not os.path.islink(run_file):
        try:
            with open(run_file, encoding="utf-8") as f:
                what = f"run {json.load(f).get('run_id')}"
        except (ValueError, AttributeError):
            pass
        steps = sorted(d for d in _listdir(os.path.join(root, "checkpoints")) if d.startswith("step-")
                       and not d.endswith(".tmp"))
        if steps:
            what += f" (newest checkpoint {steps[-1]})"
    return (f"output_dir {output_dir} already holds {what}; a new run would mix its metrics and checkpoints with it: "
            f"continue that run with --resume, start over with --overwrite (moves it to {output_dir}.old-<time>), "
            "or choose another output_dir")


def _move_aside(root: str) -> str:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    aside = f"{root}.old-{stamp}"
    n = 1
    while os.path.lexists(aside):
        n += 1
        aside = f"{root}.old-{stamp}-{n}"
    os.rename(root, aside)
    return aside


# ---- links ------------------------------------------------------------------------------------------------


def _refuse_link(path: str) -> None:
    if os.path.islink(path):
        raise OutputDirError(
            f"{path} is a symbolic link (to {os.readlink(path)}); fitune writes and deletes only real files inside "
            "output_dir and never through a link: remove the link, or choose another output_dir")


def _refuse_links_inside(folder: RunFolder) -> None:
    """Refuse at the start, not hours later at the end: the top level and the checkpoints folder."""
    for name in _listdir(folder.root):
        _refuse_link(os.path.join(folder.root, name))
    checkpoints = os.path.join(folder.root, "checkpoints")
    for name in _listdir(checkpoints):
        _refuse_link(os.path.join(checkpoints, name))


def _listdir(path: str) -> list[str]:
    return sorted(os.listdir(path)) if os.path.isdir(path) and not os.path.islink(path) else []


# ---- durable writes ---------------------------------------------------------------------------------------

_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def write_file_atomic(folder: RunFolder, name: str, text: str, newest: str | None = "") -> str:
    """Write `root/name` as `name.tmp` (created fresh, no link followed), fsync it, rename it over `name`.

    Raises:
        OutputDirError: the write failed (a full disk); `newest` as in `write_failed_message`.
    """
    final = folder.inside(name)
    tmp = folder.inside(name + ".tmp")
    if os.path.lexists(tmp):
        os.unlink(tmp)  # unlinks a link itself, never its target
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW, 0o644)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:  # a full disk: `name` is untouched; the partial .tmp goes (a retry finds no stray file)
        os.unlink(tmp)
        raise OutputDirError(write_failed_message(final, exc, newest)) from None
    os.replace(tmp, final)  # replaces a link at `final` itself, never writes through it
    fsync_dir(folder.root)
    return final


def fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | _O_NOFOLLOW)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str) -> None:
    """Make a rename or a new entry in `path` durable (no-op where folders cannot be opened, e.g. Windows)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover - some filesystems refuse fsync on a folder
        pass
    finally:
        os.close(fd)


def fsync_tree(path: str) -> None:
    """fsync every file of a folder, then the folder: its contents are on disk before it is renamed into place."""
    for dirpath, dirnames, filenames in os.walk(path):
        for name in filenames:
            file = os.path.join(dirpath, name)
            if not os.path.islink(file):
                fsync_file(file)
        for name in dirnames:
            fsync_dir(os.path.join(dirpath, name))
    fsync_dir(path)


def _line_step(line: str) -> int:
    try:
        return int(json.loads(line).get("step", 0))
    except (ValueError, AttributeError, TypeError):
        return 0  # not a step's line: kept


# ---- the lock ---------------------------------------------------------------------------------------------


def _acquire_lock(root: str) -> int | None:
    """flock output_dir itself and `root/fitune.lock` (both released by the kernel when the process dies, so a
    stale file is simply taken over); fitune.lock carries our pid for the message a second run gets."""
    try:
        import fcntl  # noqa: F401
    except ImportError:  # pragma: no cover - Windows: no advisory locks; one run per folder is on the user
        log.warning("no file locking on this platform: do not start two runs in %s", root)
        return None
    dir_fd = _lock_dir(root)
    try:
        fd = _lock_file(root)
    except BaseException:
        os.close(dir_fd)
        raise
    if fd is not None:
        _DIR_LOCKS[fd] = dir_fd
    return fd


_DIR_LOCKS: dict[int, int] = {}
"""fd of a held fitune.lock -> fd of its output_dir, flock-ed too: deleting fitune.lock cannot let a second run in."""


def _lock_dir(root: str) -> int:
    """flock output_dir's own inode: unlike fitune.lock it cannot be deleted while the run holds it."""
    fd = os.open(root, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        pid = _flock_holder_pid(os.fstat(fd))
        os.close(fd)
        holder = _holder_from_file(root)
        if pid is not None and holder.get("pid") != pid:
            holder = {"pid": pid}  # fitune.lock was deleted or replaced: the kernel still knows who holds the folder
        raise OutputDirError(_in_use_message(root, holder)) from None
    return fd


def _flock_holder_pid(st: os.stat_result) -> int | None:
    """The pid holding a flock on the file `st` describes, from /proc/locks (Linux); None where unknown."""
    want = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open("/proc/locks", encoding="ascii", errors="replace") as f:
            for line in f:
                fields = line.split()
                if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == want and fields[4].isdigit():
                    return int(fields[4])
    except OSError:
        pass
    return None


def _holder_from_file(root: str) -> dict:
    path = os.path.join(root, LOCK_FILE)
    try:
        fd = os.open(path, os.O_RDONLY | _O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return {}
    try:
        holder = _read_holder(fd)
        for _ in range(200):  # the holder writes its pid just after taking the lock: wait for it (<= 1 s)
            if holder.get("pid"):
                break
            time.sleep(0.005)
            holder = _read_holder(fd)
        return holder
    finally:
        os.close(fd)


def _in_use_message(root: str, holder: dict) -> str:
    who = "another process"
    if holder.get("pid"):
        who = f"pid {holder.get('pid')}"
        if holder.get("host"):
            who += f" on {holder.get('host')}, started {holder.get('started')}"
    return (f"output_dir {root} is in use by another fitune run ({who}); one run per output_dir: wait for it to "
            "finish or stop it, or choose another output_dir")


def _lock_file(root: str) -> int | None:
    """flock `root/fitune.lock` and write our pid into it for the message a second run gets."""
    path = os.path.join(root, LOCK_FILE)
    for _ in range(5):
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | _O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o644)
        except OSError as exc:
            _refuse_link(path)
            raise OutputDirError(f"cannot create the lock file {path}: {exc}; check output_dir's permissions") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise OutputDirError(_in_use_message(root, _holder_from_file(root))) from None
        try:
            same_file = os.fstat(fd).st_ino == os.lstat(path).st_ino
        except FileNotFoundError:
            same_file = False
        if not same_file:  # the run before us removed the file between our open and our flock: take the new one
            os.close(fd)
            continue
        stale = _read_holder(fd)
        if stale and stale.get("pid") != os.getpid():
            print(f"fitune: taking over the lock of {root} left by pid {stale.get('pid')} (no longer running)",
                  file=sys.stderr)
        me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
        return fd
    raise OutputDirError(f"could not lock {path}: it keeps being replaced; is another program cleaning output_dir?")


def _read_holder(fd: int) -> dict:
    try:
        holder = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
        return holder if isinstance(holder, dict) else {}
    except (ValueError, UnicodeDecodeError, OSError):
        return {}


def _release_lock(root: str, fd: int | None) -> None:
    if fd is None:
        return
    path = os.path.join(root, LOCK_FILE)
    try:
        if os.fstat(fd).st_ino == os.lstat(path).st_ino:
            os.unlink(path)  # while still locked: a waiting run then opens a new file, never our unlinked one
    except OSError:
        pass
    os.close(fd)
    dir_fd = _DIR_LOCKS.pop(fd, None)
    if dir_fd is not None:
        os.close(dir_fd)  # the folder's lock goes last: nobody gets in between the two

"""Writing and reading the files a user names, safely: one place for every writer and reader outside a run folder.

Writing (`write_text_atomic`, `write_bytes_atomic`, `atomic_writer` for streamed writers, `atomic_folder` for a
folder of files, `write_keeping_previous` for `plan --write`):
  - the new contents go to a temporary file created with O_EXCL | O_NOFOLLOW under an unpredictable name in the
    target's folder (`tempfile.mkstemp`), so a symbolic link planted at any name fitune might use is never
    followed, and the file is fsync-ed before it is renamed over the target: the target is either the old file
    or the complete new one, never half of either;
  - the target is refused unless it is a regular file or absent (a symbolic link, FIFO, socket, device or folder
    is named as such), when the writer starts and again just before the rename;
  - a failed write (a full disk, a permission) removes the temporary file, leaves the old target as it was and
    raises one message naming the target and the error.

Reading (`open_regular`, `read_text_regular`): a file is opened with O_NONBLOCK (a FIFO nobody writes to does not
block the open) and fstat must show a regular file (not a FIFO, socket or device, which would block or never end)
before anything is read; a file found inside a folder (`within=`) may not be a link out of that folder.

Every refusal is an `UnsafeFileError` (a FituneError: the CLI prints it and exits 2). Pure Python: no torch.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
import tempfile
from typing import IO, Iterator

try:
    import fcntl
except ImportError:  # Windows: no fcntl, and no O_NONBLOCK to clear (_O_NONBLOCK is 0)
    fcntl = None

from .errors import FituneError

_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


class UnsafeFileError(FituneError):
    """A file fitune was asked to write or read that is not a regular file (a link, a pipe, a device, a folder), or
    a write that failed; the message names the path, what it is and what to do."""

    def __init__(self, message: str, *, path: str | None = None):
        super().__init__(message)
        self.path = path


# ---- what a path is ------------------------------------------------------------------------------------------


def kind_of(mode: int) -> str:
    """'a symbolic link', 'a named pipe (FIFO)', 'a character device', ... for an `st_mode`."""
    for test, name in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a named pipe (FIFO)"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a folder"), (stat.S_ISREG, "a regular file")):
        if test(mode):
            return name
    return "not a regular file"


def _link_text(path: str) -> str:
    try:
        return f" (to {os.readlink(path)})"
    except OSError:
        return ""


def check_target(path: str, what: str) -> None:
    """Raise UnsafeFileError unless `path` is absent or a regular file (checked without following a link).

    Args:
        path: the file about to be written (replaced).
        what: how the user named it, for the message: "--html", "--write", "-o", "--out".
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise UnsafeFileError(f"{what} {path}: cannot be checked ({exc.strerror or exc}); check the path and its "
                              "permissions", path=path) from None
    if stat.S_ISREG(st.st_mode):
        return
    kind = kind_of(st.st_mode)
    if stat.S_ISLNK(st.st_mode):
        fix = ("fitune never writes through a link; give the file it points to by its own name, or remove the link "
               "and run again")
        kind += _link_text(path)
    elif stat.S_ISDIR(st.st_mode):
        fix = "give the name of a file (inside it, or elsewhere)"
    else:
        fix = ("writing there would wait forever, fail, or replace it with a regular file; give the name of a "
               "regular file (a new one, or one fitune may replace)")
    raise UnsafeFileError(f"{what} {path} is {kind}, not a regular file: {fix}", path=path)


def same_file(a: str, b: str) -> bool:
    """Whether `a` and `b` name the same existing file (through any path, link or hard link)."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.abspath(a) == os.path.abspath(b)


# ---- writing -------------------------------------------------------------------------------------------------


def _new_file_mode(existing: str) -> int:
    """The permissions the written file gets: the replaced file's, else what `open(path, "w")` would give."""
    try:
        return stat.S_IMODE(os.stat(existing, follow_symlinks=False).st_mode)
    except OSError:
        return 0o666 & ~_umask()


def _umask() -> int:
    try:  # Linux shows it without changing it; os.umask must set it to read it
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    old = os.umask(0o022)
    os.umask(old)
    return old


def write_failed(path: str, what: str, exc: OSError) -> UnsafeFileError:
    """The message for a write of `path` that failed with `exc`: the file, the error, that the old file stayed."""
    reason = exc.strerror or str(exc)
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        fix = "free some space (or write elsewhere) and run again"
    elif exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        fix = "write somewhere this user may write, or fix the permissions"
    else:
        fix = "check the path, its permissions and the free space, then run again"
    kept = "it was left as it was" if os.path.lexists(path) else "nothing was written"
    return UnsafeFileError(f"{what} {path}: could not write it ({reason}); {kept}, no temporary file remains: {fix}",
                           path=path)


def _fsync_dir(folder: str) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY | _O_CLOEXEC)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems cannot sync a folder; the rename itself is atomic
    finally:
        os.close(fd)


def _remove(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


@contextlib.contextmanager
def atomic_writer(path: str, *, what: str = "--out", binary: bool = True) -> Iterator[IO]:
    """A file object whose contents replace `path` whole when the block ends without an exception.

    The data go to `.NAME.XXXXXXXX.tmp` beside `path` (mkstemp: O_EXCL, unpredictable, never a link), which is
    flushed, fsync-ed, checked to be still ours, and renamed over `path`; the target is checked to be absent or a
    regular file before the first byte and again before the rename. The writer may close the file object itself
    (GGUFWriter does). On any exception the temporary file is removed and `path` keeps its old contents; an
    OSError of the write becomes one UnsafeFileError naming `path`.

    Raises:
        UnsafeFileError: `path` is a link, FIFO, socket, device or folder; or the write failed.
    """
    check_target(path, what)
    folder = os.path.dirname(os.path.abspath(path)) or "."
    try:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    except OSError as exc:
        raise write_failed(path, what, exc) from None
    try:
        try:
            os.fchmod(fd, _new_file_mode(path))
            with os.fdopen(os.dup(fd), "wb" if binary else "w", **({} if binary else {"encoding": "utf-8"})) as f:
                yield f
            os.fsync(fd)  # our own descriptor: the data are on disk before the name points at them
            mine = os.fstat(fd)
        finally:
            os.close(fd)
        now = os.lstat(tmp)
        if (now.st_dev, now.st_ino) != (mine.st_dev, mine.st_ino):  # someone replaced our temporary file
            raise UnsafeFileError(f"{what} {path}: the temporary file {tmp} was replaced while fitune wrote it; "
                                  "nothing was written: write somewhere no other user can write", path=path)
        check_target(path, what)  # it may have become a link or a pipe while we wrote
        os.replace(tmp, path)
    except OSError as exc:
        _remove(tmp)
        if exc.filename not in (None, tmp, path):
            raise  # the writer failed to read one of its own inputs: that file's error, not ours
        raise write_failed(path, what, exc) from None
    except BaseException:
        _remove(tmp)
        raise
    _fsync_dir(folder)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def write_bytes_atomic(path: str, data: bytes, *, what: str = "--out") -> str:
    """Replace `path` whole with `data` (see `atomic_writer`); returns `path`."""
    with atomic_writer(path, what=what) as f:
        f.flush()
        _write_all(f.fileno(), data)  # os.write: no buffer between the data and the error of a full disk
    return path


def write_text_atomic(path: str, text: str, *, what: str = "--html") -> str:
    """Replace `path` whole with `text` as UTF-8 (see `atomic_writer`); returns `path`.

    Raises:
        UnsafeFileError: `path` is a link, FIFO, socket, device or folder; or the write failed (the old file stays).
    """
    return write_bytes_atomic(path, text.encode("utf-8"), what=what)


def _keep_aside(path: str, what: str) -> str:
    """A second name for the current `path` (a hard link, else a copy made with O_EXCL): `PATH.bak`, `PATH.bak.1`,
    ...; `path` itself is not touched, so it survives whatever happens to the new write."""
    n = 0
    while True:
        kept = f"{path}.bak" if n == 0 else f"{path}.bak.{n}"
        try:
            os.link(path, kept, follow_symlinks=False)
            return kept
        except FileExistsError:
            n += 1
            continue
        except OSError as exc:
            if exc.errno not in (errno.EPERM, errno.EXDEV, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP):
                raise write_failed(path, what, exc) from None
        try:
            out = os.open(kept, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_CLOEXEC, 0o600)
        except FileExistsError:
            n += 1
            continue
        except OSError as exc:
            raise write_failed(path, what, exc) from None
        try:
            with open_regular(path, what=what, binary=True) as src:
                _write_all(out, src.read())
            os.fchmod(out, _new_file_mode(path))
        except OSError as exc:
            os.close(out)
            _remove(kept)
            raise write_failed(path, what, exc) from None
        os.close(out)
        return kept


def write_keeping_previous(path: str, text: str, *, what: str = "--write") -> str | None:
    """Write `text` to `path` whole and keep what was there: an existing file with other contents stays under its
    name until the new one replaces it, and is kept as the first free `PATH.bak`, `PATH.bak.1`, ... (a hard link
    or a copy made before the rename). If the write fails, `path` keeps its old contents and no `.bak` or
    temporary file is left. Returns the name the old file was kept under, or None (none, or the same contents).

    Raises:
        UnsafeFileError: `path` is a link, FIFO, socket, device or folder; or the write failed.
    """
    check_target(path, what)
    kept = None
    if os.path.lexists(path):
        try:
            with open_regular(path, what=what) as f:
                same = f.read() == text
        except (OSError, UnicodeDecodeError):
            same = False
        if not same:
            kept = _keep_aside(path, what)
    try:
        write_text_atomic(path, text, what=what)
    except BaseException:
        if kept is not None:
            _remove(kept)  # the old file is still `path`: no second copy of it left behind
        raise
    return kept


def open_output_stream(path: str, *, what: str = "--out") -> IO:
    """`path` opened for writing text line by line (output a user may read while it grows, kept when the command is
    interrupted): created or truncated, never through a link (O_NOFOLLOW), and refused unless it is a regular file
    (O_NONBLOCK: a FIFO without a reader fails at once instead of waiting; a device is refused before a byte).

    Raises:
        UnsafeFileError: `path` is a link, FIFO, socket, device or folder, or cannot be opened.
    """
    check_target(path, what)
    flags = os.O_WRONLY | os.O_CREAT | _O_NOFOLLOW | _O_NONBLOCK | _O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o666)
    except OSError as exc:
        check_target(path, what)  # a link or a pipe planted since: say so
        raise write_failed(path, what, exc) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeFileError(f"{what} {path} is {kind_of(st.st_mode)}, not a regular file: give the name of a "
                                  "regular file", path=path)
        os.ftruncate(fd, 0)  # only now: a regular file, ours to replace
        if _O_NONBLOCK:
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~_O_NONBLOCK)
        return os.fdopen(fd, "w", encoding="utf-8")
    except BaseException:
        os.close(fd)
        raise


@contextlib.contextmanager
def atomic_folder(path: str, *, what: str = "--out") -> Iterator[str]:
    """A fresh temporary folder beside `path` (mkdtemp: unpredictable, never a link) to write a folder's files
    into; when the block ends without an exception it takes the place of `path`, which must be absent or an empty
    folder (not a link, a file or anything else). On an exception the temporary folder is removed.

    Raises:
        UnsafeFileError: `path` is a link, a file, a pipe, a device or a folder that is not empty.
    """
    check_folder_target(path, what)
    parent = os.path.dirname(os.path.abspath(path).rstrip(os.sep)) or "."
    try:
        tmp = tempfile.mkdtemp(dir=parent, prefix=f".{os.path.basename(os.path.abspath(path))}.", suffix=".tmp")
        os.chmod(tmp, 0o777 & ~_umask())
    except OSError as exc:
        raise write_failed(path, what, exc) from None
    try:
        yield tmp
        check_folder_target(path, what)
        if os.path.isdir(path):
            os.rmdir(path)  # empty (checked): the complete folder takes its place
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync_dir(parent)


def check_folder_target(path: str, what: str) -> None:
    """Raise UnsafeFileError unless `path` is absent or an empty real folder (not a link to one)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        names = sorted(os.listdir(path))
        if not names:
            return
        raise UnsafeFileError(f"{what} {path} exists and is not empty ({', '.join(names[:5])}"
                              f"{', ...' if len(names) > 5 else ''}); write into a new or empty folder: choose "
                              f"another {what}, or remove that folder first", path=path)
    kind = kind_of(st.st_mode) + (_link_text(path) if stat.S_ISLNK(st.st_mode) else "")
    raise UnsafeFileError(f"{what} {path} is {kind}, not a folder: give a new folder's name (fitune never writes "
                          "through a link)", path=path)


# ---- reading -------------------------------------------------------------------------------------------------


def _inside(path: str, folder: str) -> bool:
    real, root = os.path.realpath(path), os.path.realpath(folder)
    return real == root or real.startswith(root.rstrip(os.sep) + os.sep)


def open_regular(path: str, *, what: str = "INPUT", binary: bool = False, encoding: str = "utf-8",
                 errors: str | None = None, within: str | None = None) -> IO:
    """`path` opened for reading, once it is known to be a regular file: opened with O_NONBLOCK (a FIFO does not
    block the open) and checked with fstat (a FIFO, socket or device is refused before a byte is read: reading it
    would wait forever or never end). A link the user named is followed to a regular file; with `within`, a file
    found inside that folder may not be a link out of it.

    Raises:
        UnsafeFileError: not a regular file, a link out of `within`.
        FileNotFoundError, IsADirectoryError, PermissionError: as open() (callers word those themselves).
    """
    if within is not None and not _inside(path, within):
        raise UnsafeFileError(f"{what} {path} is a symbolic link{_link_text(path)} out of {within}: fitune reads "
                              f"only the files inside it; replace the link with the file itself", path=path)
    if os.path.isdir(path):
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
    fd = os.open(path, os.O_RDONLY | _O_NONBLOCK | _O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeFileError(f"{what} {path} is {kind_of(st.st_mode)}, not a regular file: reading it would "
                                  "wait forever or never end; pass a regular file", path=path)
        if _O_NONBLOCK:
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~_O_NONBLOCK)
        if binary:
            return os.fdopen(fd, "rb")
        return os.fdopen(fd, "r", encoding=encoding, errors=errors)
    except BaseException:
        os.close(fd)
        raise


def check_regular(path: str, what: str = "INPUT") -> None:
    """Raise UnsafeFileError when `path` exists and is not a regular file (after following links): for files a
    library opens by name (safetensors, transformers), where a FIFO would block it forever."""
    try:
        st = os.stat(path)
    except OSError:
        return  # missing or unreadable: the reader says so in its own words
    if not stat.S_ISREG(st.st_mode):
        raise UnsafeFileError(f"{what} {path} is {kind_of(st.st_mode)}, not a regular file: reading it would wait "
                              "forever or never end; pass a regular file", path=path)


def read_text_regular(path: str, *, what: str = "INPUT", errors: str | None = None, within: str | None = None) -> str:
    """The whole UTF-8 text of `path`, read through `open_regular` (same checks, same errors)."""
    with open_regular(path, what=what, errors=errors, within=within) as f:
        return f.read()

"""A run's identity beyond its config: what the base weights and the training data files hold.

Recorded in run.json at a fresh start (`"identity"`), compared on `--resume`: the config names the same paths, but
weights replaced in place, or data edited so that each record keeps its token count, would be resumed silently.

What is hashed (SHA-256), per file:
    a file of at most FULL_HASH_BYTES (1 GiB)   its whole content ("sha256:<hex>")
    a larger file                               its size, first and last EDGE_BYTES (16 MiB) and mtime
                                                ("partial:<hex>"): a compromise, so that a resume of a 70B model
                                                does not read 140 GB; a replacement that keeps the size, both ends
                                                and the mtime is not seen
Base weights: a model file itself (.gguf, .safetensors, ...), or the *.safetensors / *.bin / *.gguf / *.pt files at
the top of a model folder. Data: data.path, a file or every regular file under a folder.

A Hub id (a model, or a data set) is read from its snapshot in the Hub cache (`snapshots/<commit>`), whose files are
links to content-addressed blobs (`blobs/<sha256>` for LFS files, the git blob id otherwise): the identity records
the snapshot's commit (`"@revision"`) and each file's blob name (`"blob:<name>"`), so a new revision pulled into the
cache, or a blob replaced in place, is seen without reading the weights again. A Hub id not in the cache when the run
starts (it is downloaded at load) is recorded as `"@revision": "not cached at the start"`: that kind is not compared
on resume (what was downloaded is unknown to the record), a stated limit.
"""

from __future__ import annotations

import hashlib
import os
import re
import stat

from ..data import hub as data_hub, read as data_read
from ..errors import ConfigError
from ..specs import sources
from ..units import GiB, MiB

FULL_HASH_BYTES = 1 * GiB
EDGE_BYTES = 16 * MiB
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")
KINDS = {"base_weights": "the base model's weights", "data": "the training data"}
REVISION_KEY = "@revision"
NOT_CACHED = "not cached at the start"
_BLOB_NAME = re.compile(r"^[0-9a-f]{40}$|^[0-9a-f]{64}$")


def file_digest(path: str) -> str:
    """"sha256:<hex>" of a file's content, or "partial:<hex>" of size + both ends + mtime for one over 1 GiB."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))  # a FIFO: refused below, not waited on
    except OSError as exc:
        raise ConfigError(f"cannot read {path} to record the run's identity: {exc}") from None
    with open(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{path} is not a regular file (a FIFO or device); give a real file")
        digest = hashlib.sha256()
        if st.st_size <= FULL_HASH_BYTES:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
            return "sha256:" + digest.hexdigest()
        digest.update(f"{st.st_size}:{st.st_mtime_ns}:".encode())
        digest.update(f.read(EDGE_BYTES))
        f.seek(st.st_size - EDGE_BYTES)
        digest.update(f.read(EDGE_BYTES))
        return "partial:" + digest.hexdigest()


def _files(path: str, suffixes: tuple[str, ...] | None, recursive: bool) -> list[str]:
    if os.path.isfile(path):
        return [path]
    if not os.path.isdir(path):
        return []  # a Hub id: not a local path
    found = []
    for dirpath, dirnames, filenames in os.walk(path):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".")) if recursive else []
        found += [os.path.join(dirpath, n) for n in sorted(filenames)
                  if (suffixes is None or n.endswith(suffixes)) and os.path.isfile(os.path.join(dirpath, n))]
    return found


def _digests(path: str, suffixes, recursive: bool) -> dict[str, str]:
    files = _files(path, suffixes, recursive)
    return {os.path.relpath(f, path) if f != path else os.path.basename(f): file_digest(f) for f in files}


def _blob_digest(path: str) -> str:
    """"blob:<name>" for a Hub cache file linked to its content-addressed blob, else the file's own digest."""
    if os.path.islink(path):
        target = os.path.realpath(path)
        name = os.path.basename(target)
        if os.path.basename(os.path.dirname(target)) == "blobs" and _BLOB_NAME.match(name):
            return "blob:" + name
    return file_digest(path)


def _hub_digests(snapshot: str | None, suffixes, recursive: bool) -> dict[str, str]:
    """A Hub snapshot's identity: its commit and each file's blob name (see the module docstring)."""
    if snapshot is None:
        return {REVISION_KEY: NOT_CACHED}
    files = _files(snapshot, suffixes, recursive)
    found = {os.path.relpath(f, snapshot): _blob_digest(f) for f in files}
    found[REVISION_KEY] = os.path.basename(os.path.normpath(snapshot))
    return found


def model_digests(model: str) -> dict[str, str]:
    """The base weights' identity: a local file or folder hashed, a Hub id by its cached snapshot."""
    if sources.is_hub_id(model):
        return _hub_digests(sources.cached_hub_snapshot(model), WEIGHT_SUFFIXES, recursive=False)
    return _digests(model, WEIGHT_SUFFIXES, recursive=False)


def data_digests(data_path: str) -> dict[str, str]:
    """The training data's identity: a local file or folder hashed, a Hub data set id by its cached snapshot."""
    if not data_path:
        return {}
    if data_hub.is_hub_id(data_path, data_read.SUFFIXES):
        return _hub_digests(data_hub.cached_snapshot(data_path), None, recursive=True)
    return _digests(data_path, None, recursive=True)


def fingerprint(model: str, data_path: str) -> dict:
    """{"base_weights": {file: digest}, "data": {file: digest}}: see the module docstring for each kind of source."""
    return {"base_weights": model_digests(model), "data": data_digests(data_path)}


def changes(saved: dict, now: dict) -> list[str]:
    """One sentence per kind whose files differ: "the base model's weights changed since the run started (FILE)"."""
    found = []
    for kind, label in KINDS.items():
        before, after = saved.get(kind), now.get(kind)
        if not isinstance(before, dict) or before == after or before.get(REVISION_KEY) == NOT_CACHED:
            continue  # an earlier fitune's run.json, or a Hub id downloaded after the record: nothing to compare
        after = after if isinstance(after, dict) else {}
        changed = sorted(f for f in set(before) | set(after) if before.get(f) != after.get(f))
        names = ", ".join(changed[:3]) + (", ..." if len(changed) > 3 else "")
        found.append(f"{label} changed since the run started ({names})")
    return found


def check(saved: dict | None, now: dict, allow_changed: bool) -> list[str]:
    """Compare a run's recorded identity with the current one: returns what `--allow-changed` lets through.

    Raises:
        ConfigError: something changed and `allow_changed` is False; one problem per kind, naming the files.
    """
    found = changes(saved or {}, now)
    if found and not allow_changed:
        raise ConfigError([f"--resume: {what}; resume with --allow-changed to continue anyway, or start a new run "
                           "with --overwrite" for what in found])
    return [f"--allow-changed: {what}; continuing anyway" for what in found]

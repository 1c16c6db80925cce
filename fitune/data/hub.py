"""Hugging Face Hub data set ids (`data.path: tatsu-lab/alpaca`), read through `datasets` from the local cache.

A `data.path` of the form ORG/NAME that is not an existing local path is a Hub data set id. When the Hub cache holds
a snapshot of it (`hf download ORG/NAME --repo-type dataset` put it there, or an earlier download), `datasets` reads
that snapshot folder as a local data set: its README's `configs:` (the subsets, `data.subset`) and splits
(`data.split`) are honoured and nothing touches the network. Otherwise, online, `datasets.load_dataset(ORG/NAME)`
downloads it; offline (HF_HUB_OFFLINE or HF_DATASETS_OFFLINE set), it is one DataError naming the download command.

Why the snapshot and not `load_dataset("ORG/NAME")` offline: datasets 5's offline mode reads only its own cache of
prepared Arrow files (`CachedDatasetModuleFactory` in datasets/load.py), never the Hub cache `hf download` fills.

The cache is located from the environment at call time, as huggingface_hub does at import
(huggingface_hub/constants.py): HF_HUB_CACHE, else HF_HOME/hub, else $XDG_CACHE_HOME/huggingface/hub, else
~/.cache/huggingface/hub. Pure Python until a data set is opened; `datasets` is imported then.
"""

from __future__ import annotations

import os
from typing import Any, Iterator

from ..datasource import HUB_ID, is_hub_id  # noqa: F401 - defined below the spine (fitune.config reads them)
from ..errors import DataError

DEFAULT_SPLIT = "train"
"""The split read when data.split is not given."""
_TRUE = ("1", "on", "yes", "true")


def offline() -> bool:
    """HF_HUB_OFFLINE or HF_DATASETS_OFFLINE is set to a true value (1, ON, YES, TRUE), read now."""
    return any(os.environ.get(name, "").strip().lower() in _TRUE for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


def hub_cache_dir() -> str:
    """The Hub cache folder, from the environment as huggingface_hub reads it (see the module docstring)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.path.expanduser(os.environ["HF_HUB_CACHE"])
    return os.path.join(_hf_home(), "hub")


def datasets_cache_dir() -> str:
    """Where `datasets` writes the Arrow files it prepares: HF_DATASETS_CACHE, else HF_HOME/datasets (datasets/
    config.py), read now rather than at datasets' import."""
    if os.environ.get("HF_DATASETS_CACHE"):
        return os.path.expanduser(os.environ["HF_DATASETS_CACHE"])
    return os.path.join(_hf_home(), "datasets")


def _hf_home() -> str:
    if os.environ.get("HF_HOME"):
        return os.path.expanduser(os.environ["HF_HOME"])
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(xdg, "huggingface")


def cached_snapshot(repo_id: str, revision: str = "main") -> str | None:
    """The snapshot folder of data set `repo_id` in the Hub cache (datasets--ORG--NAME/snapshots/<commit>, the
    commit read from refs/<revision>), or None when it is not cached."""
    repo = os.path.join(hub_cache_dir(), "datasets--" + repo_id.replace("/", "--"))
    ref = os.path.join(repo, "refs", revision)
    try:
        with open(ref, encoding="utf-8") as f:
            commit = f.read().strip()
    except OSError:
        return None
    snapshot = os.path.join(repo, "snapshots", commit)
    return snapshot if commit and os.path.isdir(snapshot) else None


def download_command(repo_id: str) -> str:
    return f"hf download {repo_id} --repo-type dataset"


def open_hub_dataset(repo_id: str, split: str = DEFAULT_SPLIT, subset: str | None = None,
                     streaming: bool = False) -> Any:
    """The split `split` of subset `subset` of Hub data set `repo_id`: a `datasets.Dataset`, or with streaming an
    `IterableDataset` that reads the cached files lazily.

    Raises:
        DataError: datasets is not installed; the data set is not cached and the Hub is offline (the message gives
            the download command); the subset or split does not exist (the message lists those that do); the data
            set does not exist on the Hub.
    """
    try:
        # datasets: optional, imported where used (estimate, plan and doctor SCRIPT never load it)
        import datasets
    except ImportError:
        raise DataError(f"{repo_id}: reading a Hugging Face Hub data set needs the datasets package, which is not "
                        "installed; run `pip install datasets`", path=repo_id) from None
    snapshot = cached_snapshot(repo_id)
    if snapshot is None and offline():
        raise DataError(
            f"{repo_id}: not a local file or folder, and not a data set in the Hugging Face cache "
            f"({hub_cache_dir()}); the Hub is offline (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE), so it cannot be "
            f"downloaded now. Download it where there is network: `{download_command(repo_id)}` (then point HF_HOME "
            "or HF_HUB_CACHE at that cache), or fix data.path if it is meant to be a local file",
            path=repo_id,
        )
    where = snapshot or repo_id  # a cached snapshot is read as a local folder: no network
    try:
        return datasets.load_dataset(where, name=subset, split=split, streaming=streaming,
                                     cache_dir=None if streaming else datasets_cache_dir())
    except ValueError as exc:  # unknown config ("BuilderConfig 'x' not found") or split ("Unknown split")
        raise DataError(f"{repo_id}: {_choices_message(datasets, where, subset, split, exc)}", path=repo_id) from None
    except Exception as exc:  # DatasetNotFoundError, ConnectionError, FileNotFoundError, ...: all "cannot read it"
        raise DataError(
            f"{repo_id}: not a local file or folder, and datasets cannot load it from the Hub ({type(exc).__name__}: "
            f"{exc}); check the id on huggingface.co/datasets, download it with `{download_command(repo_id)}`, or fix "
            "data.path if it is meant to be a local file",
            path=repo_id,
        ) from None


def _choices_message(datasets: Any, where: str, subset: str | None, split: str, exc: Exception) -> str:
    """What to say about an unknown subset or split: the subsets and splits the data set has."""
    try:
        subsets = datasets.get_dataset_config_names(where)
    except Exception:  # noqa: BLE001 - only used to make the message better
        subsets = []
    if subset is not None and subsets and subset not in subsets:
        return f"has no subset {subset!r}; its subsets: {', '.join(subsets)} (set data.subset to one)"
    try:
        splits = datasets.get_dataset_split_names(where, subset)
    except Exception:  # noqa: BLE001
        splits = []
    if splits and split not in splits:
        return f"has no split {split!r}; its splits: {', '.join(splits)} (set data.split to one)"
    if subset is None and len(subsets) > 1:
        return f"has several subsets and none was chosen ({exc}); set data.subset to one of {', '.join(subsets)}"
    return f"datasets cannot load it ({exc})"


def iter_rows(dataset: Any) -> Iterator[tuple[int, dict]]:
    """(1-based row, row) of a `datasets` Dataset or IterableDataset, one at a time."""
    for i, row in enumerate(dataset, start=1):
        yield i, dict(row)

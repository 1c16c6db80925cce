"""What several commands share: the TrainSetup flags (generated from the schema) and reading a config file."""

from __future__ import annotations

import argparse
import os

from ..config import config_keys_in
from ..errors import ConfigError
from ..files import check_target, write_keeping_previous as write
from ..schema import Problems, add_arguments, load_config_file, values_from_args
from ..setup import DEFAULT_SETUP, SETUP_KEYS, TrainSetup
from ..units import gib


def add_setup_arguments(p: argparse.ArgumentParser, *, model: bool = True, config: bool = True,
                        skip: tuple[str, ...] = ()) -> None:
    """MODEL, `--config FILE.yaml` and one flag per TrainSetup field (fitune/setup.py declares them).

    Flags not given leave the config file's value (or the default) in place: flags always win over the file."""
    if model:
        p.add_argument("model", nargs="?", metavar="MODEL", help="catalog name (llama-3.1-8b), Hugging Face id "
                       "(meta-llama/Llama-3.1-8B), config.json, or model folder")
    if config:
        p.add_argument("--config", metavar="FILE.yaml", help="a fitune train config: its model and setup keys "
                       "(method, lora, seq_len, ...) are used; flags given here override them")
    add_arguments(p, SETUP_KEYS, skip=skip, defaults=DEFAULT_SETUP.to_dict() | {"lora_targets": DEFAULT_SETUP.lora_targets},
                  group_title="training setup (same names as the fitune train config's keys)")


def setup_and_model(args, default_stack: str | None = None) -> tuple[str | None, TrainSetup, dict[str, str]]:
    """(model, TrainSetup, origin) from `--config` (when given) with the flags applied on top.

    `origin` maps each field set by the file to "yaml" and each set by a flag to "flag", for error messages."""
    model = getattr(args, "model", None)
    base = DEFAULT_SETUP if default_stack is None else DEFAULT_SETUP.replace(stack=default_stack)
    origin: dict[str, str] = {}
    if getattr(args, "config", None):
        file_model, values = config_keys_in(load_config_file(args.config), args.config)
        base = TrainSetup(**{"stack": "fitune", **values})  # a train config describes fitune's runner
        origin.update({f: "yaml" for f in values})
        model = model or file_model
    problems = Problems()
    flags = values_from_args(args, SETUP_KEYS, problems)
    problems.raise_if_any()
    origin.update({f: "flag" for f in flags})
    return model, base.replace(**flags), origin


def write_keeping_previous(path: str, text: str, flag: str = "--write") -> str | None:
    """Write `text` to `path` whole and keep an earlier file with other contents as `PATH.bak` (`.bak.1`, ...), so a
    hand-edited plan is never lost to a second `fitune plan --write`; the old file keeps its name until the new
    one is complete (fitune/files.py `write_keeping_previous`). Returns the name it was kept under, or None."""
    return write(path, text, what=flag)


def check_output_file(path: str, flag: str, make_parents: bool = False) -> None:
    """Refuse, before any work is done, an output file that cannot be written: an empty name, anything but a
    regular file in its place (a symbolic link, a FIFO, a socket, a device, a folder), a path under a file, a
    missing folder (unless the writer makes it: `make_parents`) or one this user cannot write."""
    if not path or not path.strip():
        raise ConfigError(f"{flag} needs a file name, got {path!r}")
    check_target(path, flag)  # a link, pipe, device or folder: refused before any work (and again when written)
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise ConfigError(f"{flag} {path} exists and is not writable by this user; choose another file")
    folder = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(folder):
        if not make_parents:
            raise ConfigError(f"{flag} {path}: the folder {folder} does not exist; create it (mkdir -p {folder}) or "
                              "write somewhere else")
        folder = os.path.dirname(folder)
    if not os.path.isdir(folder):
        raise ConfigError(f"{flag} {path}: {folder} is a file, not a folder; choose another path")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag} {path}: the folder {folder} is not writable by this user; write somewhere else")


def kernel_images_said(gpu, fmt=gib) -> str:
    """`, X for the step once the run's kernels load (Y)` after a GPU's allocator budget, when the two differ
    (fitune/specs/gpu.py `kernel_images_bytes`); "" otherwise."""
    images = gpu.allocator_budget_bytes - gpu.training_budget_bytes
    if not images:
        return ""
    return f", {fmt(gpu.training_budget_bytes)} for the step once the run's kernels load ({fmt(images)})"

"""`check_script`: read a training script's syntax tree (never run it) and apply every rule."""

from __future__ import annotations

import ast
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .findings import Finding, ScriptError, sort_findings
from .index import ScriptIndex

if TYPE_CHECKING:
    from ..specs.gpu import GpuSpec
    from .extract import ScriptSetup
    from .fixes import Diagnosis


def check_script(path: str) -> list[Finding]:
    """All findings for the script at `path`, sorted by line.

    Raises:
        ScriptError: the file is missing, is a folder, is not UTF-8 text, or is not valid Python.
    """
    return check_source(read_script(path), path)


def check_source(source: str, filename: str = "<script>", setup_overrides: dict | None = None,
                 model: str | None = None) -> list[Finding]:
    """All findings for Python `source`, sorted by line. Raises ScriptError when it does not parse.

    `setup_overrides` (TrainSetup field -> value) and `model` (a catalog name) stand in for what the script does not
    say; findings quote estimates of the script's own setup with them."""
    ix = index_source(source, filename, setup_overrides, model)
    try:
        return _findings(ix)
    except RecursionError:
        raise _unreadable(filename) from None


def index_source(source: str, filename: str = "<script>", setup_overrides: dict | None = None,
                 model: str | None = None, gpu: str | None = None) -> ScriptIndex:
    """The script's `ScriptIndex` (with its extracted setup on demand). Raises ScriptError when it does not parse."""
    try:
        tree = ast.parse(source, filename=filename)
    except SyntaxError as exc:
        where = f" at line {exc.lineno}" if exc.lineno else ""
        raise ScriptError(f"{filename} is not a Python script: {exc.msg}{where}; `fitune doctor "
                          "SCRIPT` reads a training script (.py), `fitune doctor --data FILE` reads data") from exc
    except ValueError as exc:  # CPython 3.11: "source code string cannot contain null bytes"
        raise ScriptError(f"{filename} is not a Python script: {exc}; `fitune doctor SCRIPT` reads a training script "
                          "(.py)") from None
    except (RecursionError, MemoryError):  # CPython's parser on an expression nested thousands of levels deep
        raise _unreadable(filename) from None
    try:
        return ScriptIndex.build(tree, setup_overrides, model, gpu)
    except RecursionError:  # the syntax tree parsed but is too deep for the rules' recursive walk
        raise _unreadable(filename) from None


def _unreadable(filename: str) -> ScriptError:
    return ScriptError(f"{filename}: fitune doctor cannot read this script: it nests too deeply (an expression "
                       "thousands of levels deep, as generated code has); check the file, or split the expression")


@dataclass(frozen=True)
class ScriptReport:
    """What `fitune doctor SCRIPT` reports: the setup read from the script, its estimate on a GPU with the fixes
    that make it fit (None when the script loads no model and none was named), and the rule findings."""

    path: str
    findings: list[Finding]
    script: "ScriptSetup | None"
    diagnosis: "Diagnosis | None"


def diagnose_script(path: str, gpu: "GpuSpec", setup_overrides: dict | None = None,
                    model: str | None = None) -> ScriptReport:
    """Read the script at `path` (never run it): its setup, estimate and fixes on `gpu`, and its findings.

    Raises:
        ScriptError: the file cannot be read or parsed.
        ConfigError / UnknownModelError: the setup (with the overrides) is not one fitune can estimate.
    """
    from .fixes import diagnose

    ix = index_source(read_script(path), path, setup_overrides, model, gpu.name)
    try:
        script = ix.script_setup
        estimated = script.model_id is not None or model is not None
        diagnosis = diagnose(script, gpu) if estimated else None
        findings = _findings(ix)
    except RecursionError:
        raise _unreadable(path) from None
    return ScriptReport(path, findings, script if estimated else None, diagnosis)


def _findings(ix: ScriptIndex) -> list[Finding]:
    from .rules import ALL_RULES

    findings: list[Finding] = []
    for rule in ALL_RULES:
        findings.extend(rule(ix))
    return sort_findings(_dedupe(findings))


#: The largest script `fitune doctor` reads (bytes): training scripts are a few KiB; generated code may be large.
MAX_SCRIPT_BYTES = 16 << 20


def read_script(path: str) -> str:
    if not os.path.exists(path):
        raise ScriptError(f"{path}: no such file; pass the path of your training script, e.g. fitune doctor train.py")
    if os.path.isdir(path):
        raise ScriptError(f"{path} is a folder; pass one training script (.py)")
    if not os.path.isfile(path):  # a pipe or a device: opening it could wait forever
        raise ScriptError(f"{path} is not a regular file (a pipe or a device?); pass one training script (.py)")
    if os.path.getsize(path) > MAX_SCRIPT_BYTES:
        raise ScriptError(f"{path}: {os.path.getsize(path):,} bytes is too large for a training script (at most "
                          f"{MAX_SCRIPT_BYTES:,}); pass the script, not its data")
    with open(path, "rb") as f:
        raw = f.read()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise ScriptError(f"{path} is not UTF-8 text (line {line}, byte offset {exc.start}); "
                          "is it a Python script?") from exc


def _dedupe(findings: list[Finding]) -> list[Finding]:
    """One finding per (rule, line): a line with two fp16 calls says it once."""
    seen, out = set(), []
    for f in findings:
        if (f.rule, f.line) not in seen:
            seen.add((f.rule, f.line))
            out.append(f)
    return out

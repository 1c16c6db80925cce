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
    return _findings(index_source(source, filename, setup_overrides, model))


def index_source(source: str, filename: str = "<script>", setup_overrides: dict | None = None,
                 model: str | None = None, gpu: str | None = None) -> ScriptIndex:
    """The script's `ScriptIndex` (with its extracted setup on demand). Raises ScriptError when it does not parse."""
    try:
        tree = ast.parse(source, filename=filename)
    except SyntaxError as exc:
        raise ScriptError(f"{filename} is not a Python script: {exc.msg} at line {exc.lineno}; `fitune doctor "
                          "SCRIPT` reads a training script (.py), `fitune doctor --data FILE` reads data") from exc
    return ScriptIndex.build(tree, setup_overrides, model, gpu)


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
    script = ix.script_setup
    estimated = script.model_id is not None or model is not None
    diagnosis = diagnose(script, gpu) if estimated else None
    return ScriptReport(path, _findings(ix), script if estimated else None, diagnosis)


def _findings(ix: ScriptIndex) -> list[Finding]:
    from .rules import ALL_RULES

    findings: list[Finding] = []
    for rule in ALL_RULES:
        findings.extend(rule(ix))
    return sort_findings(_dedupe(findings))


def read_script(path: str) -> str:
    if not os.path.exists(path):
        raise ScriptError(f"{path}: no such file; pass the path of your training script, e.g. fitune doctor train.py")
    if os.path.isdir(path):
        raise ScriptError(f"{path} is a folder; pass one training script (.py)")
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

"""`check_script`: read a training script's syntax tree (never run it) and apply every rule."""

from __future__ import annotations

import ast
import os

from .findings import Finding, ScriptError, sort_findings
from .index import ScriptIndex


def check_script(path: str) -> list[Finding]:
    """All findings for the script at `path`, sorted by line.

    Raises:
        ScriptError: the file is missing, is a folder, is not UTF-8 text, or is not valid Python.
    """
    return check_source(read_script(path), path)


def check_source(source: str, filename: str = "<script>") -> list[Finding]:
    """All findings for Python `source`, sorted by line. Raises ScriptError when it does not parse."""
    from .rules import ALL_RULES

    try:
        tree = ast.parse(source, filename=filename)
    except SyntaxError as exc:
        raise ScriptError(f"{filename} is not a Python script: {exc.msg} at line {exc.lineno}; `fitune doctor "
                          "SCRIPT` reads a training script (.py), `fitune doctor --data FILE` reads data") from exc
    ix = ScriptIndex.build(tree)
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

"""`check_script`: read a training script's syntax tree (never run it) and apply every rule."""

from __future__ import annotations

import ast
import dataclasses
import os
import re
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..schema import int_digits, too_many_digits
from .extract import extract_setup
from .findings import Finding, ScriptError, sort_findings
from .index import ScriptIndex
from .notebook import NOTEBOOK_SUFFIX, Notebook, read_notebook

if TYPE_CHECKING:
    from ..specs.gpu import GpuSpec
    from .extract import ScriptSetup
    from .fixes import Diagnosis


def check_script(path: str) -> list[Finding]:
    """All findings for the script (or notebook) at `path`, sorted by line. In a notebook, `line` counts the lines
    of its code cells joined (`read_source(path).where(line)` says "cell 3, line 2"), and the messages name cells.

    Raises:
        ScriptError: the file is missing, is a folder, is not UTF-8 text, is data, or is not valid Python.
    """
    src = read_source(path)
    ix = index_source(src.text, path, notebook=src.notebook)
    try:
        return relabel_findings(_findings(ix), src.notebook)
    except RecursionError:
        raise _unreadable(path) from None


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
                 model: str | None = None, gpu: str | None = None, notebook: Notebook | None = None) -> ScriptIndex:
    """The script's `ScriptIndex` (with its extracted setup on demand). Raises ScriptError when it does not parse.
    `notebook`: the notebook `source` was joined from, so that a syntax error names its cell."""
    try:
        tree = ast.parse(source, filename=filename)
    except (SyntaxError, ValueError) as exc:  # ValueError (3.11): "source code string cannot contain null bytes"
        long_number = _too_long_literal(source) if "Exceeds the limit" in str(exc) else None
        if long_number is not None:  # a 5,000-digit literal: CPython's message names neither line nor fix
            line, digits = long_number
            where = notebook.where(line) if notebook else f"line {line}"
            raise ScriptError(f"{filename}, {where}: {too_many_digits(digits)}; Python itself cannot run this "
                              "script (write the number in hexadecimal, or as a product)") from None
        if isinstance(exc, ValueError):
            raise ScriptError(f"{filename} is not a Python script: {exc}; {SCRIPT_HINT}") from None
        where = "" if not exc.lineno else f" at {notebook.where(exc.lineno)}" if notebook else f" at line {exc.lineno}"
        what = "a notebook of Python code" if notebook else "a Python script"
        raise ScriptError(f"{filename} is not {what}: {exc.msg}{where}; {SCRIPT_HINT}") from exc
    except (RecursionError, MemoryError):  # CPython's parser on an expression nested thousands of levels deep
        raise _unreadable(filename) from None
    huge = _unprintable_literal(tree)
    if huge is not None:  # `0x` and 3,600 hex digits parse, but no message or fix could write the number
        line, digits = huge
        where = notebook.where(line) if notebook else f"line {line}"
        raise ScriptError(f"{filename}, {where}: {too_many_digits(digits)}; no setting of a training script is "
                          "that large: check the literal")
    try:
        return ScriptIndex.build(tree, setup_overrides, model, gpu, read_setup=extract_setup)
    except RecursionError:  # the syntax tree parsed but is too deep for the rules' recursive walk
        raise _unreadable(filename) from None


def _too_long_literal(source: str) -> tuple[int, int] | None:
    """(line, digits) of the first integer literal longer than Python converts (sys.get_int_max_str_digits(): the
    ValueError ast.parse raises for it names neither), or None."""
    limit = sys.get_int_max_str_digits()
    for m in re.finditer(r"(?<![\w.])[0-9][0-9_]{%d,}" % limit, source):
        digits = len(m.group(0).replace("_", ""))
        if digits > limit:
            return source.count("\n", 0, m.start()) + 1, digits
    return None


def _unprintable_literal(tree: ast.AST) -> tuple[int, int] | None:
    """(line, digits) of an integer literal that str() refuses (more than sys.get_int_max_str_digits() digits once
    written in decimal: a hexadecimal literal gets there), or None."""
    for node in ast.walk(tree):
        value = getattr(node, "value", None) if isinstance(node, ast.Constant) else None
        if isinstance(value, int) and value.bit_length() > 14_000 and int_digits(value) > sys.get_int_max_str_digits():
            return node.lineno, int_digits(value)
    return None


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
    source: "ScriptSource | None" = None
    """The text the rules read; for a notebook, its code cells joined, with where each line came from."""


def diagnose_script(path: str, gpu: "GpuSpec", setup_overrides: dict | None = None,
                    model: str | None = None) -> ScriptReport:
    """Read the script at `path` (never run it): its setup, estimate and fixes on `gpu`, and its findings.

    Raises:
        ScriptError: the file cannot be read or parsed.
        ConfigError / UnknownModelError: the setup (with the overrides) is not one fitune can estimate.
    """
    # the command's library: imported when it runs, so that `fitune --help` stays light
    from .fixes import diagnose

    src = read_source(path)
    ix = index_source(src.text, path, setup_overrides, model, gpu.name, src.notebook)
    try:
        script = ix.script_setup
        estimated = script.model_id is not None or model is not None
        diagnosis = diagnose(script, gpu) if estimated else None
        findings = relabel_findings(_findings(ix), src.notebook)
    except RecursionError:
        raise _unreadable(path) from None
    return ScriptReport(path, findings, script if estimated else None, diagnosis, src)


def relabel_findings(findings: list[Finding], notebook: Notebook | None) -> list[Finding]:
    """In a notebook, the findings' messages, fixes and evidence with "line 12" written as "cell 3, line 2"; their
    `line` stays the line of the joined source (sorting and the JSON's `cell` are made from it)."""
    if notebook is None:
        return findings
    return [dataclasses.replace(f, message=notebook.relabel(f.message), fix=notebook.relabel(f.fix),
                                evidence=notebook.relabel(f.evidence)) for f in findings]


def _findings(ix: ScriptIndex) -> list[Finding]:
    from .rules import ALL_RULES

    findings: list[Finding] = []
    for rule in ALL_RULES:
        findings.extend(rule(ix))
    return sort_findings(_dedupe(findings))


#: The largest script `fitune doctor` reads (bytes): training scripts are a few KiB; generated code may be large.
MAX_SCRIPT_BYTES = 16 << 20


@dataclass(frozen=True)
class ScriptSource:
    """A script's Python text as the rules read it; for a notebook, also where each line came from."""

    path: str
    text: str
    notebook: "Notebook | None" = None

    def where(self, line: int) -> str:
        """"line 12" in a script, "cell 3, line 2" in a notebook."""
        return self.notebook.where(line) if self.notebook else f"line {line}"


#: What a file is by its suffix when it is not a script, and the command that reads it ({path}: the file).
NOT_PYTHON = {
    **{s: ("data", "`fitune doctor --data {path} --tokenizer DIR` checks data (DIR: the model folder whose tokenizer "
                   "the training uses)") for s in (".json", ".jsonl", ".csv", ".tsv", ".parquet", ".arrow")},
    ".txt": ("text (or plain-text data)", "`fitune doctor --data {path} --tokenizer DIR` checks a data file; "
             "`fitune doctor SCRIPT` reads a training script (.py) or a notebook (.ipynb)"),
    ".md": ("Markdown", "`fitune doctor SCRIPT` reads a training script (.py) or a notebook (.ipynb)"),
    **{s: ("a YAML config", "`fitune estimate --config {path}` estimates the setup it describes and `fitune train "
                            "{path}` runs it") for s in (".yaml", ".yml")},
}
SCRIPT_HINT = ("`fitune doctor SCRIPT` reads a training script (.py) or a notebook (.ipynb); `fitune doctor --data "
               "FILE --tokenizer DIR` checks data")
"""The closing hint of every "not a Python script" message."""


def read_script(path: str) -> str:
    """The Python text of the script (or notebook: its code cells joined) at `path`. Raises ScriptError."""
    return read_source(path).text


def read_source(path: str) -> ScriptSource:
    """The script at `path` as the rules read it: a .py file's text, or a notebook's code cells joined.

    Raises:
        ScriptError: missing, a folder, too large, not UTF-8, a data / text / YAML file, or a broken notebook.
    """
    suffix = os.path.splitext(path)[1].lower()
    if suffix in NOT_PYTHON and os.path.isfile(path):
        what, hint = NOT_PYTHON[suffix]
        raise ScriptError(f"{path} is {what}, not a Python script: {hint.format(path=path)}")
    text = _read_text(path)
    if suffix == NOTEBOOK_SUFFIX:
        nb = read_notebook(path, text)
        return ScriptSource(path, nb.source, nb)
    return ScriptSource(path, text)


def _read_text(path: str) -> str:
    if not os.path.exists(path):
        raise ScriptError(f"{path}: no such file; pass the path of your training script, e.g. fitune doctor train.py")
    if os.path.isdir(path):
        raise ScriptError(f"{path} is a folder; pass one training script (.py) or notebook (.ipynb)")
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

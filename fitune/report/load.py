"""Reading a report's input: the JSON a command printed with --json (a file or stdin), or a run folder."""

from __future__ import annotations

import json
import os
import sys

from ..errors import FituneError
from ..files import read_text_regular
from .check import check_numbers
from .train import read_run

KINDS = ("estimate", "plan", "profile", "train", "doctor")

_SIGNATURE = {  # keys that tell the documents apart (docs/reference.md's / docs/plan.md's JSON output)
    "plan": ("plans", "request"),
    "profile": ("estimate", "difference_bytes"),
    "estimate": ("breakdown", "peak_phase"),
}


def guess_kind(doc) -> str | None:
    """Which command printed `doc`: plan, profile, estimate or doctor; None when none matches."""
    if isinstance(doc, list):
        return "doctor" if all(isinstance(x, dict) and "rule" in x for x in doc) else None
    if not isinstance(doc, dict):
        return None
    if "findings" in doc:
        return "doctor"
    for kind, keys in _SIGNATURE.items():
        if all(k in doc for k in keys):
            return kind
    return None


def read_json(source: str, what: str = "INPUT"):
    """A JSON document from a file, or from stdin when `source` is "-". NaN is accepted (fitune writes it for a
    step that never ran)."""
    try:
        if source == "-":
            text = sys.stdin.read()
            name = "stdin"
        else:
            text = read_text_regular(source, what=what)  # a FIFO or a device is refused, never waited on
            name = source
    except FileNotFoundError:
        raise FituneError(f"{what} {source}: no such file; write one with e.g. "
                          "`fitune estimate llama-3.1-8b --gpu rtx4090 --json > estimate.json`") from None
    except IsADirectoryError:
        raise FituneError(f"{what} {source} is a folder; only `fitune report train` takes a run folder") from None
    except UnicodeDecodeError:
        raise FituneError(f"{what} {source} is not UTF-8 text (a binary file?); pass what a fitune command printed "
                          "with --json") from None
    except OSError as exc:
        raise FituneError(f"{what} {source}: cannot be read ({exc.strerror or exc})") from None
    if not text.strip():
        raise FituneError(f"{what} {name} is empty; pass the output of a command run with --json")
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise FituneError(f"{what} {name} is not JSON ({exc.msg} at line {exc.lineno}); pass what a fitune command "
                          "printed with --json (its text output is not JSON)") from None
    except ValueError as exc:  # an integer of more than 4,300 digits (Python's limit on reading one)
        raise FituneError(f"{what} {name} holds a number no fitune output holds ({exc}); pass what a fitune "
                          "command printed with --json") from None


def check_kind(kind: str, doc, source: str, flag: str | None = None) -> None:
    """Raise a FituneError when `doc` is not the JSON of `fitune KIND --json`, naming the kind it looks like."""
    if kind not in KINDS:
        raise FituneError(f"unknown report {kind!r}; known: {', '.join(KINDS)}")
    ok = guess_kind(doc) == kind or (kind == "estimate" and isinstance(doc, dict) and "peak_allocated_bytes" in doc
                                     and guess_kind(doc) is None)
    if kind == "profile" and isinstance(doc, dict) and "oom" in doc and "phases" in doc:
        ok = True
    if kind == "doctor" and doc == []:
        ok = True
    if ok:
        return
    looks = guess_kind(doc)
    if looks and flag:
        hint = f"; it looks like `fitune {looks} --json`"
    elif looks:
        hint = f"; it looks like `fitune {looks} --json`: run `fitune report {looks} {source}`"
    else:
        hint = "; pass what the command printed with --json"
    raise FituneError(f"{flag + ' ' if flag else ''}{source} is not the JSON of `fitune {kind} --json`{hint}")


def load_document(kind: str, source: str, measured: str | None = None, script: str | None = None) -> dict | list:
    """The document `render_html(kind, ...)` takes, read from `source` (JSON file, "-" for stdin, or for
    `train` a run folder). `script`: the doctor's script, whose text the report shows."""
    if kind == "train":
        return read_run(source)
    doc = read_json(source)
    check_kind(kind, doc, "stdin" if source == "-" else source)
    check_numbers(doc, kind, "stdin" if source == "-" else source)
    if kind == "doctor":
        # the command's library: imported when it runs, so that `fitune --help` stays light
        from .doctor import as_doc

        path = script or (doc.get("script") if isinstance(doc, dict) else None)
        return as_doc(doc, path, read_source(path) if path else None)
    return doc


def read_source(path: str) -> str:
    """The text of the doctor's script (`--script`, or the path its findings name); a FIFO or device is refused."""
    if not os.path.isfile(path):
        raise FituneError(f"--script {path}: no such file (the script the doctor's findings are about)")
    return read_text_regular(path, what="--script", errors="replace")

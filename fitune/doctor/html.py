"""`fitune doctor SCRIPT --html FILE`: the whole answer as one self-contained page, as the text output gives it.

The page is fitune report's doctor page (`fitune.report.doctor.render`, the one renderer `fitune report doctor`
uses too), drawn from the `--json` document; this module only adds what the live doctor knows and the document
does not carry: the script's text (a notebook's code cells), why each stated field has its value, and the measured
evidence behind a "fits only with allocator retries" verdict. Pure Python.
"""

from __future__ import annotations

import os

from ..files import write_text_atomic
from ..report import render_html
from .evidence import retries_verdict_evidence


def page_document(report, doc: dict) -> dict:
    """`doc` (the `--json` document of a `ScriptReport`, already located in cells for a notebook) with what the page
    shows beside it: `source` or `cells`, `setup.why`, `verdict_note` (see `fitune.report.doctor.as_doc`)."""
    src = report.source
    notebook = src.notebook if src is not None else None
    page = dict(doc, script=report.path)
    if notebook is not None:
        page["cells"] = [list(cell) for cell in notebook.cells]
    elif src is not None:
        page["source"] = src.text
    if report.script is not None and doc.get("setup"):
        relabel = notebook.relabel if notebook is not None else (lambda text: text)
        why = {f: relabel(r.why) for f, r in report.script.fields.items() if not r.assumed}
        page["setup"] = dict(doc["setup"], why=why)
    est = doc.get("estimate") or {}
    if est.get("fits") and est.get("retries_expected"):
        page["verdict_note"] = retries_verdict_evidence(doc.get("gpu"))
    return page


def script_page(report, doc: dict) -> str:
    """The page for a `ScriptReport` and its `--json` document `doc` (already located in cells for a notebook)."""
    return render_html("doctor", page_document(report, doc))


def write_script_page(path: str, report, doc: dict) -> str:
    """Write the page to `path`, replacing the file whole (a browser reloading it never sees half a page)."""
    text = script_page(report, doc)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    write_text_atomic(path, text, what="--html")  # a fresh temp file in the folder, never a link or a device
    return path

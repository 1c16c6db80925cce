"""`fitune doctor SCRIPT --html FILE`: the whole answer as one self-contained page, as the text output gives it.

In order: the setup as written (each field with its lines; then what was assumed and the flag that sets it), the
estimate of that step on the GPU (breakdown, phase peaks, the verdict: fits or does not fit), the ranked fixes with
their lines to change, fitune plan's best on fitune's own runner, and the findings on the script's lines (in a
notebook, under each code cell). The estimate and findings sections are fitune.report's own (`fitune report
estimate` / `fitune report doctor` draw them the same way); every number carries its path in the `--json` document
(`data-key`, relative to its section: `estimate.` for the estimate's, e.g. `breakdown.weights`). Pure Python.
"""

from __future__ import annotations

import os

from .notebook import Notebook
from .report import setup_rows


def script_page(report, doc: dict) -> str:
    """The page for a `ScriptReport` and its `--json` document `doc` (already located in cells for a notebook)."""
    from ..report.charts import HATCH_DEFS
    from ..report.html import esc, page

    src = report.source
    notebook = src.notebook if src is not None else None
    out = [f"<h1>fitune doctor: {esc(report.path)}</h1>",
           f'<p class="sub">read, never run; judged on the {esc(doc.get("gpu"))}</p>']
    if report.script is not None and doc.get("estimate"):
        out.append(_setup_section(report, notebook))
        out.append(_estimate_section(doc["estimate"]))
        out.append(_fixes_section(doc, report.diagnosis))
    else:
        out.append("<p>No model load found, so no estimate (name one with <code>--model</code>, e.g. "
                   "<code>--model llama-3.1-8b</code>).</p>")
    out.append(_findings_section(doc, src, notebook))
    return page(f"fitune doctor: {report.path}", "doctor", HATCH_DEFS + "\n".join(out))


def write_script_page(path: str, report, doc: dict) -> str:
    """Write the page to `path`, replacing the file whole (a browser reloading it never sees half a page)."""
    from ..files import write_text_atomic

    text = script_page(report, doc)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    write_text_atomic(path, text, what="--html")  # a fresh temp file in the folder, never a link or a device
    return path


def _setup_section(report, notebook: Notebook | None) -> str:
    from ..report.html import esc

    script = report.script
    rows = setup_rows(script, notebook)
    kind = "notebook" if notebook is not None else "script"
    out = [f'<h2 id="setup">As written ({esc(script.style)} {kind})</h2>',
           '<table class="setup"><tr><th>field</th><th>value</th><th>where</th><th>why</th></tr>']
    for i, r in enumerate(rows):
        if r.assumed and (i == 0 or not rows[i - 1].assumed):
            out.append('<tr><th colspan="4">not in the script (assumed; the flag sets it)</th></tr>')
        where = f"<code>{esc(r.where)}</code>" if r.assumed else esc(r.where)
        out.append(f'<tr data-field="{esc(r.field)}" data-assumed="{str(r.assumed).lower()}"><td>{esc(r.label)}</td>'
                   f'<td data-value="{esc(r.value)}"><b>{esc(r.value)}</b></td><td class="nowrap">{where}</td>'
                   f"<td>{esc(r.why)}</td></tr>")
    out.append("</table>")
    notes = [notebook.relabel(n) if notebook is not None else n for n in script.notes]
    if notes:
        out.append("<ul class=\"notes\">" + "".join(f"<li>note: {esc(n)}</li>" for n in notes) + "</ul>")
    return "\n".join(out)


def _estimate_section(estimate: dict) -> str:
    """fitune report's estimate page (bars, breakdown, phases, verdict), its title made a section heading."""
    from ..report.estimate import render

    _, body = render(estimate)
    title = body[body.index("<h1>") + 4: body.index("</h1>")]
    body = _retitle(body, f'<h2 id="estimate">{title}</h2>')
    return f'<section data-doc-prefix="estimate.">{body}</section>'


def _fixes_section(doc: dict, diagnosis) -> str:
    from ..report.html import esc, num_bytes, num_value

    fixes = doc.get("fixes") or []
    gpu = doc.get("gpu")
    out = []
    est = doc.get("estimate") or {}
    if est.get("fits") and est.get("retries_expected"):
        from .evidence import retries_verdict_evidence

        out.append(f'<p class="notes">{esc(retries_verdict_evidence(gpu))}</p>')
    if diagnosis is not None and diagnosis.needs_fix:
        out.append(f'<h2 id="fixes">What to change so that it fits the {esc(gpu)}</h2>')
        if fixes:
            speed = doc.get("tokens_per_s")
            out.append(f'<p class="sub">ranked as <code>fitune plan</code> ranks plans; predicted {esc(gpu)} '
                       f'tokens/s, as written {num_value(speed, "tokens_per_s", _per_s(speed))} if it fit</p>'
                       '<ol class="fixes">')
            for i, f in enumerate(fixes):
                retries = ", allocator retries" if f.get("retries_expected") else ""
                edits = "".join(f"<li><code>{esc(e)}</code></li>" for e in f.get("edits") or [])
                cost = f'<div class="notes">cost: {esc(f["cost"])}</div>' if f.get("cost") not in (None, "none") else ""
                out.append(f'<li data-fix="{i}"><b data-key="fixes.{i}.change">{esc(f["change"])}</b>: '
                           f'{num_bytes(f["peak_allocated_bytes"], f"fixes.{i}.peak_allocated_bytes")} allocated, '
                           f'{num_bytes(f["peak_reserved_bytes"], f"fixes.{i}.peak_reserved_bytes")} reserved'
                           f'{retries}; {num_value(f["tokens_per_s"], f"fixes.{i}.tokens_per_s", _per_s(f["tokens_per_s"]))} '
                           f'tokens/s ({f["speed_change"]:+.0%})<ul>{edits}</ul>{cost}</li>')
            out.append("</ol>")
        else:
            out.append(f"<p>No change to this script that fitune tries makes it fit the {esc(gpu)}.</p>")
    plan = doc.get("plan")
    if plan:
        out.append('<h2 id="plan">On fitune\'s own runner</h2>'
                   f'<p><code>{esc(plan["command"])}</code> &rarr; {esc(plan["plan"])}, '
                   f'{num_bytes(plan["peak_reserved_bytes"], "plan.peak_reserved_bytes")} reserved, '
                   f'{num_value(plan["tokens_per_s"], "plan.tokens_per_s", _per_s(plan["tokens_per_s"]))} '
                   "tokens/s (then <code>--write plan.yaml</code> and <code>fitune train plan.yaml</code>, or "
                   "<code>--emit hf</code>)</p>")
    return "\n".join(out)


def _retitle(body: str, heading: str) -> str:
    """A fitune.report page body with its <h1> title replaced by `heading`: here it is one section of a page."""
    start, end = body.index("<h1>"), body.index("</h1>") + len("</h1>")
    return body[:start] + heading + body[end:]


def _per_s(x) -> str:
    return f"{x:,.0f}" if isinstance(x, (int, float)) else "n/a"


def _findings_section(doc: dict, src, notebook: Notebook | None) -> str:
    """The findings on their lines: fitune report's doctor page for a script; for a notebook, each code cell."""
    from ..report.doctor import render

    findings = doc.get("findings") or []
    if notebook is None:
        _, body = render({"script": doc.get("script"), "findings": findings,
                          "source": src.text if src is not None else None})
        return _retitle(body, '<h2 id="findings">Findings</h2>')
    return _notebook_findings(findings, notebook, doc.get("script") or notebook.path)


def _notebook_findings(findings: list[dict], notebook: Notebook, path: str) -> str:
    from ..report.doctor import _finding, render
    from ..report.html import esc

    _, head = render({"script": path, "findings": findings})  # the counts line, as for a script
    head = head[: head.index("</div>") + len("</div>")] if "</div>" in head else head
    out = [_retitle(head, '<h2 id="findings">Findings</h2>')]
    placed: set[int] = set()
    for cell, text in notebook.cells:
        out.append(f'<h3 id="cell{cell}">cell {cell}</h3><div class="src" data-cell="{cell}">')
        for n, line in enumerate(text.rstrip("\n").split("\n"), 1):  # a closing newline is no line
            hits = [i for i, f in enumerate(findings) if f.get("cell") == cell and f.get("line") == n]
            sev = min((findings[i].get("severity", "info") for i in hits),
                      key=lambda s: ("error", "warning", "info").index(s) if s in ("error", "warning", "info") else 9,
                      default="")
            cls = f" hit {esc(sev)}" if hits else ""
            out.append(f'<div class="ln{cls}" id="C{cell}L{n}" data-cell="{cell}" data-line="{n}">'
                       f'<span class="no">{n}</span><span class="code">{esc(line) or " "}</span></div>')
            for i in hits:
                out.append(_finding(findings[i], i))
                placed.add(i)
        out.append("</div>")
    rest = [i for i in range(len(findings)) if i not in placed]
    if rest:
        out.append("<h3>Findings not on a line of the notebook</h3>")
        out.extend(_finding(findings[i], i) for i in rest)
    return "\n".join(out)

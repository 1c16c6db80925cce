"""The `doctor` page, the one renderer of `fitune doctor SCRIPT --html` (fitune/doctor/html.py) and `fitune report
doctor FILE.json`: from `fitune doctor --json`'s document, in order, the setup as written (each field with its lines;
then what was assumed and the flag that sets it), the estimate of that step (fitune report's estimate page: bars,
breakdown, phases, the verdict), the ranked fixes with their lines to change, fitune plan's best on fitune's own
runner, and the findings on the script's lines (in a notebook, under each code cell). A bare findings list (or
`doctor --data`'s object) gives the findings alone. Every number carries its path in the document (`data-key`;
the estimate's relative to `estimate.`). Pure Python.
"""

from __future__ import annotations

from ..errors import FituneError
from .check import problems_in
from .estimate import render as render_estimate
from .html import esc, num_bytes, num_value

SEVERITY_ORDER = ("error", "warning", "info")
FIELD_LABELS = {"model": "model", "method": "method", "lora_rank": "LoRA rank", "lora_alpha": "LoRA alpha",
                "lora_dropout": "LoRA dropout", "lora_targets": "LoRA targets", "dtype": "dtype",
                "grad_checkpointing": "checkpointing", "attn": "attention", "optimizer": "optimizer",
                "batch_size": "micro-batch", "seq_len_tokens": "seq len (tokens)", "grad_accum": "grad accumulation",
                "keep_outputs": "output kept in backward"}
"""The setup fields `fitune doctor` shows, in order, with their labels (the text output's too)."""
LORA_FIELDS = ("lora_rank", "lora_alpha", "lora_dropout", "lora_targets")
"""Shown only for a LoRA or QLoRA setup."""


def as_doc(findings_or_doc, script: str | None = None, source: str | None = None) -> dict:
    """The page's document: `fitune doctor --json`'s document, or its findings list (or its --data object, which has
    "findings"), with `script` (the script's path) and `source` (its text) set when given.

    The live doctor (`fitune doctor --html`) adds what --json does not carry: `cells` ([cell number, text] of a
    notebook's code cells, shown instead of `source`), `setup.why` ({field: why} of the fields the script states)
    and `verdict_note` (the measured evidence behind a "fits only with allocator retries" verdict)."""
    if isinstance(findings_or_doc, list):
        doc = {"findings": findings_or_doc}
    else:
        doc = dict(findings_or_doc)
    if script is not None:
        doc["script"] = script
    if source is not None:
        doc["source"] = source
    return doc


def render(doc) -> tuple[str, str]:
    """(title, body) of the doctor page for `doc` (see `as_doc`)."""
    doc = as_doc(doc)
    script = doc.get("script") or doc.get("path") or "script"
    whole = "setup" in doc  # the whole `fitune doctor SCRIPT --json` document, not a findings list
    out = [f"<h1>fitune doctor: {esc(script)}</h1>"]
    if doc.get("gpu"):
        out.append(f'<p class="sub">read, never run; judged on the {esc(doc["gpu"])}</p>')
    if doc.get("setup") and doc.get("estimate"):
        _check_answer(doc, script)
        out += [_setup_section(doc["setup"], "cells" in doc), _estimate_section(doc["estimate"]), _fixes_section(doc)]
    elif whole:
        out.append("<p>No model load found, so no estimate (name one with <code>--model</code>, e.g. "
                   "<code>--model llama-3.1-8b</code>).</p>")
    out.append(_findings_section(doc, whole))
    return f"fitune doctor: {script}", "\n".join(out)


def _check_answer(doc: dict, script: str) -> None:
    """Raise one FituneError when the setup, estimate, fixes or plan of `doc` are not what `fitune doctor --json`
    writes (wrong types, numbers that are not numbers), instead of a traceback halfway through the page."""
    shapes = (("setup", dict, False), ("estimate", dict, False), ("fixes", list, True), ("plan", dict, True))
    found = [f"{key} is {type(doc.get(key)).__name__}, not {kind.__name__}" for key, kind, none_ok in shapes
             if not isinstance(doc.get(key), kind) and not (none_ok and doc.get(key) is None)]
    found += [f"fixes.{i} is not an object" for i, f in enumerate(doc.get("fixes") or []) if not isinstance(f, dict)]
    if not found:
        found = problems_in({k: doc.get(k) for k in ("estimate", "tokens_per_s", "fixes", "plan")})
    if found:
        raise FituneError(f"{script}: not the unedited JSON of `fitune doctor SCRIPT --json`: " + "; ".join(found)
                          + ". Pass what the command printed")


# ---- the setup as written ----------------------------------------------------------------------------------------
def setup_rows(setup: dict) -> list[dict]:
    """The rows of the setup as written, from --json's `setup`: the fields the script states (or a flag gives), then
    the ones assumed; each {field, label, value, where (its lines, "flag", or the flag that sets it), why, assumed}."""
    lora = setup.get("method") in ("lora", "qlora")
    origin, assumed = _mapping(setup, "origin"), _mapping(setup, "assumed")
    rows = []
    for is_assumed in (False, True):
        for f in (f for f in FIELD_LABELS if lora or f not in LORA_FIELDS):
            if (f in assumed) != is_assumed or (not is_assumed and origin.get(f) not in ("script", "flag")):
                continue
            value = setup.get("model") if f == "model" else _value_text(setup.get(f))
            if is_assumed:
                a = assumed[f] if isinstance(assumed[f], dict) else {}
                where, why = a.get("flag", ""), a.get("why", "")
            else:
                where = "flag" if origin[f] == "flag" else _where(setup, f)
                why = _mapping(setup, "why").get(f, "")
            rows.append({"field": f, "label": FIELD_LABELS[f], "value": value, "where": where, "why": why,
                         "assumed": is_assumed})
    return rows


def _mapping(setup: dict, key: str) -> dict:
    value = setup.get(key)
    return value if isinstance(value, dict) else {}


def _value_text(v) -> str:
    if isinstance(v, (list, tuple)):
        return ",".join(map(str, v))
    if isinstance(v, bool):
        return "yes" if v else "no"
    return str(v)


def _where(setup: dict, f: str) -> str:
    """Where field `f` is written: "line 4", "lines 3, 5"; in a notebook (`setup.cells` beside `setup.lines`)
    "cell 2, line 1 and cell 3, line 4"."""
    lines, cells = _mapping(setup, "lines").get(f), _mapping(setup, "cells").get(f) or []
    if not lines or not isinstance(lines, list):
        return ""
    if not isinstance(cells, list) or len(cells) != len(lines) or not all(isinstance(c, int) for c in cells):
        return ("line " if len(lines) == 1 else "lines ") + ", ".join(map(str, lines))
    by_cell: dict[int, list[int]] = {}
    for cell, line in zip(cells, lines):
        by_cell.setdefault(cell, []).append(line)
    return " and ".join(f"cell {c}, line{'s' if len(ls) > 1 else ''} {', '.join(map(str, ls))}"
                        for c, ls in by_cell.items())


def _setup_section(setup: dict, notebook: bool) -> str:
    rows = setup_rows(setup)
    kind = "notebook" if notebook else "script"
    out = [f'<h2 id="setup">As written ({esc(setup.get("style"))} {kind})</h2>',
           '<table class="setup"><tr><th>field</th><th>value</th><th>where</th><th>why</th></tr>']
    for i, r in enumerate(rows):
        if r["assumed"] and (i == 0 or not rows[i - 1]["assumed"]):
            out.append('<tr><th colspan="4">not in the script (assumed; the flag sets it)</th></tr>')
        where = f"<code>{esc(r['where'])}</code>" if r["assumed"] else esc(r["where"])
        out.append(f'<tr data-field="{esc(r["field"])}" data-assumed="{str(r["assumed"]).lower()}">'
                   f'<td>{esc(r["label"])}</td><td data-value="{esc(r["value"])}"><b>{esc(r["value"])}</b></td>'
                   f'<td class="nowrap">{where}</td><td>{esc(r["why"])}</td></tr>')
    out.append("</table>")
    notes = setup.get("notes") or []
    if notes:
        out.append("<ul class=\"notes\">" + "".join(f"<li>note: {esc(n)}</li>" for n in notes) + "</ul>")
    return "\n".join(out)


# ---- the estimate, the fixes, fitune's own runner ----------------------------------------------------------------
def _estimate_section(estimate: dict) -> str:
    """fitune report's estimate page (bars, breakdown, phases, verdict), its title made a section heading."""
    _, body = render_estimate(estimate)
    title = body[body.index("<h1>") + 4: body.index("</h1>")]
    body = _retitle(body, f'<h2 id="estimate">{title}</h2>')
    return f'<section data-doc-prefix="estimate.">{body}</section>'


def _fixes_section(doc: dict) -> str:
    fixes, gpu, est = doc.get("fixes") or [], doc.get("gpu"), doc.get("estimate") or {}
    out = []
    if est.get("fits") and est.get("retries_expected") and doc.get("verdict_note"):
        out.append(f'<p class="notes">{esc(doc["verdict_note"])}</p>')
    if not est.get("fits") or est.get("retries_expected"):  # the doctor's Diagnosis.needs_fix
        out.append(f'<h2 id="fixes">What to change so that it fits the {esc(gpu)}</h2>')
        if fixes:
            speed = doc.get("tokens_per_s")
            out.append(f'<p class="sub">ranked as <code>fitune plan</code> ranks plans; predicted {esc(gpu)} '
                       f'tokens/s, as written {num_value(speed, "tokens_per_s", _per_s(speed))} if it fit</p>'
                       '<ol class="fixes">')
            out += [_fix(i, f) for i, f in enumerate(fixes)]
            out.append("</ol>")
        else:
            out.append(f"<p>No change to this script that fitune tries makes it fit the {esc(gpu)}.</p>")
    plan = doc.get("plan")
    if plan:
        out.append('<h2 id="plan">On fitune\'s own runner</h2>'
                   f'<p><code>{esc(plan.get("command"))}</code> &rarr; {esc(plan.get("plan"))}, '
                   f'{num_bytes(plan.get("peak_reserved_bytes"), "plan.peak_reserved_bytes")} reserved, '
                   f'{num_value(plan.get("tokens_per_s"), "plan.tokens_per_s", _per_s(plan.get("tokens_per_s")))} '
                   "tokens/s (then <code>--write plan.yaml</code> and <code>fitune train plan.yaml</code>, or "
                   "<code>--emit hf</code>)</p>")
    return "\n".join(out)


def _fix(i: int, f: dict) -> str:
    retries = ", allocator retries" if f.get("retries_expected") else ""
    edits = "".join(f"<li><code>{esc(e)}</code></li>" for e in f.get("edits") or [])
    cost = f'<div class="notes">cost: {esc(f["cost"])}</div>' if f.get("cost") not in (None, "none") else ""
    change = f.get("speed_change")
    change = f"{change:+.0%}" if isinstance(change, (int, float)) else "n/a"
    return (f'<li data-fix="{i}"><b data-key="fixes.{i}.change">{esc(f.get("change"))}</b>: '
            f'{num_bytes(f.get("peak_allocated_bytes"), f"fixes.{i}.peak_allocated_bytes")} allocated, '
            f'{num_bytes(f.get("peak_reserved_bytes"), f"fixes.{i}.peak_reserved_bytes")} reserved'
            f'{retries}; {num_value(f.get("tokens_per_s"), f"fixes.{i}.tokens_per_s", _per_s(f.get("tokens_per_s")))} '
            f"tokens/s ({change})<ul>{edits}</ul>{cost}</li>")


def _retitle(body: str, heading: str) -> str:
    """A fitune.report page body with its <h1> title replaced by `heading`: here it is one section of a page."""
    start, end = body.index("<h1>"), body.index("</h1>") + len("</h1>")
    return body[:start] + heading + body[end:]


def _per_s(x) -> str:
    return f"{x:,.0f}" if isinstance(x, (int, float)) else "n/a"


# ---- the findings on their lines ---------------------------------------------------------------------------------
def _findings_section(doc: dict, whole: bool) -> str:
    """The finding counts, then the script (or each code cell of a notebook) with the findings under their lines,
    then the findings on no line; a bare list of findings when there is no source."""
    findings = doc.get("findings") or []
    counts = {s: sum(1 for f in findings if f.get("severity") == s) for s in SEVERITY_ORDER}
    count_text = ", ".join(f'<span data-severity="{s}" data-value="{n}">{n} {s}'
                           f'{"s" if n != 1 else ""}</span>' for s, n in counts.items() if n) or "no findings"
    worst = "bad" if counts["error"] else ("warn" if counts["warning"] else "ok")
    out = ['<h2 id="findings">Findings</h2>'] if whole else []
    out.append(f'<div class="verdict {worst}">{count_text}</div>')
    placed: set[int] = set()
    at: dict[tuple, list[int]] = {}  # (cell or None, line) -> the findings there
    for i, f in enumerate(findings):
        if f.get("line") is not None:
            at.setdefault((f.get("cell"), f["line"]), []).append(i)
    if doc.get("cells"):
        for cell, text in doc["cells"]:
            out.append(f'<h3 id="cell{cell}">cell {cell}</h3><div class="src" data-cell="{cell}">')
            out += _lines(findings, text.rstrip("\n").split("\n"), at, placed, cell)  # a closing newline is no line
            out.append("</div>")
        source = "notebook"
    elif doc.get("source") is not None:
        out.append('<h2>The script, with the findings on their lines</h2><div class="src">')
        out += _lines(findings, doc["source"].splitlines() or [""], at, placed)
        out.append("</div>")
        source = "script"
    else:
        source = None
    rest = [i for i in range(len(findings)) if i not in placed]
    if rest:
        tag = "h3" if source == "notebook" else "h2"  # a notebook's cells are h3 sections of its findings
        out.append("<h2>Findings</h2>" if source is None else f"<{tag}>Findings not on a line of the {source}</{tag}>")
        out.extend(_finding(findings[i], i) for i in rest)
    if not findings:
        out.append("<p>no findings</p>")
    return "\n".join(out)


def _lines(findings: list[dict], lines: list[str], at: dict[tuple, list[int]], placed: set[int],
           cell: int | None = None) -> list[str]:
    """The source lines (of one notebook cell when `cell` is given), each followed by its findings (`at`: (cell,
    line) -> their indexes, which are added to `placed`)."""
    out = []
    for n, text in enumerate(lines, 1):
        hits = at.get((cell, n), [])
        cls = ""
        if hits:
            sev = min((findings[i].get("severity", "info") for i in hits),
                      key=lambda s: SEVERITY_ORDER.index(s) if s in SEVERITY_ORDER else 9)
            cls = f" hit {esc(sev)}"
        ids = f'id="L{n}" data-line="{n}"' if cell is None else f'id="C{cell}L{n}" data-cell="{cell}" data-line="{n}"'
        out.append(f'<div class="ln{cls}" {ids}><span class="no">{n}</span>'
                   f'<span class="code">{esc(text) or " "}</span></div>')
        for i in hits:
            out.append(_finding(findings[i], i))
            placed.add(i)
    return out


def _finding(f: dict, i: int) -> str:
    sev = f.get("severity", "info")
    line = (f'line {num_value(f["line"], f"findings.{i}.line")}' if f.get("line") is not None else "the run")
    claims = f' <span class="notes">[{esc(", ".join(f["claims"]))}]</span>' if f.get("claims") else ""
    return (f'<div class="finding {esc(sev)}" data-finding="{i}" data-rule="{esc(f.get("rule"))}" '
            f'data-line="{esc(f.get("line") or "")}"><span class="sev {esc(sev)}">{esc(sev)}</span>'
            f'<span class="rule">{esc(f.get("rule"))}</span> <span class="notes">({line})</span>{claims}'
            f"<div>{esc(f.get('message', ''))}</div>"
            f"<div><b>fix:</b> <code>{esc(f.get('fix', ''))}</code></div>"
            f'<div class="notes"><b>evidence:</b> {esc(f.get("evidence", ""))}</div></div>')

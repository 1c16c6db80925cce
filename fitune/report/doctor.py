"""The `doctor` report: the script with each finding under its line (severity, message, fix, evidence)."""

from __future__ import annotations

from .html import esc, num_value

SEVERITY_ORDER = ("error", "warning", "info")


def as_doc(findings_or_doc, script: str | None = None, source: str | None = None) -> dict:
    """The report's document: {"script", "source", "findings"} from `fitune doctor --json`'s list (or its --data
    object, which has "findings"), the script's path and its text."""
    if isinstance(findings_or_doc, list):
        doc = {"findings": findings_or_doc}
    else:
        doc = dict(findings_or_doc)
    if script is not None:
        doc["script"] = script
    if source is not None:
        doc["source"] = source
    return doc


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


def render(doc) -> tuple[str, str]:
    doc = as_doc(doc)
    findings = doc.get("findings") or []
    script = doc.get("script") or doc.get("path") or "script"
    counts = {s: sum(1 for f in findings if f.get("severity") == s) for s in SEVERITY_ORDER}
    count_text = ", ".join(f'<span data-severity="{s}" data-value="{n}">{n} {s}'
                           f'{"s" if n != 1 else ""}</span>' for s, n in counts.items() if n) or "no findings"
    worst = "bad" if counts["error"] else ("warn" if counts["warning"] else "ok")
    out = [f"<h1>fitune doctor: {esc(script)}</h1>",
           f'<div class="verdict {worst}">{count_text}</div>']
    by_line: dict[int, list[int]] = {}
    for i, f in enumerate(findings):
        if f.get("line") is not None:
            by_line.setdefault(int(f["line"]), []).append(i)
    source = doc.get("source")
    placed: set[int] = set()
    if source is not None:
        out.append('<h2>The script, with the findings on their lines</h2><div class="src">')
        for n, text in enumerate(source.splitlines() or [""], 1):
            hits = by_line.get(n, [])
            cls = ""
            if hits:
                sev = min((findings[i].get("severity", "info") for i in hits),
                          key=lambda s: SEVERITY_ORDER.index(s) if s in SEVERITY_ORDER else 9)
                cls = f" hit {esc(sev)}"
            out.append(f'<div class="ln{cls}" id="L{n}" data-line="{n}"><span class="no">{n}</span>'
                       f'<span class="code">{esc(text) or " "}</span></div>')
            for i in hits:
                out.append(_finding(findings[i], i))
                placed.add(i)
        out.append("</div>")
    rest = [i for i in range(len(findings)) if i not in placed]
    if rest:
        out.append("<h2>" + ("Findings" if source is None else "Findings not on a line of the script") + "</h2>")
        out.extend(_finding(findings[i], i) for i in rest)
    if not findings:
        out.append("<p>no findings</p>")
    return f"fitune doctor: {script}", "\n".join(out)

"""Text for findings: one block per finding, sorted by line. Formatting only; the callers decide where it goes."""

from __future__ import annotations

import textwrap
from dataclasses import dataclass

from ..report.doctor import FIELD_LABELS, LORA_FIELDS  # the setup's fields and labels, one list for text and page
from ..units import gib
from .evidence import retries_verdict_evidence
from .findings import SEVERITIES, Finding, sort_findings

WIDTH = 110


def count_text(findings: list[Finding]) -> str:
    """"3 findings (1 error, 2 warnings)"."""
    if not findings:
        return "no findings"
    parts = []
    for sev in SEVERITIES:
        n = sum(f.severity == sev for f in findings)
        if n:
            parts.append(f"{n} {sev}" + ("s" if n > 1 and sev != "info" else ""))
    return f"{len(findings)} finding{'s' if len(findings) > 1 else ''} ({', '.join(parts)})"


def format_finding(f: Finding, source: str = "", notebook=None) -> str:
    """One finding as a block: `train.py:12: warning [rule]`, then message, fix and evidence. `notebook`: the
    `fitune.doctor.notebook.Notebook` the script was read from: its lines are written `train.ipynb: cell 3, line 2`."""
    if f.line is None:
        where = source or "run"
    elif notebook is not None:
        where = f"{source}: {notebook.where(f.line)}" if source else notebook.where(f.line)
    else:
        where = f"{source}:{f.line}" if source else f"line {f.line}"
    head = f"{where}: {f.severity} [{f.rule}]" + (f" ({', '.join(f.claims)})" if f.claims else "")
    body = [_wrap(f.message, "  ", "  "), _wrap(f.fix, "  fix: ", "       "),
            _wrap(f.evidence, "  evidence: ", "            ")]
    return "\n".join([head, *body])


def format_findings(findings: list[Finding], source: str = "", notebook=None) -> str:
    """All findings as blocks separated by a blank line, sorted by line."""
    return "\n\n".join(format_finding(f, source, notebook) for f in sort_findings(findings))


def _wrap(text: str, first: str, rest: str) -> str:
    return textwrap.fill(text, width=WIDTH, initial_indent=first, subsequent_indent=rest, break_on_hyphens=False,
                         break_long_words=False)


BAR_WIDTH = 40
STRATEGY_LABELS = {"max_length": "pad every record to {s}", "dynamic": "pad each batch of {b} to its longest",
                   "packing": "pack into rows of {s}"}


def format_data_report(report) -> str:
    """The data scan (a `fitune.doctor.data.DataReport`) as text: lengths, histogram, padding, findings."""
    st = report.length_stats()
    template = {"chat": " (chat template)" if report.chat_template else " (no chat template: role: content lines)"}
    lines = [f"{report.path}: {report.records:,} {report.format} records{template.get(report.format, ' (chat template)' if report.chat_template else '')}, "
             f"seq len {report.seq_len_tokens}, batch {report.batch_size}",
             f"tokens per record: min {st['min']}, median {st['median']:g}, mean {st['mean']:.1f}, p90 {st['p90']}, "
             f"p99 {st['p99']}, max {st['max']}", "", f"{'tokens':>13s} {'records':>8s}"]
    top = max(b.count for b in report.histogram) or 1
    for b in report.histogram:
        bar = "#" * max(1 if b.count else 0, round(BAR_WIDTH * b.count / top))
        note = ""
        if b.low_tokens > report.seq_len_tokens:
            note = f"  longer than {report.seq_len_tokens}: truncated"
        elif b.high_tokens > report.seq_len_tokens:
            note = f"  the records above {report.seq_len_tokens} are truncated"
        lines.append(f"{b.low_tokens:>6d}-{b.high_tokens:<6d} {b.count:>8,d}  {bar:<{BAR_WIDTH}s}{note}".rstrip())
    lines += ["", "padding over one epoch in file order (share of computed token positions that are padding):"]
    for p in report.padding:
        label = STRATEGY_LABELS[p.strategy].format(s=report.seq_len_tokens, b=report.batch_size)
        lines.append(f"  {label:40s} {100 * p.padding_share:5.1f} %  ({p.slot_tokens:,} positions for "
                     f"{p.real_tokens:,} real tokens)")
    n = report.truncated_records
    lines.append(f"truncated at {report.seq_len_tokens} tokens: {n:,} record{'' if n == 1 else 's'}, "
                 f"{report.truncated_tokens:,} tokens")
    if report.findings:
        lines += ["", f"{count_text(list(report.findings))}:", "", format_findings(list(report.findings), report.path)]
    return "\n".join(lines)




def _value_text(v) -> str:
    if isinstance(v, tuple):
        return ",".join(v)
    if isinstance(v, bool):
        return "yes" if v else "no"
    return str(v)


def _lines_text(lines, notebook=None) -> str:
    if not lines:
        return ""
    text = ("line " if len(lines) == 1 else "lines ") + ", ".join(str(n) for n in lines)
    return notebook.relabel(text) if notebook is not None else text


@dataclass(frozen=True)
class SetupRow:
    """One row of the setup as written: a field, its value, where it comes from (lines, or the flag that sets it
    when assumed) and why."""

    field: str
    label: str
    value: str
    where: str
    why: str
    assumed: bool


def setup_rows(script, notebook=None) -> list[SetupRow]:
    """The rows `fitune doctor` shows for the setup: the fields the script states (or a flag gives), then the ones
    assumed. `notebook`: the Notebook the script was read from (lines are then written as cells and lines)."""
    relabel = notebook.relabel if notebook is not None else (lambda text: text)
    s = script.setup
    lora = s.method in ("lora", "qlora")
    shown = [f for f in FIELD_LABELS if lora or f not in LORA_FIELDS]
    rows = []
    for assumed in (False, True):
        for f in shown:
            r = script.fields[f]
            if r.assumed != assumed or (not assumed and r.origin not in ("script", "flag")):
                continue
            value = _value_text(getattr(s, f, r.value)) if f != "model" else script.model
            where = r.flag if assumed else "flag" if r.origin == "flag" else _lines_text(r.lines, notebook)
            rows.append(SetupRow(f, FIELD_LABELS[f], value, where, relabel(r.why), assumed))
    return rows


def format_script_setup(script, path: str, notebook=None) -> str:
    """The setup read from the script: each field with its lines; then what was assumed, with the flag to set it.
    `notebook`: the Notebook the script was read from (lines are then written as cells and lines)."""
    rows = setup_rows(script, notebook)
    lines = [f"{path}, as written ({script.style} {'notebook' if notebook is not None else 'script'}):"]
    for i, r in enumerate(rows):
        if r.assumed and (i == 0 or not rows[i - 1].assumed):
            lines.append("  not in the script (assumed; the flag sets it):")
        lines.append(f"  {r.label:24s} {r.value:28s} {r.where:14s} {_short(r.why)}".rstrip())
    for n in script.notes:
        lines.append(_wrap(f"note: {notebook.relabel(n) if notebook is not None else n}", "  ", "        "))
    return "\n".join(lines)


def _short(text: str, width: int = 60) -> str:
    return text if len(text) <= width else text[: width - 3].rstrip() + "..."


def format_fixes(diagnosis, notebook=None) -> str:
    """The fixes, ranked, each with its lines to change, memory and predicted speed; then fitune plan's best.
    `notebook`: the Notebook the script was read from (lines are then written as cells and lines)."""
    relabel = notebook.relabel if notebook is not None else (lambda text: text)

    est = diagnosis.estimate
    gpu = est.gpu
    lines = []
    if est.fits and est.retries_expected:
        lines += [_wrap(retries_verdict_evidence(gpu.name), "", "  "), ""]
    if diagnosis.needs_fix:
        if diagnosis.fixes:
            lines.append(f"what to change so that it fits the {gpu.name} (ranked as `fitune plan` ranks plans; "
                         f"predicted {gpu.name} tokens/s, as written {diagnosis.tokens_per_s:,.0f} if it fit):")
            for i, f in enumerate(diagnosis.fixes, 1):
                note = ", allocator retries" if f.retries_expected else ""
                lines.append(f"  {i}. {f.change}: {gib(f.peak_allocated_bytes)} allocated, "
                             f"{gib(f.peak_reserved_bytes)} reserved{note}; {f.tokens_per_s:,.0f} tokens/s "
                             f"({f.speed_change:+.0%})")
                for e in f.edits:
                    lines.append(_wrap(relabel(e), "       ", "         "))
                if f.cost != "none":
                    lines.append(_wrap(f"cost: {f.cost}", "       ", "             "))
        else:
            lines.append(f"no change to this script that fitune tries makes it fit the {gpu.name}")
    p = diagnosis.runner_plan
    if p is not None:
        lines.append(_wrap(f"on fitune's own runner: `{p.command}` -> {p.description}, {gib(p.peak_reserved_bytes)} "
                           f"reserved, {p.tokens_per_s:,.0f} tokens/s (then --write plan.yaml and `fitune train "
                           "plan.yaml`, or --emit hf)", "  ", "    "))
    return "\n".join(lines)

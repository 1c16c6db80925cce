"""The `estimate` report: the peak as a stacked bar by category against the card's budget, the phase peaks, the
changes that fit, and a measured profile beside the estimate when one is given."""

from __future__ import annotations

from ..units import count_text
from .categories import BY_KEY, Category, ordered
from .charts import BarRow, Marker, Segment, legend, stacked_bars
from .common import breakdown_table, notes_list, setup_line
from .html import OKABE_ITO, esc, num_bytes, num_value

RESERVED = Category("peak_reserved", "peak reserved", OKABE_ITO["sky_blue"],
                    "torch.cuda.max_memory_reserved(): what PyTorch's allocator holds at the peak")


def budget_marker(doc: dict) -> Marker | None:
    gpu = doc.get("gpu")
    if not gpu or gpu.get("allocator_budget_bytes") is None:
        return None
    return Marker(gpu["allocator_budget_bytes"], f"{gpu.get('name', 'GPU')} budget", "gpu.allocator_budget_bytes")


def peak_row(label: str, doc: dict, prefix: str = "", docname: str | None = None) -> BarRow:
    """The peak split into categories; the allocator's overhead is reserved - allocated when the document does not
    carry it (a measured profile)."""
    breakdown = dict(doc.get("breakdown") or {})
    segs = [Segment(c, v, f"{prefix}breakdown.{c.key}", docname) for c, v in ordered(breakdown)]
    reserved = doc.get("peak_reserved_bytes")
    allocated = doc.get("peak_allocated_bytes")
    if "allocator_overhead" not in breakdown and reserved is not None and allocated is not None:
        segs.append(Segment(BY_KEY["allocator_overhead"], reserved - allocated,
                            f"{prefix}peak_reserved_bytes - {prefix}peak_allocated_bytes", docname))
    total, key, note = (reserved, "peak_reserved_bytes", "reserved") if reserved is not None else \
        (allocated, "peak_allocated_bytes", "allocated")
    return BarRow(label, segs, total, prefix + key, note, docname)


def verdict(doc: dict) -> str:
    if "fits" not in doc:
        return ""
    head = doc.get("headroom_bytes")
    hd = f", headroom {num_bytes(head, 'headroom_bytes')}" if head is not None else ""
    if not doc["fits"]:
        return f'<div class="verdict bad" data-verdict="no">DOES NOT FIT{hd}</div>'
    if doc.get("retries_expected"):
        return (f'<div class="verdict warn" data-verdict="retries">FITS ONLY WITH ALLOCATOR RETRIES: the reserved peak '
                f"is over the budget, so the allocator flushes its cache mid-step{hd}</div>")
    tight = " (tight: within 5 % of the budget)" if doc.get("tight") else ""
    return f'<div class="verdict ok" data-verdict="yes">FITS{tight}{hd}</div>'


def render(doc: dict, measured: dict | None = None) -> tuple[str, str]:
    """(title, body) of the estimate page. `measured`: a `fitune profile --json` document of the same setup."""
    model = doc.get("model", "?")
    marker = budget_marker(doc)
    out = [f"<h1>{esc(model)}: where one training step's memory goes</h1>",
           f'<p class="sub">{esc(setup_line(doc.get("setup") or {}))} &middot; engine {esc(doc.get("engine", "analytic"))}</p>']
    if doc.get("total_params"):
        total, trainable = doc["total_params"], doc.get("trainable_params") or 0
        out.append(f'<p class="sub">{num_value(total, "total_params", count_text(total))} parameters, '
                   f'{num_value(trainable, "trainable_params", count_text(trainable))} trainable</p>')
    if doc.get("gpu"):
        g = doc["gpu"]
        out.append(f'<p>{esc(g.get("name"))}: {num_bytes(g.get("allocator_budget_bytes"), "gpu.allocator_budget_bytes")} '
                   f'for PyTorch\'s allocator (of {num_bytes(g.get("total_bytes"), "gpu.total_bytes")})</p>')
    out.append(verdict(doc))

    out.append(f"<h2>At the peak ({esc(doc.get('peak_phase', '?'))})</h2>")
    rows = [peak_row("estimate", doc)]
    if measured:
        rows.append(peak_row(f"measured ({measured.get('device', '?')})", measured, docname="measured"))
    out.append(stacked_bars(rows, marker, caption="peak memory by category"))
    cats = [c for c, _ in ordered({k: 0 for r in rows for s in r.segments for k in [s.category.key]})]
    out.append(legend(cats))
    out.append('<p class="sub">'
               f'peak allocated {num_bytes(doc.get("peak_allocated_bytes"), "peak_allocated_bytes")} '
               "(torch.cuda.max_memory_allocated), peak reserved "
               f'{num_bytes(doc.get("peak_reserved_bytes"), "peak_reserved_bytes")} '
               "(torch.cuda.max_memory_reserved)</p>")
    columns = [("estimate", doc.get("breakdown") or {}, "breakdown.", None)]
    if measured:
        columns.append(("measured", measured.get("breakdown") or {}, "breakdown.", "measured"))
    out.append(breakdown_table(columns, diff=(1, 0) if measured else None))
    if measured:
        out.append('<p class="sub">measured peak allocated '
                   f'{num_bytes(measured.get("peak_allocated_bytes"), "peak_allocated_bytes", doc="measured")}, '
                   f'reserved {num_bytes(measured.get("peak_reserved_bytes"), "peak_reserved_bytes", doc="measured")}'
                   "</p>")

    phases = doc.get("phases") or {}
    if phases:
        out.append("<h2>Phase peaks (allocated)</h2>")
        prow = []
        for name, ph in phases.items():
            segs = [Segment(c, v, f"phases.{name}.breakdown.{c.key}") for c, v in ordered(ph.get("breakdown") or {})]
            prow.append(BarRow(f"{name}" + (" (estimate)" if measured else ""), segs, ph.get("peak_allocated_bytes"),
                               f"phases.{name}.peak_allocated_bytes", row_id=f"phase-{name}"))
            mph = (measured or {}).get("phases", {}).get(name)
            if mph:
                msegs = [Segment(c, v, f"phases.{name}.breakdown.{c.key}", "measured")
                         for c, v in ordered(mph.get("breakdown") or {})]
                prow.append(BarRow(f"{name} (measured)", msegs, mph.get("peak_allocated_bytes"),
                                   f"phases.{name}.peak_allocated_bytes", doc="measured"))
        out.append(stacked_bars(prow, marker, caption="peak allocated per phase"))

    out.append(run_phases_table(doc))
    suggestions = doc.get("suggestions") or []
    if suggestions:
        out.append("<h2>Changes that fit (one at a time)</h2>")
        srows = [BarRow(s["change"], [Segment(RESERVED, s["peak_reserved_bytes"], f"suggestions.{i}.peak_reserved_bytes")],
                        s["peak_reserved_bytes"], None,
                        "reserved (on that GPU)" if s["change"].startswith("--gpu") else "reserved")
                 for i, s in enumerate(suggestions)]
        out.append(stacked_bars(srows, marker, caption="peak reserved with each change"))
        out.append("<table><tr><th>change</th><th class=\"n\">peak reserved</th><th>why</th></tr>" + "".join(
            f"<tr><td><code>{esc(s['change'])}</code></td><td class=\"n\">"
            f"{num_bytes(s['peak_reserved_bytes'], f'suggestions.{i}.peak_reserved_bytes')}</td>"
            f"<td>{esc(s.get('why', ''))}{'; allocator retries' if s.get('retries_expected') else ''}</td></tr>"
            for i, s in enumerate(suggestions)) + "</table>")
    extra = []
    if doc.get("host_bytes"):
        extra.append(f"pinned host memory for offloaded checkpoints: {num_bytes(doc['host_bytes'], 'host_bytes')}")
    resident = doc.get("resident_bytes") or {}
    if resident:
        extra.append("kept between steps: " + ", ".join(
            f"{c.label} {num_bytes(v, f'resident_bytes.{c.key}')}" for c, v in ordered(resident) if v))
    if extra or doc.get("notes"):
        out.append("<h2>Notes</h2>")
        out.append("".join(f"<p>{x}</p>" for x in extra))
        out.append(notes_list(doc.get("notes")))
    return f"fitune estimate: {model}", "\n".join(out)


def run_phases_table(doc: dict) -> str:
    """Every phase of the run (`run_phases`, docs/phases.md): GPU allocated / reserved and host memory per phase,
    the worst phase named. Empty for documents without them (the trace engine, older files)."""
    phases = doc.get("run_phases") or []
    if not phases:
        return ""
    rows = "".join(
        f"<tr><td>{esc(p.get('name'))}</td>"
        f"<td class=\"n\">{num_bytes(p.get('gpu_allocated_bytes'), f'run_phases.{i}.gpu_allocated_bytes')}</td>"
        f"<td class=\"n\">{num_bytes(p.get('gpu_reserved_bytes'), f'run_phases.{i}.gpu_reserved_bytes')}</td>"
        f"<td class=\"n\">{num_bytes(p.get('host_bytes'), f'run_phases.{i}.host_bytes')}</td>"
        f"<td>{esc(p.get('note', ''))}</td></tr>" for i, p in enumerate(phases))
    verdict_text = f"worst phase on the GPU: {esc(doc.get('worst_phase', '?'))}"
    if "run_fits" in doc:
        verdict_text += " (the whole run fits)" if doc["run_fits"] else " (the whole run does not fit)"
    return ("<h2>Every phase of the run</h2>"
            "<table><tr><th>phase</th><th class=\"n\">GPU allocated</th><th class=\"n\">GPU reserved</th>"
            f"<th class=\"n\">host</th><th>what</th></tr>{rows}</table><p>{verdict_text}; host memory peaks in "
            f"{esc(doc.get('host_peak_phase', '?'))}</p>")

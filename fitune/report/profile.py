"""The `profile` report: measured against estimated per category, phase peaks, speed, the memory timeline when the
document carries one, and the post-mortem of an out-of-memory error."""

from __future__ import annotations

from .categories import ordered
from .charts import BarRow, Marker, Segment, Series, legend, line_chart, stacked_bars
from .common import breakdown_table, setup_line
from .estimate import peak_row
from .html import OKABE_ITO, esc, num_bytes, num_value

PHASE_COLORS = {"forward": OKABE_ITO["sky_blue"], "backward": OKABE_ITO["orange"], "optimizer": OKABE_ITO["bluish_green"]}


def render(doc: dict) -> tuple[str, str]:
    model = doc.get("model", "?")
    cap = doc.get("cap_bytes")
    marker = Marker(cap, "allocator cap", "cap_bytes") if cap else None
    est = doc.get("estimate") or {}
    out = [f"<h1>{esc(model)}: a measured training step</h1>",
           f'<p class="sub">{esc(setup_line(doc.get("setup") or {}))} &middot; '
           f'{num_value(doc.get("steps"), "steps")} step(s) on {esc(doc.get("device", "?"))}'
           + (f", allocator capped at {num_bytes(cap, 'cap_bytes')}" if cap else "") + "</p>"]
    oom = doc.get("oom")
    if oom:
        out.append(f'<div class="verdict bad" data-verdict="oom">OUT OF MEMORY in the {esc(oom.get("phase", "?"))}</div>')
        out.append(_oom(oom, marker))

    if doc.get("steps"):
        out.append(f"<h2>At the measured peak ({esc(doc.get('peak_phase', '?'))}): measured and estimated</h2>")
        rows = [peak_row("measured", doc)]
        if est:
            rows.append(peak_row("estimate", est, prefix="estimate."))
        out.append(stacked_bars(rows, marker, caption="measured and estimated peak by category"))
        out.append(legend([c for c, _ in ordered({k: 0 for r in rows for s in r.segments for k in [s.category.key]})]))
        columns = [("measured", doc.get("breakdown") or {}, "breakdown.", None)]
        if est:
            columns.append(("estimated", {k: v for k, v in (est.get("breakdown") or {}).items()
                                          if k != "allocator_overhead"}, "estimate.breakdown.", None))
        out.append(breakdown_table(columns, diff=(0, 1) if est else None))
        out.append("<table><tr><th></th><th class=\"n\">measured</th><th class=\"n\">estimated</th></tr>"
                   f"<tr><td>peak allocated</td><td class=\"n\">{num_bytes(doc.get('peak_allocated_bytes'), 'peak_allocated_bytes')}</td>"
                   f"<td class=\"n\">{num_bytes(est.get('peak_allocated_bytes'), 'estimate.peak_allocated_bytes')}</td></tr>"
                   f"<tr><td>peak reserved</td><td class=\"n\">{num_bytes(doc.get('peak_reserved_bytes'), 'peak_reserved_bytes')}"
                   + ("" if doc.get("peak_reserved_bytes") is not None else
                      ' <span class="notes">(the CPU has no caching allocator)</span>')
                   + f"</td><td class=\"n\">{num_bytes(est.get('peak_reserved_bytes'), 'estimate.peak_reserved_bytes')}</td></tr>"
                   "</table>")

    phases = doc.get("phases") or {}
    if phases:
        out.append("<h2>Phase peaks (allocated, measured)</h2>")
        prow = [BarRow(name, [Segment(c, v, f"phases.{name}.breakdown.{c.key}") for c, v in ordered(ph.get("breakdown") or {})],
                       ph.get("peak_allocated_bytes"), f"phases.{name}.peak_allocated_bytes", row_id=f"phase-{name}")
                for name, ph in phases.items()]
        out.append(stacked_bars(prow, marker, caption="peak allocated per phase"))

    timeline = doc.get("timeline") or []
    if timeline:
        out.append("<h2>Memory over time</h2>")
        out.append(_timeline(timeline, est.get("timeline")))

    if doc.get("steps"):
        out.append("<h2>Speed and the allocator</h2><ul>")
        out.append(f"<li>{_tps(doc)} tokens/s "
                   f"({num_value(doc.get('step_time_s'), 'step_time_s', _secs(doc.get('step_time_s')))} per step of "
                   f"{num_value(doc.get('tokens_per_step'), 'tokens_per_step')} tokens)</li>")
        if doc.get("mfu") is not None:
            out.append(f"<li>MFU {_mfu(doc)}</li>")
        if doc.get("num_alloc_retries") is not None:
            out.append(f"<li>allocator: {num_value(doc['num_alloc_retries'], 'num_alloc_retries')} retries, fragmentation "
                       f"at the peak {num_bytes(doc.get('fragmentation_bytes'), 'fragmentation_bytes')}</li>")
        out.append("</ul>")
    return f"fitune profile: {model}", "\n".join(out)


def _tps(doc: dict) -> str:
    return num_value(doc.get("tokens_per_s"), "tokens_per_s", f"{doc.get('tokens_per_s') or 0:,.0f}")


def _mfu(doc: dict) -> str:
    return num_value(doc["mfu"], "mfu", f"{100 * doc['mfu']:.1f} %")


def _secs(x) -> str:
    return "n/a" if x is None else f"{x:.3f} s"


def _timeline(timeline: list, estimate: list | None = None) -> str:
    """`timeline`: `fitune profile --json`'s samples ({t_s, phase, live_bytes, allocated_bytes, reserved_bytes,
    breakdown}; the allocator's two are null on the CPU, `breakdown` absent before fitune 0.x wrote it), or
    [t_s, phase, live_bytes] triples (`ProfileResult.timeline`). Drawn: the live bytes by category as stacked areas,
    the allocator's allocated and reserved as lines, the phases shaded, and `estimate` (the estimate's replayed
    tape, `estimate.timeline`) as a dashed line laid over the last measured step (`tape_over_time`)."""
    stack: list[Series] = []
    if timeline and isinstance(timeline[0], dict):
        rows = [(float(x["t_s"]), x["phase"]) for x in timeline]
        lines = [("reserved", "reserved_bytes", OKABE_ITO["grey"], "2 2"),
                 ("allocated", "allocated_bytes", "#555555", "")]
        if not all(isinstance(x.get("breakdown"), dict) for x in timeline):
            lines.append(("live tensors", "live_bytes", OKABE_ITO["blue"], ""))
        else:
            present = {k for x in timeline for k, v in x["breakdown"].items() if v}
            stack = [Series(c.label, c.color, [(t, int(x["breakdown"].get(c.key, 0)), f"timeline.{i}.breakdown.{c.key}")
                                               for i, ((t, _), x) in enumerate(zip(rows, timeline))])
                     for c, _ in ordered({k: 0 for k in timeline[0]["breakdown"]}) if c.key in present]
        series = [Series(name, color, [(t, int(x[key]), f"timeline.{i}.{key}")
                                       for i, ((t, _), x) in enumerate(zip(rows, timeline)) if x.get(key) is not None],
                         dash)
                  for name, key, color, dash in lines]
        series = [s for s in series if s.points]
    else:
        rows = [(float(t), phase) for t, phase, _ in timeline]
        series = [Series("live tensors", OKABE_ITO["blue"],
                         [(float(t), int(b), f"timeline.{i}.2") for i, (t, _, b) in enumerate(timeline)])]
    bands, start = [], 0
    for i in range(1, len(rows) + 1):
        if i == len(rows) or rows[i][1] != rows[start][1]:
            phase = rows[start][1]
            end = rows[i][0] if i < len(rows) else rows[i - 1][0]
            bands.append((rows[start][0], end, str(phase), PHASE_COLORS.get(phase, OKABE_ITO["grey"])))
            start = i
    overlay = tape_over_time(rows, estimate or [])
    if overlay:
        series.append(Series("estimate (replayed tape)", OKABE_ITO["black"],
                             [(t, int(estimate[j]["allocated_bytes"]), f"estimate.timeline.{j}.allocated_bytes")
                              for t, j in overlay], dash="6 4"))
    title = "memory over time" if len(series) > 1 or stack else "live tensors over time"
    chart = line_chart(series, title=title, bytes_axis=True, width=1140, height=340 if stack else 300,
                       x_label="seconds", bands=bands, stack=stack)
    keys = '<div class="legend">' + "".join(
        f'<span><span class="swatch" style="background:{c};opacity:.5"></span>{esc(p)}</span>'
        for p, c in PHASE_COLORS.items()) + "</div>"
    note = ""
    if overlay:
        note = ('<p class="notes">The dashed line is the estimate: the step fitune\'s estimator writes down op by op, '
                "replayed, each phase of it spread over the time the last measured step spent in that phase (the tape "
                "has an order, not a clock). Hover a point for its bytes.</p>")
    elif estimate:
        note = '<p class="notes">The estimate\'s tape is not drawn: its phases do not line up with the measured ones.</p>'
    return chart + keys + note


def tape_over_time(rows: list[tuple[float, str]], tape: list[dict]) -> list[tuple[float, int]]:
    """Where each point of the estimate's tape falls on the measured clock: (t_s, index into `tape`).

    The tape (`estimate.timeline`: {event, phase, ...}) covers one training step in order: runs of forward and
    backward (one pair per micro-batch), then the optimizer. The measured `rows` ((t_s, phase) samples) cover every
    profiled step. The tape's runs are matched, in order, with the last runs of the measurement of the same phases,
    and within a run the tape's events are spread evenly over that run's time. Empty when they do not match."""
    def runs(phases: list[str]) -> list[tuple[str, int, int]]:
        out, start = [], 0
        for i in range(1, len(phases) + 1):
            if i == len(phases) or phases[i] != phases[start]:
                out.append((phases[start], start, i - 1))
                start = i
        return out

    if not rows or not tape:
        return []
    measured = [r for r in runs([p for _, p in rows]) if r[0] in PHASE_COLORS]
    tape_runs = runs([str(p.get("phase")) for p in tape])
    if measured and measured[-1][0] == "optimizer" and tape_runs[-1][0] != "optimizer":
        measured = measured[:-1]  # an optimizer step that allocates nothing (SGD) leaves no run on the tape
    if len(tape_runs) > len(measured):
        return []
    last = measured[len(measured) - len(tape_runs):]
    if [p for p, _, _ in last] != [p for p, _, _ in tape_runs]:
        return []
    out = []
    for (_, m0, m1), (_, a, b) in zip(last, tape_runs):
        t0 = rows[m0][0]
        t1 = rows[m1 + 1][0] if m1 + 1 < len(rows) else rows[m1][0]
        e0, e1 = tape[a].get("event", a), tape[b].get("event", b)
        for j in range(a, b + 1):
            frac = 0.0 if e1 == e0 else (tape[j].get("event", j) - e0) / (e1 - e0)
            out.append((t0 + frac * (t1 - t0), j))
    return out


def _oom(o: dict, marker) -> str:
    budget = o.get("budget_bytes")
    out = [f"<p>{esc(o.get('message', ''))}</p>",
           f"<p>a request of {num_bytes(o.get('requested_bytes'), 'oom.requested_bytes')} failed with "
           f"{num_bytes(o.get('live_bytes'), 'oom.live_bytes')} live"
           + (f" of a {num_bytes(budget, 'oom.budget_bytes')} budget" if budget else "")
           + f"; fitune's estimate for the whole step: {num_bytes(o.get('estimate_peak_allocated_bytes'), 'oom.estimate_peak_allocated_bytes')} allocated</p>"]
    live = o.get("live_by_category") or {}
    m = Marker(budget, "budget", "oom.budget_bytes") if budget else marker
    rows = [BarRow("live at the failure", [Segment(c, v, f"oom.live_by_category.{c.key}") for c, v in ordered(live)],
                   o.get("live_bytes"), "oom.live_bytes", "live")]
    if o.get("estimate_breakdown"):
        rows.append(BarRow("estimate of the step", [Segment(c, v, f"oom.estimate_breakdown.{c.key}")
                                                    for c, v in ordered(o["estimate_breakdown"])],
                           o.get("estimate_peak_reserved_bytes"), "oom.estimate_peak_reserved_bytes", "reserved"))
    out.append(stacked_bars(rows, m, caption="what was live when memory ran out"))
    out.append(legend([c for c, _ in ordered({**live, **(o.get("estimate_breakdown") or {})})]))
    sources = o.get("top_sources") or []
    if sources:
        out.append("<h3>Largest sources of live memory</h3><table><tr><th>source</th><th class=\"n\">bytes</th></tr>"
                   + "".join(f"<tr><td><code>{esc(s.get('source'))}</code></td><td class=\"n\">"
                             f"{num_bytes(s.get('bytes'), f'oom.top_sources.{i}.bytes')}</td></tr>"
                             for i, s in enumerate(sources)) + "</table>")
    sugg = o.get("suggestions") or []
    if sugg:
        out.append("<h3>Changes that fit</h3><ul>" + "".join(
            f"<li><code>{esc(s.get('change'))}</code>: "
            f"{num_bytes(s.get('peak_reserved_bytes'), f'oom.suggestions.{i}.peak_reserved_bytes')} reserved</li>"
            for i, s in enumerate(sugg)) + "</ul>")
    return "\n".join(out)

"""The `plan` report: each plan's memory and predicted tokens/s as bars against the budget, what it turns on, why
the faster setups do not fit; clicking a plan shows its breakdown."""

from __future__ import annotations

from .categories import Category, ordered
from .charts import BarRow, Segment, ValueBar, legend, stacked_bars, value_bars
from .common import breakdown_table, notes_list, setup_line
from .estimate import budget_marker
from .html import OKABE_ITO, esc, num_bytes, num_value
from ..plan.search import kept_as_given

METHOD_LABELS = {"lora": "LoRA", "qlora": "QLoRA", "full": "full fine-tune", "freeze": "freeze"}
OVER = Category("peak_allocated", "peak allocated", OKABE_ITO["vermillion"],
                "fitune's estimate of torch.cuda.max_memory_allocated() for this setup")
NEED = Category("peak_allocated", "peak allocated", OKABE_ITO["blue"],
                "fitune's estimate of torch.cuda.max_memory_allocated() for this setup")


def describe(s: dict) -> str:
    """'QLoRA, micro-batch 1 x 2 accumulation, checkpointing none, sdpa, chunked loss, adamw' (the planner's words)."""
    batch = f"micro-batch {s.get('batch_size')}" + (f" x {s['grad_accum']} accumulation" if (s.get("grad_accum") or 1) > 1 else "")
    loss = ", chunked loss" if s.get("loss") == "chunked" else ""
    return (f"{METHOD_LABELS.get(s.get('method'), s.get('method'))}, {batch}, checkpointing {s.get('grad_checkpointing')}, "
            f"{s.get('attn')}{loss}, {s.get('optimizer')}")


def short(p: dict) -> str:
    s = p.get("setup") or {}
    accum = f" x {s['grad_accum']}" if (s.get("grad_accum") or 1) > 1 else ""
    return (f"#{p['rank']} {METHOD_LABELS.get(s.get('method'), s.get('method'))}, micro-batch {s.get('batch_size')}"
            f"{accum}, ckpt {s.get('grad_checkpointing')}")


def render(doc: dict) -> tuple[str, str]:
    model = doc.get("model", "?")
    gpu = doc.get("gpu") or {}
    plans = doc.get("plans") or []
    marker = budget_marker(doc)
    budget = gpu.get("allocator_budget_bytes") or 0
    out = _heading(doc, model, gpu, budget, plans)
    if plans:
        out += _plans_section(plans, marker)
    out += _rejected_section(doc.get("rejected") or [], marker)
    out += _minimum_section(doc.get("minimum"), budget)
    out += _changes_section(doc.get("changes") or [], marker)
    if doc.get("notes"):
        out.append("<h2>Notes</h2>" + notes_list(doc["notes"]))
    return f"fitune plan: {model} on {gpu.get('name', '?')}", "\n".join(out)


def _heading(doc: dict, model: str, gpu: dict, budget: int, plans: list) -> list[str]:
    """The title, the request (budget, batch, sequence, what stays as given, the search) and the verdict."""
    req = doc.get("request") or {}
    search = doc.get("search") or {}
    out = [f"<h1>{esc(model)} on {esc(gpu.get('name', '?'))}: the fastest setups that fit</h1>",
           f'<p class="sub">{num_bytes(budget, "gpu.allocator_budget_bytes")} for PyTorch\'s allocator'
           + (f" x {num_value(doc['num_gpus'], 'num_gpus')} GPUs" if (doc.get("num_gpus") or 1) > 1 else "")
           + f' &middot; {num_value(req.get("batch_size"), "request.batch_size")} x '
           f'{num_value(req.get("seq_len_tokens"), "request.seq_len_tokens")} tokens per step, {esc(req.get("dtype", ""))}'
           f'; {esc(kept_as_given(req.get("methods") or ["lora"], req.get("lora_rank"), req.get("lora_targets") or []))}'
           f' &middot; searched {num_value(search.get("setups"), "search.setups")} setups in '
           f'{num_value(search.get("seconds"), "search.seconds", _seconds(search.get("seconds")))}</p>']
    if plans:
        out.append('<div class="verdict ok" data-verdict="yes">'
                   f"{len(plans)} plan{'s' if len(plans) > 1 else ''} fit{'s' if len(plans) == 1 else ''}</div>")
    else:
        out.append('<div class="verdict bad" data-verdict="no">NOTHING FITS</div>')
    return out


def _plans_section(plans: list, marker) -> list[str]:
    """The table of plans (a row selects its hidden breakdown), their memory bars and their predicted tokens/s."""
    out = ["<h2>Plans, fastest first <span class=\"sub\">(click one for its breakdown)</span></h2>",
           '<table class="plans"><tr><th>#</th><th>plan</th><th class="n">tokens/s</th>'
           '<th class="n">allocated</th><th class="n">reserved</th><th>turns on</th></tr>']
    for i, p in enumerate(plans):
        out.append(_plan_row(i, p))
    out.append("</table>")
    for i, p in enumerate(plans):
        out.append(_detail(i, p, hidden=i > 0))

    out.append("<h3>Memory at the peak (reserved), against the budget</h3>")
    rows = []
    for i, p in enumerate(plans):
        segs = [Segment(c, v, f"plans.{i}.breakdown.{c.key}") for c, v in ordered(p.get("breakdown") or {})]
        rows.append(BarRow(short(p), segs, p.get("peak_reserved_bytes"), f"plans.{i}.peak_reserved_bytes",
                           "reserved", row_id=f"plan-{i}"))
    out.append(stacked_bars(rows, marker, caption="memory of each plan"))
    out.append(legend([c for c, _ in ordered({k: 0 for p in plans for k in (p.get("breakdown") or {})})]))
    out.append("<h3>Predicted tokens/s (trained tokens)</h3>")
    out.append(value_bars([ValueBar(short(p), p.get("trained_tokens_per_s") or 0.0,
                                    f"plans.{i}.trained_tokens_per_s",
                                    _tps(p) + " tokens/s", OKABE_ITO["bluish_green"],
                                    f"plan-{i}") for i, p in enumerate(plans)],
                          unit="tokens/s", caption="predicted tokens per second"))
    return out


def _plan_row(i: int, p: dict) -> str:
    """Plan i's row of the table (the first one selected)."""
    k = f"plans.{i}"
    sel = "true" if i == 0 else "false"
    retry = ' <span class="sev warning">retries</span>' if p.get("retries_expected") else ""
    needs = (f'<br><span class="notes">needs: {esc(", ".join(p["requires"]))}</span>'
             if p.get("requires") else "")
    return (f'<tr class="plan-row" data-plan="{i}" aria-selected="{sel}">'
            f'<td><button type="button" aria-controls="plan-detail-{i}">#{esc(p.get("rank", i + 1))}</button></td>'
            f'<td>{esc(describe(p.get("setup") or {}))}{", packing" if p.get("packing") else ""}{retry}</td>'
            f'<td class="n">{num_value(p.get("trained_tokens_per_s"), k + ".trained_tokens_per_s", _tps(p))}</td>'
            f'<td class="n">{num_bytes(p.get("peak_allocated_bytes"), k + ".peak_allocated_bytes")}</td>'
            f'<td class="n">{num_bytes(p.get("peak_reserved_bytes"), k + ".peak_reserved_bytes")}</td>'
            f'<td class="notes">{esc("; ".join(p.get("turns_on") or []) or "nothing (the plain setup fits)")}'
            f"{needs}</td></tr>")


def _rejected_section(rejected: list, marker) -> list[str]:
    """The faster setups that do not fit: their peaks against the budget and why each was left out."""
    if not rejected:
        return []
    out = ["<h2>Faster setups that do not fit</h2>"]
    rrows = []
    for i, r in enumerate(rejected):
        if r.get("peak_allocated_bytes") is None:
            continue
        rrows.append(BarRow(r.get("option", "?"), [Segment(OVER, r["peak_allocated_bytes"],
                                                           f"rejected.{i}.peak_allocated_bytes")],
                            r["peak_allocated_bytes"], None, "allocated"))
    if rrows:
        out.append(stacked_bars(rrows, marker, caption="peak allocated of the setups that do not fit"))
    out.append("<ul>" + "".join(f'<li data-reason="{esc(r.get("reason"))}">{esc(r.get("message", r.get("option")))}</li>'
                                for r in rejected) + "</ul>")
    return out


def _minimum_section(minimum: dict | None, budget: int) -> list[str]:
    """When nothing fits: what the lightest setup needs, against the budget."""
    if not minimum:
        return []
    return ["<h2>The smallest requirement</h2>",
            f"<p>{num_bytes(minimum.get('peak_allocated_bytes'), 'minimum.peak_allocated_bytes')} allocated, "
            f"{num_bytes(minimum.get('peak_reserved_bytes'), 'minimum.peak_reserved_bytes')} reserved "
            f"({esc(describe(minimum.get('setup') or {}))}) &gt; {num_bytes(budget, 'gpu.allocator_budget_bytes')}</p>"]


def _changes_section(changes: list, marker) -> list[str]:
    """When nothing fits: the changes that would, with their peaks."""
    if not changes:
        return []
    out = ["<h2>Changes that would fit</h2>"]
    crow = [BarRow(c["change"], [Segment(NEED, c["peak_allocated_bytes"], f"changes.{i}.peak_allocated_bytes")],
                   c["peak_allocated_bytes"], None, "allocated" + ("" if c.get("fits") else ": no fit"))
            for i, c in enumerate(changes) if c.get("peak_allocated_bytes")]
    if crow:
        out.append(stacked_bars(crow, marker, caption="peak allocated with each change"))
    out.append("<ul>" + "".join(
        f"<li><code>{esc(c['change'])}</code>: {esc(c.get('why', ''))}"
        f"{'' if c.get('runnable', True) else ' [not runnable by fitune train today]'}</li>" for c in changes)
        + "</ul>")
    return out


def _detail(i: int, p: dict, hidden: bool) -> str:
    k = f"plans.{i}"
    body = [f'<section class="plan-detail detail" id="plan-detail-{i}" data-plan="{i}"{" hidden" if hidden else ""}>',
            f"<h3>Plan #{esc(p.get('rank', i + 1))}: {esc(describe(p.get('setup') or {}))}</h3>",
            f'<p class="sub">{esc(setup_line(p.get("setup") or {}))}</p>',
            f"<p>{num_bytes(p.get('peak_allocated_bytes'), k + '.peak_allocated_bytes')} allocated, "
            f"{num_bytes(p.get('peak_reserved_bytes'), k + '.peak_reserved_bytes')} reserved, headroom "
            f"{num_bytes(p.get('headroom_bytes'), k + '.headroom_bytes')} of "
            f"{num_bytes(p.get('budget_bytes'), k + '.budget_bytes')}; "
            f"{num_value(p.get('step_time_s'), k + '.step_time_s', _seconds(p.get('step_time_s'), 3))} per step, "
            f"{num_value(p.get('trained_tokens_per_s'), k + '.trained_tokens_per_s', _tps(p))} "
            "trained tokens/s</p>",
            breakdown_table([("bytes at the peak", p.get("breakdown") or {}, k + ".breakdown.", None)])]
    if p.get("turns_on"):
        body.append("<p>turns on:</p><ul>" + "".join(f"<li>{esc(t)}</li>" for t in p["turns_on"]) + "</ul>")
    if p.get("requires"):
        body.append(f"<p>needs: {esc(', '.join(p['requires']))}</p>")
    if p.get("retries_expected"):
        body.append('<p class="sev warning">the reserved peak is over the budget: expect allocator retries</p>')
    body.append("</section>")
    return "".join(body)


def _tps(p: dict) -> str:
    return f"{p.get('trained_tokens_per_s') or 0:,.0f}"


def _seconds(x, digits: int = 2) -> str:
    return f"{x or 0:.{digits}f} s"

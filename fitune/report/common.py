"""Pieces several reports share: the setup in one line, the categories table, reading keys safely."""

from __future__ import annotations

from ..setup import technique_labels
from .categories import ordered
from .html import esc, num_bytes


def setup_line(s: dict) -> str:
    """'lora r8 on q_proj,v_proj, 2 x 2048 tokens, bf16, checkpointing full, ...' as the text output writes it."""
    if not s:
        return ""
    method = s.get("method", "?")
    if method in ("lora", "qlora"):
        method += f" r{s.get('lora_rank')} on {','.join(s.get('lora_targets') or [])}"
    parts = [method, f"{s.get('batch_size')} x {s.get('seq_len_tokens')} tokens"]
    if (s.get("grad_accum") or 1) > 1:
        parts.append(f"{s['grad_accum']}x accumulation")
    parts += [s.get("dtype", ""), f"checkpointing {s.get('grad_checkpointing')}", f"attention {s.get('attn')}",
              f"optimizer {s.get('optimizer')}", f"loss {s.get('loss')}", f"stack {s.get('stack')}"]
    on = technique_labels(s)
    if on:
        parts.append("with " + ", ".join(on))
    return ", ".join(p for p in parts if p)


def breakdown_table(columns: list[tuple[str, dict, str, str | None]], with_what: bool = True,
                    diff: tuple[int, int] | None = None) -> str:
    """One row per category. `columns`: (heading, breakdown, key prefix, data-doc). `diff=(i, j)` adds a column
    columns[i] - columns[j]."""
    cats = ordered({k: 0 for _, b, _, _ in columns for k in b})
    head = "".join(f'<th class="n">{esc(h)}</th>' for h, _, _, _ in columns)
    if diff:
        head += '<th class="n">difference</th>'
    rows = []
    for c, _ in cats:
        cells = []
        for _, b, prefix, doc in columns:
            v = b.get(c.key)
            cells.append(f'<td class="n">{num_bytes(v, prefix + c.key, doc=doc) if v is not None else "-"}</td>')
        if diff:
            (_, bi, pi, di), (_, bj, pj, dj) = columns[diff[0]], columns[diff[1]]
            if c.key in bi and c.key in bj:
                key = f"{_qual(di)}{pi}{c.key} - {_qual(dj)}{pj}{c.key}"
                cells.append(f'<td class="n">{num_bytes(bi[c.key] - bj[c.key], key)}</td>')
            else:
                cells.append('<td class="n">-</td>')
        style = ("" if c.color == "hatch" else f' style="background:{c.color}"')
        sw = f'<span class="swatch{" hatch" if c.color == "hatch" else ""}"{style}></span>'
        what = f'<td class="notes">{esc(c.what)}</td>' if with_what else ""
        rows.append(f'<tr data-category="{esc(c.key)}"><td class="nowrap">{sw}{esc(c.label)}</td>{"".join(cells)}{what}</tr>')
    what_head = "<th>what it is</th>" if with_what else ""
    return f'<table class="breakdown"><tr><th>category</th>{head}{what_head}</tr>{"".join(rows)}</table>'


def _qual(doc: str | None) -> str:
    return f"{doc}:" if doc else ""


def notes_list(notes) -> str:
    if not notes:
        return ""
    return '<ul class="notes">' + "".join(f"<li>{esc(n)}</li>" for n in notes) + "</ul>"

"""The page around every report: inline CSS and JS (no network at view time), escaping, and numbers that carry
their source.

Every number a report shows sits in an element with `data-key` (its path in the JSON document, e.g.
`breakdown.weights` or `plans.0.tokens_per_s`) and `data-bytes` (a byte count) or `data-value` (anything else),
so a test can compare what is shown with the document it came from. `data-doc="measured"` marks numbers taken
from the second document (a profile shown beside an estimate).
"""

from __future__ import annotations

import html
import math

from .. import __version__
from .units import format_bytes, format_value

# Okabe & Ito's palette (https://jfly.uni-koeln.de/color/): distinguishable with the common colour-vision
# deficiencies. Charts also label or list every colour, so colour is never the only cue.
OKABE_ITO = {
    "orange": "#E69F00", "sky_blue": "#56B4E9", "bluish_green": "#009E73", "yellow": "#F0E442",
    "blue": "#0072B2", "vermillion": "#D55E00", "reddish_purple": "#CC79A7", "black": "#000000", "grey": "#999999",
}

CSS = """
:root { --fg: #1a1a1a; --muted: #555; --line: #d0d0d0; --bg: #fff; --soft: #f4f6f8; --accent: #0072B2;
        --bad: #D55E00; --warn: #E69F00; --ok: #009E73; }
* { box-sizing: border-box; }
body { margin: 0; font: 15px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, "DejaVu Sans", sans-serif;
       color: var(--fg); background: var(--bg); }
main { max-width: 1200px; margin: 0 auto; padding: 20px 28px 40px; }
h1 { font-size: 22px; margin: 0 0 4px; }
h2 { font-size: 17px; margin: 28px 0 8px; border-bottom: 1px solid var(--line); padding-bottom: 4px; }
h3 { font-size: 15px; margin: 16px 0 6px; }
p, li { max-width: 1100px; }
.sub { color: var(--muted); margin: 0 0 8px; }
.verdict { display: inline-block; padding: 4px 10px; border-radius: 4px; font-weight: 600; margin: 6px 0; }
.verdict.ok { background: #e3f4ee; color: #00573f; border: 1px solid var(--ok); }
.verdict.warn { background: #fdf1d8; color: #6b4a00; border: 1px solid var(--warn); }
.verdict.bad { background: #fbe4d8; color: #7a2e00; border: 1px solid var(--bad); }
table { border-collapse: collapse; margin: 6px 0 10px; }
th, td { padding: 3px 10px; text-align: left; vertical-align: top; border-bottom: 1px solid #eee; }
th { font-weight: 600; color: var(--muted); font-size: 13px; }
td.nowrap { white-space: nowrap; }
td.n, th.n { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
.swatch { display: inline-block; width: 12px; height: 12px; border-radius: 2px; margin-right: 6px;
          vertical-align: -1px; border: 1px solid rgba(0,0,0,.25); }
.swatch.line { width: 18px; height: 0; border: none; border-radius: 0; vertical-align: 3px; }
.hatch { background: repeating-linear-gradient(45deg, #999 0 3px, #fff 3px 6px); }
svg { display: block; max-width: 100%; height: auto; font-family: inherit; }
svg text { fill: var(--fg); font-size: 13px; }
svg .axis text { fill: var(--muted); font-size: 12px; }
svg .grid { stroke: #e6e6e6; }
svg .budget { stroke: var(--bad); stroke-width: 2; stroke-dasharray: 6 4; }
svg [data-tip] { cursor: default; }
svg rect[data-tip]:hover, svg circle[data-tip]:hover { stroke: #000; stroke-width: 1.5; }
#tip { position: fixed; pointer-events: none; background: #1a1a1a; color: #fff; padding: 6px 9px;
       border-radius: 4px; font-size: 13px; max-width: 420px; display: none; z-index: 10; white-space: pre-line; }
.notes { color: var(--muted); font-size: 13px; }
.plans { width: 100%; }
.plan-row { cursor: pointer; }
.plan-row:hover { background: var(--soft); }
.plan-row[aria-selected="true"] { background: #e5f0f8; outline: 2px solid var(--accent); outline-offset: -2px; }
g.bar[data-row^="plan-"] { cursor: pointer; }
g.bar[aria-selected="true"] > text:first-child { font-weight: 700; fill: var(--accent); }
.plan-row button { all: unset; font-weight: 600; color: var(--accent); cursor: pointer; }
.plan-row button:focus-visible { outline: 2px solid var(--accent); }
.detail { background: var(--soft); padding: 10px 16px; border-radius: 6px; margin-top: 8px; }
code, pre { font: 13px/1.5 ui-monospace, "DejaVu Sans Mono", Menlo, Consolas, monospace; }
.src { border: 1px solid var(--line); border-radius: 6px; overflow: hidden;
       font: 13px/1.55 ui-monospace, "DejaVu Sans Mono", Menlo, Consolas, monospace; }
.src .ln { display: grid; grid-template-columns: 52px 1fr; }
.src .no { color: #888; text-align: right; padding-right: 10px; user-select: none; background: #fafafa; }
.src .code { white-space: pre-wrap; word-break: break-word; padding-left: 8px; }
.src .hit { background: #fff6df; }
.src .hit.error { background: #fde9df; }
.finding { margin: 2px 0 6px 52px; padding: 6px 10px; border-left: 4px solid var(--warn); background: #fffaf0;
           font-family: system-ui, sans-serif; font-size: 14px; }
.finding.error { border-color: var(--bad); background: #fff3ee; }
.finding.info { border-color: var(--accent); background: #f1f7fb; }
.finding .rule { font-weight: 600; }
.sev { font-size: 12px; text-transform: uppercase; letter-spacing: .04em; font-weight: 700; margin-right: 6px; }
.sev.error { color: #a33a00; } .sev.warning { color: #7a5300; } .sev.info { color: #005a8c; }
.legend { display: flex; flex-wrap: wrap; gap: 4px 18px; margin: 4px 0 8px; font-size: 13px; }
figure { margin: 0 0 12px; }
.charts { display: grid; grid-template-columns: 1fr 1fr; gap: 8px 28px; }
footer { margin-top: 36px; color: var(--muted); font-size: 12px; }
"""

JS = """
(function () {
  var tip = document.getElementById('tip');
  document.querySelectorAll('svg title').forEach(function (t) {
    var el = t.parentNode;
    if (!el.getAttribute('data-tip')) el.setAttribute('data-tip', t.textContent);
    el.setAttribute('aria-label', t.textContent);
    t.remove();  // the custom tooltip replaces the browser's, so it does not show twice
  });
  document.addEventListener('mousemove', function (e) {
    var el = e.target.closest ? e.target.closest('[data-tip]') : null;
    if (!el) { tip.style.display = 'none'; return; }
    tip.textContent = el.getAttribute('data-tip');
    tip.style.display = 'block';
    var x = Math.min(e.clientX + 14, window.innerWidth - tip.offsetWidth - 8);
    var y = e.clientY + 16;
    if (y + tip.offsetHeight > window.innerHeight) y = e.clientY - tip.offsetHeight - 10;
    tip.style.left = x + 'px'; tip.style.top = y + 'px';
  });
  function select(id) {
    document.querySelectorAll('.plan-row').forEach(function (r) {
      r.setAttribute('aria-selected', r.getAttribute('data-plan') === id ? 'true' : 'false');
    });
    document.querySelectorAll('g.bar[data-row^="plan-"]').forEach(function (g) {
      g.setAttribute('aria-selected', g.getAttribute('data-row') === 'plan-' + id ? 'true' : 'false');
    });
    document.querySelectorAll('.plan-detail').forEach(function (d) {
      d.hidden = d.getAttribute('data-plan') !== id;
    });
  }
  document.querySelectorAll('.plan-row').forEach(function (r) {
    r.addEventListener('click', function () { select(r.getAttribute('data-plan')); });
  });
  var first = document.querySelector('.plan-row[aria-selected="true"]');
  if (first) select(first.getAttribute('data-plan'));
  document.querySelectorAll('g.bar[data-row^="plan-"]').forEach(function (g) {
    g.addEventListener('click', function () { select(g.getAttribute('data-row').slice(5)); });
  });
})();
"""


def esc(text) -> str:
    """HTML-escape any value (quotes too: safe inside attributes)."""
    return html.escape("" if text is None else str(text), quote=True)


def num_bytes(n_bytes, key: str, doc: str | None = None, tag: str = "span") -> str:
    """A byte count in its own unit (13.00 MiB, 14.96 GiB), carrying its exact value and JSON path."""
    if n_bytes is None:
        return f'<{tag} class="na">n/a</{tag}>'
    src = f' data-doc="{esc(doc)}"' if doc else ""
    return (f'<{tag} class="num" data-key="{esc(key)}" data-bytes="{int(n_bytes)}"{src}>'
            f"{esc(format_bytes(n_bytes))}</{tag}>")


def num_value(x, key: str, text: str | None = None, doc: str | None = None, tag: str = "span") -> str:
    """A number that is not a byte count (tokens/s, a loss, a line number), with its exact value and JSON path."""
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return f'<{tag} class="na">n/a</{tag}>'
    src = f' data-doc="{esc(doc)}"' if doc else ""
    return (f'<{tag} class="num" data-key="{esc(key)}" data-value="{esc(repr(x) if isinstance(x, float) else x)}"'
            f'{src}>{esc(format_value(x) if text is None else text)}</{tag}>')


def page(title: str, kind: str, body: str, refresh_s: int | None = None) -> str:
    """A whole self-contained HTML document: no external CSS, JS, fonts or images."""
    refresh = f'<meta http-equiv="refresh" content="{int(refresh_s)}">\n' if refresh_s else ""
    return (
        "<!DOCTYPE html>\n"
        '<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        f'<meta name="generator" content="fitune {esc(__version__)}">\n'
        f"{refresh}<title>{esc(title)}</title>\n<style>{CSS}</style>\n</head>\n"
        f'<body data-kind="{esc(kind)}">\n<main>\n{body}\n'
        f'<footer>fitune {esc(__version__)} &middot; fitune report {esc(kind)}</footer>\n</main>\n'
        f'<div id="tip" role="tooltip"></div>\n<script>{JS}</script>\n</body>\n</html>\n'
    )

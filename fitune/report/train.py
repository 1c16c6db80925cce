"""The `train` report: loss, eval loss, tokens/s and peak memory per step of a run folder's metrics.jsonl."""

from __future__ import annotations

import json
import os

from ..errors import FituneError
from ..files import open_regular
from .check import check_metrics_line
from .charts import Series, line_chart
from .html import OKABE_ITO, esc, num_bytes, num_value

FINAL_OUTPUTS = ("adapter", "model")
"""Folders `fitune train` writes when the run is complete (fitune/train/loop.py `_write_outputs`)."""


def read_run(run_dir: str) -> dict:
    """The report's document for a run folder: {"run_dir", "finished", "steps": [...], "evals": [...]}.

    `steps` holds the metrics.jsonl lines with a `loss`, `evals` those with an `eval_loss`, in file order.

    Raises:
        FituneError: no such folder, no metrics.jsonl in it, metrics.jsonl not a regular file inside the folder (a
            FIFO, a device, a link out of it), or a line that is not a JSON object of numbers.
    """
    if not os.path.isdir(run_dir):
        raise FituneError(f"{run_dir}: no such run folder; pass the output_dir of `fitune train` (it holds "
                          "metrics.jsonl)")
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        found = ", ".join(sorted(os.listdir(run_dir))[:8]) or "nothing"
        raise FituneError(f"{run_dir}: no metrics.jsonl (found: {found}); pass the output_dir of `fitune train`")
    steps, evals = [], []
    try:  # a FIFO, a device (a link to /dev/zero) or a link out of the run folder is refused, never read
        with open_regular(path, what="the run's", within=run_dir) as f:
            lines = f.readlines()
    except UnicodeDecodeError as exc:
        raise FituneError(f"{path} is not UTF-8 text ({exc.reason} at byte {exc.start}); metrics.jsonl holds one "
                          "JSON object per line, as fitune train writes it") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            if n == len(lines) and not line.endswith("\n"):
                break  # the run is writing this line right now
            raise FituneError(f"{path}:{n}: not JSON ({exc.msg}); metrics.jsonl holds one JSON object per line") from None
        except ValueError as exc:  # an integer of more than 4,300 digits
            raise FituneError(f"{path}:{n}: {exc}; metrics.jsonl holds the numbers fitune train writes") from None
        if not isinstance(row, dict):
            raise FituneError(f"{path}:{n}: expected a JSON object, got {type(row).__name__}")
        check_metrics_line(row, path, n)
        if "loss" in row:
            steps.append(row)
        if "eval_loss" in row:
            evals.append(row)
    finished = any(os.path.isdir(os.path.join(run_dir, x)) for x in FINAL_OUTPUTS)
    return {"run_dir": os.path.abspath(run_dir), "finished": finished, "steps": steps, "evals": evals}


def _points(rows: list[dict], field: str, prefix: str) -> list[tuple[float, float, str]]:
    return [(r["step"], r[field], f"{prefix}.{i}.{field}") for i, r in enumerate(rows)
            if r.get(field) is not None and r.get("step") is not None]


def render(doc: dict) -> tuple[str, str]:
    steps, evals = doc.get("steps") or [], doc.get("evals") or []
    name = os.path.basename(doc.get("run_dir", "").rstrip("/")) or "run"
    state = "finished" if doc.get("finished") else "running or stopped (no final adapter / model folder yet)"
    out = [f"<h1>fitune train: {esc(name)}</h1>",
           f'<p class="sub">{esc(doc.get("run_dir", ""))} &middot; <span data-value="{len(steps)}">{len(steps)}</span> steps '
           f"logged &middot; {esc(state)}</p>"]
    if not steps:
        out.append("<p>no step logged yet</p>")
        return f"fitune train: {name}", "\n".join(out)
    last = len(steps) - 1
    summary = [f"last loss {num_value(steps[-1]['loss'], f'steps.{last}.loss')} at step "
               f"{num_value(steps[-1].get('step'), f'steps.{last}.step')}"]
    if evals:
        best = min(range(len(evals)), key=lambda i: evals[i]["eval_loss"])
        summary.append(f"best eval loss {num_value(evals[best]['eval_loss'], f'evals.{best}.eval_loss')} at step "
                       f"{num_value(evals[best].get('step'), f'evals.{best}.step')}")
    tps = [i for i, r in enumerate(steps) if r.get("tokens_per_s")]
    if tps:
        i = tps[-1]
        summary.append(f"{_tps(steps, i)} tokens/s at the last step")
    mem = [i for i, r in enumerate(steps) if r.get("peak_reserved_bytes")]
    if mem:
        i = max(mem, key=lambda j: steps[j]["peak_reserved_bytes"])
        summary.append(f"highest peak reserved {num_bytes(steps[i]['peak_reserved_bytes'], f'steps.{i}.peak_reserved_bytes')}"
                       f" (step {num_value(steps[i].get('step'), f'steps.{i}.step')})")
    out.append("<ul>" + "".join(f"<li>{x}</li>" for x in summary) + "</ul>")
    changes = [(i, r) for i, r in enumerate(steps) if i and (r.get("micro_batch_size"), r.get("grad_checkpointing")) !=
               (steps[i - 1].get("micro_batch_size"), steps[i - 1].get("grad_checkpointing"))]
    if changes:
        out.append("<p>the OOM guard re-planned: " + "; ".join(
            f"from step {num_value(r.get('step'), f'steps.{i}.step')} micro-batch "
            f"{num_value(r.get('micro_batch_size'), f'steps.{i}.micro_batch_size')}, checkpointing "
            f"{esc(r.get('grad_checkpointing'))}" for i, r in changes) + "</p>")

    charts = [line_chart([Series("train loss", OKABE_ITO["blue"], _points(steps, "loss", "steps")),
                          Series("eval loss", OKABE_ITO["vermillion"], _points(evals, "eval_loss", "evals"), "6 3")],
                         title="loss"),
              line_chart([Series("tokens/s", OKABE_ITO["bluish_green"], _points(steps, "tokens_per_s", "steps"))],
                         title="tokens/s")]
    if mem:
        charts.append(line_chart([Series("peak reserved", OKABE_ITO["sky_blue"],
                                          _points(steps, "peak_reserved_bytes", "steps")),
                                  Series("peak allocated", OKABE_ITO["blue"],
                                         _points(steps, "peak_allocated_bytes", "steps"), "6 3")],
                                 title="peak memory per step", bytes_axis=True))
    else:
        charts.append('<figure class="chart"><figcaption><b>peak memory per step</b></figcaption><p class="notes">'
                      "not recorded: the run is on the CPU (metrics.jsonl has peak_allocated_bytes: null)</p></figure>")
    if any(r.get("lr") is not None for r in steps):
        charts.append(line_chart([Series("learning rate", OKABE_ITO["reddish_purple"], _points(steps, "lr", "steps"))],
                                 title="learning rate"))
    out.append('<div class="charts">' + "".join(charts) + "</div>")
    return f"fitune train: {name}", "\n".join(out)


def _tps(steps: list[dict], i: int) -> str:
    return num_value(steps[i]["tokens_per_s"], f"steps.{i}.tokens_per_s", f"{steps[i]['tokens_per_s']:,.0f}")

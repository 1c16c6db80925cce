"""Checking the numbers of a report's input before anything is drawn: a number given as a string ("1000"), a
boolean or a list where fitune writes a number, and numbers no fitune output holds (1e308 steps, a 5,000-digit
integer, infinity) each get one message naming the JSON path and the value, instead of a traceback or a chart
that never finishes drawing.

Which keys hold numbers follows the documents fitune writes (docs/reference.md / docs/plan.md "JSON output", metrics.jsonl
in fitune/train/loop.py): names ending in `_bytes`, `_params`, `_tokens`, `_per_s`, `_per_step`, `_time_s`, a few
counts by name, and the category maps (`breakdown`, ...) whose values are byte counts.
"""

from __future__ import annotations

import math

from ..errors import FituneError

LARGEST = 2**63
"""No number fitune writes is larger (a byte count of 8 EiB); anything beyond is not a fitune output."""

COUNTED_SUFFIXES = ("_bytes", "_params")
NUMBER_SUFFIXES = ("_bytes", "_params", "_tokens", "_per_s", "_per_step", "_time_s")
NUMBER_NAMES = frozenset({
    "batch_size", "grad_accum", "micro_batch_size", "per_gpu_batch_size", "lora_rank", "lora_alpha", "lora_dropout",
    "num_gpus", "rank", "steps", "mfu", "seconds", "setups", "estimated_extrapolated", "estimated_full",
    "freeze_trainable_layers", "num_alloc_retries", "bytes", "speed_change", "t_s"})
TRAIN_NAMES = frozenset({"step", "loss", "eval_loss", "lr", "tokens", "trained_tokens", "grad_norm", "epoch"})
"""metrics.jsonl's numbers besides the suffixed ones (`loss` is a number there, a loss kind in a setup)."""
NUMBER_MAPS = frozenset({"breakdown", "difference_bytes", "estimate_breakdown", "live_by_category",
                         "resident_bytes"})
"""Objects of category -> bytes."""


def _type_name(value) -> str:
    if isinstance(value, bool):
        return "a boolean"
    return {str: "a string", list: "a list", dict: "an object"}.get(type(value), type(value).__name__)


def number_problem(value, *, counted: bool = False, none_ok: bool = True) -> str | None:
    """Why `value` cannot be a number of a fitune output ('is '12' (a string), not a number'), or None when it can
    (a number within ±2**63; null when `none_ok`; NaN, for a step that never ran, unless `counted`: bytes and
    parameters are counted, never NaN)."""
    if value is None:
        return None if none_ok else "is null, not a number"
    if isinstance(value, (str, bool)):
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
        return f"is {shown} ({_type_name(value)}), not a number"
    if not isinstance(value, (int, float)):
        return f"is {_type_name(value)}, not a number"
    if isinstance(value, float) and math.isnan(value):
        return "is NaN; fitune counts it, so it is always a number" if counted else None
    if not abs(value) <= LARGEST:
        shown = f"{value:.4g}" if isinstance(value, float) else f"an integer of {len(str(abs(value)))} digits"
        return f"is {shown}, beyond any number fitune writes (at most 2**63 = {float(LARGEST):.3g})"
    return None


def _is_number_key(key, train: bool) -> bool:
    return isinstance(key, str) and (key.endswith(NUMBER_SUFFIXES) or key in NUMBER_NAMES
                                     or (train and key in TRAIN_NAMES))


def problems_in(node, path: str = "", train: bool = False, limit: int = 8) -> list[str]:
    """'<path> is '12' (a string), not a number' for every number slot of `node` that does not hold a usable
    number, and every number anywhere beyond ±2**63 (at most `limit`). `train`: `node` is a metrics.jsonl line."""
    out: list[str] = []

    def walk(n, p: str) -> None:
        if len(out) >= limit:
            return
        if isinstance(n, dict):
            for k, v in n.items():
                q = f"{p}.{k}" if p else str(k)
                if k in NUMBER_MAPS and isinstance(v, dict):
                    for c, b in v.items():
                        slot(b, f"{q}.{c}", counted=True, none_ok=False)
                elif k in NUMBER_MAPS and v is not None:
                    out.append(f"{q} is {_type_name(v)}; fitune writes an object of category: bytes there")
                elif _is_number_key(k, train):
                    slot(v, q, counted=k.endswith(COUNTED_SUFFIXES))
                else:
                    walk(v, q)
        elif isinstance(n, list):
            for i, v in enumerate(n):
                walk(v, f"{p}.{i}")
        elif isinstance(n, (int, float)) and not isinstance(n, bool):
            slot(n, p)  # a number where fitune writes text is drawn as text, but not one beyond any real value

    def slot(v, q: str, **rules) -> None:
        why = number_problem(v, **rules)
        if why and len(out) < limit:
            out.append(f"{q} {why}")

    walk(node, path)
    return out


def check_numbers(doc, kind: str, source: str) -> None:
    """Raise one FituneError listing the number slots of a `fitune KIND --json` document that hold no usable
    number. The doctor's findings hold free-form evidence and are not checked here."""
    if kind == "doctor":
        return
    found = problems_in(doc)
    if found:
        raise FituneError(f"{source} is not the unedited JSON of `fitune {kind} --json`: "
                          + "; ".join(found) + ". Pass what the command printed (its numbers are numbers)")


def check_metrics_line(row: dict, path: str, line: int) -> None:
    """Raise a FituneError naming `path:line` when a metrics.jsonl line's numbers are not numbers."""
    found = problems_in(row, train=True)
    if found:
        raise FituneError(f"{path}:{line}: " + "; ".join(found) + " (fitune train writes numbers there); pass the "
                          "output_dir of a fitune run, or fix that line")

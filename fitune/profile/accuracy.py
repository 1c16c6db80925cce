"""Compare the analytic estimate with measured GPU runs (bench/results/*/hf_recipe.jsonl). Pure Python.

`python -m fitune.profile.accuracy FILE.jsonl` prints the per-case table and the summary the README quotes.
"""

from __future__ import annotations

import json
import statistics
import sys
from dataclasses import dataclass

from ..memory import estimate
from ..setup import TrainSetup
from ..specs.gpu import resolve_gpu
from ..specs.model import load_model_spec
from ..units import GiB


@dataclass(frozen=True)
class AccuracyRow:
    label: str
    measured_allocated_bytes: int
    estimated_allocated_bytes: int
    measured_reserved_bytes: int
    estimated_reserved_bytes: int

    @property
    def allocated_error_pct(self) -> float:
        return 100.0 * (self.estimated_allocated_bytes - self.measured_allocated_bytes) / self.measured_allocated_bytes

    @property
    def reserved_error_pct(self) -> float:
        return 100.0 * (self.estimated_reserved_bytes - self.measured_reserved_bytes) / self.measured_reserved_bytes


def setup_of_record(r: dict) -> TrainSetup:
    """The TrainSetup a bench record was measured with (its setup fields by name; the rest are measurements)."""
    return TrainSetup.from_dict(r, strict=False)


def compare(path: str, gpu: str = "h200") -> list[AccuracyRow]:
    rows = []
    g = resolve_gpu(gpu)
    with open(path, encoding="utf-8") as f:
        for line in f:
            r = json.loads(line)
            if not r.get("ok"):
                continue
            setup = setup_of_record(r)
            est = estimate(load_model_spec(r["model"]), setup, g)
            label = (f"{r['model']} {r['method']} {r['lora_targets']} r{r['lora_rank']} {r['batch_size']}x"
                     f"{r['seq_len_tokens']} ckpt={r['grad_checkpointing']} {r['attn']}")
            rows.append(AccuracyRow(label, r["peak_allocated_bytes"], est.peak_allocated_bytes,
                                    r["peak_reserved_bytes"], est.peak_reserved_bytes))
    return rows


def summary(rows: list[AccuracyRow]) -> dict[str, float]:
    a = [abs(r.allocated_error_pct) for r in rows]
    b = [abs(r.reserved_error_pct) for r in rows]
    return {"cases": len(rows), "allocated_median_pct": statistics.median(a), "allocated_max_pct": max(a),
            "reserved_median_pct": statistics.median(b), "reserved_max_pct": max(b)}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    path = argv[0] if argv else "bench/results/hf_recipe/hf_recipe.jsonl"
    rows = compare(path)
    gib = GiB
    print(f"{'case':78s} {'alloc GiB':>9s} {'est':>7s} {'err':>7s} {'resv GiB':>9s} {'est':>7s} {'err':>7s}")
    for r in rows:
        print(f"{r.label:78s} {r.measured_allocated_bytes / gib:9.2f} {r.estimated_allocated_bytes / gib:7.2f} "
              f"{r.allocated_error_pct:+6.2f}% {r.measured_reserved_bytes / gib:9.2f} "
              f"{r.estimated_reserved_bytes / gib:7.2f} {r.reserved_error_pct:+6.2f}%")
    s = summary(rows)
    print(f"\n{s['cases']} cases; |error| of peak allocated: median {s['allocated_median_pct']:.2f} %, "
          f"max {s['allocated_max_pct']:.2f} %; of peak reserved: median {s['reserved_median_pct']:.2f} %, "
          f"max {s['reserved_max_pct']:.2f} %")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

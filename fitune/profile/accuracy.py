"""Compare the analytic estimate with measured GPU runs (bench/results/*/hf_recipe.jsonl). Pure Python.

`python -m fitune.profile.accuracy FILE.jsonl` prints the per-case table and the summary docs/accuracy.md quotes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
from dataclasses import dataclass

from ..memory import estimate
from ..plan.measured import ALLOCATED_LIMIT_PCT, MEASURED_PATH, RESERVED_LIMIT_PCT, evidence_of
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
    setup: TrainSetup | None = None
    model_type: str = ""
    sample: str = "in"
    """in: the estimator was changed after (or while) looking at this measurement; out: measured after its last
    change, a prediction."""

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
            label = _label(r["model"], setup)
            rows.append(AccuracyRow(label, r["peak_allocated_bytes"], est.peak_allocated_bytes,
                                    r["peak_reserved_bytes"], est.peak_reserved_bytes, setup,
                                    load_model_spec(r["model"]).model_type))
    return rows


def _label(model: str, s: TrainSetup) -> str:
    what = (f"{s.method} {','.join(s.lora_targets)} r{s.lora_rank}" if s.method in ("lora", "qlora")
            else f"{s.method}" + (f" last {s.freeze_trainable_layers}" if s.method == "freeze" else ""))
    extra = [x for x in (s.optimizer if s.optimizer != "adamw" else "", s.dtype if s.dtype != "bf16" else "",
                         f"stack {s.stack}" if s.stack != "hf" else "", "chunked" if s.loss == "chunked" else "",
                         "liger" if s.kernels == "liger" else "", "tiled-mlp" if s.tiled_mlp else "",
                         "keep-outputs" if s.keep_outputs else "") if x]
    return (f"{model} {what} {s.batch_size}x{s.seq_len_tokens} ckpt={s.grad_checkpointing} {s.attn}"
            + (f" {' '.join(extra)}" if extra else ""))


def compare_profiles(path: str, gpu: str = "h200", root: str = ".") -> list[AccuracyRow]:
    """The same comparison for `fitune profile --json` records (bench/options.sh lines: the profile object plus
    `model_arg`, the MODEL argument it was given, a catalog name or a config.json path relative to `root`)."""
    rows = []
    g = resolve_gpu(gpu)
    with open(path, encoding="utf-8") as f:
        for line in f:
            r = json.loads(line)
            if not r.get("ok") or r.get("oom"):
                continue
            setup = TrainSetup.from_dict(r["setup"])
            arg = r["model_arg"]
            model = os.path.join(root, arg) if arg.endswith(".json") else arg
            spec = load_model_spec(model)
            est = estimate(spec, setup, g)
            name = os.path.basename(arg)[:-5] if arg.endswith(".json") else arg
            rows.append(AccuracyRow(_label(name, setup), r["peak_allocated_bytes"], est.peak_allocated_bytes,
                                    r["peak_reserved_bytes"], est.peak_reserved_bytes, setup, spec.model_type))
    return rows


def compare_setups(path: str, gpu: str = "h200") -> list[AccuracyRow]:
    """The same comparison for records that hold their whole `setup` and the catalog `model`: bench/speed_calibration.py
    (`ok`) and bench/rank_check.py (`fitune train`'s exit code 0)."""
    rows = []
    g = resolve_gpu(gpu)
    with open(path, encoding="utf-8") as f:
        for line in f:
            r = json.loads(line)
            if not (r.get("ok") or r.get("exit") == 0) or not r.get("peak_allocated_bytes"):
                continue
            setup = TrainSetup.from_dict(r["setup"])
            spec = load_model_spec(r["model"])
            est = estimate(spec, setup, g)
            rows.append(AccuracyRow(_label(r["model"], setup), r["peak_allocated_bytes"], est.peak_allocated_bytes,
                                    r["peak_reserved_bytes"], est.peak_reserved_bytes, setup, spec.model_type))
    return rows


def compare_context(path: str, model: str = "llama-3.1-8b") -> list[AccuracyRow]:
    """The same comparison for bench/peers/unsloth_max_context.py's fitune probes that completed (`fits` true):
    each holds its `setup` and the allocator cap it ran under (`cap`, estimated as that budget); the model is the
    catalog's `model` (the probes train llama-3.1-8b)."""
    rows = []
    spec = load_model_spec(model)
    with open(path, encoding="utf-8") as f:
        for line in f:
            r = json.loads(line)
            if r.get("stack") != "fitune" or r.get("summary") or r.get("fits") is not True:
                continue
            setup = TrainSetup.from_dict(r["setup"])
            est = estimate(spec, setup, resolve_gpu(r["cap"]))
            rows.append(AccuracyRow(_label(model, setup), r["peak_allocated_bytes"], est.peak_allocated_bytes,
                                    r["peak_reserved_bytes"], est.peak_reserved_bytes, setup, spec.model_type))
    return rows


def summary(rows: list[AccuracyRow]) -> dict[str, float]:
    a = [abs(r.allocated_error_pct) for r in rows]
    b = [abs(r.reserved_error_pct) for r in rows]
    return {"cases": len(rows), "allocated_median_pct": statistics.median(a), "allocated_max_pct": max(a),
            "reserved_median_pct": statistics.median(b), "reserved_max_pct": max(b)}


def method_table(rows: list[AccuracyRow]) -> str:
    """docs/accuracy.md's accuracy table: |error| of the peaks by method, optimizer and sample (in-sample: the estimator
    was fitted to or changed after these runs; out-of-sample: measured after its last change), median / max, %."""
    groups: dict[tuple[str, str, str], list[AccuracyRow]] = {}
    for r in rows:
        groups.setdefault((r.setup.method, r.setup.optimizer, r.sample), []).append(r)
    order = {"lora": 0, "qlora": 1, "full": 2, "freeze": 3}
    lines = ["| method | optimizer | sample | cases | allocated: median | max | reserved: median | max |",
             "|---|---|---|---|---|---|---|---|"]
    for (method, opt, sample), rs in sorted(groups.items(),
                                            key=lambda kv: (order.get(kv[0][0], 9), kv[0][1], kv[0][2])):
        a = [abs(r.allocated_error_pct) for r in rs]
        b = [abs(r.reserved_error_pct) for r in rs]
        lines.append(f"| {method} | {opt} | {sample}-of-sample | {len(rs)} | {statistics.median(a):.2f} % | "
                     f"{max(a):.2f} % | {statistics.median(b):.2f} % | {max(b):.2f} % |".replace("in-of-sample",
                                                                                             "in-sample"))
    return "\n".join(lines)


#: The committed GPU records the planner's evidence (fitune/specs/data/measured.json) is made of: (path under the
#: repository, reader, sample). bench/results/issue12/full_recipe.jsonl is left out: its cases after the first of each
#: process started with the previous case's memory still cached (its allocation traces are used, not its peaks).
#: "out": measured after the estimator's last change (2026-12-03: fitune's runner on four models,
#: bench/speed_calibration.py, and the ranking check's `fitune train` runs), a test of its predictions.
SOURCES = (
    ("bench/results/hf_recipe/hf_recipe.jsonl", "recipe", "in"),
    ("bench/results/hf_recipe/eager_rerun/eager.jsonl", "recipe", "in"),
    ("bench/results/issue12/options.jsonl", "profile", "in"),
    ("bench/results/speed/speed.jsonl", "setup", "out"),
    ("bench/results/rank_check/rank_check.jsonl", "setup", "out"),
    ("bench/results/peers/context_per_card/call1/max_context.jsonl", "context", "out"),
    ("bench/results/peers/context_per_card/call2/max_context.jsonl", "context", "out"),
    ("bench/results/peers/context_48gb/call1/max_context.jsonl", "context", "out"),
    ("bench/results/peers/run4/rank_check.jsonl", "setup", "out"),
    ("bench/results/speed/compiled_check.jsonl", "setup", "out"),
)


def _rows_by_source(root: str) -> list[tuple[str, list[AccuracyRow]]]:
    readers = {"profile": lambda p: compare_profiles(p, root=root), "recipe": compare, "setup": compare_setups,
               "context": compare_context}
    # the compiled-layer runs (compile: layers) are in-sample whatever their file: the estimator's model of the
    # compiled layer was last changed after they were measured (the rules made from runs with zero LoRA gradients
    # were taken out: bench/results/speed/zero_grads/)
    return [(rel, [dataclasses.replace(r, sample="in" if r.setup.compile != "none" else sample)
                   for r in readers[kind](os.path.join(root, rel))])
            for rel, kind, sample in SOURCES]


def measured_rows(root: str = ".") -> list[AccuracyRow]:
    """Every committed measurement of SOURCES, compared with the estimate."""
    return [r for _, rows in _rows_by_source(root) for r in rows]


def measured_evidence(root: str = ".") -> dict:
    """The content of fitune/specs/data/measured.json (see fitune/plan/measured.py)."""
    cases = [(r.setup, r.model_type, r.allocated_error_pct, r.reserved_error_pct, rel)
             for rel, rows in _rows_by_source(root) for r in rows]
    return {"about": "written by `python -m fitune.profile.accuracy --write-measured` from the GPU records under "
                     "bench/results/; see fitune/plan/measured.py",
            "limits": {"allocated_pct": ALLOCATED_LIMIT_PCT, "reserved_pct": RESERVED_LIMIT_PCT},
            "options": evidence_of(cases)}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--write-measured"]:
        with open(MEASURED_PATH, "w", encoding="utf-8") as f:
            f.write(json.dumps(measured_evidence(), indent=1, sort_keys=True) + "\n")
        return 0
    if argv[:1] == ["--table"]:
        print(method_table(measured_rows()))
        return 0
    path = argv[0] if argv else "bench/results/hf_recipe/hf_recipe.jsonl"
    with open(path, encoding="utf-8") as f:
        first = json.loads(f.readline() or "{}")
    rows = (compare_profiles(path) if "model_arg" in first else compare_setups(path) if "setup" in first
            else compare(path))
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

"""The analytic engine against the committed GPU measurements of the HF recipe (bench/results/hf_recipe/)."""

import os
import re

import pytest

from fitune.profile.accuracy import compare, summary

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MEASURED = os.path.join(ROOT, "bench", "results", "hf_recipe", "hf_recipe.jsonl")
ROWS = compare(MEASURED)


def test_enough_cases_over_enough_architectures():
    assert len(ROWS) >= 40
    assert len({r.label.split()[0] for r in ROWS}) >= 4


@pytest.mark.parametrize("row", ROWS, ids=[r.label for r in ROWS])
def test_within_3pct_allocated(row):
    assert abs(row.allocated_error_pct) <= 3.0, row


@pytest.mark.parametrize("row", ROWS, ids=[r.label for r in ROWS])
def test_within_5pct_reserved(row):
    assert abs(row.reserved_error_pct) <= 5.0, row


def test_readme_error_table_matches_the_measurements():
    s = summary(ROWS)
    readme = open(os.path.join(ROOT, "docs", "accuracy.md"), encoding="utf-8").read()  # moved from the README
    m = re.search(r"\| peak allocated \| (\d+) \| ([\d.]+) % \| ([\d.]+) % \|", readme)
    n = re.search(r"\| peak reserved \| (\d+) \| ([\d.]+) % \| ([\d.]+) % \|", readme)
    assert m and n, "docs/accuracy.md lacks the error table"
    assert int(m.group(1)) == s["cases"] == int(n.group(1))
    assert (m.group(2), m.group(3)) == (f"{s['allocated_median_pct']:.2f}", f"{s['allocated_max_pct']:.2f}")
    assert (n.group(2), n.group(3)) == (f"{s['reserved_median_pct']:.2f}", f"{s['reserved_max_pct']:.2f}")


def test_profiled_seeds_case_per_category():
    """`fitune profile` on the H200 (bench/results/profile/): measured categories against the estimate."""
    import json

    from fitune.memory import estimate
    from fitune.setup import TrainSetup, parse_targets
    from fitune.specs.gpu import resolve_gpu
    from fitune.specs.model import load_model_spec

    doc = json.load(open(os.path.join(ROOT, "bench", "results", "profile", "seeds_ckpt_uncapped.json")))
    s = doc["setup"]
    setup = TrainSetup(**{**s, "lora_targets": parse_targets(s["lora_targets"])})
    est = estimate(load_model_spec(doc["model"]), setup, resolve_gpu("h200"))
    peak = doc["peak_allocated_bytes"]
    assert abs(est.peak_allocated_bytes - peak) <= 0.03 * peak
    assert abs(est.peak_reserved_bytes - doc["peak_reserved_bytes"]) <= 0.05 * doc["peak_reserved_bytes"]
    for category, measured in doc["breakdown"].items():
        assert abs(est.breakdown[category] - measured) <= 0.01 * peak, category


def _train_runs():
    import json

    folder = os.path.join(ROOT, "bench", "results", "train")
    out = []
    for name in ("plan", "guard", "chunked", "ckpt"):
        lines = [json.loads(x) for x in open(os.path.join(folder, f"train_{name}.jsonl"))]
        out.append((name, lines))
    return out


@pytest.mark.parametrize("name, lines", _train_runs(), ids=[n for n, _ in _train_runs()])
def test_fitune_stack_estimate_matches_fitune_train_on_the_gpu(name, lines):
    """`--stack fitune` against `fitune train`'s own per-step peaks (bench/results/train/, H200 capped at 23.4 GiB)."""
    from fitune.memory import estimate
    from fitune.setup import TrainSetup
    from fitune.specs.gpu import resolve_gpu
    from fitune.specs.model import load_model_spec

    last = lines[-1]
    setup = TrainSetup(method="qlora" if name == "plan" else "lora", batch_size=last["micro_batch_size"],
                       grad_accum=2 // last["micro_batch_size"], seq_len_tokens=2048,
                       grad_checkpointing="full" if last["grad_checkpointing"] else "none",
                       loss="chunked" if name == "chunked" else "hf", stack="fitune")
    est = estimate(load_model_spec("llama-3.1-8b"), setup, resolve_gpu("h200"))
    steady = [x for x in lines[1:]]  # step 1 holds the re-plans of the guard run
    allocated = max(x["peak_allocated_bytes"] for x in steady)
    reserved = max(x["peak_reserved_bytes"] for x in steady)
    assert abs(est.peak_allocated_bytes - allocated) <= 0.03 * allocated
    if est.peak_reserved_bytes <= 23.4 * 2**30:  # above the cap the allocator flushes its cache instead
        assert abs(est.peak_reserved_bytes - reserved) <= 0.05 * reserved


def test_the_plans_top_pick_ran_as_predicted():
    """Issue 6's GPU record: `fitune plan`'s first plan for the seeds' case, run by `fitune train` on the H200 under
    a 23.4 GiB cap (bench/results/train/train_plan.jsonl), fits, peaks within the estimator's error, and runs within
    15 % of the throughput model's prediction for the GPU it ran on."""
    import json
    import statistics

    import yaml

    from fitune.memory import estimate
    from fitune.plan import throughput
    from fitune.config import setup_from_config
    from fitune.specs.gpu import resolve_gpu
    from fitune.specs.model import load_model_spec

    folder = os.path.join(ROOT, "bench", "results", "train")
    _, setup = setup_from_config(yaml.safe_load(open(os.path.join(folder, "plan.yaml"))))
    lines = [json.loads(x) for x in open(os.path.join(folder, "train_plan.jsonl"))]
    model, h200 = load_model_spec("llama-3.1-8b"), resolve_gpu("h200")
    measured_peak = max(x["peak_allocated_bytes"] for x in lines)
    assert measured_peak <= resolve_gpu("rtx4090").allocator_budget_bytes
    assert abs(estimate(model, setup, h200).peak_allocated_bytes - measured_peak) <= 0.03 * measured_peak
    measured_tps = statistics.median(x["tokens_per_s"] for x in lines[1:])
    predicted = throughput.predict(model, setup, h200).tokens_per_s
    assert abs(measured_tps - predicted) <= 0.15 * predicted, (measured_tps, predicted)


# ---- issue 12: every option the planner can choose, measured (bench/results/issue12/, bench/options.sh) ----------

OPTION_ROWS = __import__("fitune.profile.accuracy", fromlist=["compare_profiles"]).compare_profiles(
    os.path.join(ROOT, "bench", "results", "issue12", "options.jsonl"), root=ROOT)


def test_the_option_cases_cover_every_method_optimizer_and_new_architecture():
    setups = [r.setup for r in OPTION_ROWS]
    assert len(OPTION_ROWS) >= 30
    assert {s.method for s in setups} >= {"lora", "qlora", "full", "freeze"}
    assert {s.optimizer for s in setups} >= {"adamw", "adamw8bit", "paged_adamw8bit", "adafactor", "sgd"}
    assert {"fp16", "bf16"} <= {s.dtype for s in setups} and "liger" in {s.kernels for s in setups}
    assert {r.model_type for r in OPTION_ROWS} >= {"gemma3_text", "phi3", "qwen3_moe", "mixtral"}
    assert any(s.keep_outputs for s in setups) and any(s.tiled_mlp for s in setups)


KNOWN_OPTION_MISSES = {
    "llama-3.2-1b full 2x2048 ckpt=full sdpa adafactor",  # reserved -9.2 %
    "qwen2.5-1.5b full 2x2048 ckpt=full sdpa adafactor",  # reserved -6.4 %
    "qwen2.5-1.5b full 2x2048 ckpt=full sdpa adamw8bit stack fitune chunked",  # allocated -4.5 %
    "qwen2.5-1.5b qlora all-linear r32 1x8192 ckpt=full sdpa stack fitune chunked",  # reserved -8.7 %
}
"""The option cases outside issue 12's goal, written down by hand from the estimate of 2026-12-05 (issue 34). The
check used to compare each row with fitune/specs/data/measured.json, which is generated from these same rows, so a
row outside the goal always had its own trace there and the check could not fail. A list kept by hand can: an
estimator change that moves another case outside the goal fails below until it is fixed or added here."""


@pytest.mark.parametrize("row", OPTION_ROWS, ids=[r.label for r in OPTION_ROWS])
def test_each_option_case_is_within_the_goal_or_a_known_miss_the_planner_flags(row):
    """Issue 12's goal: peak allocated within 2 %, reserved within 5 %. A case outside it is one of the misses
    written down above, and the planner lists its options as unvalidated (fitune/specs/data/measured.json)."""
    from fitune.plan.measured import unmeasured_reasons

    within = abs(row.allocated_error_pct) <= 2.0 and abs(row.reserved_error_pct) <= 5.0
    if not within:
        assert row.label in KNOWN_OPTION_MISSES, f"a new miss: {row}"
        assert unmeasured_reasons(row.setup, row.model_type), row


def test_the_known_option_misses_are_still_misses():
    """A miss that the estimator now gets right leaves the list (which stays the list of real misses)."""
    labels = {r.label: r for r in OPTION_ROWS}
    assert KNOWN_OPTION_MISSES <= set(labels), sorted(KNOWN_OPTION_MISSES - set(labels))
    fixed = [m for m in KNOWN_OPTION_MISSES if abs(labels[m].allocated_error_pct) <= 2.0
             and abs(labels[m].reserved_error_pct) <= 5.0]
    assert not fixed, f"within the goal now, remove from KNOWN_OPTION_MISSES: {fixed}"


def test_the_planners_evidence_file_is_current():
    import json

    from fitune.plan.measured import MEASURED_PATH
    from fitune.profile.accuracy import measured_evidence

    committed = json.load(open(MEASURED_PATH, encoding="utf-8"))
    assert committed == json.loads(json.dumps(measured_evidence(ROOT))), \
        "run `python -m fitune.profile.accuracy --write-measured`"


def test_readme_accuracy_table_by_method_and_optimizer_matches():
    from fitune.profile.accuracy import measured_rows, method_table

    readme = open(os.path.join(ROOT, "docs", "accuracy.md"), encoding="utf-8").read()  # moved from the README
    assert method_table(measured_rows(ROOT)) in readme


# ---- out of sample: runs measured after the estimator's last change (bench/results/speed/, rank_check/) ----------


def test_out_of_sample_runs_hold_the_estimate():
    """82 runs of fitune's runner on four models (bench/speed_calibration.py: every technique, uncapped) and the
    ranking check's `fitune train` runs under a 24 GB cap and the context probes at 8-48 GB, measured after the estimator was last changed: a test of
    its predictions, not a fit. docs/accuracy.md states how many are within the goal (2 % allocated, 5 % reserved) and
    names the misses; this holds those numbers, and the misses within 4 % / 7 %."""
    from fitune.profile.accuracy import measured_rows

    rows = [r for r in measured_rows(ROOT) if r.sample == "out"]
    assert len(rows) == 97
    allocated_misses = [r.label for r in rows if abs(r.allocated_error_pct) > 2.0]
    reserved_misses = [r.label for r in rows if abs(r.reserved_error_pct) > 5.0]
    assert allocated_misses == ["llama-3.1-8b qlora all-linear r32 1x32768 ckpt=full sdpa stack fitune chunked liger"]
    assert len(reserved_misses) == 5
    assert all(abs(r.allocated_error_pct) <= 4.0 and abs(r.reserved_error_pct) <= 7.0 for r in rows)
    readme = open(os.path.join(ROOT, "docs", "accuracy.md"), encoding="utf-8").read()  # moved from the README
    n = len(rows)
    assert f"{n - len(allocated_misses)} of the {n}" in readme and f"{n - len(reserved_misses)} of the {n}" in readme

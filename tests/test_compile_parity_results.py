"""The compiled layers' gradients on the GPU, before and after the lean LoRA branch's fix, and the estimator on the
compiled runs measured after it: docs/history.md's and docs/accuracy.md's figures recomputed from the committed records
(bench/compile_parity.py, bench/speed_calibration.py; commands in bench/results/speed/COMMAND.md)."""

import json
import os
import re

from fitune.profile.accuracy import compare_setups, measured_rows

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPEED = os.path.join(ROOT, "bench", "results", "speed")
DOCS = " ".join(open(os.path.join(ROOT, "docs", page), encoding="utf-8").read()
                for page in ("history.md", "accuracy.md")).replace("\n", " ")
"""Where the README's post-mortem and compiled-run figures went (issue 34)."""


def _quoted(*figures):
    """Each figure, formatted as the docs print it, stands in the pages as a number (not inside a longer one): a
    check of numbers against the records, not of the sentences around them."""
    missing = [f for f in figures if not re.search(rf"(?<![\d.,]){re.escape(f)}(?![\d])", DOCS)]
    assert not missing, f"figures the records give and docs/ does not quote: {missing}"


def _lines(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def test_before_the_fix_every_compiled_lora_gradient_was_zero():
    rows = _lines(os.path.join(SPEED, "zero_grads", "compile_parity_before.jsonl"))
    assert {(r["method"], r["grad_checkpointing"]) for r in rows} == {
        ("lora", "none"), ("lora", "full"), ("qlora", "none"), ("qlora", "full")}
    for r in rows:
        assert r["zero_grads_eager"] == 0 and r["zero_grads_compiled"] == r["lora_grads"] == 56, r
        assert abs(r["loss_compiled"] / r["loss_eager"] - 1) < 1e-4  # the loss gave nothing away
    _quoted(str(rows[0]["lora_grads"]), "0.01 %")  # all 56 zero; the loss within 0.01 % (1e-4, checked above)


def test_after_the_fix_compiled_gradients_match_eager():
    rows = _lines(os.path.join(SPEED, "compile_parity.jsonl"))
    assert len(rows) == 4 and all(r["versions"]["torch"].startswith("2.11") for r in rows)
    for r in rows:
        assert r["zero_grads_compiled"] == 0 and r["lora_grads"] == 56
        assert r["max_rel_diff"] < 0.03  # bf16 rounding: eager and Inductor order their sums differently
        assert abs(r["loss_compiled"] / r["loss_eager"] - 1) < 1e-4
    worst = max(r["max_rel_diff"] for r in rows)
    medians = sorted(r["median_rel_diff"] for r in rows)
    _quoted(f"{worst:.1%}".replace("%", " %"), f"{100 * medians[0]:.1f}", f"{medians[-1]:.1%}".replace("%", " %"))


def test_the_graph_excerpt_shows_the_zero_gradient():
    text = open(os.path.join(SPEED, "zero_grads", "zero_grad_graph_excerpt.txt"), encoding="utf-8").read()
    assert "tangents_1" in text and "triton_poi_fused_view_zeros" in text and "zeros_3" in text


def test_compiled_runs_measured_after_the_fix_hold_the_estimate():
    rows = [r for r in measured_rows(ROOT) if r.setup.compile == "layers"]
    assert len(rows) == 24
    worst_alloc = max(abs(r.allocated_error_pct) for r in rows)
    worst_resv = max(abs(r.reserved_error_pct) for r in rows)
    assert worst_alloc < 1.0
    _quoted(str(len(rows)), f"{worst_alloc:.2f} %", f"{worst_resv:.1f} %")
    check = compare_setups(os.path.join(SPEED, "compiled_check.jsonl"))
    assert len(check) == 9 and {r.label.split()[0] for r in check} == {"llama-3.1-8b", "qwen2.5-7b", "mistral-7b"}
    _quoted(str(len(check)), f"{max(abs(r.allocated_error_pct) for r in check):.2f} %")


def test_no_compiled_calibration_line_predates_the_fix():
    """speed.jsonl's compiled lines are the ones measured after the fix (14); the bugged ones are not read."""
    rows = _lines(os.path.join(SPEED, "speed.jsonl"))
    compiled = [r for r in rows if r["setup"].get("compile") == "layers"]
    assert len(compiled) == 14
    bugged = _lines(os.path.join(SPEED, "zero_grads", "speed_compile_zero_grads.jsonl"))
    assert not {json.dumps(r, sort_keys=True) for r in bugged} & {json.dumps(r, sort_keys=True) for r in compiled}
    assert all(r["ok"] and r["steps"] == 8 and len(r["step_times_s"]) == 8 for r in compiled)
    assert {r["model"] for r in compiled} == {"llama-3.1-8b", "llama-3.2-1b"}

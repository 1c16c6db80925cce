"""The compiled layers' gradients on the GPU, before and after the lean LoRA branch's fix, and the estimator on the
compiled runs measured after it: the README's figures recomputed from the committed records
(bench/compile_parity.py, bench/speed_calibration.py; commands in bench/results/speed/COMMAND.md)."""

import json
import os

from fitune.profile.accuracy import compare_setups, measured_rows

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPEED = os.path.join(ROOT, "bench", "results", "speed")
README = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read().replace("\n", " ")


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
    assert "with compiled layers **all 56 were zero**" in README
    assert "the loss matched the eager one to within 0.01 %" in README


def test_after_the_fix_compiled_gradients_match_eager():
    rows = _lines(os.path.join(SPEED, "compile_parity.jsonl"))
    assert len(rows) == 4 and all(r["versions"]["torch"].startswith("2.11") for r in rows)
    for r in rows:
        assert r["zero_grads_compiled"] == 0 and r["lora_grads"] == 56
        assert r["max_rel_diff"] < 0.03  # bf16 rounding: eager and Inductor order their sums differently
        assert abs(r["loss_compiled"] / r["loss_eager"] - 1) < 1e-4
    worst = max(r["max_rel_diff"] for r in rows)
    medians = sorted(r["median_rel_diff"] for r in rows)
    assert f"the largest relative difference from eager is {worst:.1%}".replace("%", " %") in README
    assert f"{medians[0]:.1%}-{medians[-1]:.1%} the median of each case".replace("%", " %").replace(" %-", "-") \
        in README


def test_the_graph_excerpt_shows_the_zero_gradient():
    text = open(os.path.join(SPEED, "zero_grads", "zero_grad_graph_excerpt.txt"), encoding="utf-8").read()
    assert "tangents_1" in text and "triton_poi_fused_view_zeros" in text and "zeros_3" in text


def test_compiled_runs_measured_after_the_fix_hold_the_estimate():
    rows = [r for r in measured_rows(ROOT) if r.setup.compile == "layers"]
    assert len(rows) == 24
    worst_alloc = max(abs(r.allocated_error_pct) for r in rows)
    worst_resv = max(abs(r.reserved_error_pct) for r in rows)
    assert worst_alloc < 1.0
    assert "the 24 compiled-layer runs" in README
    assert f"within {worst_alloc:.2f} % allocated and {worst_resv:.1f} % reserved, 9 of them" in README
    check = compare_setups(os.path.join(SPEED, "compiled_check.jsonl"))
    assert len(check) == 9 and {r.label.split()[0] for r in check} == {"llama-3.1-8b", "qwen2.5-7b", "mistral-7b"}
    assert f"Mistral-7B): within {max(abs(r.allocated_error_pct) for r in check):.2f} % allocated" in README


def test_no_compiled_calibration_line_predates_the_fix():
    """speed.jsonl's compiled lines are the ones measured after the fix (14); the bugged ones are not read."""
    rows = _lines(os.path.join(SPEED, "speed.jsonl"))
    compiled = [r for r in rows if r["setup"].get("compile") == "layers"]
    assert len(compiled) == 14
    bugged = _lines(os.path.join(SPEED, "zero_grads", "speed_compile_zero_grads.jsonl"))
    assert not {json.dumps(r, sort_keys=True) for r in bugged} & {json.dumps(r, sort_keys=True) for r in compiled}
    assert all(r["ok"] and r["steps"] == 8 and len(r["step_times_s"]) == 8 for r in compiled)
    assert {r["model"] for r in compiled} == {"llama-3.1-8b", "llama-3.2-1b"}

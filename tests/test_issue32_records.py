"""Issue 32's and 33's GPU records of 2026-12-06, recomputed: what docs/speed.md, docs/phases.md and the closing note
say of them is read here from the lines themselves (numbers, not prose).

- bench/results/issue32/packed: the varlen kernel against the segment loop (bench/packed_attention.py) and the
  real-length workload with the kernel (then opt-in) and with the loop, same call;
- bench/results/issue32/real: the real-length workload with every peer's setups searched, fitune with the kernel
  path by default, same call;
- bench/results/issue33/retries: the offloaded long-context runs after the restored checkpoints moved to the compute
  stream (their allocator retries per step).
"""

from __future__ import annotations

import json
import os
import statistics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")
LLAMA_8B = {"layers": 32, "heads": 32, "kv_heads": 8, "head_dim": 128}


def _lines(*parts: str) -> list[dict]:
    with open(os.path.join(RESULTS, *parts), encoding="utf-8") as f:
        return [json.loads(x) for x in f if x.strip()]


def test_the_varlen_kernel_equals_the_segment_loop_exactly_on_the_gpu():
    """Eager and compiled: output and the three input gradients identical to the loop's (bf16, GQA 32 / 8 heads),
    where transformers' block-diagonal mask differs by up to 0.03."""
    recs = _lines("issue32", "packed", "packed_attention.jsonl")
    varlen = [r for r in recs if r["case"] == "varlen"]
    assert sorted(r["compiled"] for r in varlen) == [False, True]
    for r in varlen:
        assert r["device"] == "cuda" and "error" not in r
        assert all(r[f"{n}_max_abs_diff"] == 0.0 for n in ("out", "dq", "dk", "dv")), r
    mask = [r for r in recs if r["case"] == "mask"]
    assert all(r["dk_max_abs_diff"] > 0 for r in mask)
    with open(os.path.join(RESULTS, "issue32", "packed", "pytest_varlen.log"), encoding="utf-8") as f:
        assert "14 passed" in f.read()  # tests/test_varlen_kernel.py on the GPU, its `gpu` test included


def _runs(folder: str) -> list[dict]:
    return _lines("issue32", folder, "real_length.jsonl")


def test_the_kernel_path_trains_as_the_segment_loop_and_six_times_faster():
    """Same call, same plan and batches: the kernel run's losses are the loop's to 0.005 at every step, its first
    trainable-gradient norm the loop's to 0.1 %; its trained tokens/s more than 5x the loop's."""
    runs = [r for r in _runs("packed") if r["stack"] == "fitune" and r["fits"]]
    kernel = next(r for r in runs if r["varlen_kernel_env"] == "1")
    loop = next(r for r in runs if r["varlen_kernel_env"] == "")
    assert kernel["setup"] == loop["setup"] and kernel["step_tokens"] == loop["step_tokens"]
    assert len(kernel["losses"]) == len(loop["losses"]) == 14
    assert max(abs(a - b) for a, b in zip(kernel["losses"], loop["losses"])) < 0.005
    assert abs(kernel["first_step_grad_norm"] / loop["first_step_grad_norm"] - 1) < 1e-3
    assert kernel["trained_tokens_per_s"] / loop["trained_tokens_per_s"] > 5


def test_repeated_kv_heads_cost_what_they_weigh_and_the_grouped_call_removed_them():
    """The first kernel run (K and V repeated to the query's heads: torch 2.11's varlen_attn has no enable_gqa) held
    the repeated copies for backward: 2 x layers x tokens x (heads - kv_heads) x head size x 2 bytes more than the
    loop; the default path of the next call (grouped heads passed as they are) allocated the loop's peak."""
    m = LLAMA_8B
    loop = next(r for r in _runs("packed") if r["stack"] == "fitune" and r["varlen_kernel_env"] == "")
    repeated = next(r for r in _runs("packed") if r["stack"] == "fitune" and r["varlen_kernel_env"] == "1"
                    and r["fits"])
    tokens = repeated["micro_batch_size"] * repeated["max_length"]
    copies = 2 * m["layers"] * tokens * (m["heads"] - m["kv_heads"]) * m["head_dim"] * 2
    extra = repeated["peak_allocated_bytes"] - loop["peak_allocated_bytes"]
    assert abs(extra / copies - 1) < 0.01, (extra, copies)
    default = [r for r in _runs("real") if r["stack"] == "fitune"]
    assert all(r["fits"] and r.get("varlen_kernel_env") is None for r in default)  # no opt-in: the default path
    for r in default:
        assert abs(r["peak_allocated_bytes"] / loop["peak_allocated_bytes"] - 1) < 1e-3


def test_the_estimate_holds_the_kernel_path_within_2_and_5_percent():
    for r in (r for r in _runs("real") if r["stack"] == "fitune"):
        assert abs(r["estimate_allocated_bytes"] / r["peak_allocated_bytes"] - 1) < 0.02
        assert abs(r["estimate_reserved_bytes"] / r["peak_reserved_bytes"] - 1) < 0.05


def test_the_real_length_call_fitune_against_each_peers_strongest_setup():
    """The figures the closing note and docs/speed.md give: fitune's median of its two runs against TRL's fastest
    setup that fit (checkpointing off, Liger, 1 x 2) and Unsloth's (its own checkpointing, micro-batch 2); the
    setups that did not fit are records with fits false, not left out."""
    runs = _runs("real")
    fitune = statistics.median(r["trained_tokens_per_s"] for r in runs if r["stack"] == "fitune")
    best = {}
    for r in runs:
        if r["stack"] != "fitune" and r["fits"]:
            if r["trained_tokens_per_s"] > best.get(r["stack"], {"trained_tokens_per_s": 0})["trained_tokens_per_s"]:
                best[r["stack"]] = r
    trl, unsloth = best["trl_packing"], best["unsloth_packing"]
    assert (trl["grad_checkpointing"], trl["liger"], trl["micro_batch_size"], trl["grad_accum"]) == ("off", True, 1, 2)
    assert (unsloth["grad_checkpointing"], unsloth["micro_batch_size"]) == ("unsloth", 2)
    assert round(fitune) == 12114 and round(trl["trained_tokens_per_s"]) == 8335
    assert round(unsloth["trained_tokens_per_s"]) == 5055
    assert 1.44 < fitune / trl["trained_tokens_per_s"] < 1.46  # issue 32's goal is 1.5x: not met
    assert 2.39 < fitune / unsloth["trained_tokens_per_s"] < 2.41  # its goal 1.2x: met
    computed = statistics.median(r["nonpad_tokens_per_s"] for r in runs if r["stack"] == "fitune")
    assert round(computed) == 17406 and 1.56 < computed / trl["nonpad_tokens_per_s"] < 1.58  # all packed tokens
    assert trl["trained_share_of_padded"] == 0.7254 and {
        r["trained_share_of_padded"] for r in runs if r["stack"] == "fitune"} == {0.6984}
    oom = {(r["stack"], r["grad_checkpointing"], r["micro_batch_size"]) for r in runs if r["fits"] is False}
    assert oom == {("unsloth_packing", "off", 1), ("trl_packing", "off", 2)}
    assert unsloth["setup"]["packed_attention_backend"] == "sdpa" and not unsloth["setup"]["torch_varlen_attn"]
    for r in runs:  # provenance of every line: commit of a clean tree, the GPU
        assert r["provenance"]["commit"].startswith("fb16493") and r["provenance"]["diff_sha256"] == ""
        assert "H100" in r["provenance"]["gpu"]["name"]


def test_offloaded_runs_still_retried_the_allocator_after_the_stream_fix():
    """Issue 33's goal (no retries in steady state) is not met: each fitune run of the call after the fix needed
    a retry for about every layer in its second step; the estimate held allocated within 2 % and host within
    10 %."""
    probes = [r for r in _lines("issue33", "retries", "lanes", "max_context.jsonl")
              if r.get("probe") and r["stack"] == "fitune"]
    assert sorted(r["seq_len_tokens"] for r in probes) == [77824, 118784, 140288]
    for r in probes:
        assert r["fits"] and r["provenance"]["commit"].startswith("4206c71")
        assert len(r["alloc_retries_per_step"]) == 2 and r["alloc_retries_per_step"][1] >= 30
        assert abs(r["est_peak_allocated_bytes"] / r["peak_allocated_bytes"] - 1) < 0.02
        assert abs(r["host_peak_over_est"] - 1) < 0.10


def test_the_whole_files_completion_share_by_fitunes_encoding(tiny_model, tmp_path):
    """The 69.4 % docs/speed.md sets beside the two streams' first 14 steps: the share of trained tokens in the whole
    real-length file (bench/peers/peerlib.write_length_data, 2,000 records, seed 0) as `fitune train` encodes it,
    with make_model.py's word-level tokenizer (the same in every size of model folder)."""
    import sys

    sys.path.insert(0, ROOT)
    from bench.peers.peerlib import write_length_data
    from fitune.data import load_tokenizer, read_records, tokenize_records

    data = str(tmp_path / "data.jsonl")
    write_length_data(data, 2000, 0)
    examples, _ = tokenize_records(read_records(data), load_tokenizer(str(tiny_model)), None, 2048)
    trained = sum(sum(1 for y in e.labels if y != -100) for e in examples)
    assert round(100 * trained / sum(len(e.input_ids) for e in examples), 1) == 69.4

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

import dataclasses
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


# ---- the calls of the eleventh session (2026-12-06): Unsloth's setups, the 80-step window, QLoRA, 48 GB -----------


def test_the_forum_workload_against_unsloths_setups_same_call():
    """fitune's plan 1 (`plan --write`, then `train`) against Unsloth's model in a plain loop: its only LoRA setup
    that fit the 24 GB cap (1 x 2, no checkpointing; micro-batch 2 ran out of memory). Issue 32's goal, 1.2x the
    strongest Unsloth setup: not met (1.17x)."""
    fitune = [r for r in _lines("issue32", "unsloth", "rank_check.jsonl") if r["workload"] == "seeds"][0]
    peers = [r for r in _lines("issue32", "unsloth", "peers.jsonl") if r["method"] == "lora"]
    best = max((r for r in peers if r["fits"]), key=lambda r: r["tokens_per_s"])
    assert (best["loop"], best["grad_checkpointing"], best["micro_batch_size"]) == ("plain PyTorch loop", "none", 1)
    assert [r["micro_batch_size"] for r in peers if r["fits"] is False] == [2]
    assert round(fitune["tokens_per_s_median"]) == 17860 and round(best["tokens_per_s"]) == 15208
    assert 1.17 < fitune["tokens_per_s_median"] / best["tokens_per_s"] < 1.18 < 1.2
    assert fitune["exit"] == 0 and fitune["micro_batch_sizes"] == [1]
    for r in [fitune] + peers:
        assert r["provenance"]["commit"].startswith("c7a5a44") and r["provenance"]["diff_sha256"] == ""


def test_qlora_plan_one_ran_out_of_memory_and_fitune_trails_unsloths_fastest_qlora():
    """QLoRA r16 all-linear, 2 x 2048: fitune's plan 1 (micro-batch 2, no checkpointing) ran out of memory in step 1
    in both calls and went on at 1 x 2. In the first call both stacks ran slower (fitune 8,092, Unsloth's fastest of
    its 3 QLoRA setups 9,860); in the second, after the OOM guard's fix, 12,750 against the same Unsloth setup's
    13,071: behind by 2.5 % (issue 32's goal: 1.1x ahead)."""
    first = [r for r in _lines("issue32", "unsloth", "rank_check.jsonl") if r["workload"] == "qlora_seeds"][0]
    qlora = [r for r in _lines("issue32", "unsloth", "peers.jsonl") if r["method"] == "qlora"]
    top = max((r for r in qlora if r["fits"]), key=lambda r: r["tokens_per_s"])
    assert len(qlora) == 3 and top["case"] == "unsloth_plain_qlora_nogc_m1a2"
    assert round(first["tokens_per_s_median"]) == 8092 and round(top["tokens_per_s"]) == 9860
    assert "out of memory at step 1" in first["log_tail"] and first["setup"]["batch_size"] == 2
    again = _lines("issue32", "qlora_replan", "rank_check.jsonl")[0]
    (peer,) = _lines("issue32", "qlora_replan", "peers.jsonl")
    assert peer["case"] == top["case"] and again["provenance"]["commit"].startswith("58459bd")
    assert "out of memory at step 1" in again["log_tail"] and again["micro_batch_sizes"] == [1]
    assert round(again["tokens_per_s_median"]) == 12750 and round(peer["tokens_per_s"]) == 13071
    assert 0.97 < again["tokens_per_s_median"] / peer["tokens_per_s"] < 0.98
    # after the re-plan the cache went back: steps 2+ reserved 15.35 GiB, not the cap's 23.4, and no retries
    assert max(again["peak_reserved_per_step_bytes"][1:]) < 16.5e9 < again["peak_reserved_per_step_bytes"][0]
    assert again["alloc_retries_per_step"][1:] == [0] * 11


def test_the_80_step_window_real_length_ratio():
    """Over 80 steps both stacks' windows hold the file's share of completion tokens (69.6-69.7 %, where TRL's 14
    steps held 72.5 %); fitune's median of two runs against TRL's strongest setup: 1.48x (goal 1.5x: not met)."""
    runs = _lines("issue32", "window", "real", "real_length.jsonl")
    assert [r["stack"] for r in runs] == ["fitune", "trl_packing", "fitune"] and all(r["steps"] == 80 for r in runs)
    fitune = statistics.median(r["trained_tokens_per_s"] for r in runs if r["stack"] == "fitune")
    (trl,) = [r for r in runs if r["stack"] == "trl_packing"]
    assert (trl["grad_checkpointing"], trl["liger"], trl["micro_batch_size"], trl["grad_accum"]) == ("off", True, 1, 2)
    assert round(fitune) == 12242 and round(trl["trained_tokens_per_s"]) == 8294
    assert 1.47 < fitune / trl["trained_tokens_per_s"] < 1.48
    assert all(0.696 <= r["trained_share_of_padded"] <= 0.697 for r in runs)
    for r in runs:
        if r["stack"] == "fitune":  # the estimate of fitune's own runs: within 2 % allocated, 5 % reserved
            assert abs(r["estimate_allocated_bytes"] / r["peak_allocated_bytes"] - 1) < 0.02
            assert abs(r["estimate_reserved_bytes"] / r["peak_reserved_bytes"] - 1) < 0.05
        assert r["provenance"]["commit"].startswith("5182728")


def test_the_qlora_profiles_peaks_against_fitune_estimate(tmp_path):
    """The QLoRA setups of the profile runs (bench/step_profile.py): `fitune estimate` of each run's own config
    against its measured peaks: allocated within 0.01 %, reserved 2.5-3.3 % under (within issue 32's 2 % / the 5 %
    reserved band). Plan 1's 2 x 2048 without checkpointing reserved 24.17 GiB with the cap raised: over the 24 GB
    card's 23.4 GiB, where its estimate (23.39 GiB) left 14 MB: the step-1 out-of-memory error of both calls."""
    import subprocess
    import sys

    import yaml

    profiles = {r["name"]: r for r in _lines("issue32", "window", "step_profile.jsonl")}
    assert set(profiles) == {"qlora_seeds.cap=78GiB", "qlora_seeds.batch_size=1.grad_accum=2"}
    for name, r in profiles.items():
        assert r["exit"] == 0 and r["provenance"]["commit"].startswith("5182728")
        path = tmp_path / "run.yaml"
        path.write_text(yaml.safe_dump(r["setup"]))
        out = subprocess.run([sys.executable, "-m", "fitune", "estimate", "--config", str(path), "--json"],
                             capture_output=True, text=True, cwd=ROOT, check=True)
        est = json.loads(out.stdout)
        assert abs(est["peak_allocated_bytes"] / r["peak_allocated_bytes"] - 1) < 0.0001, name
        assert -0.035 < est["peak_reserved_bytes"] / r["peak_reserved_bytes"] - 1 < -0.02, name
    plan1 = profiles["qlora_seeds.cap=78GiB"]
    cap_bytes = 23.4 * 2 ** 30
    assert plan1["peak_reserved_bytes"] > cap_bytes > plan1["peak_allocated_bytes"]
    # where the step goes (steps 5-7 under the profiler): matmuls most, bitsandbytes' dequantization next
    m1 = profiles["qlora_seeds.batch_size=1.grad_accum=2"]
    kinds = m1["kernel_s_per_kind"]
    assert max(kinds, key=kinds.get) == "matmul"
    dequant = sum(k["s"] for k in m1["top_kernels"] if "kDequantizeBlockwise" in k["name"])
    assert 0.10 < dequant / m1["gpu_busy_s"] < 0.15


def test_the_48gb_row_on_todays_code():
    """Issue 34's 48 GB row: `fitune plan --host-ram 64GiB` at 196,608 tokens trained two steps in a fresh process on
    commit 5182728, without allocator retries; the estimate within 0.1 % allocated, 1 % reserved, 0.3 % host."""
    (r,) = [x for x in _lines("issue34", "gb48", "max_context.jsonl") if x.get("probe")]
    assert (r["stack"], r["cap"], r["seq_len_tokens"], r["fits"]) == ("fitune", "47.4GiB", 196608, True)
    assert r["alloc_retries_per_step"] == [0, 0] and r["oom_guard_replans"] == 0 and r["plan_host_ram"] == "64GiB"
    assert abs(r["est_peak_allocated_bytes"] / r["peak_allocated_bytes"] - 1) < 0.001
    assert abs(r["est_peak_reserved_bytes"] / r["peak_reserved_bytes"] - 1) < 0.01
    assert abs(r["host_peak_over_est"] - 1) < 0.003
    assert r["provenance"]["commit"].startswith("5182728") and "H100" in r["provenance"]["gpu"]["name"]


def test_what_allocator_retries_cost_at_77824_tokens():
    """Issue 33: the 16 GB card's 77,824-token plan alone on the GPU, capped (30 and 32 retries in its two steps)
    and with the cap raised to 78 GiB (none): the same allocated peak, the steady step 24.84 s against 24.51 s,
    1.4 % (about 11 ms a retry; one sample each, inside run-to-run noise)."""
    probes = [x for x in _lines("issue33", "retry_cost", "max_context.jsonl") if x.get("probe")]
    capped, free = sorted(probes, key=lambda x: bool(x.get("set")))
    assert capped["alloc_retries_per_step"] == [30, 32] and free["alloc_retries_per_step"] == [0, 0]
    assert free["set"] == {"cap": "78GiB"} and capped["peak_allocated_bytes"] == free["peak_allocated_bytes"]
    assert free["peak_reserved_bytes"] > 15.4 * 2 ** 30 > capped["peak_reserved_bytes"]  # uncapped it reserves more
    cost = capped["step_seconds"][1] / free["step_seconds"][1] - 1
    assert 0.013 < cost < 0.015
    per_retry_s = (capped["step_seconds"][1] - free["step_seconds"][1]) / capped["alloc_retries_per_step"][1]
    assert 0.009 < per_retry_s < 0.012


def test_the_call_scripts_probe_lines_leave_summaries_out(capsys):
    """bench/peers/probe_lines.py, the call scripts' shared printer: one line per probe, none for a summary."""
    import sys

    sys.path.insert(0, os.path.join(ROOT, "bench", "peers"))
    import probe_lines

    assert probe_lines.main([os.path.join(RESULTS, "issue33", "retry_cost", "max_context.jsonl")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 and all(x.startswith("stack=fitune cap=15.4GiB") for x in out)
    assert "alloc_retries_per_step=[30, 32]" in out[0] and "set={'cap': '78GiB'}" in out[1]


def test_the_same_day_call_medians_and_the_selective_plan():
    """bench/results/issue32/sameday (commit 88a044f, H100, one call, each stack twice): the forum workload fitune
    17,651 against Unsloth's plain loop 15,435 (1.14x; issue 32's goal 1.2x) and HF + Liger's 13,351 (1.32x; goal
    1.3x); QLoRA r16 all-linear fitune's plan 1, micro-batch 2 with checkpointing on its first 4 layers, 14,074
    against Unsloth's 12,874 (1.09x; goal 1.1x) and 1.13x fitune's own micro-batch 1 x 2 (where the old tight plan's
    OOM guard went). The selective plan trains what micro-batch 1 x 2 trains (the same first-step gradient norm),
    fits the cap without the guard, and its allocated peak is the estimate's within 0.5 %."""
    from fitune.memory import estimate
    from fitune.setup import TrainSetup
    from fitune.specs import load_model_spec, resolve_gpu

    fitune = {r["case"]: r for r in _lines("issue32", "sameday", "rank_check.jsonl")}
    peers = {r.get("case") or r["stack"]: r for r in _lines("issue32", "sameday", "peers.jsonl")}
    assert all(r["provenance"]["commit"].startswith("88a044f") and not r["provenance"]["diff_sha256"]
               for r in fitune.values())
    med = lambda rs, k: statistics.median(r[k] for r in rs)  # noqa: E731
    forum = med([fitune["fitune_seeds"], fitune["fitune_seeds-r2"]], "tokens_per_s_median")
    unsloth_lora = med([peers["unsloth_plain_lora_nogc_m1a2"], peers["unsloth_plain_lora_nogc_m1a2-r2"]],
                       "tokens_per_s")
    liger = peers["hf_loop_liger"]["tokens_per_s"]
    assert round(forum) == 17651 and round(unsloth_lora) == 15435 and round(liger) == 13351
    assert round(forum / unsloth_lora, 2) == 1.14 and round(forum / liger, 2) == 1.32
    qlora = med([fitune["fitune_qlora_seeds"], fitune["fitune_qlora_seeds-r2"]], "tokens_per_s_median")
    unsloth_qlora = med([peers["unsloth_plain_qlora_nogc_m1a2"], peers["unsloth_plain_qlora_nogc_m1a2-r2"]],
                        "tokens_per_s")
    old = fitune["fitune_qlora_m1a2"]["tokens_per_s_median"]
    assert round(qlora) == 14074 and round(unsloth_qlora) == 12874 and round(old) == 12441
    assert round(qlora / unsloth_qlora, 2) == 1.09 and round(qlora / old, 2) == 1.13
    plan = fitune["fitune_qlora_seeds"]
    s = plan["setup"]
    assert (s["batch_size"], s["grad_accum"], s["grad_checkpointing"], s["optimizer"]) == (2, 1, "selective:4", "adamw")
    for r in (plan, fitune["fitune_qlora_seeds-r2"]):
        assert r["micro_batch_sizes"] == [2] and r["exit"] == 0  # no out-of-memory re-plan
        assert max(r["peak_reserved_per_step_bytes"]) < 23.4 * 2 ** 30
    # the same training: the first step's gradient against micro-batch 1 x 2 without checkpointing (same data)
    assert abs(plan["first_step_grad_norm"] / fitune["fitune_qlora_m1a2"]["first_step_grad_norm"] - 1) < 1e-4
    est = estimate(load_model_spec("llama-3.1-8b"), TrainSetup.from_dict(s), resolve_gpu("rtx4090"))
    assert abs(est.peak_allocated_bytes / plan["peak_allocated_bytes"] - 1) < 0.005
    assert abs(est.peak_reserved_bytes / plan["peak_reserved_bytes"] - 1) < 0.05


def test_todays_planner_proposes_the_plans_the_same_day_call_ran():
    """The records stand for today's planner: for both workloads, with what the GPU machine had (Triton: compiled
    layers), plan 1 is the setup the call trained."""
    from fitune.plan import PlanRequest, plan
    from fitune.specs import load_model_spec, resolve_gpu

    runs = {r["case"]: r for r in _lines("issue32", "sameday", "rank_check.jsonl")}
    model, gpu = load_model_spec("llama-3.1-8b"), resolve_gpu("rtx4090")
    forum = plan(PlanRequest(model, gpu, batch_size=2, seq_len_tokens=2048, compile="layers")).plans[0]
    qlora = plan(PlanRequest(model, gpu, batch_size=2, seq_len_tokens=2048, methods=("qlora",), lora_rank=16,
                             lora_targets=("all-linear",), compile="layers")).plans[0]
    assert forum.setup.to_dict() == runs["fitune_seeds"]["setup"]
    assert qlora.setup.to_dict() == runs["fitune_qlora_seeds"]["setup"]


def test_mfu_beside_tokens_per_s_in_the_readme_rows():
    """Issue 32 asks for MFU beside tokens/s: the README's rows divide each stack's median by the H100's dense bf16
    peak (989.4 TFLOP/s, fitune's GPU catalog) at the workload's model FLOPs per token: 31.6 GFLOP for Llama-3.1-8B
    LoRA at 2,048 tokens (4 FLOPs per weight per token, frozen weights, plus causal attention), so fitune's forum
    median 17,651 is 56.4 % and Unsloth's 15,435 is 49.3 %. The real-length row counts the linear layers only over
    all packed positions (its segments' attention is left out): a lower bound."""
    import sys

    sys.path.insert(0, ROOT)
    from bench.readme_numbers import linear_mfu_words, mfu_words
    from fitune.perf.flops import model_flops_per_token
    from fitune.setup import TrainSetup
    from fitune.specs import load_model_spec

    fitune = {r["case"]: r for r in _lines("issue32", "sameday", "rank_check.jsonl")}
    first = fitune["fitune_seeds"]
    per_token = model_flops_per_token(load_model_spec("llama-3.1-8b"), TrainSetup.from_dict(first["setup"]))
    assert round(per_token / 1e9, 1) == 31.6
    assert first["provenance"]["gpu"]["name"] == "NVIDIA H100 80GB HBM3"
    assert mfu_words(17651, first) == f"MFU {100 * 17651 * per_token / 989.4e12:.1f} %" == "MFU 56.4 %"
    assert mfu_words(15435, first) == "MFU 49.3 %"
    # Llama-3.1-8B's 8,030,261,248 parameters less the input embeddings (128,256 x 4,096) and the 65 RMSNorm weight
    # vectors multiply each token: 4 FLOPs per weight (forward and input gradient)
    linear = 4 * (8_030_261_248 - 128_256 * 4_096 - 65 * 4_096)
    assert linear_mfu_words(17_500, "llama-3.1-8b", "NVIDIA H100 80GB HBM3") == \
        f"MFU {100 * 17_500 * linear / 989.4e12:.1f} % (linear layers)"


def test_the_transfer_wait_change_left_the_retries_and_the_same_call_context_lead():
    """bench/results/issue33/noretry (commit 47e984d, H100, lanes side by side, each process under PyTorch's memory
    fraction): after offloaded checkpoints stopped deferring each layer's free with `record_stream`, the second
    steps still needed retries (22 at 141,312 tokens, 30 at 118,784), with reserved peaks at the estimate (within
    0.6 %): the retries come from the fraction's check (a whole request counted against the cap), not from memory
    the estimate missed. The context lead of the same call: `fitune plan --host-ram 64GiB`'s longest at 24 GB,
    141,312 tokens, against Unsloth's 81,920 (fits) and 87,381 (out of memory): at least 1.62x (goal 1.5x)."""
    probes = [r for r in _lines("issue33", "noretry", "lanes", "max_context.jsonl") if r.get("probe")]
    assert all(r["provenance"]["commit"].startswith("47e984d") and not r["provenance"]["diff_sha256"]
               for r in probes)
    fit = {(r["stack"], r["seq_len_tokens"]): r for r in probes if r["cap"] == "23.4GiB"}
    assert fit[("unsloth", 81920)]["fits"] is True and fit[("unsloth", 87381)]["fits"] is False
    mine = fit[("fitune", 141312)]
    assert mine["fits"] and mine["plan_host_ram"] == "64GiB" and mine["alloc_retries_per_step"] == [0, 22]
    assert round(141312 / 87381, 2) == 1.62
    assert fit[("fitune", 118784)]["alloc_retries_per_step"] == [1, 30]
    for r in (mine, fit[("fitune", 118784)]):
        assert abs(r["est_peak_allocated_bytes"] / r["peak_allocated_bytes"] - 1) < 0.001
        assert abs(r["est_peak_reserved_bytes"] / r["peak_reserved_bytes"] - 1) < 0.006
        assert abs(r["host_peak_over_est"] - 1) < 0.10
    assert "8 passed" in open(os.path.join(RESULTS, "issue33", "noretry", "pytest_offload.log")).read()


def test_where_the_gpu_waits_qlora_forward_is_host_bound():
    """bench/results/issue32/gaps (commit 47e984d, H100): plan 1 of each workload under the profiler. The QLoRA step
    is 0.298 s without the profiler (the median of steps 2-4 and 8) against 0.266 s of GPU work (11 % idle); its gaps fall in the compiled
    forward, much of it while the host runs bitsandbytes' gemm_4bit. At the GPU's busy time the step would give
    15,400 tokens/s, 1.2x Unsloth's 12,874 (issue32/sameday). The forum step: 0.223 s against 0.210 s busy."""
    recs = {r["name"]: r for r in _lines("issue32", "gaps", "step_profile.jsonl")}
    q, f = recs["qlora_seeds"], recs["seeds"]
    for r in (q, f):
        assert r["provenance"]["commit"].startswith("47e984d") and r["profiled_steps"] == 3 and r["exit"] == 0
    unprofiled = lambda r: statistics.median(r["step_time_s"][1:4] + r["step_time_s"][7:])  # noqa: E731
    assert round(q["gpu_busy_s"] / 3, 3) == 0.266 and round(unprofiled(q), 3) == 0.298
    assert round(f["gpu_busy_s"] / 3, 3) == 0.210 and round(unprofiled(f), 3) == 0.223
    assert round(q["kernels"] / 3) == 6308 and round(f["kernels"] / 3) == 4128
    ops = {h["name"]: h["s"] for h in q["host_ops_in_gaps"]}
    assert round(ops["bitsandbytes::gemm_4bit"], 3) == 0.117 and round(ops["Torch-Compiled Region: 0/0"], 2) == 0.24
    assert max(h["s"] for h in f["host_ops_in_gaps"]) < 0.023
    assert round(4096 / (q["gpu_busy_s"] / 3), -2) == 15400 and round(15400 / 12874, 1) == 1.2


def test_the_lean_nf4_op_trained_alike_within_noise_and_qlora_on_another_machine():
    """bench/results/issue32/lean_nf4 (commit 6bc8553, H100): the lean NF4 op against bitsandbytes' path in two calls
    (same first-step gradient norm, losses within 0.05 %; under 1 % faster, so it was removed), and fitune's QLoRA
    plan 1 on bitsandbytes' path against Unsloth's fastest setup of each call: 1.35x and 1.39x."""
    ratios = []
    for call, op_gain in (("call1", 0.0057), ("call2", 0.0033)):
        fitune = {r["case"].split("-r")[0]: r for r in _lines("issue32", "lean_nf4", call, "rank_check.jsonl")}
        lean, bnb = fitune["fitune_qlora_seeds"], fitune["fitune_qlora_bnb"]
        assert lean["provenance"]["commit"].startswith("6bc8553") and lean["provenance"]["diff_sha256"] == ""
        assert abs(lean["first_step_grad_norm"] / bnb["first_step_grad_norm"] - 1) < 1e-4
        assert [round(x, 1) for x in lean["loss_trajectory"]] == [round(x, 1) for x in bnb["loss_trajectory"]]
        assert max(abs(a - b) / b for a, b in zip(lean["loss_trajectory"], bnb["loss_trajectory"])) < 5e-4
        gain = lean["tokens_per_s_median"] / bnb["tokens_per_s_median"] - 1
        assert round(gain, 4) == op_gain and gain < 0.01
        peers = [r for r in _lines("issue32", "lean_nf4", call, "peers.jsonl") if r["fits"]]
        top = max(peers, key=lambda r: r["tokens_per_s"])
        assert top["case"].startswith("unsloth_plain_qlora_nogc_m1a2")
        ratios.append(round(bnb["tokens_per_s_median"] / top["tokens_per_s"], 2))
    assert ratios == [1.35, 1.39]


def test_the_ballast_cap_still_retried_the_24gb_plan():
    """bench/results/issue33/ballast: `fitune plan --host-ram 64GiB`'s 141,312 tokens under a card-like cap (the
    memory beyond 23.4 GiB taken outside PyTorch) trained two steps within the estimate, and still retried."""
    (r,) = [x for x in _lines("issue33", "ballast", "lanes", "max_context.jsonl") if not x.get("summary")]
    assert r["seq_len_tokens"] == 141312 and r["plan_host_ram"] == "64GiB" and r["fits"] is True
    assert r["alloc_retries_per_step"] == [20, 31]
    assert abs(r["peak_allocated_bytes"] / r["est_peak_allocated_bytes"] - 1) < 0.001
    gib = 2 ** 30
    assert round(r["peak_reserved_bytes"] / gib, 2) == 23.02 and round(r["est_peak_reserved_bytes"] / gib, 2) == 23.23
    assert round((23.4 * gib - r["peak_reserved_bytes"]) / gib, 2) == 0.38


def test_the_ballast_cap_retried_at_1_5x_unsloth_with_902_mib_outside_the_allocator():
    """bench/results/issue33/ballast_131k: 131,072 tokens (1.50x Unsloth's out-of-memory length 87,381 under the same
    budget) trained under the card-like cap within the estimate on GPU and host, and retried 19 and 25 times; the
    process held 902 MiB outside PyTorch's allocator after each step, 300 MiB over what the 24 GB budget leaves."""
    from fitune.specs.gpu import CONSUMER_CONTEXT_BYTES

    (r,) = [x for x in _lines("issue33", "ballast_131k", "lanes", "max_context.jsonl") if not x.get("summary")]
    assert r["provenance"]["commit"].startswith("8039b9b") and r["provenance"]["diff_sha256"] == ""
    assert r["seq_len_tokens"] == 131072 and r["plan_host_ram"] == "64GiB" and r["fits"] is True
    assert round(r["seq_len_tokens"] / 87381, 2) == 1.5
    assert r["setup"]["method"] == "qlora" and r["setup"]["lora_rank"] == 32 and r["picked"] == 1
    assert r["alloc_retries_per_step"] == [19, 25]
    assert 0 < r["est_peak_allocated_bytes"] / r["peak_allocated_bytes"] - 1 < 0.001  # +0.05 %
    assert 0 < r["est_peak_reserved_bytes"] / r["peak_reserved_bytes"] - 1 < 0.005  # +0.36 %
    assert 0 < r["est_host_peak_bytes"] / r["host_peak_rss_bytes"] - 1 < 0.005  # +0.29 %
    outside = r["outside_allocator_bytes_per_step"]
    assert outside == [946_051_482, 946_051_482]  # steady: the same after both steps
    assert round(outside[0] / 2**20) == 902 and round(CONSUMER_CONTEXT_BYTES / 2**20) == 602
    assert round((outside[0] - CONSUMER_CONTEXT_BYTES) / 2**20) == 300
    gib = 2 ** 30
    assert round(r["peak_reserved_bytes"] / gib, 2) == 23.03  # the plan fills the budget, as at 141,312 tokens


def test_the_head_at_the_trained_positions_against_every_position_and_trl():
    """bench/results/issue32/trained_rows: in one call, fitune 12,499 and 12,590 trained tokens/s (median 12,544),
    1.47x TRL's strongest setup's 8,523 (goal 1.5x: not met); the head over every position 12,435 (+0.9 % for the
    change: noise-sized); 8 MiB more allocated (the gathered chunk). On the CPU the real model's losses agree."""
    from bench.readme_numbers import result_lines

    runs = result_lines(os.path.join(RESULTS, "issue32", "trained_rows", "call_output.txt"))
    assert list(runs) == ["fitune", "trl_nogc_liger_m1a2", "fitune_all_rows", "fitune_again"]
    assert all(r["fits"] for r in runs.values()) and runs["trl_nogc_liger_m1a2"]["stack"] == "trl_packing"
    mine = statistics.median([runs["fitune"]["tokens_per_s"], runs["fitune_again"]["tokens_per_s"]])
    trl, every = runs["trl_nogc_liger_m1a2"]["tokens_per_s"], runs["fitune_all_rows"]["tokens_per_s"]
    assert round(mine) == 12544 and round(trl) == 8523 and round(every) == 12435
    assert round(mine / trl, 2) == 1.47 and round(every / trl, 2) == 1.46
    assert round(100 * (mine / every - 1), 1) == 0.9
    extra = runs["fitune"]["peak_allocated_bytes"] - runs["fitune_all_rows"]["peak_allocated_bytes"]
    assert 1024 * 4096 * 2 <= extra < 1024 * 4096 * 2 + 2**16
    folder = os.path.join(RESULTS, "issue32", "trained_rows", "cpu_parity")
    rows, every_row = _lines("issue32", "trained_rows", "cpu_parity", "parity.jsonl")
    assert (rows["run"], every_row["run"], every_row["trained_rows_env"]) == ("trained_rows", "all_rows", "0")
    assert rows["provenance"]["commit"].startswith("8039b9b") and rows["provenance"]["diff_sha256"] == ""
    assert round(sum(rows["trained_tokens_per_step"]) / sum(rows["tokens_per_step"]), 2) == 0.35
    for key in ("loss_trajectory", "eval_losses"):
        a, b = rows[key], every_row[key]
        assert len(a) == len(b) >= 2 and all(abs(x - y) < 1e-6 for x, y in zip(a, b)), key
    assert os.path.exists(os.path.join(folder, "run.yaml"))


def test_the_next_ballast_call_plans_for_22_9_gib_and_leaves_the_outside_memory_room():
    """What bench/results/issue33/ballast_131k/COMMAND.md proposes to run next (BALLAST_PLAN_GPU=22.9GiB): the plan
    for 22.9 GiB at 131,072 tokens reserves 22.61 GiB, 0.79 GiB under the 23.4 GiB cap, more than the 300 MiB the
    measured process held outside the allocator beyond what the budget leaves. (That AdamW plan is plan 2 since commit
    8c87b0d: its 8-bit twin, roomier, ranks first.)"""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "fitune", "plan", "llama-3.1-8b", "--gpu", "22.9GiB", "--method",
                          "qlora", "--lora-rank", "32", "--lora-targets", "all-linear", "--seq-len", "131072",
                          "--batch-size", "1", "--host-ram", "64GiB", "--json"],
                         capture_output=True, text=True, cwd=ROOT, check=True)
    plans = json.loads(out.stdout)["plans"]
    assert plans[0]["setup"]["optimizer"] == "adamw8bit"
    (plan,) = [p for p in plans if p["setup"]["optimizer"] == "adamw" and p["setup"]["offload_embeddings"]]
    gib = 2 ** 30
    assert round(plan["peak_reserved_bytes"] / gib, 2) == 22.61
    assert round((23.4 * gib - plan["peak_reserved_bytes"]) / gib, 2) == 0.79
    assert any("offloaded input embeddings" in t for t in plan["turns_on"])


def test_the_real_length_call_again():
    """bench/results/issue32/real_again (commit 6b44142, one call, 50 steps): fitune 12,093 and 12,044 trained tokens/s
    (median 12,069), TRL's strongest setup 7,606: 1.59x (goal 1.5x: met in this call); both train alike (first-step
    gradient norms 0.6996 and 0.7061, the same trained share, losses within 0.05 over the first 8 steps)."""
    runs = _lines("issue32", "real_again", "real_length.jsonl")
    assert [r["stack"] for r in runs] == ["fitune", "trl_packing", "fitune"]
    assert all(r["fits"] and r["steps_done"] == 50 for r in runs)
    assert {r["provenance"]["commit"] for r in runs} == {"6b44142280708cc0959e9bce1a2c85ffd4c865d4"}
    assert {r["provenance"]["diff_sha256"] for r in runs} == {""}
    mine = statistics.median([r["trained_tokens_per_s"] for r in runs if r["stack"] == "fitune"])
    trl = runs[1]
    assert round(mine) == 12069 and round(trl["trained_tokens_per_s"]) == 7606
    assert round(mine / trl["trained_tokens_per_s"], 2) == 1.59
    assert trl["grad_checkpointing"] == "off" and trl["setup"]["gradient_checkpointing"] is False
    assert (trl["micro_batch_size"], trl["grad_accum"], trl["liger"], trl["setup"]["packing"]) == (1, 2, True, True)
    assert abs(runs[0]["trained_share_of_padded"] - trl["trained_share_of_padded"]) < 0.005
    assert abs(runs[0]["first_step_grad_norm"] - trl["first_step_grad_norm"]) < 0.01
    assert max(abs(a - b) for a, b in zip(runs[0]["loss_trajectory"][:8], trl["loss_trajectory"][:8])) < 0.05
    for r in runs:  # the median of steps 3 and later (bench/peers/real_length.py `summarize_steps`)
        rates = [trained / s for (_, _, trained), s in zip(r["step_tokens"], r["step_seconds"])][2:]
        assert len(rates) == 48 and abs(statistics.median(rates) / r["trained_tokens_per_s"] - 1) < 1e-3


def test_the_131k_plan_made_for_the_card_retried_in_its_first_step():
    """bench/results/issue33/ballast_4090 (commit 6b44142): `fitune plan --gpu rtx4090`'s plan at 131,072 tokens is
    the one of ballast_131k (estimate 24,817,696,768 B reserved, 76 MiB under the card's 23.19 GiB step budget); under
    the card-like cap it reserved the allocator's whole room (23.19 GiB) and retried 9 times in step 1; step 2 did
    not run in the call's time."""
    from fitune.specs.gpu import resolve_gpu

    (r,) = [x for x in _lines("issue33", "ballast_4090", "max_context.jsonl") if x.get("probe")]
    (old,) = [x for x in _lines("issue33", "ballast_131k", "lanes", "max_context.jsonl") if x.get("probe")]
    assert r["provenance"]["commit"].startswith("6b44142") and r["plan_host_ram"] == "64GiB"
    assert r["setup"] == old["setup"] and r["est_peak_reserved_bytes"] == old["est_peak_reserved_bytes"]
    budget = resolve_gpu("rtx4090").training_budget_bytes
    assert round((budget - r["est_peak_reserved_bytes"]) / 2**20) == 76
    assert r["alloc_retries_per_step"] == [9] and r["steps_done"] == 1 and r["timed_out"]
    assert 0 <= budget - r["peak_reserved_bytes"] < 2**22  # the whole room (in 2 MiB pages): 23.19 GiB
    assert r["outside_allocator_bytes_per_step"] == old["outside_allocator_bytes_per_step"][:1]


def test_the_roomier_131k_plan_ran_three_steps_with_few_retries_where_unsloth_ran_out():
    """bench/results/issue33/ballast_4090_adamw (commit b778601): AdamW with the embedding table in host memory at
    131,072 tokens, the setup `fitune plan --gpu rtx4090` ranked first then and ranks second since its 8-bit twin
    (commit 8c87b0d); the bench planned it for the cap (`--gpu 23.4GiB`: BALLAST_PLAN_GPU did not reach the probes
    before commit 9dd703c), the same setup. Under the card-like cap it trained 3 steps with 1, 2 and 3
    allocator retries (the goal of none in steady state is not met) and the allocator's whole room reserved, where
    Unsloth ran out of memory at 87,381 tokens in the same call. Allocated and host peaks within 0.1 % of the
    estimate."""
    from fitune.plan import PlanRequest, plan
    from fitune.specs import load_model_spec
    from fitune.specs.gpu import resolve_gpu

    rows = _lines("issue33", "ballast_4090_adamw", "max_context.jsonl")
    (f,) = [x for x in rows if x.get("probe") and x["stack"] == "fitune"]
    (u,) = [x for x in rows if x.get("probe") and x["stack"] == "unsloth"]
    assert f["provenance"]["commit"] == u["provenance"]["commit"] and f["provenance"]["commit"].startswith("b778601")
    assert f["provenance"]["diff_sha256"] == "" and f["picked"] == 1 and f["plan_host_ram"] == "64GiB"
    result = plan(PlanRequest(load_model_spec("llama-3.1-8b"), resolve_gpu("rtx4090"), batch_size=1,
                              seq_len_tokens=131072, methods=("qlora",), lora_rank=32, lora_targets=("all-linear",),
                              host_ram_bytes=64 * 2**30))
    second = result.plans[1].setup
    assert (second.optimizer, second.offload_embeddings) == ("adamw", True)
    assert "plan_gpu" not in f and f["est_peak_reserved_bytes"] != result.plans[1].peak_reserved_bytes
    assert {k: v for k, v in f["setup"].items() if k != "lora_targets"} == \
        {k: v for k, v in dataclasses.asdict(second).items() if k in f["setup"] and k != "lora_targets"}
    assert f["fits"] and f["steps_done"] == 3 and f["alloc_retries_per_step"] == [1, 2, 3]
    assert f["oom_guard_replans"] == 0
    assert abs(f["peak_allocated_bytes"] / f["est_peak_allocated_bytes"] - 1) < 0.001
    assert abs(f["host_peak_rss_bytes"] / f["est_host_peak_bytes"] - 1) < 0.001
    budget = resolve_gpu("rtx4090").training_budget_bytes
    assert 0 <= budget - f["peak_reserved_bytes"] < 2**22  # the whole room again
    assert f["peak_reserved_bytes"] / f["est_peak_reserved_bytes"] - 1 > 0.025  # the estimate at least 2.5 % low
    assert u["seq_len_tokens"] == 87381 and not u["fits"] and "out of memory" in u["error"]
    assert f["seq_len_tokens"] / u["seq_len_tokens"] >= 1.5


def test_two_restore_buffers_did_not_remove_the_131k_retries():
    """bench/results/issue33/ballast_staging (commit 75fe043, reverted): restoring offloaded inputs into two fixed
    GPU buffers left the same plan's peaks unchanged and its retries at 1 and 3 in steps 1-2 (1 and 2 with a block
    per layer in ballast_4090_adamw), with the same losses to the fourth decimal."""
    (s,) = [x for x in _lines("issue33", "ballast_staging", "max_context.jsonl") if x.get("probe")]
    (b,) = [x for x in _lines("issue33", "ballast_4090_adamw", "max_context.jsonl")
            if x.get("probe") and x["stack"] == "fitune"]
    assert s["provenance"]["commit"].startswith("75fe043") and s["setup"] == b["setup"]
    assert s["steps_done"] == 2 and s["alloc_retries_per_step"] == [1, 3] and b["alloc_retries_per_step"][:2] == [1, 2]
    assert s["peak_allocated_bytes"] == b["peak_allocated_bytes"] and s["peak_reserved_bytes"] == b["peak_reserved_bytes"]
    assert all(abs(x - y) <= 2e-4 for x, y in zip(s["losses"], b["losses"]))


def test_plan_1_trains_131k_without_retries_where_unsloth_ran_out():
    """Issue 33's goal (bench/results/issue33/ballast_plan1, commit 8c87b0d): `fitune plan --gpu rtx4090 --host-ram
    64GiB`'s plan 1 at 131,072 tokens (8-bit AdamW, the embedding table in host memory), written and trained by
    `fitune train` under the card-like cap, three steps with no allocator retry; Unsloth out of memory at 87,381 in
    the same call under the same cap (1.50x). The allocated and host peaks within 2 % of the estimate, the reserved
    within 5 % (the estimate low)."""
    from fitune.plan import PlanRequest, plan
    from fitune.specs import load_model_spec
    from fitune.specs.gpu import resolve_gpu

    rows = _lines("issue33", "ballast_plan1", "max_context.jsonl")
    (f,) = [x for x in rows if x.get("probe") and x["stack"] == "fitune"]
    (u,) = [x for x in rows if x.get("probe") and x["stack"] == "unsloth"]
    assert f["provenance"]["commit"] == u["provenance"]["commit"] == "8c87b0d57f89aaf908d344702992cd896e573dbb"
    assert f["picked"] == 1 and f["plan_gpu"] == "rtx4090" and f["plan_host_ram"] == "64GiB"
    assert "plan_optimizer" not in f and f["steps"] == 3
    result = plan(PlanRequest(load_model_spec("llama-3.1-8b"), resolve_gpu("rtx4090"), batch_size=1,
                              seq_len_tokens=131072, methods=("qlora",), lora_rank=32, lora_targets=("all-linear",),
                              host_ram_bytes=64 * 2**30))
    first = result.plans[0]
    assert (first.setup.optimizer, first.setup.offload_embeddings) == ("adamw8bit", True)
    assert {k: v for k, v in f["setup"].items() if k != "lora_targets"} == \
        {k: v for k, v in dataclasses.asdict(first.setup).items() if k in f["setup"] and k != "lora_targets"}
    assert f["est_peak_reserved_bytes"] == first.peak_reserved_bytes
    assert f["fits"] and f["steps_done"] == 3 and f["alloc_retries_per_step"] == [0, 0, 0]
    assert abs(f["peak_allocated_bytes"] / f["est_peak_allocated_bytes"] - 1) < 0.02
    assert abs(f["host_peak_rss_bytes"] / f["est_host_peak_bytes"] - 1) < 0.02
    assert 0 < f["peak_reserved_bytes"] / f["est_peak_reserved_bytes"] - 1 < 0.05
    assert u["seq_len_tokens"] == 87381 and not u["fits"] and "out of memory" in u["error"]
    assert f["seq_len_tokens"] / u["seq_len_tokens"] >= 1.5


def test_the_8bit_plan_ran_three_times_alike():
    """bench/results/issue33/ballast_8bit: the same setup through `fitune plan --optimizer adamw8bit` in three calls
    (commits 9dd703c and 37a3a3b): no retries, the same allocated and reserved peaks to the byte, and Unsloth out of
    memory at 87,381 in the third."""
    runs = []
    for part in (("first",), ("history",), ()):
        runs += [x for x in _lines("issue33", "ballast_8bit", *part, "max_context.jsonl") if x.get("probe")]
    mine = [r for r in runs if r["stack"] == "fitune"]
    assert len(mine) == 3 and all(r["plan_optimizer"] == "adamw8bit" and r["plan_gpu"] == "rtx4090" for r in mine)
    assert {r["alloc_retries_per_step"] == [0, 0, 0] for r in mine} == {True}
    assert {(r["peak_allocated_bytes"], r["peak_reserved_bytes"]) for r in mine} == {(21782542848, 24767365120)}
    assert [r["provenance"]["commit"][:7] for r in mine] == ["9dd703c", "37a3a3b", "37a3a3b"]
    (u,) = [r for r in runs if r["stack"] == "unsloth"]
    assert u["seq_len_tokens"] == 87381 and not u["fits"]

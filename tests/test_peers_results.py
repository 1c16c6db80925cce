"""The README's side-by-side table (issue 14) is the committed GPU record of bench/results/peers/: every figure in
it is recomputed here from the raw lines."""

from __future__ import annotations

import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FOLDER = os.path.join(ROOT, "bench", "results", "peers")


def _lines(name):
    return [json.loads(x) for x in open(os.path.join(FOLDER, name), encoding="utf-8")]


def _best(stack):
    """The stack's fastest case that fit."""
    fits = [r for r in _lines("peers.jsonl") if r["stack"] == stack and r["fits"]]
    return max(fits, key=lambda r: r["tokens_per_s"])


def _gib(n):
    return f"{n / 2**30:.2f} GiB"


def test_every_stack_ran_its_candidates_in_one_call():
    rows = _lines("peers.jsonl")
    assert {r["stack"] for r in rows} == {"hf_trainer", "hf_trainer_liger", "hf_loop_liger", "unsloth"}
    assert all(r["fits"] in (True, False) for r in rows)  # every case ended in a result, none in an error
    assert all(r["cap"] == "rtx4090" and r["seq_len_tokens"] == 2048 for r in rows)
    for r in rows:
        assert r["micro_batch_size"] * r["grad_accum"] == 2  # 2 x 2048 tokens per optimizer step, every stack
        if r["fits"]:
            assert r["steps_done"] == 12 and r["peak_allocated_bytes"] <= 23.4 * 2**30


def test_readme_table_is_the_record():
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    fitune = _lines("fitune.jsonl")[0]
    assert fitune["exit"] == 0 and fitune["plan"] == 1
    assert f"| **{fitune['tokens_per_s_median']:,.0f}** | {_gib(fitune['peak_allocated_bytes'])} | " \
           f"{_gib(fitune['peak_reserved_bytes'])} |" in readme
    for stack in ("hf_trainer", "hf_trainer_liger", "hf_loop_liger", "unsloth"):
        r = _best(stack)
        assert f"| {r['tokens_per_s']:,.0f} | {_gib(r['peak_allocated_bytes'])} | {_gib(r['peak_reserved_bytes'])}" \
            in readme, stack
    hf_liger = max(_best("hf_trainer_liger")["tokens_per_s"], _best("hf_loop_liger")["tokens_per_s"])
    ratio_liger = fitune["tokens_per_s_median"] / hf_liger
    ratio_unsloth = fitune["tokens_per_s_median"] / _best("unsloth")["tokens_per_s"]
    assert f"fitune is {ratio_liger:.2f}x the fastest HF + Liger stack and {ratio_unsloth:.2f}x Unsloth" in readme


def test_readme_unsloth_against_the_trainer_is_the_record():
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    u, t = _best("unsloth"), _best("hf_trainer")
    less = 1 - u["peak_allocated_bytes"] / t["peak_allocated_bytes"]
    assert (f"Unsloth made {u['tokens_per_s'] / t['tokens_per_s']:.2f}x\nthe tokens/s of the HF Trainer "
            f"({u['tokens_per_s']:,.0f} against {t['tokens_per_s']:,.0f}) at {less:.0%} less peak allocated memory"
            ).replace("%", " %") in readme


def test_readme_second_call_is_the_record():
    """The compiled-layers call (bench/results/peers/run2/): fitune along the user's path, then each peer at the
    setup that was its fastest in the first call; the ratios the README states."""
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    fitune = _lines("run2/rank_check.jsonl")[0]
    assert fitune["exit"] == 0 and fitune["plan"] == 1 and fitune["steps"] == 12
    assert f"| **{fitune['tokens_per_s_median']:,.0f}** | {_gib(fitune['peak_allocated_bytes'])} | " \
           f"{_gib(fitune['peak_reserved_bytes'])} |" in readme
    peers = {r["stack"]: r for r in _lines("run2/peers.jsonl")}
    assert set(peers) == {"hf_trainer", "hf_trainer_liger", "hf_loop_liger", "unsloth"}
    for r in peers.values():
        assert r["fits"] and r["cap"] == "rtx4090" and r["steps_done"] == 12
        assert f"| {r['tokens_per_s']:,.0f} | {_gib(r['peak_allocated_bytes'])} | {_gib(r['peak_reserved_bytes'])}" \
            in readme, r["stack"]
    hf_liger = max(peers["hf_trainer_liger"]["tokens_per_s"], peers["hf_loop_liger"]["tokens_per_s"])
    assert f"fitune is {fitune['tokens_per_s_median'] / hf_liger:.2f}x the fastest HF + Liger stack (the plain loop) " \
           f"and {fitune['tokens_per_s_median'] / peers['unsloth']['tokens_per_s']:.2f}x Unsloth" in readme


def test_readme_real_length_figures_are_the_record():
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read().replace("\n", " ")
    rows = _lines("real_length.jsonl")
    trainer = [r for r in rows if r["stack"] == "hf_trainer" and r["fits"]]
    packing = [r for r in rows if r["stack"] == "trl_packing" and r["fits"]]
    fitune = [r for r in rows if r["stack"] == "fitune" and r["fits"]]
    assert len(trainer) == len(packing) == 1 and len(fitune) == 2
    assert f"{trainer[0]['trained_tokens_per_s']:,.0f} at micro-batch 2 x 2" in readme
    assert f"packing {packing[0]['trained_tokens_per_s']:,.0f}" in readme
    assert (f"`fitune train` {fitune[0]['trained_tokens_per_s']:,.0f} and {fitune[1]['trained_tokens_per_s']:,.0f} "
            "in two calls") in readme
    assert all(r["setup"]["packing"] is False for r in fitune)  # what the README says the plan chose


def test_readme_real_length_same_call_is_the_record():
    """The real-length call after the packing rule: the Trainer default and `fitune train` in one GPU call."""
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read().replace("\n", " ")
    rows = _lines(os.path.join("real_length2", "real_length.jsonl"))
    trainer = [r for r in rows if r["stack"] == "hf_trainer" and r["fits"]]
    fitune = [r for r in rows if r["stack"] == "fitune" and r["fits"]]
    assert len(trainer) == len(fitune) == 1
    t, f = trainer[0], fitune[0]
    assert f["setup"]["packing"] is True and f["setup"]["packing_attention"] == "varlen"
    assert (t["micro_batch_size"], t["grad_accum"]) == (2, 2)
    assert f"default {t['trained_tokens_per_s']:,.0f} trained tokens/s (micro-batch 2 x 2" in readme
    assert f"`fitune train` {f['trained_tokens_per_s']:,.0f} (packing" in readme
    ratio = f["trained_tokens_per_s"] / t["trained_tokens_per_s"]
    assert f"**{ratio:.2f}x** the Trainer default" in readme and ratio >= 2


def _run3(call):
    folder = "run3/call_a" if call == 3 else "run3"
    fitune = _lines(f"{folder}/rank_check.jsonl")[0]
    peers = {r["stack"]: r for r in _lines(f"{folder}/peers.jsonl")}
    return fitune, peers


def test_readme_third_and_fourth_calls_are_the_record():
    """bench/results/peers/run3/: the step without host syncs and with the compiled loss, fitune first (call 3) and
    last (call 4); every figure of the README's table and the ratios it states."""
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    ratios = {}
    for call in (3, 4):
        fitune, peers = _run3(call)
        assert fitune["exit"] == 0 and fitune["plan"] == 1 and fitune["steps"] == 12
        assert fitune["micro_batch_sizes"] == [1] and fitune["peak_allocated_bytes"] <= 23.4 * 2**30
        for r in peers.values():
            assert r["fits"] and r["cap"] == "rtx4090" and r["steps_done"] == 12
        hf_liger = max(peers["hf_trainer_liger"]["tokens_per_s"], peers["hf_loop_liger"]["tokens_per_s"])
        ratios[call] = fitune["tokens_per_s_median"] / hf_liger
        unsloth = f"{peers['unsloth']['tokens_per_s']:,.0f}" if "unsloth" in peers else "not run"
        row = (f"| {call} (fitune {'first' if call == 3 else 'last'}) | **{fitune['tokens_per_s_median']:,.0f}** | "
               f"{peers['hf_loop_liger']['tokens_per_s']:,.0f} | {peers['hf_trainer_liger']['tokens_per_s']:,.0f} | "
               f"{unsloth} | **{ratios[call]:.2f}x**")
        assert row in readme, row
    fitune, peers = _run3(4)
    to_unsloth = fitune["tokens_per_s_median"] / peers["unsloth"]["tokens_per_s"]
    assert f"(and {to_unsloth:.2f}x Unsloth)" in readme
    assert f"fitune's peak {_gib(fitune['peak_allocated_bytes'])} allocated / " \
           f"{_gib(fitune['peak_reserved_bytes'])[:-4]} GiB reserved" in readme
    assert min(ratios.values()) / 1.2 > 1.08  # the issue's goal, in both calls, each beyond the noise
    assert "each more than 8 % above it" in readme
    run2 = _lines("run2/rank_check.jsonl")[0]["tokens_per_s_median"] / max(
        r["tokens_per_s"] for r in _lines("run2/peers.jsonl") if "liger" in r["stack"])
    first = _lines("fitune.jsonl")[0]["tokens_per_s_median"] / max(
        _best("hf_trainer_liger")["tokens_per_s"], _best("hf_loop_liger")["tokens_per_s"])
    assert (f"on the seeds' workload {ratios[3]:.2f}x and {ratios[4]:.2f}x HF + Liger in two calls and "
            f"{to_unsloth:.2f}x Unsloth (the step without host syncs and with a compiled loss; {run2:.2f}x and "
            f"{first:.2f}x in the two calls before)") in readme


def test_readme_estimate_on_the_fourth_call_is_the_estimator():
    from fitune.memory.estimate import estimate
    from fitune.setup import TrainSetup
    from fitune.specs import load_model_spec, resolve_gpu

    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    r = _lines("run3/rank_check.jsonl")[0]
    est = estimate(load_model_spec(r["model"]), TrainSetup.from_dict(r["setup"]), resolve_gpu("h200"))  # as accuracy.py
    err = est.peak_allocated_bytes / r["peak_allocated_bytes"] - 1
    assert abs(err) < 0.02
    assert f"(estimate {err:+.2%} allocated)".replace("%", " %") in readme


def test_readme_loss_kernel_table_is_the_record():
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    path = os.path.join(ROOT, "bench", "results", "speed", "loss_kernels.jsonl")
    rows = {(r["impl"], r["tokens"]): r for r in map(json.loads, open(path, encoding="utf-8"))}
    for n in (2048, 16384):
        ms = {impl: rows[(impl, n)]["ms"] for impl in ("chunked", "chunked_compiled", "liger_flce", "cce", "cce_exact",
                                                      "hf")}
        assert min(ms, key=ms.get) == "chunked_compiled"  # the fastest of all, exact or not
        assert rows[("chunked_compiled", n)]["grad_rel_norm_diff"] < 1e-4  # exact to rounding
        assert rows[("cce", n)]["grad_rel_norm_diff"] > 5e-3  # the filtered kernel is not
        assert (f"| {n:,} | {ms['chunked']:.2f} ms | **{ms['chunked_compiled']:.2f} ms** | {ms['liger_flce']:.2f} ms | "
                f"{ms['cce']:.2f} ms") in readme, n
        assert f"{ms['cce_exact']:.2f} ms | {ms['hf']:.2f} ms, {_gib(rows[('hf', n)]['peak_above_inputs_bytes'])} |" \
            in readme, n
    assert (f"0.51 GiB at 2,048 tokens against the eager\nchunk's "
            f"{rows[('chunked', 2048)]['peak_above_inputs_bytes'] / 2**30:.2f} GiB") in readme
    assert f"{rows[('chunked_compiled', 2048)]['peak_above_inputs_bytes'] / 2**30:.2f}" == "0.51"


def test_readme_step_profile_figures_are_the_record():
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    speed = os.path.join(ROOT, "bench", "results", "speed")
    before = json.loads(open(os.path.join(speed, "step_profile_before.jsonl")).readline())
    after = json.loads(open(os.path.join(speed, "step_profile.jsonl")).readline())
    assert f"went from {before['tokens_per_s_median']:,.0f} to {after['tokens_per_s_median']:,.0f} tokens/s" in readme
    kinds = before["kernel_s_per_kind"]
    wall = before["wall_s"]
    assert f"{kinds['matmul'] / wall:.0%}\nmatmuls, {kinds['attention'] / wall:.0%} attention".replace("%", " %") \
        in readme
    assert f"{kinds['compiled'] / wall:.0%}\ncompiled layer code, {kinds['other'] / wall:.0%} other elementwise".replace(
        "%", " %") in readme


def test_readme_bounds_for_fused_lora_and_cuda_graphs_are_the_record():
    """The small-tile matmuls' share of the profiled step before the changes (from its committed trace), and the
    idle share after them (busy time against the median unprofiled step)."""
    import gzip
    import re
    import statistics

    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    speed = os.path.join(ROOT, "bench", "results", "speed")
    before = json.loads(open(os.path.join(speed, "step_profile_before.jsonl")).readline())
    with gzip.open(os.path.join(speed, "trace_seeds_before.json.gz"), "rt") as f:
        kernels = [e for e in json.load(f)["traceEvents"] if e.get("cat") == "kernel"]
    small_us = sum(e["dur"] for e in kernels if re.search(r"nvjet|gemm|splitK", e["name"])
                   and not re.search(r"_(256x128|320x128)_", e["name"]))
    assert (f"took {small_us / 1e3:.1f} ms of the three steps' {before['wall_s'] * 1e3:.0f} ms, "
            f"{small_us / 1e6 / before['wall_s']:.1%}").replace("%", " %") in readme.replace("\n", " ")
    after = json.loads(open(os.path.join(speed, "step_profile.jsonl")).readline())
    profiled = range(5, 5 + after["profiled_steps"])  # bench/step_profile.py's default --profile-from 5
    step = statistics.median(t for i, t in enumerate(after["step_time_s"]) if i >= 1 and i not in profiled)
    busy = after["gpu_busy_s"] / after["profiled_steps"]
    assert f"busy\n{busy:.3f} s of a {step:.3f} s step" in readme
    assert f"at most the {1 - busy / step:.1%} that is idle".replace("%", " %") in readme


def test_readme_idle_gpu_at_each_micro_batch_start_is_the_record():
    """The profiled step before the host syncs went (its committed trace): at each micro-batch's start, from the end
    of the last kernel before its input copies to its first kernel longer than 50 us, how long the GPU sat idle."""
    import gzip

    with gzip.open(os.path.join(ROOT, "bench", "results", "speed", "trace_seeds_before.json.gz"), "rt") as f:
        gpu = sorted((e for e in json.load(f)["traceEvents"] if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                     key=lambda e: e["ts"])
    idle_ms, i = [], 0
    while i < len(gpu):
        if "HtoD" in gpu[i]["name"] and (i == 0 or "HtoD" not in gpu[i - 1]["name"]):
            end = gpu[i - 1]["ts"] + gpu[i - 1]["dur"] if i else gpu[i]["ts"]
            idle, j = 0.0, i
            while j < len(gpu) and gpu[j]["dur"] <= 50:
                idle += max(0.0, gpu[j]["ts"] - end)
                end = max(end, gpu[j]["ts"] + gpu[j]["dur"])
                j += 1
            if j < len(gpu):
                idle += max(0.0, gpu[j]["ts"] - end)
            idle_ms.append(idle / 1000)
            i = j
        i += 1
    assert len(idle_ms) == 6  # three profiled steps of two micro-batches
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    assert (f"for {min(idle_ms):.1f} to {max(idle_ms):.1f} ms ({sum(idle_ms) / len(idle_ms):.1f} ms on average over "
            "the six in the trace)") in readme

"""Issue 14's second peers' call, on the CPU: the shared length distribution (bench/peers/peerlib.py),
bench/peers/real_length.py on a tiny model, and the longest-context search of bench/peers/unsloth_max_context.py
(its parent logic with fake probes; fitune's probe on a tiny model). Unsloth, TRL's packing and QLoRA need the GPU."""

import importlib.util
import json
import math
import os
import random
import statistics
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.peers import peerlib  # noqa: E402


def _load(path, name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, path))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _py(args, timeout=300):
    env = dict(os.environ, PYTHONPATH=ROOT, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="")
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def _lines(path):
    return [json.loads(x) for x in open(path).read().splitlines() if x.strip()]


# ---- the length distribution -------------------------------------------------------------------------------

def test_length_distribution_has_its_documented_percentiles():
    lengths = peerlib.instruction_lengths(50_000, seed=0)
    assert min(lengths) >= peerlib.LENGTH_MIN and max(lengths) == peerlib.LENGTH_MAX
    measured = peerlib.length_percentiles(lengths)
    for key, documented in peerlib.LENGTH_PERCENTILES.items():
        assert abs(measured[key] - documented) <= 0.03 * documented, (key, measured[key], documented)
    assert measured["p99"] == 2048 and 0.013 <= measured["at_max_share"] <= 0.020  # 1.6 % at the clip
    assert abs(statistics.mean(lengths) - 435) < 10
    # the documented figures are the lognormal's own (median 300, sigma 0.9), p99 clipped
    z = statistics.NormalDist()
    for key, documented in peerlib.LENGTH_PERCENTILES.items():
        exact = min(2048, peerlib.LENGTH_MEDIAN * math.exp(peerlib.LENGTH_SIGMA * z.inv_cdf(int(key[1:]) / 100)))
        assert round(exact) == documented, key


def test_length_data_is_seeded_and_described(tmp_path):
    assert peerlib.instruction_lengths(500, 0) == peerlib.instruction_lengths(500, 0)
    assert peerlib.instruction_lengths(500, 1) != peerlib.instruction_lengths(500, 0)
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    desc = peerlib.write_length_data(str(a), 2000, seed=0)
    peerlib.write_length_data(str(b), 2000, seed=0)
    assert a.read_bytes() == b.read_bytes()
    lengths = peerlib.instruction_lengths(2000, 0)
    records = _lines(a)
    for rec, n in zip(records, lengths):
        p, c = len(rec["prompt"].split()), len(rec["completion"].split())
        assert p + c == n and rec["completion"].startswith(" ") and p >= 4 and c >= 1
        assert p <= max(4, round(0.5 * n) + 1)
    # the seed-0 sample quoted in real_length.py's docstring, and the distribution's percentiles in peerlib's
    assert desc["sample_percentiles"] == {"p10": 96, "p25": 170, "p50": 304, "p75": 545, "p90": 938, "p95": 1332,
                                          "p99": 2048, "max": 2048, "mean": 437.7, "at_max_share": 0.0185}
    doc = " ".join(_load("bench/peers/real_length.py", "real_length").__doc__.split())
    assert "p10 96, p25 170, p50 304, p75 545, p90 938, p95 1332, p99 2048, mean 438, 1.85 % at 2048" in doc
    assert "p10 95, p25 163, p50 300, p75 550, p90 951, p95 1318, p99 2048" in doc
    assert desc["documented_percentiles"] == peerlib.LENGTH_PERCENTILES


# ---- real_length.py ----------------------------------------------------------------------------------------

def test_real_length_hf_trainer_counts_trained_padded_and_real_tokens(tiny_model, tmp_path):
    out = tmp_path / "rl.jsonl"
    proc = _py(["bench/peers/real_length.py", "--stack", "hf_trainer", "--model-dir", str(tiny_model), "--out",
                str(out), "--device", "cpu", "--cap", "", "--steps", "3", "--examples", "64", "--max-length", "512",
                "--work", str(tmp_path / "work")])
    assert proc.returncode == 0, proc.stderr[-2000:]
    (rec,) = _lines(out)
    assert rec["stack"] == "hf_trainer" and rec["fits"] is True and rec["steps_done"] == 3, rec.get("error")
    assert rec["micro_batch_size"] == 4 and rec["setup"]["gradient_checkpointing"] is True
    assert 0 < rec["trained_tokens"] < rec["nonpad_tokens"] < rec["padded_tokens"]
    assert 0 < rec["trained_tokens_per_s"] < rec["nonpad_tokens_per_s"] < rec["padded_tokens_per_s"]
    assert rec["tokens_per_s"] == rec["trained_tokens_per_s"] and 0 < rec["padding_share"] < 1
    steps = rec["step_tokens"]
    assert len(steps) == 3 and [sum(s[i] for s in steps) for i in range(3)] == [
        rec["padded_tokens"], rec["nonpad_tokens"], rec["trained_tokens"]]
    assert all(padded % 4 == 0 and padded <= 4 * 512 for padded, _, _ in steps)  # 4 rows, each <= 512
    assert rec["data"]["examples"] == 64 and rec["data"]["documented_percentiles"] == peerlib.LENGTH_PERCENTILES


# ---- unsloth_max_context.py --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def umc():
    return _load("bench/peers/unsloth_max_context.py", "unsloth_max_context")


def test_gallop_brackets_every_threshold_from_any_prior(umc):
    rng = random.Random(0)
    for res, limit in ((1024, 262144), (4096, 262144)):
        for prior in (res, 78475, 143360, limit):
            for threshold in [0, res - 1, res, prior - res, prior, prior + res, limit, 10**7] + \
                             [rng.randrange(limit) for _ in range(15)]:
                seen = {}

                def fits(n):
                    assert res <= n <= limit and n % res == 0
                    seen.setdefault(n, n <= threshold)
                    return seen[n]

                umc.gallop(fits, prior, res, limit)
                best = max((n for n, ok in seen.items() if ok), default=0)
                assert best == min(limit, threshold // res * res), (res, prior, threshold)
                above = [n for n, ok in seen.items() if not ok and n > best]
                assert best == limit or min(above) == best + res
    seen = []
    umc.gallop(lambda n: seen.append(n) or n <= 70000, 78475, 4096, 262144)  # a prior near the answer: few probes
    assert len(seen) <= 5 and seen[0] == 77824


@pytest.mark.parametrize("prior, threshold", [("auto", 70000), ("auto", 100000), ("auto", 500), ("none", 70000),
                                              ("30000", 262144)])
def test_max_context_search_finds_the_threshold_with_fake_probes(umc, tmp_path, prior, threshold):
    out = tmp_path / "mc.jsonl"
    proc = _py(["bench/peers/unsloth_max_context.py", "--model-dir", str(tmp_path), "--cap", "23.4GiB", "--out",
                str(out), "--fake-threshold", str(threshold), "--prior", prior, "--resolution", "1024",
                "--work", str(tmp_path / "work")], timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = _lines(out)
    probes, (summary,) = lines[:-1], lines[-1:]
    assert summary["summary"] and summary["complete"] and summary["stopped"] is None
    assert summary["longest_tokens"] == min(262144, threshold // 1024 * 1024)
    assert summary["upper_bound_tokens"] == (None if threshold >= 262144 else summary["longest_tokens"] + 1024)
    assert [[p["seq_len_tokens"], p["fits"]] for p in probes] == [s[:2] for s in summary["probes"]]
    assert all(p["probe"] and p["fake"] and p["fits"] == (p["seq_len_tokens"] <= threshold) for p in probes)
    if prior == "auto":
        assert summary["prior"] == 78475 and summary["first_probe"] == 77824 == probes[0]["seq_len_tokens"]


def test_max_context_search_stops_at_its_budget_and_counts_timeouts_as_no(tmp_path):
    out = tmp_path / "mc.jsonl"
    proc = _py(["bench/peers/unsloth_max_context.py", "--model-dir", str(tmp_path), "--cap", "11.4GiB", "--out",
                str(out), "--fake-threshold", "100000", "--fake-seconds", "5", "--probe-timeout", "0.5",
                "--budget-s", "2.5", "--min-probe-s", "0.6", "--work", str(tmp_path / "work")], timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = _lines(out)
    summary = lines[-1]
    assert summary["complete"] is False and summary["stopped"].startswith("out of budget")
    assert summary["prior"] == 21848 and summary["longest_tokens"] == 0 and summary["timed_out_probes"]
    assert all(p["fits"] is None and p["error"].startswith("no record") for p in lines[:-1])  # killed probes
    assert len(lines) - 1 == len(summary["probes"]) >= 2


def test_fitune_probe_plans_and_trains_on_a_tiny_model(umc, tiny_model, tmp_path):
    """The fitune stack's probe along the user's path (plan, --write --pick, train) on a tiny config, LoRA on the
    CPU (QLoRA needs bitsandbytes and CUDA), then the search with fitune's plan as its prior."""
    out = tmp_path / "mc.jsonl"
    proc = _py(["bench/peers/unsloth_max_context.py", "--stack", "fitune", "--model",
                str(tiny_model / "config.json"), "--method", "lora", "--model-dir", str(tiny_model), "--cap",
                "7.4GiB", "--out", str(out), "--resolution", "512", "--limit", "1024", "--device", "cpu",
                "--work", str(tmp_path / "work")], timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = _lines(out)
    probe, summary = lines[0], lines[-1]
    assert probe["fits"] is True and probe["exit"] == 0 and probe["steps_done"] == 2, probe.get("error")
    assert probe["picked"] == 1 and probe["setup"]["optimizer"] == "adamw" and probe["seq_len_tokens"] == 1024
    assert probe["est_peak_reserved_bytes"] > 0 and probe["tokens_per_s"] > 0
    assert summary["prior_source"] == "fitune plan's longest" and summary["plan_longest_tokens"] == 1024
    assert summary["longest_tokens"] == 1024 and summary["complete"]


def test_fitune_probe_at_fixed_lengths_with_a_key_set_records_that_runs_estimate(umc, tiny_model, tmp_path):
    """--lengths (bracketing a stack's longest in a few probes) with --fitune-set: the written plan gets the key,
    the record says so and carries the estimate of the config that ran, not of the plan as written."""
    out = tmp_path / "mc.jsonl"
    proc = _py(["bench/peers/unsloth_max_context.py", "--stack", "fitune", "--model",
                str(tiny_model / "config.json"), "--method", "lora", "--model-dir", str(tiny_model), "--cap",
                "7.4GiB", "--out", str(out), "--lengths", "512,256", "--fitune-set", "lean_lora=false", "--fitune-plan-at", "256",
                "--device", "cpu", "--work", str(tmp_path / "work")], timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = _lines(out)
    probe, summary = lines[0], lines[-1]
    assert len(lines) == 2  # 512 fitted, so 256 was not probed
    assert probe["fits"] is True and probe["set"] == {"lean_lora": False} and probe["setup"]["lean_lora"] is True
    assert probe["est_peak_allocated_bytes"] > 0 and probe["planned_at_tokens"] == 256
    assert probe["seq_len_tokens"] == 512 and probe["steps_done"] == 2
    assert summary["mode"] == "lengths" and summary["longest_tokens"] == 512 and summary["set"] == {"lean_lora": False}
    assert summary["probes"][0][:2] == [512, True]


def test_lengths_mode_skips_what_a_probe_already_decides(umc):
    results, probed = {}, []

    def fits(n):
        probed.append(n)
        results[n] = n <= 3000
        return results[n]

    umc.probe_lengths(fits, [5000, 6000, 2000, 1000, 4000], results)
    assert probed == [5000, 2000, 4000]  # 6000 > a failure; 1000 < a fit

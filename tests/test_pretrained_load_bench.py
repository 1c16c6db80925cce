"""bench/pretrained_load.py on the CPU: its --smoke mode runs the whole flow (a sharded Hub-like folder, `fitune plan
--write`, `fitune estimate --config`, `fitune train` with init: pretrained in a fresh process, the load measured by a
wrapper the loop really calls); its verdicts on made-up numbers. The 8B measurements are taken on the GPU machine
(bench/results/pretrained_load/COMMAND.md)."""

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load():
    spec = importlib.util.spec_from_file_location("pretrained_load", os.path.join(ROOT, "bench", "pretrained_load.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_smoke_trains_a_sharded_pretrained_folder_and_records_its_load(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("peft")
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "pretrained_load.py"), "--out", str(out),
                           "--smoke"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "qlora skipped" in proc.stdout
    [rec] = [json.loads(x) for x in (out / "pretrained_load.jsonl").read_text().splitlines()]
    assert (rec["case"], rec["exit"], rec["child_exit"], rec["smoke"]) == ("lora", 0, 0, True)

    # the folder as a Hub download: shards named K-of-N, their index, config, generation config, a tokenizer
    files = rec["folder"]["folder_files"]
    n = rec["folder"]["shards"]
    assert n >= 2
    assert [f for f in files if f.endswith(".safetensors")] == [f"model-{k:05d}-of-{n:05d}.safetensors"
                                                                 for k in range(1, n + 1)]
    assert {"model.safetensors.index.json", "config.json", "generation_config.json", "tokenizer.json"} <= set(files)
    index = json.loads((out / "work" / "model" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == n

    # the user's path: plan --write, then init: pretrained from that folder
    cfg = rec["train_config"]
    assert (cfg["init"], cfg["model"], cfg["method"], cfg["cap"]) == ("pretrained", str(out / "work" / "model"),
                                                                      "lora", "rtx4090")
    assert " plan " in rec["plan_command"] and "--write" in rec["plan_command"]
    assert (out / "lora_config.yaml").exists() and (out / "lora.log").exists()

    # the load, measured by the wrapper inside `fitune train` (on the CPU: host memory only)
    load = rec["load"]
    assert load is not None, rec.get("error")
    assert load["load_s"] > 0 and load["device"] == "cpu" and load["parameters_on"] == {"cpu": 21}
    assert load["host_rss_peak_bytes"] >= load["host_rss_before_bytes"] > 0
    assert load["host_anon_peak_bytes"] > 0 and load["host_file_peak_bytes"] > 0
    assert load["load_path"] in ("host_first", "direct_to_gpu")
    assert load["gpu_peak_allocated_bytes"] is None and load["linear4bit_modules"] == 0

    # the first steps, and fitune's estimate of the same config
    assert rec["steps_done"] == 2 and [s["step"] for s in rec["steps"]] == [1, 2]
    assert rec["est_peak_allocated_bytes"] > 0 and rec["est_peak_reserved_bytes"] > 0
    assert rec["est_weights_bytes"] < rec["folder"]["shard_bytes"] < 1.1 * rec["est_weights_bytes"]  # bf16 + headers

    # every phase of the run, measured by wrappers of the loop's own functions, and `fitune merge` in a process of
    # its own; each beside the estimate's phase of the same name
    assert set(rec["phases"]) == {"eval_step", "save", "write_outputs"}
    for name, phase in rec["phases"].items():
        assert phase["calls"] >= 1 and phase["seconds"] > 0, name
        assert phase["host_bytes"] > 0 and phase["host_anon_bytes"] > 0, name
        assert phase["gpu_allocated_bytes"] is None, name  # the CPU
    merge = rec["merge"]
    assert merge["exit"] == 0 and merge["child_exit"] == 0, merge.get("log_tail")
    assert merge["host_rss_peak_bytes"] > 0 and merge["merged_bytes"] > 0
    assert [x["stage"] for x in merge["stages"]] == ["base built", "adapter loaded", "merged", "written", "overall"]
    assert not (out / "work" / "merged").exists()  # deleted after measuring (16 GB for 8B)
    assert set(rec["est_run_phases"]) >= {"load", "train_step", "eval_step", "save", "merge"}
    comparison = rec["phase_comparison"]
    assert set(comparison) == {"load", "eval_step", "save", "write_outputs", "merge"}  # no GPU step peak on the CPU
    assert comparison["write_outputs"]["est_phase"] == "save"
    assert load["host_no_weight_files_peak_bytes"] > 0  # /proc/self/smaps read: the mapped shards left out
    for name, c in comparison.items():
        assert c["est_host_bytes"] > 0 and c["measured_host_bytes"] > 0, name
        assert c["host_bytes_over_est"] == c["measured_host_bytes"] / c["est_host_bytes"], name

    # provenance
    assert rec["commit"] is None or re.fullmatch(r"[0-9a-f]{40}", rec["commit"])
    assert rec["diff_sha256"] is None or re.fullmatch(r"([0-9a-f]{64})?", rec["diff_sha256"])
    assert re.fullmatch(r"[0-9a-f]{64}", rec["runtime_model_sha256"])
    assert rec["versions"]["torch"] and rec["versions"]["gpu"] == "cpu"
    assert "--smoke" in rec["command"]


def test_load_path_follows_the_anonymous_host_growth():
    mod = _load()
    bf16 = 16_060_522_496

    def verdict(anon_growth, rss_peak):
        rec = {"folder": {"shard_bytes": bf16}, "est_weights_bytes": bf16 - 10**6, "peak_allocated_bytes": 2 * 10**10,
               "est_peak_allocated_bytes": 10**10,
               "load": {"host_anon_growth_bytes": anon_growth, "host_rss_peak_bytes": rss_peak,
                        "host_anon_peak_bytes": anon_growth + 10**9, "gpu_allocated_after_bytes": bf16,
                        "gpu_peak_allocated_bytes": bf16}}
        return mod.with_comparisons(rec)

    whole = verdict(16 * 10**9, 19 * 10**9)  # from_pretrained on the CPU, then .to("cuda")
    assert whole["load"]["load_path"] == "host_first"
    assert whole["load"]["host_rss_peak_over_bf16_weights"] and whole["load"]["host_anon_peak_over_bf16_weights"]
    assert whole["step_allocated_over_est"] == 2.0
    # straight to the GPU: the shards' mapped pages (file-backed) can still push RSS past the weights
    direct = verdict(300 * 2**20, 17 * 10**9)
    assert direct["load"]["load_path"] == "direct_to_gpu"
    assert direct["load"]["host_rss_peak_over_bf16_weights"] and not direct["load"]["host_anon_peak_over_bf16_weights"]
    assert direct["load"]["gpu_after_over_est_weights"] == pytest.approx(bf16 / (bf16 - 10**6))


def test_provenance_prefers_the_commit_given_to_a_copy_without_git(monkeypatch):
    mod = _load()
    monkeypatch.setenv("FITUNE_COMMIT", "a" * 40)
    monkeypatch.setenv("FITUNE_DIFF_SHA256", "")
    prov = mod.provenance()
    assert (prov["commit"], prov["diff_sha256"], prov["provenance_from"]) == ("a" * 40, "", "env")


def test_step_peaks_reads_the_runs_metrics(tmp_path):
    mod = _load()
    lines = [{"step": 1, "loss": 2.0, "tokens_per_s": 10.0, "peak_allocated_bytes": 5, "peak_reserved_bytes": 8},
             {"step": 1, "eval_loss": 1.0},
             {"step": 2, "loss": 1.5, "tokens_per_s": 11.0, "peak_allocated_bytes": 7, "peak_reserved_bytes": 6}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    got = mod.step_peaks(str(tmp_path))
    assert (got["steps_done"], got["peak_allocated_bytes"], got["peak_reserved_bytes"]) == (2, 7, 8)
    assert mod.step_peaks(str(tmp_path / "none"))["steps_done"] == 0

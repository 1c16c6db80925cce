"""The GPU benchmark scripts' logic, on the CPU (their measurements are taken on the GPU machine)."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "bench", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _tiny_config(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                                "vocab_size": 300, "max_position_embeddings": 4096}))
    return path


@pytest.mark.parametrize("threshold", [1000, 4096, 5000, 70000, 300000])
def test_max_context_search_finds_the_threshold(threshold):
    search = _load("max_context").search
    probes = []

    def fits(n):
        probes.append(n)
        return n <= threshold

    best = search(fits, start=4096, resolution=1024, limit=262144)
    expected = 0 if threshold < 4096 else min(threshold // 1024 * 1024, 262144)
    if threshold >= 262144:
        expected = max(n for n in probes if n <= threshold)
    assert best == expected
    assert len(probes) <= 16


def _run_on_tiny_model(tmp_path, script: str, stacks, *args) -> list[dict]:
    """Run bench/SCRIPT.py on the CPU for each stack on a tiny Llama; the JSON lines it wrote."""
    pytest.importorskip("torch")
    pytest.importorskip("peft")
    cfg = _tiny_config(tmp_path)
    out = tmp_path / f"{script}.jsonl"
    for stack in stacks:
        subprocess.run([sys.executable, os.path.join(ROOT, "bench", f"{script}.py"), "--stack", stack, "--model",
                        str(cfg), "--device", "cpu", "--cap", "", *args, "--out", str(out)], check=True, cwd=ROOT,
                       capture_output=True, text=True)
    return [json.loads(x) for x in out.read_text().splitlines()]


def test_max_context_runs_on_a_tiny_model(tmp_path):
    lines = _run_on_tiny_model(tmp_path, "max_context", ("hf", "fitune"), "--start", "64", "--resolution", "64",
                               "--limit", "256", "--steps", "1")
    finals = [x for x in lines if "max_seq_len_tokens" in x]
    assert [x["max_seq_len_tokens"] for x in finals] == [256, 256]  # no cap on the CPU: everything fits
    assert all(x["fits"] for x in lines if "fits" in x)
    probes = [x for x in lines if "fits" in x]
    assert all(x["est_peak_allocated_bytes"] > 0 and x["host_rss_peak_bytes"] > 0 for x in probes)


def test_max_context_probes_fixed_lengths(tmp_path):
    lines = _run_on_tiny_model(tmp_path, "max_context", ("fitune",), "--seqs", "96,160", "--batch-size", "2",
                               "--lora-targets", "all-linear")
    assert [(x["seq_len_tokens"], x["batch_size"], x["fits"]) for x in lines] == [(96, 2, True), (160, 2, True)]


def test_throughput_runs_every_variant_on_a_tiny_model(tmp_path):
    lines = _run_on_tiny_model(tmp_path, "throughput", ("hf", "fitune"), "--seq-len", "64", "--steps", "2",
                               "--selective", "1")
    assert [(x["stack"], x["grad_checkpointing"], x.get("micro_batch_size")) for x in lines] == [
        ("hf", "none", None), ("hf", "full", None), ("hf", "none", 1), ("fitune", "selective:1", None),
        ("fitune", "full", None), ("fitune", "none", 1)]
    assert all(x["fits"] and x["tokens_per_s"] > 0 for x in lines)
    fitune = [x for x in lines if x["stack"] == "fitune"]
    assert all(x["lean_lora"] and x["lean_norm"] and x["est_peak_allocated_bytes"] > 0 for x in fitune)


def _py(args, cwd, timeout=300):
    env = dict(os.environ, PYTHONPATH=ROOT, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_speed_calibration_runs_every_case_of_a_group_on_a_tiny_model(tmp_path):
    """bench/speed_calibration.py (the throughput model's data) on a 2-layer copy of the model, on the CPU: every
    case of the group writes a line with its whole setup and a median tokens/s."""
    out = tmp_path / "speed.jsonl"
    proc = _py(["bench/speed_calibration.py", "--model", "llama-3.2-1b", "--group", "lora", "--device", "cpu",
                "--tiny", "--steps", "3", "--out", str(out)], ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    cases = _load("speed_calibration").cases("lora", "llama")
    assert len(lines) == len(cases) and all(x["ok"] and x["tokens_per_s"] > 0 for x in lines)
    assert [x["setup"]["grad_checkpointing"] for x in lines] == [c.grad_checkpointing for c in cases]
    assert lines[-1]["setup"]["tiled_mlp"]  # the tiled MLP stays patched: it runs last


def test_peer_scripts_run_on_a_tiny_model(tmp_path):
    """bench/peers/: the model folder, the HF Trainer and the plain loop on the CPU (Unsloth and Liger need the GPU):
    each writes one JSON line with the same fields."""
    model = tmp_path / "tiny"
    proc = _py(["bench/peers/make_model.py", "--out", str(model), "--device", "cpu", "--layers", "2", "--hidden",
                "64", "--intermediate", "128", "--heads", "4", "--kv-heads", "2", "--vocab", "8192", "--rows", "8",
                "--seq-len", "64"], ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = tmp_path / "peers.jsonl"
    for script, extra in (("hf_trainer", ["--grad-checkpointing", "full"]),
                          ("hf_loop", ["--micro-batch", "1", "--grad-accum", "2"])):
        proc = _py([f"bench/peers/{script}.py", "--model-dir", str(model), "--out", str(out), "--steps", "4",
                    "--device", "cpu", "--cap", "", *extra], ROOT)
        assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["stack"] for x in lines] == ["hf_trainer", "hf_loop"]
    for x in lines:
        assert x["fits"] is True and x["tokens_per_s"] > 0 and x["steps_done"] == 4
    assert lines[1]["micro_batch_size"] == 1 and lines[1]["grad_accum"] == 2

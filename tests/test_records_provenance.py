"""Issue 34: every record under bench/results/ says what produced it.

A record (a JSON line of a `.jsonl` under bench/results/) carries `provenance`: the commit, the sha256 of the
uncommitted diff ("" when clean), package versions and the GPU; a training record also its first step's
trainable-gradient norm and its loss trajectory. Files written before that are listed in bench/results/LEGACY.txt
and kept as they were. The bench scripts write their records through one function, `bench.common.write_record`,
which refuses a training record without the gradient norm or the trajectory.
"""

import ast
import glob
import json
import os

import pytest

from bench import common
from bench.common import PROVENANCE_KEYS, TRAINING_KEYS, RecordError, write_record

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")
SCRIPTS = sorted(glob.glob(os.path.join(ROOT, "bench", "*.py")) + glob.glob(os.path.join(ROOT, "bench", "peers",
                                                                                           "*.py")))
TRAINING_SCRIPTS = {"claims_single_gpu.py", "hf_recipe.py", "max_context.py", "oom_guard.py", "rank_check.py",
                    "speed_calibration.py", "step_profile.py", "throughput.py", "train_parity.py", "train_seeds.py",
                    "zero_single_gpu.py", "pretrained_load.py",
                    "peerlib.py", "real_length.py", "unsloth_max_context.py"}
"""Scripts whose records are training runs: each of their write_record calls passes `training=`."""


def _legacy() -> set[str]:
    with open(os.path.join(RESULTS, "LEGACY.txt"), encoding="utf-8") as f:
        lines = [line.strip() for line in f]
    assert lines[0].startswith("#") and "provenance" in lines[0], "LEGACY.txt starts with a header saying what it is"
    return {line for line in lines[1:] if line and not line.startswith("#")}


def _records() -> list[str]:
    return sorted(os.path.relpath(p, RESULTS) for p in glob.glob(os.path.join(RESULTS, "**", "*.jsonl"),
                                                                  recursive=True))


def test_every_record_file_is_legacy_or_carries_provenance():
    legacy = _legacy()
    assert legacy <= set(_records()), f"LEGACY.txt names files that are not there: {sorted(legacy - set(_records()))}"
    for rel in _records():
        if rel in legacy:
            continue
        with open(os.path.join(RESULTS, rel), encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                rec = json.loads(line)
                prov = rec.get("provenance")
                assert isinstance(prov, dict), f"{rel}:{n} has no provenance (write it with bench.common.write_record)"
                missing = [k for k in PROVENANCE_KEYS if k not in prov]
                assert not missing, f"{rel}:{n}'s provenance lacks {missing}"
                assert prov["commit"], f"{rel}:{n} does not say which commit produced it"
                if any(k in rec for k in TRAINING_KEYS):
                    common.check_training(rec)


def test_write_record_adds_provenance(tmp_path, monkeypatch):
    monkeypatch.setenv("FITUNE_COMMIT", "a" * 40)
    monkeypatch.setenv("FITUNE_DIFF_SHA256", "")
    path = tmp_path / "sub" / "r.jsonl"
    write_record(str(path), {"case": "x", "fits": True})
    write_record(str(path), {"case": "y"}, training={"first_step_grad_norm": 0.5, "loss_trajectory": [2.0, 1.5]})
    first, second = [json.loads(line) for line in path.read_text().splitlines()]
    assert first["case"] == "x" and first["provenance"]["commit"] == "a" * 40
    assert first["provenance"]["diff_sha256"] == "" and first["provenance"]["provenance_from"] == "env"
    assert first["provenance"]["versions"]["python"] and "torch" in first["provenance"]["versions"]
    assert set(PROVENANCE_KEYS) <= set(first["provenance"])
    assert second["first_step_grad_norm"] == 0.5 and second["loss_trajectory"] == [2.0, 1.5]


def test_provenance_hashes_the_uncommitted_diff(monkeypatch):
    monkeypatch.delenv("FITUNE_COMMIT", raising=False)
    calls = {("rev-parse", "HEAD"): b"c" * 40 + b"\n", ("diff", "HEAD"): b"--- a\n+++ b\n"}
    monkeypatch.setattr(common, "_git", lambda *args: calls[args])
    v = common.code_version()
    assert v["commit"] == "c" * 40 and v["provenance_from"] == "git"
    assert v["diff_sha256"] == __import__("hashlib").sha256(b"--- a\n+++ b\n").hexdigest()
    calls[("diff", "HEAD")] = b""
    assert common.code_version()["diff_sha256"] == ""


@pytest.mark.parametrize("training, match", [
    ({"loss_trajectory": [1.0]}, "needs first_step_grad_norm"),
    ({"first_step_grad_norm": 1.0}, "needs loss_trajectory"),
    ({"first_step_grad_norm": None, "loss_trajectory": []}, "without first_step_grad_norm_why_none"),
    ({"first_step_grad_norm": float("nan"), "loss_trajectory": [1.0]}, "finite number"),
    ({"first_step_grad_norm": 1.0, "loss_trajectory": "1.0 0.9"}, "list of numbers"),
])
def test_write_record_refuses_a_training_record_without_grad_norm_or_trajectory(tmp_path, training, match):
    path = tmp_path / "r.jsonl"
    with pytest.raises(RecordError, match=match):
        write_record(str(path), {"case": "x"}, training=training, prov={"commit": "x"})
    assert not path.exists()  # nothing half-written


def test_a_run_without_a_first_step_says_why():
    facts = common.training_facts([], None, why_none="out of memory at the first forward")
    common.check_training(facts)
    assert facts["first_step_grad_norm"] is None and facts["first_step_grad_norm_why_none"].startswith("out of")


def test_first_step_grad_norm_is_the_trainable_gradients_norm(monkeypatch):
    """The norm `clip_grad_norm_` would see (trainable parameters only), also when read 16 Mi elements at a time."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(30, 20), torch.nn.Linear(20, 5))
    model[0].bias.requires_grad_(False)  # frozen: not part of the norm
    model(torch.randn(4, 30)).square().sum().backward()
    trainable = [p for p in model.parameters() if p.requires_grad]
    want = float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in trainable])))
    assert common.first_step_grad_norm(model) == pytest.approx(want, rel=1e-6)
    monkeypatch.setattr(torch.Tensor, "split", lambda t, n: torch.Tensor.chunk(t, 7))  # many pieces
    assert common.first_step_grad_norm(model) == pytest.approx(want, rel=1e-6)
    model.zero_grad(set_to_none=True)
    assert common.first_step_grad_norm(model) is None  # nothing to read: the record must say why


def test_the_probe_reads_the_norm_where_the_runner_checks_and_unscales_fp16():
    """grad_norm_probe: the first check's norm only; under an fp16 GradScaler (the runner checks before
    `unscale_`), divided by the loss scale."""
    torch = pytest.importorskip("torch")
    from fitune.runtime import step as step_mod

    class Scaler:
        def get_scale(self):
            return 1024.0

    def runner_step(model, scaler):  # stands for train_step: its `scaler` local, then the check
        step_mod.require_gradients(model)

    model = torch.nn.Linear(4, 1, bias=False)
    model.weight.grad = torch.full((1, 4), 512.0)  # norm 1024: the unscaled gradient's norm is 1
    with common.grad_norm_probe() as seen:
        runner_step(model, Scaler())
        model.weight.grad = torch.full((1, 4), 1.0)
        runner_step(model, None)  # a later step: not the first
    assert seen == {"first_step_grad_norm": pytest.approx(1.0)}


def test_a_parent_process_names_the_gpu_through_nvidia_smi(monkeypatch):
    """A process that never imported torch (a parent whose children measure) still names the card."""
    import subprocess
    import sys

    monkeypatch.delitem(sys.modules, "torch", raising=False)
    answer = subprocess.CompletedProcess([], 0, stdout="NVIDIA H200, 143771\nNVIDIA H200, 143771\n")
    monkeypatch.setattr(common.subprocess, "run", lambda *a, **k: answer)
    assert common.gpu_facts() == {"name": "NVIDIA H200", "total_memory_bytes": 143771 * 2**20, "count": 2,
                                  "source": "nvidia-smi"}

    def missing(*a, **k):
        raise FileNotFoundError("nvidia-smi")

    monkeypatch.setattr(common.subprocess, "run", missing)
    assert common.gpu_facts() is None  # no GPU here


def _calls(tree, name: str) -> list[ast.Call]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call) and
            (getattr(n.func, "id", None) == name or getattr(n.func, "attr", None) == name)]


def _writes_json_by_hand(tree) -> list[int]:
    """Lines where a file opened for appending gets `json.dumps(...)` written to it: a record bypassing
    write_record."""
    lines = []
    for w in ast.walk(tree):
        if not isinstance(w, ast.With):
            continue
        appending = any(isinstance(item.context_expr, ast.Call) and getattr(item.context_expr.func, "id", "") == "open"
                        and any(isinstance(a, ast.Constant) and a.value == "a" for a in item.context_expr.args[1:2])
                        for item in w.items)
        if appending:
            lines += [c.lineno for c in _calls(w, "write") if _calls(c, "dumps")]
    return lines


PEERLIB_ROUTES = {"write", "run_case", "record_whatever_happens"}
"""bench/peers/peerlib.py's functions that write a record, each through write_record (checked below)."""


def _peerlib_routes(tree) -> set[str]:
    return {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module == "bench.peers.peerlib"
            for a in n.names if a.name in PEERLIB_ROUTES}


@pytest.mark.parametrize("path", SCRIPTS, ids=[os.path.relpath(p, ROOT) for p in SCRIPTS])
def test_bench_scripts_write_records_through_write_record(path):
    name = os.path.basename(path)
    tree = ast.parse(open(path, encoding="utf-8").read())
    if name == "common.py":
        return
    by_hand = _writes_json_by_hand(tree)
    assert not by_hand, f"{name} appends JSON lines by hand at lines {by_hand}: use bench.common.write_record"
    calls = _calls(tree, "write_record")
    if name in TRAINING_SCRIPTS:
        assert calls or _peerlib_routes(tree), f"{name} runs training and writes its records without write_record"
        assert all(any(k.arg == "training" for k in c.keywords) for c in calls), \
            f"{name}: a training record is written without training= (its grad norm and loss trajectory)"


def test_peerlib_writes_training_records_through_write_record():
    """The peers' scripts write through peerlib.write, which passes their losses and first-step norm."""
    tree = ast.parse(open(os.path.join(ROOT, "bench", "peers", "peerlib.py"), encoding="utf-8").read())
    write = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "write")
    calls = _calls(write, "write_record")
    assert calls and all(any(k.arg == "training" for k in c.keywords) for c in calls)
    routes = {n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in PEERLIB_ROUTES - {"write"}}
    for fn in (n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in routes):
        assert _calls(fn, "write") or _calls(fn, "record_whatever_happens"), fn.name


# ---- end to end on the CPU: the norm is read where the runner checks its first step --------------------------------


def test_a_bench_training_record_carries_its_first_step_norm_and_losses(tmp_path):
    """bench/max_context.py on a tiny Llama: each record has provenance, a positive first-step gradient norm and
    one loss per step."""
    pytest.importorskip("torch")
    pytest.importorskip("peft")
    import subprocess
    import sys

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                               "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                               "vocab_size": 300, "max_position_embeddings": 4096}))
    out = tmp_path / "max_context.jsonl"
    subprocess.run([sys.executable, os.path.join(ROOT, "bench", "max_context.py"), "--stack", "fitune", "--model",
                    str(cfg), "--device", "cpu", "--cap", "", "--seqs", "64", "--steps", "2", "--out", str(out)],
                   check=True, cwd=ROOT, capture_output=True, text=True)
    (rec,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert set(PROVENANCE_KEYS) <= set(rec["provenance"]) and rec["provenance"]["commit"]
    assert rec["first_step_grad_norm"] > 0 and len(rec["loss_trajectory"]) == 2
    common.check_training(rec)


def test_a_fitune_train_child_reports_its_first_step_norm(tmp_path):
    """`probed_fitune_cmd`: `fitune train` in a child process writes its first step's gradient norm."""
    pytest.importorskip("torch")
    import subprocess

    import yaml

    from fitune.train.quickstart import write_quickstart

    config = write_quickstart(str(tmp_path / "q"))
    doc = yaml.safe_load(open(config))
    doc.update(max_steps=2, eval_every=None)
    doc["data"].pop("eval_path", None)
    with open(config, "w") as f:
        yaml.safe_dump(doc, f)
    probe = str(tmp_path / "norm.json")
    argv, env = common.probed_fitune_cmd(probe)
    subprocess.run([*argv, "train", config, "--no-progress"], env=env, check=True, capture_output=True, text=True)
    lines = [json.loads(x) for x in open(os.path.join(doc["output_dir"], "metrics.jsonl"))]
    facts = common.training_facts([x["loss"] for x in lines if "loss" in x], probe)
    common.check_training(facts)
    assert facts["first_step_grad_norm"] > 0 and len(facts["loss_trajectory"]) == 2

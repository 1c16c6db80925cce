"""Issue 32, Unsloth at its strongest (bench/peers/unsloth_run.py, bench/calls/issue32_unsloth.sh), on the CPU: the
new options' parsing and defaults (`--loop`, `--qlora`, `--lora-rank`, `--lora-targets` with `all-linear`), a run
where Unsloth cannot be imported is a record with `error` (the training record's rule kept), the plain loop's clock,
losses and first-step gradient norm on a tiny transformers + PEFT model (Unsloth's own model needs the GPU), and
bench/rank_check.py's `qlora_seeds` workload is a plan `fitune plan` makes."""

import importlib.util
import json
import os
import signal
import subprocess
import sys
from types import SimpleNamespace

import pytest

from bench.common import PROVENANCE_KEYS, check_training

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _load(name, path):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, *path.split("/")))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def ur():
    return _load("unsloth_run_under_test", "bench/peers/unsloth_run.py")


@pytest.fixture(scope="module")
def rank_check():
    return _load("rank_check_under_test", "bench/rank_check.py")


COMMON = ["--model-dir", "m", "--out", "o"]


def test_defaults_are_todays_sfttrainer_lora_r8_on_q_and_v(ur):
    args = ur.parse_args(COMMON)
    assert (args.loop, args.qlora, args.lora_rank, args.lora_targets) == ("sfttrainer", False, 8, ["q_proj", "v_proj"])
    assert (args.grad_checkpointing, args.micro_batch, args.grad_accum, args.case) == ("unsloth", 2, 1, None)
    assert ur.lora_config(args) == {"r": 8, "alpha": 16, "dropout": 0.0, "targets": ["q_proj", "v_proj"]}
    assert ur.LOOPS == {"sfttrainer": "SFTTrainer", "plain": "plain PyTorch loop"}


def test_plain_qlora_all_linear(ur):
    args = ur.parse_args([*COMMON, "--loop", "plain", "--qlora", "--lora-rank", "16", "--lora-targets", "all-linear",
                          "--grad-checkpointing", "none", "--micro-batch", "1", "--grad-accum", "2"])
    assert (args.loop, args.qlora, args.grad_checkpointing, args.micro_batch, args.grad_accum) == \
        ("plain", True, "none", 1, 2)
    assert ur.lora_config(args) == {"r": 16, "alpha": 32, "dropout": 0.0, "targets": ALL_LINEAR}
    assert ur.GC[args.grad_checkpointing] is False


@pytest.mark.parametrize("text, want", [("all-linear", ALL_LINEAR), (" all-linear ", ALL_LINEAR),
                                        ("q_proj,k_proj,v_proj,o_proj", ALL_LINEAR[:4]),
                                        ("v_proj, q_proj", ["v_proj", "q_proj"])])
def test_lora_targets(ur, text, want):
    assert ur.lora_targets(text) == want


@pytest.mark.parametrize("bad", [["--lora-targets", "qproj"], ["--lora-targets", ""],
                                 ["--lora-targets", "all-linear,lm_head"], ["--lora-rank", "0"],
                                 ["--loop", "trainer"], ["--grad-checkpointing", "full"]])
def test_refusals(ur, bad):
    with pytest.raises(SystemExit):
        ur.parse_args([*COMMON, *bad])


def _run_without_unsloth(tmp_path, *flags):
    out = tmp_path / "peers.jsonl"
    env = dict(os.environ, PYTHONPATH=ROOT, HF_HUB_OFFLINE="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "bench/peers/unsloth_run.py", "--model-dir", str(tmp_path / "no_model"),
                           "--out", str(out), "--device", "cpu", "--cap", "", "--steps", "2", *flags],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (rec,) = [json.loads(x) for x in out.read_text().splitlines() if x.strip()]
    assert rec["stack"] == "unsloth" and rec["fits"] is None and rec["tokens_per_s"] is None
    assert rec["error"].startswith("ModuleNotFoundError") and "unsloth" in rec["error"]
    assert rec["imported_before_unsloth"] == []  # nothing Unsloth patches was imported before it
    check_training(rec)  # a training record: no first step, so the norm is None with the reason, no losses
    assert rec["first_step_grad_norm"] is None and rec["loss_trajectory"] == []
    assert set(PROVENANCE_KEYS) <= set(rec["provenance"])
    return rec


@pytest.fixture
def no_unsloth():
    if importlib.util.find_spec("unsloth") is not None:
        pytest.skip("unsloth imports here")


def test_plain_qlora_run_without_unsloth_is_a_record_with_error(tmp_path, no_unsloth):
    rec = _run_without_unsloth(tmp_path, "--loop", "plain", "--qlora", "--lora-rank", "16", "--lora-targets",
                               "all-linear", "--grad-checkpointing", "none", "--micro-batch", "1", "--grad-accum", "2",
                               "--case", "unsloth_plain_qlora_nogc_m1a2")
    assert (rec["loop"], rec["method"], rec["case"]) == ("plain PyTorch loop", "qlora", "unsloth_plain_qlora_nogc_m1a2")
    assert rec["lora"] == {"r": 16, "alpha": 32, "dropout": 0.0, "targets": ALL_LINEAR}
    assert (rec["grad_checkpointing"], rec["micro_batch_size"], rec["grad_accum"]) == ("none", 1, 2)


def test_default_run_without_unsloth_keeps_todays_record(tmp_path, no_unsloth):
    rec = _run_without_unsloth(tmp_path)
    assert (rec["loop"], rec["method"], rec["optim"]) == ("SFTTrainer", "lora", "adamw_torch")
    assert rec["lora"] == {"r": 8, "alpha": 16, "dropout": 0.0, "targets": ["q_proj", "v_proj"]}
    assert "case" not in rec


def test_plain_loop_times_steps_and_records_losses_and_first_norm(ur, tiny_model, tmp_path):
    """The loop itself on a tiny transformers + PEFT Llama (what `--loop plain` runs after Unsloth's setup), through
    peerlib.run_case: one timed step per optimizer step, a loss per step, the first step's norm, a valid record."""
    torch = pytest.importorskip("torch")
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from bench.peers.peerlib import load_rows, run_case

    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    model.train()
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    args = SimpleNamespace(model_dir=str(tiny_model), out=str(tmp_path / "r.jsonl"), device="cpu", cap="",
                           grad_checkpointing="none", micro_batch=1, grad_accum=2, steps=3)
    rows = load_rows(str(tiny_model))
    sigterm = signal.getsignal(signal.SIGTERM)  # run_case installs its own handler: give pytest its own back
    try:
        rec = run_case("unsloth", args, lambda rec, clock: ur.unsloth_plain_loop(args, rec, clock, model, rows),
                       loop=ur.LOOPS["plain"])
    finally:
        signal.signal(signal.SIGTERM, sigterm)
    assert rec["fits"] is True and rec["steps_done"] == 3, rec.get("error")
    assert rec["tokens_per_step"] == 2 * rows.shape[1] and rec["tokens_per_s"] > 0
    assert rec["optim"] == "adamw_torch"  # fused only on CUDA
    (line,) = [json.loads(x) for x in open(args.out)]
    check_training(line)
    assert line["first_step_grad_norm"] > 0 and len(line["loss_trajectory"]) == 3
    assert all(0 < x < 20 for x in line["loss_trajectory"])  # the mean of two micro-batches' token losses
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters() if p.requires_grad)


def test_qlora_seeds_is_a_call_workload(rank_check):
    assert rank_check.CALL_WORKLOADS["qlora_seeds"] == [
        "llama-3.1-8b", "--gpu", "rtx4090", "--seq-len", "2048", "--batch-size", "2", "--method", "qlora",
        "--lora-rank", "16", "--lora-targets", "all-linear"]
    assert "qlora_seeds" not in rank_check.WORKLOADS  # issue 12's record (tests/test_rank_check.py) is its own
    assert rank_check.ALL_WORKLOADS == {**rank_check.WORKLOADS, **rank_check.CALL_WORKLOADS}


def test_qlora_seeds_is_a_valid_plan(rank_check, capsys):
    from fitune.cli.main import main

    assert main(["plan", *rank_check.ALL_WORKLOADS["qlora_seeds"], "--top", "3", "--json"]) == 0
    plans = json.loads(capsys.readouterr().out)["plans"]
    assert plans and plans[0]["fits"] and plans[0]["runnable"]
    for p in plans:
        s = p["setup"]
        assert (s["method"], s["lora_rank"], s["lora_targets"], s["seq_len_tokens"]) == \
            ("qlora", 16, ["all-linear"], 2048)
        assert s["batch_size"] * s["grad_accum"] == 2


def test_rank_check_trains_plan_1_only_of_a_call_workload():
    env = dict(os.environ, PYTHONPATH=ROOT)
    run = lambda *a: subprocess.run([sys.executable, "bench/rank_check.py", *a], cwd=ROOT, env=env,  # noqa: E731
                                    capture_output=True, text=True, timeout=60)
    helped = run("--help")
    assert helped.returncode == 0 and "qlora_seeds" in helped.stdout and "--plans" in helped.stdout
    refused = run("--out", "x", "--workload", "qlora_seeds", "--plans", "0")
    assert refused.returncode == 2 and "--plans" in refused.stderr


def _dispatch(env: dict) -> list[str]:
    """The call script's case table and order run with its three runners replaced by `echo`: what it would run."""
    text = open(os.path.join(ROOT, "bench", "calls", "issue32_unsloth.sh"), encoding="utf-8").read()
    table = text[text.index("run_named() {"):text.index("for f in \"$LOGS\"/*.log")]
    stubs = ("QLORA=(--qlora --lora-rank 16 --lora-targets all-linear)\n"
             "fitune_case() { echo \"fitune $*\"; }\nunsloth_case() { echo \"unsloth $*\"; }\n"
             "hf_loop_case() { echo \"hf_loop $*\"; }\n")
    proc = subprocess.run(["bash", "-c", stubs + table], capture_output=True, text=True,
                          env={"PATH": os.environ["PATH"], **env})
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()


def test_the_call_script_parses_and_runs_its_cases_in_order():
    path = os.path.join(ROOT, "bench", "calls", "issue32_unsloth.sh")
    assert subprocess.run(["bash", "-n", path], capture_output=True).returncode == 0
    text = open(path, encoding="utf-8").read()
    assert [line.split()[1] for line in _dispatch({})] == [
        "fitune_seeds", "unsloth_plain_lora_nogc_m1a2", "fitune_qlora_seeds", "unsloth_sft_qlora_gc_m2",
        "unsloth_plain_qlora_nogc_m1a2", "unsloth_plain_qlora_gc_m2", "unsloth_plain_lora_nogc_m2"]
    assert "PEERS_BUDGET_S:-560" in text and "probe_setup" in text


def test_the_call_script_runs_a_named_order_with_repeats_and_variants():
    lines = _dispatch({"U32_ORDER": "fitune_qlora_seeds,unsloth_plain_qlora_nogc_m1a2-r2,fitune_qlora_sel3,"
                                    "hf_loop_liger_m1a2,fitune_qlora_m1a2"})
    assert lines[0] == "fitune fitune_qlora_seeds qlora_seeds"
    assert lines[1].startswith("unsloth unsloth_plain_qlora_nogc_m1a2-r2 --loop plain --qlora")  # a repeat, same flags
    assert lines[2] == ("fitune fitune_qlora_sel3 qlora_seeds --set batch_size=2 --set grad_accum=1 "
                        "--set grad_checkpointing=selective:3 --set optimizer=adamw8bit")
    assert lines[3] == "hf_loop hf_loop_liger_m1a2 --liger --grad-checkpointing none --micro-batch 1 --grad-accum 2"
    assert "--set batch_size=1 --set grad_accum=2" in lines[4]

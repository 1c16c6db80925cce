"""bench/peers/real_length.py's peer setups on the CPU (issue 32: each peer at its strongest setup): the TRL / HF
flags (--grad-checkpointing, --liger) reach the trainer and the record, the unsloth_packing stack is dispatched and
writes a record with `error` where Unsloth cannot be imported, and the fitune stack records its plan's estimate.
Training TRL's packed SFTTrainer (its fused LM head needs Triton), Liger and Unsloth needs the GPU
(bench/calls/issue32_real.sh)."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PEERS_SITE = os.path.join(ROOT, ".peers_site")


def _load():
    spec = importlib.util.spec_from_file_location("real_length_stacks", os.path.join(ROOT, "bench", "peers",
                                                                                     "real_length.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _py(args, pythonpath=ROOT, timeout=120):
    env = dict(os.environ, PYTHONPATH=pythonpath, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="")
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def _run(stack, model, tmp_path, *flags, pythonpath=ROOT, examples=64):
    out = tmp_path / f"{stack}.jsonl"
    proc = _py(["bench/peers/real_length.py", "--stack", stack, "--model-dir", str(model), "--out", str(out),
                "--device", "cpu", "--cap", "", "--steps", "2", "--examples", str(examples), "--max-length", "512",
                "--work", str(tmp_path / "work"), *flags], pythonpath=pythonpath)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (rec,) = [json.loads(x) for x in out.read_text().splitlines() if x.strip()]
    return rec


def test_stack_flags_defaults_and_refusals():
    rl = _load()
    common = ["--model-dir", "m", "--out", "o"]
    assert "unsloth_packing" in rl.STACKS and rl.LOOPS["unsloth_packing"] == "Unsloth SFTTrainer"
    for stack, gc, micro in (("hf_trainer", "on", 4), ("trl_packing", "on", 2), ("unsloth_packing", "unsloth", 2),
                             ("fitune", None, None)):
        args = rl.parse_args(["--stack", stack, *common])
        assert (args.grad_checkpointing, args.micro_batch, args.grad_accum, args.liger) == (gc, micro, 1, False)
    args = rl.parse_args(["--stack", "trl_packing", "--grad-checkpointing", "off", "--liger", "--micro-batch", "1",
                          "--grad-accum", "2", *common])
    assert (args.grad_checkpointing, args.liger, args.micro_batch, args.grad_accum) == ("off", True, 1, 2)
    assert rl.UNSLOTH_GC == {"unsloth": "unsloth", "off": False, "on": True}
    for bad in (["--stack", "fitune", "--liger"], ["--stack", "fitune", "--grad-checkpointing", "off"],
                ["--stack", "trl_packing", "--grad-checkpointing", "unsloth"],
                ["--stack", "unsloth_packing", "--liger"]):
        with pytest.raises(SystemExit):
            rl.parse_args([*bad, *common])


def test_hf_trainer_without_checkpointing_says_so(tiny_model, tmp_path):
    rec = _run("hf_trainer", tiny_model, tmp_path, "--grad-checkpointing", "off", "--micro-batch", "1",
               "--grad-accum", "2")
    assert rec["fits"] is True and rec["steps_done"] == 2, rec.get("error")
    assert rec["setup"]["gradient_checkpointing"] is False and rec["setup"]["use_liger_kernel"] is False
    assert rec["grad_checkpointing"] == "off" and rec["liger"] is False
    assert (rec["micro_batch_size"], rec["grad_accum"]) == (1, 2)
    assert all(padded <= 2 * 512 for padded, _, _ in rec["step_tokens"])  # 2 micro-batches of 1 row each


@pytest.fixture(scope="module")
def trl_path(tmp_path_factory):
    """A folder with only .peers_site's TRL on it (its other packages are Python 3.12 builds, or other versions of
    what this interpreter has)."""
    found = [n for n in (os.listdir(PEERS_SITE) if os.path.isdir(PEERS_SITE) else [])
             if n == "trl" or (n.startswith("trl-") and n.endswith(".dist-info"))]
    if "trl" not in found and importlib.util.find_spec("trl") is None:
        pytest.skip("TRL is neither installed nor in .peers_site")
    folder = tmp_path_factory.mktemp("trl_only")
    for name in found:
        os.symlink(os.path.join(PEERS_SITE, name), folder / name)
    path = ROOT + os.pathsep + str(folder)
    proc = _py(["-c", "from trl import SFTConfig, SFTTrainer"], pythonpath=path)
    if proc.returncode != 0:
        pytest.skip(f"TRL does not import here: {proc.stderr.strip().splitlines()[-1:]}")
    return path


@pytest.mark.parametrize("flags, gc, liger", [((), True, False),
                                              (("--grad-checkpointing", "off", "--liger", "--micro-batch", "1",
                                                "--grad-accum", "2"), False, True)])
def test_trl_packing_flags_reach_the_config(tiny_model, tmp_path, trl_path, flags, gc, liger):
    """The record's setup is read off the built SFTTrainer's config; on the CPU training itself may fail (TRL
    1.15's fused LM head needs Triton, --liger needs liger-kernel): the setup is recorded before."""
    rec = _run("trl_packing", tiny_model, tmp_path, *flags, pythonpath=trl_path)
    setup = rec["setup"]
    assert setup["packing"] is True and setup["padding_free"] is True, rec.get("error")
    assert setup["gradient_checkpointing"] is gc and setup["use_liger_kernel"] is liger
    assert rec["grad_checkpointing"] == ("on" if gc else "off") and rec["liger"] is liger
    if liger:  # TRL keeps its fused LM head: Liger's layer kernels only
        assert setup["liger_kernel_config"] == {"fused_linear_cross_entropy": False}
        assert (rec["micro_batch_size"], rec["grad_accum"]) == (1, 2)
    assert rec["fits"] is True or rec["error"]


def test_unsloth_packing_is_a_record_with_error_where_unsloth_does_not_import(tmp_path):
    if importlib.util.find_spec("unsloth") is not None:
        pytest.skip("unsloth imports here")
    rec = _run("unsloth_packing", tmp_path / "no_model", tmp_path, "--grad-checkpointing", "off", "--micro-batch",
               "1", "--grad-accum", "2", examples=16)
    assert rec["stack"] == "unsloth_packing" and rec["loop"] == "Unsloth SFTTrainer"
    assert rec["fits"] is None and rec["error"].startswith("ModuleNotFoundError") and "unsloth" in rec["error"]
    assert rec["imported_before_unsloth"] == []  # nothing Unsloth patches was imported before it
    assert (rec["grad_checkpointing"], rec["micro_batch_size"], rec["grad_accum"]) == ("off", 1, 2)
    assert rec["tokens_per_s"] is None and rec["data"]["examples"] == 16


def test_fitune_stack_records_its_plans_estimate(tiny_model, tmp_path):
    rec = _run("fitune", tiny_model, tmp_path)
    assert rec["fits"] is True and rec["stream_matches_metrics"] is True, rec.get("error")
    assert rec["estimate_exit"] == 0 and "estimate_error" not in rec
    assert 0 < rec["estimate_allocated_bytes"] <= rec["estimate_reserved_bytes"]


def test_fitune_estimate_failure_is_a_note_not_a_failure(tmp_path):
    rl = _load()
    env = dict(os.environ, PYTHONPATH=ROOT, CUDA_VISIBLE_DEVICES="")
    out = rl.fitune_estimate([sys.executable, "-m", "fitune"], str(tmp_path / "missing.yaml"), "rtx4090", env)
    assert out["estimate_allocated_bytes"] is None and out["estimate_reserved_bytes"] is None
    assert out["estimate_error"]
    out = rl.fitune_estimate([sys.executable, "-c", "raise SystemExit(3)"], "x", "rtx4090", env)
    assert out["estimate_allocated_bytes"] is None and "exit 3" in out["estimate_error"]

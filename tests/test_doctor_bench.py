"""bench/doctor_scripts.py runs forum scripts as written with random weights: its machinery on the CPU with a tiny
model (the GPU measurement itself is run by hand; see the script's docstring)."""

import importlib.util
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FORUM = os.path.join(ROOT, "tests", "fixtures", "doctor", "forum")
BENCH = os.path.join(ROOT, "bench", "doctor_scripts.py")


def bench():
    spec = importlib.util.spec_from_file_location("doctor_scripts", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_synthetic_text_is_exactly_the_recovered_length_and_pads_like_the_family():
    b = bench()
    rows = b.synthetic_rows(3, 300)
    llama, qwen = b.synthetic_tokenizer("llama"), b.synthetic_tokenizer("qwen2")
    assert len(llama(rows["text"][0], add_special_tokens=False)["input_ids"]) == 300
    assert llama.pad_token is None and qwen.pad_token == "<pad>"
    with pytest.raises(ValueError, match="Asking to pad but the tokenizer does not have a padding token"):
        llama(rows["text"][:2], padding=True)


def test_shim_dataset_does_what_forum_scripts_ask():
    b = bench()
    ds = b.ShimDataset(b.synthetic_rows(4, 8))
    tok = b.synthetic_tokenizer("qwen2")
    mapped = ds.map(lambda x: tok(x["text"], truncation=True, max_length=5), batched=True,
                    remove_columns=ds.column_names)
    assert mapped.column_names == ["input_ids", "attention_mask"] and len(mapped) == 4
    mapped.set_format("torch")
    assert tuple(mapped[0]["input_ids"].shape) == (5,)
    one = ds.map(lambda x: {"n": len(x["text"])})
    assert one["n"] == [len(ds["text"][0])] * 4 and "text" in one.column_names


def test_tiny_config_keeps_the_architecture():
    cfg = bench().model_config("qwen2.5-7b", tiny=True)
    assert cfg["model_type"] == "qwen2" and cfg["num_hidden_layers"] == 2 and cfg["vocab_size"] > 1004


@pytest.mark.slow
def test_runs_a_forum_loop_as_written_on_the_cpu(tmp_path):
    """The keep-outputs loop, run as written (2 optimizer steps of a 2-layer Llama), one JSON line per script, each
    script in its own subprocess; the pad-token script fails the way the real one does."""
    out = tmp_path / "doctor_scripts.jsonl"
    scripts = [os.path.join(FORUM, "loop_llama_keep_outputs.py"), os.path.join(FORUM, "trainer_mistral_no_pad.py")]
    recs = bench().run_all(scripts, str(out), 600, ["--steps", "2", "--cap", "none", "--device", "cpu", "--tiny"])
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert lines == recs and len(lines) == 2
    loop, pad = lines
    assert loop["status"] == "ok" and loop["steps"] == 2 and loop["oom"] is False and loop["error"] is None
    assert loop["model"] == "llama-3.1-8b" and loop["setup"]["keep_outputs"] is True
    assert loop["setup"]["seq_len_tokens"] == 2048 and loop["estimate"]["fits"] is not None
    assert set(loop["estimate"]) == {"gpu", "peak_allocated_bytes", "peak_reserved_bytes", "fits", "retries_expected"}
    assert pad["status"] == "error" and "Asking to pad" in pad["error"]


def test_a_script_past_its_time_limit_is_recorded(tmp_path):
    script = tmp_path / "slow.py"
    script.write_text("import time\ntime.sleep(60)\n")
    out = tmp_path / "o.jsonl"
    (rec,) = bench().run_all([str(script)], str(out), 1, ["--device", "cpu", "--tiny"])
    assert rec["status"] == "timeout" and json.loads(out.read_text())["status"] == "timeout"


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")
def test_seeds_script_under_a_24gb_cap_on_the_gpu(tmp_path):  # pragma: no cover - GPU only
    out = tmp_path / "gpu.jsonl"
    (rec,) = bench().run_all([os.path.join(FORUM, "trainer_llama_seeds.py")], str(out), 1200,
                             ["--steps", "3", "--cap", "rtx4090", "--device", "cuda"])
    assert rec["status"] in ("ok", "oom") and rec["peak_allocated_bytes"] > 0
    assert sys.executable

"""`fitune doctor SCRIPT` reads the script's own setup: ten scripts written the way forum posters write them
(tests/fixtures/doctor/forum/, each with its expected setup beside it), the estimate of that setup on a GPU, the
fixes tied to the script's lines, and the JSON document."""

import ast
import json
import os

import pytest

from fitune.cli.main import main
from fitune.doctor.extract import SCRIPT_FIELDS, catalog_model, extract_setup
from fitune.doctor.index import ScriptIndex
from fitune.doctor.script import read_script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FORUM = os.path.join(ROOT, "tests", "fixtures", "doctor", "forum")
SCRIPTS = sorted(f for f in os.listdir(FORUM) if f.endswith(".py"))


def forum(name: str) -> str:
    return os.path.join(FORUM, name)


def extract(source: str, **kw):
    return extract_setup(ScriptIndex.build(ast.parse(source)), **kw)


def expected(name: str) -> dict:
    with open(forum(name[:-3] + ".json"), encoding="utf-8") as f:
        return json.load(f)


def test_ten_forum_scripts_each_with_its_expected_setup():
    assert len(SCRIPTS) >= 10
    styles = {extract(read_script(forum(n))).style for n in SCRIPTS}
    assert styles == {"trainer", "sft", "loop", "unsloth"}
    models = {expected(n)["model"] for n in SCRIPTS}
    assert {"llama-3.1-8b", "qwen2.5-7b"} <= models and any(m.startswith("mistral-7b") for m in models)


@pytest.mark.parametrize("name", SCRIPTS)
def test_recovered_setup_matches_every_field_the_script_states(name):
    exp = expected(name)
    ss = extract(read_script(forum(name)))
    got = ss.setup.to_dict()
    assert ss.model == exp["model"] and ss.model_known
    for field, value in exp["setup"].items():
        assert got[field] == value, f"{name}: {field}"
        assert ss.fields[field].origin == "script", f"{name}: {field} should be read from the script"
        assert ss.fields[field].lines, f"{name}: {field} cites no line"
    for field, value in exp["assumed"].items():
        assert got[field] == value, f"{name}: assumed {field}"
        assert ss.fields[field].assumed and ss.fields[field].flag.startswith("--")
    stated_or_assumed = set(exp["setup"]) | set(exp["assumed"])
    assert stated_or_assumed == set(SCRIPT_FIELDS), f"{name}: the JSON covers every field"


def test_lines_point_at_the_values():
    path = forum("trainer_llama_r256.py")
    lines = read_script(path).splitlines()
    ss = extract(read_script(path))
    assert "default=256" in lines[ss.fields["lora_rank"].lines[0] - 1]  # the argparse default holds the value
    assert "max_length=args.max_length" in lines[ss.fields["seq_len_tokens"].lines[-1] - 1]
    assert "per_device_train_batch_size=2" in lines[ss.fields["batch_size"].lines[0] - 1]
    assert ss.to_dict()["lines"]["model"] == [10, 19]


@pytest.mark.parametrize("model_id, name", [
    ("meta-llama/Llama-3.1-8B", "llama-3.1-8b"),
    ("meta-llama/Meta-Llama-3.1-8B-Instruct", "llama-3.1-8b"),
    ("unsloth/Meta-Llama-3.1-8B-bnb-4bit", "llama-3.1-8b"),
    ("mistralai/Mistral-7B-Instruct-v0.3", "mistral-7b"),
    ("mistralai/Mistral-7B-v0.1", "mistral-7b-v0.1"),
    ("Qwen/Qwen2.5-7B-Instruct", "qwen2.5-7b"),
    ("NousResearch/Llama-2-7b-hf", "llama-2-7b"),
    ("google/gemma-2-9b-it", "gemma-2-9b"),
    ("./my-model", None),
])
def test_catalog_model_tolerates_hub_suffixes(model_id, name):
    assert catalog_model(model_id) == name


HEAD = ("import torch\nfrom transformers import AutoModelForCausalLM\n"
        "model = AutoModelForCausalLM.from_pretrained('meta-llama/Llama-3.1-8B', dtype=torch.bfloat16)\n"
        "model.train()\n")


@pytest.mark.parametrize("loop, kept", [
    ("for b in loader:\n    out = model(**b)\n    out.loss.backward()\n", True),
    ("for b in loader:\n    out = model(**b)\n    loss = out.loss\n    loss.backward()\n", True),
    ("for b in loader:\n    out = model(**b)\n    loss = out.loss / 4\n    loss.backward()\n", True),
    ("for b in loader:\n    out = model(**b)\n    loss = out.loss\n    del out\n    loss.backward()\n", False),
    ("for b in loader:\n    loss = model(**b).loss\n    loss.backward()\n", False),
    ("for b in loader:\n    model(**b).loss.backward()\n", False),
])
def test_keep_outputs_follows_the_output_variable(loop, kept):
    ss = extract(HEAD + loop)
    assert ss.setup.keep_outputs is kept and ss.fields["keep_outputs"].origin == "script"


def test_plain_loop_pieces():
    src = HEAD + ("import bitsandbytes as bnb\nfrom torch.utils.data import DataLoader\nGRAD_ACCUM = 8\n"
                  "loader = DataLoader(ds, batch_size=4)\nopt = bnb.optim.AdamW8bit(model.parameters())\n"
                  "model.gradient_checkpointing_enable()\n"
                  "for b in loader:\n    model(**b).loss.backward()\n")
    s = extract(src).setup
    assert (s.batch_size, s.grad_accum, s.optimizer, s.grad_checkpointing, s.method) == (4, 8, "adamw8bit", "full",
                                                                                          "full")


def test_checkpointing_without_train_mode_is_estimated_as_none():
    src = HEAD.replace("model.train()\n", "") + "model.gradient_checkpointing_enable()\nmodel(**b).loss.backward()\n"
    ss = extract(src)
    assert ss.setup.grad_checkpointing == "none" and "eval mode" in ss.fields["grad_checkpointing"].why


def test_library_defaults_are_assumed_and_named():
    src = ("from transformers import AutoModelForCausalLM, Trainer, TrainingArguments\nfrom trl import SFTConfig\n"
           "model = AutoModelForCausalLM.from_pretrained('Qwen/Qwen2.5-7B')\n"
           "Trainer(model=model, args=SFTConfig(output_dir='o')).train()\n")
    ss = extract(src)
    f = ss.fields
    assert (ss.setup.batch_size, ss.setup.seq_len_tokens, ss.setup.dtype) == (8, 1024, "bf16")
    assert f["batch_size"].origin == "library" and "default" in f["batch_size"].why
    assert f["seq_len_tokens"].flag == "--seq-len" and f["batch_size"].flag == "--batch-size"
    assert "transformers 5 loads the checkpoint's dtype" in f["dtype"].why


def test_flags_override_the_script_and_an_unknown_model_is_assumed():
    src = HEAD.replace("meta-llama/Llama-3.1-8B", "./my-finetune") + "model(**b).loss.backward()\n"
    ss = extract(src)
    assert not ss.model_known and ss.model == "llama-3.1-8b" and ss.fields["model"].flag == "--model"
    ss = extract(src, overrides={"seq_len_tokens": 4096}, model_override="qwen2.5-7b")
    assert ss.model == "qwen2.5-7b" and ss.model_known and ss.setup.seq_len_tokens == 4096
    assert ss.fields["seq_len_tokens"].origin == "flag"


def test_targets_the_model_lacks_are_dropped_with_a_note():
    src = HEAD + "from peft import LoraConfig\nLoraConfig(r=8, target_modules=['q_proj', 'query_key_value'])\n"
    ss = extract(src)
    assert ss.setup.lora_targets == ("q_proj",) and any("query_key_value" in n for n in ss.notes)


# ---- the command line ----------------------------------------------------------------------------------------------
def test_seeds_script_prints_setup_estimate_and_fixes(capsys):
    assert main(["doctor", forum("trainer_llama_seeds.py"), "--gpu", "rtx4090"]) == 0  # no error finding
    out = capsys.readouterr().out
    assert "as written (trainer script)" in out
    assert "LoRA rank                8                            line 17" in out
    assert "peak allocated            21.99 GiB" in out  # the measured seeds' case: 21.99 GiB (docs/accuracy.md)
    assert "FITS ONLY WITH ALLOCATOR RETRIES" in out
    assert "line 38: per_device_train_batch_size=2 -> per_device_train_batch_size=1" in out
    assert "line 39: gradient_accumulation_steps=8 -> gradient_accumulation_steps=16" in out
    assert "tokens/s" in out and "fitune plan llama-3.1-8b --gpu rtx4090" in out


def test_r256_script_does_not_fit_and_every_fix_fits(capsys):
    assert main(["doctor", forum("trainer_llama_r256.py"), "--gpu", "rtx4090", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    est = doc["estimate"]
    assert est["fits"] is False and est["setup"]["lora_rank"] == 256 and est["setup"]["seq_len_tokens"] == 4096
    assert doc["setup"]["lines"]["lora_rank"] == [13, 23] and "attn" in doc["setup"]["assumed"]
    assert doc["setup"]["assumed"]["optimizer"]["flag"] == "--optimizer"
    assert doc["fixes"] and all(f["fits"] for f in doc["fixes"])
    assert all(f["peak_allocated_bytes"] <= est["gpu"]["allocator_budget_bytes"] for f in doc["fixes"])
    assert all(f["edits"] and f["edits"][0].startswith("line ") for f in doc["fixes"])
    assert not doc["fixes"][0]["retries_expected"]  # ranked: no allocator retries first
    rules = {f["rule"] for f in doc["findings"]}
    assert "lora-rank-large" in rules
    all_linear = next(f for f in doc["findings"] if f["rule"] == "lora-all-linear")
    assert "this script's step (llama-3.1-8b, LoRA r256 on all-linear, 2 x 4096 tokens" in all_linear["evidence"]


def test_keep_outputs_script_finding_and_fix(capsys):
    assert main(["doctor", forum("loop_llama_keep_outputs.py"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["gpu"] == "rtx4090" and doc["setup"]["keep_outputs"] is True
    kept = next(f for f in doc["findings"] if f["rule"] == "outputs-kept-through-backward")
    assert kept["line"] == 33 and "2 x 2048 x 128,256 x 2 bytes = 0.98 GiB" in kept["message"]
    assert "as written" in kept["evidence"] and "with the output freed before backward" in kept["evidence"]


def test_missing_pad_token_is_an_error_exit_1(capsys):
    assert main(["doctor", forum("trainer_mistral_no_pad.py")]) == 1
    out = capsys.readouterr().out
    assert "error [missing-pad-token]" in out and "DOES NOT FIT" in out
    assert "line 15: default=1024" in out or "line 14: default=2" in out  # the argparse defaults are the lines


def test_setup_flags_override_the_script(capsys):
    assert main(["doctor", forum("trainer_llama_seeds.py"), "--seq-len", "1024", "--lora-rank", "16", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["setup"]["seq_len_tokens"] == 1024 and doc["setup"]["lora_rank"] == 16
    assert doc["setup"]["origin"]["seq_len_tokens"] == "flag" and doc["estimate"]["retries_expected"] is False


def test_bad_setup_flag_exits_2(capsys):
    assert main(["doctor", forum("trainer_llama_seeds.py"), "--attn", "flashy"]) == 2
    assert "--attn 'flashy' is not one of" in capsys.readouterr().err


def test_script_without_a_model_gets_no_estimate(tmp_path, capsys):
    path = tmp_path / "train.py"
    path.write_text("import torch\nloss = torch.zeros(1, requires_grad=True)\nloss.backward()\n")
    assert main(["doctor", str(path)]) == 0
    assert "no model load found, so no estimate" in capsys.readouterr().out
    assert main(["doctor", str(path), "--model", "qwen2.5-7b", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["estimate"]["model"] == "qwen2.5-7b"

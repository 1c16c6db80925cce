"""Issue 31: `fitune train OTHER.yaml --translate` says everything it changed (the method carried, quantized loading,
optimizers of the same precision, "not set" sentinels, train_on_inputs), its "to fix" list names every missing
piece at once, a foreign config given to `train` / `estimate --config` gets one line pointing to --translate and at
most five problems, and `fitune train` runs from flags alone. No torch needed, except the one run from flags."""

from __future__ import annotations

import json

import pytest
import yaml

from fitune.cli.main import main
from fitune.translate import translate, translate_doc, translated_yaml

HF_YAML = """\
model_name_or_path: meta-llama/Llama-3.1-8B
learning_rate: 2.0e-5
per_device_train_batch_size: 2
max_steps: -1
num_train_epochs: 3
bf16: true
optim: paged_adamw_32bit
gradient_checkpointing: true
"""

AXO_YAML = """\
base_model: meta-llama/Llama-3.1-8B
load_in_8bit: true
adapter: lora
lora_r: 16
lora_alpha: 32
lora_target_linear: true
sequence_len: 2048
micro_batch_size: 2
train_on_inputs: false
optimizer: paged_adamw_32bit
learning_rate: 0.0002
datasets:
  - path: data.jsonl
    type: alpaca
wandb_project: x
"""

CHAT_ROW = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


@pytest.fixture
def files(tmp_path, monkeypatch):
    """hf.yaml and axo.yaml as the issue gives them, in the working folder, with the data.jsonl axo.yaml names."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)  # the Hub id stays a valid model without its download
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    (tmp_path / "hf.yaml").write_text(HF_YAML)
    (tmp_path / "axo.yaml").write_text(AXO_YAML)
    (tmp_path / "data.jsonl").write_text(json.dumps(CHAT_ROW) + "\n")
    return tmp_path


def _translated(main_args, capsys) -> tuple[str, dict]:
    assert main(main_args) == 0
    text = capsys.readouterr().out
    return text, yaml.safe_load(text)


# ---- 1. the method is carried -------------------------------------------------------------------------------------


def test_hf_config_without_peft_keys_is_a_full_fine_tune_and_says_so(files, capsys):
    text, out = _translated(["train", "hf.yaml", "--translate"], capsys)
    assert out["method"] == "full" and "lora" not in out
    assert ("# carried over, method: full: no PEFT keys: a full fine-tune, as in the source; add lora keys for LoRA"
            in text)


@pytest.mark.parametrize("extra, method", [
    ({"use_peft": True}, "lora"),
    ({"lora_r": 16}, "lora"),
    ({"peft_config": {"r": 32, "lora_alpha": 64, "task_type": "CAUSAL_LM"}}, "lora"),
    ({"use_peft": False, "lora_r": 16}, "full"),
    ({"use_peft": True, "load_in_4bit": True}, "qlora"),
])
def test_hf_peft_keys_carry_the_method(extra, method):
    t = translate_doc({"model_name_or_path": "m", **extra})
    assert t.config["method"] == method
    assert not any("no PEFT keys" in n for n in t.changed)
    if "peft_config" in extra:
        assert t.config["lora"] == {"rank": 32, "alpha": 64}


@pytest.mark.parametrize("adapter, load_in_4bit, method", [("lora", False, "lora"), ("qlora", True, "qlora"),
                                                           ("lora", True, "qlora")])
def test_axolotl_adapter_carries_the_method(adapter, load_in_4bit, method):
    t = translate_doc({"base_model": "m", "adapter": adapter, "load_in_4bit": load_in_4bit, "num_epochs": 1})
    assert t.config["method"] == method
    if adapter == "lora" and load_in_4bit:
        assert "load_in_4bit: true -> method: qlora: LoRA on 4-bit (NF4) base weights" in t.changed


def test_torchtune_builder_name_carries_the_method():
    assert translate_doc({"model": {"_component_": "torchtune.models.llama3_1.llama3_1_8b"}}).config["method"] == "full"
    assert translate_doc({"model": {"_component_": "torchtune.models.llama3_1.qlora_llama3_1_8b"}}).config[
        "method"] == "qlora"


# ---- 2. 8-bit loading ---------------------------------------------------------------------------------------------


def test_load_in_8bit_stays_lora_in_bf16_and_says_the_weight_memory(files, capsys):
    text, out = _translated(["train", "axo.yaml", "--translate"], capsys)
    assert out["method"] == "lora" and out["lora"] == {"rank": 16, "alpha": 32, "targets": ["all-linear"]}
    assert ("# carried over, load_in_8bit: true -> method: lora with the weights in bf16: fitune has no 8-bit base "
            "weights; about 1.8x the 8-bit weight memory (14.96 GiB vs 8.46 GiB for llama-3.1-8b in fitune's "
            "catalog); method: qlora (4-bit NF4) takes less than 8-bit: 5.31 GiB") in text


def test_load_in_8bit_of_a_model_the_catalog_does_not_know_says_the_ratio():
    t = translate_doc({"base_model": "./my-model", "load_in_8bit": True, "adapter": "lora", "num_epochs": 1})
    assert t.config["method"] == "lora"
    assert any("about 2x the 8-bit weight memory (2 bytes a weight instead of 1)" in n for n in t.changed)


# ---- 3. optimizers ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("optim, fitune, said", [
    ("paged_adamw_32bit", "adamw", "paging dropped"),
    ("adamw_torch", "adamw", None),
    ("adamw_torch_fused", "adamw", "the same AdamW update and 32-bit states"),
    ("adamw_hf", "adamw", None),
    ("adamw_apex_fused", "adamw", "the same AdamW update and 32-bit states"),
    ("adamw_8bit", "adamw8bit", None),
    ("adamw_bnb_8bit", "adamw8bit", None),
    ("paged_adamw_8bit", "paged_adamw8bit", None),
    ("adafactor", "adafactor", None),
    ("sgd", "sgd", None),
])
def test_optimizers_map_to_the_same_precision(optim, fitune, said):
    t = translate_doc({"model_name_or_path": "m", "optim": optim, "num_train_epochs": 1})
    assert t.config["optimizer"] == fitune
    notes = [n for n in t.changed if n.startswith("optim:")]
    assert (notes == [] if said is None else said in notes[0] and f"optim: {optim} -> optimizer: {fitune}" in notes[0])


@pytest.mark.parametrize("value, hint", [
    ("paged_adamw_32bit", "did you mean adamw? (the same 32-bit precision)"),
    ("paged_lion_8bit", "did you mean paged_adamw8bit? (the same 8-bit precision)"),
])
def test_an_unknown_optimizer_is_offered_one_of_its_own_precision(tmp_path, capsys, value, hint):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"model: llama-3.1-8b\noptimizer: {value}\n")
    assert main(["estimate", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert hint in err and "Traceback" not in err


def test_an_unknown_32bit_optimizer_gets_no_8bit_suggestion(tmp_path, capsys):
    from fitune.schema import closest_of_same_width

    assert closest_of_same_width("paged_adamw_32bit", ["adamw", "paged_adamw8bit"]) == "adamw"
    assert closest_of_same_width("lion_32bit", ["adamw8bit", "paged_adamw8bit"]) is None
    text = translated_yaml({"model_name_or_path": "m", "optim": "lion_32bit", "num_train_epochs": 1}, "x.yaml")
    assert "# to fix before training: optimizer: 'lion_32bit' is not one of:" in text and "8bit?" not in text


# ---- 4. "not set" sentinels ---------------------------------------------------------------------------------------


def test_hf_unset_sentinels_are_dropped_with_a_comment(files, capsys):
    text, out = _translated(["train", "hf.yaml", "--translate"], capsys)
    assert "max_steps" not in out and out["epochs"] == 3
    assert "# not carried over, max_steps: -1: HF Trainer's 'not set' (train num_train_epochs instead); dropped" in text
    t = translate_doc({"model_name_or_path": "m", "num_train_epochs": 1, "max_grad_norm": 0, "eval_steps": None,
                       "save_strategy": "no", "save_steps": 500, "warmup_ratio": 0, "warmup_steps": 0})
    assert t.config["max_grad_norm"] is None and "eval_every" not in t.config and "save_every" not in t.config
    assert t.config["warmup_steps"] == 0  # 0 warm-up steps is a value, fitune's default, not a sentinel
    said = "\n".join(t.changed + t.dropped)
    for note in ("max_grad_norm: 0 -> max_grad_norm: null",
                 "save_steps: 500: unused in the source (save_strategy: no); dropped",
                 "save_strategy: no: fitune still checkpoints at the end", "warmup_ratio: 0: no warm-up"):
        assert note in said, note


def test_a_positive_max_steps_overrides_the_epochs_as_in_hf():
    t = translate_doc({"model_name_or_path": "m", "max_steps": 100, "num_train_epochs": 3})
    assert t.config["max_steps"] == 100 and "epochs" not in t.config
    assert "epochs 3: max_steps 100 overrides it in the source; dropped" in t.dropped


def test_neither_epochs_nor_max_steps_is_the_trainers_default():
    assert translate_doc({"base_model": "m", "micro_batch_size": 1}).config["epochs"] == 1  # Axolotl
    t = translate_doc({"model_name_or_path": "m", "per_device_train_batch_size": 1})  # HF Trainer
    assert t.config["epochs"] == 3 and "epochs: 3: num_train_epochs not given; HF Trainer / TRL's default is 3" in \
        t.changed


# ---- 5. train_on_inputs -------------------------------------------------------------------------------------------


def test_train_on_inputs_false_is_what_fitune_does_already(files, capsys):
    text, out = _translated(["train", "axo.yaml", "--translate"], capsys)
    assert "train_on_inputs" not in out
    assert ("# carried over, train_on_inputs: false: fitune trains only the answers (assistant turns, the completion, "
            "the alpaca output) already") in text
    _, notes = translate({"base_model": "m", "train_on_inputs": True})
    assert any(n.startswith("train_on_inputs: true: fitune takes the loss on the answers only") and "data.format: text"
               in n for n in notes)


def test_axolotl_dataset_type_becomes_the_data_format(files, capsys):
    """`type: alpaca` is a format fitune reads: it becomes data.format (it was "not carried over")."""
    text, out = _translated(["train", "axo.yaml", "--translate"], capsys)
    assert out["data"] == {"path": "data.jsonl", "format": "alpaca"} and "type 'alpaca'" not in text
    for kind, fmt in (("sharegpt", "sharegpt"), ("chat_template", "chat"), ("completion", "text")):
        config, _ = translate({"base_model": "m", "datasets": [{"path": "d.jsonl", "type": kind}]})
        assert config["data"]["format"] == fmt
    _, notes = translate({"base_model": "m", "datasets": [{"path": "d.jsonl", "type": "input_output"}]})
    assert any("type 'input_output': not a format fitune reads" in n for n in notes)


# ---- 6. the "to fix" list names every missing piece at once -------------------------------------------------------


def test_to_fix_names_the_model_the_data_and_every_problem_together():
    text = translated_yaml({"learning_rate": 1e-4, "per_device_train_batch_size": 0, "optim": "lion_32bit"}, "x.yaml")
    fixes = [line for line in text.splitlines() if line.startswith("# to fix before training: ")]
    assert fixes[0].startswith("# to fix before training: model: not set: the model to fine-tune")
    assert fixes[1].startswith("# to fix before training: data.path: not set: the training data")
    assert any("batch_size: must be a positive integer, got 0" in f for f in fixes)
    assert any("optimizer: 'lion_32bit'" in f for f in fixes)  # a refused value does not hide the rest
    assert "<model>" not in text and "<data>" not in text


def test_hf_yaml_to_fix_is_the_data_only(files, capsys):
    text, _ = _translated(["train", "hf.yaml", "--translate"], capsys)
    fixes = [line for line in text.splitlines() if line.startswith("# to fix")]
    assert fixes == ["# to fix before training: data.path: not set: the training data (a .jsonl / .json / .csv / "
                     ".parquet file, a dataset folder or a Hub data set id ORG/NAME)"]


# ---- 7. train / estimate on a foreign config: one pointer line, at most five problems ----------------------------


@pytest.mark.parametrize("argv, then", [(["train", "axo.yaml"], ""),
                                        (["estimate", "--config", "axo.yaml"], " (then `fitune estimate --config "
                                                                                "run.yaml`)")])
def test_a_foreign_config_points_to_translate_first_then_five_problems(files, capsys, argv, then):
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert lines[0] == (f"fitune {argv[0]}: error: this looks like another trainer's config (Axolotl): `fitune train "
                        f"axo.yaml --translate > run.yaml` writes it with fitune's names and says what it could not "
                        f"carry over{then}; its problems as a fitune config:")
    problems = [line for line in lines[1:] if line.startswith("  - ")]
    assert len(problems) == 5 and problems[0] == ("  - base_model: not a fitune key; did you mean model? "
                                                  "(`base_model` is how other trainers spell it)")
    assert "  - load_in_8bit: not a fitune key" in problems
    assert lines[-1] == "  ... and 8 more" and len(lines) == 7
    assert "known:" not in err and "Traceback" not in err


def test_hf_yaml_given_to_train_points_to_translate(files, capsys):
    assert main(["train", "hf.yaml"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fitune train: error: this looks like another trainer's config (HF Trainer / TRL): "
                          "`fitune train hf.yaml --translate > run.yaml`")
    assert err.splitlines()[-1] == "  ... and 3 more" and "Traceback" not in err


def test_fitunes_own_config_with_a_wrong_value_gets_no_pointer(files, capsys):
    (files / "run.yaml").write_text("model: llama-3.1-8b\nlr: -1\nlora: {rnak: 8}\n")
    assert main(["estimate", "--config", "run.yaml"]) == 2
    err = capsys.readouterr().err
    assert "--translate" not in err and "lora.rnak: not a fitune key; did you mean lora.rank?" in err


# ---- the translated YAML validates and round-trips ----------------------------------------------------------------


@pytest.mark.parametrize("source, fill", [("hf.yaml", "data: data.jsonl\n"), ("axo.yaml", "")])
def test_translated_yaml_is_accepted_and_round_trips(files, capsys, source, fill):
    text, out = _translated(["train", source, "--translate"], capsys)
    (files / "run.yaml").write_text(text + fill)
    assert main(["estimate", "--config", "run.yaml"]) == 0
    assert "llama-3.1-8b: " + ("full" if source == "hf.yaml" else "lora r16 on all-linear") in capsys.readouterr().out
    from fitune.config import config_from_dict

    doc = yaml.safe_load((files / "run.yaml").read_text())
    cfg = config_from_dict(doc, "run.yaml")  # what `fitune train run.yaml` reads, validated
    assert cfg.setup.optimizer == "adamw" and cfg.setup.method == ("full" if source == "hf.yaml" else "lora")
    again, out_again = _translated(["train", "run.yaml", "--translate"], capsys)
    assert out_again == doc  # fitune's own config comes back unchanged
    assert again.splitlines()[:2] == ["# translated by fitune from run.yaml", "model: meta-llama/Llama-3.1-8B"]


# ---- CONFIG.yaml is optional ---------------------------------------------------------------------------------------


def test_train_without_a_file_names_the_missing_flags(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--lr", "1e-4"]) == 2
    err = capsys.readouterr().err
    assert "  - --model missing; give a Hugging Face model folder" in err
    assert "  - --data missing; point it at" in err and "  - --max-steps / --epochs give exactly one of them" in err
    assert "Traceback" not in err
    assert main(["train", "--translate"]) == 2
    assert ("fitune train: error: --translate needs the other trainer's config file: fitune train axolotl.yml "
            "--translate > run.yaml") in capsys.readouterr().err


def test_train_help_shows_the_run_from_flags(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    assert "[CONFIG.yaml]" in out
    assert ("fitune train --model ./my-model --data train.jsonl --method qlora --max-steps 200 --output-dir runs/x"
            in out)


def test_train_runs_from_flags_alone(tmp_path, monkeypatch, capsys):
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    from fitune.train.quickstart import write_quickstart

    monkeypatch.chdir(tmp_path)
    write_quickstart("demo")
    code = main(["train", "--model", "demo/model", "--data", "demo/train.jsonl", "--dtype", "fp32", "--seq-len", "64",
                 "--batch-size", "4", "--max-steps", "2", "--output-dir", "runs/flags", "--no-progress"])
    assert code == 0
    assert "trained 2 steps" in capsys.readouterr().out
    assert (tmp_path / "runs/flags/adapter").is_dir()


def test_a_tiny_model_is_not_zero_billion_parameters(tmp_path, capsys):
    """Issue 31: tiny models printed `0.00B parameters, 0.00M trainable`."""
    from fitune.units import count_text

    assert [count_text(n) for n in (8_030_261_248, 3_407_872, 106_816, 512)] == ["8.03B", "3.41M", "106.8K", "512"]
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                                  "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                                  "vocab_size": 256, "max_position_embeddings": 512}))
    assert main(["estimate", str(config), "--gpu", "rtx4090"]) == 0
    out = capsys.readouterr().out
    assert "0.00B" not in out and "K parameters" in out and "K trainable" in out

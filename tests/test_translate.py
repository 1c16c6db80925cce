"""`fitune train OTHER.yaml --translate` (fitune/translate.py): Axolotl, HF Trainer / TRL and torchtune configs as
fitune configs; what cannot be carried over is said, never guessed; fitune's own config comes back unchanged."""

from __future__ import annotations

import json

import pytest
import yaml

from fitune.cli.main import main
from fitune.errors import ConfigError
from fitune.translate import translate, translated_yaml, validate

AXOLOTL = """\
base_model: ./demo/model
datasets:
  - path: ./demo/train.jsonl
    type: chat_template
  - path: more.jsonl
adapter: qlora
load_in_4bit: true
lora_r: 8
lora_alpha: 16
lora_dropout: 0.05
lora_target_linear: true
sequence_len: 64
micro_batch_size: 4
gradient_accumulation_steps: 2
num_epochs: 1
learning_rate: 0.0002
lr_scheduler: cosine
bf16: true
gradient_checkpointing: true
output_dir: ./out
warmup_ratio: 0.1
logging_steps: 5
sample_packing: false
val_set_size: 0.05
wandb_project: proj
special_tokens:
  pad_token: "<pad>"
"""

TORCHTUNE = """\
output_dir: /tmp/tt
model:
  _component_: torchtune.models.llama3_1.lora_llama3_1_8b
  lora_attn_modules: ['q_proj', 'v_proj', 'output_proj']
  apply_lora_to_mlp: True
  apply_lora_to_output: False
  lora_rank: 8
  lora_alpha: 16
tokenizer:
  _component_: torchtune.models.llama3.llama3_tokenizer
  path: /w/original/tokenizer.model
  max_seq_len: null
checkpointer:
  _component_: torchtune.training.FullModelHFCheckpointer
  checkpoint_dir: /w/
  model_type: LLAMA3
dataset:
  _component_: torchtune.datasets.alpaca_cleaned_dataset
seed: null
batch_size: 2
optimizer:
  _component_: torch.optim.AdamW
  fused: True
  weight_decay: 0.01
  lr: 3.0e-4
lr_scheduler:
  _component_: torchtune.training.lr_schedulers.get_cosine_schedule_with_warmup
  num_warmup_steps: 100
epochs: 1
gradient_accumulation_steps: 8
enable_activation_checkpointing: True
dtype: bf16
"""

HF = {"model_name_or_path": "m", "train_file": "t.jsonl", "learning_rate": 2e-4, "per_device_train_batch_size": 4,
      "gradient_accumulation_steps": 4, "num_train_epochs": 2, "bf16": True, "fp16": False,
      "optim": "paged_adamw_8bit", "lr_scheduler_type": "cosine", "max_seq_length": 1024, "lora_r": 16,
      "lora_target_modules": ["q_proj", "v_proj"], "save_total_limit": 2, "report_to": "none",
      "resume_from_checkpoint": True, "seed": 42}


@pytest.fixture
def demo(tmp_path, monkeypatch):
    """The quick-start's tiny model and data under ./demo, what the Axolotl config points at."""
    pytest.importorskip("transformers")
    from fitune.train.quickstart import write_quickstart

    monkeypatch.chdir(tmp_path)
    return write_quickstart("demo")


def test_axolotl_config_translates_key_by_key_and_says_what_it_drops(demo):
    out, notes = translate(yaml.safe_load(AXOLOTL))
    assert out["model"] == "./demo/model" and out["data"] == {"path": "./demo/train.jsonl", "format": "chat"}  # type: chat_template
    assert out["method"] == "qlora" and out["lora"] == {"rank": 8, "alpha": 16, "dropout": 0.05,
                                                       "targets": ["all-linear"]}
    assert (out["seq_len"], out["batch_size"], out["grad_accum"], out["epochs"]) == (64, 4, 2, 1)
    assert (out["lr"], out["schedule"], out["dtype"], out["grad_checkpointing"]) == (0.0002, "cosine", "bf16", True)
    assert out["log_every"] == 5 and out["report_to"] == ["wandb"] and out["packing"] is False
    said = "\n".join(notes)
    for name in ("warmup_ratio", "val_set_size", "special_tokens", "2 data sets", "WANDB_PROJECT"):
        assert name in said, name
    assert validate(out, "ax.yaml") == []  # fitune's own reader takes it as it is


def test_torchtune_sections_translate_with_transformers_module_names():
    out, notes = translate(yaml.safe_load(TORCHTUNE))
    assert out["model"] == "/w/" and "tokenizer" not in out and "seed" not in out
    assert out["lora"]["targets"] == ["q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert (out["lora"]["rank"], out["lr"], out["weight_decay"], out["warmup_steps"]) == (8, 3.0e-4, 0.01, 100)
    assert (out["grad_accum"], out["grad_checkpointing"], out["dtype"]) == (8, True, "bf16")
    said = "\n".join(notes)
    assert "alpaca_cleaned_dataset" in said and "fused" in said and "tokenizer.model" in said


def test_hf_training_arguments_translate_and_report_to_none_is_fitunes_too():
    out, notes = translate(HF)
    assert (out["model"], out["data"]["path"], out["batch_size"], out["optimizer"]) == ("m", "t.jsonl", 4,
                                                                                      "paged_adamw8bit")
    assert out["keep_checkpoints"] == 2 and out["dtype"] == "bf16" and out["seed"] == 42
    assert any("--resume" in n for n in notes) and any(n.startswith("fp16") for n in notes)
    assert out["report_to"] == "none"  # HF's spelling, kept: fitune's own reader takes it as "no logger"
    from fitune.config import TrainConfig
    from fitune.schema import Problems, keys_of, values_from_mapping

    problems = Problems()
    assert values_from_mapping({"report_to": "none"}, keys_of(TrainConfig), "x", problems) == {"report_to": ()}
    assert values_from_mapping({"report_to": "all"}, keys_of(TrainConfig), "x", problems) == {
        "report_to": ("tensorboard", "wandb")}
    assert problems.items == []


def test_fitunes_own_config_comes_back_unchanged(tmp_path):
    from fitune.train.quickstart import write_quickstart

    pytest.importorskip("transformers")
    path = write_quickstart(str(tmp_path / "demo"))
    with open(path, encoding="utf-8") as f:
        doc = yaml.safe_load(f)
    out, notes = translate(doc)
    assert out == doc and notes == []


def test_cli_translate_prints_yaml_and_the_error_points_to_it(demo, tmp_path, capsys):
    cfg = tmp_path / "ax.yml"
    cfg.write_text(AXOLOTL)
    assert main(["train", str(cfg), "--translate"]) == 0
    text = capsys.readouterr().out
    assert text.startswith(f"# translated by fitune from {cfg}\n")
    assert yaml.safe_load(text) == translate(yaml.safe_load(AXOLOTL))[0]
    assert "# not carried over, warmup_ratio" in text and "to fix before training" not in text
    code = main(["train", str(cfg)])
    err = capsys.readouterr().err
    assert code == 2 and "did you mean model?" in err and f"fitune train {cfg} --translate > run.yaml" in err
    (tmp_path / "h.json").write_text(json.dumps({"learning_rate": 1e-4}))
    assert main(["train", str(tmp_path / "h.json"), "--translate"]) == 0
    assert "# to fix before training: model: not set" in capsys.readouterr().out


def test_translated_yaml_lists_what_fitune_still_refuses():
    text = translated_yaml({"model_name_or_path": "m", "per_device_train_batch_size": -1}, "x.yaml")
    assert "# to fix before training: batch_size" in text
    text = translated_yaml({"datasets": 5, "lora_r": 8}, "x.yaml")
    assert "datasets: 5: no file path in it" in text
    assert text.count("model:") == 1 and "<model>" not in text  # the missing model said once


def test_a_foreign_error_without_foreign_keys_has_no_hint(tmp_path, capsys):
    cfg = tmp_path / "r.yaml"
    cfg.write_text("model: m\nlr: -1\n")
    assert main(["train", str(cfg)]) == 2
    assert "--translate" not in capsys.readouterr().err
    with pytest.raises(ConfigError):
        from fitune.config import config_from_dict

        config_from_dict({"model": "m", "report_to": "nope"}, "x")

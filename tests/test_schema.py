"""The config schema: every field round-trips through YAML, the command line and JSON; what people type works or
gets a "did you mean"; errors name the YAML key in a file and the flag on the command line. No torch needed."""

from __future__ import annotations

import json

import pytest
import yaml

from fitune.cli.main import build_parser, main
from fitune.config import ALL_KEYS, TrainConfig, config_from_dict, flat_values, train_values_from_args
from fitune.errors import ConfigError
from fitune.schema import load_config_file, to_mapping
from fitune.setup import SETUP_KEYS, TrainSetup

#: A value different from the default for every field, valid for its kind.
SAMPLE = {
    "model": None, "path": None, "format": "completion", "eval_path": None, "split": "validation", "subset": None,
    "streaming": True, "method": "freeze", "lora_rank": 16,
    "lora_alpha": 32, "lora_dropout": 0.05, "lora_targets": ("q_proj", "k_proj"), "dtype": "fp16",
    "grad_checkpointing": "selective:1", "attn": "eager", "optimizer": "sgd", "batch_size": 3, "seq_len_tokens": 96,
    "freeze_trainable_layers": 4, "grad_accum": 5, "loss": "chunked", "tiled_mlp": True, "lean_lora": False,
    "lean_norm": True, "kernels": "torch", "compile": "none", "offload_embeddings": False, "expandable_segments": True, "keep_outputs": False, "stack": "fitune", "num_gpus": 2, "strategy": "fsdp", "output_dir": None,
    "init": "random", "tokenizer": None, "trust_remote_code": True, "max_steps": 7, "epochs": None, "lr": 3e-5,
    "weight_decay": 0.01, "schedule": "linear", "warmup_steps": 2, "max_grad_norm": None, "seed": 11,
    "packing": True, "packing_attention": "mask", "eval_every": 3, "save_every": 4, "save_every_minutes": 5.5,
    "keep_checkpoints": 3, "report_to": ("tensorboard",), "log_every": 2, "merge": True, "oom_guard": False,
    "cap": "rtx4090",
}


@pytest.fixture
def paths(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    data = tmp_path / "train.jsonl"
    data.write_text('{"text": "hello"}\n')
    evald = tmp_path / "eval.jsonl"
    evald.write_text('{"text": "hello"}\n')
    return {"model": str(model), "path": str(data), "eval_path": str(evald), "output_dir": str(tmp_path / "out"),
            "tokenizer": str(model)}


def _sample(paths) -> dict:
    return {f: (paths[f] if v is None and f in paths else v) for f, v in SAMPLE.items()}


def test_the_sample_covers_every_field_and_differs_from_the_defaults():
    assert set(SAMPLE) == {k.field for k in ALL_KEYS}
    defaults = flat_values(TrainConfig())
    same = [f for f, v in SAMPLE.items() if v is not None and v == defaults[f] and f not in ("lean_lora", "kernels", "compile", "offload_embeddings", "stack", "keep_outputs")]
    assert same == []


def test_every_field_round_trips_through_yaml(paths, tmp_path):
    values = _sample(paths)
    cfg = config_from_dict(to_mapping(values, ALL_KEYS, keep_none=["max_grad_norm"]), "sample")
    assert flat_values(cfg) == {**values, "epochs": None}
    # the saved form (what checkpoints and `plan --write` write) reads back to the same config
    text = yaml.safe_dump(cfg.to_dict(), sort_keys=False)
    (tmp_path / "run.yaml").write_text(text)
    again = config_from_dict(load_config_file(str(tmp_path / "run.yaml")), "run.yaml")
    assert again == cfg
    assert again.setup.freeze_trainable_layers == 4  # it was dropped by the old hand-written to_dict


def test_every_field_round_trips_through_the_command_line(paths, tmp_path):
    values = _sample(paths)
    argv = ["train", "run.yaml"]
    for k in ALL_KEYS:
        v = values[k.field]
        if k.kind == "bool":
            argv.append(k.flag if v else "--no-" + k.flag[2:])
        elif v is None:
            argv += [k.flag, "null"]
        elif isinstance(v, tuple):
            argv += [k.flag, ",".join(v)]
        else:
            argv += [k.flag, str(v)]
    args = build_parser().parse_args(argv)
    got = train_values_from_args(args)
    assert got == values


def test_every_setup_field_round_trips_through_json():
    s = TrainSetup(**{**{k.field: SAMPLE[k.field] for k in SETUP_KEYS}, "keep_outputs": True})
    doc = json.loads(json.dumps(s.to_dict()))
    assert set(doc) == {k.field for k in SETUP_KEYS}
    assert TrainSetup.from_dict(doc) == s
    with pytest.raises(ConfigError, match="setup.bogus: not a TrainSetup field"):
        TrainSetup.from_dict({**doc, "bogus": 1})


@pytest.mark.parametrize("command", ["estimate", "profile", "train"])
def test_every_command_accepts_the_setup_flags(command):
    """Every command that takes a setup takes every TrainSetup flag (--grad-accum, --lora-alpha, ...)."""
    parser = build_parser()
    sub = next(a for a in parser._subparsers._actions if a.choices)  # noqa: SLF001 - argparse internals, tests only
    flags = {opt for action in sub.choices[command]._actions for opt in action.option_strings}  # noqa: SLF001
    assert {k.flag for k in SETUP_KEYS} <= flags
    assert {"--grad-accum", "--lora-alpha", "--lora-dropout", "--freeze-trainable-layers"} <= flags


def test_plan_takes_the_kept_fields_by_the_same_flags():
    parser = build_parser()
    sub = next(a for a in parser._subparsers._actions if a.choices)  # noqa: SLF001
    flags = {opt for action in sub.choices["plan"]._actions for opt in action.option_strings}  # noqa: SLF001
    assert {"--seq-len", "--lora-rank", "--lora-alpha", "--lora-dropout", "--lora-targets",
            "--freeze-trainable-layers", "--kernels"} <= flags


# ---- what people type -------------------------------------------------------------------------------------------


def _config(paths, tmp_path, text: str) -> TrainConfig:
    f = tmp_path / "run.yaml"
    base = {"model": paths["model"], "data": paths["path"], "max_steps": 3}
    given = {line.split(":")[0] for line in text.splitlines()}
    f.write_text("".join(f"{k}: {v}\n" for k, v in base.items() if k not in given) + text)
    return config_from_dict(load_config_file(str(f)), "run.yaml")


def test_yaml_floats_in_e_notation_are_floats(paths, tmp_path):
    assert _config(paths, tmp_path, "lr: 2e-4\nweight_decay: 1e-2\n").lr == 2e-4


@pytest.mark.parametrize("text, field, value", [
    ("grad_checkpointing: true\n", "grad_checkpointing", "full"),
    ("grad_checkpointing: false\n", "grad_checkpointing", "none"),
    ("grad_checkpointing: unsloth\n", "grad_checkpointing", "offload"),
    ("dtype: bfloat16\n", "dtype", "bf16"),
    ("dtype: float16\n", "dtype", "fp16"),
    ("attn: flash_attention_2\n", "attn", "flash"),
    ("optimizer: adamw_torch\n", "optimizer", "adamw"),
    ("optimizer: paged_adamw_8bit\n", "optimizer", "paged_adamw8bit"),
    ("lora: {targets: all_linear}\n", "lora_targets", ("all-linear",)),
    ("lora: {targets: 'q_proj,v_proj', dropout: 0.1}\n", "lora_targets", ("q_proj", "v_proj")),
])
def test_values_other_trainers_write_work(paths, tmp_path, text, field, value):
    cfg = _config(paths, tmp_path, text)
    assert flat_values(cfg)[field] == value


@pytest.mark.parametrize("text, message", [
    ("learning_rate: 1e-4\n", "learning_rate: not a fitune key; did you mean lr?"),
    ("gradient_checkpointing: true\n", "did you mean grad_checkpointing?"),
    ("lora_r: 16\n", "did you mean lora.rank?"),
    ("lora_target_modules: [q_proj]\n", "did you mean lora.targets?"),
    ("max_seq_length: 512\n", "did you mean seq_len?"),
    ("per_device_train_batch_size: 2\n", "did you mean batch_size?"),
    ("num_train_epochs: 3\n", "did you mean epochs?"),
    ("bf16: true\n", "did you mean dtype: bf16?"),
    ("lora: {r: 64}\n", "lora.r: not a fitune key; did you mean lora.rank?"),
    ("lora: {target_modules: [q_proj]}\n", "lora.target_modules: not a fitune key; did you mean lora.targets?"),
    ("lora: {alpah: 3}\n", "lora.alpah: not a fitune key; did you mean lora.alpha"),
    ("data: {path: x.jsonl, formt: chat}\n", "data.formt: not a fitune key; did you mean data.format?"),
    ("sequence_len: 4096\n", "did you mean seq_len?"),
    ("micro_batch_size: 2\n", "did you mean batch_size?"),
])
def test_foreign_and_misspelt_keys_get_did_you_mean(paths, tmp_path, text, message):
    with pytest.raises(ConfigError) as info:
        _config(paths, tmp_path, text)
    assert message in str(info.value)


@pytest.mark.parametrize("text, message", [
    ('trust_remote_code: "false"\n', "trust_remote_code: 'false' — only the literal true runs"),
    ('merge: "no"\n', "merge: must be true or false"),
    ("lr: .inf\n", "lr: must be a finite number"),
    ("lr: 1e300\n", "lr: must be at most 1"),
    ("epochs: .inf\n", "epochs: must be a finite number"),
    ("lora: {rank: 1e9}\n", "lora.rank: must be at most 65536"),
    ("max_grad_norm: -1\n", "max_grad_norm: must be above 0"),
    ("seed: abc\n", "seed: must be a number"),
    ("model: [a, b]\n", "model: must be text"),
    ("output_dir: ''\n", "output_dir: is empty"),
    ("output_dir: 5\n", "output_dir: must be text"),
    ("lora: 5\n", "lora: expected a mapping"),
    ("method: lorra\n", "method: 'lorra' is not one of: lora, qlora, full, freeze; did you mean lora?"),
])
def test_wrong_values_name_the_yaml_key(paths, tmp_path, text, message):
    with pytest.raises(ConfigError) as info:
        _config(paths, tmp_path, text)
    assert message in str(info.value)
    assert "--" not in str(info.value).split(message)[0][-40:]  # a YAML key, not a flag


@pytest.mark.parametrize("content, message", [
    (b"model: a\nmodel: b\n", "key 'model' is given twice"),
    ("model: x\n".encode("utf-16"), "UTF-16"),
    (b"model: \xe9t\xe9\n", "not UTF-8"),
    (b"\x00\x01\x02", "binary"),
    (b"[" * 5000, "nested"),
    (b"a:\n" + b"".join(b"  " * i + b"b:\n" for i in range(1, 30)), "nested more than"),
    (b"!!python/object/apply:os.system ['echo hi']\n", "not valid YAML"),
])
def test_bad_files_are_one_clear_message(tmp_path, content, message):
    f = tmp_path / "run.yaml"
    f.write_bytes(content)
    with pytest.raises(ConfigError, match=message):
        load_config_file(str(f))


def test_train_flags_override_the_file_and_name_the_flag(paths, tmp_path, capsys):
    f = tmp_path / "run.yaml"
    f.write_text(f"model: {paths['model']}\ndata: {paths['path']}\nepochs: 1\nlr: 1e-4\n")
    args = build_parser().parse_args(["train", str(f), "--lr", "3e-4", "--max-steps", "5", "--lora-rank", "32"])
    cfg = config_from_dict(load_config_file(str(f)), str(f), None, train_values_from_args(args))
    assert (cfg.lr, cfg.max_steps, cfg.epochs, cfg.setup.lora_rank) == (3e-4, 5, None, 32)
    assert main(["train", str(f), "--lr", "-1"]) == 2
    assert "--lr must be above 0" in capsys.readouterr().err


def test_profile_flags_override_the_config_file(paths, tmp_path):
    """`fitune profile --config run.yaml --seq-len 32` profiles 32 tokens (the flag was silently ignored)."""
    from fitune.cli.common import setup_and_model

    f = tmp_path / "run.yaml"
    f.write_text(f"model: {paths['model']}\ndata: {paths['path']}\nseq_len: 512\nlora: {{rank: 4}}\n")
    args = build_parser().parse_args(["profile", "--config", str(f), "--seq-len", "32"])
    model, setup, origin = setup_and_model(args)
    assert (model, setup.seq_len_tokens, setup.lora_rank, setup.stack) == (paths["model"], 32, 4, "fitune")
    assert origin["seq_len_tokens"] == "flag" and origin["lora_rank"] == "yaml"


def test_estimate_reads_a_train_config_and_flags_win(paths, tmp_path, capsys):
    f = tmp_path / "run.yaml"
    f.write_text(f"model: llama-3.1-8b\ndata: {paths['path']}\nseq_len: 1024\nbatch_size: 1\n")
    assert main(["estimate", "--config", str(f), "--seq-len", "512", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["setup"]["seq_len_tokens"] == 512 and doc["setup"]["batch_size"] == 1
    assert doc["setup"]["stack"] == "fitune"


def test_estimate_flag_errors_name_flags(capsys):
    assert main(["estimate", "llama-3.1-8b", "--dtype", "bfloat17"]) == 2
    err = capsys.readouterr().err
    assert "--dtype 'bfloat17' is not one of: bf16, fp16, fp32; did you mean bf16?" in err


def test_catalog_accepts_the_hugging_face_ids_list_models_prints(capsys):
    assert main(["estimate", "meta-llama/Llama-3.1-8B", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model"] == "llama-3.1-8b"
    assert main(["estimate", "--list-models"]) == 0
    listing = capsys.readouterr().out
    assert "meta-llama/Llama-3.1-8B" in listing


def test_set_values_are_read_as_the_file_reads_them(paths, tmp_path):
    from fitune.cli.train import parse_overrides

    f = tmp_path / "run.yaml"
    f.write_text(f"model: {paths['model']}\ndata: {paths['path']}\nmax_steps: 3\n")
    args = build_parser().parse_args(["train", str(f), "--set", "lr=2e-4", "--set", "lora.dropout=0.1"])
    cfg = config_from_dict(load_config_file(str(f)), str(f), parse_overrides(args))
    assert (cfg.lr, cfg.setup.lora_dropout) == (2e-4, 0.1)


def test_a_set_max_steps_replaces_the_files_epochs(paths, tmp_path):
    """`fitune plan --write` writes `epochs: 1`; `--set max_steps=25` on that file is one choice, as the flag
    --max-steps is (found trying a written plan as a user), and `--set epochs=2` replaces a file's max_steps."""
    from fitune.cli.train import parse_overrides

    f = tmp_path / "run.yaml"
    f.write_text(f"model: {paths['model']}\ndata: {paths['path']}\nepochs: 1\n")
    args = build_parser().parse_args(["train", str(f), "--set", "max_steps=25"])
    cfg = config_from_dict(load_config_file(str(f)), str(f), parse_overrides(args))
    assert (cfg.max_steps, cfg.epochs) == (25, None)
    f.write_text(f"model: {paths['model']}\ndata: {paths['path']}\nmax_steps: 3\n")
    args = build_parser().parse_args(["train", str(f), "--set", "epochs=2"])
    cfg = config_from_dict(load_config_file(str(f)), str(f), parse_overrides(args))
    assert (cfg.max_steps, cfg.epochs) == (None, 2)
    args = build_parser().parse_args(["train", str(f), "--set", "epochs=2", "--set", "max_steps=4"])
    with pytest.raises(ConfigError, match="give exactly one of them"):  # both given: still refused
        config_from_dict(load_config_file(str(f)), str(f), parse_overrides(args))


def test_a_misspelt_section_is_offered_the_section_not_a_short_key(tmp_path, capsys):
    """`loar:` is `lora` with two letters swapped: offered the section, with its keys, not the key `lr` (closer by
    letters than any of the section's own keys)."""
    from fitune.cli.main import main

    path = tmp_path / "c.yaml"
    path.write_text("model: llama-3.1-8b\nloar:\n  rank: 8\nlora:\n  rnak: 8\n")
    assert main(["estimate", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "loar: not a fitune key; did you mean lora? (a section: lora.rank, lora.alpha" in err
    assert "lora.rnak: not a fitune key; did you mean lora.rank?" in err

"""Flags the way other trainers spell them (HF Trainer, TRL, PEFT, Axolotl, torchtune) get one line with the fitune
flag to write, and exit 2: never argparse's bare "unrecognized arguments"."""

from __future__ import annotations

import json

import pytest

from fitune.cli.main import main


@pytest.mark.parametrize("argv, expected", [
    (["plan", "llama-3.1-8b", "--gpu", "rtx4090", "--per-device-train-batch-size", "2"], "did you mean --batch-size?"),
    (["estimate", "llama-3.1-8b", "--gradient_accumulation_steps", "4"], "did you mean --grad-accum?"),
    (["estimate", "llama-3.1-8b", "--bf16"], "did you mean --dtype bf16?"),
    (["plan", "llama-3.1-8b", "--gpu", "rtx4090", "--target-modules", "q_proj"], "did you mean --lora-targets?"),
    (["estimate", "llama-3.1-8b", "--use-liger-kernel"], "did you mean --kernels liger?"),
    (["estimate", "llama-3.1-8b", "--learning-rate=1e-4"], "`learning-rate` is fitune's `lr`, which this command"),
    (["estimate", "llama-3.1-8b", "--seq-length", "4096"], "did you mean --seq-len?"),
    (["plan", "llama-3.1-8b", "--gpu", "rtx4090", "--use_peft"], "did you mean --method lora?"),  # TRL's ModelConfig
])
def test_other_trainers_flags_get_a_did_you_mean(argv, expected, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err and err.count("\n") == 1, err


def test_a_stray_value_still_gets_argparses_message(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["plan", "llama-3.1-8b", "--gpu", "rtx4090", "stray"])
    assert exc.value.code == 2 and "unrecognized arguments: stray" in capsys.readouterr().err


@pytest.mark.parametrize("argv, flag, value, yaml_key", [
    (["plan", "llama-3.1-8b", "--gpu", "rtx4090", "--keep-outputs", "true"], "--keep-outputs", "true", "keep_outputs"),
    (["estimate", "llama-3.1-8b", "--no-lean-lora", "false"], "--no-lean-lora", "false", "lean_lora"),
])
def test_a_value_given_to_an_on_off_flag_says_how_to_write_it(argv, flag, value, yaml_key, capsys):
    """`--lean-lora true` (HF's `--bf16 True` habit): one line naming the flag, how to turn it on and off, and the
    YAML spelling; exit 2."""
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "usage:" not in err
    assert f"{flag} takes no value (got {value!r})" in err and f"`{yaml_key}: true`" in err


@pytest.mark.parametrize("command, model_args", [
    ("estimate", ["--model", "llama-3.1-8b"]),
    ("estimate", ["--model_name_or_path=llama-3.1-8b"]),
    ("plan", ["--base-model", "llama-3.1-8b"]),
    ("plan", ["--model-name-or-path", "llama-3.1-8b"]),
])
def test_the_model_given_as_a_flag_is_the_model(command, model_args, capsys):
    """`fitune plan --model X` (how vLLM and lm-eval take it; `--model_name_or_path` in HF's scripts and TRL, Axolotl's
    `base_model`) runs as `fitune plan X`: the same JSON, wherever the flag stands."""
    rest = ["--gpu", "rtx4090", "--json"] + (["--top", "1"] if command == "plan" else [])
    assert main([command, "llama-3.1-8b"] + rest) == 0
    positional = capsys.readouterr().out
    assert main([command] + rest[:2] + model_args + rest[2:]) == 0
    as_flag = capsys.readouterr().out

    def without_timing(text):  # plan's JSON says how long its search took
        doc = json.loads(text)
        doc.get("search", {}).pop("seconds", None)
        return doc
    assert without_timing(as_flag) == without_timing(positional)


def test_the_model_given_twice_is_one_line_and_exit_2(capsys):
    assert main(["estimate", "--model", "llama-3.1-8b", "qwen2.5-7b", "--gpu", "rtx4090"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "given twice" in err and "--model llama-3.1-8b and qwen2.5-7b" in err


def test_commands_without_a_model_argument_keep_their_message(capsys):
    """chat takes a run folder: `--model` there is an unknown flag, and no "did you mean --help"."""
    assert main(["chat", "--model", "x", "run"]) == 2
    err = capsys.readouterr().err
    assert "--model is not a flag of fitune chat" in err and "--help?" not in err

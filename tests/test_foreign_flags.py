"""Flags the way other trainers spell them (HF Trainer, TRL, PEFT, Axolotl, torchtune) get one line with the fitune
flag to write, and exit 2: never argparse's bare "unrecognized arguments"."""

from __future__ import annotations

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

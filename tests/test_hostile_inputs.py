"""Issue 35, part B: every hostile input gets one message and exit status 2, and nothing runs unbounded.

First the inputs the issue names, one test each, with the exact input: YAML tags with bad values (`lr: !!int abc`,
`--set 'seed=!!bool 0'`), numbers over Python's 4,300-digit limit (YAML, JSON, data records, `selective:<digits>`,
doctor scripts), `doctor` on `LoraConfig(target_modules=[1, None, {}])`, on a 400-digit literal and on a four-line
Trainer script with `--model FOLDER`, `--translate` of `lora: 5` beside `lora_r: 8`, `plan --gpus 720 ...`, and a
20,000-turn conversation in `doctor --data`.

Then a generated corpus that grows with the schema and with every new input kind: value kinds (numbers of any size,
every YAML tag, surrogates, empty and nested values, booleans where numbers go) x places (every key of
`fitune.config.ALL_KEYS` in a YAML config given to `fitune estimate --config`, every `--set KEY=VALUE` of `fitune
train`, every other trainer's key `fitune train --translate` reads, the fields of a data record for `fitune doctor
--data`, the keywords of a training script for `fitune doctor`); broken files under every name a command reads; and
hostile chat templates. Each case must exit 0 or 2 (doctor: 0, 1 or 2, its documented codes) with no traceback; an
exit 2 carries exactly one `fitune CMD: error:` line. Everything runs in-process through `fitune.cli.main.main`
(fast); the few inputs that could hang run in a subprocess whose timeout is the bound.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from fitune.cli.main import main
from fitune.config import ALL_KEYS
from fitune.schema import FOREIGN_KEYS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: A tiny Llama as config.json: 2 layers, hidden 64 (fitune estimate reads it in milliseconds).
TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 64,
        "max_position_embeddings": 256, "torch_dtype": "float32"}
DIGITS_5000 = "9" * 5000
DIGITS_400 = "9" * 400


# ---- the harness ------------------------------------------------------------------------------------------------


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    """`fitune ARGV` in-process: (exit status, stdout, stderr); argparse's SystemExit is an exit status too. Any
    other exception propagates, and fails the test with its traceback."""
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    out, err = capsys.readouterr()
    return code, out, err


ERROR_LINE = re.compile(r"^fitune [a-z]+: error: ", re.MULTILINE)


def one_error(code: int, out: str, err: str, *names: str) -> str:
    """Assert exit 2, no traceback and exactly one `fitune CMD: error:` line naming each of `names`; the message."""
    assert "Traceback" not in out + err, out + err
    assert code == 2, f"exit {code}\nstdout: {out[-1500:]}\nstderr: {err[-1500:]}"
    assert len(ERROR_LINE.findall(err)) == 1, err
    for name in names:
        assert name in err, f"the message does not name {name!r}: {err}"
    return err


def clean(code: int, out: str, err: str, codes=(0, 2)) -> None:
    """A corpus case: an allowed exit status, no traceback, and one error line when it failed."""
    assert "Traceback" not in out + err, out + err
    assert code in codes, f"exit {code}\nstdout: {out[-800:]}\nstderr: {err[-800:]}"
    if code == 2:
        assert len(ERROR_LINE.findall(err)) == 1, err


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    """A model folder holding only config.json (the tiny Llama): enough for estimate, doctor --model and plan."""
    folder = tmp_path_factory.mktemp("model")
    (folder / "config.json").write_text(json.dumps(TINY))
    return str(folder)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> str:
    """A word-level tokenizer with a chat template (tests/tiny.py)."""
    from tests.tiny import make_tokenizer

    return make_tokenizer(str(tmp_path_factory.mktemp("tokenizer")))


# ---- the inputs the issue names -----------------------------------------------------------------------------------


def test_yaml_int_tag_on_text_names_the_key_the_value_and_why(tmp_path, model_dir, capsys):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"model: {model_dir}\nlr: !!int abc\n")
    err = one_error(*run_cli(["estimate", "--config", cfg], capsys), "line 2", "lr:", "`!!int abc`",
                    "is not a whole number")
    assert "write the value without the tag" in err


def test_set_with_a_bool_tag_on_0_names_the_key_the_value_and_why(capsys):
    err = one_error(*run_cli(["train", "--model", "m", "--data", "d.jsonl", "--set", "seed=!!bool 0"], capsys),
                    "--set seed=!!bool 0", "`!!bool 0`", "is not true or false")
    assert "KeyError" not in err


@pytest.mark.parametrize("tag", ["!!python/object:os.system x", "!!python/object/apply:os.system ['echo hi']",
                                 "!foo 3", "!<tag:example.com,2024:x> 1"])
def test_a_tag_fitune_does_not_read_is_named(tmp_path, model_dir, tag, capsys):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"model: {model_dir}\nseed: {tag}\n")
    one_error(*run_cli(["estimate", "--config", cfg], capsys), "seed:", "is a tag fitune does not read")


def test_5000_digit_integer_in_a_yaml_config(tmp_path, model_dir, capsys):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"model: {model_dir}\nseed: {DIGITS_5000}\n")
    one_error(*run_cli(["estimate", "--config", cfg], capsys), "seed:", "a number of 5,000 digits",
              "4,300 digits at most")


def test_5000_digit_hexadecimal_integer_in_a_yaml_config(tmp_path, model_dir, capsys):
    """YAML reads `0x...` whatever its length (int() has no limit in base 16): refused by its decimal length."""
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"model: {model_dir}\nlora:\n  rank: 0x{'f' * 5000}\n")
    one_error(*run_cli(["estimate", "--config", cfg], capsys), "lora.rank:", "a number of 6,021 digits")


def test_5000_digit_integer_in_a_json_config(tmp_path, model_dir, capsys):
    cfg = tmp_path / "run.json"
    cfg.write_text(f'{{"model": {json.dumps(model_dir)}, "seed": {DIGITS_5000}}}')
    one_error(*run_cli(["estimate", "--config", cfg], capsys), "run.json", "a number of 5,000 digits")


def test_5000_digit_integer_in_set(capsys):
    err = one_error(*run_cli(["train", "--model", "m", "--data", "d.jsonl", "--set", f"seed={DIGITS_5000}"], capsys),
                    "--set seed=", "a number of 5,000 digits")
    assert DIGITS_400 not in err  # the value is shortened in the message, not written out


@pytest.mark.parametrize("flag, value", [("--batch-size", DIGITS_5000), ("--lora-dropout", "-" + DIGITS_5000),
                                         ("--seq-len", DIGITS_400)])
def test_huge_numbers_in_flags(flag, value, capsys):
    err = one_error(*run_cli(["estimate", "llama-3.1-8b", flag, value], capsys), flag)
    assert "a number of" in err and "digits" in err


@pytest.mark.parametrize("where", ["jsonl", "json"])
def test_5000_digit_integer_in_a_data_record(tmp_path, tokenizer_dir, where, capsys):
    record = f'{{"messages": [{{"role": "user", "content": "hi"}}, {{"role": "assistant", "content": {DIGITS_5000}}}]}}'
    data = tmp_path / f"train.{where}"
    data.write_text(record + "\n" if where == "jsonl" else f"[{record}]")
    one_error(*run_cli(["doctor", "--data", data, "--tokenizer", tokenizer_dir], capsys), "line 1",
              "a number of 5,000 digits")


def test_selective_checkpointing_with_5000_digits_as_a_flag(capsys):
    one_error(*run_cli(["estimate", "llama-3.1-8b", "--grad-checkpointing", f"selective:{DIGITS_5000}"], capsys),
              "--grad-checkpointing", "selective:K with K a number of 5,000 digits")


def test_selective_checkpointing_with_5000_digits_in_yaml(tmp_path, model_dir, capsys):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"model: {model_dir}\ngrad_checkpointing: selective:{DIGITS_5000}\n")
    one_error(*run_cli(["estimate", "--config", cfg], capsys), "grad_checkpointing:", "a number of 5,000 digits")


def test_5000_digit_literal_in_a_doctor_script(tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text(f"import os\n\nsteps = {DIGITS_5000}\n")
    one_error(*run_cli(["doctor", script], capsys), "train.py, line 3", "a number of 5,000 digits")


def test_5000_digit_hexadecimal_literal_in_a_doctor_script(tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text(f"from transformers import TrainingArguments\nTrainingArguments(seed=0x{'f' * 5000})\n")
    one_error(*run_cli(["doctor", script], capsys), "train.py, line 2", "a number of 6,021 digits")


def test_doctor_lora_target_modules_that_are_not_names(tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text("from peft import LoraConfig\ncfg = LoraConfig(target_modules=[1, None, {}])\n")
    code, out, err = run_cli(["doctor", script], capsys)
    assert (code, "Traceback" in out + err) == (0, False), err
    assert "no findings" in out


@pytest.mark.parametrize("keyword", ["per_device_train_batch_size", "gradient_accumulation_steps", "max_steps",
                                     "learning_rate", "seed"])
def test_doctor_400_digit_literal_in_training_arguments(tmp_path, model_dir, keyword, capsys):
    script = tmp_path / "train.py"
    script.write_text("from transformers import AutoModelForCausalLM, Trainer, TrainingArguments\n"
                      'model = AutoModelForCausalLM.from_pretrained("meta-llama/Llama-3.1-8B")\n'
                      f"args = TrainingArguments({keyword}={DIGITS_400})\n"
                      "Trainer(model=model, args=args).train()\n")
    code, out, err = run_cli(["doctor", script, "--model", model_dir], capsys)
    assert code in (0, 1) and "Traceback" not in out + err, err
    assert f"{keyword}=a number of 400 digits" in out or keyword in ("learning_rate", "max_steps", "seed"), out


def test_doctor_400_digit_batch_size_is_noted_and_the_default_assumed(tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text("from transformers import AutoModelForCausalLM, Trainer, TrainingArguments\n"
                      'model = AutoModelForCausalLM.from_pretrained("meta-llama/Llama-3.1-8B")\n'
                      f"args = TrainingArguments(per_device_train_batch_size={DIGITS_400} * {DIGITS_400})\n"
                      "Trainer(model=model, args=args).train()\n")
    code, out, err = run_cli(["doctor", script, "--json"], capsys)
    assert code in (0, 1), err
    doc = json.loads(out)
    assert doc["setup"]["batch_size"] == 2  # fitune's default, said
    assert any("must be at most 65536, got a number of 800 digits" in n for n in doc["setup"]["notes"]), doc["setup"]


def test_doctor_four_line_trainer_script_with_a_model_folder(tmp_path, model_dir, capsys):
    script = tmp_path / "train.py"
    script.write_text("from transformers import Trainer, TrainingArguments\n"
                      'args = TrainingArguments(output_dir="o")\n'
                      "trainer = Trainer(model=model, args=args, train_dataset=ds)\n"
                      "trainer.train()\n")
    code, out, err = run_cli(["doctor", script, "--model", model_dir], capsys)
    assert (code, "Traceback" in out + err) == (0, False), err
    assert "FITS" in out and "train.py: no findings" in out


def test_translate_lora_value_beside_lora_r(tmp_path, capsys):
    cfg = tmp_path / "trl.json"
    cfg.write_text(json.dumps({"lora": 5, "lora_r": 8}))
    code, out, err = run_cli(["train", cfg, "--translate"], capsys)
    assert (code, "Traceback" in out + err) == (0, False), err
    assert "not carried over, lora: 5: fitune's lora: is a section (rank, alpha, dropout, targets), not a value" in out
    assert "lora:\n  rank: 8\n" in out  # lora_r carried over


def test_plan_on_720_gpus_is_refused_naming_the_limit(capsys):
    from fitune.plan.search import MAX_PLAN_GPUS

    one_error(*run_cli(["plan", "llama-3.1-8b", "--gpu", "rtx4090", "--gpus", "720", "--batch-size", "720720",
                        "--method", "lora,qlora,full,freeze"], capsys),
              "--gpus 720", f"at most {MAX_PLAN_GPUS} GPUs", "one machine")


def test_plan_search_is_bounded_on_the_largest_request_it_takes():
    """The most GPUs plan takes, a batch with 240 divisors and every method: the estimates the search makes stay
    within MAX_SEARCH_COST (plus the confirmations after it), counted, not timed; the note says where it stopped.
    Before: 89 s on --gpus 720, 74 s on --gpus 8."""
    from fitune.plan import search
    from fitune.specs import load_model_spec
    from fitune.specs.gpu import resolve_gpu

    model = load_model_spec("llama-3.1-8b")
    req = search.PlanRequest(model=model, gpu=resolve_gpu("rtx4090"), batch_size=720720,
                             num_gpus=search.MAX_PLAN_GPUS, methods=("lora", "qlora", "full", "freeze"))
    result = search.plan(req)
    full_cost = max(1, model.num_layers // 5)
    confirmations = search.MAX_CONFIRMATIONS + 2 * len(req.methods) + 8  # _confirm, then the explanations
    assert result.estimated_fast + result.estimated_full * full_cost <= search.MAX_SEARCH_COST + full_cost * (
        confirmations + 3 * 4)  # + the bisection of the option being probed when the bound is reached
    assert result.plans, result.rejected
    counts = [n for n in range(2, 17) if 16 % n == 0]
    assert all(p.setup.num_gpus in [1] + counts for p in result.plans)


def test_plan_gpu_counts_are_thinned_to_one_per_power_of_two():
    from fitune.plan import search
    from fitune.specs import load_model_spec
    from fitune.specs.gpu import resolve_gpu

    req = search.PlanRequest(model=load_model_spec("llama-3.1-8b"), gpu=resolve_gpu("rtx4090"), batch_size=720720,
                             num_gpus=12)
    assert sorted({n for n, _ in search.parallel_options(req, "lora")}) == [1, 3, 6, 12]  # of 2, 3, 4, 6, 12


def _fitune(args: list[str], timeout_s: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "fitune", *args], capture_output=True, text=True, timeout=timeout_s,
                          cwd=ROOT, env=env, stdin=subprocess.DEVNULL)


def test_doctor_data_on_one_20000_turn_conversation_is_linear(tmp_path, tokenizer_dir):
    """One conversation of 20,000 messages: a subprocess with a timeout is the hang guard (before: 77-94 s)."""
    turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": "the cat sat on the mat"} for i in range(20000)]
    data = tmp_path / "long.jsonl"
    data.write_text(json.dumps({"messages": turns}) + "\n")
    run = _fitune(["doctor", "--data", str(data), "--tokenizer", tokenizer_dir], timeout_s=20)
    assert "Traceback" not in run.stdout + run.stderr, run.stderr
    assert run.returncode in (0, 1), run.stderr
    assert "tokens per record: min 160000" in run.stdout



def test_streaming_data_encodes_a_20000_turn_conversation_as_train_does(tmp_path, tokenizer_dir):
    """`data.streaming`'s encoder keeps seq_len too: the long conversation is cut as `fitune train` cuts it, in
    linear time (a subprocess with a timeout is the hang guard), and gives the same tokens as the reader."""
    code = f"""
import json, sys
from transformers import AutoTokenizer
from fitune.data.stream import StreamingBatches
from fitune.data.encode import tokenize_records
from fitune.data.read import read_records
tok = AutoTokenizer.from_pretrained({tokenizer_dir!r})
path = sys.argv[1]
stream = StreamingBatches(path, "train", None, tok, None, seq_len_tokens=64, rows=1, pad_token_id=0, packed=False)
streamed = stream.next_batch()
read, _ = tokenize_records(list(read_records(path)), tok, None, 64)
print(json.dumps({{"streamed": [int(t) for t in streamed.input_ids[0]], "read": list(read[0].input_ids)}}))
"""
    turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": "the cat sat on the mat"} for i in range(20000)]
    data = tmp_path / "long.jsonl"
    data.write_text(json.dumps({"messages": turns}) + "\n")
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    run = subprocess.run([sys.executable, "-c", code, str(data)], capture_output=True, text=True, timeout=20,
                         cwd=ROOT, env=env, stdin=subprocess.DEVNULL)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(out["read"]) == 64 and out["streamed"][:64] == out["read"]

# ---- the generated corpus ---------------------------------------------------------------------------------------

#: Value kinds, as YAML text after `key: ` (and after `--set KEY=`). Add a kind here and every place gets it.
YAML_VALUES = {
    "int-5000-digits": DIGITS_5000,
    "int-negative-5000-digits": "-" + DIGITS_5000,
    "int-4300-digits": "9" * 4300,  # Python reads it: refused by the key's range
    "int-hex-5000-digits": "0x" + "f" * 5000,
    "int-2**63": str(2 ** 63),
    "float-1e308": "1e308",
    "float-1e400": "1e400",  # inf
    "minus-zero": "-0",
    "nan": ".nan",
    "inf": ".inf",
    "minus-inf": "-.inf",
    "text-nan": "nan",
    "int-tag-text": "!!int abc",
    "int-tag-hex-empty": "!!int 0x",
    "bool-tag-0": "!!bool 0",
    "bool-tag-yes": "!!bool yes",
    "float-tag-text": "!!float x",
    "float-tag-list": "!!float [1]",
    "str-tag-number": "!!str 3",
    "str-tag-mapping": "!!str {a: 1}",
    "null-tag-text": "!!null x",
    "binary-tag-bad": "!!binary ???",
    "binary-tag-ok": "!!binary aGVsbG8=",
    "timestamp-tag-text": "!!timestamp x",
    "timestamp-tag-bad-month": "!!timestamp 2001-13-45",
    "timestamp-tag-ok": "!!timestamp 2001-12-14",
    "bad-date": "2024-13-45",
    "date": "2024-01-31",
    "map-tag-text": "!!map x",
    "seq-tag-text": "!!seq x",
    "set-tag": "!!set {a, b}",
    "set-tag-list": "!!set [a]",
    "omap-tag": "!!omap [a: 1]",
    "pairs-tag-text": "!!pairs x",
    "merge-tag": "!!merge x",
    "python-object-tag": "!!python/object:os.system x",
    "python-name-tag": "!!python/name:os.system",
    "custom-tag": "!foo 3",
    "verbatim-tag": "!<tag:example.com,2024:x> 1",
    "surrogate": '"\\ud800"',
    "surrogate-low": '"\\udfff"',
    "nul-character": '"a\\0b"',
    "empty-text": '""',
    "null": "",
    "tilde": "~",
    "nested-list": "[[1, 2], {a: b}]",
    "nested-mapping": "{a: {b: [c]}}",
    "empty-list": "[]",
    "empty-mapping": "{}",
    "true": "true",
    "false": "false",
    "yes": "yes",
    "long-text": "'" + "x" * 20000 + "'",
    "template-text": "'{{ raise_exception(\"x\") }}'",
}


def _yaml_entry(dotted: str, value: str) -> str:
    *outer, last = dotted.split(".")
    text, indent = "", ""
    for part in outer:
        text += f"{indent}{part}:\n"
        indent += "  "
    return f"{text}{indent}{last}: {value}\n"


def _failures(cases, check) -> list[str]:
    """Run `check` on every case; the ids of those that fail, with why (one test per key lists every bad value)."""
    failed = []
    for case_id, case in cases:
        try:
            check(case)
        except AssertionError as exc:
            failed.append(f"{case_id}: {str(exc)[:400]}")
    return failed


@pytest.mark.parametrize("key", [k.yaml for k in ALL_KEYS])
def test_corpus_yaml_config_key(key, tmp_path, model_dir, capsys):
    """Every value kind under `key` in a YAML config given to `fitune estimate --config`."""
    cfg = tmp_path / "run.yaml"

    def check(value: str) -> None:
        head = "" if key == "model" else f"model: {model_dir}\n"
        cfg.write_text(head + _yaml_entry(key, value))
        clean(*run_cli(["estimate", "--config", cfg], capsys))

    assert not _failures(YAML_VALUES.items(), check)


@pytest.mark.parametrize("key", [k.yaml for k in ALL_KEYS])
def test_corpus_set_key(key, capsys):
    """Every value kind as `--set KEY=VALUE` of `fitune train` (the missing model and data stop it before it runs:
    exit 2 whatever the value, with the value's problem first when it has one)."""
    def check(value: str) -> None:
        code, out, err = run_cli(["train", "--model", "/nonexistent/model", "--data", "/nonexistent/d.jsonl",
                                  "--set", f"{key}={value}"], capsys)
        clean(code, out, err, codes=(2,))

    assert not _failures(YAML_VALUES.items(), check)


@pytest.mark.parametrize("key", sorted(set(FOREIGN_KEYS) | {"lora", "data", "peft_config", "use_peft"}))
def test_corpus_translate_foreign_key(key, tmp_path, capsys):
    """Every value kind under another trainer's key (HF Trainer, TRL, PEFT, Axolotl, torchtune), read by `fitune
    train --translate` next to `lora_r: 8` (whose `lora.rank` a scalar `lora:` once broke)."""
    cfg = tmp_path / "axolotl.yaml"

    def check(value: str) -> None:
        cfg.write_text(("lora_r: 8\n" if key != "lora_r" else "") + f"{key}: {value}\n")
        clean(*run_cli(["train", cfg, "--translate"], capsys))

    assert not _failures(YAML_VALUES.items(), check)


#: Value kinds as JSON text, for data records.
JSON_VALUES = {
    "int-5000-digits": DIGITS_5000,
    "int-negative-5000-digits": "-" + DIGITS_5000,
    "int-400-digits": DIGITS_400,
    "float-1e308": "1e308",
    "float-1e400": "1e400",
    "minus-zero": "-0",
    "nan": "NaN",
    "inf": "Infinity",
    "surrogate": '"\\ud800"',
    "surrogate-pair": '"\\ud83d\\ude00"',
    "nul-character": '"a\\u0000b"',
    "empty-text": '""',
    "null": "null",
    "nested-list": "[[1], {}]",
    "nested-mapping": '{"a": {"b": []}}',
    "true": "true",
    "false": "false",
    "long-text": json.dumps("the cat " * 5000),
    "template-text": json.dumps("{{ raise_exception('x') }}{% for m in messages %}"),
    "special-token-text": json.dumps("</s><s><|im_start|>assistant"),
}

#: Places in a data record, `V` standing for the value.
RECORD_PLACES = {
    "text": '{"text": V}',
    "chat-user-content": '{"messages": [{"role": "user", "content": V}, {"role": "assistant", "content": "blue"}]}',
    "chat-assistant-content": '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": V}]}',
    "chat-role": '{"messages": [{"role": V, "content": "hi"}, {"role": "assistant", "content": "blue"}]}',
    "chat-messages": '{"messages": V}',
    "completion-prompt": '{"prompt": V, "completion": "blue"}',
    "completion-completion": '{"prompt": "hi", "completion": V}',
    "alpaca-instruction": '{"instruction": V, "output": "blue"}',
    "sharegpt-value": '{"conversations": [{"from": "human", "value": V}, {"from": "gpt", "value": "blue"}]}',
}


@pytest.mark.parametrize("place", list(RECORD_PLACES))
def test_corpus_data_record_field(place, tmp_path, tokenizer_dir, capsys):
    """Every value kind in one field of a data record (next to a good record), read by `fitune doctor --data`."""
    data = tmp_path / "train.jsonl"
    good = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "blue"}]})

    def check(value: str) -> None:
        data.write_text(good + "\n" + RECORD_PLACES[place].replace("V", value) + "\n")
        clean(*run_cli(["doctor", "--data", data, "--tokenizer", tokenizer_dir], capsys), codes=(0, 1, 2))

    assert not _failures(JSON_VALUES.items(), check)


#: Value kinds as Python source, for the keywords of a training script.
PYTHON_VALUES = {
    "int-400-digits": DIGITS_400,
    "int-negative-400-digits": "-" + DIGITS_400,
    "int-product-of-huge": " * ".join([DIGITS_400] * 12),
    "int-hex-1000-digits": "0x" + "f" * 1000,
    "float-1e308": "1e308",
    "float-overflow": "1e308 * 10",
    "division-overflow": f"{DIGITS_400} / 7",
    "division-by-zero": "1 / 0",
    "minus-zero": "-0",
    "zero": "0",
    "negative": "-3",
    "nan-call": "float('nan')",
    "surrogate": "'\\ud800'",
    "empty-text": "''",
    "none": "None",
    "true": "True",
    "list-of-odd-things": "[1, None, {}]",
    "dict-with-a-list-key": "{(1,): [2], 'a': {}}",
    "set": "{1, 2}",
    "lambda": "lambda: 0",
}

#: Keywords a training script passes, `V` standing for the value.
SCRIPT_PLACES = {
    "batch-size": "TrainingArguments(output_dir='o', per_device_train_batch_size=V)",
    "accumulation": "TrainingArguments(output_dir='o', gradient_accumulation_steps=V)",
    "optim": "TrainingArguments(output_dir='o', optim=V)",
    "lora-rank": "LoraConfig(r=V)",
    "lora-alpha": "LoraConfig(lora_alpha=V)",
    "lora-dropout": "LoraConfig(lora_dropout=V)",
    "lora-targets": "LoraConfig(target_modules=V)",
    "max-length": "SFTConfig(max_length=V)",
    "dtype": "AutoModelForCausalLM.from_pretrained('meta-llama/Llama-3.1-8B', torch_dtype=V)",
    "attn": "AutoModelForCausalLM.from_pretrained('meta-llama/Llama-3.1-8B', attn_implementation=V)",
}

SCRIPT = """\
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments
from peft import LoraConfig, get_peft_model
from trl import SFTConfig
model = AutoModelForCausalLM.from_pretrained("meta-llama/Llama-3.1-8B")
x = {call}
model = get_peft_model(model, x)
Trainer(model=model, args=x).train()
"""


@pytest.mark.parametrize("place", list(SCRIPT_PLACES))
def test_corpus_doctor_script_keyword(place, tmp_path, model_dir, capsys):
    """Every value kind as one keyword of a training script `fitune doctor` reads, and estimates on the tiny model
    (--model: milliseconds where the script's 8B takes a second)."""
    script = tmp_path / "train.py"

    def check(value: str) -> None:
        script.write_text(SCRIPT.format(call=SCRIPT_PLACES[place].replace("V", value)))
        clean(*run_cli(["doctor", script, "--model", model_dir], capsys), codes=(0, 1, 2))

    assert not _failures(PYTHON_VALUES.items(), check)


#: Broken files: each kind is written under each name below and given to the command that reads that file.
BROKEN_FILES = {
    "empty": b"",
    "bom-only": b"\xef\xbb\xbf",
    "nul-bytes": b"\x00\x01\x02\x00",
    "utf-16": 'model: x\n{"text": "hi"}\n'.encode("utf-16"),
    "latin-1": b"model: \xe9t\xe9\n",
    "truncated-json": b'{"messages": [{"role": "user", "content": "hi"',
    "deep-brackets": b"[" * 100_000,
    "deep-braces": b'{"a":' * 50_000,
    "yaml-billion-laughs": b"a: &a [x, x, x, x, x, x, x, x, x]\n" + b"".join(
        f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 9)}]\n".encode() for i in range(8)),
    "lone-carriage-returns": b"a\rb\rc",
    "every-byte": bytes(range(256)) * 16,
    "huge-number": DIGITS_5000.encode(),
    "surrogate-escapes": b'{"text": "\\ud800"}\n["\\udfff"]\n',
}

#: File names and the command that reads each ({path}: the file; {tokenizer}: a tokenizer folder).
BROKEN_PLACES = {
    "config.yaml": ["estimate", "--config", "{path}"],
    "config.json": ["estimate", "--config", "{path}"],
    "train.jsonl": ["doctor", "--data", "{path}", "--tokenizer", "{tokenizer}"],
    "train.json": ["doctor", "--data", "{path}", "--tokenizer", "{tokenizer}"],
    "train.csv": ["doctor", "--data", "{path}", "--tokenizer", "{tokenizer}"],
    "train.py": ["doctor", "{path}"],
    "train.ipynb": ["doctor", "{path}"],
    "translate.yaml": ["train", "{path}", "--translate"],
}


@pytest.mark.parametrize("name", list(BROKEN_PLACES))
def test_corpus_broken_file(name, tmp_path, tokenizer_dir, capsys):
    """Every kind of broken file under each name a command reads: one message (or a result), no traceback."""
    path = tmp_path / name

    def check(content: bytes) -> None:
        path.write_bytes(content)
        argv = [a.format(path=path, tokenizer=tokenizer_dir) for a in BROKEN_PLACES[name]]
        clean(*run_cli(argv, capsys), codes=(0, 1, 2))

    assert not _failures(BROKEN_FILES.items(), check)


#: Chat templates that fail, loop or recurse: each record gets a message (or the tokenizer one), never a traceback.
HOSTILE_TEMPLATES = {
    "raises": "{{ raise_exception('boom') }}",
    "unclosed": "{% for m in messages %}",
    "undefined-attribute": "{{ messages[0].nope.deeper }}",
    "range-too-big": "{% for i in range(100000000) %}x{% endfor %}",
    "recursion": "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",
    "nested-loops": "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}",
    "renders-the-list": "{{ messages }}",
}


#: Those that can loop run in a subprocess, whose timeout is the hang guard.
LOOPING_TEMPLATES = ("nested-loops",)


@pytest.mark.parametrize("name", list(HOSTILE_TEMPLATES))
def test_corpus_hostile_chat_template(name, tmp_path, tokenizer_dir, capsys):
    import shutil

    folder = tmp_path / "tokenizer"
    shutil.copytree(tokenizer_dir, folder)
    (folder / "chat_template.jinja").write_text(HOSTILE_TEMPLATES[name])
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                             {"role": "assistant", "content": "blue"}]}) + "\n")
    argv = ["doctor", "--data", str(data), "--tokenizer", str(folder)]
    if name in LOOPING_TEMPLATES:
        run = _fitune(argv, timeout_s=60)
        clean(run.returncode, run.stdout, run.stderr, codes=(0, 1, 2))
    else:
        clean(*run_cli(argv, capsys), codes=(0, 1, 2))


def test_chat_template_that_writes_a_lone_surrogate(tmp_path, tokenizer_dir, capsys):
    import shutil

    folder = tmp_path / "tokenizer"
    shutil.copytree(tokenizer_dir, folder)
    (folder / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{{ '\\udcff' }}{% endfor %}")
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                             {"role": "assistant", "content": "blue"}]}) + "\n")
    clean(*run_cli(["doctor", "--data", data, "--tokenizer", folder], capsys), codes=(0, 1, 2))

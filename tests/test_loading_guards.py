"""Issue 35 (part D): remote code only when asked for in so many words; what transformers, safetensors and torch
raise while loading a model or tokenizer wrapped into one message naming the file; records that are not valid
Unicode and chat templates that would render for hours refused by name.

Every case runs the exact hostile input of the issue through `fitune train` (`fitune.cli.main.main`) or the
encoder, in tmp_path, on the CPU.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading

import pytest

from fitune.cli.main import main
from fitune.errors import ConfigError, DataError

from tiny import make_chat_data, make_model_folder, make_tokenizer

NESTED_LOOPS = "{% for a in range(100000) %}{% for b in range(100000) %}x{% endfor %}{% endfor %}"
"""The issue's chat template: 10^10 iterations (Jinja's sandbox caps each range() at 100,000 items, not the nest)."""


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> str:
    return make_model_folder(str(tmp_path_factory.mktemp("tiny") / "model"))


@pytest.fixture
def workspace(tmp_path, tiny_folder):
    """(model folder copy, chat data file, tmp_path): the copy is the one a case damages."""
    model = str(tmp_path / "model")
    shutil.copytree(tiny_folder, model)
    data = make_chat_data(str(tmp_path / "chat.jsonl"), n=8)
    return model, data, tmp_path


def _config_text(tmp_path, model: str, data: str, extra: str = "") -> str:
    path = tmp_path / "run.yaml"
    path.write_text(f"model: {model}\ndata:\n  path: {data}\n  format: chat\nmethod: lora\nseq_len: 32\n"
                    f"batch_size: 2\nmax_steps: 1\ndtype: fp32\noutput_dir: {tmp_path / 'out'}\n{extra}",
                    encoding="utf-8")
    return str(path)


def _train_fails(capsys, config: str) -> str:
    """Run `fitune train CONFIG`: exit 2, one error line-block, no traceback; returns stderr."""
    code = main(["train", config])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    assert err.count("fitune train: error:") == 1, err
    return err


def _edit_config_json(model: str, **values) -> None:
    path = os.path.join(model, "config.json")
    with open(path, encoding="utf-8") as f:
        doc = json.load(f)
    doc.update(values)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f)


# ---- 1. trust_remote_code takes the literal true only ---------------------------------------------------------


@pytest.mark.parametrize("written", ["yes", "on", '"true"', "1", "True", "y"])
def test_trust_remote_code_other_spellings_refused(capsys, workspace, written):
    model, data, tmp_path = workspace
    err = _train_fails(capsys, _config_text(tmp_path, model, data, f"trust_remote_code: {written}\n"))
    shown = repr(written)
    assert (f"trust_remote_code: {shown} — only the literal true runs a model folder's own code; write "
            "trust_remote_code: true") in err
    assert not (tmp_path / "out").exists()  # refused before anything ran


def test_trust_remote_code_literal_true_and_the_flag_are_accepted(workspace):
    from fitune.config import config_from_dict
    from fitune.schema import load_config_file

    model, data, tmp_path = workspace
    config = _config_text(tmp_path, model, data, "trust_remote_code: true\n")
    assert config_from_dict(load_config_file(config), config).trust_remote_code is True
    plain = _config_text(tmp_path, model, data)
    assert config_from_dict(load_config_file(plain), plain, flag_values={"trust_remote_code": True}).trust_remote_code
    off = _config_text(tmp_path, model, data, "trust_remote_code: false\n")
    assert config_from_dict(load_config_file(off), off).trust_remote_code is False


def _remote_code_folder(model: str) -> None:
    """The tiny model with an auto_map naming its own .py files; the configuration module raises when run, so the
    test sees whether the announcement came before the folder's code ran."""
    _edit_config_json(model, auto_map={"AutoConfig": "configuration_x.XConfig",
                                       "AutoModelForCausalLM": "modeling_x.XForCausalLM"})
    with open(os.path.join(model, "configuration_x.py"), "w", encoding="utf-8") as f:
        f.write("raise RuntimeError('the folder code ran')\n")
    with open(os.path.join(model, "modeling_x.py"), "w", encoding="utf-8") as f:
        f.write("raise RuntimeError('the folder code ran')\n")


def test_remote_code_files_lists_what_auto_map_names(workspace):
    from fitune.specs.sources import remote_code_files

    model, _, _ = workspace
    assert remote_code_files(model) == []  # no auto_map: transformers runs its own classes only
    _remote_code_folder(model)
    with open(os.path.join(model, "tokenizer_config.json"), encoding="utf-8") as f:
        tok = json.load(f)
    tok["auto_map"] = {"AutoTokenizer": ["tokenization_x.XTokenizer", None]}
    with open(os.path.join(model, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(tok, f)
    assert remote_code_files(model) == ["configuration_x.py", "modeling_x.py", "tokenization_x.py"]


def test_remote_code_is_announced_before_it_runs(workspace, caplog, monkeypatch, tmp_path):
    import transformers.dynamic_module_utils as dynamic

    from fitune.runtime.model import build_model
    from fitune.specs import sources

    monkeypatch.setattr(sources, "_ANNOUNCED", set())
    monkeypatch.setattr(dynamic, "HF_MODULES_CACHE", str(tmp_path / "modules"))
    model, _, _ = workspace
    _remote_code_folder(model)
    events: list[str] = []

    class Recorder(logging.Handler):
        def emit(self, record):
            events.append(record.getMessage())

    handler = Recorder(level=logging.WARNING)
    logging.getLogger("fitune").addHandler(handler)
    try:
        with pytest.raises(ConfigError) as info:
            build_model(model, dtype_name="fp32", device="cpu", init="pretrained", trust_remote_code=True)
    finally:
        logging.getLogger("fitune").removeHandler(handler)
    events.append(str(info.value))
    assert events[0] == f"running code from {model}: configuration_x.py, modeling_x.py (trust_remote_code: true)"
    assert "the folder code ran" in events[-1]  # the code ran after the announcement, and its error names it


# ---- 2. loading errors name the file -------------------------------------------------------------------------


@pytest.mark.parametrize("values, named", [
    ({"hidden_act": "bogus"}, "hidden_act: 'bogus'"),
    ({"rope_scaling": {"type": "bogus"}}, "rope_scaling: {'type': 'bogus'}"),
    ({"pad_token_id": 99999}, "pad_token_id: 99999"),
    # values transformers' config classes validate: refused while the tokenizer is loaded (AutoTokenizer reads
    # config.json to choose the tokenizer class), still named by file and key
    ({"rms_norm_eps": "tiny"}, "rms_norm_eps: 'tiny'"),
    ({"attention_bias": "maybe"}, "attention_bias: 'maybe'"),
    ({"tie_word_embeddings": "yes"}, "tie_word_embeddings: 'yes'"),
    ({"layer_types": ["bogus", "bogus"]}, "layer_types: ['bogus', 'bogus']"),
])
def test_config_json_values_transformers_refuses(capsys, workspace, values, named):
    model, data, tmp_path = workspace
    _edit_config_json(model, **values)
    err = _train_fails(capsys, _config_text(tmp_path, model, data))
    assert f"{os.path.join(model, 'config.json')}: transformers refuses {named} (" in err
    assert "fix the value" in err


def test_config_json_sizes_that_do_not_match_the_weights(capsys, workspace):
    model, data, tmp_path = workspace
    _edit_config_json(model, head_dim=7)
    err = _train_fails(capsys, _config_text(tmp_path, model, data))
    assert (f"model: {model}: the weights' shapes are not those {os.path.join(model, 'config.json')} gives") in err


@pytest.mark.parametrize("damage", ["truncated", "random bytes"])
def test_damaged_safetensors(capsys, workspace, damage):
    model, data, tmp_path = workspace
    weights = os.path.join(model, "model.safetensors")
    with open(weights, "rb") as f:
        raw = f.read()
    with open(weights, "wb") as f:
        f.write(raw[: len(raw) // 2] if damage == "truncated" else os.urandom(4096))
    err = _train_fails(capsys, _config_text(tmp_path, model, data))
    assert f"{weights} is damaged or not a safetensors file (SafetensorError:" in err


def test_pickle_only_model_folder_refused(capsys, workspace):
    import torch
    from safetensors.torch import load_file

    model, data, tmp_path = workspace
    weights = os.path.join(model, "model.safetensors")
    torch.save(load_file(weights), os.path.join(model, "pytorch_model.bin"))
    os.remove(weights)
    err = _train_fails(capsys, _config_text(tmp_path, model, data))
    assert "its weights are pickle files only (pytorch_model.bin); fitune loads safetensors only" in err
    assert "weights_only=False" not in err  # never the advice to turn torch's safety off
    assert "save_pretrained" in err  # the conversion command


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json"])
def test_damaged_tokenizer_files(capsys, workspace, name):
    model, data, tmp_path = workspace
    with open(os.path.join(model, name), "w", encoding="utf-8") as f:
        f.write('{"version": "1.0", "truncat')
    err = _train_fails(capsys, _config_text(tmp_path, model, data))
    assert f"{os.path.join(model, name)} is not valid JSON" in err


# ---- 3. a lone surrogate in a record ---------------------------------------------------------------------------

SURROGATE_LINE = '{"messages": [{"role": "user", "content": "\\ud800"}, {"role": "assistant", "content": "the cat"}]}'


def test_lone_surrogate_in_a_jsonl_record(capsys, workspace):
    model, data, tmp_path = workspace
    good = '{"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "the cat"}]}'
    (tmp_path / "chat.jsonl").write_text(f"{good}\n{good}\n{SURROGATE_LINE}\n", encoding="utf-8")
    err = _train_fails(capsys, _config_text(tmp_path, model, data))
    assert "line 3" in err and "\\ud800" in err and "surrogate" in err


@pytest.mark.parametrize("fmt, record", [
    ("chat", json.loads(SURROGATE_LINE)),
    ("text", {"text": "the \ud800 cat"}),
    ("completion", {"prompt": "the cat", "completion": "sat \ud800"}),
])
def test_lone_surrogate_reaching_the_encoder(tmp_path, fmt, record):
    """Records not read from JSON lines (parquet, the Hub) reach the encoder with the surrogate in them."""
    from fitune.data.encode import encode_records, load_tokenizer, tokenize_records

    tok = load_tokenizer(make_tokenizer(str(tmp_path / "tok")))
    good = {"chat": {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "the cat"}]},
            "text": {"text": "the cat"}, "completion": {"prompt": "the", "completion": "cat"}}[fmt]
    records = [(1, good), (2, good), (3, record)]
    _, _, problems = encode_records(records, tok, fmt, 32)
    assert [(p.line, p.kind) for p in problems] == [(3, "malformed")]
    with pytest.raises(DataError, match=r"line 3: text with an unpaired surrogate \(\\ud800\) at character \d+: not "
                                        r"valid Unicode; fix the record"):
        tokenize_records(records, tok, fmt, 32, source="data.jsonl")


# ---- 4. chat templates rendered within a time limit ------------------------------------------------------------

CHAT = [(1, {"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "the cat"}]})]


def test_nested_loop_template_refused(tmp_path):
    from fitune.data.encode import PROBE_LIMIT_S, encode_records, load_tokenizer

    tok = load_tokenizer(make_tokenizer(str(tmp_path / "tok")))
    tok.chat_template = NESTED_LOOPS
    with pytest.raises(DataError, match=rf"the chat template of .*tok takes too long to render \(over "
                                        rf"{PROBE_LIMIT_S:g} s on a 2-message conversation\)"):
        encode_records(CHAT, tok, "chat", 32)


def test_nested_loop_template_refused_off_the_main_thread(tmp_path):
    """Where SIGALRM cannot be used (another thread), the render runs in a thread that is abandoned at the limit."""
    from fitune.data.encode import encode_records, load_tokenizer

    tok = load_tokenizer(make_tokenizer(str(tmp_path / "tok")))
    tok.chat_template = NESTED_LOOPS.replace("x", "")  # loops that write nothing are bounded too
    caught: list[BaseException] = []

    def work():
        try:
            encode_records(CHAT, tok, "chat", 32)
        except BaseException as exc:  # noqa: BLE001 - handed to the test's thread
            caught.append(exc)

    worker = threading.Thread(target=work)
    worker.start()
    worker.join(60)
    assert not worker.is_alive()
    assert len(caught) == 1 and isinstance(caught[0], DataError)
    assert "takes too long to render" in str(caught[0])


def test_nested_loop_template_through_train(capsys, workspace):
    model, data, tmp_path = workspace
    path = os.path.join(model, "tokenizer_config.json")
    with open(path, encoding="utf-8") as f:
        doc = json.load(f)
    doc["chat_template"] = NESTED_LOOPS
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f)
    for name in ("chat_template.jinja", "chat_template.json"):
        if os.path.exists(os.path.join(model, name)):
            os.remove(os.path.join(model, name))
    err = _train_fails(capsys, _config_text(tmp_path, model, data))
    assert "takes too long to render (over 2 s on a 2-message conversation)" in err


def test_long_real_conversation_still_renders(real_model_dir):
    """The limit bounds runaway templates, not long data: SmolLM2's own template on a 200-turn chat."""
    from fitune.data.encode import encode_records, load_tokenizer

    tok = load_tokenizer(real_model_dir)
    messages = []
    for i in range(100):
        messages += [{"role": "user", "content": f"question {i}: what is {i} plus one?"},
                     {"role": "assistant", "content": f"{i} plus one is {i + 1}."}]
    examples, stats, problems = encode_records([(1, {"messages": messages})], tok, "chat", 8192)
    assert problems == []
    assert stats.examples == 1 and stats.trained_tokens > 100 * 5


@pytest.mark.parametrize("command", [["doctor"], ["plan", "MODEL", "--gpu", "rtx4090"]])
def test_nested_loop_template_through_doctor_and_plan_data(capsys, workspace, command):
    model, data, tmp_path = workspace
    tok = make_tokenizer(str(tmp_path / "slow_tok"))
    path = os.path.join(tok, "tokenizer_config.json")
    with open(path, encoding="utf-8") as f:
        doc = json.load(f)
    doc["chat_template"] = NESTED_LOOPS
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f)
    for name in ("chat_template.jinja", "chat_template.json"):
        if os.path.exists(os.path.join(tok, name)):
            os.remove(os.path.join(tok, name))
    argv = [model if a == "MODEL" else a for a in command] + ["--data", data, "--tokenizer", tok]
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    assert f"the chat template of {tok} takes too long to render (over 2 s on a 2-message conversation)" in err


@pytest.mark.parametrize("value", ["yes", "on", "1", "True", "y"])
def test_set_trust_remote_code_takes_the_literal_true_only(value, tmp_path, capsys):
    """Issue 35: `--set trust_remote_code=yes` was read as true by YAML before the config saw it."""
    from fitune.cli.main import main

    config = tmp_path / "run.yaml"
    config.write_text("model: llama-3.2-1b\ninit: random\ndata:\n  path: d.jsonl\nmax_steps: 1\n")
    assert main(["train", str(config), "--set", f"trust_remote_code={value}"]) == 2
    err = capsys.readouterr().err
    assert f"--set trust_remote_code='{value}': only the literal true" in err and "Traceback" not in err

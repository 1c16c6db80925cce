"""`fitune doctor --data`: token lengths, padding waste, truncation and bad records, on files the tests write, with a
word-level tokenizer built in tmp_path (one token per word, no special prefix: counts are exact).

The scan encodes records as `fitune train` does (fitune.data), so text and completion records end with the eos
token: a text of n words is n + 1 tokens."""

import json
import re

import pytest

from fitune.cli.main import main
from fitune.data import padding_costs
from fitune.doctor.data import scan_data
from fitune.doctor.findings import DataError

CHAT_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} {% endfor %}"


def make_tokenizer(path, chat_template: str | None = None) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["a b c user assistant : < >"],
                            trainers.WordLevelTrainer(special_tokens=["[UNK]", "[PAD]", "</s>"]))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", eos_token="</s>")
    if chat_template:
        fast.chat_template = chat_template
    fast.save_pretrained(str(path))
    return str(path)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


def words(n: int) -> str:
    return " ".join(["a"] * n)


def write_jsonl(path, records) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records), encoding="utf-8")
    return str(path)


def test_lengths_padding_and_truncation_are_exact(tmp_path, tokenizer):
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": words(n - 1)} for n in (2, 4, 6, 8, 10)])  # + eos
    rep = scan_data(data, tokenizer, seq_len_tokens=8, batch_size=2)
    assert rep.format == "text" and rep.lengths_tokens == (2, 4, 6, 8, 10)
    # truncated at 8: 2 4 6 8 8 = 28 real tokens
    to_max, dynamic, packing = rep.padding
    assert (to_max.slot_tokens, to_max.real_tokens) == (40, 28)  # 5 x 8
    assert dynamic.slot_tokens == 2 * 4 + 2 * 8 + 1 * 8  # batches (2,4) (6,8) (8)
    assert packing.slot_tokens == 32  # ceil(28 / 8) rows of 8
    assert (rep.truncated_records, rep.truncated_tokens) == (1, 2)
    assert [(f.rule, f.line) for f in rep.findings] == [("data-truncated", 5)]
    assert rep.length_stats()["median"] == 6 and rep.length_stats()["max"] == 10


def test_padding_costs_by_hand():
    to_max, dynamic, packing = padding_costs([1, 1, 1, 100], seq_len=64, batch_size=2)
    assert (to_max.slot_tokens, dynamic.slot_tokens, packing.slot_tokens) == (256, 2 + 128, 128)
    assert to_max.real_tokens == 67 and round(to_max.padding_share, 4) == round(1 - 67 / 256, 4)


def test_bad_records_are_reported_by_line_and_the_rest_is_scanned(tmp_path, tokenizer):
    path = tmp_path / "d.jsonl"
    write_jsonl(path, [{"text": words(3)}, {"text": ""}, "{not json", {"prompt": "a", "completion": "b"},
                       {"text": words(5)}])
    with open(path, "ab") as f:
        f.write(b'{"text": "a \xff b"}\n')
    rep = scan_data(str(path), tokenizer, seq_len_tokens=8)
    assert rep.lengths_tokens == (4, 6)  # 3 and 5 words, + eos
    assert [(f.rule, f.line, f.severity) for f in rep.findings] == [
        ("data-empty-record", 2, "warning"), ("data-bad-json", 3, "error"), ("data-malformed", 4, "error"),
        ("data-not-utf8", 6, "error")]
    assert "line 3: not valid JSON" in rep.findings[1].message
    assert "0xff at byte" in rep.findings[3].message
    assert "line 4: missing field 'text'" in rep.findings[2].message
    assert rep.dropped_lines == (2,) and "fitune train drops it" in rep.findings[0].message


def test_chat_records_use_the_chat_template_when_there_is_one(tmp_path):
    conv = {"messages": [{"role": "user", "content": "a b"}, {"role": "assistant", "content": "c"}]}
    data = write_jsonl(tmp_path / "chat.jsonl", [conv])
    with_template = scan_data(data, make_tokenizer(tmp_path / "t1", CHAT_TEMPLATE))
    # "<user> a b <assistant> c ": < user > a b < assistant > c = 9 words and marks (the template ends the turn)
    assert with_template.chat_template and with_template.lengths_tokens == (9,)
    # without a template fitune train cannot render a chat, so neither does the doctor: it says so, as training does
    with pytest.raises(DataError, match="format chat renders conversations with the tokenizer's chat template"):
        scan_data(data, make_tokenizer(tmp_path / "t2"))


def test_completion_records_and_json_lists_with_line_numbers(tmp_path, tokenizer):
    path = tmp_path / "d.json"
    path.write_text('[\n  {"prompt": "a b", "completion": "c"},\n  {"prompt": "a", "completion": ""}\n]\n',
                    encoding="utf-8")
    rep = scan_data(str(path), tokenizer, seq_len_tokens=4)
    assert rep.format == "completion" and rep.lengths_tokens == (4,)  # a b c + eos
    # .json records are numbered by their index in the list (as fitune train's errors number them)
    assert [(f.rule, f.line) for f in rep.findings] == [("data-empty-record", 2)]
    assert rep.findings[0].message.startswith("record 2: no token to train on (the completion is empty)")


def test_padding_waste_is_an_info_finding(tmp_path, tokenizer):
    data = write_jsonl(tmp_path / "short.jsonl", [{"text": words(3)}] * 10)  # 4 tokens with eos
    rep = scan_data(data, tokenizer, seq_len_tokens=64)
    (f,) = rep.findings
    assert f.rule == "data-padding-waste" and f.severity == "info" and "93.8 %" in f.message  # 1 - 40/640


@pytest.mark.parametrize("content, message", [
    (b"", "is empty"),
    (b"\n\n", "is empty"),
    (b'{"foo": 1}\n', "no record has a known format; keys found: ['foo']. fitune reads chat"),
    (b'{oops\n{"text": \n', "d.jsonl: 2 bad records; fix or delete them:\n  line 1: not valid JSON"),
    (b'[{"text": "a"},\n {"text": "b" \n]', "d.json, line 3: not valid JSON: Expecting ',' delimiter"),
    (b'[{"text": "a"} {"text": "b"}]', "d.json, line 1: not valid JSON: Expecting ',' delimiter"),
    (b'[{"text": "a"},\n {"text": "\xff"}]', "d.json, line 2: bytes that are not UTF-8 (0xff"),
])
def test_unusable_files_raise_a_clear_error(tmp_path, tokenizer, content, message):
    path = tmp_path / ("d.json" if content.startswith(b"[") else "d.jsonl")
    path.write_bytes(content)
    with pytest.raises(DataError, match=re.escape(message)):
        scan_data(str(path), tokenizer)


# ---- the command line ------------------------------------------------------------------------------------------
def test_cli_prints_histogram_and_padding(tmp_path, tokenizer, capsys):
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": words(n - 1)} for n in (10, 20, 40, 80, 300)])  # + eos
    assert main(["doctor", "--data", data, "--tokenizer", tokenizer, "--seq-len", "256"]) == 0
    out = capsys.readouterr().out
    assert f"{data}: 5 text records, seq len 256, batch 8" in out
    assert re.search(r"^ +1-32 +2  #{40}$", out, re.M) and re.search(r"^ +129-256 +0$", out, re.M)
    assert re.search(r"^ +257-512 +1  #{20} +longer than 256: truncated$", out, re.M)
    assert "pad every record to 256" in out and "pack into rows of 256" in out
    assert "truncated at 256 tokens: 1 record, 44 tokens" in out


def test_cli_json_and_exit_code_1_on_bad_records(tmp_path, tokenizer, capsys):
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": words(3)}, "{oops"])
    assert main(["doctor", "--data", data, "--tokenizer", tokenizer, "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert {"file", "format", "records", "seq_len_tokens", "batch_size", "length_tokens", "histogram", "padding",
            "truncated_records", "truncated_tokens", "findings"} <= set(doc)
    assert set(doc["padding"]) == {"max_length", "dynamic", "packing"}
    assert doc["findings"][0]["rule"] == "data-bad-json" and doc["findings"][0]["line"] == 2


@pytest.mark.parametrize("argv, message", [
    (["--data", "{data}"], "--data needs --tokenizer DIR"),
    (["--data", "{data}", "--tokenizer", "{tmp}/nope"], "no such folder"),
    (["--data", "{tmp}/missing.jsonl", "--tokenizer", "{tok}"], "no such file"),
    (["--data", "{empty}", "--tokenizer", "{tok}"], "is empty"),
])
def test_cli_bad_input_exits_2(tmp_path, tokenizer, capsys, argv, message):
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": "a"}])
    (tmp_path / "empty.jsonl").write_bytes(b"")
    fill = {"data": data, "tmp": str(tmp_path), "tok": tokenizer, "empty": str(tmp_path / "empty.jsonl")}
    assert main(["doctor", *[a.format(**fill) for a in argv]]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err

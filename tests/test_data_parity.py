"""One data path: `fitune train`, `fitune doctor --data` and `fitune plan --data` count the same tokens and the same
truncation on the same file, because all three encode it with fitune.data. Chat and completion files, each with a
record cut by truncation but kept, one whose answer truncation cuts away, and one with nothing to train on."""

import json
import logging

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from fitune.cli.main import main  # noqa: E402
from fitune.cli.plan import truncated_said  # noqa: E402
from fitune.data import load_tokenizer, read_records, tokenize_records  # noqa: E402
from fitune.plan.data import choose_seq_len, profile_data  # noqa: E402
from tiny import make_tokenizer  # noqa: E402

SEQ_LEN = 16


def chat(question, answer=None):
    messages = [{"role": "user", "content": question}]
    if answer is not None:
        messages.append({"role": "assistant", "content": answer})
    return {"messages": messages}


LONG = " ".join(["the big red dog ran home"] * 4)  # 24 words: longer than SEQ_LEN on its own
FILES = {
    "chat": [
        chat("what color is the sky", "blue"),  # 10 tokens
        chat("what is the cat", LONG),  # the answer runs past SEQ_LEN: truncated, kept
        chat(LONG, "yes"),  # the answer starts past SEQ_LEN: truncated, then dropped
        chat("hello world"),  # no assistant turn: nothing to train on, dropped
        chat("what color is the grass", "green green"),
    ],
    "completion": [
        {"prompt": "what color is the sky", "completion": "blue"},
        {"prompt": "what is the cat", "completion": LONG},  # truncated, kept
        {"prompt": LONG, "completion": "yes"},  # truncated, then dropped
        {"prompt": "hello world", "completion": ""},  # nothing to train on, dropped
        {"prompt": "what color is the grass", "completion": "green green"},
    ],
}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return make_tokenizer(str(tmp_path_factory.mktemp("tok")))


def write(tmp_path, fmt):
    path = tmp_path / f"{fmt}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in FILES[fmt]), encoding="utf-8")
    return str(path)


@pytest.mark.parametrize("fmt", ["chat", "completion"])
def test_train_doctor_and_plan_count_the_same_tokens(tmp_path, tokenizer_dir, capsys, fmt):
    path = write(tmp_path, fmt)
    # what fitune train's loop does with the file
    examples, stats = tokenize_records(read_records(path), load_tokenizer(tokenizer_dir), None, SEQ_LEN)
    assert stats.format == fmt and stats.examples == len(examples) == 3
    assert stats.truncated_lines == (2, 3) and stats.truncated_away_lines == (3,) and stats.empty_lines == (4,)
    assert stats.dropped_lines == (3, 4) and stats.lengths == [len(e) for e in examples]
    assert len(stats.lengths_tokens) == 4 and max(stats.lengths_tokens) > SEQ_LEN

    # fitune doctor --data
    assert main(["doctor", "--data", path, "--tokenizer", tokenizer_dir, "--seq-len", str(SEQ_LEN), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["format"] == fmt and doc["records"] == len(stats.lengths_tokens)
    assert doc["length_tokens"]["max"] == max(stats.lengths_tokens)
    assert doc["length_tokens"]["mean"] == pytest.approx(sum(stats.lengths_tokens) / len(stats.lengths_tokens))
    assert (doc["truncated_records"], doc["truncated_tokens"]) == (stats.truncated_records, stats.truncated_tokens)
    assert doc["truncated_records"] == 2  # the dropped record counts: truncation is what emptied it
    assert doc["padding"]["dynamic"]["real_tokens"] == stats.tokens  # what training batches
    assert doc["dropped_lines"] == [3, 4]
    rules = {(f["rule"], f["line"]) for f in doc["findings"]}
    assert {("data-truncated", 2), ("data-truncated-away", 3), ("data-empty-record", 4)} <= rules

    # fitune plan --data: the same lengths; at the same sequence length, the same truncation
    profile = profile_data(path, tokenizer_dir)
    assert profile.lengths_tokens == stats.lengths_tokens
    assert choose_seq_len(profile, SEQ_LEN) == (SEQ_LEN, stats.truncated_records)
    assert main(["plan", "llama-3.2-1b", "--gpu", "rtx4090", "--data", path, "--tokenizer", tokenizer_dir,
                 "--seq-len", str(SEQ_LEN), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["request"]["seq_len_tokens"] == SEQ_LEN
    assert plan["data"]["examples"] == doc["records"] and plan["data"]["max_tokens"] == doc["length_tokens"]["max"]
    assert any(truncated_said(stats.truncated_records) in note for note in plan["notes"])


def test_fitune_train_says_which_records_it_drops(tmp_path, caplog):
    pytest.importorskip("torch")
    pytest.importorskip("peft")
    from tiny import make_model_folder, write_config

    model = make_model_folder(str(tmp_path / "model"))
    cfg = write_config(str(tmp_path / "run.yaml"), model=model, data={"path": write(tmp_path, "chat")}, max_steps=1,
                       seq_len=SEQ_LEN, batch_size=2, output_dir=str(tmp_path / "out"))
    with caplog.at_level(logging.INFO):
        assert main(["train", cfg, "--no-progress"]) == 0
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("dropped 2 records" in w and "(line 4:" in w and "(line 3;" in w for w in warnings), warnings
    info = " ".join(r.getMessage() for r in caplog.records)
    assert "3 examples" in info and "2 truncated at 16 tokens" in info and "2 dropped" in info


def test_the_truncation_note_counts_in_words():
    assert truncated_said(0) == ""
    assert truncated_said(1) == " (1 longer example is truncated)"
    assert truncated_said(1234) == " (1,234 longer examples are truncated)"

"""Data formats and sources: every format and file type through the real readers, its labels with the real
tokenizer (SmolLM2-135M-Instruct, ChatML), two training steps of each on the CPU quick-start model, Hub data set
ids read from a fabricated Hugging Face cache (offline; never the network), and what doctor --data and plan --data
say about the format."""

from __future__ import annotations

import csv
import itertools
import json
import os

import pytest

from fitune.data import load_tokenizer, read_records, scan_records, tokenize_records
from fitune.data.convert import ALPACA_PROMPT
from fitune.data.encode import IGNORE_INDEX
from fitune.data.formats import FORMATS, detect_format
from fitune.data.read import iter_records
from fitune.errors import ConfigError, DataError

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

# One record of each format, with the answer training must learn (and only that).
ALPACA = {"instruction": "Name the colour of the sky.", "input": "On a clear day.", "output": "Blue.",
          "system": "Answer in one word."}
SHAREGPT = {"system": "Be brief.", "conversations": [{"from": "human", "value": "Hi there"},
                                                     {"from": "gpt", "value": "Hello!"}]}
CHAT = {"messages": [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"}]}
COMPLETION = {"prompt": "The capital of France is", "completion": " Paris."}
CONVERSATIONAL = {"prompt": [{"role": "user", "content": "Two plus two?"}, {"role": "assistant", "content": "Four."},
                             {"role": "user", "content": "And three plus three?"}],
                  "completion": [{"role": "assistant", "content": "Six."}]}
TEXT = {"text": "The quick brown fox."}
RECORDS = {"alpaca": ALPACA, "sharegpt": SHAREGPT, "chat": CHAT, "completion": COMPLETION,
           "conversational_completion": CONVERSATIONAL, "text": TEXT}


def _jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return str(path)


# ---------------------------------------------------------------------------------------------------- formats


def test_the_records_cover_every_format_and_each_is_detected():
    assert set(RECORDS) == set(FORMATS)
    for fmt, record in RECORDS.items():
        assert detect_format([(1, record)]) == fmt


def test_sharegpt_role_and_content_keys_are_detected_too():
    record = {"conversations": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]}
    assert detect_format([(1, record)]) == "sharegpt"
    assert detect_format([(1, {"instruction": "x", "output": "y"})]) == "alpaca"  # input is optional


@pytest.fixture(scope="module")
def real_tok(real_model_dir):
    return load_tokenizer(real_model_dir)


def _trained_text(tok, example) -> str:
    return tok.decode([t for t, label in zip(example.input_ids, example.labels) if label != IGNORE_INDEX])


@pytest.mark.parametrize("fmt, answer", [
    ("alpaca", "Blue."), ("sharegpt", "Hello!"), ("chat", "Hello!"), ("completion", " Paris."),
    ("conversational_completion", "Six."),
])
def test_labels_are_the_answer_and_the_end_of_turn_token(real_tok, fmt, answer):
    (example,), stats = tokenize_records([(1, RECORDS[fmt])], real_tok, None, 512)
    assert stats.format == fmt
    # a rendered conversation ends its turn with ChatML's <|im_end|>; a completion gets the tokenizer's eos (this
    # tokenizer, converted from the GGUF file, names <|im_start|> its eos)
    end = "<|im_end|>" if stats.chat_template else real_tok.eos_token
    assert stats.chat_template == (fmt != "completion")
    assert _trained_text(real_tok, example) == answer + end
    # the trained tokens are one run at the end (only the newline ChatML writes after <|im_end|> follows): nothing
    # of the prompt, system or earlier turns
    trained = [k for k, label in enumerate(example.labels) if label != IGNORE_INDEX]
    assert trained == list(range(trained[0], trained[-1] + 1))
    assert real_tok.decode(example.input_ids[trained[-1] + 1:]) == ("\n" if stats.chat_template else "")


def test_text_trains_every_token_but_the_first(real_tok):
    (example,), stats = tokenize_records([(1, TEXT)], real_tok, None, 512)
    ids = real_tok("The quick brown fox.", add_special_tokens=False)["input_ids"]
    assert list(example.input_ids) == ids + [real_tok.eos_token_id]
    assert _trained_text(real_tok, example) == real_tok.decode(ids[1:]) + real_tok.eos_token


def test_alpaca_becomes_chat_messages_with_a_chat_template(real_tok):
    (example,), stats = tokenize_records([(1, ALPACA)], real_tok, "instruction", 512)  # an alias of alpaca
    assert stats.format == "alpaca" and stats.chat_template
    messages = [{"role": "system", "content": "Answer in one word."},
                {"role": "user", "content": "Name the colour of the sky.\n\nOn a clear day."},
                {"role": "assistant", "content": "Blue."}]
    rendered = real_tok.apply_chat_template(messages, tokenize=False)
    assert real_tok.decode(example.input_ids) == rendered
    no_input = {"instruction": "Say hi.", "input": "", "output": "Hi."}
    (plain,), _ = tokenize_records([(1, no_input)], real_tok, None, 512)
    chat = [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi."}]
    assert real_tok.decode(plain.input_ids) == real_tok.apply_chat_template(chat, tokenize=False)


def test_alpaca_without_a_chat_template_is_the_stanford_prompt(real_model_dir):
    tok = load_tokenizer(real_model_dir)
    tok.chat_template = None
    (example,), stats = tokenize_records([(1, ALPACA)], tok, None, 512)
    assert stats.format == "alpaca" and not stats.chat_template
    prompt = ("Answer in one word.\n\nBelow is an instruction that describes a task, paired with an input that "
              "provides further context. Write a response that appropriately completes the request.\n\n"
              "### Instruction:\nName the colour of the sky.\n\n### Input:\nOn a clear day.\n\n### Response:")
    assert prompt == "Answer in one word.\n\n" + ALPACA_PROMPT["prompt_input"].format(**ALPACA)
    assert tok.decode(example.input_ids) == prompt + "Blue." + tok.eos_token
    assert _trained_text(tok, example) == "Blue." + tok.eos_token
    with pytest.raises(DataError, match="format sharegpt renders conversations with the tokenizer's chat template"):
        tokenize_records([(1, SHAREGPT)], tok, None, 512)


def test_conversational_completion_trains_only_the_completion(real_tok):
    # as chat, the same messages would train the prompt's "Four." as well
    (as_chat,), _ = tokenize_records([(1, {"messages": CONVERSATIONAL["prompt"] + CONVERSATIONAL["completion"]})],
                                     real_tok, None, 512)
    assert _trained_text(real_tok, as_chat) == "Four.<|im_end|>Six.<|im_end|>"
    (example,), _ = tokenize_records([(1, CONVERSATIONAL)], real_tok, None, 512)
    assert example.input_ids == as_chat.input_ids
    assert _trained_text(real_tok, example) == "Six.<|im_end|>"


def test_bad_sharegpt_and_alpaca_records_are_named_by_number(real_tok):
    tool = {"conversations": [{"from": "human", "value": "Hi"}, {"from": "tool", "value": "{}"}]}
    with pytest.raises(DataError, match=r"line 2: conversations\[1\]\.from is 'tool', not a role fitune knows; "
                                        r"known: human, user, gpt, assistant, chatgpt, bing, bard, model, system"):
        tokenize_records([(1, SHAREGPT), (2, tool)], real_tok, None, 512)
    with pytest.raises(DataError, match=r"line 1: missing field 'output' \(keys found: \['instruction'\]\)"):
        tokenize_records([(1, {"instruction": "x"})], real_tok, "alpaca", 512)
    with pytest.raises(DataError, match=r"line 1: field 'input' is a number, not a string"):
        tokenize_records([(1, {"instruction": "x", "input": 3, "output": "y"})], real_tok, None, 512)


def test_the_config_takes_every_format_and_its_aliases(tmp_path):
    from fitune.config import DATA_FORMATS, config_from_dict

    assert DATA_FORMATS == FORMATS  # one list
    data = _jsonl(tmp_path / "d.jsonl", [ALPACA])
    (tmp_path / "m").mkdir()
    base = {"model": str(tmp_path / "m"), "init": "random", "tokenizer": str(tmp_path / "m"), "max_steps": 1,
            "output_dir": str(tmp_path / "o")}
    for typed, fmt in (("alpaca", "alpaca"), ("instruction", "alpaca"), ("ShareGPT", "sharegpt"),
                       ("conversations", "sharegpt"), ("messages", "chat"), ("prompt_completion", "completion"),
                       ("conversational_prompt_completion", "conversational_completion")):
        doc = {**base, "data": {"path": data, "format": typed}}
        assert config_from_dict(doc, "t", ).data.format == fmt
    with pytest.raises(ConfigError, match=r"epochs: 1 cannot be counted with data.streaming true: records are read "
                                          r"as training needs them.*give max_steps instead"):
        config_from_dict({**base, "max_steps": None, "epochs": 1, "data": {"path": data, "streaming": True}}, "t")
    with pytest.raises(ConfigError, match=r"data.subset: 'x' names a subset of a Hub data set, but data.path "
                                          r"\S+d.jsonl is a local file or folder; remove it"):
        config_from_dict({**base, "data": {"path": data, "subset": "x"}}, "t")


# ---------------------------------------------------------------------------------------------------- file types


def test_csv_with_quoted_newlines_and_commas(tmp_path):
    path = tmp_path / "alpaca.csv"
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["instruction", "input", "output"])
        w.writerow(["Write two lines.", "", "one,\ntwo"])
        w.writerow(["Say hi.", "to Bob", "Hi Bob."])
    assert read_records(str(path)) == [
        (1, {"instruction": "Write two lines.", "input": "", "output": "one,\ntwo"}),
        (2, {"instruction": "Say hi.", "input": "to Bob", "output": "Hi Bob."}),
    ]
    assert detect_format(read_records(str(path))) == "alpaca"
    bad = tmp_path / "bad.csv"
    bad.write_text("prompt,completion\na,b\nc,d,e\n", encoding="utf-8")
    records, problems = scan_records(str(bad))
    assert records == [(1, {"prompt": "a", "completion": "b"})]
    assert [(p.line, p.kind) for p in problems] == [(2, "malformed")]
    assert problems[0].message.startswith("3 fields, but the header row has 2 (prompt, completion)")


def test_tsv(tmp_path):
    path = tmp_path / "d.tsv"
    path.write_text('prompt\tcompletion\nThe sky is\t"blue\tand\nwide"\n', encoding="utf-8")
    assert read_records(str(path)) == [(1, {"prompt": "The sky is", "completion": "blue\tand\nwide"})]


def test_txt_is_one_text_record_per_non_blank_line(tmp_path):
    path = tmp_path / "d.txt"
    path.write_bytes(b"\xef\xbb\xbffirst line\r\n\nsecond line\n   \nthird")
    assert read_records(str(path)) == [(1, {"text": "first line"}), (3, {"text": "second line"}),
                                       (5, {"text": "third"})]
    assert read_records(str(path)).unit == "line"


def test_parquet_with_nested_messages(tmp_path):
    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist([CONVERSATIONAL, CONVERSATIONAL]), str(path))
    assert read_records(str(path)) == [(1, CONVERSATIONAL), (2, CONVERSATIONAL)]
    assert list(iter_records(str(path))) == [(1, CONVERSATIONAL), (2, CONVERSATIONAL)]


def test_json_list_and_jsonl(tmp_path):
    (tmp_path / "d.json").write_text(json.dumps([SHAREGPT, ALPACA]))
    assert read_records(str(tmp_path / "d.json")) == [(1, SHAREGPT), (2, ALPACA)]
    path = _jsonl(tmp_path / "d.jsonl", [CHAT, COMPLETION])
    assert read_records(path) == [(1, CHAT), (2, COMPLETION)]
    assert list(iter_records(path)) == [(1, CHAT), (2, COMPLETION)]


def test_save_to_disk_folder_and_its_split(tmp_path):
    datasets = pytest.importorskip("datasets")
    folder = tmp_path / "saved"
    datasets.DatasetDict({"train": datasets.Dataset.from_list([TEXT]),
                          "validation": datasets.Dataset.from_list([{"text": "held out"}])}).save_to_disk(str(folder))
    assert read_records(str(folder)) == [(1, TEXT)]
    assert read_records(str(folder), split="validation") == [(1, {"text": "held out"})]
    with pytest.raises(DataError, match=r"holds the splits \['train', 'validation'\] and none is called 'test'; "
                                        "set data.split"):
        read_records(str(folder), split="test")


# ---------------------------------------------------------------------------------------------------- the Hub

REVISION = "0123456789abcdef0123456789abcdef01234567"
HUB_ROWS = 50


def _fabricate_hub_cache(root) -> str:
    """A Hub cache holding data set org/alpaca-demo as `hf download` leaves it: refs/main -> a commit, its snapshot
    with two subsets (default: data/, 50 train rows and 2 test rows; short: short/, 3 train rows) declared in the
    README's `configs:`, as the Hub writes them."""
    repo = root / "hub" / "datasets--org--alpaca-demo"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(REVISION)
    snapshot = repo / "snapshots" / REVISION
    for folder, split, n in (("data", "train", HUB_ROWS), ("data", "test", 2), ("short", "train", 3)):
        (snapshot / folder).mkdir(parents=True, exist_ok=True)
        rows = [{"instruction": f"what color is the {folder} {split} {i}", "input": "", "output": "the answer is red"}
                for i in range(n)]
        pq.write_table(pa.Table.from_pylist(rows), str(snapshot / folder / f"{split}-00000-of-00001.parquet"))
    (snapshot / "README.md").write_text(
        "---\nconfigs:\n- config_name: default\n  data_files:\n  - split: train\n    path: data/train-*\n"
        "  - split: test\n    path: data/test-*\n- config_name: short\n  data_files:\n  - split: train\n"
        "    path: short/train-*\n---\n# demo\n")
    return str(root)


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    pytest.importorskip("datasets")
    home = _fabricate_hub_cache(tmp_path)
    monkeypatch.setenv("HF_HOME", home)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HF_DATASETS_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    return home


def test_a_hub_id_is_read_from_the_cache_with_its_split_and_subset(hub_cache):
    records = read_records("org/alpaca-demo")
    assert len(records) == HUB_ROWS and records.unit == "record"
    assert records[0] == (1, {"instruction": "what color is the data train 0", "input": "", "output":
                              "the answer is red"})
    assert [r["instruction"] for _, r in read_records("org/alpaca-demo", split="test")] == [
        "what color is the data test 0", "what color is the data test 1"]
    assert [r["instruction"] for _, r in read_records("org/alpaca-demo", subset="short")] == [
        f"what color is the short train {i}" for i in range(3)]
    assert detect_format(records) == "alpaca"
    with pytest.raises(DataError, match=r"org/alpaca-demo: has no split 'validation'; its splits: train, test"):
        read_records("org/alpaca-demo", split="validation")
    with pytest.raises(DataError, match=r"has no subset 'long'; its subsets: default, short"):
        read_records("org/alpaca-demo", subset="long")
    # the prepared Arrow files went under HF_HOME, not the user's cache
    assert os.path.isdir(os.path.join(hub_cache, "datasets"))


def test_a_streamed_hub_id_is_read_lazily(hub_cache, real_tok):
    from fitune.data.stream import DETECT_RECORDS, StreamingBatches

    assert [n for n, _ in itertools.islice(iter_records("org/alpaca-demo"), 3)] == [1, 2, 3]
    detected = StreamingBatches("org/alpaca-demo", "train", None, real_tok, None, 128, rows=2, pad_token_id=0,
                                packed=False)
    assert detected.format == "alpaca"
    assert detected.records_read == DETECT_RECORDS  # detection reads ahead a little; training reuses those records
    stream = StreamingBatches("org/alpaca-demo", "train", None, real_tok, "alpaca", 128, rows=2, pad_token_id=0,
                              packed=False)
    assert stream.records_read == 2  # the first batch's records, read before training starts
    first, second = stream.next_batch(), stream.next_batch()
    assert (first.rows, second.rows) == (2, 2)
    assert stream.records_read == 4  # two batches of two: 4 of the 50 records read
    assert first.input_ids.tolist() == detected.next_batch().input_ids.tolist()  # the same records, in order
    resumed = StreamingBatches("org/alpaca-demo", "train", None, real_tok, "alpaca", 128, rows=2, pad_token_id=0,
                               packed=False)
    state = stream.state_dict()
    third = stream.next_batch()
    resumed.load_state_dict(state)
    assert resumed.next_batch().input_ids.tolist() == third.input_ids.tolist()
    short = StreamingBatches("org/alpaca-demo", "train", "short", real_tok, None, 128, rows=2, pad_token_id=0,
                             packed=False)
    assert [short.next_batch().rows for _ in range(3)] == [2, 1, 2]  # 3 records: an epoch, then the next one
    assert short.epoch == 1


def test_a_hub_id_not_cached_offline_names_the_download_command(hub_cache):
    with pytest.raises(DataError, match=r"org/missing: not a local file or folder, and not a data set in the Hugging "
                                        r"Face cache .*offline.*`hf download org/missing --repo-type dataset`"):
        read_records("org/missing")
    with pytest.raises(DataError, match=r"data/train.jsonl: no such file or folder"):  # a missing file stays one
        read_records("data/train.jsonl")


# ---------------------------------------------------------------------------------------------------- training

# Records in the quick-start model's words (fitune/train/quickstart.py: WORDS), one file per format and file type.
QS_RECORDS = {
    "alpaca": {"instruction": "what color is the cat", "input": "", "output": "the answer is red"},
    "sharegpt": {"conversations": [{"from": "human", "value": "what color is the dog"},
                                   {"from": "gpt", "value": "the answer is blue"}]},
    "chat": {"messages": [{"role": "user", "content": "what color is the sky"},
                          {"role": "assistant", "content": "the answer is white"}]},
    "completion": {"prompt": "what color is the mat", "completion": "the answer is green"},
    "conversational_completion": {"prompt": [{"role": "user", "content": "what color is the hat"}],
                                  "completion": [{"role": "assistant", "content": "the answer is black"}]},
    "text": {"text": "the car is red"},
}


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory):
    pytest.importorskip("torch")
    pytest.importorskip("peft")
    from fitune.train.quickstart import write_quickstart

    folder = tmp_path_factory.mktemp("qs")
    write_quickstart(str(folder))
    return folder


def _train_two_steps(quickstart, out: str, data: dict):
    from fitune.config import config_from_dict
    from fitune.train.loop import train

    doc = {"model": str(quickstart / "model"), "data": data, "method": "lora",
           "lora": {"rank": 4, "alpha": 8, "targets": ["q_proj", "v_proj"]}, "dtype": "fp32", "seq_len": 32,
           "batch_size": 2, "max_steps": 2, "lr": 1e-3, "output_dir": str(quickstart / out)}
    return train(config_from_dict(doc, "test"), progress=False)


@pytest.mark.slow
@pytest.mark.parametrize("fmt, suffix", [
    ("alpaca", ".csv"), ("sharegpt", ".json"), ("chat", ".jsonl"), ("completion", ".tsv"),
    ("conversational_completion", ".parquet"), ("text", ".txt"),
])
def test_every_format_trains_two_steps(quickstart, fmt, suffix, caplog):
    record = QS_RECORDS[fmt]
    path = quickstart / f"{fmt}{suffix}"
    if suffix in (".csv", ".tsv"):
        with open(path, "w", newline="", encoding="utf-8") as f:
            w = csv.DictWriter(f, fieldnames=list(record), delimiter="," if suffix == ".csv" else "\t")
            w.writeheader()
            w.writerows([record] * 4)
    elif suffix == ".json":
        path.write_text(json.dumps([record] * 4))
    elif suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist([record] * 4), str(path))
    elif suffix == ".txt":
        path.write_text((record["text"] + "\n") * 4)
    else:
        _jsonl(path, [record] * 4)
    with caplog.at_level("INFO", logger="fitune.train.loop"):
        result = _train_two_steps(quickstart, f"run-{fmt}", {"path": str(path)})
    assert result.steps == 2 and len(result.losses) == 2
    assert f"data: format {fmt}; 4 examples" in caplog.text


@pytest.mark.slow
def test_a_streamed_hub_data_set_trains_two_steps(quickstart, hub_cache, caplog):
    with caplog.at_level("INFO", logger="fitune.train.loop"):
        result = _train_two_steps(quickstart, "run-hub", {"path": "org/alpaca-demo", "streaming": True})
    assert result.steps == 2
    assert "data: format alpaca; streaming org/alpaca-demo" in caplog.text
    with pytest.raises(DataError, match="hf download org/missing --repo-type dataset"):
        _train_two_steps(quickstart, "run-missing", {"path": "org/missing"})


# ---------------------------------------------------------------------------------------------------- doctor, plan


def test_doctor_and_plan_name_the_detected_format(tmp_path, real_model_dir, capsys):
    from fitune.cli.main import main
    from fitune.plan.data import profile_data

    alpaca = _jsonl(tmp_path / "alpaca.jsonl", [ALPACA] * 3)
    sharegpt = _jsonl(tmp_path / "sharegpt.jsonl", [SHAREGPT] * 3)
    for path, fmt in ((alpaca, "alpaca"), (sharegpt, "sharegpt")):
        main(["doctor", "--data", path, "--tokenizer", real_model_dir])
        out = capsys.readouterr().out
        assert out.startswith(f"{path}: 3 {fmt} records (chat template), seq len")
        main(["doctor", "--data", path, "--tokenizer", real_model_dir, "--json"])
        assert json.loads(capsys.readouterr().out)["format"] == fmt
        assert profile_data(path, real_model_dir).format == fmt
    main(["plan", real_model_dir, "--gpu", "24GiB", "--data", sharegpt])
    assert f"--data {sharegpt}: 3 sharegpt examples" in capsys.readouterr().out


def test_streaming_a_local_file_packs_windows_and_stops_at_a_bad_record(tmp_path, real_tok):
    from fitune.data import pack
    from fitune.data.stream import StreamingBatches

    texts = [{"text": "word " * n} for n in (3, 9, 5, 2)]
    path = _jsonl(tmp_path / "d.jsonl", texts + [{"text": 7}])
    examples, _ = tokenize_records(list(enumerate(texts, start=1)), real_tok, "text", 16)
    with pytest.raises(DataError, match=r"d.jsonl, line 5: field 'text' is a number, not a string"):
        # the first window (up to 256 examples when packing) reads on to the end of the file and meets line 5
        StreamingBatches(path, "train", None, real_tok, None, 16, rows=8, pad_token_id=0, packed=True)
    good = _jsonl(tmp_path / "good.jsonl", texts)
    packed = StreamingBatches(good, "train", None, real_tok, None, 16, rows=8, pad_token_id=0, packed=True)
    rows = pack(examples, 16)
    assert packed.next_batch().input_ids.shape[0] == len(rows)  # the window's examples, packed as pack() packs them

"""fitune.data: reading, label masking, truncation, padding, packing isolation, resumable batches.

A word-level tokenizer is built in the test (no downloads); the packing test runs a tiny random Llama on the CPU."""

import json
import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from fitune.data import (  # noqa: E402
    IGNORE_INDEX,
    Batch,
    BatchStream,
    Example,
    PackedSequence,
    collate,
    detect_format,
    load_examples,
    pack,
    pad_id,
    read_records,
    split_batch,
    tokenize_records,
)
from fitune.errors import ConfigError, DataError  # noqa: E402

SPECIALS = ["<pad>", "<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"]
WORDS = (
    "hello hi how are you i am fine thanks the a cat dog sat on mat what is two plus three five tell me joke why "
    "did chicken cross road to get other side , . ? ! be brief"
).split()
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)


def _make_tokenizer(folder, chat_template=TEMPLATE):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIALS + WORDS)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens(SPECIALS)
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", vocab["<s>"])])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    if chat_template:
        tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(str(folder))
    return AutoTokenizer.from_pretrained(str(folder))


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return _make_tokenizer(tmp_path_factory.mktemp("tok"))


def _ids(tok, words: str) -> list[int]:
    return tok.convert_tokens_to_ids(words.split())


def _write_jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return str(path)


CHAT = {
    "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hello how are you ?"},
        {"role": "assistant", "content": "i am fine thanks"},
        {"role": "user", "content": "tell me a joke"},
        {"role": "assistant", "content": "why did the chicken cross the road ?"},
    ]
}


# ------------------------------------------------------------------------------------------------ label masking


def test_chat_loss_only_on_assistant_tokens(tok):
    (example,), stats = tokenize_records([(1, CHAT)], tok, "chat", 64)
    # (tokens, trained?) in order: headers and everything not said by the assistant carry no loss; the assistant's
    # content and its end-of-turn </s> do (the model must learn to stop); the "<|assistant|>" header does not.
    parts = [
        ("<s> <|system|> be brief </s>", False),
        ("<|user|> hello how are you ? </s>", False),
        ("<|assistant|>", False),
        ("i am fine thanks </s>", True),
        ("<|user|> tell me a joke </s>", False),
        ("<|assistant|>", False),
        ("why did the chicken cross the road ? </s>", True),
    ]
    expected_ids = [i for words, _ in parts for i in _ids(tok, words)]
    expected_labels = [i if trained else IGNORE_INDEX for words, trained in parts for i in _ids(tok, words)]
    assert list(example.input_ids) == expected_ids
    assert list(example.labels) == expected_labels
    assert stats.trained_tokens == 5 + 9 and stats.tokens == len(expected_ids) and stats.format == "chat"


def test_chat_template_without_generation_prompt_still_masks_other_turns(tmp_path):
    # The template of the brief has no add_generation_prompt branch: the assistant header is then part of the turn.
    plain = _make_tokenizer(tmp_path, "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} </s> {% endfor %}")
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    (example,), _ = tokenize_records([(1, {"messages": messages})], plain, "chat", 64)
    assert list(example.input_ids) == _ids(plain, "<|user|> hi </s> <|assistant|> hello </s>")
    assert list(example.labels) == [IGNORE_INDEX] * 3 + _ids(plain, "<|assistant|> hello </s>")


def test_chat_template_that_rewrites_earlier_turns_falls_back_to_the_content(tmp_path):
    # Like Qwen3 dropping earlier reasoning: the text of a turn changes once later turns follow it, so the prefix
    # renders are not prefixes of the whole conversation; the assistant content (and an eos right after it) is
    # found in the rendered text instead.
    shifty = _make_tokenizer(
        tmp_path,
        "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }}{% if loop.last %} !{% endif %} </s> "
        "{% endfor %}",
    )
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "how are you"},
        {"role": "assistant", "content": "fine thanks"},
    ]
    (example,), _ = tokenize_records([(1, {"messages": messages})], shifty, "chat", 64)
    parts = [
        ("<|user|> hi </s> <|assistant|>", False),
        ("hello </s>", True),
        ("<|user|> how are you </s> <|assistant|>", False),
        # the last turn: the whole conversation is rendered, so the turn is what follows the text it shares with the
        # same turn emptied, "! </s>" included (the template's end-of-turn: the model learns to stop)
        ("fine thanks ! </s>", True),
    ]
    assert list(example.input_ids) == [i for words, _ in parts for i in _ids(shifty, words)]
    assert list(example.labels) == [i if t else IGNORE_INDEX for words, t in parts for i in _ids(shifty, words)]


def test_chat_without_template_says_so(tmp_path):
    bare = _make_tokenizer(tmp_path, chat_template=None)
    with pytest.raises(DataError, match=r"train.jsonl: format chat .* has none; .*completion"):
        tokenize_records([(1, CHAT)], bare, "chat", 64, source="train.jsonl")


def test_completion_masks_prompt_and_appends_eos(tok):
    record = {"prompt": "what is two plus three ?", "completion": "five"}
    (example,), stats = tokenize_records([(1, record)], tok, "completion", 64)
    prompt = _ids(tok, "<s> what is two plus three ?")  # <s>: the tokenizer's own special prefix
    assert list(example.input_ids) == prompt + _ids(tok, "five </s>")
    assert list(example.labels) == [IGNORE_INDEX] * len(prompt) + _ids(tok, "five </s>")
    assert stats.trained_tokens == 2


def test_text_trains_every_token_after_the_first(tok):
    (example,), _ = tokenize_records([(1, {"text": "the cat sat on the mat ."})], tok, None, 64)
    ids = _ids(tok, "<s> the cat sat on the mat . </s>")
    assert list(example.input_ids) == ids
    # the first label is never a target: ForCausalLMLoss scores labels[t + 1] against the logits at t
    assert list(example.labels) == [IGNORE_INDEX] + ids[1:]


def test_truncation_and_skips_are_counted(tok):
    records = [
        (1, {"text": "the cat sat on the mat ."}),  # 9 tokens -> 6: 3 cut
        (2, {"text": "hi"}),  # 3 tokens: kept whole
        (3, {"text": "   "}),  # empty: skipped
        (4, {"prompt": "x", "completion": "y"}),  # wrong format for text: missing 'text' -> error, see below
    ]
    examples, stats = tokenize_records(records[:3], tok, "text", 6)
    assert [len(e) for e in examples] == [6, 3] == stats.lengths
    assert (stats.examples, stats.dropped_records, stats.truncated_records, stats.truncated_tokens) == (2, 1, 1, 3)
    assert stats.tokens == 9 and stats.trained_tokens == 5 + 2
    assert stats.lengths_tokens == (9, 3) and stats.dropped_lines == stats.empty_lines == (3,)
    assert "dropped 1 record: 1 with nothing to train on (line 3: the text is empty)" in stats.dropped_message()
    # a chat whose answer lies beyond seq_len has nothing left to train on: skipped, not kept with zero loss
    long_question = "hello how are you i am the cat on the mat"  # 15 tokens before the answer
    chat = {"messages": [{"role": "user", "content": long_question}, {"role": "assistant", "content": "hi"}]}
    examples, stats = tokenize_records([(1, chat), (2, CHAT)], tok, "chat", 14)
    # the dropped chat counts as truncated too: truncation is what left it with nothing to train on
    assert stats.dropped_records == 1 and stats.examples == 1 and stats.truncated_records == 2
    assert stats.truncated_away_lines == stats.dropped_lines == (1,) and stats.truncated_lines == (1, 2)
    assert examples[0].trained_tokens == 1 and examples[0].labels[-1] == tok.convert_tokens_to_ids("i")
    assert "1 whose trained tokens all lie past seq_len 14 (line 1;" in stats.dropped_message()
    assert stats.summary() == (f"1 example, 14 tokens (1 trained); 2 truncated at 14 tokens "
                               f"({stats.truncated_tokens} tokens cut); 1 dropped without a token to train on")


def test_no_trainable_record_is_an_error(tok):
    no_answer = {"messages": [{"role": "user", "content": "hello"}]}
    with pytest.raises(DataError, match="none of the 1 records has a token to train on.*assistant"):
        tokenize_records([(1, no_answer)], tok, "chat", 64)


# ------------------------------------------------------------------------------------------------ padding


def test_collate_dynamic_padding(tok):
    examples, _ = tokenize_records([(1, {"text": "hi"}), (2, {"text": "the cat sat on the mat"})], tok, "text", 64)
    batch = collate(examples, pad_id(tok), packed=False)
    assert batch.input_ids.shape == (2, 8) and batch.labels.shape == (2, 8)  # the longest, not seq_len
    assert batch.attention_mask.tolist() == [[1, 1, 1, 0, 0, 0, 0, 0], [1] * 8]
    assert batch.input_ids[0, 3:].tolist() == [tok.pad_token_id] * 5
    assert batch.labels[0].tolist() == [IGNORE_INDEX] + _ids(tok, "hi </s>") + [IGNORE_INDEX] * 5
    assert batch.position_ids is None and batch.tokens == 11 and batch.trained_tokens == 2 + 7
    assert batch.model_inputs()["use_cache"] is False
    no_pad_token = collate(examples, None, packed=False)  # e.g. Llama 3 tokenizers: pads with 0, masked anyway
    assert no_pad_token.input_ids[0, 3:].tolist() == [0] * 5 and torch.equal(no_pad_token.labels, batch.labels)


# ------------------------------------------------------------------------------------------------ packing


def _examples(lengths, start=7):
    """Examples of the given lengths with distinct ids and every label but the first trained."""
    out = []
    for n, length in enumerate(lengths):
        ids = tuple(start + (n * 5 + k) % 40 for k in range(length))
        out.append(Example(ids, (IGNORE_INDEX,) + ids[1:]))
    return out


def test_pack_layout():
    examples = _examples([7, 3, 5, 2, 6, 1, 4])
    packs = pack(examples, 8)
    assert len(packs) == 4  # 28 tokens, rows of 8: best-fit decreasing reaches the minimum
    seen = []
    for p in packs:
        assert len(p) <= 8 and p.boundaries[0] == 0
        for start, length in zip(p.boundaries, p.lengths):
            assert list(p.position_ids[start : start + length]) == list(range(length))  # restart per example
            assert p.labels[start] == IGNORE_INDEX  # first label of every example: no cross-example target
            ids = p.input_ids[start : start + length]
            seen.append(Example(ids, (IGNORE_INDEX,) + p.labels[start + 1 : start + length]))
    assert sorted(seen, key=lambda e: e.input_ids) == sorted(examples, key=lambda e: e.input_ids)  # each once, whole
    assert sum(p.trained_tokens for p in packs) == sum(e.trained_tokens for e in examples)


def test_pack_masks_first_label_even_if_example_trains_it():
    a, b = Example((1, 2, 3), (1, 2, 3)), Example((4, 5), (4, 5))
    (p,) = pack([a, b], 8)
    assert p.labels == (IGNORE_INDEX, 2, 3, IGNORE_INDEX, 5)


def test_pack_rejects_examples_longer_than_the_row():
    with pytest.raises(DataError, match="longer than the pack length 4"):
        pack(_examples([5]), 4)


def test_collate_packed_rows():
    packs = pack(_examples([5, 3, 2]), 8)  # rows: [5, 3] and [2]
    batch = collate(packs, 0, packed=True)
    assert batch.attention_mask is None and batch.input_ids.shape == (2, 8)
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2], [0, 1, 0, 1, 2, 3, 4, 5]]  # padding: a segment
    assert batch.labels[1, 2:].tolist() == [IGNORE_INDEX] * 6 and batch.tokens == 10


def test_packed_examples_do_not_see_each_other(tok):
    """The key test: logits of each example inside a packed row equal the example's logits run alone."""
    from transformers import LlamaConfig, LlamaForCausalLM

    def chat(question, answer):
        return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}

    records = [
        (1, CHAT),
        (2, chat("hi", "hello")),
        (3, chat("what is two plus three ?", "five")),
        (4, chat("tell me a joke", "the cat sat on the mat")),
    ]
    examples, _ = tokenize_records(records, tok, "chat", 48)
    packs = pack(examples, 48)
    assert len(packs) == 2 and len(packs[0].boundaries) == 2 and len(packs[1].boundaries) == 2
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, pad_token_id=tok.pad_token_id,
    )
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config).float().eval()
    batch = collate(packs, pad_id(tok), packed=True)
    inputs = batch.model_inputs()
    assert "attention_mask" not in inputs and inputs["use_cache"] is False
    with torch.no_grad():
        out = model(**inputs)
        packed_logits = out.logits
        alone_loss_sum = 0.0
        for r, p in enumerate(packs):
            for start, length in zip(p.boundaries, p.lengths):
                ids = torch.tensor([p.input_ids[start : start + length]])
                labels = torch.tensor([p.labels[start : start + length]])
                alone = model(input_ids=ids, labels=labels)
                torch.testing.assert_close(packed_logits[r, start : start + length], alone.logits[0])
                alone_loss_sum += alone.loss.item() * int((labels[0, 1:] != IGNORE_INDEX).sum())
    # and the packed loss is the token-weighted mean of the examples' own losses: no target crosses an example
    torch.testing.assert_close(out.loss.item(), alone_loss_sum / batch.trained_tokens, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------------ reading / errors


def test_read_jsonl_skips_blank_lines_and_keeps_line_numbers(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"text": "a"}\n\n   \n{"text": "b"}\r\n')
    assert read_records(str(path)) == [(1, {"text": "a"}), (4, {"text": "b"})]


def test_read_json_list_numbers_records(tmp_path):
    path = tmp_path / "d.json"
    path.write_text(json.dumps([{"text": "a"}, {"text": "b"}]))
    assert read_records(str(path)) == [(1, {"text": "a"}), (2, {"text": "b"})]
    lines = tmp_path / "lines.json"  # JSON lines saved as .json: read as JSON lines
    lines.write_text('{"text": "a"}\n{"text": "b"}\n')
    assert read_records(str(lines)) == [(1, {"text": "a"}), (2, {"text": "b"})]
    bad = tmp_path / "bad.json"
    bad.write_text('[{"text": "a"},\n {"text": 1},\n "oops"]')
    with pytest.raises(DataError, match=r"bad.json, record 3: a JSON string, not an object"):
        read_records(str(bad))


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(DataError, match=r"nope.jsonl: no such file.*data.path"):
        read_records(str(tmp_path / "nope.jsonl"))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(DataError, match=r"empty.jsonl: no records"):
        read_records(str(empty))
    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n  \n\n")
    with pytest.raises(DataError, match=r"blank.jsonl: no records"):
        read_records(str(blank))
    (tmp_path / "d.xlsx").write_text("a,b\n")
    with pytest.raises(DataError, match=r"cannot read \.xlsx; fitune reads \.jsonl"):
        read_records(str(tmp_path / "d.xlsx"))
    with pytest.raises(DataError, match="not a dataset saved with datasets' save_to_disk"):
        read_records(str(tmp_path))


def test_bad_json_line_is_reported_by_number(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text('{"text": "a"}\n{"text": "b"}\n{"text": "c",}\n[1, 2]\n')
    with pytest.raises(DataError) as info:
        read_records(str(path))
    message = str(info.value)
    assert "2 bad records" in message
    assert "line 3: not valid JSON: Expecting property name enclosed in double quotes (column 14)" in message
    assert "line 4: a JSON list, not an object" in message
    assert info.value.line == 3 and info.value.path == str(path)


def test_many_bad_lines_are_listed_once(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text("".join("{oops\n" for _ in range(13)))
    with pytest.raises(DataError, match=r"13 bad records(.|\n)*line 10: not valid JSON(.|\n)*and 3 more$"):
        read_records(str(path))


def test_non_utf8_bytes_are_reported_by_line(tmp_path):
    path = tmp_path / "latin.jsonl"
    path.write_bytes('{"text": "ok"}\n{"text": "caf'.encode() + b"\xe9" + b'"}\n')
    with pytest.raises(DataError, match=r"latin.jsonl, line 2: bytes that are not UTF-8 \(0xe9 at byte 14.*iconv"):
        read_records(str(path))
    as_json = tmp_path / "latin.json"
    as_json.write_bytes(b'[{"text": "ok"},\n {"text": "caf\xe9"}]')
    with pytest.raises(DataError, match=r"latin.json, line 2: bytes that are not UTF-8"):
        read_records(str(as_json))


def test_missing_field_is_reported_with_line_and_field(tmp_path, tok):
    path = _write_jsonl(tmp_path / "train.jsonl", [{"prompt": "hi", "completion": "hello"}, {"prompt": "hi"}])
    missing = r"train.jsonl, line 2: missing field 'completion' \(keys found: \['prompt'\]\)"
    with pytest.raises(DataError, match=missing):
        load_examples(path, tok, "completion", 64)
    chat = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant"}]}
    path = _write_jsonl(tmp_path / "chat.jsonl", [CHAT, chat])
    records = read_records(path)  # remembers its file: errors name it without source=
    with pytest.raises(DataError, match=r"chat.jsonl, line 2: missing field 'content' in messages\[1\]"):
        tokenize_records(records, tok, None, 64)
    with pytest.raises(DataError, match=r"line 1: field 'text' is a number, not a string"):
        tokenize_records([(1, {"text": 3})], tok, "text", 64)


def test_unknown_format(tok):
    records = [(1, {"question": "hi", "answer": "hello"}), (2, {"input": "x"})]
    keys = r"d.jsonl: no record has a known format; keys found: \['answer', 'input', 'question'\]"
    with pytest.raises(DataError, match=keys):
        detect_format(records, source="d.jsonl")
    with pytest.raises(ConfigError, match=r"data.format: 'dolly' is not a format"):
        tokenize_records(records, tok, "dolly", 64)


def test_optional_readers_name_the_package(tmp_path):
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        (tmp_path / "d.parquet").write_bytes(b"PAR1")
        with pytest.raises(DataError, match="needs the pyarrow package.*pip install pyarrow"):
            read_records(str(tmp_path / "d.parquet"))
    try:
        import datasets  # noqa: F401
    except ImportError:
        folder = tmp_path / "saved"
        folder.mkdir()
        (folder / "dataset_info.json").write_text("{}")
        with pytest.raises(DataError, match="needs the datasets package.*pip install datasets"):
            read_records(str(folder))


# ------------------------------------------------------------------------------------------------ batch stream


def _drain(stream, n):
    return [stream.next_batch() for _ in range(n)]


def _same(a: Batch, b: Batch) -> bool:
    return all(
        (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
        for x, y in ((a.input_ids, b.input_ids), (a.labels, b.labels), (a.attention_mask, b.attention_mask),
                     (a.position_ids, b.position_ids))
    )


@pytest.mark.parametrize("packed", [False, True])
def test_batch_stream_resumes_exactly(packed):
    items = pack(_examples(range(1, 24)), 24) if packed else _examples(range(1, 24))
    stream = BatchStream(items, batch_size=3, seed=7, pad_token_id=0, packed=packed)
    uninterrupted = BatchStream(items, batch_size=3, seed=7, pad_token_id=0, packed=packed)
    reference = _drain(uninterrupted, 3 * stream.batches_per_epoch)
    taken = _drain(stream, stream.batches_per_epoch + 2)  # into the second epoch, mid-epoch
    state = json.loads(json.dumps(stream.state_dict()))  # survives a JSON round trip
    resumed = BatchStream(items, batch_size=3, seed=7, pad_token_id=0, packed=packed)
    resumed.load_state_dict(state)
    rest = _drain(resumed, len(reference) - len(taken))
    assert all(_same(a, b) for a, b in zip(taken + rest, reference))


def test_batch_stream_epochs_and_order():
    items = _examples([3] * 10)
    stream = BatchStream(items, batch_size=4, seed=1, pad_token_id=0, packed=False)
    assert stream.batches_per_epoch == 3
    sizes = [stream.next_batch().rows for _ in range(3)]
    assert sizes == [4, 4, 2] and stream.state_dict()["epoch"] == 1 and stream.state_dict()["index"] == 0
    assert sorted(stream.order(0)) == list(range(10)) and stream.order(0) != stream.order(1)  # a new shuffle
    assert BatchStream(items, 4, 1, 0, False, shuffle=False).order(3) == list(range(10))
    other = BatchStream(_examples([3] * 9), batch_size=4, seed=1, pad_token_id=0, packed=False)
    with pytest.raises(DataError, match=r"cannot resume the data position.*items: checkpoint 10, now 9"):
        other.load_state_dict(stream.state_dict())


@pytest.mark.parametrize("packed", [False, True])
def test_split_keeps_the_same_tokens(packed):
    items = pack(_examples([9, 2, 3, 7, 1, 6]), 10) if packed else _examples([9, 2, 3, 7, 1])
    stream = BatchStream(items, batch_size=len(items), seed=0, pad_token_id=0, packed=packed)
    batch = stream.next_batch()
    parts = stream.split(batch, 2)
    assert [p.rows for p in parts] == [2] * (len(items) // 2) + [1] * (len(items) % 2)
    assert sum(p.tokens for p in parts) == batch.tokens
    assert sum(p.trained_tokens for p in parts) == batch.trained_tokens
    for p in parts:  # re-collated: each part padded only to its own longest row
        assert p.width_tokens == max(len(item) for item in p.items)
    row = 0
    for p in parts:
        for r in range(p.rows):
            n = len(p.items[r])
            assert torch.equal(p.input_ids[r, :n], batch.input_ids[row, :n])
            assert torch.equal(p.labels[r, :n], batch.labels[row, :n])
            row += 1
    assert split_batch(batch, 100, 0, packed)[0].rows == batch.rows

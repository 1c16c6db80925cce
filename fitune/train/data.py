"""Training data: read records, tokenize them with the model's own tokenizer, pack, pad and batch them.

The pipeline, each step a function the training loop calls in turn:

    records = read_records("train.jsonl")                     # [(line_number, dict), ...], remembers its path
    examples, stats = tokenize_records(records, tokenizer, "chat", 2048)
    items = pack(examples, 2048) if packing else examples     # PackedSequence rows, or one example a row
    stream = BatchStream(items, batch_size=2, seed=0, pad_token_id=pad_id(tokenizer), packed=packing)
    batch = stream.next_batch()                                # Batch of CPU tensors
    loss = model(**batch.model_inputs()).loss

Formats (`FORMATS`):
- chat:       {"messages": [{"role": ..., "content": ...}, ...]} - rendered with the tokenizer's chat template; the
              loss only on the tokens assistant turns add (their content and end-of-turn), everything else -100;
- completion: {"prompt": ..., "completion": ...} - prompt tokens -100, completion tokens (+ eos) trained;
- text:       {"text": ...} - every token (+ eos) trained.

Labels follow transformers' convention: `ForCausalLMLoss` (transformers/loss/loss_utils.py) pads the labels with
-100 on the right and shifts them left, so the logits at position t are scored against labels[t + 1]. Hence the
label of the first token of an example is never a target, and this module always sets it to -100: then
`trained_tokens` (labels != -100) is exactly the number of loss terms, and in a packed row no token of one example
is predicted from the last token of the example before it.

Packing keeps examples apart without an attention mask: position ids restart at 0 for each example and the batch
carries no attention_mask, so transformers (masking_utils.find_packed_sequence_indices) builds a block-diagonal
causal mask. It only does so when no KV cache is passed; `Batch.model_inputs()` sets `use_cache=False` for that
reason (with the default `use_cache=True`, Llama creates a DynamicCache and examples in a pack see each other).

Reading and tokenizing are pure Python (plus the tokenizer); torch is imported only to build tensors.
"""

from __future__ import annotations

import bisect
import codecs
import hashlib
import json
import math
import os
import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator, Sequence

from ..errors import ConfigError, FituneError

if TYPE_CHECKING:  # pragma: no cover
    import torch

FORMATS = ("chat", "completion", "text")
"""Record shapes `tokenize_records` understands (see the module docstring)."""
IGNORE_INDEX = -100
"""Label of a token that carries no loss (transformers' and torch's cross-entropy `ignore_index`)."""
MAX_LISTED_PROBLEMS = 10
"""Bad records listed one by one in a DataError; the rest are counted."""
DETECT_KEYS_RECORDS = 100
"""Records whose keys a format-detection error lists."""
SUFFIXES = (".jsonl", ".json", ".parquet")
"""File types `read_records` reads; a folder is read as a saved Hugging Face dataset."""
HF_DATASET_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")
"""Files `datasets.Dataset(Dict).save_to_disk` writes; a folder with one of them is a saved dataset."""


class DataError(FituneError):
    """A data file or record that cannot be trained on. The message names the file, the line (or record) number,
    what is wrong and what to do; `path` and `line` (the first bad one) are kept for callers."""

    def __init__(self, message: str, *, path: str | None = None, line: int | None = None):
        super().__init__(message)
        self.path = path
        self.line = line


class Records(list):
    """What read_records returns: a list of (line_number, record) pairs that remembers the file it was read from, so
    that tokenize_records and detect_format name the file in their errors without being told."""

    def __init__(self, pairs: Sequence[tuple[int, dict]] = (), path: str | None = None):
        super().__init__(pairs)
        self.path = path


def _source_of(records: Sequence[tuple[int, dict]], source: str | None) -> str | None:
    return source if source is not None else getattr(records, "path", None)


class _RecordProblem(Exception):
    """Internal: what is wrong with one record; collected with its line number into one DataError."""


# ---------------------------------------------------------------------------------------------------------------
# Data types


@dataclass(frozen=True)
class Example:
    """One tokenized example."""

    input_ids: tuple[int, ...]
    """Token ids, at most seq_len_tokens of them."""
    labels: tuple[int, ...]
    """Same length as input_ids: the token id where the loss is taken, -100 where it is not (prompt, system and
    user tokens, the first token - see the module docstring)."""

    def __post_init__(self) -> None:
        if len(self.input_ids) != len(self.labels):
            raise ValueError(f"Example: {len(self.input_ids)} input ids but {len(self.labels)} labels; they must match")

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def trained_tokens(self) -> int:
        """Tokens with a label (labels != -100): the loss terms this example contributes."""
        return sum(1 for label in self.labels if label != IGNORE_INDEX)


@dataclass
class DataStats:
    """What tokenizing a data file kept, cut and skipped. Counts are of examples or of tokens, as named."""

    examples: int
    """Examples kept."""
    skipped_empty: int
    """Records dropped because no token was left to train on (no assistant turn, an empty text or completion, or
    every trained token cut by truncation)."""
    truncated_examples: int
    """Kept examples longer than seq_len_tokens, cut to it (tokens past it dropped from the end)."""
    truncated_tokens: int
    """Tokens cut from the kept examples by truncation."""
    tokens: int
    """Tokens of the kept examples, after truncation."""
    trained_tokens: int
    """Tokens of the kept examples with a label (labels != -100), after truncation."""
    lengths: list[int] = field(default_factory=list)
    """Tokens of each kept example, after truncation, in record order."""
    format: str = ""
    """chat | completion | text: the format the records were read as."""


@dataclass(frozen=True)
class PackedSequence:
    """Several examples back to back in one row of at most seq_len_tokens; an example is never split across two."""

    input_ids: tuple[int, ...]
    labels: tuple[int, ...]
    """The examples' labels, with the first label of every example -100 (no token predicts the next example)."""
    position_ids: tuple[int, ...]
    """0, 1, ... restarting at 0 where each example starts (what keeps examples apart in attention)."""
    boundaries: tuple[int, ...]
    """Start offset of each example in the row; boundaries[0] == 0."""

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def lengths(self) -> tuple[int, ...]:
        """Tokens of each example in the row."""
        ends = self.boundaries[1:] + (len(self.input_ids),)
        return tuple(end - start for start, end in zip(self.boundaries, ends))

    @property
    def trained_tokens(self) -> int:
        return sum(1 for label in self.labels if label != IGNORE_INDEX)


@dataclass
class Batch:
    """A batch of rows as CPU tensors of shape (rows, width), width = the longest row (dynamic padding)."""

    input_ids: "torch.LongTensor"
    labels: "torch.LongTensor"
    """-100 on padding and on tokens without loss."""
    attention_mask: "torch.LongTensor | None"
    """1 on tokens, 0 on padding (unpacked batches); None for packed batches (see position_ids)."""
    position_ids: "torch.LongTensor | None"
    """Packed batches: positions restarting at 0 per example (padding is one more segment at the end); None for
    unpacked batches, where the model counts positions itself."""
    tokens: int
    """Tokens that are not padding."""
    trained_tokens: int
    """Tokens with a label (labels != -100): the number of loss terms, e.g. `num_items_in_batch` summed over the
    micro-batches of one optimizer step."""
    items: tuple = ()
    """The Examples / PackedSequences the batch was collated from (`split_batch` re-collates them)."""

    @property
    def rows(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def width_tokens(self) -> int:
        """Padded row length."""
        return int(self.input_ids.shape[1])

    def model_inputs(self) -> dict[str, Any]:
        """Keyword arguments for a transformers causal LM: `model(**batch.model_inputs())`.

        `use_cache=False` matters for packed batches: transformers builds the block-diagonal mask from position_ids
        only when no KV cache is passed (masking_utils._preprocess_mask_arguments), and a model whose config says
        `use_cache=True` would otherwise create one in its forward."""
        inputs: dict[str, Any] = {"input_ids": self.input_ids, "labels": self.labels, "use_cache": False}
        if self.attention_mask is not None:
            inputs["attention_mask"] = self.attention_mask
        if self.position_ids is not None:
            inputs["position_ids"] = self.position_ids
        return inputs

    def to(self, device: Any) -> "Batch":
        """The same batch with its tensors on `device`."""

        def move(t):
            return None if t is None else t.to(device, non_blocking=True)

        return Batch(
            input_ids=move(self.input_ids),
            labels=move(self.labels),
            attention_mask=move(self.attention_mask),
            position_ids=move(self.position_ids),
            tokens=self.tokens,
            trained_tokens=self.trained_tokens,
            items=self.items,
        )


# ---------------------------------------------------------------------------------------------------------------
# Reading


def read_records(path: str) -> list[tuple[int, dict]]:
    """Read the records of a data file as (line_number, record) pairs (a `Records` list, which remembers `path`).

    Args:
        path: a .jsonl file (one JSON object per line, blank lines skipped; the number is the file line), a .json
            file holding a list of objects (the number is the 1-based record index), a .parquet file (needs
            pyarrow; 1-based row) or a folder written by `datasets` `save_to_disk` (needs `datasets`; 1-based row).

    Raises:
        DataError: the file is missing, of an unknown type, empty, or has lines that are not UTF-8, not JSON or not
            objects (every bad line is listed, by number).
    """
    if not os.path.exists(path):
        raise DataError(
            f"{path}: no such file or folder (looked for {os.path.abspath(path)}); check data.path (or "
            "data.eval_path) in the config",
            path=path,
        )
    if os.path.isdir(path):
        records = _read_hf_dataset(path)
    else:
        suffix = os.path.splitext(path)[1].lower()
        if suffix not in SUFFIXES:
            raise DataError(
                f"{path}: cannot read {suffix or 'a file without a suffix'}; fitune reads .jsonl (one JSON object per "
                "line), .json (a list of objects), .parquet, or a folder saved with datasets' save_to_disk. Convert "
                "the file to .jsonl, or rename it if it already is JSON lines",
                path=path,
            )
        with open(path, "rb") as f:
            data = f.read()
        if suffix == ".jsonl":
            records = _read_jsonl(path, data)
        elif suffix == ".json":
            records = _read_json(path, data)
        else:
            records = _read_parquet(path)
    if not records:
        raise DataError(
            f"{path}: no records (the file is empty or holds only blank lines); point data.path at a file with "
            "training examples",
            path=path,
        )
    return Records(records, path)


def _read_jsonl(path: str, data: bytes) -> list[tuple[int, dict]]:
    records: list[tuple[int, dict]] = []
    problems: list[tuple[int, str]] = []
    for line_number, raw in enumerate(data.split(b"\n"), start=1):
        if line_number == 1 and raw.startswith(codecs.BOM_UTF8):
            raw = raw[len(codecs.BOM_UTF8) :]  # a byte-order mark some editors write; not part of the JSON
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            problems.append((line_number, _not_utf8(raw[e.start], e.start)))
            continue
        if not text.strip():
            continue
        try:
            record = json.loads(text)
        except json.JSONDecodeError as e:
            problems.append((line_number, f"not valid JSON: {e.msg} (column {e.colno}); fix or delete the line"))
            continue
        if not isinstance(record, dict):
            what = f"a JSON {_json_type(record)}, not an object {{...}}; each line must be one record"
            problems.append((line_number, what))
            continue
        records.append((line_number, record))
    if problems:
        raise _data_error(path, problems, unit="line")
    return records


def _read_json(path: str, data: bytes) -> list[tuple[int, dict]]:
    if data.startswith(codecs.BOM_UTF8):
        data = data[len(codecs.BOM_UTF8) :]
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line_number = data.count(b"\n", 0, e.start) + 1
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1)
        raise _data_error(path, [(line_number, _not_utf8(data[e.start], column))], unit="line") from None
    if not text.strip():
        return []
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        if e.msg == "Extra data":  # several JSON values one after another: the file is JSON lines named .json
            return _read_jsonl(path, data)
        what = f"not valid JSON: {e.msg} (column {e.colno}); fix the file"
        raise _data_error(path, [(e.lineno, what)], unit="line") from None
    if isinstance(value, dict):
        raise DataError(
            f"{path}: holds one JSON object (keys: {sorted(value)}), not a list of records; write the records as a "
            "list [{...}, {...}] or as JSON lines (.jsonl)",
            path=path,
        )
    if not isinstance(value, list):
        raise DataError(f"{path}: holds a JSON {_json_type(value)}, not a list of records [{{...}}, ...]", path=path)
    problems = [
        (i, f"a JSON {_json_type(record)}, not an object {{...}}")
        for i, record in enumerate(value, start=1)
        if not isinstance(record, dict)
    ]
    if problems:
        raise _data_error(path, problems, unit="record")
    return list(enumerate(value, start=1))


def _read_parquet(path: str) -> list[tuple[int, dict]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(
            f"{path}: reading .parquet files needs the pyarrow package, which is not installed; run "
            "`pip install pyarrow`, or convert the file to .jsonl",
            path=path,
        ) from None
    try:
        rows = pq.read_table(path).to_pylist()
    except Exception as e:  # pyarrow raises its own ArrowInvalid / OSError family; all mean "not readable"
        raise DataError(
            f"{path}: not a readable parquet file ({e}); re-export it, or convert it to .jsonl", path=path
        ) from None
    return list(enumerate(rows, start=1))


def _read_hf_dataset(path: str) -> list[tuple[int, dict]]:
    if not any(os.path.exists(os.path.join(path, marker)) for marker in HF_DATASET_MARKERS):
        raise DataError(
            f"{path}: is a folder but not a dataset saved with datasets' save_to_disk (it has none of "
            f"{', '.join(HF_DATASET_MARKERS)}); pass a .jsonl, .json or .parquet file, or the folder "
            "save_to_disk wrote",
            path=path,
        )
    try:
        import datasets
    except ImportError:
        raise DataError(
            f"{path}: reading a saved Hugging Face dataset needs the datasets package, which is not installed; run "
            "`pip install datasets`, or export the dataset to .jsonl (`ds.to_json('train.jsonl')`)",
            path=path,
        ) from None
    dataset = datasets.load_from_disk(path)
    if isinstance(dataset, datasets.DatasetDict):
        if "train" in dataset:
            dataset = dataset["train"]
        elif len(dataset) == 1:
            dataset = next(iter(dataset.values()))
        else:
            raise DataError(
                f"{path}: holds the splits {sorted(dataset)} and none is called 'train'; save the split to train on "
                "alone (`ds['<split>'].save_to_disk(...)`)",
                path=path,
            )
    return list(enumerate(dataset.to_list(), start=1))


def _not_utf8(byte: int, column: int) -> str:
    """`byte`: the first byte that is not UTF-8; `column`: its 0-based offset in the line."""
    return (
        f"bytes that are not UTF-8 (0x{byte:02x} at byte {column + 1} of the line); re-save the file as "
        "UTF-8 (e.g. `iconv -f latin1 -t utf-8 IN > OUT`)"
    )


def _json_type(value: Any) -> str:
    return {list: "list", str: "string", int: "number", float: "number", bool: "boolean", type(None): "null"}.get(
        type(value), type(value).__name__
    )


def _unit(source: str | None) -> str:
    """How read_records numbered the records of `source`: file lines (.jsonl) or 1-based record indices."""
    if source is None or source.lower().endswith(".jsonl"):
        return "line"
    return "record"


def _data_error(source: str | None, problems: list[tuple[int, str]], unit: str | None = None) -> DataError:
    """One DataError for every bad record, the first MAX_LISTED_PROBLEMS listed with their numbers."""
    name = source or "data"
    unit = unit or _unit(source)
    first_line = problems[0][0]
    if len(problems) == 1:
        return DataError(f"{name}, {unit} {first_line}: {problems[0][1]}", path=source, line=first_line)
    listed = [f"  {unit} {line}: {what}" for line, what in problems[:MAX_LISTED_PROBLEMS]]
    if len(problems) > MAX_LISTED_PROBLEMS:
        listed.append(f"  ... and {len(problems) - MAX_LISTED_PROBLEMS} more")
    return DataError(
        f"{name}: {len(problems)} bad records; fix or delete them:\n" + "\n".join(listed), path=source, line=first_line
    )


# ---------------------------------------------------------------------------------------------------------------
# Formats and tokenizing


def _format_of(record: dict) -> str | None:
    if "messages" in record:
        return "chat"
    if "prompt" in record and "completion" in record:
        return "completion"
    if "text" in record:
        return "text"
    return None


def detect_format(records: Sequence[tuple[int, dict]], *, source: str | None = None) -> str:
    """The format of the first record with a known shape: "chat", "completion" or "text".

    Raises:
        DataError: no record has a known shape; the message lists the keys the records have.
    """
    source = _source_of(records, source)
    for _, record in records:
        fmt = _format_of(record)
        if fmt is not None:
            return fmt
    keys = sorted({key for _, record in records[:DETECT_KEYS_RECORDS] for key in record})
    raise DataError(
        f"{source or 'data'}: no record has a known format; keys found: {keys}. fitune reads chat "
        '{"messages": [{"role": ..., "content": ...}, ...]}, completion {"prompt": ..., "completion": ...} or text '
        '{"text": ...}; rename the fields to one of these',
        path=source,
        line=records[0][0] if records else None,
    )


def pad_id(tokenizer: Any) -> int:
    """The token id to pad with: the tokenizer's pad token, else its eos, else 0. Padding never reaches the loss
    (labels -100) nor attention (mask 0, or its own segment in packed rows), so any id is correct."""
    for token_id in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if token_id is not None:
            return int(token_id)
    return 0


class _Encoder:
    """Turns one record into (input_ids, labels) with one tokenizer; raises _RecordProblem for a bad record."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.eos = tokenizer.eos_token_id
        self.fast = bool(getattr(tokenizer, "is_fast", False))
        self.prefix = self._special_prefix()

    def _special_prefix(self) -> list[int]:
        """The special tokens the tokenizer puts before a text (e.g. <s>); learnt by probing, since tokenizers
        differ (Llama 2 adds <s>, Llama 3 <|begin_of_text|>, Qwen nothing). Trailing ones (eos) are not kept:
        completion and text add eos themselves, once."""
        probe = "hello world"
        with_special = list(self.tokenizer(probe, add_special_tokens=True)["input_ids"])
        plain = list(self.tokenizer(probe, add_special_tokens=False)["input_ids"])
        for start in range(len(with_special) - len(plain) + 1):
            if with_special[start : start + len(plain)] == plain:
                return with_special[:start]
        return []

    def ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def with_eos(self, ids: list[int]) -> list[int]:
        if self.eos is not None and (not ids or ids[-1] != self.eos):
            return ids + [self.eos]
        return ids

    def encode(self, fmt: str, record: dict) -> tuple[list[int], list[int]]:
        if fmt == "chat":
            return self.chat(record)
        if fmt == "completion":
            prompt, completion = _string_field(record, "prompt"), _string_field(record, "completion")
            if not completion.strip():
                return [], []
            prompt_ids = self.prefix + self.ids(prompt)
            completion_ids = self.with_eos(self.ids(completion))
            return prompt_ids + completion_ids, [IGNORE_INDEX] * len(prompt_ids) + completion_ids
        text = _string_field(record, "text")
        if not text.strip():
            return [], []
        ids = self.with_eos(self.prefix + self.ids(text))
        return ids, list(ids)

    # chat ---------------------------------------------------------------------------------------------------

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt
            )
        except Exception as e:  # jinja2 TemplateError, or the template's own raise_exception(...)
            raise _RecordProblem(f"the chat template cannot render these messages: {e}") from None

    def chat(self, record: dict) -> tuple[list[int], list[int]]:
        messages = _messages_field(record)
        full = self.render(messages)
        spans: list[tuple[int, int]] = []
        cursor, first = 0, 0  # the end of the last assistant turn: in characters, and the message after it
        for i, message in enumerate(messages):
            if message["role"] == "assistant":
                start, end = self.assistant_span(messages, i, full, cursor, first)
                spans.append((start, end))
                cursor, first = end, i + 1
        if not spans:
            return [], []
        ids, starts = self.tokenize_with_starts(full, spans)
        labels = [IGNORE_INDEX] * len(ids)
        for k, char_start in enumerate(starts):
            # a token belongs to an assistant turn if it starts inside the turn's characters
            if char_start is not None and any(s <= char_start < e for s, e in spans):
                labels[k] = ids[k]
        return ids, labels

    def assistant_span(self, messages: list[dict], i: int, full: str, cursor: int, first: int) -> tuple[int, int]:
        """Characters of `full` that assistant turn i adds: from the end of the conversation before it (with the
        template's generation prompt, so the "assistant:" header is not trained) to the end of the turn (its
        content and end-of-turn token, so the model learns to stop)."""
        upto = self.render(messages[: i + 1])
        if full.startswith(upto):
            for generation_prompt in (True, False):
                try:
                    before = self.render(messages[:i], add_generation_prompt=generation_prompt)
                except _RecordProblem:  # e.g. a template that cannot render an empty conversation
                    before = ""
                if upto.startswith(before) and len(before) >= cursor:
                    return len(before), len(upto)
        # The template renders an earlier turn differently once later turns follow (Qwen3 drops earlier
        # reasoning, for one): fall back to finding the content in the full text, plus an eos right after it.
        for message in messages[first:i]:  # step over the turns in between, so the content is not found in them
            found = full.find(message["content"], cursor) if message["content"] else -1
            if found >= 0:
                cursor = found + len(message["content"])
        content = messages[i]["content"]
        start = full.find(content, cursor) if content else -1
        if start < 0:
            raise _RecordProblem(
                f"cannot locate assistant message {i} in the text the chat template renders; convert the records "
                "to format completion"
            )
        end = start + len(content)
        rest = full[end:]
        eos_text = self.tokenizer.eos_token
        if eos_text and rest.lstrip().startswith(eos_text):
            end += len(rest) - len(rest.lstrip()) + len(eos_text)
        return start, end

    def tokenize_with_starts(self, text: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[int | None]]:
        """Token ids of `text` and the character offset each token starts at."""
        if self.fast:
            encoding = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
            ids = list(encoding["input_ids"])
            return ids, [s if e > s else None for s, e in encoding["offset_mapping"]]
        # A slow tokenizer gives no offsets: count the tokens of each prefix up to a span edge instead.
        ids = self.ids(text)
        starts: list[int | None] = [None] * len(ids)
        for span_start, span_end in spans:
            first, last = len(self.ids(text[:span_start])), len(self.ids(text[:span_end]))
            for k in range(first, min(last, len(ids))):
                starts[k] = span_start
        return ids, starts


def _string_field(record: dict, name: str) -> str:
    if name not in record:
        raise _RecordProblem(f"missing field '{name}' (keys found: {sorted(record)})")
    value = record[name]
    if not isinstance(value, str):
        hint = "; for conversations use format chat" if isinstance(value, list) else ""
        raise _RecordProblem(f"field '{name}' is a {_json_type(value)}, not a string{hint}")
    return value


def _messages_field(record: dict) -> list[dict]:
    if "messages" not in record:
        raise _RecordProblem(f"missing field 'messages' (keys found: {sorted(record)})")
    messages = record["messages"]
    if not isinstance(messages, list) or not messages:
        raise _RecordProblem("field 'messages' must be a non-empty list of {\"role\": ..., \"content\": ...}")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise _RecordProblem(f"messages[{i}] is a {_json_type(message)}, not an object {{\"role\", \"content\"}}")
        for key in ("role", "content"):
            if key not in message:
                raise _RecordProblem(f"missing field '{key}' in messages[{i}] (keys found: {sorted(message)})")
            if not isinstance(message[key], str):
                raise _RecordProblem(f"messages[{i}].{key} is a {_json_type(message[key])}, not a string")
    return messages


def tokenize_records(
    records: Sequence[tuple[int, dict]],
    tokenizer: Any,
    fmt: str | None,
    seq_len_tokens: int,
    *,
    source: str | None = None,
) -> tuple[list[Example], DataStats]:
    """Tokenize records into Examples, labels masked by format, truncated to seq_len_tokens.

    Args:
        records: (line_number, record) pairs, as read_records returns them.
        tokenizer: the model's transformers tokenizer (chat uses its chat template).
        fmt: "chat", "completion", "text", or None to detect it from the records.
        seq_len_tokens: the longest example kept; longer ones are cut at the end (and counted in the stats).
        source: the file the records came from, named in error messages (default: the path read_records kept).

    Returns:
        The examples in record order (records with nothing left to train on are skipped and counted) and stats.

    Raises:
        ConfigError: fmt or seq_len_tokens is not usable.
        DataError: chat without a chat template; records missing their format's fields (all listed by number);
            no record left to train on.
    """
    source = _source_of(records, source)
    if seq_len_tokens < 2:
        raise ConfigError(
            f"seq_len: {seq_len_tokens} tokens leaves nothing to train on; use at least 2 (typical: 512-4096)"
        )
    if fmt is None:
        fmt = detect_format(records, source=source)
    if fmt not in FORMATS:
        raise ConfigError(
            f"data.format: {fmt!r} is not a format; use one of {', '.join(FORMATS)} (or leave it out to detect it "
            "from the records)"
        )
    if fmt == "chat" and not getattr(tokenizer, "chat_template", None):
        name = getattr(tokenizer, "name_or_path", "") or "the tokenizer"
        raise DataError(
            f"{source or 'data'}: format chat renders conversations with the tokenizer's chat template, and "
            f"{name} has none; use a chat/instruct model's tokenizer, add a chat_template to its "
            'tokenizer_config.json, or write the records as format completion {"prompt", "completion"} or '
            'text {"text"}',
            path=source,
        )
    encoder = _Encoder(tokenizer)
    examples: list[Example] = []
    problems: list[tuple[int, str]] = []
    stats = DataStats(examples=0, skipped_empty=0, truncated_examples=0, truncated_tokens=0, tokens=0,
                      trained_tokens=0, format=fmt)
    for line_number, record in records:
        try:
            ids, labels = encoder.encode(fmt, record)
        except _RecordProblem as problem:
            problems.append((line_number, str(problem)))
            continue
        cut = max(0, len(ids) - seq_len_tokens)
        ids, labels = ids[:seq_len_tokens], labels[:seq_len_tokens]
        if labels:
            labels[0] = IGNORE_INDEX  # never a target: the loss scores labels[t + 1] against the logits at t
        example = Example(tuple(ids), tuple(labels))
        trained = example.trained_tokens
        if trained == 0:
            stats.skipped_empty += 1
            continue
        examples.append(example)
        stats.examples += 1
        stats.truncated_examples += int(cut > 0)
        stats.truncated_tokens += cut
        stats.tokens += len(ids)
        stats.trained_tokens += trained
        stats.lengths.append(len(ids))
    if problems:
        raise _data_error(source, problems)
    if not examples:
        raise DataError(
            f"{source or 'data'}: none of the {len(records)} records has a token to train on (format {fmt}, "
            f"seq_len {seq_len_tokens}): {_empty_reason(fmt)}",
            path=source,
        )
    return examples, stats


def _empty_reason(fmt: str) -> str:
    return {
        "chat": "conversations need an assistant message inside the first seq_len tokens; check the roles are "
        "'assistant' and raise seq_len if long prompts push the answers out",
        "completion": "completions are empty, or prompts fill the whole seq_len; raise seq_len",
        "text": "the texts are empty",
    }[fmt]


def load_examples(
    path: str, tokenizer: Any, fmt: str | None, seq_len_tokens: int
) -> tuple[list[Example], DataStats]:
    """read_records + tokenize_records, with errors naming `path`."""
    return tokenize_records(read_records(path), tokenizer, fmt, seq_len_tokens, source=path)


# ---------------------------------------------------------------------------------------------------------------
# Packing


def pack(examples: Sequence[Example], seq_len_tokens: int) -> list[PackedSequence]:
    """Pack examples into rows of at most seq_len_tokens, best-fit decreasing: longest example first, each into the
    fullest row it still fits in (ties: the earliest row), else a new row. Deterministic; an example is never
    split. Within a row, examples follow in the order they were placed.

    Raises:
        DataError: an example is longer than seq_len_tokens (tokenize with the same seq_len you pack with).
    """
    too_long = [len(e) for e in examples if len(e) > seq_len_tokens]
    if too_long:
        raise DataError(
            f"{len(too_long)} examples are longer than the pack length {seq_len_tokens} tokens (longest "
            f"{max(too_long)}); tokenize with the seq_len you pack with"
        )
    order = sorted(range(len(examples)), key=lambda i: (-len(examples[i]), i))
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (tokens still free, row index), sorted: bisect finds the best fit
    for i in order:
        length = len(examples[i])
        k = bisect.bisect_left(free, (length, -1))
        if k == len(free):
            rows.append([i])
            row, left = len(rows) - 1, seq_len_tokens - length
        else:
            left, row = free.pop(k)
            rows[row].append(i)
            left -= length
        if left > 0:
            bisect.insort(free, (left, row))
    return [_pack_row([examples[i] for i in row]) for row in rows]


def _pack_row(examples: Sequence[Example]) -> PackedSequence:
    input_ids: list[int] = []
    labels: list[int] = []
    position_ids: list[int] = []
    boundaries: list[int] = []
    for example in examples:
        boundaries.append(len(input_ids))
        input_ids.extend(example.input_ids)
        labels.append(IGNORE_INDEX)  # the first label would be scored against the previous example's last logits
        labels.extend(example.labels[1:])
        position_ids.extend(range(len(example)))
    return PackedSequence(tuple(input_ids), tuple(labels), tuple(position_ids), tuple(boundaries))


# ---------------------------------------------------------------------------------------------------------------
# Batching


def collate(items: Sequence[Example | PackedSequence], pad_token_id: int | None, packed: bool) -> Batch:
    """Stack items into a Batch, right-padded to the longest (dynamic padding).

    Unpacked: attention_mask 1 on tokens, 0 on padding; position_ids None.
    Packed: one row per item (an Example counts as a pack of one); position_ids restart per example, and padding
    continues as one more segment 0, 1, ... at the end; attention_mask None, so transformers builds the
    block-diagonal mask from position_ids (see Batch.model_inputs).
    Labels are -100 on padding in both. pad_token_id None (tokenizers without a pad token, e.g. Llama 3's) pads
    with 0: padding is never attended to nor scored, so the id does not matter.
    """
    import torch

    if not items:
        raise ValueError("collate: no items to batch")
    pad_token_id = 0 if pad_token_id is None else int(pad_token_id)
    rows = [_as_pack(item) for item in items] if packed else list(items)
    width = max(len(row) for row in rows)
    input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    attention_mask = None if packed else torch.zeros((len(rows), width), dtype=torch.long)
    position_ids = torch.zeros((len(rows), width), dtype=torch.long) if packed else None
    for r, row in enumerate(rows):
        n = len(row)
        input_ids[r, :n] = torch.tensor(row.input_ids, dtype=torch.long)
        labels[r, :n] = torch.tensor(row.labels, dtype=torch.long)
        if packed:
            position_ids[r, :n] = torch.tensor(row.position_ids, dtype=torch.long)
            position_ids[r, n:] = torch.arange(width - n)
        else:
            attention_mask[r, :n] = 1
    return Batch(
        input_ids=input_ids,
        labels=labels,
        attention_mask=attention_mask,
        position_ids=position_ids,
        tokens=sum(len(row) for row in rows),
        trained_tokens=int((labels != IGNORE_INDEX).sum()),
        items=tuple(items),
    )


def _as_pack(item: Example | PackedSequence) -> PackedSequence:
    if isinstance(item, PackedSequence):
        return item
    return _pack_row([item])


def split_batch(batch: Batch, micro_batch_size: int, pad_token_id: int | None, packed: bool) -> list[Batch]:
    """The rows of `batch` as micro-batches of at most micro_batch_size rows, each re-collated (padded only to its
    own longest row). Same tokens and labels, in the same order."""
    if micro_batch_size < 1:
        raise ValueError(f"split_batch: micro_batch_size must be at least 1, got {micro_batch_size}")
    if not batch.items:
        raise ValueError("split_batch: the batch has no items to re-collate; split batches that collate() made")
    return [
        collate(batch.items[start : start + micro_batch_size], pad_token_id, packed)
        for start in range(0, len(batch.items), micro_batch_size)
    ]


class BatchStream:
    """Deterministic, resumable batches: order = a permutation seeded by (seed, epoch); state is (epoch, index).

    Infinite: after the last batch of an epoch (full or partial - the last one holds the remainder) the epoch
    increments and a new permutation starts. `index` counts items (not batches) taken from the current epoch, so
    a resumed stream yields exactly the batches an uninterrupted one would, whatever happened in between."""

    STATE_VERSION = 1

    def __init__(
        self,
        items: Sequence[Example | PackedSequence],
        batch_size: int,
        seed: int,
        pad_token_id: int | None,
        packed: bool,
        shuffle: bool = True,
    ):
        if not items:
            raise DataError("no examples to batch; the data file produced none (see the DataStats of tokenizing)")
        if batch_size < 1:
            raise ConfigError(f"batch_size: {batch_size} is not a batch size; use 1 or more")
        self.items = list(items)
        self.batch_size = batch_size
        self.seed = seed
        self.pad_token_id = pad_token_id
        self.packed = packed
        self.shuffle = shuffle
        self.epoch = 0
        """Epochs completed."""
        self.index = 0
        """Items of the current epoch already batched."""
        self._order: tuple[int, list[int]] | None = None
        self._fingerprint: str | None = None

    @property
    def batches_per_epoch(self) -> int:
        return math.ceil(len(self.items) / self.batch_size)

    def order(self, epoch: int) -> list[int]:
        """Item indices in the order epoch `epoch` visits them."""
        if self._order is None or self._order[0] != epoch:
            order = list(range(len(self.items)))
            if self.shuffle:
                # str seeds are hashed with SHA-512 by random.seed: the same permutation on every Python/platform
                random.Random(f"fitune-data/{self.seed}/{epoch}").shuffle(order)
            self._order = (epoch, order)
        return self._order[1]

    def next_batch(self) -> Batch:
        chosen = self.order(self.epoch)[self.index : self.index + self.batch_size]
        self.index += len(chosen)
        if self.index >= len(self.items):
            self.epoch, self.index = self.epoch + 1, 0
        return collate([self.items[i] for i in chosen], self.pad_token_id, self.packed)

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        return self.next_batch()

    def fingerprint(self) -> str:
        """A hash of the items' lengths and token sums: tells a checkpoint's data from changed data."""
        if self._fingerprint is None:
            digest = hashlib.sha256()
            for item in self.items:
                digest.update(f"{len(item)}:{sum(item.input_ids)}:{sum(item.labels)};".encode())
            self._fingerprint = digest.hexdigest()[:16]
        return self._fingerprint

    def state_dict(self) -> dict:
        """Plain ints and strings (JSON- and torch.save-safe)."""
        return {
            "version": self.STATE_VERSION,
            "epoch": self.epoch,
            "index": self.index,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "items": len(self.items),
            "fingerprint": self.fingerprint(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from `state`. The batch size may differ (the position is counted in items); the data, seed and
        shuffling must be the checkpoint's.

        Raises:
            DataError: the state is from other data, another seed or shuffle setting.
        """
        problems = []
        if state.get("version") != self.STATE_VERSION:
            problems.append(f"data state version {state.get('version')!r}, expected {self.STATE_VERSION}")
        for key, now in (("items", len(self.items)), ("seed", self.seed), ("shuffle", self.shuffle),
                         ("fingerprint", self.fingerprint())):
            if key in state and state[key] != now:
                problems.append(f"{key}: checkpoint {state[key]!r}, now {now!r}")
        if problems:
            raise DataError(
                "cannot resume the data position: the checkpoint was made with other data or settings ("
                + "; ".join(problems)
                + "); resume with the same data file, seq_len, packing and seed, or start a new run"
            )
        epoch, index = int(state["epoch"]), int(state["index"])
        if epoch < 0 or not 0 <= index < len(self.items):
            raise DataError(f"cannot resume the data position: epoch {epoch}, index {index} is out of range")
        self.epoch, self.index = epoch, index

    def split(self, batch: Batch, micro_batch_size: int) -> list[Batch]:
        """The same tokens in micro-batches of at most micro_batch_size rows (for the OOM guard); see split_batch."""
        return split_batch(batch, micro_batch_size, self.pad_token_id, self.packed)

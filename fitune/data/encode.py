"""Encoding records into training examples: token ids and labels, with the model's own tokenizer.

Formats (`fitune.data.formats.FORMATS`):
- chat:       {"messages": [{"role": ..., "content": ...}, ...]} - rendered with the tokenizer's chat template; the
              loss only on the tokens assistant turns add (their content and end-of-turn), everything else -100;
- completion: {"prompt": ..., "completion": ...} - the tokenizer's special prefix (e.g. <s>) and the prompt -100,
              completion tokens (+ eos) trained;
- text:       {"text": ...} - the special prefix and every token (+ eos) trained.

Labels follow transformers' convention: `ForCausalLMLoss` (transformers/loss/loss_utils.py) pads the labels with
-100 on the right and shifts them left, so the logits at position t are scored against labels[t + 1]. Hence the
label of the first token of an example is never a target, and this module always sets it to -100: then
`trained_tokens` (labels != -100) is exactly the number of loss terms.

`encode_records` is the one encoder: `fitune train` (through `tokenize_records`), `fitune doctor --data` and
`fitune plan --data` (through `fitune.data.scan`) all count tokens with it. It returns what each record became
(`DataStats`) and the records it could not encode (`RecordProblem`s), so callers choose to raise or to report.
A record with no token to train on is dropped, never kept with zero loss terms; `DataStats` says which lines and
why (nothing to train on at all, or truncation cut the answer away - then it also counts as truncated).

Pure Python plus the tokenizer object it is given; `load_tokenizer` imports transformers when called.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Sequence

from ..errors import ConfigError, DataError
from .formats import FORMATS, detect_format
from .read import RecordProblem, data_error, json_type, read_records, source_of, unit_of

IGNORE_INDEX = -100
"""Label of a token that carries no loss (transformers' and torch's cross-entropy `ignore_index`)."""
MAX_LISTED_LINES = 10
"""Line numbers of dropped records a DataStats message lists; the rest are counted."""


class _RecordProblem(Exception):
    """Internal: what is wrong with one record; becomes a RecordProblem with the record's line number."""


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


@dataclass(frozen=True)
class RecordTokens:
    """What one record with something to train on became, before and after truncation at seq_len_tokens."""

    line: int
    """The record's line (.jsonl) or 1-based index (other files): see `Records.unit`."""
    tokens: int
    """Tokens of the whole record (special prefix, eos or chat template included), before truncation."""
    trained_tokens: int
    """Tokens with a label, before truncation; at least 1 (records without are `DataStats.empty`)."""
    kept_tokens: int
    """Tokens after truncation: min(tokens, seq_len_tokens)."""
    kept_trained_tokens: int
    """Tokens with a label after truncation; 0 when truncation cut every trained token (the record is dropped)."""

    @property
    def kept(self) -> bool:
        """The record becomes a training example (it has a trained token after truncation)."""
        return self.kept_trained_tokens > 0

    @property
    def truncated(self) -> bool:
        return self.tokens > self.kept_tokens


@dataclass(frozen=True)
class DataStats:
    """What encoding a data file kept, cut and dropped, record by record. Counts are of records or of tokens, as
    named; every figure `fitune train` logs, `fitune doctor --data` reports and `fitune plan --data` uses is one of
    these properties."""

    format: str
    """chat | completion | text: the format the records were read as."""
    seq_len_tokens: int
    """The length records were truncated to."""
    records: tuple[RecordTokens, ...] = ()
    """Every record with a token to train on (before truncation), in file order."""
    empty: tuple[tuple[int, str], ...] = ()
    """(line, why) of each record with no token to train on even before truncation (an empty text or completion, a
    chat with no assistant message); dropped."""
    source: str | None = None
    """The file the records came from."""
    unit: str = "line"
    """What the record numbers count: "line" or "record" (see `Records.unit`)."""

    @property
    def examples(self) -> int:
        """Records kept as training examples."""
        return sum(1 for r in self.records if r.kept)

    @property
    def tokens(self) -> int:
        """Tokens of the kept examples, after truncation."""
        return sum(r.kept_tokens for r in self.records if r.kept)

    @property
    def trained_tokens(self) -> int:
        """Tokens of the kept examples with a label (labels != -100), after truncation."""
        return sum(r.kept_trained_tokens for r in self.records if r.kept)

    @property
    def lengths(self) -> list[int]:
        """Tokens of each kept example, after truncation, in record order: what is batched."""
        return [r.kept_tokens for r in self.records if r.kept]

    @property
    def lengths_tokens(self) -> tuple[int, ...]:
        """Tokens of every record with something to train on, before truncation, in record order (kept or not)."""
        return tuple(r.tokens for r in self.records)

    @property
    def truncated_lines(self) -> tuple[int, ...]:
        """Records longer than seq_len_tokens, cut to it: those kept and those the cut left with nothing to train
        on (see truncated_away_lines)."""
        return tuple(r.line for r in self.records if r.truncated)

    @property
    def truncated_records(self) -> int:
        return len(self.truncated_lines)

    @property
    def truncated_tokens(self) -> int:
        """Tokens cut by truncation from the records of truncated_lines."""
        return sum(r.tokens - r.kept_tokens for r in self.records)

    @property
    def truncated_away_lines(self) -> tuple[int, ...]:
        """Records whose every trained token lies past seq_len_tokens (e.g. a long prompt pushes the answer out):
        truncated, then dropped."""
        return tuple(r.line for r in self.records if not r.kept)

    @property
    def empty_lines(self) -> tuple[int, ...]:
        return tuple(line for line, _ in self.empty)

    @property
    def dropped_lines(self) -> tuple[int, ...]:
        """Every record dropped for having no trained token: empty ones and truncated-away ones, in file order."""
        return tuple(sorted(self.empty_lines + self.truncated_away_lines))

    @property
    def dropped_records(self) -> int:
        return len(self.dropped_lines)

    def summary(self) -> str:
        """One line for a log: examples, tokens, truncation and drops."""
        return (
            f"{_count(self.examples, 'example')}, {self.tokens:,} tokens ({self.trained_tokens:,} trained); "
            f"{self.truncated_records:,} truncated at {self.seq_len_tokens} tokens ({self.truncated_tokens:,} tokens "
            f"cut); {self.dropped_records:,} dropped without a token to train on"
        )

    def dropped_message(self) -> str | None:
        """Which records were dropped and why, with their first line numbers; None when none was."""
        if not self.dropped_records:
            return None
        parts = []
        if self.empty:
            parts.append(f"{len(self.empty):,} with nothing to train on ({_line_list(self.unit, self.empty_lines)}: "
                         f"{_empty_hint(self.format)})")
        away = self.truncated_away_lines
        if away:
            parts.append(f"{len(away):,} whose trained tokens all lie past seq_len {self.seq_len_tokens} "
                         f"({_line_list(self.unit, away)}; raise seq_len or shorten their prompts)")
        return f"{self.source or 'data'}: dropped {_count(self.dropped_records, 'record')}: " + "; ".join(parts)


def _count(n: int, noun: str) -> str:
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


def _line_list(unit: str, lines: Sequence[int]) -> str:
    shown = ", ".join(str(line) for line in lines[:MAX_LISTED_LINES])
    more = f" and {len(lines) - MAX_LISTED_LINES:,} more" if len(lines) > MAX_LISTED_LINES else ""
    return f"{unit}{'' if len(lines) == 1 else 's'} {shown}{more}"


def _empty_hint(fmt: str) -> str:
    return {
        "chat": "a conversation needs an assistant message",
        "completion": "the completion is empty",
        "text": "the text is empty",
    }[fmt]


# ---------------------------------------------------------------------------------------------------------------
# Tokenizer


def load_tokenizer(folder: str) -> Any:
    """The transformers tokenizer saved in `folder` (a model folder works), loaded without network access.

    Raises:
        DataError: the folder is missing, transformers is not installed, or no tokenizer can be loaded from it.
    """
    if not os.path.isdir(folder):
        raise DataError(f"--tokenizer {folder}: no such folder; pass a folder with tokenizer.json / "
                        "tokenizer_config.json (a downloaded model folder works)")
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:
        raise DataError("tokenizing data needs transformers to load the tokenizer (pip install transformers)") from exc
    try:
        return AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except Exception as exc:  # transformers raises OSError / ValueError / KeyError depending on what is missing
        raise DataError(f"--tokenizer {folder}: transformers could not load a tokenizer from it ({exc})") from exc


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
        raise _RecordProblem(f"field '{name}' is a {json_type(value)}, not a string{hint}")
    return value


def _messages_field(record: dict) -> list[dict]:
    if "messages" not in record:
        raise _RecordProblem(f"missing field 'messages' (keys found: {sorted(record)})")
    messages = record["messages"]
    if not isinstance(messages, list) or not messages:
        raise _RecordProblem("field 'messages' must be a non-empty list of {\"role\": ..., \"content\": ...}")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise _RecordProblem(f"messages[{i}] is a {json_type(message)}, not an object {{\"role\", \"content\"}}")
        for key in ("role", "content"):
            if key not in message:
                raise _RecordProblem(f"missing field '{key}' in messages[{i}] (keys found: {sorted(message)})")
            if not isinstance(message[key], str):
                raise _RecordProblem(f"messages[{i}].{key} is a {json_type(message[key])}, not a string")
    return messages




# ---------------------------------------------------------------------------------------------------------------
# Records -> examples


def encode_records(
    records: Sequence[tuple[int, dict]],
    tokenizer: Any,
    fmt: str | None,
    seq_len_tokens: int,
    *,
    source: str | None = None,
) -> tuple[list[Example], DataStats, list[RecordProblem]]:
    """Encode records into Examples, labels masked by format, truncated to seq_len_tokens; report, don't raise,
    on bad records.

    Args:
        records: (line_number, record) pairs, as read_records / scan_records return them.
        tokenizer: the model's transformers tokenizer (chat uses its chat template).
        fmt: "chat", "completion", "text", or None to detect it from the records.
        seq_len_tokens: the longest example kept; longer ones are cut at the end (and counted in the stats).
        source: the file the records came from, named in messages (default: the path read_records kept).

    Returns:
        The kept examples in record order; what every record became (DataStats); the records that could not be
        encoded (kind "malformed": a missing field, a wrong type, a chat the template cannot render).

    Raises:
        ConfigError: fmt or seq_len_tokens is not usable.
        DataError: no record has a known format; chat without a chat template.
    """
    source = source_of(records, source)
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
    rows: list[RecordTokens] = []
    empty: list[tuple[int, str]] = []
    problems: list[RecordProblem] = []
    for line_number, record in records:
        try:
            ids, labels = encoder.encode(fmt, record)
        except _RecordProblem as problem:
            problems.append(RecordProblem(line_number, "malformed", str(problem)))
            continue
        if labels:
            labels[0] = IGNORE_INDEX  # never a target: the loss scores labels[t + 1] against the logits at t
        trained = sum(1 for label in labels if label != IGNORE_INDEX)
        if trained == 0:
            empty.append((line_number, _empty_hint(fmt)))
            continue
        example = Example(tuple(ids[:seq_len_tokens]), tuple(labels[:seq_len_tokens]))
        row = RecordTokens(line_number, len(ids), trained, len(example), example.trained_tokens)
        rows.append(row)
        if row.kept:
            examples.append(example)
    stats = DataStats(format=fmt, seq_len_tokens=seq_len_tokens, records=tuple(rows), empty=tuple(empty),
                      source=source, unit=unit_of(source))
    return examples, stats, problems


def tokenize_records(
    records: Sequence[tuple[int, dict]],
    tokenizer: Any,
    fmt: str | None,
    seq_len_tokens: int,
    *,
    source: str | None = None,
) -> tuple[list[Example], DataStats]:
    """encode_records for training: any bad record is an error, and so is a file with nothing to train on.

    Records with no token to train on are dropped (not kept with zero loss terms); `DataStats.dropped_message()`
    says which, and the caller should show it.

    Raises:
        ConfigError: fmt or seq_len_tokens is not usable.
        DataError: chat without a chat template; records missing their format's fields (all listed by number);
            no record left to train on.
    """
    source = source_of(records, source)
    examples, stats, problems = encode_records(records, tokenizer, fmt, seq_len_tokens, source=source)
    if problems:
        raise data_error(source, problems)
    if not examples:
        raise DataError(
            f"{source or 'data'}: none of the {len(records)} records has a token to train on (format {stats.format}, "
            f"seq_len {seq_len_tokens}): {_no_examples_reason(stats.format)}",
            path=source,
        )
    return examples, stats


def _no_examples_reason(fmt: str) -> str:
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

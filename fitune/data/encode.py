"""Encoding records into training examples: token ids and labels, with the model's own tokenizer.

Formats (`fitune.data.formats.FORMATS`) are first turned into one of three shapes (`fitune.data.convert`):
- chat:       {"messages": [{"role": ..., "content": ...}, ...]} - rendered with the tokenizer's chat template; the
              loss only on the tokens assistant turns add (their content and end-of-turn), everything else -100
              (alpaca with a chat template, sharegpt, and conversational_completion - whose prompt's assistant turns
              are not trained - become this);
- completion: {"prompt": ..., "completion": ...} - the tokenizer's special prefix (e.g. <s>) and the prompt -100,
              completion tokens (+ eos) trained (alpaca without a chat template becomes this, with Stanford
              Alpaca's prompt);
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

import functools
import json
import logging
import os
import re
import signal
import threading
from dataclasses import dataclass
from itertools import islice
from typing import Any, Sequence

from ..datasource import tokenizer_source_problem  # defined below the spine (fitune.config checks it)
from ..errors import ConfigError, DataError
from .convert import TRAINED_FROM, ShapeProblem, needs_chat_template, normalise, string_field
from .formats import FORMATS, canonical_format, detect_format, format_of
from .read import RecordProblem, Records, data_error, iter_records, json_type, read_records, source_of, unit_of

log = logging.getLogger(__name__)

IGNORE_INDEX = -100
"""Label of a token that carries no loss (transformers' and torch's cross-entropy `ignore_index`)."""
EXACT_TURNS = 64
"""Assistant turns of one conversation located by rendering the conversation up to each (exact, and quadratic in
the turns); in a longer one, those past the kept tokens are located by their content (linear)."""
MAX_LISTED_LINES = 10
"""Line numbers of dropped records a DataStats message lists; the rest are counted."""


_RecordProblem = ShapeProblem
"""Internal: what is wrong with one record (a field, or the chat template); becomes a RecordProblem with the
record's line number. The same exception `convert.normalise` raises for a record's fields."""


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
    """One of `fitune.data.formats.FORMATS`: the format the records were read as (detected or data.format)."""
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
    chat_template: bool = False
    """The records were rendered with the tokenizer's chat template (chat, sharegpt, conversational_completion,
    and alpaca with a tokenizer that has one)."""

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
        "alpaca": "the output is empty",
        "sharegpt": "a conversation needs a gpt (assistant) turn",
        "conversational_completion": "the completion needs an assistant message",
    }[fmt]


# ---------------------------------------------------------------------------------------------------------------
# Tokenizer


def load_tokenizer(source: str, trust_remote_code: bool = False, *, key: str = "--tokenizer",
                   download: bool = False) -> Any:
    """The transformers tokenizer of `source`, loaded without network access: a tokenizer or model folder, a .gguf
    file (the tokenizer stored in its metadata) or a Hub id from the Hub cache (`fitune.specs.sources.local_model`).

    The one tokenizer loader: `fitune plan --data` and `fitune doctor --data` call it as it is, `fitune train`
    (`fitune.runtime.model.load_tokenizer`) with `key="tokenizer:"` and `download=True` (a Hub id not in the cache
    is downloaded first, unless HF_HUB_OFFLINE is set). `key` names the flag or YAML key in messages.

    Raises:
        DataError: `source` is none of those (or a Hub id that is not cached: the message gives the `hf download`
            command), transformers is not installed, or no tokenizer can be loaded from it.
    """
    # the command's library: imported when it runs, so that `fitune --help` stays light
    from ..specs.sources import local_model

    source = str(source)
    problem = tokenizer_source_problem(source, key)
    if problem:
        raise DataError(problem)
    try:
        where = local_model(source, download=download, key=key)
    except ConfigError as exc:
        raise DataError(str(exc)) from exc
    if trust_remote_code:
        from ..specs.sources import announce_remote_code

        announce_remote_code(source, where.folder, log)
    try:
        # transformers: optional, imported where used (estimate, plan and doctor SCRIPT never load it)
        from transformers import AutoTokenizer
    except ImportError as exc:
        raise DataError("tokenizing data needs transformers to load the tokenizer (pip install transformers)") from exc
    try:
        tokenizer = AutoTokenizer.from_pretrained(where.folder, local_files_only=True,
                                                  trust_remote_code=trust_remote_code, **where.from_pretrained_kwargs())
    except Exception as exc:  # transformers raises OSError / ValueError / KeyError depending on what is missing
        damaged = _damaged_tokenizer_file(where.folder) if not where.gguf_file else None
        if damaged:
            raise DataError(f"{key} {source}: {damaged}; download the tokenizer files again (or fix that file)",
                            path=damaged.split(" ", 1)[0]) from exc
        from ..specs.sources import config_json_problem  # AutoTokenizer reads config.json to pick the class

        refused = config_json_problem(where.folder, exc) if not where.gguf_file else None
        if refused:
            raise DataError(f"{key} {source}: {refused}", path=os.path.join(where.folder, "config.json")) from exc
        raise DataError(f"{key} {source}: transformers could not load a tokenizer from it ({exc}); point it at a "
                        "folder holding tokenizer.json / tokenizer_config.json") from exc
    if where.gguf_file:
        set_gguf_special_tokens(tokenizer, os.path.join(where.folder, where.gguf_file))
    return tokenizer


TOKENIZER_JSON_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                        "added_tokens.json", "vocab.json")
"""The JSON files of a tokenizer folder that transformers reads; a damaged one is named by `_damaged_tokenizer_file`."""


def _damaged_tokenizer_file(folder: str) -> str | None:
    """"PATH is not valid JSON (why)" for the first tokenizer file of `folder` that does not parse, else None."""
    for name in TOKENIZER_JSON_FILES:
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            continue
        try:
            with open(path, encoding="utf-8") as f:
                json.load(f)
        except (ValueError, OSError) as exc:  # UnicodeDecodeError is a ValueError
            return f"{path} is not valid JSON ({exc})"
    return None


#: GGUF metadata keys of the special tokens (llama.cpp's gguf/constants.py, Keys.Tokenizer) -> the tokenizer's
#: attribute they name.
GGUF_SPECIAL_TOKENS = {"tokenizer.ggml.bos_token_id": "bos_token", "tokenizer.ggml.eos_token_id": "eos_token",
                       "tokenizer.ggml.padding_token_id": "pad_token", "tokenizer.ggml.unknown_token_id": "unk_token"}


def set_gguf_special_tokens(tokenizer: Any, gguf_path: str) -> None:
    """Give a tokenizer converted from a GGUF file the special tokens the file names.

    transformers 5.17's GGUF tokenizer conversion can name the wrong ones: for SmolLM2-135M-Instruct.Q4_1.gguf
    (tokenizer.ggml.eos_token_id 2, `<|im_end|>`) it sets eos to `<|im_start|>` (id 1), so text and completion
    records would end in the wrong token and `generate` would not stop where the model does. The file's ids win.
    """
    from ..specs.sources import read_gguf_header

    metadata, _ = read_gguf_header(gguf_path)
    for meta_key, attribute in GGUF_SPECIAL_TOKENS.items():
        token_id = metadata.get(meta_key)
        if isinstance(token_id, int) and 0 <= token_id < len(tokenizer):
            setattr(tokenizer, attribute, tokenizer.convert_ids_to_tokens(token_id))


def pad_id(tokenizer: Any) -> int:
    """The token id to pad with: the tokenizer's pad token, else its eos, else 0. Padding never reaches the loss
    (labels -100) nor attention (mask 0, or its own segment in packed rows), so any id is correct."""
    for token_id in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if token_id is not None:
            return int(token_id)
    return 0


class _Encoder:
    """Turns one record into (input_ids, labels) with one tokenizer; raises _RecordProblem for a bad record."""

    def __init__(self, tokenizer: Any, seq_len_tokens: int | None = None):
        self.tokenizer = tokenizer
        self.seq_len_tokens = seq_len_tokens
        """Tokens kept of each example (None: all): assistant turns that start past them are located by their
        content (linear) instead of by rendering the conversation up to them (quadratic in the turns)."""
        self.eos = tokenizer.eos_token_id
        self.fast = bool(getattr(tokenizer, "is_fast", False))
        self.prefix = self._special_prefix()
        self._template_checked = False

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
        """`fmt`: the shape `fitune.data.convert.normalise` gave the record (chat, completion or text)."""
        if fmt == "chat" and TRAINED_FROM in record:
            return self.chat_from(record)
        if fmt == "chat":
            return self.chat(record)
        if fmt == "completion":
            prompt, completion = string_field(record, "prompt"), string_field(record, "completion")
            if not completion.strip():
                return [], []
            prompt_ids = self.prefix + self.ids(prompt)
            completion_ids = self.with_eos(self.ids(completion))
            return prompt_ids + completion_ids, [IGNORE_INDEX] * len(prompt_ids) + completion_ids
        text = string_field(record, "text")
        if not text.strip():
            return [], []
        ids = self.with_eos(self.prefix + self.ids(text))
        return ids, list(ids)

    # chat ---------------------------------------------------------------------------------------------------

    def chat_from(self, record: dict) -> tuple[list[int], list[int]]:
        """chat, but trained only on the assistant turns from message record[TRAINED_FROM] on (TRL's conversational
        prompt-completion: the prompt's own assistant turns are context). Tokens wholly inside the text the
        template renders for the prompt are masked."""
        messages, first = record["messages"], record[TRAINED_FROM]
        ids, labels = self.chat({"messages": messages})
        if not any(m["role"] == "assistant" for m in messages[:first]) or not ids:
            return ids, labels  # nothing in the prompt is trained: chat's labels are already the answer
        full = self.render(messages)
        prompt = self.render(messages[:first])
        if not full.startswith(prompt):
            raise _RecordProblem(
                "the chat template renders the prompt's messages differently once the completion follows, so the "
                "prompt cannot be told from the completion; drop the assistant turns from the prompt, or write the "
                "record as format chat"
            )
        _, after_prompt = self.tokenize_in_spans(full, [(len(prompt), len(full))])
        return ids, [label if keep else IGNORE_INDEX for label, keep in zip(labels, after_prompt)]

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        if not self._template_checked:  # before the first record: a template that loops for hours is refused here
            check_chat_template_time(self.tokenizer)
            self._template_checked = True

        def apply() -> str:
            return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt)

        try:
            text = run_with_time_limit(apply, RENDER_LIMIT_S)
        except _TimeLimit:
            raise DataError(_slow_template_message(self.tokenizer, RENDER_LIMIT_S,
                                                   f"a {len(messages)}-message conversation")) from None
        except Exception as e:  # jinja2 TemplateError, or the template's own raise_exception(...)
            raise _RecordProblem(f"the chat template cannot render these messages: {e}") from None
        found = _SURROGATE.search(text)
        if found:  # the record's own text is checked (`_check_unicode`); a template can write one (`'\\udcff'`)
            raise _RecordProblem(f"the chat template writes an unpaired surrogate ({ascii(found.group())[1:-1]}) at "
                                 f"character {found.start()}: not valid Unicode, which no tokenizer takes; fix the "
                                 "chat_template")
        return text

    def chat(self, record: dict) -> tuple[list[int], list[int]]:
        messages = _messages_field(record)
        full = self.render(messages)
        exact_until = self._kept_chars(full, sum(m["role"] == "assistant" for m in messages))
        spans: list[tuple[int, int]] = []
        cursor, first = 0, 0  # the end of the last assistant turn: in characters, and the message after it
        for i, message in enumerate(messages):
            if message["role"] == "assistant":
                # A turn that starts past the kept tokens is cut by truncation: only the record's token counts see
                # it, and finding its content is linear where rendering every prefix is quadratic in the turns.
                span = self.assistant_span if cursor < exact_until else self._span_past_the_cut
                start, end = span(messages, i, full, cursor, first)
                spans.append((start, end))
                cursor, first = end, i + 1
        if not spans:
            return [], []
        ids, inside = self.tokenize_in_spans(full, spans)
        return ids, [token_id if trained else IGNORE_INDEX for token_id, trained in zip(ids, inside)]

    def assistant_span(self, messages: list[dict], i: int, full: str, cursor: int, first: int) -> tuple[int, int]:
        """Characters of `full` that assistant turn i adds: from the end of the conversation before it (with the
        template's generation prompt, so the "assistant:" header is not trained) to the end of the turn (its
        content and end-of-turn token, so the model learns to stop; not the whitespace a template writes after
        that token, which the model never generates: see `_end_of_turn`). docs/assistant_loss.md compares the
        tokens this trains with transformers' `return_assistant_tokens_mask`, template by template."""
        upto = self.render(messages[: i + 1])
        if full.startswith(upto):
            for generation_prompt in (True, False):
                try:
                    before = self.render(messages[:i], add_generation_prompt=generation_prompt)
                except _RecordProblem:  # e.g. a template that cannot render an empty conversation
                    before = ""
                if upto.startswith(before) and len(before) >= cursor:
                    return len(before), self._end_of_turn(full, len(before), len(upto))
            # The conversation before the turn renders differently on its own (Mistral v0.3 writes the system
            # prompt into the last user turn, so only when the conversation ends there): the turn starts where
            # the same turn with no content departs from it.
            try:
                empty = self.render(messages[:i] + [{**messages[i], "content": ""}])
            except _RecordProblem:
                empty = ""
            start = _common_prefix_length(upto, empty)
            if cursor <= start < len(upto):
                return start, self._end_of_turn(full, start, len(upto))
        # The template renders an earlier turn differently once later turns follow (Qwen3 drops earlier
        # reasoning, for one): fall back to finding the content in the full text, plus an eos right after it.
        return self.span_by_content(messages, i, full, cursor, first)

    def span_by_content(self, messages: list[dict], i: int, full: str, cursor: int, first: int) -> tuple[int, int]:
        """Assistant turn i found by its content in `full` after `cursor` (the turns between stepped over), plus
        an eos right after it; without rendering anything: linear."""
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

    def _span_past_the_cut(self, messages: list[dict], i: int, full: str, cursor: int, first: int) -> tuple[int, int]:
        """`span_by_content` for a turn truncation cuts: one whose content cannot be found (an empty one) counts
        no token instead of failing the record (no kept label depends on it)."""
        try:
            return self.span_by_content(messages, i, full, cursor, first)
        except _RecordProblem:
            return cursor, cursor

    def _kept_chars(self, full: str, turns: int) -> int:
        """Where in `full` the token past the first seq_len_tokens starts (the characters truncation keeps); past
        the end (every turn located exactly) when no length is set or the conversation has at most EXACT_TURNS
        assistant turns. One tokenization: linear."""
        if self.seq_len_tokens is None or turns <= EXACT_TURNS:
            return len(full) + 1
        if self.fast:
            offsets = self.tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
            return offsets[self.seq_len_tokens][0] if len(offsets) > self.seq_len_tokens else len(full) + 1
        ids = self.ids(full)
        if len(ids) <= self.seq_len_tokens:
            return len(full) + 1
        return len(self.tokenizer.decode(ids[: self.seq_len_tokens])) + 1  # a slow tokenizer gives no offsets

    def _end_of_turn(self, full: str, start: int, end: int) -> int:
        """`end` moved back over the whitespace the template writes after the turn's end-of-turn token (ChatML's
        "\\n" after <|im_end|>, Gemma's after <end_of_turn>): generation stops at that token, so the model never
        produces what follows it. Whitespace that follows no special token (a template whose turns end in "\\n\\n")
        is the only end-of-turn signal there is, and stays trained."""
        stripped = start + len(full[start:end].rstrip())
        if stripped < end and any(full.endswith(token, start, stripped) for token in self._special_texts):
            return stripped
        return end

    @functools.cached_property
    def _special_texts(self) -> frozenset[str]:
        """The texts of the tokenizer's special tokens: its named ones (bos, eos, ...) and every added token marked
        special (the SmolLM2 GGUF tokenizer names <|im_start|> its eos; <|im_end|> is only an added special token)."""
        added = getattr(self.tokenizer, "added_tokens_decoder", None) or {}
        texts = {token.content for token in added.values() if getattr(token, "special", False)}
        texts.update(getattr(self.tokenizer, "all_special_tokens", None) or ())
        return frozenset(text for text in texts if text)

    def tokenize_in_spans(self, text: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[bool]]:
        """Token ids of `text`, and for each token whether it covers a character of one of `spans` (character
        ranges). That is transformers' rule for `return_assistant_tokens_mask` (every token from the one holding a
        span's first character to the one holding its last, `char_to_token`): a token that straddles the start of
        a turn, like Mistral's " hello" after "[/INST]" where the template wrote the space, is trained."""
        if self.fast:
            encoding = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
            return list(encoding["input_ids"]), _inside_spans(encoding["offset_mapping"], spans)
        # A slow tokenizer gives no offsets: tokenize the text up to each span edge instead. A span's last token is
        # the last of the text up to its end; its first, the first token after those the text before it shares.
        ids = self.ids(text)
        inside = [False] * len(ids)
        for span_start, span_end in spans:
            first = self._first_token_from(ids, self.ids(text[:span_start]))
            last = len(self.ids(text[:span_end]))
            for k in range(first, min(last, len(ids))):
                inside[k] = True
        return ids, inside

    def _first_token_from(self, ids: list[int], before: list[int]) -> int:
        """The first token of `ids` not wholly inside the text `before` tokenizes to (a prefix of ids' text). Where
        the two part ways the edge either cuts a token of `ids` (that token is the first) or `before` merged its
        last tokens differently (Llama's "\\n\\n" ends a text as one token, two before a word): then the first token
        is the one after those that spell the same text."""
        shared = _common_prefix_length(ids, before)
        if shared == len(before):
            return shared
        tail = self.tokenizer.decode(before[shared:])
        end = shared
        while end < len(ids) and len(self.tokenizer.decode(ids[shared:end])) < len(tail):
            end += 1
        return end if self.tokenizer.decode(ids[shared:end]) == tail else shared

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


# ---------------------------------------------------------------------------------------------------------------
# Chat templates with a time limit

PROBE_LIMIT_S = 2.0
"""Seconds the chat template may take on PROBE_CONVERSATION before any record is encoded: real templates take
about a millisecond; a template with nested loops (`{% for a in range(100000) %}{% for b in range(100000) %}`) would
run for hours. (transformers renders in Jinja's ImmutableSandboxedEnvironment, which caps range() at 100,000 items
but not loops inside loops: the time limit is what bounds them.)"""
RENDER_LIMIT_S = 30.0
"""Seconds one record's render may take (a 200-turn conversation renders in milliseconds with a real template)."""
PROBE_CONVERSATION = ({"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"})


class _TimeLimit(BaseException):
    """Raised inside a render that ran past its limit. A BaseException, so that no `except Exception` of the
    template machinery swallows it."""


def run_with_time_limit(fn, limit_s: float):
    """`fn()`, or _TimeLimit once it has run `limit_s` seconds.

    In the main thread of a POSIX process with no interval timer running, SIGALRM interrupts `fn` itself (the
    previous handler is put back). Elsewhere `fn` runs in a daemon thread that is abandoned past the limit: the
    caller gets its answer in time, and the process exits on the error all the same.
    """
    usable = (hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()
              and signal.getitimer(signal.ITIMER_REAL)[0] == 0)
    if usable:
        def on_alarm(signum, frame):
            raise _TimeLimit()

        previous = signal.signal(signal.SIGALRM, on_alarm)
        try:
            signal.setitimer(signal.ITIMER_REAL, limit_s)
            return fn()
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
    outcome: dict = {}

    def target() -> None:
        try:
            outcome["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller as it is
            outcome["error"] = exc

    worker = threading.Thread(target=target, name="fitune-chat-template", daemon=True)
    worker.start()
    worker.join(limit_s)
    if worker.is_alive():
        raise _TimeLimit()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def _slow_template_message(tokenizer: Any, limit_s: float, what: str) -> str:
    name = getattr(tokenizer, "name_or_path", "") or "the tokenizer"
    return (f"the chat template of {name} takes too long to render (over {limit_s:g} s on {what}); it loops "
            "without bound (loops inside loops?): fix the chat_template in its tokenizer_config.json (or "
            "chat_template.jinja), or use the model's original tokenizer")


def check_chat_template_time(tokenizer: Any, limit_s: float = PROBE_LIMIT_S) -> None:
    """Render the tokenizer's chat template once on a 2-message conversation within `limit_s` seconds, before any
    record is encoded. A template that fails to render is left for the records to report (`_Encoder.render`).

    Raises:
        DataError: the template runs past the limit.
    """
    def apply() -> str:
        return tokenizer.apply_chat_template([dict(m) for m in PROBE_CONVERSATION], tokenize=False)

    try:
        run_with_time_limit(apply, limit_s)
    except _TimeLimit:
        raise DataError(_slow_template_message(tokenizer, limit_s, "a 2-message conversation")) from None
    except Exception:  # noqa: BLE001 - a template that cannot render this probe: the records say how
        pass


def _inside_spans(offsets: Sequence[tuple[int, int]], spans: list[tuple[int, int]]) -> list[bool]:
    """For each token's (start, end) characters, whether it covers a character of one of `spans` (sorted, disjoint
    character ranges, as `chat` makes them): one sweep over tokens and spans together, linear in both (testing
    every span for every token was quadratic: seconds for a conversation of a few thousand turns)."""
    inside, k, last_start = [], 0, -1
    for s, e in offsets:
        if s < last_start:  # offsets that go back (no fast tokenizer does): start the sweep over
            k = 0
        last_start = s
        while k < len(spans) and spans[k][1] <= s:
            k += 1  # a span that ends where this token starts ends before every later token too
        inside.append(e > s and k < len(spans) and spans[k][0] < e)
    return inside


def _common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading items `a` and `b` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


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
        fmt: one of FORMATS (or an alias of one), or None to detect it from the records.
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
    fmt = resolve_format(records, tokenizer, fmt, seq_len_tokens, source=source)
    chat_template = bool(getattr(tokenizer, "chat_template", None))
    encoder = _Encoder(tokenizer, seq_len_tokens)
    examples: list[Example] = []
    rows: list[RecordTokens] = []
    empty: list[tuple[int, str]] = []
    problems: list[RecordProblem] = []
    for line_number, record in records:
        try:
            ids, labels = encode_one(encoder, fmt, record, chat_template)
        except _RecordProblem as problem:
            problems.append(RecordProblem(line_number, "malformed", str(problem)))
            continue
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
                      source=source, unit=unit_of(source), chat_template=needs_chat_template(fmt, chat_template))
    return examples, stats, problems


def resolve_format(records: Sequence[tuple[int, dict]], tokenizer: Any, fmt: str | None, seq_len_tokens: int, *,
                   source: str | None = None) -> str:
    """The format to encode `records` with: `fmt` (an alias resolved) or, when None, the one detected from the
    records; checked against seq_len_tokens and the tokenizer's chat template.

    Raises:
        ConfigError: fmt is not a format, or seq_len_tokens below 2.
        DataError: no record has a known format; a format rendered with a chat template and a tokenizer without one.
    """
    if seq_len_tokens < 2:
        raise ConfigError(
            f"seq_len: {seq_len_tokens} tokens leaves nothing to train on; use at least 2 (typical: 512-4096)"
        )
    if fmt is None:
        fmt = detect_format(records, source=source)
    elif canonical_format(fmt) is None:
        raise ConfigError(
            f"data.format: {fmt!r} is not a format; use one of {', '.join(FORMATS)} (or leave it out to detect it "
            "from the records)"
        )
    fmt = canonical_format(fmt)
    if needs_chat_template(fmt, bool(getattr(tokenizer, "chat_template", None))) and \
            not getattr(tokenizer, "chat_template", None):
        name = getattr(tokenizer, "name_or_path", "") or "the tokenizer"
        raise DataError(
            f"{source or 'data'}: format {fmt} renders conversations with the tokenizer's chat template, and "
            f"{name} has none; use a chat/instruct model's tokenizer, add a chat_template to its "
            'tokenizer_config.json, or write the records as format completion {"prompt", "completion"} or '
            'text {"text"}',
            path=source,
        )
    return fmt


def encode_one(encoder: "_Encoder", fmt: str, record: dict, chat_template: bool) -> tuple[list[int], list[int]]:
    """One record of format `fmt` as (input_ids, labels), not truncated; the first label always -100.

    Raises:
        _RecordProblem: the record lacks its format's fields, or the chat template cannot render it.
    """
    _check_unicode(record)
    shape, normalised = normalise(fmt, record, chat_template)
    ids, labels = encoder.encode(shape, normalised)
    if labels:
        labels[0] = IGNORE_INDEX  # never a target: the loss scores labels[t + 1] against the logits at t
    return ids, labels


_SURROGATE = re.compile("[\ud800-\udfff]")


def _check_unicode(value: Any, depth: int = 0) -> None:
    """Raise _RecordProblem for a string of the record holding an unpaired surrogate (JSON's "\\ud800" escape
    read as half a UTF-16 pair, or a parquet / Hub value carrying one): not a character, and the tokenizer refuses
    it with a TypeError that names nothing."""
    if isinstance(value, str):
        found = _SURROGATE.search(value)
        if found:
            raise _RecordProblem(f"text with an unpaired surrogate ({ascii(found.group())[1:-1]}) at character "
                                 f"{found.start()}: not valid Unicode; fix the record")
    elif isinstance(value, dict) and depth < 32:
        for item in value.values():
            _check_unicode(item, depth + 1)
    elif isinstance(value, (list, tuple)) and depth < 32:
        for item in value:
            _check_unicode(item, depth + 1)


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
        "alpaca": "outputs are empty, or instructions fill the whole seq_len; raise seq_len",
        "sharegpt": "conversations need a gpt (assistant) turn inside the first seq_len tokens; raise seq_len if long "
        "prompts push the answers out",
        "conversational_completion": "completions need an assistant message inside the first seq_len tokens; raise "
        "seq_len if long prompts push the answers out",
    }[fmt]


def load_examples(
    path: str, tokenizer: Any, fmt: str | None, seq_len_tokens: int
) -> tuple[list[Example], DataStats]:
    """read_records + tokenize_records, with errors naming `path`."""
    return tokenize_records(read_records(path), tokenizer, fmt, seq_len_tokens, source=path)


PEEK_RECORDS = 100
"""Records of a data file `check_first_records` reads: enough to catch a wrong format, few enough to take no time."""


def check_first_records(path: str, fmt: str | None, *, split: str = "train", subset: str | None = None,
                        limit: int = PEEK_RECORDS) -> str:
    """The format of a local data file and its first `limit` records checked against it, without a tokenizer: what
    `fitune train` says before it loads the tokenizer and the model (the full check runs when the data is
    tokenized). Returns the format (`fmt`, or the one detected from the records).

    Raises:
        DataError: a record that cannot be read (the whole file is then read, so that every bad line is listed at
            once), no record of a known format, or records among the first `limit` that lack their format's fields
            or have them of the wrong type (all of those listed).
    """
    try:
        records = Records(islice(iter_records(path, split, subset), limit), path)
    except DataError:
        read_records(path, split, subset)  # every bad line of the file, listed at once
        raise
    given = fmt
    fmt = detect_format(records, source=path) if fmt is None else canonical_format(fmt)
    if fmt is None:
        return ""  # not a format: TrainConfig.validate names the key
    problems = []
    for line, record in records:
        try:
            normalise(fmt, record, chat_template=True)
        except ShapeProblem as problem:
            problems.append(RecordProblem(line, "malformed", str(problem)))
    if not problems:
        return fmt
    notes = [f"checked the first {limit} records before loading the model"] if len(records) == limit else []
    looks = next((f for f in map(format_of, (r for _, r in records)) if f is not None), None)
    if given is not None and looks not in (None, fmt):
        notes.append(f"these records look like format {looks}, not {fmt}: set data.format (--data-format) to {looks}, "
                     "or leave it out to detect the format from the records")
    error = data_error(path, problems)
    raise DataError(str(error) + "".join(f"\n  ({note})" for note in notes), path=path, line=error.line)

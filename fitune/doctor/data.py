"""`scan_data`: what a training data file costs once tokenised - lengths, padding, truncation, bad records.

Formats (.jsonl, or .json holding a list of records; detected from the first record with a known shape):
- chat:       {"messages": [{"role": ..., "content": ...}, ...]} - rendered with the tokenizer's chat template when it
              has one, else as "role: content" lines;
- completion: {"prompt": ..., "completion": ...} - the two tokenised one after the other;
- text:       {"text": ...}.

Padding is compared for one epoch in file order at `seq_len_tokens` (examples longer are truncated to it):
padding every example to the sequence length, padding each batch of `batch_size` to its longest example (dynamic
padding), and packing examples back to back into rows of the sequence length.

The tokenizer is loaded with transformers (imported only here, only when scanning); the rest is pure Python.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from dataclasses import dataclass, field

from ..setup import DEFAULT_SETUP
from .findings import ERROR, INFO, WARNING, DataError, Finding, sort_findings

DEFAULT_BATCH_SIZE = 8
"""Sequences per batch for the dynamic-padding figure when --batch-size is not given."""
MAX_FINDINGS_PER_RULE = 20
"""Line-level findings listed one by one per rule; the rest are summarised in one more finding."""
PADDING_WASTE_NOTE = 0.5
"""Report padding to the sequence length when more than this share of the token slots would be padding."""
FORMATS = ("chat", "completion", "text")


@dataclass(frozen=True)
class HistogramBin:
    low_tokens: int
    high_tokens: int
    count: int


@dataclass(frozen=True)
class PaddingCost:
    """What one way of batching costs over the epoch: token positions computed vs real tokens."""

    strategy: str
    """max_length | dynamic | packing."""
    slot_tokens: int
    """Token positions the model computes (real + padding)."""
    real_tokens: int

    @property
    def padding_tokens(self) -> int:
        return self.slot_tokens - self.real_tokens

    @property
    def padding_share(self) -> float:
        return self.padding_tokens / self.slot_tokens if self.slot_tokens else 0.0


@dataclass(frozen=True)
class DataReport:
    """The scan of one data file. Token counts are per record, before truncation unless named otherwise."""

    path: str
    format: str
    chat_template: bool
    """Chat records were rendered with the tokenizer's chat template (False: "role: content" lines)."""
    lengths_tokens: tuple[int, ...]
    """Tokens of each valid record, in file order."""
    seq_len_tokens: int
    batch_size: int
    histogram: tuple[HistogramBin, ...]
    padding: tuple[PaddingCost, ...]
    truncated_records: int
    truncated_tokens: int
    """Tokens cut off by truncating at seq_len_tokens."""
    findings: tuple[Finding, ...] = field(default_factory=tuple)

    @property
    def records(self) -> int:
        return len(self.lengths_tokens)

    def length_stats(self) -> dict[str, float]:
        xs = sorted(self.lengths_tokens)
        if not xs:
            return {}
        return {"min": xs[0], "median": statistics.median(xs), "mean": statistics.fmean(xs),
                "p90": _percentile(xs, 0.90), "p99": _percentile(xs, 0.99), "max": xs[-1]}

    def to_dict(self) -> dict:
        return {
            "file": self.path, "format": self.format, "chat_template": self.chat_template, "records": self.records,
            "seq_len_tokens": self.seq_len_tokens, "batch_size": self.batch_size,
            "length_tokens": self.length_stats(),
            "histogram": [{"low_tokens": b.low_tokens, "high_tokens": b.high_tokens, "count": b.count}
                          for b in self.histogram],
            "padding": {p.strategy: {"slot_tokens": p.slot_tokens, "real_tokens": p.real_tokens,
                                     "padding_tokens": p.padding_tokens, "padding_share": round(p.padding_share, 4)}
                        for p in self.padding},
            "truncated_records": self.truncated_records, "truncated_tokens": self.truncated_tokens,
            "findings": [f.to_dict() for f in self.findings],
        }


@dataclass
class _Raw:
    line: int
    value: object


def scan_data(path: str, tokenizer_dir: str, seq_len_tokens: int | None = None,
              batch_size: int = DEFAULT_BATCH_SIZE) -> DataReport:
    """Tokenise every record of `path` with the tokenizer in `tokenizer_dir` and report lengths and waste.

    Raises:
        DataError: the file is missing, empty, has no usable record, or the tokenizer cannot be loaded.
    """
    seq_len = seq_len_tokens or DEFAULT_SETUP.seq_len_tokens
    if seq_len < 1 or batch_size < 1:
        raise DataError(f"--seq-len and --batch-size must be positive integers, got {seq_len} and {batch_size}")
    raws, findings = read_records(path)
    fmt, format_line = _detect_format(path, raws, findings)
    texts: list[tuple[int, object]] = []  # (line, text or messages)
    for raw in raws:
        item = _validate(raw, fmt, format_line, findings)
        if item is not None:
            texts.append((raw.line, item))
    tok = load_tokenizer(tokenizer_dir)
    use_template = fmt == "chat" and bool(getattr(tok, "chat_template", None))
    lines, lengths = _tokenise(tok, fmt, use_template, texts, findings)
    if not lengths:
        raise DataError(f"{path}: no record could be tokenised ({len(findings)} problems; first: "
                        f"{findings[0].message if findings else 'none'})")
    truncated = [(line, n) for line, n in zip(lines, lengths) if n > seq_len]
    findings += _truncation_findings(truncated, seq_len)
    padding = padding_costs(lengths, seq_len, batch_size)
    if padding[0].padding_share > PADDING_WASTE_NOTE:
        findings.append(_padding_finding(padding, seq_len, batch_size))
    return DataReport(
        path=path, format=fmt, chat_template=use_template, lengths_tokens=tuple(lengths), seq_len_tokens=seq_len,
        batch_size=batch_size, histogram=tuple(histogram(lengths)), padding=tuple(padding),
        truncated_records=len(truncated), truncated_tokens=sum(n - seq_len for _, n in truncated),
        findings=tuple(sort_findings(_cap(findings))),
    )


# ---- reading ------------------------------------------------------------------------------------------------------
def read_records(path: str) -> tuple[list[_Raw], list[Finding]]:
    """Parse a .jsonl (one JSON value per line) or a .json list; bad lines become findings, not exceptions."""
    if not os.path.exists(path):
        raise DataError(f"{path}: no such file; pass a .jsonl or .json data file")
    if os.path.isdir(path):
        raise DataError(f"{path} is a folder; pass one .jsonl or .json data file")
    with open(path, "rb") as f:
        raw = f.read()
    if not raw.strip():
        raise DataError(f"{path} is empty: no record to scan")
    if raw.lstrip()[:1] == b"[":
        return _read_json_list(path, raw), []
    return _read_jsonl(raw)


def _read_jsonl(raw: bytes) -> tuple[list[_Raw], list[Finding]]:
    records, findings = [], []
    for i, line_bytes in enumerate(raw.split(b"\n"), start=1):
        try:
            line = line_bytes.decode("utf-8")
        except UnicodeDecodeError as exc:
            findings.append(Finding("data-not-utf8", i, ERROR,
                                    f"line {i} is not UTF-8 text (byte 0x{line_bytes[exc.start]:02x} at column "
                                    f"{exc.start + 1}).",
                                    "re-encode the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)",
                                    "read from the file"))
            continue
        if not line.strip():
            continue
        try:
            records.append(_Raw(i, json.loads(line)))
        except json.JSONDecodeError as exc:
            findings.append(Finding("data-bad-json", i, ERROR, f"line {i} is not valid JSON: {exc.msg} at column "
                                    f"{exc.colno}.", "fix or remove the line; each line of a .jsonl file is one "
                                    "JSON object", "read from the file"))
    return records, findings


def _read_json_list(path: str, raw: bytes) -> list[_Raw]:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise DataError(f"{path} is not UTF-8 text (line {line}, byte 0x{raw[exc.start]:02x}); re-encode it as "
                        "UTF-8") from exc
    decoder = json.JSONDecoder()
    records = []
    i = text.index("[") + 1
    while True:
        i = _skip_space(text, i)
        if i >= len(text):
            raise DataError(f"{path}: the JSON list is not closed (missing ']' at the end)")
        if text[i] == "]":
            break
        try:
            value, end = decoder.raw_decode(text, i)
        except json.JSONDecodeError as exc:
            raise DataError(f"{path} is not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}") from exc
        records.append(_Raw(text.count("\n", 0, i) + 1, value))
        i = _skip_space(text, end)
        if i < len(text) and text[i] == ",":
            i += 1
        elif i < len(text) and text[i] != "]":
            line = text.count("\n", 0, i) + 1
            raise DataError(f"{path} is not valid JSON: expected ',' or ']' at line {line}")
    if text[i + 1:].strip():
        line = text.count("\n", 0, i) + 1
        raise DataError(f"{path} is not valid JSON: extra data after the list ends at line {line}")
    return records


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


def _detect_format(path: str, raws: list[_Raw], problems: list[Finding]) -> tuple[str, int]:
    """The format of the first record with a known shape, and its line."""
    for raw in raws:
        fmt = _shape(raw.value)
        if fmt:
            return fmt, raw.line
    if not raws:
        first = f"; first: {problems[0].message}" if problems else ""
        raise DataError(f"{path}: no line is a valid JSON record ({len(problems)} bad lines{first})")
    first = raws[0].value
    keys = ", ".join(map(str, first)) if isinstance(first, dict) else type(first).__name__
    raise DataError(f"{path}: no record has 'messages' (chat), 'prompt' + 'completion', or 'text'; the first record "
                    f"(line {raws[0].line}) has: {keys}")


def _shape(value) -> str | None:
    if not isinstance(value, dict):
        return None
    if "messages" in value:
        return "chat"
    if "prompt" in value and "completion" in value:
        return "completion"
    if "text" in value:
        return "text"
    return None


def _validate(raw: _Raw, fmt: str, format_line: int, findings: list[Finding]):
    """The record's content for tokenising, or None (with a finding) when it is malformed or empty."""
    problem = _record_problem(raw.value, fmt)
    if problem is None:
        if fmt == "text":
            return raw.value["text"]
        if fmt == "completion":
            return raw.value["prompt"], raw.value["completion"]
        return raw.value["messages"]
    (kind, why), line = problem, raw.line
    if kind == "malformed":
        findings.append(Finding("data-malformed", line, ERROR, f"line {line}: {why}.",
                                f"fix or drop the record; this file's records are {fmt} records (format taken from "
                                f"line {format_line})", "read from the file"))
    else:
        findings.append(Finding("data-empty-record", line, WARNING, f"line {line}: {why}: nothing to learn from, "
                                "and an example whose labels are all masked gives a NaN loss.",
                                "drop empty records before training", "read from the file"))
    return None


def _record_problem(value, fmt: str) -> tuple[str, str] | None:
    """("malformed" | "empty", why) for a record that cannot train, None for a usable one."""
    if _shape(value) != fmt:
        found = ", ".join(map(str, value)) if isinstance(value, dict) else f"a JSON {type(value).__name__}"
        return "malformed", f"expected a {fmt} record ({_EXPECTED[fmt]}), found {found}"
    if fmt == "text":
        if not isinstance(value["text"], str):
            return "malformed", f"'text' is a {type(value['text']).__name__}, not a string"
        return None if value["text"].strip() else ("empty", "'text' is empty")
    if fmt == "completion":
        if not isinstance(value["prompt"], str) or not isinstance(value["completion"], str):
            return "malformed", "'prompt' and 'completion' must be strings"
        return None if value["completion"].strip() else ("empty", "'completion' is empty")
    messages = value["messages"]
    if not isinstance(messages, list):
        return "malformed", "'messages' must be a list"
    if not messages:
        return "empty", "'messages' is an empty list"
    for j, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            return "malformed", f"messages[{j}] needs 'role' and 'content'"
        if not isinstance(m["content"], (str, list)):
            return "malformed", f"messages[{j}].content is a {type(m['content']).__name__}"
    if not any(_content_text(m["content"]).strip() for m in messages):
        return "empty", "every message's content is empty"
    return None


_EXPECTED = {"chat": '{"messages": [{"role", "content"}]}', "completion": '{"prompt", "completion"}',
             "text": '{"text"}'}


def _content_text(content) -> str:
    """Message content as text: a string, or the text parts of a list of {"type": "text", "text": ...}."""
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content if isinstance(p, dict))


# ---- tokenising ---------------------------------------------------------------------------------------------------
def load_tokenizer(tokenizer_dir: str):
    if not os.path.isdir(tokenizer_dir):
        raise DataError(f"--tokenizer {tokenizer_dir}: no such folder; pass a folder with tokenizer.json / "
                        "tokenizer_config.json (a downloaded model folder works)")
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:
        raise DataError("the data scan needs transformers to load the tokenizer (pip install transformers)") from exc
    try:
        return AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    except Exception as exc:  # transformers raises OSError / ValueError / KeyError depending on what is missing
        raise DataError(f"--tokenizer {tokenizer_dir}: transformers could not load a tokenizer from it "
                        f"({exc})") from exc


def _tokenise(tok, fmt: str, use_template: bool, texts, findings: list[Finding]) -> tuple[list[int], list[int]]:
    lines, lengths = [], []
    if fmt == "completion":
        prompts = tok([p for _, (p, _) in texts])["input_ids"] if texts else []
        completions = tok([c for _, (_, c) in texts], add_special_tokens=False)["input_ids"] if texts else []
        for (line, _), p, c in zip(texts, prompts, completions):
            lines.append(line)
            lengths.append(len(p) + len(c))
        return lines, lengths
    rendered: list[tuple[int, str]] = []
    for line, item in texts:
        if fmt == "text":
            rendered.append((line, item))
            continue
        if not use_template:
            rendered.append((line, "\n".join(f"{m['role']}: {_content_text(m['content'])}" for m in item)))
            continue
        try:
            rendered.append((line, tok.apply_chat_template(item, tokenize=False)))
        except Exception as exc:  # jinja errors: roles out of order, unsupported content...
            findings.append(Finding("data-malformed", line, ERROR,
                                    f"line {line}: the tokenizer's chat template rejects this conversation ({exc}).",
                                    "fix the conversation (roles, order) or drop it", "read from the file"))
    if rendered:
        # a rendered chat template already holds its special tokens (BOS...)
        ids = tok([t for _, t in rendered], add_special_tokens=not use_template)["input_ids"]
        for (line, _), x in zip(rendered, ids):
            lines.append(line)
            lengths.append(len(x))
    return lines, lengths


# ---- figures ------------------------------------------------------------------------------------------------------
def padding_costs(lengths: list[int], seq_len: int, batch_size: int) -> list[PaddingCost]:
    """Token positions computed for one epoch in file order: pad to seq_len, pad per batch, pack into rows."""
    clipped = [min(n, seq_len) for n in lengths]
    real = sum(clipped)
    to_max = len(clipped) * seq_len
    dynamic = sum(len(b) * max(b) for b in (clipped[i:i + batch_size] for i in range(0, len(clipped), batch_size)))
    packed = math.ceil(real / seq_len) * seq_len  # only the last row is padded
    return [PaddingCost("max_length", to_max, real), PaddingCost("dynamic", dynamic, real),
            PaddingCost("packing", packed, real)]


def histogram(lengths: list[int]) -> list[HistogramBin]:
    """Power-of-two bins: 1-32, 33-64, 65-128, ... up to the longest record."""
    if not lengths:
        return []
    bins, low, high = [], 1, 32
    longest = max(lengths)
    while True:
        bins.append(HistogramBin(low, high, sum(low <= n <= high for n in lengths)))
        if high >= longest:
            break
        low, high = high + 1, high * 2
    zero = sum(n == 0 for n in lengths)
    if zero:
        bins.insert(0, HistogramBin(0, 0, zero))
    return bins


def _truncation_findings(truncated: list[tuple[int, int]], seq_len: int) -> list[Finding]:
    if not truncated:
        return []
    lines = ", ".join(str(line) for line, _ in truncated[:10]) + (" ..." if len(truncated) > 10 else "")
    lost = sum(n - seq_len for _, n in truncated)
    return [Finding("data-truncated", truncated[0][0], WARNING,
                    f"{_records(len(truncated))} longer than {seq_len} tokens (lines {lines}; the longest "
                    f"{max(n for _, n in truncated)}): truncating them drops {lost:,} tokens, and without "
                    "truncation each makes its batch as long as itself.",
                    f"keep truncation=True at max_length={seq_len}, raise --seq-len if the tails matter, or split "
                    "long records", "read from the file with this tokenizer")]


def _padding_finding(padding: list[PaddingCost], seq_len: int, batch_size: int) -> Finding:
    to_max, dynamic, packing = padding
    return Finding("data-padding-waste", None, INFO,
                   f"padding every record to {seq_len} tokens would make {100 * to_max.padding_share:.1f} % of the "
                   f"computed tokens padding; padding each batch of {batch_size} to its longest record: "
                   f"{100 * dynamic.padding_share:.1f} %; packing: {100 * packing.padding_share:.1f} %.",
                   "pad per batch (DataCollatorWithPadding, padding=True) or pack (SFTConfig(packing=True)); do not "
                   'use padding="max_length"',
                   "computed from the file's token lengths with this tokenizer; a padding token costs the memory and "
                   "time of a real one (fitune estimate scales with tokens per step)", ("C20",))


def _cap(findings: list[Finding]) -> list[Finding]:
    """At most MAX_FINDINGS_PER_RULE line findings per rule, then one finding that counts the rest."""
    out, rest = [], {}
    counts: dict[str, int] = {}
    for f in findings:
        counts[f.rule] = counts.get(f.rule, 0) + 1
        if counts[f.rule] <= MAX_FINDINGS_PER_RULE:
            out.append(f)
        else:
            rest.setdefault(f.rule, []).append(f)
    for rule, extra in rest.items():
        lines = ", ".join(str(f.line) for f in extra[:30]) + (" ..." if len(extra) > 30 else "")
        first = extra[0]
        out.append(Finding(rule, first.line, first.severity, f"{len(extra)} more lines like the above: {lines}.",
                           first.fix, first.evidence, first.claims))
    return out


def _records(n: int) -> str:
    return "1 record is" if n == 1 else f"{n:,} records are"


def _percentile(sorted_xs: list[int], q: float) -> int:
    return sorted_xs[min(len(sorted_xs) - 1, max(0, math.ceil(q * len(sorted_xs)) - 1))]

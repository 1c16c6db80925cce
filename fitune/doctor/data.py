"""`scan_data`: the doctor's report on a training data file, as findings over `fitune.data`'s scan.

The file is read and encoded exactly as `fitune train` does it (`fitune.data.scan_file`: the same reader, format
detection, chat template, special prefix and eos, truncation at `seq_len_tokens`), so the lengths, truncation and
dropped records reported here are those of training. This module only turns the scan into a `DataReport`: the
token-length histogram, the padding of one epoch in file order (padding every example to the sequence length,
padding each batch of `batch_size` to its longest example, packing), and one finding per bad, empty or truncated
record, by line.

The tokenizer is loaded with transformers (imported only when scanning); the rest is pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..data import DataScan, load_tokenizer, scan_file
from ..data.stats import HistogramBin, PaddingCost, length_stats
from ..errors import DataError
from ..setup import DEFAULT_SETUP
from .findings import ERROR, INFO, WARNING, Finding, sort_findings

DEFAULT_BATCH_SIZE = 8
"""Sequences per batch for the dynamic-padding figure when --batch-size is not given."""
MAX_FINDINGS_PER_RULE = 20
"""Line-level findings listed one by one per rule; the rest are summarised in one more finding."""
PADDING_WASTE_NOTE = 0.5
"""Report padding to the sequence length when more than this share of the token slots would be padding."""
PROBLEM_RULES = {"not-utf8": "data-not-utf8", "bad-json": "data-bad-json", "not-object": "data-malformed",
                 "malformed": "data-malformed"}
"""The finding rule of each kind of `fitune.data.RecordProblem`."""
READ = "read from the file"
ENCODED = "encoded as fitune train encodes it, with this tokenizer"


@dataclass(frozen=True)
class DataReport:
    """The scan of one data file. Token counts are per record, before truncation unless named otherwise."""

    path: str
    format: str
    chat_template: bool
    """The records were rendered with the tokenizer's chat template (chat, sharegpt, conversational_completion, and
    alpaca when the tokenizer has one: `fitune.data.convert`)."""
    lengths_tokens: tuple[int, ...]
    """Tokens of each record with something to train on (as training encodes it), in file order."""
    seq_len_tokens: int
    batch_size: int
    histogram: tuple[HistogramBin, ...]
    padding: tuple[PaddingCost, ...]
    """Over the examples training keeps, after truncation."""
    truncated_records: int
    """Records longer than seq_len_tokens, including those truncation leaves with nothing to train on."""
    truncated_tokens: int
    """Tokens cut off by truncating at seq_len_tokens."""
    dropped_lines: tuple[int, ...] = ()
    """Records training drops for having no token to train on (empty, or their answer truncated away)."""
    findings: tuple[Finding, ...] = field(default_factory=tuple)

    @property
    def records(self) -> int:
        return len(self.lengths_tokens)

    def length_stats(self) -> dict[str, float]:
        return length_stats(self.lengths_tokens)

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
            "dropped_lines": list(self.dropped_lines),
            "findings": [f.to_dict() for f in self.findings],
        }


def scan_data(path: str, tokenizer_dir: str, seq_len_tokens: int | None = None,
              batch_size: int = DEFAULT_BATCH_SIZE, fmt: str | None = None, progress=None) -> DataReport:
    """Encode every record of `path` as `fitune train` would, with the tokenizer in `tokenizer_dir`, and report
    lengths, waste, truncation and bad records. `progress(done, total)`, when given, is told how many records are
    encoded (the CLI's bar).

    Raises:
        DataError: the file is missing, empty, has no usable record, or the tokenizer cannot be loaded.
    """
    seq_len = seq_len_tokens or DEFAULT_SETUP.seq_len_tokens
    if seq_len < 2 or batch_size < 1:
        raise DataError(f"--seq-len must be at least 2 and --batch-size at least 1, got {seq_len} and {batch_size}")
    scan = scan_file(path, load_tokenizer(tokenizer_dir), seq_len, fmt, progress=progress)
    stats = scan.stats
    findings = _problem_findings(scan) + _dropped_findings(scan)
    if not stats.examples:
        first = f"; first: {findings[0].message}" if findings else ""
        raise DataError(f"{path}: no record has a token to train on at seq len {seq_len} ({len(findings)} "
                        f"problems{first})", path=path)
    findings += _truncation_findings(scan)
    padding = scan.padding(batch_size)
    if padding[0].padding_share > PADDING_WASTE_NOTE:
        findings.append(_padding_finding(padding, seq_len, batch_size))
    return DataReport(
        path=path, format=stats.format, chat_template=stats.chat_template, lengths_tokens=stats.lengths_tokens,
        seq_len_tokens=seq_len, batch_size=batch_size, histogram=tuple(scan.histogram()), padding=tuple(padding),
        truncated_records=stats.truncated_records, truncated_tokens=stats.truncated_tokens,
        dropped_lines=stats.dropped_lines, findings=tuple(sort_findings(_cap(findings))),
    )


# ---- findings -----------------------------------------------------------------------------------------------------
def _problem_findings(scan: DataScan) -> list[Finding]:
    """Records training would stop on: not UTF-8, not JSON, not an object, missing fields."""
    out = []
    for p in scan.problems:
        rule = PROBLEM_RULES[p.kind]
        if rule == "data-not-utf8":
            fix = "re-encode the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)"
        elif rule == "data-bad-json":
            fix = "fix or remove the line; each line of a .jsonl file is one JSON object"
        else:
            fix = f"fix or drop the record; this file's records are {scan.stats.format} records"
        out.append(Finding(rule, p.line, ERROR, f"{scan.unit} {p.line}: {p.message}; fitune train stops on it.", fix,
                           READ))
    return out


def _dropped_findings(scan: DataScan) -> list[Finding]:
    """Records training drops: nothing to train on, or truncation cut every trained token."""
    stats, unit = scan.stats, scan.unit
    out = [Finding("data-empty-record", line, WARNING,
                   f"{unit} {line}: no token to train on ({why}): an example whose labels are all masked gives a NaN "
                   "loss; fitune train drops it.", "drop or complete empty records before training", ENCODED)
           for line, why in stats.empty]
    lengths = {r.line: r.tokens for r in stats.records}
    out += [Finding("data-truncated-away", line, WARNING,
                    f"{unit} {line}: {lengths[line]:,} tokens, and every token to train on lies past the first "
                    f"{stats.seq_len_tokens}: truncation leaves nothing to learn from; fitune train drops it.",
                    "raise --seq-len, or shorten the prompt so the answer starts inside the sequence", ENCODED)
            for line in stats.truncated_away_lines]
    return out


def _truncation_findings(scan: DataScan) -> list[Finding]:
    stats = scan.stats
    truncated = [(r.line, r.tokens) for r in stats.records if r.truncated]
    if not truncated:
        return []
    seq_len = stats.seq_len_tokens
    lines = ", ".join(str(line) for line, _ in truncated[:10]) + (" ..." if len(truncated) > 10 else "")
    return [Finding("data-truncated", truncated[0][0], WARNING,
                    f"{_records(len(truncated))} longer than {seq_len} tokens ({scan.unit}s {lines}; the longest "
                    f"{max(n for _, n in truncated)}): truncating them drops {stats.truncated_tokens:,} tokens, and "
                    "without truncation each makes its batch as long as itself.",
                    f"keep truncation=True at max_length={seq_len}, raise --seq-len if the tails matter, or split "
                    "long records", ENCODED)]


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

"""`scan_file`: a data file read and encoded exactly as `fitune train` does, with every bad record kept as data.

`fitune doctor --data` turns a DataScan into findings; `fitune plan --data` takes its token lengths. Both thereby
count the tokens training trains on: the same reader, format detection, chat template, special prefix and eos.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from .encode import DataStats, encode_records
from .read import RecordProblem, Records, scan_records
from .stats import HistogramBin, PaddingCost, histogram, padding_costs


@dataclass(frozen=True)
class DataScan:
    """One data file, read leniently and encoded at seq_len_tokens."""

    path: str
    stats: DataStats
    """What each record with something to train on became; records dropped and why."""
    problems: tuple[RecordProblem, ...]
    """Records that could not be read or encoded (training would stop on them), by line."""

    @property
    def unit(self) -> str:
        """What line numbers count: "line" (.jsonl) or "record" (other files)."""
        return self.stats.unit

    def histogram(self) -> list[HistogramBin]:
        """Token lengths before truncation of the records with something to train on."""
        return histogram(self.stats.lengths_tokens)

    def padding(self, batch_size: int) -> list[PaddingCost]:
        """Padding of the examples training keeps (after truncation), in file order: see `padding_costs`."""
        return padding_costs(self.stats.lengths, self.stats.seq_len_tokens, batch_size)


def scan_file(path: str, tokenizer: Any, seq_len_tokens: int, fmt: str | None = None, progress=None) -> DataScan:
    """Read `path` and encode its records with `tokenizer` at seq_len_tokens; bad records are returned, not raised.
    `progress(done, total)`, when given, is called as records are encoded (see `counting`).

    Raises:
        DataError: the file cannot be read as a whole or holds no record; no record has a known format; chat
            records and a tokenizer without a chat template.
        ConfigError: seq_len_tokens below 2, or an unknown fmt.
    """
    records, problems = scan_records(path)
    _, stats, encode_problems = encode_records(counting(records, progress), tokenizer, fmt, seq_len_tokens, source=path)
    return DataScan(path, stats, tuple(sorted(problems + encode_problems, key=lambda p: p.line)))


PROGRESS_EVERY = 64
"""Records encoded between two progress calls (a call costs more than a short record's encoding)."""


class _Counted(Records):
    """Records whose iteration reports how far it has come (encoding takes one pass over them)."""

    def __init__(self, records: Records, progress):
        super().__init__(records, getattr(records, "path", None))
        self._progress = progress

    def __iter__(self):
        total = len(self)
        for done, pair in enumerate(super().__iter__()):
            if done % PROGRESS_EVERY == 0:
                self._progress(done, total)
            yield pair
        self._progress(total, total)


def counting(records: Sequence[tuple[int, dict]], progress) -> Sequence[tuple[int, dict]]:
    """`records`, reporting `progress(done, total)` as a pass over them advances (every PROGRESS_EVERY records and
    at the end; format detection's look at the first records reports a little too); `records` itself without a
    callback."""
    return records if progress is None else _Counted(records, progress)

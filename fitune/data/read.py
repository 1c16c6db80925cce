"""Reading a data source into records: (line_number, dict) pairs, every bad line collected with its number.

`scan_records` is the lenient reader (bad lines come back as `RecordProblem`s, so `fitune doctor --data` can report
them and go on); `read_records` is the strict one training uses (any bad line is a DataError that lists them all);
`iter_records` is the lazy one streaming training uses (records read as they are needed; the first bad one stops
it). All three read the same sources the same way:

- .jsonl: one JSON object per line (blank lines skipped; numbered by file line);
- .json: a list of objects (or JSON lines saved as .json);
- .csv / .tsv: a header row names the fields, each further row is a record of strings (the csv module's dialect:
  quoted fields may hold the delimiter and newlines; an empty cell is "");
- .txt: one record {"text": line} per line, as the `text` builder of Hugging Face datasets does it
  (datasets/packaged_modules/text/text.py, sample_by="line"), except that blank lines are skipped, as in .jsonl;
- .parquet (pyarrow); a folder written by `datasets`' save_to_disk (its split data.split when it holds several);
- a Hugging Face Hub data set id ORG/NAME, through `datasets` from the local cache (`fitune.data.hub`).
"""

from __future__ import annotations

import codecs
import csv
import io
import json
import os
import sys
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Sequence

from ..datasource import HF_DATASET_MARKERS, SUFFIXES, data_path_problem  # defined below the spine (fitune.config)
from ..errors import DataError
from ..schema import too_many_digits
from .hub import DEFAULT_SPLIT, is_hub_id, iter_rows, open_hub_dataset

MAX_LISTED_PROBLEMS = 10
"""Bad records listed one by one in a DataError; the rest are counted."""
LINE_SUFFIXES = (".jsonl", ".txt")
"""File types whose records are numbered by file line; the others by 1-based record index."""
CSV_DELIMITERS = {".csv": ",", ".tsv": "\t"}

PROBLEM_KINDS = ("not-utf8", "bad-json", "not-object", "malformed")
"""What `RecordProblem.kind` can be: the first three come from reading, "malformed" from encoding (a record missing
its format's fields, a field of the wrong type, a conversation the chat template cannot render). Records with no
token to train on are not problems but drops: see `DataStats.empty`."""


@dataclass(frozen=True)
class RecordProblem:
    """What is wrong with one record of a data file."""

    line: int
    """The file line (.jsonl) or the 1-based record index (.json, .parquet, saved datasets): see `Records.unit`."""
    kind: str
    """One of PROBLEM_KINDS."""
    message: str
    """What is wrong and what to do, without the file and line (callers add them)."""


class Records(list):
    """What read_records returns: a list of (line_number, record) pairs that remembers the file it was read from, so
    that tokenize_records and detect_format name the file in their errors without being told."""

    def __init__(self, pairs: Sequence[tuple[int, dict]] = (), path: str | None = None):
        super().__init__(pairs)
        self.path = path

    @property
    def unit(self) -> str:
        """What the numbers count: "line" (file lines of a .jsonl) or "record" (1-based record indices)."""
        return unit_of(self.path)


def source_of(records: Sequence[tuple[int, dict]], source: str | None) -> str | None:
    """`source` if given, else the path a `Records` list remembers."""
    return source if source is not None else getattr(records, "path", None)


def read_records(path: str, split: str = DEFAULT_SPLIT, subset: str | None = None) -> Records:
    """Read the records of a data source as (line_number, record) pairs (a `Records` list, which remembers `path`).

    Args:
        path: a .jsonl file (one JSON object per line, blank lines skipped; the number is the file line), a .json
            file holding a list of objects (the number is the 1-based record index), a .csv / .tsv file with a
            header row (1-based record), a .txt file (a {"text"} record per non-blank line; the file line), a
            .parquet file (needs pyarrow; 1-based row), a folder written by `datasets` `save_to_disk` or a Hub data
            set id ORG/NAME (both need `datasets`; 1-based row).
        split: the split of a Hub data set or of a saved DatasetDict folder.
        subset: the subset (configuration name) of a Hub data set.

    Raises:
        DataError: the source is missing, of an unknown type, empty, or has lines that are not UTF-8, not JSON or
            not objects (every bad line is listed, by number).
    """
    records, problems = scan_records(path, split, subset)
    if problems:
        raise data_error(path, problems)
    return records


def scan_records(path: str, split: str = DEFAULT_SPLIT,
                 subset: str | None = None) -> tuple[Records, list[RecordProblem]]:
    """Read the records of a data source like read_records, but return the bad lines instead of raising on them.

    Raises:
        DataError: the source as a whole cannot be read (missing, unknown type, a .json that is not a list, not
            UTF-8 or not valid JSON), or it holds no usable record at all (the message then lists the bad lines).
    """
    problems: list[RecordProblem] = []
    pairs: list[tuple[int, dict]] = []
    for item in _items(path, split, subset, streaming=False):
        if isinstance(item, RecordProblem):
            problems.append(item)
        else:
            pairs.append(item)
    if not pairs:
        if problems:
            raise data_error(path, problems)
        raise DataError(
            f"{path}: no records (the file is empty or holds only blank lines); point data.path at a file with "
            "training examples",
            path=path,
        )
    return Records(pairs, path), problems


def iter_records(path: str, split: str = DEFAULT_SPLIT, subset: str | None = None) -> Iterator[tuple[int, dict]]:
    """The records of a data source one at a time, read lazily (streaming): a .jsonl, .txt, .csv or .tsv file line by
    line, a .parquet file a row group at a time, a saved dataset row by row from its memory-mapped files, a Hub data
    set through datasets' streaming; a .json list is parsed whole (it is one JSON value).

    Raises:
        DataError: as read_records, but at the first bad record (by its number), or when the source holds none.
    """
    seen = False
    for item in _items(path, split, subset, streaming=True):
        if isinstance(item, RecordProblem):
            raise data_error(path, [item])
        seen = True
        yield item
    if not seen:
        raise DataError(f"{path}: no records (the source is empty or holds only blank lines); point data.path at "
                        "training examples", path=path)


def _items(path: str, split: str, subset: str | None, streaming: bool) -> Iterator[tuple[int, dict] | RecordProblem]:
    """Every record of `path` as a (number, record) pair, or a RecordProblem where one cannot be read; lazily for
    the file types that allow it. Whole-source failures raise DataError."""
    if not os.path.exists(path):
        if is_hub_id(path, SUFFIXES):
            dataset = open_hub_dataset(path, split, subset, streaming)
            yield from iter_rows(dataset)
            return
        raise DataError(
            f"{path}: no such file or folder (looked for {os.path.abspath(path)}); check data.path (or "
            "data.eval_path) in the config (a Hugging Face data set id is written ORG/NAME)",
            path=path,
        )
    if os.path.isdir(path):
        yield from iter_rows(_open_hf_dataset(path, split))
        return
    problem = data_path_problem(path)
    if problem:
        raise DataError(f"{path}: {problem}", path=path)
    suffix = os.path.splitext(path)[1].lower()
    if suffix == ".parquet":
        yield from _iter_parquet(path)
        return
    try:
        with open(path, "rb") as f:
            if suffix == ".jsonl":
                yield from _iter_jsonl(f)
            elif suffix == ".txt":
                yield from _iter_txt(f)
            elif suffix in CSV_DELIMITERS:
                yield from _iter_csv(path, f, CSV_DELIMITERS[suffix])
            else:
                yield from _read_json(path, f.read())
    except OSError as exc:
        raise DataError(f"{path}: cannot read it ({exc.strerror or exc}); check its permissions", path=path) \
            from None


def _loads(text: str):
    """json.loads that turns a nesting too deep for Python's parser, and an integer longer than Python converts
    (sys.get_int_max_str_digits(), 4,300 digits: ValueError), into the JSONDecodeError they are to users."""
    def parse_int(number: str) -> int:
        digits = len(number.lstrip("-"))
        if digits > sys.get_int_max_str_digits():
            raise json.JSONDecodeError(too_many_digits(digits), text, max(text.find(number), 0))
        return int(number)

    try:
        return json.loads(text, parse_int=parse_int)
    except RecursionError:
        raise json.JSONDecodeError("nested too deeply (a record nests a few levels)", text[:80], 0) from None


def _lines(lines: Iterable[bytes]) -> Iterator[tuple[int, str | RecordProblem]]:
    """(file line, its text without the newline) of each line that is not blank, or a RecordProblem for a line
    that is not UTF-8; a byte-order mark at the start is dropped (some editors write one)."""
    for line_number, raw in enumerate(lines, start=1):
        raw = raw[:-1] if raw.endswith(b"\n") else raw
        if line_number == 1 and raw.startswith(codecs.BOM_UTF8):
            raw = raw[len(codecs.BOM_UTF8) :]
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            yield line_number, RecordProblem(line_number, "not-utf8", _not_utf8(raw[e.start], e.start))
            continue
        if text.strip():
            yield line_number, text


def _iter_jsonl(lines: Iterable[bytes]) -> Iterator[tuple[int, dict] | RecordProblem]:
    for line_number, text in _lines(lines):
        if isinstance(text, RecordProblem):
            yield text
            continue
        try:
            record = _loads(text)
        except json.JSONDecodeError as e:
            what = f"not valid JSON: {e.msg} (column {e.colno}); fix or delete the line"
            yield RecordProblem(line_number, "bad-json", what)
            continue
        if not isinstance(record, dict):
            what = f"a JSON {json_type(record)}, not an object {{...}}; each line must be one record"
            yield RecordProblem(line_number, "not-object", what)
            continue
        yield line_number, record


def _iter_txt(lines: Iterable[bytes]) -> Iterator[tuple[int, dict] | RecordProblem]:
    """One {"text": line} per non-blank line, the line without its line ending (as datasets' text builder with
    keep_linebreaks=False)."""
    for line_number, text in _lines(lines):
        yield text if isinstance(text, RecordProblem) else (line_number, {"text": text.rstrip("\r")})


def _iter_csv(path: str, f, delimiter: str) -> Iterator[tuple[int, dict] | RecordProblem]:
    """Rows of a CSV / TSV file after its header row, as {header: cell} records numbered from 1. A row with more or
    fewer cells than the header is a problem (a delimiter inside an unquoted field, most often)."""
    text = io.TextIOWrapper(f, encoding="utf-8-sig", newline="")  # newline="": quoted newlines stay in their field
    reader = csv.reader(text, delimiter=delimiter)
    try:
        header = next(reader, None)
        if header is None:
            return
        for index, row in enumerate(reader, start=1):
            if not row:
                continue  # a blank line between rows
            if len(row) != len(header):
                yield RecordProblem(index, "malformed", f"{len(row)} fields, but the header row has {len(header)} "
                                    f"({', '.join(header)}); quote fields that hold the delimiter {delimiter!r}")
                continue
            yield index, dict(zip(header, row))
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: bytes that are not UTF-8 (0x{e.object[e.start]:02x}) near record "
                        f"{reader.line_num}; re-save the file as UTF-8 (e.g. `iconv -f latin1 -t utf-8 IN > OUT`)",
                        path=path) from None
    except csv.Error as e:
        raise DataError(f"{path}: not readable as {'TSV' if delimiter == chr(9) else 'CSV'} near line "
                        f"{reader.line_num} ({e}); fix the quoting there", path=path) from None


def _read_json(path: str, data: bytes) -> list[tuple[int, dict] | RecordProblem]:
    if data.startswith(codecs.BOM_UTF8):
        data = data[len(codecs.BOM_UTF8) :]
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line_number = data.count(b"\n", 0, e.start) + 1
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1)
        problem = RecordProblem(line_number, "not-utf8", _not_utf8(data[e.start], column))
        raise data_error(path, [problem], unit="line") from None
    if not text.strip():
        return []
    try:
        value = _loads(text)
    except json.JSONDecodeError as e:
        if e.msg == "Extra data":  # several JSON values one after another: the file is JSON lines named .json
            return list(_iter_jsonl(data.split(b"\n")))
        what = f"not valid JSON: {e.msg} (column {e.colno}); fix the file"
        raise data_error(path, [RecordProblem(e.lineno, "bad-json", what)], unit="line") from None
    if isinstance(value, dict):
        raise DataError(
            f"{path}: holds one JSON object (keys: {sorted(value)}), not a list of records; write the records as a "
            "list [{...}, {...}] or as JSON lines (.jsonl)",
            path=path,
        )
    if not isinstance(value, list):
        raise DataError(f"{path}: holds a JSON {json_type(value)}, not a list of records [{{...}}, ...]", path=path)
    return [(i, record) if isinstance(record, dict) else
            RecordProblem(i, "not-object", f"a JSON {json_type(record)}, not an object {{...}}")
            for i, record in enumerate(value, start=1)]


def _iter_parquet(path: str) -> Iterator[tuple[int, dict]]:
    try:
        # pyarrow, datasets: optional, imported where used (estimate, plan and doctor SCRIPT never load them)
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(
            f"{path}: reading .parquet files needs the pyarrow package, which is not installed; run "
            "`pip install pyarrow`, or convert the file to .jsonl",
            path=path,
        ) from None
    index = 0
    try:
        for batch in pq.ParquetFile(path).iter_batches(batch_size=PARQUET_BATCH_ROWS):
            for row in batch.to_pylist():
                index += 1
                yield index, row
    except Exception as e:  # pyarrow raises its own ArrowInvalid / OSError family; all mean "not readable"
        raise DataError(
            f"{path}: not a readable parquet file ({e}); re-export it, or convert it to .jsonl", path=path
        ) from None


PARQUET_BATCH_ROWS = 1024
"""Rows a parquet file is read in at a time (a guess: small next to any row group worth having, big enough that the
per-batch cost is noise)."""


def _open_hf_dataset(path: str, split: str) -> Any:
    if not any(os.path.exists(os.path.join(path, marker)) for marker in HF_DATASET_MARKERS):
        raise DataError(
            f"{path}: is a folder but not a dataset saved with datasets' save_to_disk (it has none of "
            f"{', '.join(HF_DATASET_MARKERS)}); pass a .jsonl, .json, .csv, .tsv, .txt or .parquet file, or the "
            "folder save_to_disk wrote",
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
    dataset = datasets.load_from_disk(path)  # memory-mapped Arrow files: rows are read as they are iterated
    if isinstance(dataset, datasets.DatasetDict):
        if split in dataset:
            dataset = dataset[split]
        elif len(dataset) == 1 and split == DEFAULT_SPLIT:
            dataset = next(iter(dataset.values()))
        else:
            raise DataError(
                f"{path}: holds the splits {sorted(dataset)} and none is called {split!r}; set data.split to one of "
                "them",
                path=path,
            )
    return dataset


def _not_utf8(byte: int, column: int) -> str:
    """`byte`: the first byte that is not UTF-8; `column`: its 0-based offset in the line."""
    return (
        f"bytes that are not UTF-8 (0x{byte:02x} at byte {column + 1} of the line); re-save the file as "
        "UTF-8 (e.g. `iconv -f latin1 -t utf-8 IN > OUT`)"
    )


def json_type(value: Any) -> str:
    return {list: "list", str: "string", int: "number", float: "number", bool: "boolean", type(None): "null"}.get(
        type(value), type(value).__name__
    )


def unit_of(source: str | None) -> str:
    """How read_records numbered the records of `source`: file lines (.jsonl, .txt) or 1-based record indices."""
    if source is None or source.lower().endswith(LINE_SUFFIXES):
        return "line"
    return "record"


def data_error(source: str | None, problems: Sequence[RecordProblem], unit: str | None = None) -> DataError:
    """One DataError for every bad record, the first MAX_LISTED_PROBLEMS listed with their numbers."""
    name = source or "data"
    unit = unit or unit_of(source)
    first_line = problems[0].line
    if len(problems) == 1:
        return DataError(f"{name}, {unit} {first_line}: {problems[0].message}", path=source, line=first_line)
    listed = [f"  {unit} {p.line}: {p.message}" for p in problems[:MAX_LISTED_PROBLEMS]]
    if len(problems) > MAX_LISTED_PROBLEMS:
        listed.append(f"  ... and {len(problems) - MAX_LISTED_PROBLEMS} more")
    return DataError(
        f"{name}: {len(problems)} bad records; fix or delete them:\n" + "\n".join(listed), path=source, line=first_line
    )

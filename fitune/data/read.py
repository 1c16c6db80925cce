"""Reading a data file into records: (line_number, dict) pairs, every bad line collected with its number.

`scan_records` is the lenient reader (bad lines come back as `RecordProblem`s, so `fitune doctor --data` can report
them and go on); `read_records` is the strict one training uses (any bad line is a DataError that lists them all).
Both read the same files the same way: .jsonl, .json (a list of objects), .parquet, a folder saved by `datasets`.
"""

from __future__ import annotations

import codecs
import json
import os
from dataclasses import dataclass
from typing import Any, Sequence

from ..errors import DataError

MAX_LISTED_PROBLEMS = 10
"""Bad records listed one by one in a DataError; the rest are counted."""
SUFFIXES = (".jsonl", ".json", ".parquet")
"""File types `read_records` reads; a folder is read as a saved Hugging Face dataset."""
HF_DATASET_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")
"""Files `datasets.Dataset(Dict).save_to_disk` writes; a folder with one of them is a saved dataset."""

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


def read_records(path: str) -> Records:
    """Read the records of a data file as (line_number, record) pairs (a `Records` list, which remembers `path`).

    Args:
        path: a .jsonl file (one JSON object per line, blank lines skipped; the number is the file line), a .json
            file holding a list of objects (the number is the 1-based record index), a .parquet file (needs
            pyarrow; 1-based row) or a folder written by `datasets` `save_to_disk` (needs `datasets`; 1-based row).

    Raises:
        DataError: the file is missing, of an unknown type, empty, or has lines that are not UTF-8, not JSON or not
            objects (every bad line is listed, by number).
    """
    records, problems = scan_records(path)
    if problems:
        raise data_error(path, problems)
    return records


def scan_records(path: str) -> tuple[Records, list[RecordProblem]]:
    """Read the records of a data file like read_records, but return the bad lines instead of raising on them.

    Raises:
        DataError: the file as a whole cannot be read (missing, unknown type, a .json that is not a list, not UTF-8
            or not valid JSON), or it holds no usable record at all (the message then lists the bad lines).
    """
    if not os.path.exists(path):
        raise DataError(
            f"{path}: no such file or folder (looked for {os.path.abspath(path)}); check data.path (or "
            "data.eval_path) in the config",
            path=path,
        )
    problems: list[RecordProblem] = []
    if os.path.isdir(path):
        pairs = _read_hf_dataset(path)
    else:
        problem = data_path_problem(path)
        if problem:
            raise DataError(f"{path}: {problem}", path=path)
        suffix = os.path.splitext(path)[1].lower()
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as exc:
            raise DataError(f"{path}: cannot read it ({exc.strerror or exc}); check its permissions", path=path) \
                from None
        if suffix == ".jsonl":
            pairs = _read_jsonl(data, problems)
        elif suffix == ".json":
            pairs = _read_json(path, data, problems)
        else:
            pairs = _read_parquet(path)
    if not pairs:
        if problems:
            raise data_error(path, problems)
        raise DataError(
            f"{path}: no records (the file is empty or holds only blank lines); point data.path at a file with "
            "training examples",
            path=path,
        )
    return Records(pairs, path), problems


def data_path_problem(path: str) -> str | None:
    """Why the existing `path` cannot be a data file, judged without reading its records (its type, suffix and
    size); None when it may be one. Said without the path (callers add it)."""
    if os.path.isdir(path):
        if not any(os.path.exists(os.path.join(path, marker)) for marker in HF_DATASET_MARKERS):
            return (f"is a folder but not a dataset saved with datasets' save_to_disk (it has none of "
                    f"{', '.join(HF_DATASET_MARKERS)}); pass a .jsonl, .json or .parquet file, or the folder "
                    "save_to_disk wrote")
        return None
    if not os.path.isfile(path):
        return "is not a regular file (a device or a pipe?); pass a .jsonl, .json or .parquet file"
    suffix = os.path.splitext(path)[1].lower()
    if suffix not in SUFFIXES:
        return (f"cannot read {suffix or 'a file without a suffix'}; fitune reads .jsonl (one JSON object per "
                "line), .json (a list of objects), .parquet, or a folder saved with datasets' save_to_disk. Convert "
                "the file to .jsonl, or rename it if it already is JSON lines")
    return None


def _loads(text: str):
    """json.loads that turns a nesting too deep for Python's parser into the JSONDecodeError it is to users."""
    try:
        return json.loads(text)
    except RecursionError:
        raise json.JSONDecodeError("nested too deeply (a record nests a few levels)", text[:80], 0) from None


def _read_jsonl(data: bytes, problems: list[RecordProblem]) -> list[tuple[int, dict]]:
    records: list[tuple[int, dict]] = []
    for line_number, raw in enumerate(data.split(b"\n"), start=1):
        if line_number == 1 and raw.startswith(codecs.BOM_UTF8):
            raw = raw[len(codecs.BOM_UTF8) :]  # a byte-order mark some editors write; not part of the JSON
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            problems.append(RecordProblem(line_number, "not-utf8", _not_utf8(raw[e.start], e.start)))
            continue
        if not text.strip():
            continue
        try:
            record = _loads(text)
        except json.JSONDecodeError as e:
            what = f"not valid JSON: {e.msg} (column {e.colno}); fix or delete the line"
            problems.append(RecordProblem(line_number, "bad-json", what))
            continue
        if not isinstance(record, dict):
            what = f"a JSON {json_type(record)}, not an object {{...}}; each line must be one record"
            problems.append(RecordProblem(line_number, "not-object", what))
            continue
        records.append((line_number, record))
    return records


def _read_json(path: str, data: bytes, problems: list[RecordProblem]) -> list[tuple[int, dict]]:
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
            return _read_jsonl(data, problems)
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
    records = []
    for i, record in enumerate(value, start=1):
        if isinstance(record, dict):
            records.append((i, record))
        else:
            problems.append(RecordProblem(i, "not-object", f"a JSON {json_type(record)}, not an object {{...}}"))
    return records


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


def json_type(value: Any) -> str:
    return {list: "list", str: "string", int: "number", float: "number", bool: "boolean", type(None): "null"}.get(
        type(value), type(value).__name__
    )


def unit_of(source: str | None) -> str:
    """How read_records numbered the records of `source`: file lines (.jsonl) or 1-based record indices."""
    if source is None or source.lower().endswith(".jsonl"):
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

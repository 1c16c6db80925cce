"""`StreamingBatches`: training batches from records read lazily (`data.streaming: true`), never the whole set.

The records come from `fitune.data.read.iter_records` (a file line by line, a parquet file a row group at a time, a
Hub data set through datasets' streaming). They are encoded a window at a time: `rows` examples (one batch) without
packing, `PACK_WINDOW_EXAMPLES` with packing (packed among themselves, best-fit as `pack` does it). What needs the
whole set is refused by the config instead (`fitune.config`): `epochs` (the record count is unknown up front), and
shuffling is not done (records come in source order; shuffle the data set beforehand).

The stream has BatchStream's interface where training uses it (`next_batch`, `split`, `state_dict`,
`load_state_dict`), so the loop treats both alike. Its position is (epoch, records read before the current window,
rows of the window already batched): a resumed stream re-reads and skips those records without encoding them, and
rebuilds the same window. At the end of the source it starts over (the next epoch).

Records with nothing to train on are dropped and said (logged, the first MAX_LOGGED_DROPS); a record training
cannot encode stops the run with its number, as reading the whole file would have stopped it before.
"""

from __future__ import annotations

import itertools
import logging
from typing import Any, Callable, Iterator

from ..errors import DataError
from .batch import Batch, collate, pack, split_batch
from .encode import IGNORE_INDEX, Example, _Encoder, _RecordProblem, encode_one, resolve_format
from .read import RecordProblem, data_error, iter_records

log = logging.getLogger(__name__)

PACK_WINDOW_EXAMPLES = 256
"""Examples packed together when streaming with packing (a guess: enough short examples to fill rows well, few
enough that the window's token ids stay a few MiB)."""
DETECT_RECORDS = 16
"""Records read ahead to detect the format when data.format is not given."""
MAX_LOGGED_DROPS = 10
"""Dropped records logged one by one; the rest are counted in `dropped`."""


class StreamingBatches:
    """Batches of `rows` rows from the records of `path`, read as they are needed (see the module docstring).

    Args:
        path, split, subset: the data source, as `iter_records` takes it.
        tokenizer: the model's tokenizer; fmt: a format (or alias), or None to detect it from the first records.
        seq_len_tokens: examples are cut to this; rows: rows per batch; pad_token_id: as BatchStream's.
        packed: pack examples (a window of PACK_WINDOW_EXAMPLES at a time) into rows of seq_len_tokens.
        open_records: how to (re)open the source (tests count records with it); default `iter_records`.

    Raises:
        DataError / ConfigError: at construction, when the first window cannot be read or encoded (the source is
            missing, not cached offline, of an unknown format, holds nothing to train on).
    """

    STATE_VERSION = 1

    def __init__(self, path: str, split: str, subset: str | None, tokenizer: Any, fmt: str | None,
                 seq_len_tokens: int, rows: int, pad_token_id: int | None, packed: bool,
                 open_records: Callable[[], Iterator[tuple[int, dict]]] | None = None):
        self.path, self.data_split, self.subset = path, split, subset
        self.seq_len_tokens, self.rows, self.pad_token_id, self.packed = seq_len_tokens, rows, pad_token_id, packed
        self._open = open_records or (lambda: iter_records(path, split, subset))
        self._encoder = _Encoder(tokenizer, seq_len_tokens)  # long conversations encoded in linear time, as in train
        self._chat_template = bool(getattr(tokenizer, "chat_template", None))
        self.records_read = 0
        """Records taken from the source so far, over all epochs and re-openings (what streaming reads)."""
        self.dropped: list[int] = []
        """Numbers of the records dropped for having no token to train on."""
        source = self._counted(self._open())
        head = [] if fmt is not None else list(itertools.islice(source, DETECT_RECORDS))
        self.format = resolve_format(head, tokenizer, fmt, seq_len_tokens, source=path)
        """One of FORMATS: the format the records are read as."""
        self.epoch = 0
        self._start = 0  # records of this epoch read before the current window
        self._taken = 0  # rows of the current window already batched
        self._records: Iterator[tuple[int, dict]] = itertools.chain(head, source)  # the head is not read twice
        self._window: list = []
        self._fill()
        if not self._window:
            raise DataError(f"{path}: no record has a token to train on (format {self.format}); see "
                            "`fitune doctor --data` for why", path=path)

    # ---- reading ------------------------------------------------------------------------------------------------

    def _restart(self, epoch: int, skip: int) -> None:
        """Open the source again at `epoch`, step over its first `skip` records unread, and fill the window."""
        self.epoch, self._start, self._taken = epoch, skip, 0
        self._records = self._counted(self._open())
        for _ in itertools.islice(self._records, skip):
            pass
        self._fill()

    def _counted(self, records: Iterator[tuple[int, dict]]) -> Iterator[tuple[int, dict]]:
        for pair in records:
            self.records_read += 1
            yield pair

    def _fill(self) -> None:
        """The next window: up to `rows` examples (or PACK_WINDOW_EXAMPLES, packed), encoded from the records."""
        want = PACK_WINDOW_EXAMPLES if self.packed else self.rows
        examples: list[Example] = []
        read = 0
        for number, record in self._records:
            read += 1
            example = self._encode(number, record)
            if example is not None:
                examples.append(example)
                if len(examples) == want:
                    break
        self._window_records = read
        self._window = pack(examples, self.seq_len_tokens) if self.packed and examples else examples

    def _encode(self, number: int, record: dict) -> Example | None:
        try:
            ids, labels = encode_one(self._encoder, self.format, record, self._chat_template)
        except _RecordProblem as problem:
            raise data_error(self.path, [RecordProblem(number, "malformed", str(problem))]) from None
        ids, labels = ids[: self.seq_len_tokens], labels[: self.seq_len_tokens]
        if not any(label != IGNORE_INDEX for label in labels):
            self.dropped.append(number)
            if len(self.dropped) <= MAX_LOGGED_DROPS:
                log.warning("%s, record %d: no token to train on (empty, or its answer lies past seq_len %d); "
                            "dropped", self.path, number, self.seq_len_tokens)
            return None
        return Example(tuple(ids), tuple(labels))

    # ---- BatchStream's interface ----------------------------------------------------------------------------------

    def next_batch(self) -> Batch:
        chosen = []
        while len(chosen) < self.rows:
            if self._taken == len(self._window):
                self._start += self._window_records
                self._taken = 0
                self._fill()
                if not self._window:  # the source is exhausted: the next epoch starts it over
                    if chosen:
                        break  # the last batch of an epoch holds the remainder, as BatchStream's does
                    self._restart(self.epoch + 1, 0)
                    if not self._window:
                        raise DataError(f"{self.path}: the source yielded no example in epoch {self.epoch + 1}",
                                        path=self.path)
            take = min(self.rows - len(chosen), len(self._window) - self._taken)
            chosen += self._window[self._taken : self._taken + take]
            self._taken += take
        return collate(chosen, self.pad_token_id, self.packed)

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        return self.next_batch()

    def split(self, batch: Batch, micro_batch_size: int) -> list[Batch]:
        return split_batch(batch, micro_batch_size, self.pad_token_id, self.packed)

    def state_dict(self) -> dict:
        """Plain ints and strings: the position, and what must not change for it to mean the same records."""
        return {"version": self.STATE_VERSION, "streaming": True, "epoch": self.epoch, "start": self._start,
                "taken": self._taken, "source": self.path, "split": self.data_split, "subset": self.subset,
                "format": self.format, "seq_len": self.seq_len_tokens, "rows": self.rows, "packed": self.packed}

    def load_state_dict(self, state: dict) -> None:
        """Continue from `state`: the source is re-read up to the saved window, which is rebuilt.

        Raises:
            DataError: the state is not a streaming one, or was made with another source, format, seq_len, batch
                size or packing.
        """
        problems = []
        if not state.get("streaming") or state.get("version") != self.STATE_VERSION:
            problems.append("the checkpoint's data position is not a streaming one")
        for key, now in (("source", self.path), ("split", self.data_split), ("subset", self.subset),
                         ("format", self.format), ("seq_len", self.seq_len_tokens), ("rows", self.rows),
                         ("packed", self.packed)):
            if key in state and state[key] != now:
                problems.append(f"{key}: checkpoint {state[key]!r}, now {now!r}")
        if problems:
            raise DataError("cannot resume the streamed data position (" + "; ".join(problems) + "); resume with the "
                            "same data.path, split, subset, format, seq_len, batch_size and packing, or start a new run")
        self._restart(int(state["epoch"]), int(state["start"]))
        self._taken = min(int(state["taken"]), len(self._window))

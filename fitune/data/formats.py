"""Which record shape a data file holds, detected from its records' keys or forced by `data.format`.

The one list of formats (`FORMATS`) and of the names people type for them (`FORMAT_ALIASES`), defined in
`fitune.datasource` (below the spine) and importable from here: `fitune.config`'s `data.format` key, the encoder and
the docs (docs/data.md) all read them. Records of every format become one of three shapes before they are tokenized
(`fitune.data.convert`): chat messages, a prompt/completion pair, or text.
"""

from __future__ import annotations

from typing import Sequence

from ..datasource import FORMAT_ALIASES, FORMATS  # noqa: F401 - the vocabulary lives below the spine; named here too
from ..errors import DataError
from .read import source_of

FORMAT_KEYS = {
    "chat": '{"messages": [{"role", "content"}, ...]}',
    "completion": '{"prompt": "...", "completion": "..."}',
    "text": '{"text": "..."}',
    "alpaca": '{"instruction", "input" (optional), "output"}',
    "sharegpt": '{"conversations": [{"from", "value"}, ...]}',
    "conversational_completion": '{"prompt": [messages], "completion": [messages]}',
}
"""The keys each format's records have, as messages show them."""

DETECT_KEYS_RECORDS = 100
"""Records whose keys a format-detection error lists."""


def format_of(record: dict) -> str | None:
    """The format whose keys `record` has, or None. The order decides between shapes that share keys: messages,
    then conversations, then prompt + completion (lists: conversational, else standard), then instruction + output,
    then text."""
    if "messages" in record:
        return "chat"
    if "conversations" in record:
        return "sharegpt"
    if "prompt" in record and "completion" in record:
        if isinstance(record["prompt"], list) or isinstance(record["completion"], list):
            return "conversational_completion"
        return "completion"
    if "instruction" in record and "output" in record:
        return "alpaca"
    if "text" in record:
        return "text"
    return None


def canonical_format(fmt: str) -> str | None:
    """`fmt` as one of FORMATS (an alias resolved, case ignored), or None when it is neither."""
    low = fmt.strip().lower()
    low = FORMAT_ALIASES.get(low, low)
    return low if low in FORMATS else None


def detect_format(records: Sequence[tuple[int, dict]], *, source: str | None = None) -> str:
    """The format of the first record with a known shape: one of FORMATS.

    Raises:
        DataError: no record has a known shape; the message lists the keys the records have.
    """
    source = source_of(records, source)
    for _, record in records:
        fmt = format_of(record)
        if fmt is not None:
            return fmt
    keys = sorted({key for _, record in records[:DETECT_KEYS_RECORDS] for key in record})
    known = "; ".join(f"{name} {shape}" for name, shape in FORMAT_KEYS.items())
    raise DataError(
        f"{source or 'data'}: no record has a known format; keys found: {keys}. fitune reads {known}; rename the "
        "fields to one of these (see docs/data.md)",
        path=source,
        line=records[0][0] if records else None,
    )

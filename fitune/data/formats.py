"""Which record shape a data file holds: chat, completion or text, detected from its records' keys."""

from __future__ import annotations

from typing import Sequence

from ..errors import DataError
from .read import source_of

FORMATS = ("chat", "completion", "text")
"""Record shapes the encoder understands:
- chat:       {"messages": [{"role": ..., "content": ...}, ...]};
- completion: {"prompt": ..., "completion": ...};
- text:       {"text": ...}."""
DETECT_KEYS_RECORDS = 100
"""Records whose keys a format-detection error lists."""


def format_of(record: dict) -> str | None:
    """The format whose keys `record` has (chat before completion before text), or None."""
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
    source = source_of(records, source)
    for _, record in records:
        fmt = format_of(record)
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

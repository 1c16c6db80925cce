"""Progress on stderr for the CLI's long library calls (plan's search, `--data` scans of big files).

The library takes a `progress(done, total)` callback and knows nothing of terminals; `progress_callback` makes one
that draws a tqdm bar, and only when it helps: on a terminal, once the work has run DELAY_S (a quick answer shows
no bar), never with --json, and cleared when the work ends (the answer follows on stdout). The environment variable
FITUNE_PROGRESS=1 draws it at once on any stderr and leaves its last state (logs, tests); FITUNE_PROGRESS=0 never
draws it. Without tqdm (the estimator installs nothing) there is no bar.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable, Iterator

DELAY_S = 1.0
"""Seconds of work before a bar appears on a terminal."""
ENV = "FITUNE_PROGRESS"
"""1: always draw the bar, at once; 0: never; unset: on a terminal, after DELAY_S."""

Progress = Callable[[int, int], None]
"""`progress(done, total)`: called by library code as work advances (done never goes back for one total; a new
total starts the count again)."""


def bar_wanted(enabled: bool = True) -> tuple[bool, float]:
    """(draw a bar?, after how many seconds) for this process's stderr and FITUNE_PROGRESS."""
    forced = os.environ.get(ENV, "").strip().lower()
    if not enabled or forced in ("0", "never", "no", "false"):
        return False, 0.0
    if forced in ("1", "always", "yes", "true"):
        return True, 0.0
    isatty = getattr(sys.stderr, "isatty", None)
    return bool(isatty and isatty()), DELAY_S


@contextlib.contextmanager
def progress_callback(desc: str, unit: str, enabled: bool = True) -> Iterator[Progress | None]:
    """A `progress(done, total)` callback drawing a bar labelled `desc`, counting `unit`s, closed on exit; None
    when no bar is wanted (`enabled=False` for --json), so the library skips the calls.

        with progress_callback("plan: searching", "setup", enabled=not args.json) as progress:
            result = plan(req, progress=progress)
    """
    wanted, delay_s = bar_wanted(enabled)
    if not wanted:
        yield None
        return
    started_s = time.monotonic()
    bar = None
    missing = False

    def progress(done: int, total: int) -> None:
        nonlocal bar, missing
        if bar is None:
            if missing or time.monotonic() - started_s < delay_s:
                return  # a quick answer imports nothing and draws nothing
            try:
                # tqdm: optional, imported where used (estimate, plan and doctor SCRIPT never load it)
                from tqdm import tqdm
            except ImportError:  # the estimator's install: no bar
                missing = True
                return
            # forced (logs, tests): the last state stays; on a terminal the bar is cleared for the answer
            bar = tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, leave=delay_s == 0, dynamic_ncols=True)
        elif bar.total != total:  # the next stage of the work: count again from 0
            bar.reset(total=total)
        bar.update(max(0, done - bar.n))

    try:
        yield progress
    finally:
        if bar is not None:
            bar.close()

"""One line per probe of a context_lanes.sh call (its max_context.jsonl), for the call's log: what ran, whether it
fit, the allocator retries and step times, the GPU and host peaks against the estimate (summaries left out).

    python3 bench/peers/probe_lines.py $OUT/max_context.jsonl
"""

from __future__ import annotations

import json
import sys


def line(r: dict) -> str:
    keys = ("stack", "cap", "set", "seq_len_tokens", "fits", "alloc_retries_per_step", "step_seconds",
            "peak_allocated_bytes", "est_peak_allocated_bytes", "peak_reserved_bytes", "host_peak_rss_bytes",
            "est_host_peak_bytes", "outside_allocator_bytes_per_step")
    return " ".join(f"{k}={r.get(k)}" for k in keys if r.get(k) is not None)


def main(argv: list[str] | None = None) -> int:
    (path,) = argv if argv is not None else sys.argv[1:]
    with open(path, encoding="utf-8") as f:
        for text in f:
            r = json.loads(text)
            if not r.get("summary"):
                print(line(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Where a capped run's reserved memory goes when the allocator retries: its history, and the free gaps at each retry.

Issue 33's 131,072-token plan on the 4090's budget allocates 20.75 GiB at its peak yet fills the allocator's 23.19
GiB of room and retries 1 to 3 times a step (bench/results/issue33/ballast_4090_adamw); restoring the offloaded
inputs into fixed buffers did not change that (bench/results/issue33/ballast_staging). This finds which blocks the
room goes to: `record` runs a fitune command in this process with PyTorch's allocator history on
(`torch.cuda.memory._record_memory_history`) and dumps the snapshot; `gaps` replays the snapshot's trace on the CPU
and, each time the allocator gives cached memory back to make room (a run of `segment_unmap` / `segment_free`
events: a retry, or an `empty_cache`), prints what was mapped, what was allocated, the largest free gaps with the
live blocks on either side of each (the first fitune frame, else the top frame, of what allocated them), and the
request that needed the room.

    FITUNE_CAP_MODE=ballast python -m bench.alloc_history record /tmp/h.pickle -- train plan.yaml --no-progress
    python -m bench.alloc_history gaps /tmp/h.pickle --top 8 > gaps.jsonl

`gaps` needs no torch or GPU (tests/test_alloc_history.py runs it on a trace written by hand).
"""

from __future__ import annotations

import argparse
import bisect
import collections
import json
import pickle
import sys

#: Trace actions that map memory into the allocator's room (expandable segments map pages; classic segments are
#: one cudaMalloc each) and that give it back.
MAP_ACTIONS = ("segment_map", "segment_alloc")
UNMAP_ACTIONS = ("segment_unmap", "segment_free")


def record(out_path: str, argv: list[str], max_entries: int) -> int:
    """Run `fitune ARGV` with the allocator's history on; dump the snapshot to `out_path` however it ends."""
    import torch

    from fitune.cli.main import main

    torch.cuda.memory._record_memory_history(max_entries=max_entries, stacks="python")
    try:
        return main(argv)
    finally:
        torch.cuda.memory._dump_snapshot(out_path)
        torch.cuda.memory._record_memory_history(enabled=None)


def frame_label(frames: list[dict]) -> str:
    """The first frame in fitune's code (where the run decided to allocate), else the top frame; '?' without any."""
    if not frames:
        return "?"
    f = next((f for f in frames if "/fitune/" in f.get("filename", "")), frames[0])
    path = f.get("filename", "?")
    return f"{path[path.find('fitune/'):] if 'fitune/' in path else path}:{f.get('line', '?')} {f.get('name', '?')}"


class _Room:
    """The mapped ranges and the live blocks, replayed event by event."""

    def __init__(self):
        self.mapped: dict[int, int] = {}  # start -> end (merged when adjacent)
        self.live: dict[int, tuple[int, str]] = {}  # address -> (bytes, label)

    def map(self, addr: int, size: int) -> None:
        start, end = addr, addr + size
        for s, e in list(self.mapped.items()):
            if e >= start and s <= end:  # overlapping or adjacent: merge
                del self.mapped[s]
                start, end = min(start, s), max(end, e)
        self.mapped[start] = end

    def unmap(self, addr: int, size: int) -> None:
        start, end = addr, addr + size
        for s, e in list(self.mapped.items()):
            if e <= start or s >= end:
                continue
            del self.mapped[s]
            if s < start:
                self.mapped[s] = start
            if e > end:
                self.mapped[end] = e

    def mapped_bytes(self) -> int:
        return sum(e - s for s, e in self.mapped.items())

    def allocated_bytes(self) -> int:
        return sum(size for size, _ in self.live.values())

    def gaps(self) -> list[dict]:
        """Every free range inside the mapped memory, with the live blocks just below and above it."""
        blocks = sorted((a, a + size, label) for a, (size, label) in self.live.items())
        starts = [b[0] for b in blocks]
        out = []
        for s, e in sorted(self.mapped.items()):
            cursor = s
            i = bisect.bisect_left(starts, s)
            while cursor < e:
                nxt = blocks[i] if i < len(blocks) and blocks[i][0] < e else None
                gap_end = nxt[0] if nxt is not None else e
                if gap_end > cursor:
                    below = blocks[i - 1][2] if i > 0 and blocks[i - 1][1] == cursor else None
                    above = nxt[2] if nxt is not None else None
                    out.append({"bytes": gap_end - cursor, "address": cursor, "below": below, "above": above})
                if nxt is None:
                    break
                cursor, i = max(cursor, nxt[1]), i + 1
        return out


def retries(trace: list[dict], top: int = 8) -> list[dict]:
    """One record per run of give-back events in `trace` (one device's TraceEntry list, oldest first): the room
    just before it (mapped, allocated and free bytes; the `top` largest gaps), how much it gave back, and the first
    request after it."""
    room, out, current = _Room(), [], None
    for i, ev in enumerate(trace):
        action, addr, size = ev.get("action"), ev.get("addr", 0), ev.get("size", 0)
        if action in UNMAP_ACTIONS:
            if current is None:
                gaps = sorted(room.gaps(), key=lambda g: -g["bytes"])
                mapped, allocated = room.mapped_bytes(), room.allocated_bytes()
                current = {"event": i, "mapped_bytes": mapped, "allocated_bytes": allocated,
                           "free_bytes": mapped - allocated, "gaps": len(gaps),
                           "largest_gaps": gaps[:top], "given_back_bytes": 0}
            current["given_back_bytes"] += size
            room.unmap(addr, size)
            continue
        if current is not None and action in ("alloc", "oom"):
            current["request_bytes"], current["request"] = size, frame_label(ev.get("frames", []))
            current["oom"] = action == "oom"
            out.append(current)
            current = None
        if action in MAP_ACTIONS:
            room.map(addr, size)
        elif action == "alloc":
            room.live[addr] = (size, frame_label(ev.get("frames", [])))
        elif action == "free_completed":
            room.live.pop(addr, None)
    if current is not None:
        out.append(current)
    return out


def border_counts(found: list[dict]) -> list[tuple[str, int]]:
    """How often each allocation site borders one of the reported gaps, most often first."""
    count = collections.Counter(side for r in found for g in r["largest_gaps"] for side in (g["below"], g["above"])
                                if side)
    return count.most_common()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.alloc_history", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("record", help="run `fitune ARGS` with the allocator's history on, dump the snapshot")
    r.add_argument("out", help="the snapshot file to write (pickle; PyTorch's memory_viz reads it too)")
    r.add_argument("--max-entries", type=int, default=2_000_000, help="history entries kept (the newest)")
    r.add_argument("fitune_args", nargs=argparse.REMAINDER, help="-- then the fitune command line")
    g = sub.add_parser("gaps", help="the free gaps at each give-back in a recorded snapshot (JSON lines)")
    g.add_argument("snapshot")
    g.add_argument("--top", type=int, default=8, help="gaps listed per give-back (largest first)")
    g.add_argument("--device", type=int, default=0)
    args = p.parse_args(argv)
    if args.command == "record":
        rest = args.fitune_args[1:] if args.fitune_args[:1] == ["--"] else args.fitune_args
        if not rest:
            p.error("record: give the fitune command after --, e.g. -- train plan.yaml --no-progress")
        return record(args.out, rest, args.max_entries)
    with open(args.snapshot, "rb") as f:
        snapshot = pickle.load(f)
    found = retries(snapshot["device_traces"][args.device], args.top)
    for rec in found:
        print(json.dumps(rec))
    print(json.dumps({"summary": True, "give_backs": len(found), "borders": border_counts(found)[:20]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

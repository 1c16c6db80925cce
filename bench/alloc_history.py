"""Where a capped run's reserved memory goes when the allocator retries: the free gaps at each give-back.

Issue 33's 131,072-token plan on the 4090's budget allocates 20.75 GiB at its peak yet fills the allocator's 23.19
GiB of room and retries 1 to 3 times a step (bench/results/issue33/ballast_4090_adamw); restoring the offloaded
inputs into fixed buffers did not change that (bench/results/issue33/ballast_staging). This reads the allocator
history that bench/_with_memory_history.py writes with `--trace` (the context probes write one per fitune run when
FITUNE_MEMORY_HISTORY_DIR names a folder: bench/peers/unsloth_max_context.py) and replays it on the CPU: each time
the allocator gives mapped memory back to make room (a run of `segment_unmap` / `segment_free` events: a retry, or
an `empty_cache`), one JSON line with what was mapped, what was allocated, the largest free gaps with the sizes of
the live blocks on either side of each (no stacks are recorded: sizes tell the tensors apart, e.g. 1.07 GB for a
131,072-token hidden state of Llama-3.1-8B), the phase it fell in, and the request that needed the room; then one
line for the room at the run's peak reserved (`peak_room`: where the free bytes sit when the mapped bytes are
highest, the measure of fragmentation in a run without retries); with --model, one line more: the run's requests
replayed through the estimator's allocator model (`model_replay`).

    FITUNE_MEMORY_HISTORY_DIR=$OUT/h BALLAST_LENGTHS=131072 BALLAST_PLAN_GPU=rtx4090 \
        bash bench/calls/issue33_ballast.sh $OUT/r
    python -m bench.alloc_history $OUT/h/*.trace.json.gz --top 8 > gaps.jsonl

Pure Python (tests/test_alloc_history.py runs it on a trace written by hand); not yet run on a GPU's trace.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import gzip
import json
import lzma
import sys

from fitune.memory.allocator import ExpandableAllocatorModel

#: Trace actions that map memory into the allocator's room (expandable segments map pages; classic segments are
#: one cudaMalloc each) and that give it back.
MAP_ACTIONS = ("segment_map", "segment_alloc")
UNMAP_ACTIONS = ("segment_unmap", "segment_free")


def size_label(nbytes: int) -> str:
    """A block's size as the gaps report names it (MiB, two decimals)."""
    return f"{nbytes / 2**20:,.2f} MiB"


class _Room:
    """The mapped ranges and the live blocks, replayed event by event."""

    def __init__(self):
        self.mapped: dict[int, int] = {}  # start -> end (merged when adjacent)
        self.live: dict[int, int] = {}  # address -> bytes

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
        return sum(self.live.values())

    def gaps(self) -> list[dict]:
        """Every free range inside the mapped memory, with the sizes of the live blocks just below and above it."""
        blocks = sorted((a, a + size) for a, size in self.live.items())
        starts = [b[0] for b in blocks]
        out = []
        for s, e in sorted(self.mapped.items()):
            cursor = s
            i = bisect.bisect_left(starts, s)
            while cursor < e:
                nxt = blocks[i] if i < len(blocks) and blocks[i][0] < e else None
                gap_end = nxt[0] if nxt is not None else e
                if gap_end > cursor:
                    below = blocks[i - 1] if i > 0 and blocks[i - 1][1] == cursor else None
                    out.append({"bytes": gap_end - cursor, "address": cursor,
                                "below": size_label(below[1] - below[0]) if below else None,
                                "above": size_label(nxt[1] - nxt[0]) if nxt else None})
                if nxt is None:
                    break
                cursor, i = max(cursor, nxt[1]), i + 1
        return out


def _phase(marks: list, t_us) -> str | None:
    """The label of the last phase mark at or before `t_us` (marks: [time_us, label] in order)."""
    if t_us is None or not marks:
        return None
    i = bisect.bisect_right([m[0] for m in marks], t_us)
    return marks[i - 1][1] if i else None


def _replay(room: _Room, event: list) -> None:
    """One event of the trace applied to the room."""
    action, addr, size = event[0], event[1] or 0, event[2] or 0
    if action in MAP_ACTIONS:
        room.map(addr, size)
    elif action in UNMAP_ACTIONS:
        room.unmap(addr, size)
    elif action == "alloc":
        room.live[addr] = size
    elif action == "free_completed":
        room.live.pop(addr, None)


def give_backs(events: list[list], marks: list = (), top: int = 8) -> list[dict]:
    """One record per run of give-back events in `events` (`write_trace`'s [action, addr, size, stream, time_us],
    oldest first): the room just before it (mapped, allocated and free bytes; the `top` largest gaps), how much it
    gave back, the phase it fell in, and the first request after it."""
    room, out, current = _Room(), [], None
    for i, (action, addr, size, _stream, t_us) in enumerate(events):
        addr, size = addr or 0, size or 0
        if action in UNMAP_ACTIONS:
            if current is None:
                gaps = sorted(room.gaps(), key=lambda g: -g["bytes"])
                mapped, allocated = room.mapped_bytes(), room.allocated_bytes()
                current = {"event": i, "phase": _phase(list(marks), t_us), "mapped_bytes": mapped,
                           "allocated_bytes": allocated, "free_bytes": mapped - allocated, "gaps": len(gaps),
                           "largest_gaps": gaps[:top], "given_back_bytes": 0}
            current["given_back_bytes"] += size
            room.unmap(addr, size)
            continue
        if current is not None and action in ("alloc", "oom"):
            current["request_bytes"], current["oom"] = size, action == "oom"
            out.append(current)
            current = None
        _replay(room, [action, addr, size])
    if current is not None:
        out.append(current)
    return out


def peak_room(events: list[list], marks: list = (), top: int = 8) -> dict | None:
    """The room when the mapped bytes first reach their highest (the run's peak reserved; in a run without retries
    what the allocator needed, in one with them the cap): mapped, allocated and free bytes, the `top` largest free
    gaps with the blocks beside them, the live blocks by size (largest total first), the phase, and the request that
    made the allocator map its last pages (the room is taken just after that request is served)."""
    room, peak, at = _Room(), 0, None
    for i, event in enumerate(events):
        _replay(room, event)
        if event[0] in MAP_ACTIONS:
            mapped = room.mapped_bytes()
            if mapped > peak:
                peak, at = mapped, i
    if at is None:
        return None
    room, request, end = _Room(), None, len(events) - 1
    for i, event in enumerate(events):
        _replay(room, event)
        if i > at and event[0] == "alloc":
            request, end = event[2], i
            break
        if i == end:
            break
    gaps = sorted(room.gaps(), key=lambda g: -g["bytes"])
    sizes = collections.Counter(room.live.values())
    by_size = sorted(((n * c, n, c) for n, c in sizes.items()), reverse=True)[:top]
    allocated = room.allocated_bytes()
    return {"peak_reserved": True, "event": end, "phase": _phase(list(marks), events[end][4]), "mapped_bytes": peak,
            "allocated_bytes": allocated, "free_bytes": room.mapped_bytes() - allocated, "gaps": len(gaps),
            "free_in_gaps_over_20mib_bytes": sum(g["bytes"] for g in gaps if g["bytes"] > 20 * 2**20),
            "largest_gaps": gaps[:top], "request_bytes": request,
            "live_by_size": [{"size": size_label(n), "count": c, "bytes": t} for t, n, c in by_size]}


def model_replay(events: list[list], model_class: type = ExpandableAllocatorModel) -> dict:
    """The run's own requests, in their order, replayed through the estimator's model of the allocator with
    expandable segments (fitune/memory/allocator.py `ExpandableAllocatorModel`), beside what the run mapped: how far
    the model's placement rules alone are from the allocator's, with the estimator's tape out of the question."""
    model, room, mapped_peak = model_class(), _Room(), 0
    for event in events:
        action, addr, size = event[0], event[1] or 0, event[2] or 0
        if action == "alloc":
            model.malloc(addr, size)
        elif action == "free_completed":
            model.release(addr)
        _replay(room, event)
        if action in MAP_ACTIONS:
            mapped_peak = max(mapped_peak, room.mapped_bytes())
    return {"model_replay": True, "model_peak_reserved_bytes": model.peak_reserved,
            "model_peak_allocated_bytes": model.peak_allocated, "measured_peak_mapped_bytes": mapped_peak,
            "model_over_measured": round(model.peak_reserved / mapped_peak, 4) if mapped_peak else None}


def open_trace(path: str) -> dict:
    """A trace as write_trace writes it (.json.gz), or recompressed for the records (.json.xz)."""
    opener = lzma.open if path.endswith(".xz") else gzip.open
    with opener(path, "rt", encoding="utf-8") as f:
        return json.load(f)


def border_counts(found: list[dict]) -> list[tuple[str, int]]:
    """How often blocks of each size border one of the reported gaps, most often first."""
    count = collections.Counter(side for r in found for g in r["largest_gaps"] for side in (g["below"], g["above"])
                                if side)
    return count.most_common()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.alloc_history", description=__doc__.split("\n\n")[0])
    p.add_argument("trace", help="an allocator history written by bench/_with_memory_history.py --trace (.json.gz; "
                                 "or .json.xz)")
    p.add_argument("--top", type=int, default=8, help="gaps listed per give-back (largest first)")
    p.add_argument("--model", action="store_true",
                   help="also replay the run's requests through the estimator's allocator model (`model_replay`)")
    args = p.parse_args(argv)
    trace = open_trace(args.trace)
    found = give_backs(trace["events"], trace.get("marks") or [], args.top)
    for rec in found:
        print(json.dumps(rec))
    peak = peak_room(trace["events"], trace.get("marks") or [], args.top)
    if peak is not None:
        print(json.dumps(peak))
    if args.model:
        print(json.dumps(model_replay(trace["events"])))
    print(json.dumps({"summary": True, "give_backs": len(found), "borders": border_counts(found)[:20]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

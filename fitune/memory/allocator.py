"""A model of PyTorch's CUDA caching allocator, to turn a tape of allocations into `max_memory_reserved`.

`max_memory_allocated` counts live tensors; `max_memory_reserved` counts the segments the allocator obtained
from cudaMalloc and keeps cached. The difference is fragmentation: a freed 1 GiB block cannot serve a 2 GiB
request, so a new segment is reserved next to it. The rules below follow c10/cuda/CUDACachingAllocator.cpp
(PyTorch 2.x, default settings; `ExpandableAllocatorModel` below for expandable segments):

- sizes are rounded up to a multiple of 512 bytes (`kMinBlockSize`);
- requests of at most 1 MiB come from the small pool, whose segments are 2 MiB (`kSmallBuffer`);
- larger requests come from the large pool: a request under 10 MiB (`kMinLargeAlloc`) gets a 20 MiB segment
  (`kLargeBuffer`), a larger one a segment of its own size rounded up to 2 MiB (`kRoundLarge`);
- a request takes the smallest cached free block of its pool that is large enough (best fit) and splits it when
  the remainder exceeds 512 bytes (small pool) or 1 MiB (large pool);
- among equal free blocks the lowest address wins, and the driver hands later segments lower addresses (both seen
  in the measured traces), so a newer segment is reused first;
- freed blocks merge with free neighbours of the same segment; segments are never returned to the driver
  unless an allocation fails (not modelled: the estimate reports the demand, `fits` compares it with the budget);
- a segment belongs to the stream that cudaMalloc'd it: a request is served only from blocks cached for its own
  stream (`BlockPool` lookups key on the stream; `get_free_block`), so a tensor allocated on a side stream (DeepSpeed's
  reduction stream) cannot reuse what the default stream left cached.

Checked: fed the measured allocation traces of 8 H200 runs (bench/results/hf_recipe/**/snap_*.json.gz), it
reproduces their `max_memory_reserved()` within 0.5 % (tests/test_allocator_replay.py).

Pure Python, no torch.
"""

from __future__ import annotations

import bisect

from .tape import Event

KB = 1024
MB = 1024 * 1024
MIN_BLOCK = 512
SMALL_SIZE = 1 * MB
SMALL_BUFFER = 2 * MB
MIN_LARGE_ALLOC = 10 * MB
LARGE_BUFFER = 20 * MB
ROUND_LARGE = 2 * MB


def round_size(nbytes: int) -> int:
    """Block size the allocator hands out for a request: a multiple of 512 bytes."""
    return max(MIN_BLOCK, -(-nbytes // MIN_BLOCK) * MIN_BLOCK)


def segment_size(block: int) -> int:
    """Size of the cudaMalloc a request triggers when no cached block fits."""
    if block <= SMALL_SIZE:
        return SMALL_BUFFER
    if block < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-block // ROUND_LARGE) * ROUND_LARGE


class _Block:
    """A block of a segment; blocks of one segment form a doubly linked list by address."""

    __slots__ = ("offset", "size", "free", "small", "prev", "next", "stream")

    def __init__(self, offset: int, size: int, free: bool, small: bool, prev=None, next=None, stream: int = 0):
        self.offset, self.size, self.free, self.small, self.prev, self.next = offset, size, free, small, prev, next
        self.stream = stream


class CachingAllocatorModel:
    """Best-fit block cache over segments; tracks reserved (segments) and allocated (live blocks) bytes."""

    def __init__(self) -> None:
        self.reserved = 0
        self.allocated = 0
        self.peak_reserved = 0
        self.peak_allocated = 0
        # per pool (small?, stream): a sorted list of (size, offset) of free blocks; offsets are unique over segments
        self._free: dict[tuple[bool, int], list[tuple[int, int]]] = {(True, 0): [], (False, 0): []}
        self._by_offset: dict[int, _Block] = {}
        self._live: dict[int, _Block] = {}
        self._next_offset = 1 << 60

    def malloc(self, key: int, nbytes: int, stream: int = 0) -> None:
        size = nbytes if nbytes % MIN_BLOCK == 0 and nbytes else (nbytes // MIN_BLOCK + 1) * MIN_BLOCK
        small = size <= SMALL_SIZE
        pool = self._free.setdefault((small, stream), [])
        i = self._best_fit(pool, bisect.bisect_left(pool, (size, -1)), small)
        if i < len(pool):
            block = self._by_offset.pop(pool.pop(i)[1])
        else:
            block = self._new_block(size, small)
            block.stream = stream
        remaining = block.size - size
        if self._splits(remaining, small):
            rest = _Block(block.offset + size, remaining, True, small, block, block.next, block.stream)
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            block.size = size
            self._by_offset[rest.offset] = rest
            bisect.insort(pool, (remaining, rest.offset))
        block.free = False
        self._live[key] = block
        self.allocated += block.size
        if self.allocated > self.peak_allocated:
            self.peak_allocated = self.allocated

    def _best_fit(self, pool: list[tuple[int, int]], i: int, small: bool) -> int:
        """The index in `pool` of the block that serves a request whose smallest fitting block is at `i`."""
        return i

    def _splits(self, remaining: int, small: bool) -> bool:
        """Whether a block serving a request keeps its `remaining` bytes as a free block of their own (small pool:
        more than 512 bytes; large pool: more than 1 MiB, CUDACachingAllocator.cpp `should_split`). The same rules
        serve ExpandableAllocatorModel, though PyTorch's allocator splits differently with expandable segments: see
        bench/expandable_rules.py."""
        return remaining > (MIN_BLOCK if small else SMALL_SIZE)

    def _new_block(self, size: int, small: bool) -> _Block:
        """No cached block fits: cudaMalloc a new segment."""
        seg_bytes = segment_size(size)
        # the driver hands out lower addresses for later segments (seen in every measured trace), and ties
        # between equal free blocks go to the lowest address: a newer segment wins
        self._next_offset -= seg_bytes + ROUND_LARGE  # segments are never adjacent
        self._grow(seg_bytes)
        return _Block(self._next_offset, seg_bytes, True, small)

    def _grow(self, nbytes: int) -> None:
        self.reserved += nbytes
        if self.reserved > self.peak_reserved:
            self.peak_reserved = self.reserved

    def _unpool(self, b: _Block) -> None:
        pool = self._free[(b.small, b.stream)]
        del pool[bisect.bisect_left(pool, (b.size, b.offset))]
        del self._by_offset[b.offset]

    def release(self, key: int) -> None:
        block = self._live.pop(key, None)
        if block is None:
            return
        self.allocated -= block.size
        block.free = True
        nxt = block.next
        if nxt is not None and nxt.free:  # merge with the free neighbour after
            self._unpool(nxt)
            block.size += nxt.size
            block.next = nxt.next
            if nxt.next is not None:
                nxt.next.prev = block
        prv = block.prev
        if prv is not None and prv.free:  # and before
            self._unpool(prv)
            prv.size += block.size
            prv.next = block.next
            if block.next is not None:
                block.next.prev = prv
            block = prv
        self._by_offset[block.offset] = block
        bisect.insort(self._free[(block.small, block.stream)], (block.size, block.offset))
        self._merged(block)

    def _merged(self, block: _Block) -> None:
        """Hook: `block` is free after merging with its free neighbours."""

    def empty_cache(self) -> None:
        """`torch.cuda.empty_cache()`: every cached segment with no live block goes back to the driver
        (CUDACachingAllocator.cpp `release_cached_blocks`: only whole free segments are released); a segment
        with one live block keeps all its free blocks."""
        for pool in self._free.values():
            for _size, offset in list(pool):
                b = self._by_offset[offset]
                if b.prev is None and b.next is None:
                    self._unpool(b)
                    self.reserved -= b.size


class ExpandableAllocatorModel(CachingAllocatorModel):
    """The same cache with `expandable_segments:True`: one segment per pool, a virtual range that maps pages at its
    end as it grows (CUDACachingAllocator.cpp, `ExpandableSegment`: 20 MiB pages for the large pool, 2 MiB for the
    small one). A request no cached block holds extends the segment's free tail, or maps a new block after a busy
    one; free blocks still strand memory between live ones until the allocator is under pressure (then it unmaps
    free pages and retries: not modelled, the estimate reports the demand as for the default allocator)."""

    def __init__(self) -> None:
        super().__init__()
        self._tail: dict[bool, _Block | None] = {True: None, False: None}
        self._end = {True: 1 << 58, False: 1 << 59}  # separate virtual ranges per pool

    def _new_block(self, size: int, small: bool) -> _Block:
        page = SMALL_BUFFER if small else LARGE_BUFFER
        tail = self._tail[small]
        if tail is not None and tail.free:  # grow the free tail by whole pages
            self._unpool(tail)
            grow = -(-(size - tail.size) // page) * page
            tail.size += grow
            self._end[small] += grow
            self._grow(grow)
            return tail
        nbytes = -(-size // page) * page
        block = _Block(self._end[small], nbytes, True, small, tail, None)
        if tail is not None:
            tail.next = block
        self._end[small] += nbytes
        self._tail[small] = block
        self._grow(nbytes)
        return block

    def malloc(self, key: int, nbytes: int, stream: int = 0) -> None:
        """Streams are not told apart here (one range per pool): a simplification, no measured case needs it."""
        super().malloc(key, nbytes)
        small = round_size(nbytes) <= SMALL_SIZE
        tail = self._tail[small]
        if tail is not None and tail.next is not None:  # a split of the last block left its free rest at the end
            self._tail[small] = tail.next

    def _merged(self, block: _Block) -> None:
        if block.next is None:  # the freed (and merged) block ends the segment
            self._tail[block.small] = block

    def empty_cache(self) -> None:
        """Unmaps a range that holds no live block (partly free ranges keep their pages: not modelled)."""
        super().empty_cache()
        for small, tail in self._tail.items():
            if tail is not None and tail.offset not in self._by_offset and tail.free:
                self._tail[small] = None


#: In `setup_events`: `torch.cuda.empty_cache()` at that point.
EMPTY_CACHE = (0, 0)


def replay_reserved(resident: list[int], step_events: list[Event], steps: int = 2,
                    expandable: bool = False, first_step_state: list[int] | None = None,
                    setup_events: list[tuple[int, int]] | None = None,
                    first_step_state_at: list[tuple[int, int]] | None = None) -> tuple[int, int]:
    """Peak (reserved, allocated) bytes over `steps` repetitions of one step's tape.

    Two steps reach the steady state: the second starts with the blocks the first left cached (the same
    peaks as 3 steps on all 45 measured cases).

    `resident` lists the sizes of the tensors allocated before training (weights, adapters...), each in its own
    request, as model loading does. `first_step_state`: optimizer state tensors created lazily by the first
    optimizer step (torch's AdamW `_init_group`, bitsandbytes' `init_state`), one request each, when the first
    step's optimizer phase begins, and kept: they land in the blocks the backward left cached, which is what the
    next step's activations then find fragmented (measured traces: bench/results/issue12/snaps/).

    `setup_events`: what a framework allocates and frees between loading and the first step, after `resident`:
    (key, bytes) allocates, (key, -bytes) frees that key, `EMPTY_CACHE` empties the cache (DeepSpeed's
    initialisation: parallel.py `zero_setup_allocations`). Keys must be negative, below -2**40.
    `first_step_state_at`: (index into `step_events`, bytes): state created lazily by the first step just before
    that event, one request each, and kept (ZeRO-3's optimizer state, one sub-group after the other).
    """
    model = ExpandableAllocatorModel() if expandable else CachingAllocatorModel()
    for i, nbytes in enumerate(resident):
        model.malloc(-1 - i, nbytes)
    for key, nbytes in setup_events or ():
        if (key, nbytes) == EMPTY_CACHE:
            model.empty_cache()
        elif nbytes > 0:
            model.malloc(key, nbytes)
        else:
            model.release(key)
    by_index: dict[int, list[int]] = {}
    for at, nbytes in first_step_state_at or ():
        by_index.setdefault(at, []).append(nbytes)
    late_state: dict[int, list[int]] = {}  # the same, indexed over the non-retag events replayed below
    kept = 0
    for i, ev in enumerate(step_events):
        if i in by_index:
            late_state.setdefault(kept, []).extend(by_index[i])
        kept += not ev.retag
    for at, sizes in by_index.items():
        if at >= len(step_events):
            late_state.setdefault(kept, []).extend(sizes)
    events = [(ev.tid, ev.nbytes, ev.stream) for ev in step_events if not ev.retag]
    state_at = next((i for i, ev in enumerate(e for e in step_events if not e.retag) if ev.phase == "optimizer"),
                    len(events))
    malloc, release = model.malloc, model.release
    for step in range(steps):
        offset = step * 10_000_000
        for i, (tid, nbytes, stream) in enumerate(events):
            if step == 0 and i == state_at and first_step_state:
                for j, n in enumerate(first_step_state):
                    malloc(-10_000_000 - j, n)
            if step == 0 and i in late_state:
                for j, n in enumerate(late_state[i]):
                    malloc(-20_000_000 - 1000 * i - j, n)
            if nbytes > 0:
                malloc(offset + tid, nbytes, stream)
            else:
                release(offset + tid)
        if step == 0 and state_at >= len(events) and first_step_state:
            for j, n in enumerate(first_step_state):
                malloc(-10_000_000 - j, n)
        if step == 0:  # state placed after the step's last event
            for j, n in enumerate(late_state.get(len(events), ())):
                malloc(-20_000_000 - 1000 * len(events) - j, n)
        # tensors still live at the end of the step (none, once the step frees what it made) carry over
    return model.peak_reserved, model.peak_allocated


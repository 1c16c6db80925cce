"""A model of PyTorch's CUDA caching allocator, to turn a tape of allocations into `max_memory_reserved`.

`max_memory_allocated` counts live tensors; `max_memory_reserved` counts the segments the allocator obtained
from cudaMalloc and keeps cached. The difference is fragmentation: a freed 1 GiB block cannot serve a 2 GiB
request, so a new segment is reserved next to it. The rules below follow c10/cuda/CUDACachingAllocator.cpp
(PyTorch 2.x, default settings, no expandable segments):

- sizes are rounded up to a multiple of 512 bytes (`kMinBlockSize`);
- requests of at most 1 MiB come from the small pool, whose segments are 2 MiB (`kSmallBuffer`);
- larger requests come from the large pool: a request under 10 MiB (`kMinLargeAlloc`) gets a 20 MiB segment
  (`kLargeBuffer`), a larger one a segment of its own size rounded up to 2 MiB (`kRoundLarge`);
- a request takes the smallest cached free block of its pool that is large enough (best fit) and splits it when
  the remainder exceeds 512 bytes (small pool) or 1 MiB (large pool);
- freed blocks merge with free neighbours of the same segment; segments are never returned to the driver
  unless an allocation fails (not modelled: the estimate reports the demand, `fits` compares it with the budget).

Pure Python, no torch.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

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


@dataclass
class _Block:
    seg: int
    offset: int
    size: int
    free: bool


class CachingAllocatorModel:
    """Best-fit block cache over segments; tracks reserved (segments) and allocated (live blocks) bytes."""

    def __init__(self) -> None:
        self.reserved = 0
        self.allocated = 0
        self.peak_reserved = 0
        self.peak_allocated = 0
        self._segments: list[list[_Block]] = []
        self._free = {True: [], False: []}  # small? -> sorted list of (size, seg, offset)
        self._live: dict[int, _Block] = {}
        self._seg_small: list[bool] = []

    def reset_peaks(self) -> None:
        self.peak_reserved = self.reserved
        self.peak_allocated = self.allocated

    def malloc(self, key: int, nbytes: int) -> None:
        size = round_size(nbytes)
        small = size <= SMALL_SIZE
        pool = self._free[small]
        i = bisect.bisect_left(pool, (size, -1, -1))
        if i < len(pool):
            _, seg, off = pool.pop(i)
            block = self._find(seg, off)
        else:
            seg = len(self._segments)
            seg_bytes = segment_size(size)
            block = _Block(seg, 0, seg_bytes, True)
            self._segments.append([block])
            self._seg_small.append(small)
            self.reserved += seg_bytes
        remaining = block.size - size
        if remaining > (MIN_BLOCK if small else SMALL_SIZE):
            rest = _Block(block.seg, block.offset + size, remaining, True)
            blocks = self._segments[block.seg]
            blocks.insert(blocks.index(block) + 1, rest)
            bisect.insort(pool, (rest.size, rest.seg, rest.offset))
            block.size = size
        block.free = False
        self._live[key] = block
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    def release(self, key: int) -> None:
        block = self._live.pop(key, None)
        if block is None:
            return
        self.allocated -= block.size
        block.free = True
        blocks = self._segments[block.seg]
        small = self._seg_small[block.seg]
        pool = self._free[small]
        idx = blocks.index(block)
        # merge with the free neighbours
        for j in (idx + 1, idx - 1):
            if 0 <= j < len(blocks) and blocks[j].free and blocks[j] is not block:
                nb = blocks[j]
                pool.remove((nb.size, nb.seg, nb.offset))
                if j > idx:
                    block.size += nb.size
                    blocks.pop(j)
                else:
                    nb.size += block.size
                    blocks.pop(idx)
                    block = nb
                    idx = j
        bisect.insort(pool, (block.size, block.seg, block.offset))

    def _find(self, seg: int, offset: int) -> _Block:
        for b in self._segments[seg]:
            if b.offset == offset:
                return b
        raise KeyError((seg, offset))


def replay_reserved(resident: list[int], step_events: list[Event], steps: int = 3) -> tuple[int, int]:
    """Peak (reserved, allocated) bytes over `steps` repetitions of one step's tape.

    `resident` lists the sizes of the tensors allocated before training (weights, adapters...), each in its own
    request, as model loading does; optimizer states appear in the first step's tape and stay.
    """
    model = CachingAllocatorModel()
    for i, nbytes in enumerate(resident):
        model.malloc(-1 - i, nbytes)
    for step in range(steps):
        offset = step * 10_000_000
        for ev in step_events:
            if ev.retag:
                continue
            if ev.nbytes > 0:
                model.malloc(offset + ev.tid, ev.nbytes)
            else:
                model.release(offset + ev.tid)
        # tensors still live at the end of the step (none, once the step frees what it made) carry over
    return model.peak_reserved, model.peak_allocated

"""A memory tape: the allocations and frees of one training step, in program order, with a category each.

The analytic engine does not guess a peak from a sum: it writes down, op by op, what a PyTorch training step
allocates and frees (forward in order, then autograd's backward in reverse), and replays that tape. The live
total at every point gives the peak of each phase and what the peak is made of; the same tape drives the
caching-allocator model in `allocator.py` for `max_memory_reserved`.

Pure Python: no torch import.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Categories (the keys of MemoryEstimate.breakdown).
WEIGHTS = "weights"
ADAPTERS = "adapter_weights"
GRADIENTS = "gradients"
OPTIMIZER = "optimizer_states"
ACTIVATIONS = "saved_activations"
LOGITS = "logits_and_loss"
TRANSIENTS = "transients"
WORKSPACES = "workspaces"
CATEGORIES = (WEIGHTS, ADAPTERS, GRADIENTS, OPTIMIZER, ACTIVATIONS, LOGITS, TRANSIENTS, WORKSPACES)

FORWARD, BACKWARD, OPTIMIZER_STEP = "forward", "backward", "optimizer"
PHASES = (FORWARD, BACKWARD, OPTIMIZER_STEP)


@dataclass
class Event:
    """One allocation (`nbytes` > 0) or free (`nbytes` < 0) of tensor `tid`."""

    tid: int
    nbytes: int
    category: str
    phase: str
    label: str = ""
    retag: bool = False  # a change of category only: the allocator model ignores it
    stream: int = 0
    """The CUDA stream an allocation is made on (0: the default one): the caching allocator serves a request only
    from blocks cached for its stream (allocator.py)."""


@dataclass
class Tape:
    """Records events; `alloc` returns a tensor id to `free` later. Sizes are bytes (ints)."""

    events: list[Event] = field(default_factory=list)
    phase: str = FORWARD
    _sizes: dict[int, tuple[int, str, str]] = field(default_factory=dict)
    _next: int = 0

    def alloc(self, nbytes: int, category: str, label: str = "", stream: int = 0) -> int:
        tid = self._next
        self._next += 1
        nbytes = int(nbytes)
        self._sizes[tid] = (nbytes, category, label)
        if nbytes:
            self.events.append(Event(tid, nbytes, category, self.phase, label, stream=stream))
        return tid

    def free(self, *tids: int | None) -> None:
        for tid in tids:
            if tid is None or tid not in self._sizes:
                continue
            nbytes, category, label = self._sizes.pop(tid)
            if nbytes:
                self.events.append(Event(tid, -nbytes, category, self.phase, label))

    def retag(self, tid: int, category: str) -> None:
        """Move a live tensor to another category (e.g. a temporary that autograd decides to save)."""
        if tid not in self._sizes:
            return
        nbytes, old, label = self._sizes[tid]
        if old == category or not nbytes:
            return
        self._sizes[tid] = (nbytes, category, label)
        self.events.append(Event(tid, -nbytes, old, self.phase, label, retag=True))
        self.events.append(Event(tid, nbytes, category, self.phase, label, retag=True))

    def category_of(self, tid: int) -> str | None:
        entry = self._sizes.get(tid)
        return entry[1] if entry else None

    def live_ids(self) -> list[int]:
        return list(self._sizes)

    def size(self, tid: int) -> int:
        return self._sizes[tid][0]


@dataclass(frozen=True)
class PhasePeak:
    """The largest live total of one phase, and what was live at that moment, per category."""

    peak_bytes: int
    by_category: dict[str, int]
    at_label: str


def replay(events: list[Event], start_live: dict[str, int]) -> dict[str, PhasePeak]:
    """Replay the tape from `start_live` (bytes per category already resident) and find each phase's peak."""
    live = dict.fromkeys(CATEGORIES, 0)
    for k, v in start_live.items():
        live[k] = live.get(k, 0) + v
    total = sum(live.values())
    best: dict[str, PhasePeak] = {}
    at_start: dict[str, PhasePeak] = {}  # what is live when a phase begins: its peak if it allocates nothing
    for ev in events:
        if ev.phase not in at_start:
            at_start[ev.phase] = PhasePeak(total, dict(live), "")
        live[ev.category] = live.get(ev.category, 0) + ev.nbytes
        total += ev.nbytes
        if ev.nbytes > 0 and not ev.retag:
            cur = best.get(ev.phase)
            if cur is None or total > cur.peak_bytes:
                best[ev.phase] = PhasePeak(total, dict(live), ev.label)
    for phase in PHASES:
        if phase not in best:  # e.g. SGD's step: in place, no allocation; the gradients are still live
            best[phase] = at_start.get(phase) or PhasePeak(sum(start_live.values()), dict(live), "")
    return best


TAPE_TIMELINE_POINTS = 600
"""Points `timeline` keeps of a replayed tape (an 8B model's step has tens of thousands of events)."""


@dataclass(frozen=True)
class TapePoint:
    """The live bytes after one event of the replayed tape."""

    event: int
    """The event's index in the tape."""
    phase: str
    label: str
    """The tensor allocated or freed there."""
    allocated_bytes: int
    by_category: dict[str, int]


def timeline(events: list[Event], start_live: dict[str, int],
             max_points: int = TAPE_TIMELINE_POINTS) -> list[TapePoint]:
    """The replayed tape as at most `max_points` points in tape order, keeping its shape: the first and the last
    event of each run of one phase (its bands), each run's highest point (the phase peaks `replay` finds), and the
    lowest and the highest point of equal slices of the tape. Retags move bytes between categories only and make
    no point of their own."""
    total = sum(start_live.values())
    totals: list[int] = []
    for ev in events:
        total += ev.nbytes
        totals.append(total)
    usable = [i for i, ev in enumerate(events) if not ev.retag]
    if not usable:
        return []
    keep: set[int] = set()
    start = 0
    for j in range(1, len(usable) + 1):  # runs of one phase among the usable events
        if j == len(usable) or events[usable[j]].phase != events[usable[start]].phase:
            run = usable[start:j]
            keep.update((run[0], run[-1], max(run, key=totals.__getitem__)))
            start = j
    slices = max(1, (max_points - len(keep)) // 2)
    if len(usable) > len(keep):
        per = -(-len(usable) // slices)
        for a in range(0, len(usable), per):
            part = usable[a:a + per]
            keep.update((min(part, key=totals.__getitem__), max(part, key=totals.__getitem__)))
    live = dict.fromkeys(CATEGORIES, 0)
    for k, v in start_live.items():
        live[k] = live.get(k, 0) + v
    points = []
    for i, ev in enumerate(events):  # a second replay: the categories at the kept points only
        live[ev.category] = live.get(ev.category, 0) + ev.nbytes
        if i in keep:
            points.append(TapePoint(i, ev.phase, ev.label, totals[i], dict(live)))
    return points

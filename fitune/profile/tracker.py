"""Measure a real training step's memory by category: every storage PyTorch creates is seen (a
TorchDispatchMode), labelled when it is born, and dropped when it dies (a weak reference to its storage).

Labels follow the estimator's categories (fitune/memory/tape.py), so a measurement and an estimate subtract:
- weights / adapter_weights: the model's parameters (frozen / trainable), registered up front;
- gradients: `.grad` of trainable parameters; optimizer_states: tensors in `optimizer.state`;
- saved_activations: born in forward and still alive when forward ends: what autograd keeps for backward;
- logits_and_loss: born in lm_head, the loss, or the loss's backward (until lm_head's backward finishes);
- transients: everything else (intermediates of forward and of backward, and the activations a checkpointed
  layer recomputes in backward);
- workspaces: on CUDA, what the allocator has out that the mode never saw (cuBLAS workspaces).

Works on the CPU (tensor-level accounting) and on CUDA (where the allocator counters are read as well). The
autograd engine propagates dispatch modes to its worker threads, so backward allocations are seen too.
"""

from __future__ import annotations

import math
import re
import threading
import time
import weakref
from dataclasses import dataclass

_LAYER_INDEX = re.compile(r"\.\d+\.")

CATEGORIES = ("weights", "adapter_weights", "gradients", "optimizer_states", "saved_activations",
              "logits_and_loss", "transients", "workspaces")
MAX_TIMELINE_POINTS = 2000
"""Samples `downsample` keeps of a timeline (a step of an 8B model takes tens of thousands)."""
ALLOCATOR_READ_EVERY_S = 0.001
"""Seconds between two reads of the CUDA allocator's counters: a read costs 15 us (memory_stats_as_nested_dict on
an H200), and reading at each of a 1B model's 6,000 samples per step slowed its step by half (measured: 0.38 ->
0.57 s, llama-3.2-1b LoRA, 2 x 2048 tokens)."""


@dataclass
class Sample:
    """Memory at one moment: taken at every allocation and every free the tracker sees."""

    t_s: float
    """Seconds since the tracker was made."""
    phase: str
    """forward | backward | optimizer | idle (between steps)."""
    live_bytes: int
    """Bytes of the tensors the tracker sees alive (on the CPU, the memory the step holds)."""
    allocated_bytes: int | None = None
    """CUDA (allocator_counters=True): the caching allocator's allocated bytes at that moment; None on the CPU and
    between two reads (at most one every ALLOCATOR_READ_EVERY_S)."""
    reserved_bytes: int | None = None
    """CUDA (allocator_counters=True): the caching allocator's reserved bytes (its segments) at that moment."""
    by_category: tuple[int, ...] | None = None
    """`live_bytes` split by category, in the order of CATEGORIES (the categories of that moment: forward's
    transients become saved_activations when backward starts, as at the peaks)."""

    def breakdown(self) -> dict[str, int] | None:
        return None if self.by_category is None else dict(zip(CATEGORIES, self.by_category))


@dataclass
class PeakRecord:
    phase: str
    live_bytes: int
    by_category: dict[str, int]
    by_source: dict[str, int]


@dataclass
class _Entry:
    nbytes: int
    category: str
    phase: str
    source: str


class MemoryTracker:
    """Context manager: `with MemoryTracker(model, optimizer) as tr: ...; tr.set_phase("backward") ...`.

    Keep the tracker to one training loop at a time; it is not re-entrant.
    """

    def __init__(self, model=None, optimizer=None, lm_head=None, cap_bytes: int | None = None,
                 timeline: bool = True, device_type: str | None = None, allocator_counters: bool = False):
        """`allocator_counters`: on CUDA, each timeline sample also reads the caching allocator's allocated and
        reserved bytes."""
        # torch: optional, imported where used (estimate, plan and doctor SCRIPT never load it)
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode

        self._torch = torch
        self.model = model
        self.optimizer = optimizer
        self.cap_bytes = cap_bytes
        self.timeline_enabled = timeline
        self.allocator_counters = allocator_counters
        self._counters_read_s = -1.0
        self.device_type = device_type
        if device_type is None and model is not None:
            try:
                self.device_type = next(model.parameters()).device.type
            except StopIteration:
                self.device_type = None
        self.live: dict[int, _Entry] = {}
        self.live_bytes = 0
        self._category_bytes = dict.fromkeys(CATEGORIES, 0)
        """Live bytes per category, kept as entries come, go and change category (the timeline's split)."""
        self.phase = "idle"
        self.phase_peaks: dict[str, PeakRecord] = {}
        self.samples: list[Sample] = []
        self._t0 = time.perf_counter()
        self._lock = threading.RLock()
        self._module_stack: list[str] = []
        self._in_loss = False
        self._loss_backward = False
        self._refs: dict[int, object] = {}
        tracker = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                tracker._see(out, str(func.overloadpacket.__name__))
                return out

        self._mode = _Mode()
        self._hooks = []
        self._param_storages: dict[int, str] = {}
        if model is not None:
            for p in model.parameters():
                key = self._key(p)
                if key is not None and key not in self._param_storages:
                    self._param_storages[key] = "adapter_weights" if p.requires_grad else "weights"
            for name, module in model.named_modules():
                self._hooks.append(module.register_forward_pre_hook(self._pre_hook(name)))
                self._hooks.append(module.register_forward_hook(self._post_hook(name)))
            head = lm_head if lm_head is not None else _find_lm_head(model)
            if head is not None:
                self._hooks.append(head.register_forward_pre_hook(lambda m, a: self._enter_loss()))
                self._hooks.append(head.register_full_backward_hook(lambda m, gi, go: self._leave_loss_backward()))

    # ---- phases -------------------------------------------------------------------------------------------
    def set_phase(self, phase: str) -> None:
        """Mark the start of a phase: forward, backward, optimizer (or anything else)."""
        with self._lock:
            if phase == "backward":
                self._relabel_forward_survivors()
                self._loss_backward = True
            if phase == "optimizer":
                self._relabel_grads()
            if phase not in ("forward",):
                self._in_loss = False
            # non-reentrant checkpointing stops a recomputation early by raising inside the layer, so forward
            # post-hooks do not always run: start every phase with an empty module stack
            self._module_stack.clear()
            self.phase = phase

    def end_step(self) -> None:
        with self._lock:
            self._relabel_optimizer_states()
            self.phase = "idle"

    # ---- results ------------------------------------------------------------------------------------------
    @property
    def peak(self) -> PeakRecord | None:
        if not self.phase_peaks:
            return None
        return max(self.phase_peaks.values(), key=lambda p: p.live_bytes)

    def live_by_category(self) -> dict[str, int]:
        out = dict.fromkeys(CATEGORIES, 0)
        with self._lock:
            for e in self.live.values():
                out[e.category] = out.get(e.category, 0) + e.nbytes
        return out

    def live_by_source(self, top: int = 10) -> list[tuple[str, int]]:
        """Live bytes by the module (or op) that made them, layers folded together (`layers.*.mlp.up_proj`)."""
        agg: dict[str, int] = {}
        with self._lock:
            for e in self.live.values():
                src = _LAYER_INDEX.sub(".*.", e.source)
                agg[src] = agg.get(src, 0) + e.nbytes
        return sorted(agg.items(), key=lambda kv: -kv[1])[:top]

    # ---- context manager ----------------------------------------------------------------------------------
    def __enter__(self) -> "MemoryTracker":
        # what exists already: parameters, grads, optimizer state
        if self.model is not None:
            for p in self.model.parameters():
                self._add(p, self._param_storages.get(self._key(p), "weights"), "parameters", count_peak=False)
        self._relabel_optimizer_states(add=True)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    # ---- internals ----------------------------------------------------------------------------------------
    def _pre_hook(self, name):
        def hook(module, args):
            self._module_stack.append(name)
        return hook

    def _post_hook(self, name):
        def hook(module, args, output):
            if self._module_stack:
                self._module_stack.pop()
        return hook

    def _enter_loss(self) -> None:
        if self.phase == "forward":
            self._in_loss = True

    def _leave_loss_backward(self) -> None:
        self._loss_backward = False

    def _key(self, t) -> int | None:
        try:
            st = t.untyped_storage()
            return st.data_ptr() if st.nbytes() else None
        except Exception:  # noqa: BLE001 - meta / sparse tensors: not memory
            return None

    def _category_for_new(self) -> str:
        if self.phase == "forward":
            return "logits_and_loss" if self._in_loss else "transients"
        if self.phase == "backward":
            # A checkpointed layer's recomputed activations live only through that layer's backward: they count
            # as transients here (the estimate counts them as activations; the totals agree).
            return "logits_and_loss" if self._loss_backward else "transients"
        if self.phase == "optimizer":
            return "transients"
        return "transients"

    def _see(self, out, op: str) -> None:
        torch = self._torch
        tensors = []
        if isinstance(out, torch.Tensor):
            tensors = [out]
        elif isinstance(out, (tuple, list)):
            tensors = [t for t in out if isinstance(t, torch.Tensor)]
        if not tensors:
            return
        source = self._module_stack[-1] if self._module_stack else ("loss" if self._in_loss else op)
        for t in tensors:
            self._add(t, self._category_for_new(), source)

    def _add(self, t, category: str, source: str, count_peak: bool = True) -> None:
        if self.device_type is not None and t.device.type != self.device_type:
            return
        key = self._key(t)
        if key is None:
            return
        with self._lock:
            if key in self.live:
                return
            st = t.untyped_storage()
            nbytes = st.nbytes()
            if self.cap_bytes is not None and count_peak and self.live_bytes + nbytes > self.cap_bytes:
                raise self._torch.OutOfMemoryError(
                    f"out of memory under the tracker's cap. Tried to allocate {nbytes} B; "
                    f"{self.live_bytes} B live of a {self.cap_bytes} B cap")
            self.live[key] = _Entry(nbytes, category, self.phase, source)
            self.live_bytes += nbytes
            self._category_bytes[category] = self._category_bytes.get(category, 0) + nbytes
            try:
                self._refs[key] = weakref.ref(st, lambda _r, k=key: self._drop(k))
            except TypeError:  # storages that cannot be weakly referenced: kept (counted) until the end
                pass
            if count_peak:
                self._note_peak()

    def _drop(self, key: int) -> None:
        with self._lock:
            e = self.live.pop(key, None)
            self._refs.pop(key, None)
            if e is not None:
                self.live_bytes -= e.nbytes
                self._category_bytes[e.category] -= e.nbytes
                if self.timeline_enabled:
                    self.samples.append(self._sample(self.phase))

    def _note_peak(self) -> None:
        phase = self.phase
        cur = self.phase_peaks.get(phase)
        if cur is None or self.live_bytes > cur.live_bytes:
            by_cat = dict.fromkeys(CATEGORIES, 0)
            by_src: dict[str, int] = {}
            for e in self.live.values():
                by_cat[e.category] = by_cat.get(e.category, 0) + e.nbytes
                by_src[e.source] = by_src.get(e.source, 0) + e.nbytes
            self.phase_peaks[phase] = PeakRecord(phase, self.live_bytes, by_cat, by_src)
        if self.timeline_enabled:
            self.samples.append(self._sample(phase))

    def _sample(self, phase: str) -> Sample:
        t_s = time.perf_counter() - self._t0
        split = tuple(self._category_bytes.values())
        if not self.allocator_counters or t_s - self._counters_read_s < ALLOCATOR_READ_EVERY_S:
            return Sample(t_s, phase, self.live_bytes, by_category=split)
        self._counters_read_s = t_s
        try:
            stats = self._torch.cuda.memory_stats_as_nested_dict()  # one call for both counters
        except Exception:  # noqa: BLE001 - a free seen while CUDA shuts down (a weakref callback at exit)
            return Sample(t_s, phase, self.live_bytes, by_category=split)
        return Sample(t_s, phase, self.live_bytes, stats["allocated_bytes"]["all"]["current"],
                      stats["reserved_bytes"]["all"]["current"], split)

    def _move(self, e: _Entry, category: str) -> None:
        """Give a live entry another category (its bytes move with it)."""
        self._category_bytes[e.category] -= e.nbytes
        self._category_bytes[category] = self._category_bytes.get(category, 0) + e.nbytes
        e.category = category

    def _relabel_forward_survivors(self) -> None:
        for e in self.live.values():
            if e.phase == "forward" and e.category == "transients":
                self._move(e, "saved_activations")

    def _relabel_grads(self) -> None:
        if self.model is None:
            return
        for p in self.model.parameters():
            if p.grad is not None:
                key = self._key(p.grad)
                if key in self.live:
                    self._move(self.live[key], "gradients")
                else:
                    self._add(p.grad, "gradients", "grad", count_peak=False)

    def _relabel_optimizer_states(self, add: bool = False) -> None:
        if self.optimizer is None:
            return
        for state in self.optimizer.state.values():
            for v in state.values():
                if isinstance(v, self._torch.Tensor) and v.device.type != "cpu" or (
                        isinstance(v, self._torch.Tensor) and v.dim() > 0):
                    key = self._key(v)
                    if key in self.live:
                        self._move(self.live[key], "optimizer_states")
                    elif add:
                        self._add(v, "optimizer_states", "optimizer", count_peak=False)


def downsample(samples: list[Sample], max_points: int = MAX_TIMELINE_POINTS) -> list[Sample]:
    """At most `max_points` of `samples`, in time order, keeping the timeline's shape: the first and the last sample
    of each run of one phase (the phase bands), the highest live, allocated and reserved samples (the peaks), and in
    each of equal slices of time, within a phase, its lowest and highest live sample and its highest allocated one."""
    n = len(samples)
    if n <= max_points:
        return list(samples)
    runs, start = [], 0  # [start, end) of each run of one phase
    for i in range(1, n + 1):
        if i == n or samples[i].phase != samples[start].phase:
            runs.append((start, i))
            start = i
    keep = {i for a, b in runs for i in (a, b - 1)}
    read = [i for i in range(n) if samples[i].allocated_bytes is not None]  # CUDA: the allocator was read there
    keep.add(max(range(n), key=lambda i: samples[i].live_bytes))
    for key in ("allocated_bytes", "reserved_bytes"):
        if read:
            keep.add(max(read, key=lambda i: getattr(samples[i], key)))
    # each slice adds two samples (three with allocator readings), and a phase boundary can cut one slice in two
    per_slice = 3 if read else 2
    slices = (max_points - len(keep)) // per_slice - len(runs)
    if slices >= 1:
        t0, span = samples[0].t_s, (samples[-1].t_s - samples[0].t_s) or 1.0
        lowest_highest: dict[tuple[int, int], tuple[int, int, int | None]] = {}
        for r, (a, b) in enumerate(runs):
            for i in range(a, b):
                k = (r, min(slices - 1, int((samples[i].t_s - t0) / span * slices)))
                lo, hi, top = lowest_highest.get(k, (i, i, None))
                v = samples[i].live_bytes
                alloc = samples[i].allocated_bytes
                if alloc is not None and (top is None or alloc > samples[top].allocated_bytes):
                    top = i
                lowest_highest[k] = (i if v < samples[lo].live_bytes else lo, i if v > samples[hi].live_bytes else hi,
                                     top)
        keep.update(i for picks in lowest_highest.values() for i in picks if i is not None)
    kept = sorted(keep)
    if len(kept) > max_points:  # more phase runs than points (hundreds of steps): every k-th, and the peak
        peak = max(range(n), key=lambda i: samples[i].live_bytes)
        kept = sorted(set(kept[::math.ceil(len(kept) / (max_points - 1))]) | {peak})
    return [samples[i] for i in kept]


def _find_lm_head(model):
    get = getattr(model, "get_output_embeddings", None)
    if callable(get):
        try:
            return get()
        except Exception:  # noqa: BLE001
            return None
    return None

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

import re
import threading
import time
import weakref
from dataclasses import dataclass

_LAYER_INDEX = re.compile(r"\.\d+\.")

CATEGORIES = ("weights", "adapter_weights", "gradients", "optimizer_states", "saved_activations",
              "logits_and_loss", "transients", "workspaces")


@dataclass
class Sample:
    """Live bytes at one moment (taken at every allocation that raises the live total of a phase)."""

    t_s: float
    phase: str
    live_bytes: int


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
                 timeline: bool = True, device_type: str | None = None):
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode

        self._torch = torch
        self.model = model
        self.optimizer = optimizer
        self.cap_bytes = cap_bytes
        self.timeline_enabled = timeline
        self.device_type = device_type
        if device_type is None and model is not None:
            try:
                self.device_type = next(model.parameters()).device.type
            except StopIteration:
                self.device_type = None
        self.live: dict[int, _Entry] = {}
        self.live_bytes = 0
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
                if self.timeline_enabled:
                    self.samples.append(Sample(time.perf_counter() - self._t0, self.phase, self.live_bytes))

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
            self.samples.append(Sample(time.perf_counter() - self._t0, phase, self.live_bytes))

    def _relabel_forward_survivors(self) -> None:
        for e in self.live.values():
            if e.phase == "forward" and e.category == "transients":
                e.category = "saved_activations"

    def _relabel_grads(self) -> None:
        if self.model is None:
            return
        for p in self.model.parameters():
            if p.grad is not None:
                key = self._key(p.grad)
                if key in self.live:
                    self.live[key].category = "gradients"
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
                        self.live[key].category = "optimizer_states"
                    elif add:
                        self._add(v, "optimizer_states", "optimizer", count_peak=False)


def _find_lm_head(model):
    get = getattr(model, "get_output_embeddings", None)
    if callable(get):
        try:
            return get()
        except Exception:  # noqa: BLE001
            return None
    return None

"""A live-tensor-bytes tracker for the trace engine: a `TorchDispatchMode` that weakly follows every storage.

Why not `torch.distributed._tools.mem_tracker.MemTracker`? It was tried first (torch 2.13) and does the same
thing at heart, but on the HF recipe it (1) registers a gradient hook on *every* parameter, which raises
"cannot register a hook on a tensor that doesn't require gradient" as soon as LoRA freezes the base, and
(2) under non-reentrant checkpointing its `ModTracker` leaks the first decoder layer's input and that
input's gradient every step (a `register_multi_grad_hook` closure on a leaf tensor made to require grad by
`enable_input_require_grads` keeps them alive through C++, out of reach of `gc`), which inflates the second
step's numbers by 2 x batch x seq x hidden x 2 bytes. This tracker has no module hooks at all.

How it counts. Every tensor an op returns (inside the mode) has its storage looked up in a
`WeakIdKeyDictionary` (one Python object per live storage, so views and aliases count once); a new storage
is added with its `nbytes()` under the current category and a weakref callback subtracts it when the
storage dies. Tensors that exist before the mode is entered (the model, optimizer state, the input ids) are
registered with `track()`. The category of a new storage is the phase's: "activations" in the forward,
"temporaries" in the backward and the optimizer step; `retag()` moves a storage to another category
(gradients once accumulated, optimizer state after the step). The peak of each phase is the highest total
seen after any op of the phase, with the per-category breakdown at that moment.
"""

from __future__ import annotations

import weakref
from typing import Any


def make_tracker():
    """Build a `LiveBytesTracker` (imports torch): `StorageLedger`'s bookkeeping, fed by a `TorchDispatchMode`."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves
    from torch.utils.weak import WeakIdKeyDictionary

    class LiveBytesTracker(StorageLedger, TorchDispatchMode):
        def __init__(self) -> None:
            TorchDispatchMode.__init__(self)
            StorageLedger.__init__(self, WeakIdKeyDictionary())

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            category = self.category
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self._see(t, category, retag=False)
            # in-place ops may resize their first argument's storage (aten.resize_, out= variants)
            if args and isinstance(args[0], torch.Tensor) and func._schema.is_mutable:
                self._see(args[0], category, retag=False)
            if self.total > self.phase_peak:
                self.phase_peak = self.total
                self.phase_peak_by_category = self.snapshot()
            return out

    return LiveBytesTracker()


class StorageLedger:
    """The live bytes of every storage seen, by category, and the peak of the current phase (no torch import:
    `make_tracker` feeds it from a `TorchDispatchMode`)."""

    def __init__(self, infos) -> None:
        self._infos = infos  # a WeakIdKeyDictionary: UntypedStorage -> [nbytes, category, weakref]
        self.by_category: dict[str, int] = {}
        self.total = 0
        self.category = "activations"  # category of storages created from now on
        self.phase_peak = 0
        self.phase_peak_by_category: dict[str, int] = {}

    # ---- bookkeeping
    def _add(self, st, category: str) -> None:
        n = st.nbytes()
        info: list[Any] = [n, category, None]
        info[2] = weakref.ref(st, lambda _ref, info=info: self._free(info))
        self._infos[st] = info
        self.total += n
        self.by_category[category] = self.by_category.get(category, 0) + n

    def _free(self, info) -> None:
        n, category = info[0], info[1]
        self.total -= n
        self.by_category[category] -= n

    def _see(self, t, category: str, retag: bool) -> None:
        try:
            st = t.untyped_storage()
        except Exception:  # noqa: BLE001 - sparse / exotic tensors: no storage to follow
            return
        info = self._infos.get(st)
        if info is None:
            self._add(st, category)
            return
        n = st.nbytes()
        if n != info[0]:  # resized in place (resize_, out= variants)
            delta = n - info[0]
            info[0] = n
            self.total += delta
            self.by_category[info[1]] += delta
        if retag and info[1] != category:
            self.by_category[info[1]] -= n
            self.by_category[category] = self.by_category.get(category, 0) + n
            info[1] = category

    def track(self, tensors, category: str) -> None:
        """Register tensors that exist already (weights, optimizer state, inputs) under `category`."""
        for t in tensors:
            self._see(t, category, retag=False)

    def retag(self, tensors, category: str) -> None:
        """Move the storages of `tensors` (registering them if new) to `category`."""
        for t in tensors:
            if t is not None:
                self._see(t, category, retag=True)

    def category_of(self, t) -> str | None:
        info = self._infos.get(t.untyped_storage())
        return None if info is None else info[1]

    # ---- phases
    def start_phase(self, category: str) -> None:
        self.category = category
        self.phase_peak = self.total
        self.phase_peak_by_category = self.snapshot()

    def end_phase(self) -> tuple[int, dict[str, int]]:
        return self.phase_peak, dict(self.phase_peak_by_category)

    def snapshot(self) -> dict[str, int]:
        return {k: v for k, v in self.by_category.items() if v}

"""Offloaded activation checkpoints: each checkpointed layer's input waits for backward in (pinned) host memory.

Activation checkpointing keeps one tensor per layer on the GPU, the layer's input (2 x hidden bytes per token
per layer: 32 layers x 8 KiB per token for Llama-3.1-8B, 8 GiB at 32k tokens). Here that input is copied to
pinned CPU memory on a side CUDA stream while the layer's forward runs, and copied back during
backward one layer ahead of need (when layer i recomputes, layer i-1's input is already on its way), so the
transfers overlap compute. The recomputation and its backward are the ones of reentrant checkpointing
(`torch.utils.checkpoint` with use_reentrant=True): run the layer again with grad enabled, backpropagate the
incoming gradient through it; parameter gradients accumulate as usual.

The host buffers come from a `PinnedPool`: ordinary host memory of the checkpoint's exact size, page-locked with
`cudaHostRegister` (what PyTorch's torch/cuda/_pin_memory_utils.py does), owned by the pool and reused step after
step. PyTorch's pinned allocator (`pin_memory=True`) rounds each block up to a power of two before 2.13: a
140,288-token QLoRA run held 64 GiB of pinned blocks for 34.3 GiB of checkpoints (PyTorch 2.11, measured). With the
pool the host RAM is the checkpoints' bytes on every PyTorch version.

Install with `enable_offloaded_checkpointing(model)` after `gradient_checkpointing_enable()` (it replaces the
checkpoint function transformers' GradientCheckpointingLayer calls). Exact: tests/test_offload.py compares loss
and gradients with the model trained without checkpointing.
"""

from __future__ import annotations

import logging

import torch

from ..layers import find_decoder_layers

log = logging.getLogger(__name__)


def _page_lock(buffer) -> None:
    cudart = torch.cuda.cudart()
    rc = int(cudart.cudaHostRegister(buffer.data_ptr(), buffer.numel(), 0))
    if rc != 0:
        if hasattr(cudart, "cudaGetLastError"):  # a later launch check must not pick this error up
            cudart.cudaGetLastError()
        raise RuntimeError(f"cudaHostRegister of {buffer.numel()} host bytes failed (CUDA error {rc}): the host may "
                           "be out of page-lockable memory (ulimit -l, or RAM): see `fitune estimate`'s host figure")


def _page_unlock(buffer) -> None:
    torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr())


class PinnedPool:
    """Exact-size page-locked host buffers for the offloaded checkpoints, reused across steps.

    The pool owns every buffer it made for as long as it lives (a registered buffer must be unregistered before its
    memory is freed; a checkpoint lost to an out-of-memory error mid-step never gives its buffer back, and the
    buffer stays owned, not freed). `take` lends the smallest free buffer that holds the tensor (or makes one of
    its exact size); `give_back` returns it. Where page-locking fails (a locked-memory limit), the checkpoint takes a
    block of PyTorch's pinned allocator instead, with a warning. `lock` / `unlock` page-lock a new buffer and release it (stand-ins in
    tests on the CPU)."""

    def __init__(self, lock=_page_lock, unlock=_page_unlock, pinned=None):
        self._lock, self._unlock = lock, unlock
        self._pinned = pinned or (lambda shape, dtype: torch.empty(shape, dtype=dtype, pin_memory=True))
        self._owned: list = []
        self._free: list = []
        self.fell_back = False
        """Page-locking failed once: checkpoints then take PyTorch's pinned blocks (`take` returns no buffer)."""

    @property
    def registered_bytes(self) -> int:
        return sum(b.numel() for b in self._owned)

    def take(self, shape, dtype):
        """A host tensor of `shape` and `dtype` inside a page-locked buffer, lent until `give_back`."""
        if self.fell_back:
            return self._pinned(shape, dtype), None
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        fitting = [b for b in self._free if b.numel() >= nbytes]
        if fitting:
            buffer = min(fitting, key=lambda b: b.numel())
            self._free.remove(buffer)
        else:
            if self._free:  # a longer batch than before: the shorter buffers go, so host RAM stays one set
                self.release_free()
            buffer = torch.empty(nbytes, dtype=torch.uint8)
            try:
                self._lock(buffer)
            except RuntimeError as exc:  # PyTorch's own pinned allocator instead (rounded blocks), said once
                if not self.fell_back:
                    log.warning("offloaded checkpoints: %s; using PyTorch's pinned allocator, which rounds each "
                                "block up to a power of two (more host RAM than fitune estimated)", exc)
                self.fell_back = True
                return self._pinned(shape, dtype), None
            self._owned.append(buffer)
        return buffer[:nbytes].view(dtype).view(shape), buffer

    def give_back(self, buffer) -> None:
        if buffer is not None:
            self._free.append(buffer)

    def release_free(self) -> None:
        """Unlock and drop the free buffers (after the copies that used them are done)."""
        if self._free and torch.cuda.is_available():
            torch.cuda.synchronize()
        for buffer in self._free:
            self._unlock(buffer)
            self._owned.remove(buffer)
        self._free.clear()

    def close(self) -> None:
        """Unlock every buffer this pool made (lent ones too: their checkpoints are gone with the run)."""
        self._free = list(self._owned)
        self.release_free()


_POOLS: list[PinnedPool] = []


def registered_bytes() -> int:
    """Host bytes page-locked by offloaded checkpoints in this process (every pool), for the records."""
    return sum(pool.registered_bytes for pool in _POOLS)


class OffloadManager:
    """Orders the offloaded inputs of one forward, so backward can prefetch the next one it will need."""

    def __init__(self, pool: PinnedPool | None = None):
        self.contexts: list = []
        self._stream = None
        self.pool = pool

    def stream(self, device):
        if self._stream is None and device.type == "cuda":
            self._stream = torch.cuda.Stream(device)
        return self._stream

    def register(self, ctx) -> int:
        self.contexts.append(ctx)
        return len(self.contexts) - 1

    def prefetch(self, index: int) -> None:
        """Start copying the input of context `index` back to its device (no-op if already done)."""
        if index < 0 or index >= len(self.contexts):
            return
        ctx = self.contexts[index]
        if ctx is None or getattr(ctx, "restored", None) is not None:
            return
        stream = self.stream(ctx.device)
        if stream is None:  # CPU: a plain copy stands in for the transfer
            ctx.restored = ctx.host.clone()
            return
        # The GPU copy is allocated on the compute stream, where it is used and freed, and filled on the side
        # stream. Allocated on the side stream (as before 2026-12-06), its block went back to the side stream's
        # pool when freed: (1) the next prefetch could take it and overwrite it while the compute stream still read
        # it (the caching allocator orders reuse within a stream only), and (2) the compute stream could not reuse
        # it, so under a capped budget every layer's backward needed an allocator retry (31-32 per step measured,
        # bench/results/issue33/rows). The side stream first waits for the compute stream's work so far: the block
        # may be one that work still reads.
        compute = torch.cuda.current_stream(ctx.device)
        restored = torch.empty(ctx.host.shape, dtype=ctx.host.dtype, device=ctx.device)
        stream.wait_stream(compute)
        with torch.cuda.stream(stream):
            restored.copy_(ctx.host, non_blocking=True)
            ctx.ready = torch.cuda.Event()
            ctx.ready.record(stream)
        ctx.restored = restored

    def host_copy(self, shape, dtype):
        """Where a checkpoint waits: (host tensor, its pool buffer), the pool made on first use."""
        if self.pool is None:
            self.pool = PinnedPool()
            _POOLS.append(self.pool)
        return self.pool.take(shape, dtype)

    def release(self, index: int) -> None:
        ctx = self.contexts[index]
        if ctx is not None and getattr(ctx, "buffer", None) is not None:
            self.pool.give_back(ctx.buffer)
            ctx.buffer = None
        self.contexts[index] = None
        if all(c is None for c in self.contexts):
            self.contexts.clear()


class _OffloadedCheckpoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx, manager, run, x, anchor):
        ctx.run, ctx.manager, ctx.device = run, manager, x.device
        ctx.cpu_rng = torch.get_rng_state()
        ctx.cuda_rng = torch.cuda.get_rng_state(x.device) if x.is_cuda else None
        copied = None
        if x.is_cuda:  # the transfer runs on the side stream while the layer's forward runs on the compute stream
            compute, stream = torch.cuda.current_stream(x.device), manager.stream(x.device)
            stream.wait_stream(compute)  # x is complete before it is copied
            host, ctx.buffer = manager.host_copy(x.shape, x.dtype)
            with torch.cuda.stream(stream):
                host.copy_(x, non_blocking=True)
                copied = torch.cuda.Event()
                copied.record(stream)
        else:
            host, ctx.buffer = x.detach().clone(), None
        with torch.no_grad():
            y = run(x)
        if copied is not None:
            # The compute stream goes on only once the transfer has read x, so x's block, freed by the caller after
            # this returns, is free at once for the compute stream's next requests, where the estimate frees it.
            # `x.record_stream(side stream)` (before 2026-12-06) deferred that free until the host saw the copy
            # finish, and the host runs layers ahead of the GPU. The copy (about 25 ms for 140k tokens' hidden
            # states) overlaps the layer's forward (hundreds of ms). The allocator retries of offloaded runs under a
            # `cap` stayed after this change (bench/results/issue33/noretry): they come from PyTorch's memory
            # fraction check (fitune/runtime/device.py `limit_allocator`).
            compute.wait_event(copied)
        ctx.host, ctx.restored, ctx.ready = host, None, None
        ctx.index = manager.register(ctx)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        manager = ctx.manager
        manager.prefetch(ctx.index)  # normally done already by the layer above
        if ctx.ready is not None:
            torch.cuda.current_stream(ctx.device).wait_event(ctx.ready)
        need_x = ctx.needs_input_grad[2]
        x = ctx.restored.detach().requires_grad_(need_x)
        ctx.restored = ctx.host = None
        manager.prefetch(ctx.index - 1)  # the layer below: its input travels while this one recomputes
        devices = [ctx.device] if ctx.cuda_rng is not None else []
        with torch.random.fork_rng(devices=devices):
            torch.set_rng_state(ctx.cpu_rng)
            if ctx.cuda_rng is not None:
                torch.cuda.set_rng_state(ctx.cuda_rng, ctx.device)
            with torch.enable_grad():
                y = ctx.run(x)
        torch.autograd.backward(y, grad_y)
        manager.release(ctx.index)
        return None, None, x.grad if need_x else None, None


def enable_offloaded_checkpointing(model) -> OffloadManager:
    """Make every checkpointing decoder layer of `model` keep its input in host memory (see module docstring)."""
    manager = OffloadManager()

    anchor = torch.zeros(0, requires_grad=True)

    def checkpoint(run, hidden_states, *args):
        if args:
            raise ValueError("offloaded checkpointing expects the layer's hidden states as its only positional input")
        # `anchor` makes the output require grad (so backward reaches the layer's parameters) even when the input
        # does not: the first layer's input, the embeddings, then needs no requires_grad, and no autograd leaf
        # keeps it on the GPU for the whole step (transformers' input-requires-grad hook is removed below)
        return _OffloadedCheckpoint.apply(manager, run, hidden_states, anchor)

    found = 0
    for module in model.modules():
        if getattr(module, "gradient_checkpointing", False) and hasattr(module, "_gradient_checkpointing_func"):
            module._gradient_checkpointing_func = checkpoint
            found += 1
    if not found:
        raise ValueError("no checkpointing layer found: call gradient_checkpointing_enable() first")
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if embeddings is not None:
        for key, hook in list(embeddings._forward_hooks.items()):
            if getattr(hook, "__name__", "").startswith("make_inputs_require_grad"):
                del embeddings._forward_hooks[key]
    return manager


def enable_selective_checkpointing(model, k: int) -> int:
    """Keep checkpointing on the first `k` decoder layers only (the others keep their activations: faster).

    The first layers are the ones whose activations would live longest; `fitune estimate --grad-checkpointing
    selective:K` models the same choice. Returns how many layers checkpoint.
    """
    layers = find_decoder_layers(model)
    for i, layer in enumerate(layers):
        layer.gradient_checkpointing = i < k
    return min(k, len(layers))

"""`--engine trace`: run the real transformers model + PEFT + loss on fake tensors and measure memory.

The HF recipe (see `fitune.profile.hf_recipe`) is executed op by op under PyTorch's `FakeTensorMode`: every
tensor has its real shape, dtype, strides and storage size, but no data, so an 8B model with a batch of
2 x 2048 tokens "runs" on a laptop CPU in seconds and allocates nothing real. Memory is measured by
`fitune.trace.tracker` (a `TorchDispatchMode` that weakly follows every storage an op creates, counts each
storage once, however many views share it, and sorts it into params / buffers / inputs / activations /
temporaries / grads / optimizer; its docstring says why PyTorch's own `MemTracker` is not used).

What is measured (all in bytes, storages counted once):

* weights / adapter weights / gradients / optimizer states: read off the model and the optimizer after the
  last step's backward and optimizer step;
* saved activations (non-checkpointed): unique storages that autograd saved during the last forward,
  parameters excluded, through `torch.autograd.graph.saved_tensors_hooks` (exactly what the GPU bench does);
* saved activations (checkpointed, `grad_checkpointing="full"`): non-reentrant checkpointing installs its
  own `saved_tensors_hooks`, which hide what is saved inside each checkpointed layer from an outer hook, so
  here it is (live bytes right after the forward) - (live bytes right before it): what the checkpoint
  frames keep (each layer's input) plus what the non-checkpointed parts (embedding, final norm, lm_head,
  loss) save, plus the loss scalar;
* phase peaks: the highest live-bytes total seen during the last step's forward, backward and optimizer
  step (`opt.step()` + `opt.zero_grad(set_to_none=True)` + dropping the loss), for the steady state
  (the optimizer state exists from the second step on).

Fidelity notes. Fake tensors live on a fake *CPU* device (this torch build has no CUDA, and fake CUDA
needs it), so the numbers are exact tensor bytes without the CUDA caching allocator's 512-byte rounding,
fragmentation or reserved-but-free memory, without the CUDA context, and without cuBLAS / flash-attention
workspaces. SDPA picks the CPU flash kernel (which saves the output and the fp32 logsumexp, like the CUDA
flash kernel). AdamW runs with `foreach=True`, the implementation PyTorch picks by default for CUDA
tensors (on CPU it would default to the per-parameter loop, whose temporaries are smaller).

Checked against the H200 bench (bench/results/hf_recipe, the 37 bf16 LoRA cases, 5 architectures, both
attention implementations, with and without checkpointing): the saved-tensor bytes agree to the byte
(+-512 B), and the forward / backward / optimizer peaks measured from the step's start agree within 1 MiB in
32 cases (the others: 5-43 MiB, foreach-AdamW temporaries of very large adapters and two short-sequence
cases); absolute peaks come out 64-67 MiB (0.1-0.6 %) lower, the bench's non-tensor allocations.

Two library quirks are worked around for the duration of a fake run (so a run is not thread-safe): PEFT's
`.to()` of each new LoRA layer fails on fake parameters (`torch.utils.swap_tensors` refuses the weakref that
FakeTensorMode's memo puts on them), and transformers treats fake position ids as "tracing" and would build
a packed-sequence attention mask that the real run never builds. See `_fake_swap_fix` and
`_no_packed_sequence_detection`; with both, the fake run matches the same run on real tensors byte for byte
(tests/test_trace_engine.py).

`import fitune.trace` does not import torch: torch, transformers and peft are imported inside functions.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

from fitune.trace.tracker import make_tracker

METHODS = ("lora", "full", "freeze", "qlora")
ATTN_IMPLEMENTATIONS = ("sdpa", "eager")
DTYPES = ("bf16", "fp16", "fp32")
GRAD_CHECKPOINTING = ("none", "full")
OPTIMIZERS = ("adamw",)


class TraceUnsupportedError(NotImplementedError):
    """The trace engine cannot run this case (use the analytic engine instead)."""


@dataclass(frozen=True)
class TraceResult:
    """What one traced HF-recipe run measured (bytes; each storage counted once)."""

    weights_bytes: int  # frozen (non-trainable) parameters and buffers
    adapter_weights_bytes: int  # trainable parameters (LoRA A/B for lora; everything for full)
    gradients_bytes: int  # .grad of trainable parameters after backward
    optimizer_states_bytes: int  # AdamW state (exp_avg, exp_avg_sq, step) after opt.step()
    saved_activations_bytes: int  # see the module docstring (hooks; live-bytes difference when checkpointed)
    forward_peak_bytes: int  # peak of live tensor bytes during the last forward (all categories)
    backward_peak_bytes: int  # peak during the last backward
    optimizer_peak_bytes: int  # peak during the last optimizer step (+ zero_grad)
    peak_bytes: int  # max over the three (steady state: the last step)
    by_category: dict[str, int]  # live bytes per category at `peak_bytes`
    notes: tuple[str, ...]
    # Extras (not needed by the estimate, useful to explain it):
    step_start_bytes: int = 0  # live bytes when the last step starts (weights, adapter, optimizer state, ids)
    after_forward_bytes: int = 0  # live bytes right after the last forward
    saved_hooks_bytes: int = 0  # what an outer saved_tensors_hooks saw (checkpointed: only outside the layers)
    trainable_params: int = 0
    frozen_params: int = 0
    peak_phase: str = ""  # "forward" | "backward" | "optimizer"
    phase_peaks_by_category: dict[str, dict[str, int]] = field(default_factory=dict)
    elapsed_s: float = 0.0


def trace_training_step(
    hf_config: dict,
    *,
    method: str = "lora",
    lora_rank: int = 8,
    lora_targets: list[str] | str = ("q_proj", "v_proj"),
    batch_size: int = 1,
    seq_len_tokens: int = 512,
    grad_checkpointing: str = "none",
    attn: str = "sdpa",
    dtype: str = "bf16",
    optimizer: str = "adamw",
    steps: int = 2,
) -> TraceResult:
    """Run `steps` HF-recipe training steps on fake tensors (CPU, no weights, no real memory) and measure.

    `hf_config` is a config.json dict (it needs `model_type`). `method`: "lora" (PEFT LoRA exactly as
    `hf_recipe.wrap_lora`: lora_alpha=16, dropout 0, adapter in fp32) or "full" (every parameter trains, in
    `dtype`). "qlora" (needs bitsandbytes on CUDA) and "freeze" raise `TraceUnsupportedError`: use the
    analytic engine for them. `grad_checkpointing`: "none" or "full" (non-reentrant, as the recipe).
    Phase peaks and `by_category` describe the last step. See the module docstring for what each
    number means.
    """
    return _trace(
        hf_config,
        method=method,
        lora_rank=lora_rank,
        lora_targets=lora_targets,
        batch_size=batch_size,
        seq_len_tokens=seq_len_tokens,
        grad_checkpointing=grad_checkpointing,
        attn=attn,
        dtype=dtype,
        optimizer=optimizer,
        steps=steps,
        fake=True,
    )


def _validate(method, lora_rank, lora_targets, batch_size, seq_len_tokens, grad_checkpointing, attn, dtype,
              optimizer, steps, hf_config) -> None:
    if method == "qlora":
        raise TraceUnsupportedError(
            "the trace engine cannot run method='qlora': QLoRA's NF4 layers need bitsandbytes with CUDA, and "
            "this engine runs on fake CPU tensors; use the analytic engine (--engine analytic) for QLoRA"
        )
    if method == "freeze":
        raise TraceUnsupportedError(
            "the trace engine does not model method='freeze' (partial freezing of the base model); "
            "use the analytic engine (--engine analytic)"
        )
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; the trace engine knows 'lora' and 'full'")
    if attn not in ATTN_IMPLEMENTATIONS:
        raise ValueError(
            f"unknown attention implementation {attn!r} for the trace engine; choose one of "
            f"{', '.join(ATTN_IMPLEMENTATIONS)} (flash-attention kernels need CUDA; use the analytic engine)"
        )
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    if grad_checkpointing not in GRAD_CHECKPOINTING:
        raise ValueError(
            f"unknown grad_checkpointing {grad_checkpointing!r}; the trace engine knows "
            f"{', '.join(GRAD_CHECKPOINTING)}"
        )
    if optimizer not in OPTIMIZERS:
        raise TraceUnsupportedError(
            f"the trace engine only runs torch.optim.AdamW (optimizer='adamw'), not {optimizer!r}; "
            "use the analytic engine"
        )
    if method == "lora" and (not isinstance(lora_rank, int) or lora_rank < 1):
        raise ValueError(f"lora_rank must be a positive integer, got {lora_rank!r}")
    if method == "lora" and not lora_targets:
        raise ValueError("lora_targets is empty")
    if batch_size < 1 or seq_len_tokens < 1 or steps < 1:
        raise ValueError("batch_size, seq_len_tokens and steps must be >= 1")
    if not isinstance(hf_config, dict) or "model_type" not in hf_config:
        raise ValueError("hf_config must be a config.json dict with a 'model_type'")


def _trace(
    hf_config: dict,
    *,
    method: str,
    lora_rank: int,
    lora_targets,
    batch_size: int,
    seq_len_tokens: int,
    grad_checkpointing: str,
    attn: str,
    dtype: str,
    optimizer: str,
    steps: int,
    fake: bool = True,
    seed: int = 0,
) -> TraceResult:
    """The engine. `fake=False` runs the very same code on real CPU tensors (for the tests, tiny models only)."""
    _validate(method, lora_rank, lora_targets, batch_size, seq_len_tokens, grad_checkpointing, attn, dtype,
              optimizer, steps, hf_config)
    import torch

    from fitune.profile.hf_recipe import build_random_model, enable_checkpointing, wrap_lora

    t0 = time.perf_counter()
    notes: list[str] = []
    if isinstance(lora_targets, tuple):
        lora_targets = list(lora_targets)

    ctx = contextlib.ExitStack()
    ctx.enter_context(torch.random.fork_rng(devices=[]))  # leave the caller's RNG state alone
    if fake:
        from torch._subclasses.fake_tensor import FakeTensorMode

        mode = FakeTensorMode()
        ctx.enter_context(mode)
        ctx.enter_context(_fake_swap_fix(mode))
        ctx.enter_context(_no_packed_sequence_detection())

    with ctx:
        torch.manual_seed(seed)
        model = build_random_model(hf_config, attn=attn, device="cpu", dtype_name=dtype)
        if method == "lora":
            model = wrap_lora(model, lora_rank, lora_targets)
        else:  # full
            for p in model.parameters():
                p.requires_grad_(True)
        if grad_checkpointing == "full":
            enable_checkpointing(model)
        model.train()
        trainable = [p for p in model.parameters() if p.requires_grad]
        if not trainable:
            raise ValueError(f"no trainable parameters (lora_targets={lora_targets!r} matched nothing?)")
        opt = torch.optim.AdamW(trainable, lr=1e-4, foreach=True)
        vocab = int(hf_config["vocab_size"])
        ids = torch.randint(0, vocab, (batch_size, seq_len_tokens))

        param_storage_ids = _storage_keys(model.parameters(), fake)
        tracker = make_tracker()
        tracker.track(model.parameters(), "params")
        tracker.track(model.buffers(), "buffers")
        tracker.track([ids], "inputs")
        # a gradient is a temporary of the backward until it is accumulated into .grad
        handles = [
            p.register_post_accumulate_grad_hook(lambda p: tracker.retag([p.grad], "grads")) for p in trainable
        ]

        phases: dict[str, tuple[int, dict[str, int]]] = {}
        saved_hooks_bytes = 0
        start_bytes = after_fwd_bytes = 0
        grads_bytes = 0
        with tracker:
            for step in range(steps):
                last = step == steps - 1
                start_bytes = tracker.total

                tracker.start_phase("activations")
                if last:
                    seen: dict[Any, int] = {}
                    keep: list = []
                    with torch.autograd.graph.saved_tensors_hooks(_make_pack(seen, keep, fake), _unpack):
                        loss = model(input_ids=ids, labels=ids).loss
                    saved_hooks_bytes = sum(n for k, n in seen.items() if k not in param_storage_ids)
                    seen.clear()
                    keep.clear()  # holding them longer would keep them alive past the backward
                else:
                    loss = model(input_ids=ids, labels=ids).loss
                fwd = tracker.end_phase()
                after_fwd_bytes = tracker.total

                tracker.start_phase("temporaries")
                loss.backward()
                bwd = tracker.end_phase()
                if last:
                    grads_bytes = _unique_bytes((p.grad for p in trainable if p.grad is not None), fake)

                tracker.start_phase("temporaries")
                opt.step()
                tracker.retag(_optimizer_tensors(opt), "optimizer")
                opt.zero_grad(set_to_none=True)
                del loss
                optp = tracker.end_phase()
                if last:
                    phases = {"forward": fwd, "backward": bwd, "optimizer": optp}
        for h in handles:
            h.remove()

        frozen = [p for p in model.parameters() if not p.requires_grad]
        weights_bytes = _unique_bytes(list(frozen) + list(model.buffers()), fake)
        adapter_bytes = _unique_bytes(trainable, fake)
        opt_bytes = _unique_bytes(_optimizer_tensors(opt), fake)
        trainable_params = sum(p.numel() for p in trainable)
        frozen_params = sum(p.numel() for p in _unique_tensors(frozen, fake))

    if grad_checkpointing == "full":
        saved = after_fwd_bytes - start_bytes
        notes.append(
            "checkpointed: saved_activations_bytes = live bytes after the forward - live bytes before it "
            f"(an outer saved_tensors_hooks sees only {saved_hooks_bytes} bytes outside the checkpointed layers)"
        )
    else:
        saved = saved_hooks_bytes
        diff = after_fwd_bytes - start_bytes
        notes.append(f"live bytes after the forward - before it: {diff} (saved tensors + loss)")

    peak_phase = max(phases, key=lambda k: phases[k][0])
    peak_bytes, by_category = phases[peak_phase]
    notes.append(
        "tensor bytes only (fake CPU tensors): add the CUDA context, library workspaces (the H200 bench holds "
        "64 MiB more allocated than the tensors from the first step on, cuBLAS workspaces most likely) and the "
        "caching allocator's rounding, fragmentation and reserved-but-free memory"
    )
    notes.append("AdamW runs with foreach=True (the CUDA default); the 'step' state is counted in optimizer state")
    return TraceResult(
        weights_bytes=weights_bytes,
        adapter_weights_bytes=adapter_bytes,
        gradients_bytes=grads_bytes,
        optimizer_states_bytes=opt_bytes,
        saved_activations_bytes=saved,
        forward_peak_bytes=phases["forward"][0],
        backward_peak_bytes=phases["backward"][0],
        optimizer_peak_bytes=phases["optimizer"][0],
        peak_bytes=peak_bytes,
        by_category=by_category,
        notes=tuple(notes),
        step_start_bytes=start_bytes,
        after_forward_bytes=after_fwd_bytes,
        saved_hooks_bytes=saved_hooks_bytes,
        trainable_params=trainable_params,
        frozen_params=frozen_params,
        peak_phase=peak_phase,
        phase_peaks_by_category={k: v[1] for k, v in phases.items()},
        elapsed_s=time.perf_counter() - t0,
    )


# --------------------------------------------------------------------------------------------- helpers


def _optimizer_tensors(opt) -> list:
    import torch

    return [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]


def _storage_key(t, fake: bool):
    """A key that identifies `t`'s storage: the data pointer for real tensors, the storage object's id for fake
    ones (fake storages have no data; PyTorch keeps one Python object per live storage)."""
    st = t.untyped_storage()
    return id(st) if fake else st.data_ptr()


def _unique_tensors(tensors, fake: bool):
    seen = set()
    out = []
    for t in tensors:
        k = _storage_key(t, fake)
        if k not in seen:
            seen.add(k)
            out.append(t)
    return out


def _unique_bytes(tensors, fake: bool) -> int:
    """Bytes of the distinct storages behind `tensors` (views and tied weights counted once)."""
    seen: dict[Any, int] = {}
    keep = []  # keep the storages alive while counting so that ids are not reused
    for t in tensors:
        st = t.untyped_storage()
        keep.append(st)
        seen[id(st) if fake else st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def _storage_keys(tensors, fake: bool) -> set:
    return {_storage_key(t, fake) for t in tensors}


@contextlib.contextmanager
def _no_packed_sequence_detection():
    """Answer transformers' packed-sequence question the way a real run of the recipe does: "not packed".

    Without a KV cache (training with checkpointing sets `use_cache=False`) and without an attention mask,
    `masking_utils.find_packed_sequence_indices(position_ids)` asks the data `(mask[:, -1] == 0).all()`; a real
    run answers "one sequence per row" (position ids are 0..S-1) and lets SDPA use `is_causal` without a mask.
    On fake tensors transformers treats the check as tracing and returns a packed-sequence mask, which would
    materialise a [B, 1, S, S] mask and, for GQA models, `repeat_kv` copies of K and V that the real run never
    makes. The recipe never packs sequences, so answer None here, as the real run does.
    """
    try:
        from transformers import masking_utils
    except ImportError:  # pragma: no cover - older transformers: nothing to patch
        yield
        return
    orig = getattr(masking_utils, "find_packed_sequence_indices", None)
    if orig is None:  # pragma: no cover
        yield
        return
    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = orig


def _make_pack(seen: dict, keep: list, fake: bool):
    """A pack hook that records {storage key: nbytes} of every saved tensor into `seen`."""

    def pack(t):
        try:
            st = t.untyped_storage()
        except Exception:  # noqa: BLE001 - sparse or exotic tensors have no storage: counting is best effort
            return t
        if fake:
            keep.append(st)  # ids stay unique during the forward (saved tensors are alive then anyway)
            seen[id(st)] = st.nbytes()
        else:
            seen[st.data_ptr()] = st.nbytes()
        return t

    return pack


def _unpack(t):
    return t


@contextlib.contextmanager
def _fake_swap_fix(mode):
    """Let `nn.Module.to()` work on fake parameters (PEFT moves each new LoRA layer with `.to(device, dtype)`).

    `Module._apply` always swaps FakeTensor parameters with `torch.utils.swap_tensors`, which refuses tensors
    that carry a weakref, and `FakeTensorConverter.from_meta_and_device` memoises every fresh fake tensor in
    a `WeakValueDictionary` (pytorch#178584, pytorch#196558). Dropping the two tensors from that memo before
    the swap is harmless: the memo is a cache keyed by dead meta tensors.
    """
    import torch.utils

    orig = torch.utils.swap_tensors
    memo = mode.fake_tensor_converter.meta_converter.tensor_memo

    def swap_tensors(t1, t2):
        import weakref

        if weakref.getweakrefcount(t1) or weakref.getweakrefcount(t2):
            for key in [k for k, v in list(memo.items()) if v is t1 or v is t2]:
                memo.pop(key, None)
        return orig(t1, t2)

    torch.utils.swap_tensors = swap_tensors
    try:
        yield
    finally:
        torch.utils.swap_tensors = orig

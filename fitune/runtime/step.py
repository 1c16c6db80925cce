"""The one training step: forward, backward over the micro-batches, then the optimizer. `fitune train`, `fitune
profile` (both stacks) and the GPU benchmarks all run `train_step`; they differ only in what they pass:

    train      micro-batches of fitune.data batches, num_items = the step's trained tokens, fp16 scaler, clipping
    profile    one token tensor; `recipe=True` for `--stack hf`; `phase=` measures forward / backward / optimizer
    bench      token tensors split into micro-batches; bench/hf_recipe.py records CUDA counters per phase

    for each micro-batch:  forward -> loss   (the whole step's normalisation, see `train_step`)
                           backward          (gradients accumulate in .grad)
    [unscale] [clip] optimizer step, zero_grad(set_to_none)

Imports torch at import; callers import this module where they need it.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Sequence

import torch

from ..errors import FituneError
from .techniques.offload_embeddings import compute_device

TRAINED_ROWS_ENV = "FITUNE_TRAINED_ROWS"
"""Set to 0, the chunked loss runs the head over every position, the trained or not (the path before the head ran
only at the trained positions; kept to measure that change against: bench/results/issue32/trained_rows)."""

PhaseHook = Callable[[str], ContextManager]
"""`phase(name)` returns a context manager entered around each phase: "forward", "backward", "optimizer"."""


@dataclass
class StepStats:
    """What one optimizer step reports."""

    loss: float
    """The step's loss: with `num_items`, the summed token loss / the step's trained tokens; without, the mean of
    the micro-batches' mean token losses."""
    micro_batches: int
    loss_scale_before: float | None = None
    """fp16: the GradScaler's scale before the step (None without a scaler)."""
    loss_scale: float | None = None
    """fp16: the scale after the step; lower than before when the gradients overflowed (the step was skipped)."""

    @property
    def overflowed(self) -> bool:
        return self.loss_scale is not None and self.loss_scale < self.loss_scale_before


def forward_loss(model, batch: Any, *, loss: str = "hf", num_items: int | None = None, recipe: bool = False,
                 return_output: bool = False):
    """The loss tensor of one micro-batch.

    Args:
        batch: a (batch, seq) token tensor (labels = inputs), or an object with `input_ids`, `labels` and optional
            `attention_mask` / `position_ids` tensors (fitune.data's batches).
        loss: "hf" (transformers' loss over the full logits) or "chunked" (fitune's chunked loss: the logits of
            the whole sequence never exist).
        num_items: divide the summed token losses by this (transformers' `num_items_in_batch`); None: the mean.
        recipe: the HF recipe's call as users write it: `model(input_ids=ids, labels=ids).loss` (the config's
            KV-cache default, transformers' mean loss); `loss` and `num_items` are not used.
        return_output: with `recipe`, return the model's whole output (its `.loss`, and the logits it holds).
    """
    if isinstance(batch, torch.Tensor):
        input_ids = labels = batch
        extra = {}
    else:
        input_ids, labels = batch.input_ids, batch.labels
        extra = {k: getattr(batch, k, None) for k in ("attention_mask", "position_ids")}
        extra = {k: v for k, v in extra.items() if v is not None}
    if recipe:
        out = model(input_ids=input_ids, labels=labels, **extra)
        return out if return_output else out.loss
    device = compute_device(model)  # not the first parameter's: an offloaded embedding table is on the CPU
    # use_cache=False: no KV cache in training, and transformers builds the packed-sequence mask (examples kept
    # apart by their restarting position_ids) only when no cache is passed
    kwargs = {"use_cache": False, **{k: to_device(v, device) for k, v in without_default_inputs(extra).items()}}
    if "position_ids" in kwargs:  # packed rows: their segment bounds, once per batch, for the varlen kernel
        kwargs.update(_varlen_kernel_inputs(model, extra["position_ids"], input_ids.shape[0], device))
    if loss == "chunked" and labels.device.type == "cpu" and os.environ.get(TRAINED_ROWS_ENV) != "0":
        # the head runs only where a label is trained
        from .techniques.chunked_loss import trained_rows

        kwargs["rows"] = to_device(trained_rows(labels), device)  # from the CPU labels: no host sync
    input_ids, labels = to_device(input_ids, device), to_device(labels, device)
    num = to_device(torch.tensor(num_items), device) if num_items is not None else None
    if loss == "chunked":  # never materialise the whole sequence's logits
        from .techniques.chunked_loss import causal_lm_chunked_loss

        return causal_lm_chunked_loss(model, input_ids, labels, num_items=num, **kwargs)
    if num is not None:
        kwargs["num_items_in_batch"] = num
    return model(input_ids=input_ids, labels=labels, **kwargs).loss


def _varlen_kernel_inputs(model, position_ids: torch.Tensor, rows: int, device) -> dict:
    """fitune's varlen attention (packing_attention: varlen): the packed rows' segment bounds, computed from the
    batch's CPU position ids (no host sync) outside the model, so the compiled layers receive them as an input
    (techniques/varlen_attention.py `varlen_inputs`); {} for any other attention."""
    from .techniques.varlen_attention import varlen_inputs

    packed = varlen_inputs(model, position_ids, rows, device)
    if packed:
        cu = to_device(packed["cu_seq_lens_q"], device)  # one copy for queries and keys (self-attention)
        packed.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu)
    return packed


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """`t` on `device` without making the CPU wait: a CPU tensor is copied to a CUDA device from pinned memory,
    non-blocking. A copy from pageable memory returns only once the GPU has run everything queued before it, so
    the CPU would then launch the micro-batch's first kernels with the GPU idle (measured on the seeds' workload:
    2.3 to 4.6 ms of idle GPU at each micro-batch's start, bench/results/speed/trace_seeds_before.json.gz)."""
    if t.device.type == "cpu" and torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def without_default_inputs(inputs: dict) -> dict:
    """The batch's `attention_mask` / `position_ids` less what transformers would only test on the GPU and then
    ignore: a mask of ones (masking_utils' `_ignore_causal_mask_sdpa` then runs causal attention without a mask)
    and position ids 0, 1, ... on every row (what the model computes when none are given). Tested here on the CPU
    copy, it costs no host sync; a packed batch's restarting positions, or a mask with padding, are kept."""
    out = dict(inputs)
    mask, pos = out.get("attention_mask"), out.get("position_ids")
    if isinstance(mask, torch.Tensor) and mask.device.type == "cpu" and mask.dim() == 2 and bool(mask.all()):
        del out["attention_mask"]
        mask = None
    if (mask is None and isinstance(pos, torch.Tensor) and pos.device.type == "cpu" and pos.dim() == 2
            and torch.equal(pos, torch.arange(pos.shape[1]).expand_as(pos))):
        del out["position_ids"]
    return out


def train_step(model, optimizer, micro_batches: Sequence[Any], *, loss: str = "hf", recipe: bool = False,
               num_items: int | None = None, scaler=None, max_grad_norm: float | None = None,
               phase: PhaseHook | None = None, before_micro_batch: Callable[[int], None] | None = None,
               keep_outputs: bool = False, check_gradients: bool = False) -> StepStats:
    """One optimizer step over `micro_batches` (gradient accumulation when there are several).

    Args:
        micro_batches: what `forward_loss` takes, one per forward / backward.
        num_items: the step's trained-token count: each micro-batch's loss is its summed token loss / num_items,
            so the gradient does not depend on how the step's data is split into micro-batches. None: each
            micro-batch's mean loss, divided by the number of micro-batches.
        loss: see `forward_loss`.
        recipe: the HF recipe as users write it: `forward_loss(recipe=True)`, and the last micro-batch's loss stays
            referenced until the optimizer step is done (a script's `loss` variable does).
        scaler: a torch.amp.GradScaler (fp16): the loss is scaled, the gradients unscaled before clipping.
        max_grad_norm: clip the trainable parameters' gradient norm to this (None or 0: no clipping).
        phase: measures the phases (see `PhaseHook`).
        before_micro_batch: called with the micro-batch's index before its forward (tests inject faults here).
        keep_outputs: with `recipe`, the loop people write: `out = model(**batch); out.loss.backward()` - the whole
            output (its bf16 logits) stays referenced through backward and the optimizer step.
        check_gradients: before the optimizer step, make sure some trainable parameter got a non-zero gradient
            (`require_gradients`; one host sync: `fitune train` checks its first step).
    Raises:
        whatever the model raises (an out-of-memory error included: `fitune.runtime.oom.is_oom` tells it; the
        caller frees the step: `optimizer.zero_grad(set_to_none=True)`).
    """
    phase = phase or _no_phase
    n = len(micro_batches)
    total = None  # the step's loss, summed on the device: read once, after the optimizer step is queued
    users_loss = users_out = None
    for i, mb in enumerate(micro_batches):
        if before_micro_batch is not None:
            before_micro_batch(i)
        with phase("forward"):
            if recipe and keep_outputs:
                users_out = forward_loss(model, mb, recipe=True, return_output=True)
                loss_t = users_out.loss
            else:
                loss_t = forward_loss(model, mb, loss=loss, num_items=num_items, recipe=recipe)
            if num_items is None and n > 1:
                loss_t = loss_t / n  # the step's loss is the mean over its micro-batches
        with phase("backward"):
            (scaler.scale(loss_t) if scaler is not None else loss_t).backward()
        total = loss_t.detach() if total is None else total + loss_t.detach()  # no host sync between micro-batches
        if recipe:  # a user's `loss` variable lives on through opt.step(), and so does what its graph still holds
            users_loss = loss_t  # (with checkpointing 2 x hidden x tokens; measured: bench/results/hf_recipe)
        del loss_t  # fitune frees the graph's last references before the next micro-batch and the optimizer step
    if check_gradients and num_items != 0:  # a step with no trained token has nothing to learn from anyway
        require_gradients(model)
    with phase("optimizer"):
        if scaler is not None:
            scaler.unscale_(optimizer)  # clipping sees the true gradients
        if max_grad_norm:
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], max_grad_norm)
        scale_before = scale_after = None
        if scaler is not None:
            scale_before = scaler.get_scale()
            scaler.step(optimizer)  # skipped when the gradients hold inf / nan
            scaler.update()
            scale_after = scaler.get_scale()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)  # the gradients' memory goes back before the next forward
        del users_loss, users_out
    return StepStats(loss=total.item() if total is not None else 0.0, micro_batches=n, loss_scale_before=scale_before,
                     loss_scale=scale_after)


def require_gradients(model) -> None:
    """Raise `FituneError` when every trainable parameter's gradient is zero after backward.

    A step like that trains nothing while its loss looks normal. It happened: compiled layers on CUDA (torch 2.11)
    with an earlier lean LoRA branch gave every LoRA gradient as zero (bench/results/speed/zero_grads/). LoRA's B
    starts at zero, so at the first step A's gradients are zero by design, but B's are not. One `amax` and one
    `amin` per parameter (no tensor of a gradient's size is made), read back once. Each process checks its own
    gradients (a sharded one, its shard)."""
    grads = [p.grad for p in model.parameters() if p.requires_grad and p.grad is not None]
    grads = [g.to_local() if hasattr(g, "to_local") else g for g in grads]  # FSDP2's DTensor: this rank's shard
    grads = [g for g in grads if g.numel()]
    if not grads:  # none to read: an engine such as DeepSpeed's ZeRO keeps the gradients in its own buffers
        return
    if bool(torch.stack([torch.stack([g.amax(), g.amin()]).ne(0).any() for g in grads]).any()):
        return
    raise FituneError(
        "the step's backward gave every trainable parameter a zero gradient, although it "
        "had tokens to train on: nothing would learn. Run it again with `compile: none` (compiled layers are the "
        "case seen so far) and, if it persists, check that the model's trainable parameters are used in its "
        "forward; please report it with the config")


@contextlib.contextmanager
def _no_phase(name: str):
    yield


def count_saved_tensors():
    """`(ctx, seen)`: inside `ctx`, the unique storages autograd saves are recorded in `seen` ({data_ptr: bytes},
    parameters included: subtract theirs). For measuring a forward (bench/hf_recipe.py, the trace engine's
    tests)."""
    seen: dict[int, int] = {}

    def pack(t):
        try:
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
        except Exception:  # noqa: BLE001 - sparse or exotic tensors: skip, counting is best effort
            pass
        return t

    ctx = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
    return ctx, seen

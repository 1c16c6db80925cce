"""Chunked linear + cross-entropy: the loss of `hidden @ lm_head.T` without ever holding all the logits.

transformers' loss materialises the logits of every token, upcasts them to fp32 and keeps the fp32 log-probs for
backward: 12 bytes x vocabulary per token at the start of backward (5.87 GiB for Llama-3.1-8B at 2 x 2048 tokens,
measured: bench/results/profile/seeds_ckpt_uncapped.json). Here the tokens are processed `chunk_tokens` at a
time; for each chunk the logits are computed, turned into the loss and, in the same pass, into the gradient with
respect to the hidden states (softmax - one-hot, the gradient of cross-entropy), and then dropped. Backward only
scales the stored gradient. Memory: one chunk's logits plus the hidden states' gradient; compute: the same
matmuls as the plain path (the technique of Liger Kernel's fused linear cross-entropy, written in PyTorch).

Only the trained positions: the positions whose label is -100 (a prompt, padding, the last token of each row)
add nothing to the loss or to any gradient, so when the labels are still on the CPU (`trained_rows`, as
`fitune train` passes them: no host sync) only the trained positions' hidden states go through the head, a chunk
at a time; the others' hidden-state gradient is zero. On chat data where 30 % of the tokens are prompts that is 30 %
of the head's matmuls and of the softmax passes saved: +0.9 % on the step, measured (bench/results/issue32/
trained_rows).

Exact: the same loss and gradients as `cross_entropy(lm_head(h).float(), labels, reduction="sum") / num_items`
up to float rounding (tests/test_chunked_loss.py compares forward and backward with the plain computation).

Compiled (with `compile: layers`, see `use_compiled_loss`): what runs between a chunk's two matmuls (upcast,
max, exp, sum, the softmax minus the one-hot label, the scaling, the cast back) is one `torch.compile`d function,
so Inductor fuses it into a few passes over the model-dtype logits instead of a dozen passes over an fp32 copy,
and the fp32 copy never exists. Measured alone on the seeds' lm_head (bench/loss_kernels.py,
bench/results/speed/loss_kernels.jsonl).
"""

from __future__ import annotations

import torch

IGNORE_INDEX = -100
CHUNK_TOKENS = 1024  # fitune.memory.loss.CHUNK_TOKENS models the same chunk
COMPILED_FLAG = "_fitune_compiled_loss"
"""The attribute `use_compiled_loss` sets on the base model: `causal_lm_chunked_loss` then runs the compiled chunk."""


def chunk_loss_and_grad(logits: torch.Tensor, labels: torch.Tensor, num_items: torch.Tensor,
                        softcap: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk's summed token loss (fp32) and the loss's gradient with respect to its logits (in the logits'
    dtype): the eager loop's arithmetic in the same order, written without in-place updates or indexing so that
    `torch.compile` fuses it (`_compiled_chunk`)."""
    x = logits.float()
    if softcap:
        t = torch.tanh(x / softcap)
        x = t * softcap
    valid = labels != IGNORE_INDEX
    safe = torch.where(valid, labels, torch.zeros_like(labels))
    peak = x.amax(dim=-1, keepdim=True)
    e = torch.exp(x - peak)
    sums = e.sum(dim=-1, keepdim=True)
    lse = (sums.log() + peak).squeeze(1)
    picked = x.gather(1, safe[:, None]).squeeze(1)
    loss = ((lse - picked) * valid).sum()
    one_hot = torch.arange(x.shape[1], device=x.device)[None, :] == safe[:, None]
    grad = (e / sums - one_hot.to(x.dtype)) * valid[:, None].to(x.dtype)
    if softcap:
        grad = grad * (1 - t * t)  # d(cap * tanh(x / cap)) / dx
    return loss, (grad / num_items).to(logits.dtype)


_COMPILED_CHUNK = None


def _compiled_chunk():
    global _COMPILED_CHUNK
    if _COMPILED_CHUNK is None:  # dynamic=None: a second chunk length (the last, shorter chunk) compiles dynamic once
        _COMPILED_CHUNK = torch.compile(chunk_loss_and_grad, dynamic=None)
    return _COMPILED_CHUNK


def _base_model(model):
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def use_compiled_loss(model, on: bool = True) -> None:
    """Make `causal_lm_chunked_loss` on `model` (PEFT-wrapped or not) run each chunk's softmax gradient compiled
    (`compile: layers` turns it on with the compiled decoder layers; `compile: none` leaves it eager)."""
    setattr(_base_model(model), COMPILED_FLAG, bool(on))


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, num_items, chunk_tokens, softcap, compiled=False, rows=None):
        n_tokens = hidden.shape[0] if rows is None else rows.shape[0]
        need_h = ctx.needs_input_grad[0]
        need_w = ctx.needs_input_grad[1]
        fused = _compiled_chunk() if compiled and (need_h or need_w) else None
        if need_h:  # with `rows`, the untrained positions' gradient is zero and never written
            grad_hidden = torch.empty_like(hidden) if rows is None else torch.zeros_like(hidden)
        else:
            grad_hidden = None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if need_w else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, n_tokens, chunk_tokens):
            end = min(start + chunk_tokens, n_tokens)
            if rows is None:
                h, y, picked_rows = hidden[start:end], labels[start:end], None
            else:  # the chunk's trained positions, gathered (one chunk of hidden states: `chunk_tokens` x h)
                picked_rows = rows[start:end]
                h, y = hidden.index_select(0, picked_rows), labels.index_select(0, picked_rows)
            if fused is not None:  # one compiled function: the chunk's fp32 logits never exist
                logits = h @ weight.t()
                part, g = fused(logits, y, num_items, softcap)
                del logits
                total += part
                del part
            else:
                logits = (h @ weight.t()).float()  # the model-dtype logits die here: only fp32 stays
                if softcap:
                    t = torch.tanh(logits / softcap)
                    logits = t * softcap
                valid = y != IGNORE_INDEX
                safe_y = torch.where(valid, y, torch.zeros_like(y))
                picked = logits.gather(1, safe_y[:, None]).squeeze(1)
                # log-sum-exp and softmax in place: torch.logsumexp would allocate a temporary the size of the chunk
                peak = logits.amax(dim=-1, keepdim=True)
                grad = logits.sub_(peak).exp_()  # exp(z - max), in place of the logits
                del logits  # `grad` is the only name left for the chunk's fp32 block: it goes with `del grad`
                sums = grad.sum(dim=-1, keepdim=True)
                lse = (sums.log() + peak).squeeze(1)
                total += ((lse - picked) * valid).sum()
                del picked, lse, peak
                if not (need_h or need_w):
                    del grad
                    continue
                grad.div_(sums)  # softmax
                grad[torch.arange(end - start, device=grad.device), safe_y] -= valid.to(grad.dtype)
                grad *= valid[:, None].to(grad.dtype)
                if softcap:
                    grad *= 1 - t * t  # d(cap * tanh(x / cap)) / dx
                    del t
                grad /= num_items
                g = grad.to(weight.dtype)
                del grad
            if need_h and picked_rows is None:
                grad_hidden[start:end] = g @ weight
            elif need_h:
                grad_hidden.index_copy_(0, picked_rows, g @ weight)
            if need_w:
                grad_weight += (g.t() @ h).float()
            del g
        ctx.save_for_backward(grad_hidden if need_h else None, grad_weight if need_w else None)
        ctx.weight_dtype = weight.dtype
        return total / num_items

    @staticmethod
    def backward(ctx, grad_output):
        grad_hidden, grad_weight = ctx.saved_tensors
        gh = grad_hidden * grad_output.to(grad_hidden.dtype) if grad_hidden is not None else None
        gw = (grad_weight * grad_output).to(ctx.weight_dtype) if grad_weight is not None else None
        return gh, gw, None, None, None, None, None, None


def shifted_labels(labels: torch.Tensor) -> torch.Tensor:
    """(batch, seq) labels shifted as transformers does (position t predicts labels[t + 1]; the last position of each
    row predicts nothing: -100), flattened."""
    return torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:].reshape(-1)


def trained_rows(labels: torch.Tensor) -> torch.Tensor:
    """The flat positions of a (batch, seq) label tensor whose shifted label is trained (not -100), int64, computed
    on the labels' device: call it on the CPU labels, before they go to the GPU, and it costs no host sync."""
    return torch.nonzero(shifted_labels(labels) != IGNORE_INDEX).squeeze(1)


def chunked_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                                 num_items: int | torch.Tensor | None = None, chunk_tokens: int = CHUNK_TOKENS,
                                 softcap: float | None = None, compiled: bool = False,
                                 rows: torch.Tensor | None = None) -> torch.Tensor:
    """Causal-LM loss of `hidden` (batch, seq, h) through `weight` (vocab, h) against `labels` (batch, seq).

    Labels are shifted as transformers does (position t predicts labels[t + 1]); -100 is ignored. The loss is
    the sum over predicted tokens divided by `num_items` (default: their count), as `ForCausalLMLoss` with
    `num_items_in_batch`. `rows`: `trained_rows(labels)` (on any device): only those positions go through the
    head; None: every position does (the ignored ones add zero).
    """
    flat_h = hidden.reshape(-1, hidden.shape[-1])
    flat_y = shifted_labels(labels).to(hidden.device)
    if num_items is None:
        num_items = rows.shape[0] if rows is not None else int((flat_y != IGNORE_INDEX).sum().item())
    num = torch.as_tensor(num_items, dtype=torch.float32, device=hidden.device).clamp_min(1)
    rows = rows.to(hidden.device) if rows is not None else None
    return _ChunkedLinearCrossEntropy.apply(flat_h, weight, flat_y, num, chunk_tokens, softcap, compiled, rows)


def causal_lm_chunked_loss(model, input_ids, labels, num_items=None, chunk_tokens: int = CHUNK_TOKENS,
                           rows: torch.Tensor | None = None, **inputs):
    """Run a (PEFT-wrapped) transformers causal LM's decoder and take the chunked loss through its lm_head (only at
    `rows`, the labels' `trained_rows`, when given)."""
    base = _base_model(model)
    decoder = base.get_decoder() if hasattr(base, "get_decoder") else base.model
    out = decoder(input_ids=input_ids, **inputs)
    head = base.get_output_embeddings()
    softcap = getattr(base.config, "final_logit_softcapping", None)
    if getattr(head, "bias", None) is not None:
        raise ValueError("the chunked loss supports lm_heads without bias (every catalog model)")
    return chunked_linear_cross_entropy(out.last_hidden_state, head.weight, labels, num_items, chunk_tokens, softcap,
                                        compiled=getattr(base, COMPILED_FLAG, False), rows=rows)

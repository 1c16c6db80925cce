"""The language-model head and the loss on the memory tape.

`hf`: transformers' `ForCausalLMLoss` (transformers/loss/loss_utils.py): `logits = lm_head(h)` in the model
dtype, `logits.float()` (a full fp32 copy: 4 x vocab bytes per token), `cross_entropy` = log_softmax (saves its
fp32 output) + nll_loss. The bf16 logits stay referenced by the model output until `.loss` is taken.
Backward: nll_loss's gradient (fp32, full size), log_softmax's backward (fp32, full size), the cast back to bf16,
lm_head's backward. Measured on llama-3.1-8b at 2x2048 tokens: 3 fp32 logits copies (6,012 MiB) live at the
start of backward (bench/results/hf_recipe/snap_llama-3.1-8b_bf16_0.json.gz, events 3486-3489).
Gemma's final logit soft-capping (`logits / cap; tanh; * cap`) adds bf16 copies; tanh saves its output.

`chunked`: the loss is computed over chunks of tokens (fitune's runner), so at most one chunk's logits exist;
`chunk_tokens` is the chunk length.
"""

from __future__ import annotations

from ..specs.model import ModelSpec
from .autograd import Autograd, Tensor
from .tape import LOGITS

FP32 = 4

#: Tokens per chunk of fitune's chunked loss (fitune.runtime.techniques.chunked_loss uses the same constant).
CHUNK_TOKENS = 1024


def hf_loss(ag: Autograd, model: ModelSpec, h: Tensor, tokens: int, act_bytes: int, lm_head_trainable: bool,
            keep_outputs: bool = False) -> Tensor:
    """lm_head + ForCausalLMLoss. Returns the (scalar) loss tensor; records the backward.

    `keep_outputs`: the script keeps the model output (`out = model(**batch); out.loss.backward()`), so the
    model-dtype logits it holds stay live through backward (`Autograd.hold`; the caller releases them after)."""
    V, w = model.vocab_size, act_bytes
    logits = ag.new(w * V * tokens, True, "logits", LOGITS)
    ag.record(logits, [h], [h] if lm_head_trainable else [], [h.nbytes],
              param_grad_bytes=(w * V * model.hidden_size if lm_head_trainable else 0), label="lm_head")
    keep = logits  # CausalLMOutputWithPast(logits=...) keeps the model-dtype logits until `.loss` is read
    if model.final_logit_softcapping:
        div = ag.new(w * V * tokens, True, "logits/cap", LOGITS)
        ag.record(div, [logits], [], [logits.nbytes])  # DivBackward allocates grad / cap
        ag.drop(logits)  # `logits = logits / cap` rebinds: the lm_head output goes
        th = ag.new(w * V * tokens, True, "tanh(logits)", LOGITS)
        ag.record(th, [div], [th], [div.nbytes], label="softcap-tanh")
        ag.drop(div)
        capped = ag.new(w * V * tokens, True, "logits*cap", LOGITS)
        ag.record(capped, [th], [], [th.nbytes])  # MulBackward allocates grad * cap
        ag.drop(th)
        keep = logits = capped
    if w != FP32:
        l32 = ag.new(FP32 * V * tokens, True, "logits.float()", LOGITS)
        ag.record(l32, [logits], [], [w * V * tokens], label="logits.float")
    else:
        l32 = logits
    logp = ag.new(FP32 * V * tokens, True, "log_softmax", LOGITS)
    ag.record(logp, [l32], [logp], [FP32 * V * tokens], label="log_softmax")
    if l32 is not logits:
        ag.drop(l32)
    loss = ag.new(FP32, True, "loss", LOGITS)
    ag.record(loss, [logp], [], [FP32 * V * tokens], label="nll_loss")
    ag.drop(logp)
    if keep_outputs:
        ag.hold(keep)
    else:
        ag.drop(keep)
    return loss


def chunked_loss(ag: Autograd, model: ModelSpec, h: Tensor, tokens: int, act_bytes: int, chunk_tokens: int = CHUNK_TOKENS,
                 lm_head_trainable: bool = False, compiled: bool = False, grads: bool = True) -> Tensor:
    """fitune's chunked linear + cross-entropy (fitune/runtime/techniques/chunked_loss.py).

    Forward: the gradient with respect to the hidden states is computed along with the loss and kept
    (act_bytes x hidden per token); per chunk of `chunk_tokens` tokens the model-dtype logits, their fp32 copy
    (turned into the softmax gradient in place; Gemma's soft-cap keeps its tanh too), the cast back and the
    chunk's hidden-gradient product exist, then go. Backward: the kept gradient times the upstream scalar.
    Nothing of the size of the whole vocabulary x sequence is ever allocated.

    `lm_head_trainable` (full fine-tuning): the head's gradient is accumulated in fp32 during the forward
    (`torch.zeros_like(weight, dtype=float32)`, 4 x vocab x hidden bytes, kept for backward); each chunk adds
    `(g.t() @ h).float()` (a model-dtype and an fp32 vocab x hidden temporary, after the chunk's fp32 logits are
    freed); backward scales it (an fp32 temporary) and casts it into the parameter's gradient.

    `compiled` (`compile: layers`): each chunk's softmax gradient is one compiled function
    (`chunked_loss.chunk_loss_and_grad`) from the model-dtype logits to a model-dtype gradient: no fp32 chunk, no
    separate cast; the logits go once it has run.

    `grads=False` (an eval forward under `torch.no_grad()`: neither the hidden states nor the head need a gradient,
    `ctx.needs_input_grad` is all False): no kept gradient and no compiled function; per chunk the model-dtype
    logits and their fp32 copy exist at once (`(h @ weight.t()).float()`), then only the loss (measured on the GPU:
    the eval step of bench/results/pretrained_load, 2 x 2048 tokens, was 0.27 GiB over the compiled-chunk model).
    """
    V, w, H = model.vocab_size, act_bytes, model.hidden_size
    n = min(tokens, chunk_tokens)
    if not grads:
        chunk_bf16 = ag.new(w * V * n, False, "chunk logits", LOGITS)
        chunk_fp32 = ag.new(FP32 * V * n, False, "chunk logits fp32", LOGITS)
        ag.drop(chunk_bf16)
        tanh = ag.new(FP32 * V * n, False, "chunk tanh", LOGITS) if model.final_logit_softcapping else None
        ag.drop(chunk_fp32, tanh)
        return ag.new(FP32, False, "loss", LOGITS)
    grad_h = ag.new(w * H * tokens, True, "chunked loss: d loss / d hidden", LOGITS)
    grad_w = ag.new(FP32 * V * H, True, "chunked loss: d loss / d lm_head (fp32)", LOGITS) if lm_head_trainable else None
    chunk_bf16 = ag.new(w * V * n, False, "chunk logits", LOGITS)
    if compiled:
        chunk_fp32 = tanh = None
        cast = ag.new(w * V * n, False, "chunk gradient (compiled)", LOGITS)
        ag.drop(chunk_bf16)  # `del logits` after the compiled function
    else:
        chunk_fp32 = ag.new(FP32 * V * n, False, "chunk logits fp32", LOGITS)
        ag.drop(chunk_bf16)
        tanh = ag.new(FP32 * V * n, False, "chunk tanh", LOGITS) if model.final_logit_softcapping else None
        cast = ag.new(w * V * n, False, "chunk gradient cast", LOGITS)
    if lm_head_trainable and chunk_fp32 is not None:
        ag.drop(chunk_fp32)  # `del grad` once cast: gone before the matmuls
    part = ag.new(w * H * n, False, "chunk d hidden", LOGITS)
    if lm_head_trainable:
        gw_chunk = ag.new(w * V * H, False, "chunk d lm_head", LOGITS)
        gw_chunk32 = ag.new(FP32 * V * H, False, "chunk d lm_head .float()", LOGITS)
        ag.drop(gw_chunk, gw_chunk32)
    ag.drop(None if lm_head_trainable else chunk_fp32, tanh, cast, part)
    loss = ag.new(FP32, True, "loss", LOGITS)
    ag.record(loss, [h], [grad_h] + ([grad_w] if grad_w is not None else []), [h.nbytes],
              extra_bytes=FP32 * V * H if lm_head_trainable else 0,
              param_grad_bytes=w * V * H if lm_head_trainable else 0, label="chunked_loss")
    ag.drop(grad_h, grad_w)
    return loss

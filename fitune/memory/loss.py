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

#: Tokens per chunk of fitune's chunked loss (fitune.train.techniques.chunked_loss uses the same constant).
CHUNK_TOKENS = 1024


def hf_loss(ag: Autograd, model: ModelSpec, h: Tensor, tokens: int, act_bytes: int, lm_head_trainable: bool) -> Tensor:
    """lm_head + ForCausalLMLoss. Returns the (scalar) loss tensor; records the backward."""
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
    ag.drop(keep)
    return loss


def chunked_loss(ag: Autograd, model: ModelSpec, h: Tensor, tokens: int, act_bytes: int, chunk_tokens: int = CHUNK_TOKENS) -> Tensor:
    """Chunked linear + cross-entropy: per chunk, logits (model dtype), their fp32 copy and log-probs exist only
    inside the chunk; the backward recomputes a chunk's logits and frees them before the next chunk.
    Saves nothing per token beyond the hidden state (shared with the final norm's output).
    """
    V, w = model.vocab_size, act_bytes
    n = min(tokens, chunk_tokens)
    chunk = ag.new((w + 2 * FP32) * V * n, False, "chunk logits", LOGITS)
    ag.drop(chunk)
    loss = ag.new(FP32, True, "loss", LOGITS)
    ag.record(loss, [h], [h], [h.nbytes], extra_bytes=(w + 3 * FP32) * V * n, label="chunked_loss")
    return loss

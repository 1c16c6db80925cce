"""The ops of a decoder layer as transformers 5 + PEFT run them, written onto the memory tape.

Each function mirrors one piece of modelling code and says, in its docstring, what it allocates, what
autograd saves and why (the source line). Sizes are bytes for `ctx.tokens` tokens. The measured allocation
traces in bench/results/hf_recipe/snap_*.json.gz show these sequences op by op (llama-3.1-8b, H200).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..specs.model import LinearSpec, ModelSpec
from .autograd import Autograd, Tensor

FP32 = 4


@dataclass(frozen=True)
class LayerContext:
    """What the layer ops need to size tensors."""

    model: ModelSpec
    batch_size: int
    seq_len_tokens: int
    act_bytes: int  # bytes per element of activations (2 for bf16/fp16, 4 for fp32)
    lora_targets: frozenset[str]  # module names wrapped by LoRA (empty for full / freeze)
    lora_rank: int
    qlora: bool
    trainable_base: bool  # full fine-tuning of this layer: base weights train (and save their inputs)
    attn: str  # sdpa | flash | eager
    use_cache: bool  # transformers builds a DynamicCache (no checkpointing): k, v are copied into it
    tiled_mlp_tokens: int = 0  # fitune's tiled MLP: tokens per tile (0: off)
    lean_lora: bool = False  # fitune's lean LoRA branch (fitune/runtime/techniques/lean_lora.py)
    lean_norm_rows: int = 0  # fitune's lean RMSNorm: rows per tile (0: off; fitune/runtime/techniques/lean_norm.py)
    liger: bool = False  # Liger's RMSNorm and SwiGLU kernels (fitune/runtime/techniques/fused_kernels.py)
    compiled: bool = False  # each decoder layer torch.compile'd (fitune/runtime/techniques/compile_layers.py)

    @property
    def tokens(self) -> int:
        return self.batch_size * self.seq_len_tokens


def frozen_or_trainable_linear(ag: Autograd, c: LayerContext, x: Tensor, lin: LinearSpec) -> Tensor:
    """`nn.Linear` (or a bitsandbytes `Linear4bit`) not wrapped by LoRA.

    Forward allocates the output (act_bytes x out x tokens). Autograd saves the input only when the weight
    trains (derivatives.yaml: `mm`'s `mat2` gradient needs `self`); a frozen weight saves nothing per token.
    NF4: bitsandbytes `MatMul4Bit` dequantises the whole weight to bf16 for the matmul, in forward and again in
    backward (bitsandbytes/autograd/_functions.py), a transient of in x out x 2 bytes.
    """
    T, w = c.tokens, c.act_bytes
    deq = ag.new(w * lin.in_features * lin.out_features, False, f"{lin.name}:nf4-dequant") if c.qlora else None
    y = ag.new(w * lin.out_features * T, x.requires_grad or c.trainable_base, lin.name)
    ag.drop(deq)
    param_grad = (lin.in_features * lin.out_features + (lin.out_features if lin.bias else 0)) * w if c.trainable_base else 0
    ag.record(y, [x], [x] if c.trainable_base else [], [w * lin.in_features * T],
              extra_bytes=w * lin.in_features * lin.out_features if c.qlora else 0,
              param_grad_bytes=param_grad, label=lin.name)
    return y


def lora_linear(ag: Autograd, c: LayerContext, x: Tensor, lin: LinearSpec) -> Tensor:
    """A PEFT LoRA `Linear` (peft/tuners/lora/layer.py `Linear.forward`, peft 0.21).

    `result = base_layer(x)`; the adapter weights are fp32 (`autocast_adapter_dtype=True`), so
    `x = self._cast_input_dtype(x, lora_A.weight.dtype)` makes an fp32 copy of the input (4 x in bytes per token),
    one per wrapped module even when q, k and v share x, and lora_A saves it. `result + lora_B(lora_A(x)) *
    scaling` is promoted to fp32 (two fp32 temporaries of `out`) and cast back by `result.to(torch_result_dtype)`.
    QLoRA (peft/tuners/lora/bnb.py `Linear4bit.forward`): the base output is `clone()`d and the adapter output is
    cast to bf16 *before* scaling, so its temporaries are bf16.
    """
    T, w, r = c.tokens, c.act_bytes, c.lora_rank
    n_in, n_out = lin.in_features, lin.out_features
    base = frozen_or_trainable_linear(ag, c, x, lin)
    if c.qlora:
        cloned = ag.new(w * n_out * T, base.requires_grad, f"{lin.name}:clone")
        ag.record_passthrough(cloned, [base], label=f"{lin.name}:clone")
        ag.drop(base)
        base = cloned
    if w != FP32:
        xc = ag.new(FP32 * n_in * T, x.requires_grad, f"{lin.name}:lora-input-fp32")
        ag.record(xc, [x], [], [w * n_in * T], label=f"{lin.name}:cast")
    else:
        xc = x
    a = ag.new(FP32 * r * T, True, f"{lin.name}:lora_A")
    ag.record(a, [xc], [xc], [FP32 * n_in * T], param_grad_bytes=FP32 * r * n_in, label=f"{lin.name}:lora_A")
    if xc is not x:
        ag.drop(xc)
    b = ag.new(FP32 * n_out * T, True, f"{lin.name}:lora_B")
    ag.record(b, [a], [a], [FP32 * r * T], param_grad_bytes=FP32 * r * n_out, label=f"{lin.name}:lora_B")
    ag.drop(a)
    if c.qlora:
        b16 = ag.new(w * n_out * T, True, f"{lin.name}:to-bf16")
        ag.record(b16, [b], [], [FP32 * n_out * T])
        ag.drop(b)
        scaled = ag.new(w * n_out * T, True, f"{lin.name}:scaled")
        ag.record(scaled, [b16], [], [b16.nbytes])  # mul/div by a constant: the gradient is a new tensor
        ag.drop(b16)
        out = ag.new(w * n_out * T, True, f"{lin.name}:out")
        ag.record_passthrough(out, [base, scaled])
        ag.drop(base, scaled)
        return out
    scaled = ag.new(FP32 * n_out * T, True, f"{lin.name}:scaled")
    ag.record(scaled, [b], [], [b.nbytes])  # mul/div by a constant: the gradient is a new tensor
    ag.drop(b)
    summed = ag.new(max(FP32, w) * n_out * T, True, f"{lin.name}:sum")
    ag.record(summed, [base, scaled], [], [w * n_out * T, 0])
    ag.drop(scaled, base)  # `result = result + ...` rebinds: the scaled term goes first, then the old result
    if w != FP32:
        out = ag.new(w * n_out * T, True, f"{lin.name}:out")
        ag.record(out, [summed], [], [FP32 * n_out * T])
        ag.drop(summed)
        return out
    return summed


def lean_lora_linear(ag: Autograd, c: LayerContext, x: Tensor, lin: LinearSpec) -> Tensor:
    """fitune's lean LoRA (fitune/runtime/techniques/lean_lora.py `lora_branch`): `base_layer(x) + branch(x)` in
    the activations' dtype. The branch saves x (held anyway), x A^T (r values per token) and the two matrices it
    multiplies by, cast to the activations' dtype: A (r x n_in) and s B (n_out x r); its backward makes the r-wide
    gradient, then the input's gradient; A and B get fp32 gradients through the casts.
    """
    T, w, r = c.tokens, c.act_bytes, c.lora_rank
    n_in, n_out = lin.in_features, lin.out_features
    base = frozen_or_trainable_linear(ag, c, x, lin)
    a_cast = ag.new(w * r * n_in, True, f"{lin.name}:lora_A_cast")
    sb_cast = ag.new(w * n_out * r, True, f"{lin.name}:lora_sB_cast")
    xa = ag.new(w * r * T, True, f"{lin.name}:lora_xa")
    branch = ag.new(w * n_out * T, True, f"{lin.name}:lora_branch")
    # compiled or not, the branch keeps x for A's gradient and the cast matrices (traced on the CPU:
    # tests/test_compile_layers.py; on CUDA measured with the gradients checked, bench/results/speed/)
    ag.record(branch, [x], [x, xa, a_cast, sb_cast], [w * n_in * T], extra_bytes=w * r * T,
              param_grad_bytes=FP32 * r * (n_in + n_out), label=f"{lin.name}:lora")
    ag.drop(xa, a_cast, sb_cast)
    out = ag.new(w * n_out * T, True, f"{lin.name}:out")
    ag.record_passthrough(out, [base, branch])
    ag.drop(base, branch)
    return out


def linear(ag: Autograd, c: LayerContext, x: Tensor, lin: LinearSpec) -> Tensor:
    if lin.name in c.lora_targets:
        if c.lean_lora:
            return lean_lora_linear(ag, c, x, lin)
        return lora_linear(ag, c, x, lin)
    return frozen_or_trainable_linear(ag, c, x, lin)


def rms_norm(ag: Autograd, c: LayerContext, x: Tensor, width: int, label: str, gemma: bool = False) -> Tensor:
    """`LlamaRMSNorm` / `Gemma2RMSNorm` over `width` features (modeling_llama.py L60-67).

    The input is upcast to fp32 (`hidden_states.to(torch.float32)`); `pow` and `mul` save that fp32 copy and
    the per-row `rsqrt` (4 bytes per row): 4 x width + 4 bytes per token (per head for q/k norms). The frozen
    weight saves nothing per token. Forward temporaries: pow output, the normalised fp32 tensor, its cast.
    Gemma computes `output * (1 + weight)` in fp32 as well, one more fp32 temporary.
    """
    w = c.act_bytes
    rows = x.nbytes // w // width  # one rsqrt per normalised vector (per token, or per head for q/k norms)
    if c.liger and not gemma and label in LIGER_NORMS:
        return liger_rms_norm(ag, c, x, rows, label)
    if c.compiled and not gemma and label in COMPILED_NORMS:
        return compiled_rms_norm(ag, c, x, rows, label)
    if c.lean_norm_rows and not gemma:
        return lean_rms_norm(ag, c, x, width, rows, label)
    x32 = ag.new(FP32 * x.nbytes // w, x.requires_grad, f"{label}:fp32") if w != FP32 else x
    sq = ag.new(FP32 * x.nbytes // w, False, f"{label}:pow")
    ag.drop(sq)
    rs = ag.new(FP32 * rows, x.requires_grad, f"{label}:rsqrt")
    y32 = ag.new(FP32 * x.nbytes // w, x.requires_grad, f"{label}:normed")
    # backward: pow, mean and mul each make an fp32 temporary of the input's size (separate blocks)
    ag.record(y32, [x], [x32, rs] if x.requires_grad else [], [x.nbytes], extra_bytes=(FP32 * x.nbytes // w,) * 3,
              label=label)
    if x32 is not x:
        ag.drop(x32)
    ag.drop(rs)
    if gemma:
        y2 = ag.new(FP32 * x.nbytes // w, y32.requires_grad, f"{label}:scaled")
        ag.record(y2, [y32], [], [y32.nbytes])  # times the frozen (1 + weight): the gradient is a new tensor
        ag.drop(y32)
        y32 = y2
    out = ag.new(x.nbytes, y32.requires_grad, f"{label}:out")
    ag.record(out, [y32], [], [y32.nbytes], label=label)
    ag.drop(y32)
    if not gemma:  # llama: `self.weight * hidden_states.to(input_dtype)`: one more activation-sized tensor
        out2 = ag.new(x.nbytes, out.requires_grad, f"{label}:weighted")
        ag.record(out2, [out], [], [out.nbytes])  # times the frozen weight: the gradient is a new tensor
        ag.drop(out)
        out = out2
    return out


#: The norms Liger's `apply_liger_kernel_to_*(model=...)` replaces (the decoder layers' two and the final one).
LIGER_NORMS = ("input_norm", "post_attn_norm", "final_norm")


def liger_rms_norm(ag: Autograd, c: LayerContext, x: Tensor, rows: int, label: str) -> Tensor:
    """Liger's RMSNorm (liger_kernel/ops/rms_norm.py, 0.8.5): one Triton kernel writes the output and an fp32 rstd
    per row and saves the input; backward writes the input's gradient over the incoming one (`in_place=True`)."""
    rs = ag.new(FP32 * rows, x.requires_grad, f"{label}:rstd")
    out = ag.new(x.nbytes, x.requires_grad, f"{label}:out")
    ag.record_passthrough(out, [x], label=label)
    ag.save_only([x, rs], label)
    ag.drop(rs)
    return out


#: The norms inside a decoder layer (what `compile: layers` compiles; the final norm stays eager).
COMPILED_NORMS = ("input_norm", "post_attn_norm", "q_norm", "k_norm")


def compiled_rms_norm(ag: Autograd, c: LayerContext, x: Tensor, rows: int, label: str) -> Tensor:
    """RMSNorm inside a compiled layer: Inductor fuses the upcast, mean of squares, rsqrt, scaling and cast into
    one kernel writing the bf16 output and an fp32 rstd per row; the partitioner saves the input (held anyway)
    and the rstd, and recomputes the rest in backward, which writes a new input gradient. Traced on the CPU
    (tests/test_compile_layers.py) and measured on the H200 (bench/results/speed/speed.jsonl, group *_compile)."""
    rs = ag.new(FP32 * rows, x.requires_grad, f"{label}:rstd")
    out = ag.new(x.nbytes, x.requires_grad, f"{label}:out")
    ag.record(out, [x], [x, rs], [x.nbytes], label=label)
    ag.drop(rs)
    return out


def lean_rms_norm(ag: Autograd, c: LayerContext, x: Tensor, width: int, rows: int, label: str) -> Tensor:
    """fitune's lean RMSNorm (fitune/runtime/techniques/lean_norm.py): saves the input (held anyway) and one fp32
    rsqrt per row; forward and backward work `lean_norm_rows` rows at a time in fp32. Forward: the output, then
    per tile the fp32 copy, its square, the normalised fp32 tile and two bf16 tiles. Backward: the input's
    gradient, then per tile about five fp32 tiles (n, g, g * w, the mean term, the result before its cast).
    """
    w = c.act_bytes
    tile_rows = min(rows, c.lean_norm_rows)
    tile32 = FP32 * tile_rows * width
    rs = ag.new(FP32 * rows, x.requires_grad, f"{label}:rsqrt")
    out = ag.new(x.nbytes, x.requires_grad, f"{label}:out")
    tmp = [ag.new(tile32, False, f"{label}:tile-fp32") for _ in range(3)]
    tmp += [ag.new(w * tile_rows * width, False, f"{label}:tile") for _ in range(2)]
    ag.drop(*tmp)
    ag.record(out, [x], [x, rs], [x.nbytes], extra_bytes=(tile32,) * 5, label=label)
    ag.drop(rs)
    return out


def rope(ag: Autograd, c: LayerContext, q: Tensor, label: str) -> Tensor:
    """`apply_rotary_pos_emb`: `(q * cos) + (rotate_half(q) * sin)` (modeling_llama.py L134-160).

    cos/sin do not require grad, so the muls save cos and sin (shared by all layers) and nothing per layer.
    Forward temporaries: q*cos, the negated half, the concatenation, rotate_half(q)*sin. In a compiled layer one
    fused kernel writes the output, with no temporaries.
    """
    if c.compiled:
        out = ag.new(q.nbytes, q.requires_grad, f"{label}:rope")
        ag.record(out, [q], [], [q.nbytes], label=label)
        return out
    a = ag.new(q.nbytes, q.requires_grad, f"{label}:q*cos")
    neg = ag.new(q.nbytes // 2, False, f"{label}:neg")
    cat = ag.new(q.nbytes, False, f"{label}:rotate_half")
    ag.drop(neg)
    b = ag.new(q.nbytes, q.requires_grad, f"{label}:rot*sin")
    ag.drop(cat)
    out = ag.new(q.nbytes, q.requires_grad, f"{label}:rope")
    ag.record(out, [q], [], [q.nbytes], extra_bytes=2 * q.nbytes, label=label)
    ag.drop(a, b)
    return out


def attention_core(ag: Autograd, c: LayerContext, q: Tensor, k: Tensor, v: Tensor, sliding: bool) -> Tensor:
    """The attention itself: SDPA (flash / memory-efficient kernels) or the eager softmax(QK^T)V.

    SDPA, no mask: grouped-query attention is passed through natively (`enable_gqa`, transformers
    `use_gqa_in_sdpa`), the flash kernel saves q, k, v, the output and the fp32 log-sum-exp (4 x heads bytes per
    token); its backward allocates an fp32 dq accumulator and, under GQA, full-head dk/dv before reducing them
    (flash_api.cpp `mha_bwd`). With a sliding-window mask (a window shorter than the sequence) transformers
    repeats k/v to all heads and the memory-efficient kernel runs with the boolean mask.
    Eager: `_eager_attention`.
    """
    m = c.model
    masked = sliding and m.sliding_window is not None and c.seq_len_tokens > m.sliding_window
    if c.attn in ("sdpa", "flash") and not (c.attn == "sdpa" and masked):
        return _fused_attention(ag, c, q, k, v)
    if c.attn == "sdpa":  # masked: repeat_kv + memory-efficient kernel
        return _masked_sdpa(ag, c, q, k, v)
    return _eager_attention(ag, c, q, k, v)


def _fused_attention(ag: Autograd, c: LayerContext, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """SDPA's flash kernel (or flash-attn) without a mask: see `attention_core`."""
    m, T, w = c.model, c.tokens, c.act_bytes
    qd = m.q_dim
    gqa = m.num_kv_heads != m.num_heads
    out = ag.new(w * qd * T, True, "attn:out")
    lse = ag.new(FP32 * m.num_heads * T, True, "attn:lse")
    extra = FP32 * qd * T + FP32 * m.num_heads * T + (2 * w * qd * T if gqa else 0)
    ag.record(out, [q, k, v], [q, k, v, out, lse], [q.nbytes, k.nbytes, v.nbytes], extra_bytes=extra, label="sdpa")
    ag.drop(lse)
    return out


def _masked_sdpa(ag: Autograd, c: LayerContext, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """SDPA with a sliding-window mask: k/v repeated to all heads, the memory-efficient kernel (its log-sum-exp
    padded to 32 positions)."""
    m, T, w, b, s = c.model, c.tokens, c.act_bytes, c.batch_size, c.seq_len_tokens
    qd = m.q_dim
    gqa = m.num_kv_heads != m.num_heads
    k_rep, v_rep = _repeat_kv(ag, c, k, v) if gqa else (k, v)
    out = ag.new(w * qd * T, True, "attn:out")
    lse = ag.new(FP32 * m.num_heads * b * (-(-s // 32) * 32), True, "attn:lse")
    extra = FP32 * qd * T + FP32 * m.num_heads * T
    ag.record(out, [q, k_rep, v_rep], [q, k_rep, v_rep, out, lse], [q.nbytes, k_rep.nbytes, v_rep.nbytes],
              extra_bytes=extra, label="sdpa-masked")
    ag.drop(lse, *((k_rep, v_rep) if gqa else ()))
    return out


def _eager_attention(ag: Autograd, c: LayerContext, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Eager attention (modeling_llama.py `eager_attention_forward`): `repeat_kv` copies k and v to all heads, the
    scores are b x heads x s x s; softmax in fp32 saves its fp32 output, the bf16 cast is saved by the second
    matmul: 6 bytes per score, per layer (4 + 2; the attention dropout at p=0 saves no mask - measured).
    """
    m, T, w, b, s = c.model, c.tokens, c.act_bytes, c.batch_size, c.seq_len_tokens
    gqa = m.num_kv_heads != m.num_heads
    k_rep, v_rep = _repeat_kv(ag, c, k, v) if gqa else (k, v)
    n_scores = b * m.num_heads * s * s
    # matmul(q, k.transpose(2, 3)) folds to bmm with a contiguous copy of the transposed keys; that copy is what
    # autograd saves, while `key_states` itself lives until the function returns
    k_t = ag.new(k_rep.nbytes, True, "attn:k^T")
    ag.record_passthrough(k_t, [k_rep])
    scores = ag.new(w * n_scores, True, "attn:scores")
    ag.record(scores, [q, k_t], [q, k_t], [q.nbytes, k_t.nbytes], label="qk")
    ag.drop(k_t)
    scaled = ag.new(w * n_scores, True, "attn:scaled")
    ag.record(scaled, [scores], [], [scores.nbytes])  # mul/div by a constant: the gradient is a new tensor
    ag.drop(scores)
    if m.attn_logit_softcapping:
        scaled = _softcap_scores(ag, scaled, w * n_scores)
    p = _eager_softmax(ag, scaled, w, n_scores)
    out = ag.new(w * m.q_dim * T, True, "attn:pv")
    # bmm's backward writes the gradient of its second operand first (measured traces)
    ag.record(out, [v_rep, p], [p, v_rep], [v_rep.nbytes, p.nbytes], label="pv")
    ag.drop(p)
    if gqa:  # `key_states` / `value_states` live until the attention module returns
        ag.defer_until_return(k_rep, v_rep)
    # `attn_output.transpose(1, 2).contiguous()`: a copy for the eager layout; in backward, bmm needs the
    # transposed gradient contiguous again: a copy of the same size
    out2 = ag.new(out.nbytes, True, "attn:contiguous")
    ag.record(out2, [out], [], [out.nbytes])
    ag.drop(out)
    return out2


def _softcap_scores(ag: Autograd, scaled: Tensor, nbytes: int) -> Tensor:
    """Gemma 2's logit soft-capping of the scores, `tanh(scores / cap) * cap`: tanh saves its output."""
    div = ag.new(nbytes, True, "attn:softcap/")
    ag.record(div, [scaled], [], [scaled.nbytes])  # mul/div by a constant: the gradient is a new tensor
    ag.drop(scaled)
    th = ag.new(nbytes, True, "attn:tanh")
    ag.record(th, [div], [th], [nbytes], label="softcap-tanh")
    ag.drop(div)
    capped = ag.new(nbytes, True, "attn:softcap*")
    ag.record(capped, [th], [], [th.nbytes])  # mul/div by a constant: the gradient is a new tensor
    ag.drop(th)
    return capped


def _eager_softmax(ag: Autograd, scaled: Tensor, w: int, n_scores: int) -> Tensor:
    """The mask (a pass-through add), softmax in fp32 and the cast back to the activation dtype: the probabilities."""
    masked_scores = ag.new(w * n_scores, True, "attn:masked")
    ag.record_passthrough(masked_scores, [scaled])
    ag.drop(scaled)
    # softmax(..., dtype=torch.float32) first casts its bf16 input to fp32 (a transient the size of the output)
    cast_in = ag.new(FP32 * n_scores, False, "attn:softmax-input-fp32")
    p32 = ag.new(FP32 * n_scores, True, "attn:softmax-fp32")
    ag.drop(cast_in)
    # _softmax_backward_data computes the fp32 gradient, then casts it to the input dtype: two fp32 temporaries
    ag.record(p32, [masked_scores], [p32], [w * n_scores], extra_bytes=(FP32 * n_scores, FP32 * n_scores), label="softmax",
              grads_last=True)
    ag.drop(masked_scores)
    p = ag.new(w * n_scores, True, "attn:probs")
    ag.record(p, [p32], [], [FP32 * n_scores], label="probs-cast")
    ag.drop(p32)
    return p


def _repeat_kv(ag: Autograd, c: LayerContext, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """`repeat_kv`: expand + reshape copies k and v to every query head (backward sums them back)."""
    m, T, w = c.model, c.tokens, c.act_bytes
    k_rep = ag.new(w * m.q_dim * T, True, "attn:k_rep")
    ag.record(k_rep, [k], [], [k.nbytes], label="repeat_kv")
    v_rep = ag.new(w * m.q_dim * T, True, "attn:v_rep")
    ag.record(v_rep, [v], [], [v.nbytes], label="repeat_kv")
    return k_rep, v_rep


def attention_block(ag: Autograd, c: LayerContext, x: Tensor, sliding: bool) -> Tensor:
    """Projections, q/k norms (Qwen3, Gemma 3), RoPE, the KV cache copy, attention, o_proj."""
    m, T, w = c.model, c.tokens, c.act_bytes
    lins = {lin.name: lin for lin in m.attention_linears()}
    if m.fused_qkv:
        qkv = linear(ag, c, x, lins["qkv_proj"])
        # `qkv[..., :q_dim]` etc. are views of one storage: all three keep it alive
        q, k, v = (Tensor(qkv.tid, 0, qkv.requires_grad, n) for n in ("q", "k", "v"))
        q = _view_as_new(ag, qkv, w * m.q_dim * T, "q")
        k = _view_as_new(ag, qkv, w * m.kv_dim * T, "k")
        v = _view_as_new(ag, qkv, w * m.kv_dim * T, "v")
        ag.drop(qkv)
    else:
        q = linear(ag, c, x, lins["q_proj"])
        k = linear(ag, c, x, lins["k_proj"])
        v = linear(ag, c, x, lins["v_proj"])
    if m.qk_norm:
        q2 = rms_norm(ag, c, q, m.head_dim, "q_norm", gemma=m.rms_norm_one_plus_weight)
        ag.drop(q)
        k2 = rms_norm(ag, c, k, m.head_dim, "k_norm", gemma=m.rms_norm_one_plus_weight)
        ag.drop(k)
        q, k = q2, k2
    q2 = rope(ag, c, q, "rope_q")
    ag.drop(q)
    k2 = rope(ag, c, k, "rope_k")
    ag.drop(k)
    q, k = q2, k2
    if c.use_cache:  # DynamicCache.update: torch.cat copies k and v into the cache; attention uses the copies
        kc = ag.new(k.nbytes, k.requires_grad, "cache:k")
        ag.record_passthrough(kc, [k])
        vc = ag.new(v.nbytes, v.requires_grad, "cache:v")
        ag.record_passthrough(vc, [v])
        ag.drop(k, v)
        k, v = kc, vc
        ag.defer_until_forward_end(kc, vc)  # the DynamicCache holds them until the model output is dropped
    out = attention_core(ag, c, q, k, v, sliding)
    ag.drop(q)
    if not c.use_cache:
        ag.drop(k, v)
    y = linear(ag, c, out, lins["o_proj"])
    ag.drop(out)
    ag.drop_returned()
    return y


def _view_as_new(ag: Autograd, base: Tensor, nbytes: int, label: str) -> Tensor:
    t = ag.new(nbytes, base.requires_grad, f"{label}:split")
    ag.record_passthrough(t, [base])
    return t


def mlp_block(ag: Autograd, c: LayerContext, x: Tensor) -> Tensor:
    if c.tiled_mlp_tokens and c.tokens > c.tiled_mlp_tokens:
        return tiled_mlp_block(ag, c, x)
    return plain_mlp_block(ag, c, x)


def tiled_mlp_block(ag: Autograd, c: LayerContext, x: Tensor) -> Tensor:
    """fitune's tiled MLP (fitune/runtime/techniques/tiled_mlp.py): forward tile by tile keeping nothing but the MLP's
    input; backward recomputes and differentiates one tile at a time, writing into the input's gradient.

    Forward: the output (hidden x act_bytes per token) plus one tile's working set at a time. Backward: the input's
    gradient plus one tile's recomputed activations and gradients. Every tile has the same shape, so one is
    written on the tape.
    """
    tile = replace(c, batch_size=1, seq_len_tokens=c.tiled_mlp_tokens, tiled_mlp_tokens=0)
    out = ag.new(x.nbytes, True, "mlp:tiled-out")
    sub = Autograd(ag.tape, keep_saved=False)
    t_in = ag.new(x.nbytes * tile.tokens // c.tokens, False, "mlp:tile-in")
    t_out = plain_mlp_block(sub, tile, Tensor(t_in.tid, t_in.nbytes, True, "tile"))
    sub.drop(t_out)
    ag.drop(t_in)
    ag.save_only([x], "tiled MLP input")

    def backward(main: Autograd, output: Tensor | None) -> None:
        g = main.take_grad(output)
        if g is None:
            return
        gx = main.new(x.nbytes, True, "grad:mlp-input")
        t_x = main.new(x.nbytes * tile.tokens // c.tokens, True, "mlp:tile-in (recomputed)")
        sub2 = Autograd(main.tape, retag_saved=False)
        t_y = plain_mlp_block(sub2, tile, t_x)
        t_g = sub2.new(t_y.nbytes, True, "grad:mlp tile")
        sub2._grads[t_y.tid] = t_g
        sub2._grad_refs[t_g.tid] = 1
        sub2.drop(t_y)
        sub2.backward()
        main.param_grads.extend(sub2.param_grads)
        leftover = sub2._grads.pop(t_x.tid, None)
        main.tape.free(t_x.tid, leftover.tid if leftover is not None else None)
        main.drop_grad(g)
        main._grads[x.tid] = gx
        main._grad_refs[gx.tid] = 1

    ag.custom(backward, out, "tiled MLP")
    return out


def plain_mlp_block(ag: Autograd, c: LayerContext, x: Tensor) -> Tensor:
    """Gated MLP: `down_proj(act(gate_proj(x)) * up_proj(x))` (SiLU for Llama/Qwen/Mistral, tanh-GELU for Gemma).

    The activation saves its input, the product saves both factors: 3 x intermediate x act_bytes per token.
    Phi-3's fused `gate_up_proj` output is chunked into views, so its whole storage stays saved (same bytes).
    """
    m, T, w = c.model, c.tokens, c.act_bytes
    i = m.intermediate_size
    lins = {lin.name: lin for lin in m.dense_mlp_linears()}
    if m.fused_gate_up:
        gu = linear(ag, c, x, lins["gate_up_proj"])
        act = ag.new(w * i * T, gu.requires_grad, "mlp:act")
        ag.record(act, [gu], [gu], [gu.nbytes], label="act")
        prod = ag.new(w * i * T, gu.requires_grad, "mlp:prod")
        ag.record(prod, [gu, act], [act], [gu.nbytes, act.nbytes], label="mul")
        ag.drop(gu, act)
    elif c.liger:  # LigerSiLUMulFunction: saves both inputs, writes their gradients in place of them
        g = linear(ag, c, x, lins["gate_proj"])
        u = linear(ag, c, x, lins["up_proj"])
        prod = ag.new(w * i * T, True, "mlp:swiglu")
        ag.record_passthrough(prod, [g, u], label="swiglu")
        ag.save_only([g, u], "swiglu")
        ag.drop(g, u)
    elif c.compiled:  # one fused kernel: act(g) * u; saves g and u, recomputes act(g); new gradients for both
        g = linear(ag, c, x, lins["gate_proj"])
        u = linear(ag, c, x, lins["up_proj"])
        prod = ag.new(w * i * T, True, "mlp:act*up")
        ag.record(prod, [g, u], [g, u], [g.nbytes, u.nbytes], label="act*up")
        ag.drop(g, u)
    else:
        g = linear(ag, c, x, lins["gate_proj"])
        act = ag.new(w * i * T, g.requires_grad, "mlp:act")
        ag.record(act, [g], [g], [g.nbytes], label="act")
        ag.drop(g)
        u = linear(ag, c, x, lins["up_proj"])
        prod = ag.new(w * i * T, True, "mlp:prod")
        ag.record(prod, [act, u], [act, u], [act.nbytes, u.nbytes], extra_bytes=0, label="mul")
        ag.drop(act, u)
    y = linear(ag, c, prod, lins["down_proj"])
    ag.drop(prod)
    return y


def residual_add(ag: Autograd, c: LayerContext, x: Tensor, y: Tensor, label: str) -> Tensor:
    out = ag.new(x.nbytes, x.requires_grad or y.requires_grad, label)
    ag.record_passthrough(out, [x, y], label=label)
    return out


def decoder_layer(ag: Autograd, c: LayerContext, x: Tensor, sliding: bool) -> Tensor:
    """One decoder layer: pre-norm attention and MLP with residuals (Gemma 2/3 add post-norms)."""
    m = c.model
    gemma = m.rms_norm_one_plus_weight  # Gemma's norms: (1 + weight) in fp32
    n = rms_norm(ag, c, x, m.hidden_size, "input_norm", gemma)
    a = attention_block(ag, c, n, sliding)
    ag.drop(n)
    if m.norms_per_layer == 4:
        a2 = rms_norm(ag, c, a, m.hidden_size, "post_attn_norm", gemma)
        ag.drop(a)
        a = a2
    h = residual_add(ag, c, x, a, "residual1")
    ag.drop(a)
    n2 = rms_norm(ag, c, h, m.hidden_size, "pre_ffn_norm" if gemma else "post_attn_norm", gemma)
    f = mlp_block(ag, c, n2)
    ag.drop(n2)
    if m.norms_per_layer == 4:
        f2 = rms_norm(ag, c, f, m.hidden_size, "post_ffn_norm", gemma)
        ag.drop(f)
        f = f2
    out = residual_add(ag, c, h, f, "residual2")
    ag.drop(h, f)
    return out

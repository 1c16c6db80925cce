"""FLOPs of a training step, per token. Pure Python.

Formula (Kaplan et al. 2020, section 2.1; PaLM, Chowdhery et al. 2022, appendix B): a matmul with N weights costs
2N FLOPs per token forward, 2N for the input gradient and 2N for the weight gradient; causal attention adds
2 x 2 x seq x q_dim per layer forward (QK^T and PV), halved by the causal mask, and twice that in backward.
Frozen weights (LoRA, QLoRA, freeze) skip their weight gradient. Model FLOPs count no recomputation; hardware
FLOPs add one forward when checkpointing.
"""

from __future__ import annotations

from ..setup import TrainSetup
from ..specs.model import ModelSpec


def matmul_params_per_token(m: ModelSpec) -> int:
    """Weights one token multiplies through: decoder Linears (active experts only) and lm_head."""
    per_dense = sum(l.in_features * l.out_features for l in m.linears(False))
    per_moe = sum(l.in_features * l.out_features for l in m.linears(True))
    per_moe += m.experts_per_token * 3 * m.hidden_size * m.moe_intermediate_size + m.num_experts * m.hidden_size
    return per_dense * m.dense_layers + per_moe * m.moe_layers + m.vocab_size * m.hidden_size


def forward_flops_per_token(m: ModelSpec, seq_len_tokens: int) -> tuple[int, int]:
    """(linear, attention) forward FLOPs per token."""
    linear = 2 * matmul_params_per_token(m)
    attention = 2 * seq_len_tokens * m.q_dim * m.num_layers  # 4 x s x q_dim, halved by the causal mask
    return linear, attention


def model_flops_per_token(m: ModelSpec, s: TrainSetup) -> int:
    """Model FLOPs per trained token (no recomputation)."""
    lin, att = forward_flops_per_token(m, s.seq_len_tokens)
    weight_grads = lin if s.method == "full" else 0
    return lin + lin + weight_grads + 3 * att


def hardware_flops_per_token(m: ModelSpec, s: TrainSetup) -> int:
    """Model FLOPs plus the recomputed forward of checkpointed layers."""
    lin, att = forward_flops_per_token(m, s.seq_len_tokens)
    k = {"none": 0, "full": m.num_layers, "offload": m.num_layers}.get(s.checkpointed_layers_mode, s.selective_k() or 0)
    frac = k / m.num_layers
    decoder_lin = lin - 2 * m.vocab_size * m.hidden_size
    return model_flops_per_token(m, s) + int(frac * (decoder_lin + att))


def mfu(tokens_per_s: float, m: ModelSpec, s: TrainSetup, peak_tflops: float | None) -> float | None:
    """Model FLOPs utilisation: achieved model FLOP/s over the GPU's dense bf16 peak."""
    if not peak_tflops:
        return None
    return tokens_per_s * model_flops_per_token(m, s) / (peak_tflops * 1e12)

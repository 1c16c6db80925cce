"""Fixed overheads of a step: cuBLAS workspaces, RoPE tables, attention masks."""

from __future__ import annotations

from ..setup import TrainSetup
from ..specs.gpu import cublas_workspace_bytes
from ..specs.model import ModelSpec


def cublas_workspaces_bytes(compute_capability: str) -> int:
    """Two cuBLAS workspaces (forward thread and autograd's backward thread) from PyTorch's allocator.

    Formula: 2 x `cublas_workspace_bytes(cc)`. Measured 64 MiB on an H200 (bench/results/hf_recipe/hf_recipe.jsonl:
    `before_steps_allocated_bytes` - `model_only_allocated_bytes` - adapter bytes).
    """
    return 2 * cublas_workspace_bytes(compute_capability)


def rope_cache_bytes(m: ModelSpec, seq_len_tokens: int, act_bytes: int) -> int:
    """cos and sin tables, [1, seq, head_dim] each in the model dtype (LlamaRotaryEmbedding.forward), shared by
    all layers and saved by RoPE's multiplications until backward ends."""
    return 2 * seq_len_tokens * m.head_dim * act_bytes


def attention_mask_bytes(m: ModelSpec, s: TrainSetup) -> int:
    """The attention mask transformers materialises for the forward (masking_utils.create_causal_mask).

    eager: a [batch, 1, seq, seq] additive mask in the model dtype (Gemma 2/3: one more for the sliding layers).
    sdpa / flash without padding: no mask (`is_causal=True`), except a boolean [batch, 1, seq, seq] one for
    sliding-window layers whose window is shorter than the sequence.
    """
    n = s.batch_size * s.seq_len_tokens * s.seq_len_tokens
    w = 4 if s.dtype == "fp32" else 2
    sliding_active = bool(m.sliding_window_layers) and m.sliding_window is not None and s.seq_len_tokens > m.sliding_window
    if s.attn == "eager":
        return n * w * (2 if m.sliding_window_layers and m.sliding_window_layers < m.num_layers else 1)
    if s.attn == "sdpa" and sliding_active:
        return n
    return 0

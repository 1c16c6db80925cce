"""Parameter counts and the bytes of the model's weights.

Counts come from the shapes in ModelSpec; tests/test_memory_weights.py checks them against the real
transformers module built on the meta device (and the catalog's published counts).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..specs.model import ModelSpec

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}

#: bitsandbytes NF4 block size (elements per absmax) and the double-quantisation block size (absmaxes per
#: second-level scale): bitsandbytes/functional.py `quantize_4bit(blocksize=64)`, `quantize_blockwise(blocksize=256)`.
NF4_BLOCK = 64
NF4_DOUBLE_QUANT_BLOCK = 256


@dataclass(frozen=True)
class ParamCounts:
    """Parameters of the model, by where they sit (element counts)."""

    embedding: int
    lm_head: int  # 0 when tied to the embedding
    decoder_linear: int  # weights + biases of every nn.Linear inside the decoder layers
    decoder_other: int  # norms, routers, fused expert tensors (not nn.Linear)
    final_norm: int

    @property
    def total(self) -> int:
        return self.embedding + self.lm_head + self.decoder_linear + self.decoder_other + self.final_norm


def count_params(m: ModelSpec) -> ParamCounts:
    """Count parameters from the architecture (formula per module: in x out + bias for Linear, width for norms)."""
    h = m.hidden_size

    def linear_params(moe_layer: bool) -> int:
        return sum(l.in_features * l.out_features + (l.out_features if l.bias else 0) for l in m.linears(moe_layer))

    norms = m.norms_per_layer * h + (2 * m.head_dim if m.qk_norm else 0)
    experts = 0
    if m.moe_layers:
        # router (E x h) + fused experts: gate_up (E x 2i x h) and down (E x h x i), transformers 5 `*Experts`
        experts = m.num_experts * h + m.num_experts * 3 * h * m.moe_intermediate_size
    decoder_linear = m.dense_layers * linear_params(False) + m.moe_layers * linear_params(True)
    decoder_other = m.num_layers * norms + m.moe_layers * experts
    return ParamCounts(
        embedding=m.vocab_size * h,
        lm_head=0 if m.tie_word_embeddings else m.vocab_size * h,
        decoder_linear=decoder_linear,
        decoder_other=decoder_other,
        final_norm=h,
    )


def nf4_bytes(numel: int) -> int:
    """Bytes of a weight quantised to NF4 with double quantisation (QLoRA, Dettmers et al. 2023, section 3).

    Formula: numel / 2 (4-bit codes) + numel / 64 (one 8-bit absmax per 64-block, double-quantised) +
    4 x numel / (64 x 256) (one fp32 scale per 256 absmaxes). Measured: llama-3.1-8b with NF4 decoder
    Linears = 5,438.6 MiB allocated, formula 5,438.1 MiB (bench/results/hf_recipe/hf_recipe.jsonl,
    group llama-3.1-8b:nf4, `model_only_allocated_bytes`).
    """
    blocks = -(-numel // NF4_BLOCK)
    return numel // 2 + blocks + 4 * -(-blocks // NF4_DOUBLE_QUANT_BLOCK)


def weight_bytes(m: ModelSpec, method: str, dtype: str) -> int:
    """Bytes of the base model's weights on the GPU.

    bf16/fp16/fp32: every parameter at that width. qlora: the decoder's nn.Linear weights in NF4 (`nf4_bytes`),
    biases, embeddings, lm_head, norms and fused MoE experts (not nn.Linear) stay in the compute dtype.
    """
    p = count_params(m)
    w = DTYPE_BYTES[dtype]
    if method != "qlora":
        return p.total * w
    lin_weights = sum(l.in_features * l.out_features for l in m.linears(False)) * m.dense_layers + \
        sum(l.in_features * l.out_features for l in m.linears(True)) * m.moe_layers
    biases = p.decoder_linear - lin_weights
    per_layer_lin = [l for l in m.linears(False)]
    nf4 = sum(nf4_bytes(l.in_features * l.out_features) for l in per_layer_lin) * m.dense_layers
    if m.moe_layers:
        nf4 += sum(nf4_bytes(l.in_features * l.out_features) for l in m.linears(True)) * m.moe_layers
    return nf4 + (biases + p.embedding + p.lm_head + p.decoder_other + p.final_norm) * w


def offloaded_embedding_bytes(m: ModelSpec, setup) -> int:
    """Bytes the input embedding table leaves on the CPU with `offload_embeddings` (fitune/runtime/techniques/
    offload_embeddings.py): vocabulary x hidden in the compute dtype (bf16 with QLoRA: bitsandbytes leaves the
    embeddings unquantised); 0 when the lm_head shares its weight (tied: the table stays on the GPU) or when off."""
    if not getattr(setup, "offload_embeddings", False) or m.tie_word_embeddings:
        return 0
    w = 2 if setup.method == "qlora" else DTYPE_BYTES[setup.dtype]
    return m.vocab_size * m.hidden_size * w

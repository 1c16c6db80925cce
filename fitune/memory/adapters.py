"""Trainable parameters (LoRA adapters, or the base weights for full / freeze), their bytes and gradients."""

from __future__ import annotations

from ..setup import TrainSetup
from ..specs.model import ModelSpec
from .weights import DTYPE_BYTES, count_params

#: PEFT keeps LoRA weights in fp32 even on a bf16 model (`get_peft_model(..., autocast_adapter_dtype=True)`,
#: peft/tuners/tuners_utils.py `cast_adapter_dtype`): 4 bytes per adapter parameter, and 4 per gradient.
LORA_PARAM_BYTES = 4


def lora_targets(m: ModelSpec, s: TrainSetup) -> frozenset[str]:
    """Names of the Linear modules LoRA wraps; `all-linear` is every Linear of the decoder (PEFT excludes lm_head)."""
    if s.method not in ("lora", "qlora"):
        return frozenset()
    if s.all_linear:
        return frozenset(m.linear_names())
    return frozenset(s.lora_targets)


def lora_param_count(m: ModelSpec, s: TrainSetup) -> int:
    """r x (in + out) per wrapped Linear (A is r x in, B is out x r), over all layers (Hu et al. 2021)."""
    targets = lora_targets(m, s)
    per_dense = sum(s.lora_rank * (l.in_features + l.out_features) for l in m.linears(False) if l.name in targets)
    per_moe = sum(s.lora_rank * (l.in_features + l.out_features) for l in m.linears(True) if l.name in targets)
    return per_dense * m.dense_layers + per_moe * m.moe_layers


def trainable_param_count(m: ModelSpec, s: TrainSetup) -> int:
    if s.method in ("lora", "qlora"):
        return lora_param_count(m, s)
    p = count_params(m)
    if s.method == "full":
        return p.total
    # freeze: the last `freeze_trainable_layers` decoder layers train, all else frozen (LLaMA-Factory's
    # `finetuning_type: freeze` default, freeze_trainable_layers=2)
    per_layer = (p.decoder_linear + p.decoder_other) // m.num_layers
    return per_layer * min(s.freeze_trainable_layers, m.num_layers)


def trainable_param_bytes(m: ModelSpec, s: TrainSetup) -> int:
    """LoRA: fp32 adapters. full / freeze: the trained weights at the model dtype (already part of the weights)."""
    if s.method in ("lora", "qlora"):
        return LORA_PARAM_BYTES * lora_param_count(m, s)
    return DTYPE_BYTES[s.dtype] * trainable_param_count(m, s)


def gradient_bytes(m: ModelSpec, s: TrainSetup) -> int:
    """One gradient per trainable parameter, in the parameter's dtype (PyTorch's .grad matches the param)."""
    return trainable_param_bytes(m, s)


def trainable_tensor_shapes(m: ModelSpec, s: TrainSetup) -> list[tuple[int, ...]]:
    """The shapes of the trainable parameter tensors of a full fine-tune or freeze (what a per-tensor optimizer
    such as Adafactor sizes its state and its step's temporaries by): per decoder layer its Linears (out, in),
    with mixture-of-experts layers the router (E, h) and the fused experts (E, 2i, h) and (E, h, i) of
    transformers 5, and the norms (h,); for full also the embedding (vocab, h), an untied lm_head and the final
    norm. Biases are left out (vectors, negligible)."""
    h = m.hidden_size
    norms = [(h,)] * m.norms_per_layer + ([(m.head_dim,)] * 2 if m.qk_norm else [])

    def layer(moe: bool) -> list[tuple[int, ...]]:
        out = [(lin.out_features, lin.in_features) for lin in m.linears(moe)] + norms
        if moe:
            i = m.moe_intermediate_size
            out += [(m.num_experts, h), (m.num_experts, 2 * i, h), (m.num_experts, h, i)]
        return out

    kinds = [False] * m.dense_layers + [True] * m.moe_layers  # dense layers first: a simplification for freeze
    if s.method == "freeze":
        return [t for moe in kinds[-min(s.freeze_trainable_layers, m.num_layers):] for t in layer(moe)]
    shapes = [(m.vocab_size, h)] + [t for moe in kinds for t in layer(moe)] + [(h,)]
    if not m.tie_word_embeddings:
        shapes.append((m.vocab_size, h))
    return shapes

"""Rules about how the model is loaded: its dtype, where its weights go, which attention it runs."""

from __future__ import annotations

from typing import Iterator

from .. import evidence
from ..findings import WARNING
from ..index import ScriptIndex, is_unsloth_loader
from .base import Hit, call_text, known_setup, rule, script_model

QUANTIZED_LOAD_KWARGS = ("quantization_config", "load_in_4bit", "load_in_8bit")


@rule("load-without-dtype", WARNING, "from_pretrained without dtype/torch_dtype", ("C10",))
def load_without_dtype(ix: ScriptIndex) -> Iterator[Hit]:
    """A model loaded without a dtype gets whatever the installed transformers defaults to. Not Unsloth's loaders:
    they pick the dtype themselves (dtype=None: bf16 where the GPU has it, else float16)."""
    for load in ix.model_loads:
        if load.has_kw("dtype", "torch_dtype") or load.open_kwargs or is_unsloth_loader(load.receiver):
            continue
        quantized = load.has_kw(*QUANTIZED_LOAD_KWARGS)
        what = ("the modules bitsandbytes does not quantise (embeddings, lm_head, norms)" if quantized
                else "every weight")
        yield Hit(
            load.line,
            f"`{call_text(load)}` gives no dtype: transformers 4.x loads {what} in float32 (4 bytes per parameter, "
            "twice bf16); transformers 5 reads the checkpoint's dtype ('auto'). The memory then depends on the "
            "installed version.",
            "pass dtype=torch.bfloat16 (torch_dtype=torch.bfloat16 on transformers 4.x)",
            evidence.fp32_weights(script_model(ix), known_setup(ix)),
        )


@rule("load-in-fp32", WARNING, "model weights loaded as float32", ("C10",))
def load_in_fp32(ix: ScriptIndex) -> Iterator[Hit]:
    for load in ix.model_loads:
        kw = load.kw("dtype") if load.kw("dtype") is not None else load.kw("torch_dtype")
        if ix.dtype_of(kw) != "fp32":
            continue
        yield Hit(
            load.line,
            f"`{call_text(load)}` loads the weights as float32: 4 bytes per parameter, twice bf16. With LoRA the "
            "frozen base never needs float32; in full fine-tuning float32 master weights are a deliberate choice "
            "only if the card holds them plus 8 bytes per parameter of AdamW state.",
            "dtype=torch.bfloat16 (and bf16=True in TrainingArguments)",
            evidence.fp32_weights(script_model(ix), known_setup(ix)),
        )


@rule("device-map-auto", WARNING, 'device_map="auto" on a model that is trained', ("C22",))
def device_map_auto(ix: ScriptIndex) -> Iterator[Hit]:
    if not ix.trains:
        return
    for load in ix.model_loads:
        if ix.value(load.kw("device_map")) != "auto":
            continue
        yield Hit(
            load.line,
            f"`{call_text(load)}` with device_map=\"auto\" places weights for inference: it fills the GPU with "
            "layers and sends the rest to CPU RAM or disk. It never makes activations, gradients or optimizer "
            "states smaller; when the model does not fit, offloaded layers are copied to the GPU in every step "
            "(slow), and the GPU is already full when training starts.",
            'device_map={"": 0} (one GPU; or move the model with .to("cuda")); if the weights do not fit, use '
            "4-bit loading (QLoRA) rather than offloading",
            "reasoned (not measured): accelerate's infer_auto_device_map sizes the placement for weights only; "
            "offloading is not among " + evidence.HF_RECIPE_CITED,
        )


@rule("eager-attention", WARNING, 'attn_implementation="eager" for training', ("C02", "C03", "C12"))
def eager_attention(ix: ScriptIndex) -> Iterator[Hit]:
    if not ix.trains:
        return
    for load in ix.model_loads:
        if ix.value(load.kw("attn_implementation")) != "eager":
            continue
        yield Hit(
            load.line,
            f"`{call_text(load)}` asks for eager attention, which materialises and saves a batch x heads x seq x "
            "seq probability matrix in every layer; sdpa (the default) and flash-attention save none.",
            'drop attn_implementation or set "sdpa" (or "flash_attention_2"); if the model needs eager for '
            "correctness (old Gemma-2 soft-capping), turn gradient checkpointing on",
            evidence.eager_attention(known_setup(ix)),
        )


RULES = (load_without_dtype, load_in_fp32, device_map_auto, eager_attention)

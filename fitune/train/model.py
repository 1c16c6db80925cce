"""Load the model and tokenizer for a TrainConfig and prepare them for its method (LoRA, QLoRA, full, freeze)."""

from __future__ import annotations

import logging
import re

from ..errors import ConfigError
from ..setup import TrainSetup
from .config import TrainConfig

log = logging.getLogger(__name__)

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def pick_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def load_tokenizer(cfg: TrainConfig):
    from transformers import AutoTokenizer

    path = cfg.tokenizer or cfg.model
    try:
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"tokenizer: cannot load a tokenizer from {path!r} ({exc}); set `tokenizer:` to a folder "
                          "holding tokenizer.json / tokenizer_config.json") from exc
    if tok.pad_token_id is None:
        if tok.eos_token_id is None:
            raise ConfigError(f"tokenizer {path}: it has neither a pad nor an eos token; add a pad token")
        tok.pad_token = tok.eos_token  # padding positions carry label -100 and attention 0: any id will do
    return tok


def load_model(cfg: TrainConfig, device: str):
    """The base model in the config's dtype and attention, quantised for QLoRA, on `device`."""
    import torch
    from transformers import AutoModelForCausalLM

    s = cfg.setup
    dtype = getattr(torch, DTYPES["bf16" if s.method == "qlora" else s.dtype])
    attn = "sdpa" if s.attn == "flash" else s.attn
    if s.method == "qlora" and device != "cuda":
        raise ConfigError("method: qlora needs a CUDA GPU (bitsandbytes NF4 kernels); use method: lora on this machine")
    if cfg.init == "random":
        from ..profile.hf_recipe import build_random_model, quantize_decoder_to_nf4
        from ..specs.model import load_model_spec

        spec = load_model_spec(cfg.model)
        model = build_random_model(spec.hf_config, attn=attn, device=device,
                                   dtype_name="bf16" if s.method == "qlora" else s.dtype)
        if s.method == "qlora":
            quantize_decoder_to_nf4(model)
    else:
        kwargs = {"dtype": dtype, "attn_implementation": attn, "trust_remote_code": cfg.trust_remote_code}
        if s.method == "qlora":
            from transformers import BitsAndBytesConfig

            kwargs["quantization_config"] = BitsAndBytesConfig(
                load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                bnb_4bit_compute_dtype=torch.bfloat16)
            kwargs["device_map"] = {"": 0}
        model = AutoModelForCausalLM.from_pretrained(cfg.model, **kwargs)
        if s.method != "qlora":
            model.to(device)
    model.config.use_cache = False  # training: no KV cache
    model.train()
    return model


def prepare_for_method(model, cfg: TrainConfig):
    """Wrap with PEFT LoRA, or choose the trainable layers; turn on the memory techniques the setup asks for."""
    return prepare_for_setup(model, cfg.setup)


def prepare_for_setup(model, s: TrainSetup):
    """The method's trainable parameters (LoRA adapters, the last layers for freeze, everything for full) and the
    memory techniques of `s`: Liger kernels, lean LoRA, lean RMSNorm, tiled MLP, checkpointing (full, offloaded,
    selective).
    Shared by train, profile and the GPU benchmarks. (The allocator's settings are made before CUDA starts:
    `configure_allocator`.)"""
    from ..profile import hf_recipe

    if s.kernels == "liger":  # before LoRA wraps the projections: Liger patches the base model's modules
        from .techniques.fused_kernels import enable_liger_kernels

        enable_liger_kernels(model)
    if s.method in ("lora", "qlora"):
        targets = "all-linear" if s.all_linear else list(s.lora_targets)
        model = hf_recipe.wrap_lora(model, s.lora_rank, targets, alpha=s.lora_alpha)
    elif s.method == "freeze":
        layers = hf_recipe._decoder_layers(model)
        for p in model.parameters():
            p.requires_grad_(False)
        for layer in list(layers)[-s.freeze_trainable_layers:]:
            for p in layer.parameters():
                p.requires_grad_(True)
    if s.lean_lora:
        from .techniques.lean_lora import enable_lean_lora

        enable_lean_lora(model)
    if s.lean_norm:
        from .techniques.lean_norm import enable_lean_norm

        enable_lean_norm(model)
    if s.tiled_mlp:
        from .techniques.tiled_mlp import enable_tiled_mlp

        enable_tiled_mlp(model)
    if s.grad_checkpointing != "none":
        set_checkpointing(model, True)
        from .techniques.offload import enable_offloaded_checkpointing, enable_selective_checkpointing

        if s.checkpointed_layers_mode == "offload":
            enable_offloaded_checkpointing(model)
        elif s.checkpointed_layers_mode == "selective":
            enable_selective_checkpointing(model, s.selective_k())
    return model


#: Offloaded checkpoints larger than this get exact-size pinned host blocks (see configure_allocator).
EXACT_PINNED_ABOVE_MB = 64


def configure_allocator(s: TrainSetup) -> dict[str, str]:
    """Set PYTORCH_CUDA_ALLOC_CONF for `s` before CUDA starts; returns what was added. A key the user already set
    wins.

    - expandable_segments:True when `s.expandable_segments` (freed blocks are not stranded between live ones);
    - with offloaded checkpoints, pinned_max_round_threshold_mb: PyTorch's pinned-memory allocator rounds every
      block up to a power of two by default, so a 1.17 GB checkpoint (143k tokens x 8 KiB) holds 2 GiB of host
      RAM (measured: bench/results/issue5/). Blocks above the threshold get their exact size. The option is parsed
      by PyTorch 2.13's allocator config (c10/core/AllocatorConfig.h, pull 171662); fitune sets it from 2.13 on
      and leaves older versions, which may reject the key, with the rounding (fitune estimate notes it). Not yet
      measured on a GPU: the GPU machine has PyTorch 2.11.
    """
    import os

    added: dict[str, str] = {}
    current = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    if s.expandable_segments and "expandable_segments" not in current:
        added["expandable_segments"] = "True"
    if s.checkpointed_layers_mode == "offload" and "pinned_max_round_threshold" not in current \
            and exact_pinned_supported():
        added["pinned_max_round_threshold_mb"] = str(EXACT_PINNED_ABOVE_MB)
    if added:
        items = [current] if current else []
        items += [f"{k}:{v}" for k, v in added.items()]
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ",".join(items)
    return added


def exact_pinned_supported() -> bool:
    """Whether this PyTorch knows pinned_max_round_threshold_mb (checked in 2.13's allocator config)."""
    import torch

    version = re.match(r"(\d+)\.(\d+)", torch.__version__)
    return bool(version) and (int(version.group(1)), int(version.group(2))) >= (2, 13)


def set_checkpointing(model, on: bool) -> None:
    from ..profile import hf_recipe

    if on:
        hf_recipe.enable_checkpointing(model)
    else:
        hf_recipe.disable_checkpointing(model)

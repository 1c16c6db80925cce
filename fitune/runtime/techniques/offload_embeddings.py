"""Offloaded input embeddings: the (frozen) embedding table stays in CPU memory.

A LoRA / QLoRA run never updates the input embeddings, and looking up a batch's rows is a gather, not a matmul:
the CPU does it in microseconds, and only the looked-up rows (batch x tokens x hidden, 16 MiB for 2 x 2048 tokens of
Llama-3.1-8B in bf16) cross to the GPU. What leaves the GPU is the whole table: vocabulary x hidden x 2 bytes, 1.0 GB
for Llama-3.1-8B (128,256 x 4,096), about a fifth of its QLoRA weights, which matters on 8-12 GB cards. Models whose
lm_head shares the embedding's weight (tied, e.g. Llama-3.2-1B) keep it on the GPU: the lm_head is a matmul on every
token. The result is the same computation on another device (tests/test_offload_embeddings.py); the gradient stops
at the embeddings' output, as it does for a frozen table.
"""

from __future__ import annotations

import torch

from ...errors import ConfigError


def enable_offloaded_embeddings(model: torch.nn.Module) -> int:
    """Move `model`'s input embedding module to the CPU and make its forward take and give tensors on the device the
    rest of the model is on. Returns the bytes moved off the accelerator.

    Raises:
        ConfigError: the embedding is tied to the lm_head, or it trains.
    """
    emb = model.get_input_embeddings()
    head = model.get_output_embeddings()
    if head is not None and head.weight is emb.weight:
        raise ConfigError("offload_embeddings: this model ties its lm_head to the input embeddings (one weight, "
                          "used by a matmul on every token), so the table stays on the GPU: drop offload_embeddings")
    if any(p.requires_grad for p in emb.parameters()):
        raise ConfigError("offload_embeddings: the input embeddings train in this setup; the offloaded table is "
                          "for frozen embeddings (LoRA / QLoRA without embedding adapters)")
    device = head.weight.device if head is not None else next(p.device for p in model.parameters()
                                                               if p is not emb.weight)
    nbytes = sum(p.numel() * p.element_size() for p in emb.parameters())
    emb.to("cpu")
    emb.register_forward_pre_hook(_ids_to_cpu)
    emb.register_forward_hook(lambda module, inputs, output: output.to(device, non_blocking=True))
    return nbytes if device.type != "cpu" else 0


def _ids_to_cpu(module, inputs):
    return tuple(t.to("cpu") if isinstance(t, torch.Tensor) else t for t in inputs)


def compute_device(model: torch.nn.Module) -> torch.device:
    """The device the model computes on: the lm_head's (its first parameter may be an offloaded embedding table)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None and getattr(head, "weight", None) is not None:
        return head.weight.device
    return next(model.parameters()).device

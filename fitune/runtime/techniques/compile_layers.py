"""Regional compilation: `torch.compile` on each decoder layer, the rest of the model eager.

Inductor fuses what runs between the matmuls and attention of a layer: RMSNorm (saving its bf16 input and one
fp32 rstd per row instead of an fp32 copy), RoPE, SiLU x up (saving gate and up, not their product) and the
LoRA branch's scaling and sum. Every layer has the same code and shapes, so they share one compiled graph:
compiling takes seconds, not the minute a whole-model compile takes, and the loss, the embeddings and the
optimizer stay eager. The chunked loss's elementwise part (softmax minus the one-hot label, per chunk of logits)
is compiled with them (`chunked_loss.use_compiled_loss`). Measured on the HF recipe (docs/evidence.md C13): Llama-3.1-8B, 2 x 2048, no
checkpointing, 12.9k -> 17.1k tokens/s and 42.05 -> 34.52 GiB.

With checkpointing, transformers' `GradientCheckpointingLayer.__call__` wraps `nn.Module.__call__`, which runs
the compiled forward: the checkpoint is around the compiled layer, and its recomputation runs compiled too.
What the estimator assumes the compiled layer saves: fitune/memory/layers.py (`LayerContext.compiled`), checked
against traced saved tensors on the CPU (tests/test_compile_layers.py) and measured peaks on the GPU.
"""

from __future__ import annotations

import torch

from ..layers import find_decoder_layers
from .chunked_loss import use_compiled_loss


def enable_compiled_layers(model: torch.nn.Module) -> int:
    """Compile every decoder layer of `model` in place (`nn.Module.compile`); returns how many.

    `dynamic=None`: the first shape compiles static, a second sequence length recompiles once with dynamic
    shapes, so data without packing (lengths that vary per batch) does not recompile every step."""
    layers = find_decoder_layers(model)
    if not layers:
        raise ValueError("compile: layers found no decoder layers in this model; use compile: none")
    for layer in layers:
        layer.compile(dynamic=None)
    use_compiled_loss(model, True)
    return len(layers)


def disable_compiled_layers(model: torch.nn.Module) -> None:
    """Back to eager (`nn.Module.compile` keeps the compiled callable in `_compiled_call_impl`)."""
    for layer in find_decoder_layers(model):
        layer._compiled_call_impl = None
    use_compiled_loss(model, False)

"""Where a causal LM keeps its repeated decoder blocks (quantisation, freeze, selective checkpointing, tiled MLP,
the doctor's phase hooks all need them)."""

from __future__ import annotations

import torch


def find_decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated decoder blocks of `model` (PEFT-wrapped or not), in order: transformers'
    GradientCheckpointingLayer instances, else the longest nn.ModuleList whose children share one class."""
    layers = [m for m in model.modules() if any(c.__name__ == "GradientCheckpointingLayer" for c in type(m).__mro__)]
    if layers:
        return layers
    best: list[torch.nn.Module] = []
    for m in model.modules():
        if isinstance(m, torch.nn.ModuleList) and len(m) > len(best) and len({type(c) for c in m}) == 1:
            best = list(m)
    return best

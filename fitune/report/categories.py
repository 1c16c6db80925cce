"""The memory categories of fitune's estimate and profile, with a colour and a one-line explanation each."""

from __future__ import annotations

from dataclasses import dataclass

from .html import OKABE_ITO


@dataclass(frozen=True)
class Category:
    key: str
    """The key in the JSON `breakdown`."""
    label: str
    """What the text output calls it."""
    color: str
    """Fill colour (Okabe-Ito); "hatch" for the allocator's overhead, which is reserved but holds no tensor."""
    what: str
    """What the term is, shown on hover."""


CATEGORIES = (
    Category("weights", "weights", OKABE_ITO["blue"],
             "the model's parameters on the GPU (bf16, fp32, or 4-bit NF4 with QLoRA)"),
    Category("adapter_weights", "adapter weights", OKABE_ITO["sky_blue"],
             "the trainable LoRA A and B matrices"),
    Category("gradients", "gradients", OKABE_ITO["reddish_purple"],
             "gradients of the trainable parameters, kept until the optimizer step"),
    Category("optimizer_states", "optimizer states", OKABE_ITO["bluish_green"],
             "the optimizer's state per trainable parameter (AdamW: two fp32 moments)"),
    Category("saved_activations", "saved activations", OKABE_ITO["orange"],
             "tensors the forward keeps for the backward (checkpointing trades them for recomputation)"),
    Category("logits_and_loss", "logits and loss", OKABE_ITO["vermillion"],
             "the vocabulary-sized logits, their fp32 copies and the loss's buffers"),
    Category("transients", "transients", OKABE_ITO["yellow"],
             "short-lived temporaries of the op running at the peak"),
    Category("workspaces", "cuBLAS workspaces", OKABE_ITO["black"],
             "scratch memory the CUDA libraries (cuBLAS) hold"),
    Category("allocator_overhead", "allocator overhead", "hatch",
             "reserved by PyTorch's caching allocator beyond live tensors: cached free blocks and fragmentation "
             "(peak reserved - peak allocated)"),
)
BY_KEY = {c.key: c for c in CATEGORIES}


def category(key: str) -> Category:
    """The category for a breakdown key; an unknown key (a newer fitune) gets a grey bar and its own name."""
    return BY_KEY.get(key) or Category(key, key.replace("_", " "), OKABE_ITO["grey"], key.replace("_", " "))


def ordered(breakdown: dict) -> list[tuple[Category, int]]:
    """The breakdown's entries in the text output's order, unknown keys last."""
    known = [(c, breakdown[c.key]) for c in CATEGORIES if c.key in breakdown]
    extra = [(category(k), v) for k, v in breakdown.items() if k not in BY_KEY]
    return known + extra

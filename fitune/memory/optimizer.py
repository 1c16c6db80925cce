"""Optimizer state and the optimizer step's temporaries."""

from __future__ import annotations

#: bitsandbytes 8-bit optimizers: one uint8 per state element plus one fp32 absmax per 256-element block
#: (bitsandbytes/optim/optimizer.py, blockwise quantisation, block size 256); tensors under 4,096 elements keep
#: 32-bit state (`min_8bit_size=4096`).
BNB_BLOCK = 256
BNB_MIN_8BIT_SIZE = 4096


def optimizer_state_bytes(optimizer: str, param_numels: list[int], param_bytes_each: int) -> int:
    """Bytes of optimizer state for trainable tensors of the given sizes.

    adamw: exp_avg + exp_avg_sq at the parameter's dtype (torch.optim.AdamW `zeros_like(p)`; `step` is a CPU
    scalar unless capturable/fused). adamw8bit / paged_adamw8bit: 2 x (1 byte + 4/256 bytes) per element
    (32-bit for small tensors). adafactor (transformers, beta1=None): a row and a column fp32 vector per matrix.
    sgd (momentum 0): nothing.
    """
    if optimizer == "adamw":
        return 2 * param_bytes_each * sum(param_numels)
    if optimizer in ("adamw8bit", "paged_adamw8bit"):
        total = 0
        for n in param_numels:
            if n < BNB_MIN_8BIT_SIZE:
                total += 2 * 4 * n
            else:
                total += 2 * (n + 4 * -(-n // BNB_BLOCK))
        return total
    if optimizer == "adafactor":
        return 0  # filled per matrix by `adafactor_state_bytes`; kept here for the dispatch table
    return 0


def adafactor_state_bytes(shapes: list[tuple[int, int]]) -> int:
    """Factored second moment: rows + columns fp32 per matrix (Shazeer & Stern 2018); no first moment."""
    return sum(4 * (r + c) for r, c in shapes)


def optimizer_step_transient_bytes(optimizer: str, trainable_bytes: int) -> int:
    """Temporaries of one optimizer step.

    adamw (torch's default foreach implementation): the step builds intermediate tensor lists over all
    parameters at once, ~1 x the trainable bytes. Measured: +640 MiB above the gradients for 640 MiB of fp32
    LoRA weights (llama-3.1-8b all-linear r64; bench/results/hf_recipe/hf_recipe.jsonl). bitsandbytes'
    fused 8-bit kernels and SGD work in place: 0.
    """
    if optimizer == "adamw":
        return trainable_bytes
    if optimizer == "adafactor":
        return trainable_bytes
    return 0

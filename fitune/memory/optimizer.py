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


def adafactor_state_bytes(shapes: list[tuple[int, ...]]) -> int:
    """Factored second moment (Shazeer & Stern 2018; transformers' `Adafactor`, beta1=None: no first moment): for
    a tensor of 2 or more dimensions an fp32 row vector (`shape[:-1]`) and column vector (`shape[:-2] +
    shape[-1:]`); a vector keeps a full fp32 second moment."""
    total = 0
    for shape in shapes:
        if len(shape) == 1:
            total += 4 * shape[0]
            continue
        lead = 1
        for d in shape[:-2]:
            lead *= d
        total += 4 * (lead * shape[-2] + lead * shape[-1])
    return total


def adafactor_step_transient_bytes(largest_numel: int, param_bytes: int) -> int:
    """The peak temporaries of transformers' `Adafactor.step`, which updates one parameter at a time: for the
    largest tensor, `grad.float()` and `p.float()` (fp32 copies when the parameter is 16-bit), `update = grad**2 +
    eps` and, before that one is released, the new `update = _approx_sq_grad(...)`: four fp32 copies of a 16-bit
    tensor, two of an fp32 one. Measured: 3.915 GiB for Llama-3.2-1B's bf16 embedding (262.7 M elements: 4 x 4
    bytes each; bench/results/issue12/options.jsonl case 4, the optimizer phase)."""
    copies = 4 if param_bytes < 4 else 2
    return copies * 4 * largest_numel


def optimizer_step_transient_bytes(optimizer: str, trainable_bytes: int, largest_numel: int | None = None,
                                   param_bytes: int = 2) -> int:
    """Temporaries of one optimizer step.

    adamw (torch's default foreach implementation): the step builds intermediate tensor lists over all
    parameters at once, ~1 x the trainable bytes. Measured: +640 MiB above the gradients for 640 MiB of fp32
    LoRA weights (llama-3.1-8b all-linear r64; bench/results/hf_recipe/hf_recipe.jsonl). bitsandbytes'
    fused 8-bit kernels and SGD work in place: 0.
    """
    if optimizer == "adamw":
        return trainable_bytes
    if optimizer == "adafactor":
        if largest_numel is None:  # no tensor sizes known (sharded flat state): the old bound
            return trainable_bytes
        return adafactor_step_transient_bytes(largest_numel, param_bytes)
    return 0


def state_tensor_bytes(optimizer: str, shape: tuple[int, ...], param_bytes: int) -> list[int]:
    """The optimizer state tensors one parameter of `shape` gets, in the order they are created (sizes in bytes).

    adamw: exp_avg, exp_avg_sq (`torch.zeros_like(p)`; torch/optim/adamw.py `_init_group`). adamw8bit: state1,
    absmax1, state2, absmax2 (uint8 codes, one fp32 absmax per 256 elements; bitsandbytes `init_state`), fp32
    states under 4,096 elements. adafactor: the fp32 row and column vectors (or one full vector for a 1-D
    parameter). paged_adamw8bit: none in PyTorch's allocator (CUDA unified memory). sgd: none.
    """
    n = 1
    for d in shape:
        n *= d
    if optimizer == "adamw":
        return [n * param_bytes, n * param_bytes]
    if optimizer == "adamw8bit":
        if n < BNB_MIN_8BIT_SIZE:
            return [4 * n, 4 * n]
        blocks = -(-n // BNB_BLOCK)
        return [n, 4 * blocks, n, 4 * blocks]
    if optimizer == "adafactor":
        if len(shape) == 1:
            return [4 * n]
        lead = n // (shape[-1] * shape[-2])
        return [4 * lead * shape[-2], 4 * lead * shape[-1]]
    return []

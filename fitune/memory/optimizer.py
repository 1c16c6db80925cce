"""Optimizer state and the optimizer step's temporaries: the memory model's view of the optimizer registry.

Each optimizer's formulas (state tensors per parameter, the step's temporaries), with their sources, live in its
entry of fitune/specs/optimizers.py; these functions add them up over a model's trainable tensors.
"""

from __future__ import annotations

from ..specs import optimizers as optimizer_specs
from ..specs.optimizers import (BNB_BLOCK, BNB_MIN_8BIT_SIZE,  # noqa: F401  (re-exported: the 8-bit block model)
                                adafactor_state_tensor_bytes, adafactor_step_transient_bytes)


def optimizer_state_bytes(optimizer: str, param_numels: list[int], param_bytes_each: int) -> int:
    """Bytes of optimizer state for trainable tensors of the given sizes: the sum of the registry's
    `state_tensor_bytes` over each tensor taken as a vector (in or out of PyTorch's allocator).

    adamw: 2 x the parameter's bytes per element. adamw8bit / paged_adamw8bit: 2 x (1 byte + 4/256 bytes) per
    element (32-bit for small tensors). sgd (momentum 0): nothing. A factored optimizer (adafactor) needs the
    shapes: 0 here, counted by `adafactor_state_bytes` / `state_bytes_of_shapes`.
    """
    spec = optimizer_specs.get(optimizer)
    if spec.factored:
        return 0
    return sum(spec.state_bytes((n,), param_bytes_each) for n in param_numels)


def state_bytes_of_shapes(optimizer: str, shapes: list[tuple[int, ...]], param_bytes: int) -> int:
    """Bytes of optimizer state for trainable tensors of the given shapes (the registry's per-parameter formula)."""
    spec = optimizer_specs.get(optimizer)
    return sum(spec.state_bytes(shape, param_bytes) for shape in shapes)


def adafactor_state_bytes(shapes: list[tuple[int, ...]]) -> int:
    """Adafactor's factored second moment over tensors of `shapes` (`adafactor_state_tensor_bytes`: Shazeer &
    Stern 2018; transformers' `Adafactor`, beta1=None)."""
    return sum(sum(adafactor_state_tensor_bytes(shape, 4)) for shape in shapes)


def flat_state_bytes(optimizer: str, elements: int, allocator_only: bool = True) -> int:
    """The optimizer's state over one flat fp32 tensor of `elements` (ZeRO's partition: a factored optimizer
    keeps an unfactored second moment there); with `allocator_only`, 0 for state outside PyTorch's allocator."""
    spec = optimizer_specs.get(optimizer)
    if allocator_only and not spec.in_allocator:
        return 0
    return spec.state_bytes((elements,), 4)


def optimizer_step_transient_bytes(optimizer: str, trainable_bytes: int, largest_numel: int | None = None,
                                   param_bytes: int = 2) -> int:
    """Temporaries of one optimizer step: the registry's `step_transient_bytes` (adamw's foreach lists ~1 x the
    trainable bytes; adafactor's fp32 copies of the largest tensor, `adafactor_step_transient_bytes`; the fused
    8-bit kernels and SGD: 0)."""
    return optimizer_specs.get(optimizer).step_transient_bytes(trainable_bytes, largest_numel, param_bytes)


def state_tensor_bytes(optimizer: str, shape: tuple[int, ...], param_bytes: int) -> list[int]:
    """The optimizer state tensors one parameter of `shape` gets in PyTorch's allocator, in the order they are
    created (sizes in bytes): the registry's `state_tensor_bytes`; none for state in CUDA managed memory
    (paged_adamw8bit)."""
    spec = optimizer_specs.get(optimizer)
    if not spec.in_allocator:
        return []
    return spec.state_tensor_bytes(shape, param_bytes)

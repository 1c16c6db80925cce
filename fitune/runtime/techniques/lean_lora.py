"""Lean LoRA: the LoRA branch of a PEFT `Linear` / `Linear4bit` computed in the activations' dtype.

PEFT keeps the adapter weights in fp32 and, in `Linear.forward`, casts the layer's input to fp32 before
`lora_A` (peft/tuners/lora/layer.py, `_cast_input_dtype`); autograd saves that fp32 copy for lora_A's weight
gradient: 4 bytes per input feature per token for every wrapped module, even when q, k and v read the same
input (four copies of the attention input with all-linear targets: 6 GiB at 100k tokens for Llama-3.1-8B).
Here the branch casts the (tiny) adapter matrices to the input's dtype instead, with the scaling folded into B:

    y = (x A^T) (s B)^T      as  F.linear(F.linear(x, A.to(dt)), (B * s).to(dt))

so autograd saves the input the layer already holds and the r-wide intermediate x A^T (and the bf16 copies of A
and B, r values per feature), and its backward makes the r-wide gradient, then the input's gradient, with bf16
matmuls that accumulate in fp32; A and B get their gradients in their fp32 dtype through the casts. The output is
the base output plus the branch in bf16, without PEFT's fp32 sum or QLoRA's clone of the base output.
Mathematically the same as PEFT's forward; numerically equal within bf16 rounding (tests/test_lean_kernels.py
compares loss and every gradient with PEFT's own forward).

The branch is plain differentiable ops, not a custom `torch.autograd.Function`: inside a `torch.compile`d layer
(`compile: layers`) on CUDA, torch 2.11 traced an earlier Function version of this branch with a zero gradient
for its output, so every LoRA gradient came out zero while the loss matched (bench/compile_parity.py, measured
on the H200: bench/results/speed/zero_grads/compile_parity_before.jsonl; after: compile_parity.jsonl).

Modules with DoRA or another LoRA variant, several active adapters, merged weights or mixed-batch adapter
names keep PEFT's forward.
"""

from __future__ import annotations

import torch


def lora_branch(x: torch.Tensor, weight_a: torch.Tensor, weight_b: torch.Tensor, scale: float) -> torch.Tensor:
    """`(x A^T) B^T * scale` in x's dtype; autograd saves x, x A^T and the low-precision A and s B."""
    dt = x.dtype
    xa = torch.nn.functional.linear(x, weight_a.to(dt))
    return torch.nn.functional.linear(xa, (weight_b * scale).to(dt))


def _lean_applicable(module, kwargs) -> str | None:
    """The single active vanilla-LoRA adapter of `module`, or None when PEFT's own forward must run."""
    if module.disable_adapters or module.merged or kwargs.get("adapter_names") is not None:
        return None
    active = [a for a in module.active_adapters if a in module.lora_A.keys()]
    if len(active) != 1:
        return None
    name = active[0]
    if name in getattr(module, "lora_variant", {}) or getattr(module, "use_dora", {}).get(name):
        return None
    return name


def lean_lora(module) -> None:
    """Make one PEFT LoRA layer (Linear or bitsandbytes Linear4bit) compute its branch lean (in place)."""
    peft_forward = module.forward

    def forward(x, *args, **kwargs):
        name = _lean_applicable(module, kwargs)
        if name is None:
            return peft_forward(x, *args, **kwargs)
        result = module.base_layer(x, *args, **kwargs)
        xd = module.lora_dropout[name](x)
        branch = lora_branch(xd.to(result.dtype), module.lora_A[name].weight, module.lora_B[name].weight,
                             module.scaling[name])
        return result + branch

    module.forward = forward


def enable_lean_lora(model) -> int:
    """Make every LoRA Linear of a PEFT model lean. Returns how many modules changed."""
    from peft.tuners.lora import LoraLayer

    n = 0
    for module in model.modules():
        if isinstance(module, LoraLayer) and hasattr(module, "base_layer") and hasattr(module, "lora_A") \
                and isinstance(getattr(module, "base_layer"), torch.nn.Module) \
                and type(module).__name__ in ("Linear", "Linear4bit", "Linear8bitLt"):
            lean_lora(module)
            n += 1
    if not n:
        raise ValueError("no PEFT LoRA Linear found: wrap the model with LoRA before enabling lean LoRA")
    return n

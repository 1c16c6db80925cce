"""Lean LoRA: the LoRA branch of a PEFT `Linear` / `Linear4bit` computed in the activations' dtype.

PEFT keeps the adapter weights in fp32 and, in `Linear.forward`, casts the layer's input to fp32 before
`lora_A` (peft/tuners/lora/layer.py, `_cast_input_dtype`); autograd saves that fp32 copy for lora_A's weight
gradient: 4 bytes per input feature per token for every wrapped module, even when q, k and v read the same
input (four copies of the attention input with all-linear targets: 6 GiB at 100k tokens for Llama-3.1-8B).
Here the branch is one autograd Function that casts the (tiny) adapter matrices to the input's dtype instead,
saves the input the layer already holds and the r-wide intermediate, and computes in backward

    x_A = x A^T,   y = x_A B^T * s
    dL/dB = s g^T x_A,   dL/dx_A = s g B,   dL/dA = (dL/dx_A)^T x,   dL/dx = (dL/dx_A) A

with bf16 matmuls that accumulate in fp32 (the gradients of A and B are returned in their fp32 dtype). The
output is the base output plus the branch in bf16, without PEFT's fp32 sum or QLoRA's clone of the base
output. Mathematically the same as PEFT's forward; numerically equal within bf16 rounding
(tests/test_lean_lora.py compares loss and every gradient with PEFT's own forward).

Modules with DoRA or another LoRA variant, several active adapters, merged weights or mixed-batch adapter
names keep PEFT's forward.
"""

from __future__ import annotations

import torch


class _LoraBranch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight_a, weight_b, scale: float):
        dt = x.dtype
        a_lowp, b_lowp = weight_a.to(dt), weight_b.to(dt)
        xa = x @ a_lowp.t()
        y = (xa @ b_lowp.t()).mul_(scale)
        ctx.save_for_backward(x, xa, weight_a, weight_b)
        ctx.scale = scale
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x, xa, weight_a, weight_b = ctx.saved_tensors
        dt = grad_y.dtype
        g = grad_y.reshape(-1, grad_y.shape[-1])
        xa2 = xa.reshape(-1, xa.shape[-1])
        x2 = x.reshape(-1, x.shape[-1])
        grad_xa = (g @ weight_b.to(dt)).mul_(ctx.scale)  # tokens x r
        grad_b = grad_a = grad_x = None
        if ctx.needs_input_grad[2]:
            grad_b = (g.t() @ xa2).to(weight_b.dtype).mul_(ctx.scale)
        if ctx.needs_input_grad[1]:
            grad_a = (grad_xa.t() @ x2).to(weight_a.dtype)
        if ctx.needs_input_grad[0]:
            grad_x = (grad_xa @ weight_a.to(dt)).view_as(x)
        return grad_x, grad_a, grad_b, None


def lora_branch(x: torch.Tensor, weight_a: torch.Tensor, weight_b: torch.Tensor, scale: float) -> torch.Tensor:
    """`(x A^T) B^T * scale` in x's dtype, saving only x and the r-wide intermediate."""
    return _LoraBranch.apply(x, weight_a, weight_b, scale)


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

"""Lean RMSNorm: the Llama-family RMSNorm with one saved bf16 tensor and no fp32 copies of the sequence.

transformers' `LlamaRMSNorm.forward` upcasts its input to fp32 and autograd saves that fp32 copy (4 bytes per
feature per token, twice the input), and its backward makes three more fp32 temporaries of the input's size
(fitune.memory.layers.rms_norm models them). At 100k tokens and hidden 4096 each is 1.5 GiB. Here forward and
backward run a tile of tokens at a time in fp32, and only the input (the tensor the layer already holds) and one
fp32 reciprocal RMS per token are saved. The forward is the same arithmetic, op for op, so its output is
bit-identical; backward is the analytic gradient of RMSNorm computed in fp32:

    n = x * r,  r = (mean(x^2) + eps)^-1/2,  y = w * bf16(n)
    dL/dn = g * w,   dL/dx = r * (dL/dn - n * mean(dL/dn * n)),   dL/dw = sum over tokens of g * bf16(n)

Only norms whose `forward` is the Llama one (compared by byte code: Llama, Mistral, Qwen2/3, Phi-3 and copies)
are replaced; others (Gemma's `1 + weight`) are left alone. tests/test_lean_norm.py checks forward and gradients
against the module it replaces.
"""

from __future__ import annotations

import torch

TILE_TOKENS = 8192  # fitune.memory.layers.lean_rms_norm models the same tile


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps: float, tile: int):
        flat = x.reshape(-1, x.shape[-1])
        out = None
        rstd = torch.empty(flat.shape[0], 1, dtype=torch.float32, device=x.device)
        for start in range(0, flat.shape[0], tile):
            h = flat[start:start + tile].to(torch.float32)
            r = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
            y = weight * (h * r).to(x.dtype)
            if out is None:
                out = torch.empty(flat.shape, dtype=y.dtype, device=x.device)
            out[start:start + tile] = y
            rstd[start:start + tile] = r
        ctx.save_for_backward(x, weight, rstd)
        ctx.tile = tile
        return out.view(x.shape[:-1] + out.shape[-1:])

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, rstd = ctx.saved_tensors
        flat = x.reshape(-1, x.shape[-1])
        g = grad_out.reshape(-1, grad_out.shape[-1])
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_x = torch.empty_like(flat) if need_x else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=x.device) if need_w else None
        w32 = weight.to(torch.float32)
        for start in range(0, flat.shape[0], ctx.tile):
            sl = slice(start, start + ctx.tile)
            n = flat[sl].to(torch.float32) * rstd[sl]
            g32 = g[sl].to(torch.float32)
            if need_w:
                grad_w += (g32 * n.to(x.dtype).to(torch.float32)).sum(0)
            if need_x:
                gn = g32 * w32
                grad_x[sl] = (rstd[sl] * (gn - n * (gn * n).mean(-1, keepdim=True))).to(x.dtype)
        return (grad_x.view_as(x) if need_x else None, grad_w.to(weight.dtype) if need_w else None, None, None)


def _llama_norm_code():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    return LlamaRMSNorm.forward.__code__


def is_llama_rms_norm(module: torch.nn.Module) -> bool:
    """True when `module`'s forward is transformers' Llama RMSNorm (same byte code and names)."""
    fwd = getattr(type(module), "forward", None)
    code = getattr(fwd, "__code__", None)
    ref = _llama_norm_code()
    return (code is not None and code.co_code == ref.co_code and code.co_names == ref.co_names
            and hasattr(module, "weight") and hasattr(module, "variance_epsilon"))


def lean_norm(module: torch.nn.Module, tile_tokens: int = TILE_TOKENS) -> None:
    """Make one Llama-style RMSNorm run lean (in place)."""

    def forward(hidden_states):  # tiled under no_grad too (checkpointed forwards): no fp32 copy of the sequence
        return _RMSNorm.apply(hidden_states, module.weight, module.variance_epsilon, tile_tokens)

    module.forward = forward


def enable_lean_norm(model, tile_tokens: int = TILE_TOKENS) -> int:
    """Replace every Llama-style RMSNorm of `model` (layers' norms, the final norm, q/k norms). Returns the count."""
    n = 0
    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm") and is_llama_rms_norm(module):
            lean_norm(module, tile_tokens)
            n += 1
    if not n:
        raise ValueError("no Llama-style RMSNorm found: lean_norm applies to Llama, Mistral, Qwen2/3 and Phi-3 "
                         "families; turn it off for this model")
    return n

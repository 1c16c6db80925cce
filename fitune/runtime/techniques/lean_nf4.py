"""Lean NF4 linear: a QLoRA base layer (bitsandbytes `Linear4bit`, NF4) as one PyTorch custom op per call.

Where the QLoRA step's time goes (bench/results/issue32/gaps, H100): the compiled layers' forward waits on the host,
and a third of that wait is bitsandbytes' `gemm_4bit` kernel, written in Python: for a training batch (more than
1,536 rows) it allocates the double-quantized absmax in fp32, dequantizes it with one C call inside a device
context manager, adds the offset into a second fp32 tensor, allocates the weight, dequantizes it with another C call
inside another context manager, then runs `F.linear` (bitsandbytes/backends/cuda/ops.py `_dequant_linear_fallback`),
once for each of the 7 x 32 linears and again in backward (`MatMul4Bit.backward`, through
`F.dequantize_4bit`'s Python).

Here the same kernels run with less host work: `fitune::nf4_linear` is a custom op (opaque to `torch.compile`, so
the compiled layer calls it as one node), whose CUDA path makes the two C calls of bitsandbytes' library directly
(`cdequantize_blockwise_fp32` for the absmax, `cdequantize_blockwise_bf16_nf4` / `_fp16_nf4` for the weight, on the
current stream, as Unsloth's `fast_dequantize` does) with the offset added in place, then `F.linear`. Its backward
(`fitune::nf4_linear_grad_input`) dequantizes again and multiplies, as `MatMul4Bit.backward` does: autograd saves
no dequantized weight, so memory is bitsandbytes' own (one bf16 weight and one fp32 absmax alive per call, one
fp32 absmax less than bitsandbytes' path).

Off CUDA (the tests' CPU path) the op dequantizes with PyTorch indexing: the 4-bit codes (two a byte, the high
nibble first) look up the 16-value table `quant_state.code`, times each block's absmax, itself `code2[absmax_8bit]`
times its 256-block scale plus the offset (bitsandbytes/functional.py `quantize_4bit` with `compress_statistics`).
tests/test_lean_nf4.py checks both against bitsandbytes' `dequantize_4bit` and the gradients against autograd.

Layers it does not take keep bitsandbytes' forward: FP4, an unnested absmax, a bias that trains, a weight that
trains, or a batch of at most 1,536 rows (generation: bitsandbytes' fused 4-bit GEMV/GEMM kernels are faster there).
`FITUNE_LEAN_NF4=0` turns it off (for side-by-side measurements).
"""

from __future__ import annotations

import os

import torch

LEAN_NF4_ENV = "FITUNE_LEAN_NF4"
# bitsandbytes' gemm_4bit runs its own fused kernel up to this many rows on CUDA, dequantize + F.linear above it
# (bitsandbytes/backends/cuda/ops.py `_gemm_4bit_custom_max_m`); the lean op takes only the rows above
BNB_FUSED_MAX_ROWS = 1536


_CUDA_FUNCTIONS: dict = {}


def _cuda_functions(dtype: torch.dtype) -> tuple:
    """bitsandbytes' C functions for the CUDA path: (absmax dequantizer into fp32, NF4 dequantizer into `dtype`),
    each (code, A, absmax, out, blocksize, n, stream); importing bitsandbytes' CUDA backend sets their argtypes."""
    fns = _CUDA_FUNCTIONS.get(dtype)
    if fns is None:
        from bitsandbytes.backends.cuda import ops as _ops  # noqa: F401  (sets the ctypes argument types)
        from bitsandbytes.cextension import lib

        nf4 = {torch.bfloat16: lib.cdequantize_blockwise_bf16_nf4, torch.float16: lib.cdequantize_blockwise_fp16_nf4}
        fns = _CUDA_FUNCTIONS[dtype] = (lib.cdequantize_blockwise_fp32, nf4[dtype])
    return fns


def _absmax_fp32(absmax_8bit, absmax_code, absmax_scale, offset, blocksize2: int, dtype) -> torch.Tensor:
    """The per-block absmax of a double-quantized NF4 weight, in fp32: `code2[absmax_8bit] * scale[block2] + offset`."""
    if absmax_8bit.is_cuda:
        absmax = torch.empty(absmax_8bit.shape, dtype=torch.float32, device=absmax_8bit.device)
        dequant_absmax, _ = _cuda_functions(dtype)
        dequant_absmax(absmax_code.data_ptr(), absmax_8bit.data_ptr(), absmax_scale.data_ptr(), absmax.data_ptr(),
                       blocksize2, absmax_8bit.numel(), torch._C._cuda_getCurrentRawStream(absmax_8bit.device.index))
        return absmax.add_(offset)
    n = absmax_8bit.numel()
    values = absmax_code[absmax_8bit.reshape(-1).long()].float()
    scale = absmax_scale.float().repeat_interleave(blocksize2)[:n]
    return values * scale + offset


def dequantize_nf4(packed, absmax_8bit, absmax_code, absmax_scale, offset, code4, shape: list[int],
                   blocksize: int, blocksize2: int, dtype: torch.dtype) -> torch.Tensor:
    """The weight of shape `shape` in `dtype` from its packed NF4 codes and double-quantized absmax."""
    absmax = _absmax_fp32(absmax_8bit, absmax_code, absmax_scale, offset, blocksize2, dtype)
    n = shape[0] * shape[1]
    if packed.is_cuda:
        weight = torch.empty(shape, dtype=dtype, device=packed.device)
        _, dequant_weight = _cuda_functions(dtype)
        dequant_weight(None, packed.data_ptr(), absmax.data_ptr(), weight.data_ptr(), blocksize, n,
                       torch._C._cuda_getCurrentRawStream(packed.device.index))
        return weight
    codes = packed.reshape(-1)
    nibbles = torch.stack([codes >> 4, codes & 15], dim=1).reshape(-1)[:n].long()
    values = code4.float()[nibbles] * absmax.repeat_interleave(blocksize)[:n]
    return values.to(dtype).reshape(shape)


@torch.library.custom_op("fitune::nf4_linear", mutates_args=())
def nf4_linear(x: torch.Tensor, packed: torch.Tensor, absmax_8bit: torch.Tensor, absmax_code: torch.Tensor,
               absmax_scale: torch.Tensor, offset: torch.Tensor, code4: torch.Tensor, bias: torch.Tensor | None,
               out_features: int, blocksize: int, blocksize2: int) -> torch.Tensor:
    """`x @ W^T (+ bias)` with W dequantized from NF4 for this call only."""
    weight = dequantize_nf4(packed, absmax_8bit, absmax_code, absmax_scale, offset, code4,
                            [out_features, x.shape[-1]], blocksize, blocksize2, x.dtype)
    return torch.nn.functional.linear(x, weight, bias)


@nf4_linear.register_fake
def _nf4_linear_fake(x, packed, absmax_8bit, absmax_code, absmax_scale, offset, code4, bias, out_features,
                     blocksize, blocksize2):
    return x.new_empty((*x.shape[:-1], out_features))


@torch.library.custom_op("fitune::nf4_linear_grad_input", mutates_args=())
def nf4_linear_grad_input(grad: torch.Tensor, packed: torch.Tensor, absmax_8bit: torch.Tensor,
                          absmax_code: torch.Tensor, absmax_scale: torch.Tensor, offset: torch.Tensor,
                          code4: torch.Tensor, in_features: int, blocksize: int, blocksize2: int) -> torch.Tensor:
    """The input's gradient `grad @ W`, W dequantized again (autograd keeps no dequantized weight)."""
    weight = dequantize_nf4(packed, absmax_8bit, absmax_code, absmax_scale, offset, code4,
                            [grad.shape[-1], in_features], blocksize, blocksize2, grad.dtype)
    return torch.matmul(grad, weight)


@nf4_linear_grad_input.register_fake
def _nf4_linear_grad_input_fake(grad, packed, absmax_8bit, absmax_code, absmax_scale, offset, code4, in_features,
                                blocksize, blocksize2):
    return grad.new_empty((*grad.shape[:-1], in_features))


def _setup_context(ctx, inputs, output):
    x, packed, absmax_8bit, absmax_code, absmax_scale, offset, code4, _bias, _out, blocksize, blocksize2 = inputs
    ctx.save_for_backward(packed, absmax_8bit, absmax_code, absmax_scale, offset, code4)
    ctx.in_features, ctx.blocksize, ctx.blocksize2 = x.shape[-1], blocksize, blocksize2


def _backward(ctx, grad):
    packed, absmax_8bit, absmax_code, absmax_scale, offset, code4 = ctx.saved_tensors
    grad_x = None
    if ctx.needs_input_grad[0]:
        grad_x = nf4_linear_grad_input(grad, packed, absmax_8bit, absmax_code, absmax_scale, offset, code4,
                                       ctx.in_features, ctx.blocksize, ctx.blocksize2)
    return grad_x, None, None, None, None, None, None, None, None, None, None


nf4_linear.register_autograd(_backward, setup_context=_setup_context)


def lean_nf4_state(layer) -> tuple | None:
    """What the op reads of a bitsandbytes `Linear4bit` (packed codes, absmax 8-bit, its code and scales, offset,
    the 4-bit table, block sizes, out features), or None where the layer keeps bitsandbytes' forward. Read once,
    when the model is in place on its device (the tensors are the layer's own, not copies)."""
    weight = getattr(layer, "weight", None)
    state = getattr(weight, "quant_state", None)
    if state is None or state.quant_type != "nf4" or not state.nested or weight.requires_grad:
        return None
    if layer.bias is not None and layer.bias.requires_grad:
        return None
    if state.offset is None or state.state2 is None or len(state.shape) != 2:
        return None
    return (weight.data, state.absmax, state.state2.code, state.state2.absmax, state.offset, state.code,
            state.blocksize, state.state2.blocksize, int(state.shape[0]))


def lean_nf4_enabled() -> bool:
    """Off only where FITUNE_LEAN_NF4 says 0 / false / off (for measuring bitsandbytes' path beside it)."""
    return os.environ.get(LEAN_NF4_ENV, "1").strip().lower() not in ("0", "false", "off", "no")


def base_output(base_layer, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """The base layer's output: the lean NF4 op for a training batch of a layer it takes, else the layer itself."""
    nf4 = getattr(base_layer, "_fitune_nf4", None)
    if nf4 is None or args or kwargs or x.dtype not in (torch.bfloat16, torch.float16) \
            or base_layer.compute_dtype not in (None, x.dtype) \
            or (base_layer.bias is not None and base_layer.bias.dtype != x.dtype) \
            or x.numel() // x.shape[-1] <= BNB_FUSED_MAX_ROWS:
        return base_layer(x, *args, **kwargs)
    packed, absmax_8bit, absmax_code, absmax_scale, offset, code4, blocksize, blocksize2, out_features = nf4
    return nf4_linear(x, packed, absmax_8bit, absmax_code, absmax_scale, offset, code4, base_layer.bias,
                      out_features, blocksize, blocksize2)


def mark_lean_nf4(base_layer) -> bool:
    """Let `base_output` run `base_layer` (a bitsandbytes Linear4bit) through the lean op. False: it keeps its own."""
    if not lean_nf4_enabled() or type(base_layer).__name__ != "Linear4bit":
        return False
    state = lean_nf4_state(base_layer)
    if state is None:
        return False
    base_layer._fitune_nf4 = state
    return True

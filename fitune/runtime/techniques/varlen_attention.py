"""Packed rows without a mask: attention computed example by example inside each row.

With packing, several examples share one row and their position ids restart at 0 at each example's first token.
transformers keeps them apart by building a block-diagonal causal mask from those position ids
(masking_utils.find_packed_sequence_indices): a boolean tensor of rows x length x length (10 GB at 100k tokens),
and with a mask SDPA cannot use its causal flash kernel. Here the attention of a packed row is run segment by
segment: each example's queries attend to its own keys with SDPA's `is_causal=True` (the flash kernel on a GPU),
and the outputs are concatenated. No O(n^2) tensor exists; the result is the block-diagonal attention exactly
(tests/test_varlen_attention.py compares logits and gradients with transformers' masked path and with the
examples run one by one).

Installed as a transformers attention implementation ("fitune_varlen"). Its name is not in transformers' mask
registry, so the model builds no mask at all; rows whose position ids never restart run as one causal segment.
Models with a sliding window keep transformers' masked path (`varlen_supported` says so).

Under `compile: layers` the segment loop runs eagerly (torch.compiler.disable): its segment bounds come from the
data, and traced they would recompile the layer for every new row layout (measured on the H200: 2,037 tokens/s
instead of about 17k, bench/results/peers/real_length.jsonl). The compiled layer is then two graphs, before and
after attention.

The kernel path (issue 32; on by default, FITUNE_VARLEN_KERNEL=0 turns it off, see `KERNEL_ENV`): on a
CUDA device with torch's `varlen_attn` (torch >= 2.10, flash attention over
packed tokens), a packed batch's attention is ONE call over all its rows, no Python loop and no graph break.
Its segment bounds (`cu_seqlens`) are computed once per batch from the CPU position ids, outside the model
(`varlen_inputs`, called by fitune.runtime.step), and reach every layer as transformers' `cu_seq_lens_q` /
`cu_seq_lens_k` / `max_length_q` / `max_length_k` keyword arguments: a traced layer sees a tensor input, not the
data. Their count is padded to a power of two with empty segments and the max lengths are the row length (an
upper bound), so a compiled layer sees few shapes and no new constants as layouts change. Elsewhere (the CPU, an
older torch, fp32, dropout, a head size flash attention lacks) the segment loop above runs, unchanged.
Parity on the CPU against the loop and transformers' mask, with the kernel replaced by a reference:
tests/test_varlen_kernel.py; timing on the GPU: bench/packed_attention.py.
"""

from __future__ import annotations

import inspect
import os

import torch

NAME = "fitune_varlen"


def _segments(position_ids: torch.Tensor) -> list[list[tuple[int, int]]]:
    """Per row, the [start, end) of each example: a new one begins where the position id is 0."""
    out = []
    length = position_ids.shape[-1]
    for row in position_ids.reshape(-1, length):
        starts = torch.nonzero(row == 0).flatten().tolist()
        if not starts or starts[0] != 0:
            starts = [0] + starts
        bounds = starts + [length]
        out.append([(a, b) for a, b in zip(bounds[:-1], bounds[1:]) if b > a])
    return out


KERNEL_ARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
"""The keyword arguments `varlen_inputs` adds to the model's call (transformers' names, passed to every layer)."""

FLASH_DTYPES = (torch.float16, torch.bfloat16)
FLASH_MAX_HEAD_DIM = 256
"""Flash attention's limits (torch's aten/src/ATen/native/transformers/cuda/flash_attn: fp16/bf16, head size a
multiple of 8 up to 256); other inputs keep the segment loop."""


def segment_bucket(segments: int) -> int:
    """The padded count of segments: the next power of two, so a compiled layer sees about log2(rows * length)
    `cu_seqlens` shapes in all instead of one per count."""
    return 1 << max(segments - 1, 0).bit_length()


def packed_cu_seqlens(position_ids: torch.Tensor, bucket: bool = True) -> torch.Tensor:
    """Cumulative segment bounds (int32) of all rows flattened into one sequence, as `varlen_attn` takes them.

    A segment begins at each row's first token and wherever a position id is 0 (the same bounds as `_segments`);
    the last bound is rows x length. With `bucket`, the count of segments is padded to `segment_bucket` by
    repeating the last bound: empty segments, which attend to nothing and produce no output. Computed on the
    device the position ids are on: call it on the CPU copy (no host sync)."""
    length = position_ids.shape[-1]
    starts = position_ids.reshape(-1, length) == 0
    starts[:, 0] = True
    bounds = torch.nonzero(starts.reshape(-1)).flatten()
    total = torch.tensor([starts.numel()], dtype=bounds.dtype, device=bounds.device)
    pad = segment_bucket(bounds.numel()) - bounds.numel() if bucket else 0
    return torch.cat([bounds, total.expand(pad + 1)]).to(torch.int32)


_LAST_INPUTS: list = [None, None, None]
"""The batch `varlen_inputs` answered last: its position ids, (their version counter, rows), the answer."""


def varlen_inputs(model, position_ids: torch.Tensor | None, rows: int, device) -> dict:
    """The keyword arguments that let `model`'s packed attention run as one kernel call (`KERNEL_ARGS`), or {}
    when its attention is not fitune's varlen, there are no position ids or the kernel cannot run on `device`
    (the segment loop needs none of them). `rows`: the batch's rows (one row of position ids serves them all).

    Computed where `position_ids` are (pass the CPU copy: no host sync; the caller moves the tensor to the
    model's device), once per batch: a second call with the same tensor returns the same answer."""
    if position_ids is None or not kernel_available(device) or _attn_implementation(model) != NAME:
        return {}
    last_ids, last_key, last = _LAST_INPUTS
    if last_ids is position_ids and last_key == (position_ids._version, rows):
        return dict(last)
    settle_gqa(device)  # before the first traced layer reads it
    length = int(position_ids.shape[-1])
    cu = packed_cu_seqlens(position_ids.reshape(-1, length).expand(rows, length))
    out = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": length, "max_length_k": length}
    _LAST_INPUTS[:] = [position_ids, (position_ids._version, rows), out]
    return dict(out)


def _attn_implementation(model) -> str | None:
    """The attention implementation of `model` under its wrappers (DDP / DeepSpeed `.module`, PEFT)."""
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return getattr(getattr(base, "config", None), "_attn_implementation", None)


_VARLEN_ATTN: list = []
"""torch's `varlen_attn` once `load_kernel` found it (a module global: a traced layer reads it without importing)."""

_KERNEL_GQA: list = ["keyword"]
"""How that `varlen_attn` is given K and V with fewer heads than the query (grouped-query attention):
"keyword": it takes `enable_gqa` (torch 2.13); "native": it has no such keyword (torch 2.11: "unexpected keyword
argument 'enable_gqa'" on the GPU machine) but computes GQA from the fewer heads as flash attention does (checked
once on the device, `settle_gqa`); "repeat": K and V are repeated to the query's heads before the call (their
copies are saved for the backward: 2 x (heads - kv_heads) x head size bytes per token per layer more than the
estimate counts); "unknown" until `settle_gqa` has run. Read as a constant by a traced layer."""


def takes_keyword(fn, name: str) -> bool:
    """Whether `fn` accepts the keyword argument `name` (by name, or through **kwargs)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # no signature to read: assume the documented one
        return True
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def load_kernel():
    """torch's `varlen_attn` (torch >= 2.10), or None on an older torch."""
    if not _VARLEN_ATTN:
        try:
            from torch.nn.attention.varlen import varlen_attn
        except ImportError:
            varlen_attn = None
        _VARLEN_ATTN.append(varlen_attn)
        takes = varlen_attn is None or takes_keyword(varlen_attn, "enable_gqa")
        _KERNEL_GQA[0] = "keyword" if takes else "unknown"
    return _VARLEN_ATTN[0]


def settle_gqa(device) -> str:
    """`_KERNEL_GQA` for the kernel on `device`, deciding "native" or "repeat" once where the kernel has no
    `enable_gqa`: one small causal call with K and V of half the query's heads against the same call with them
    repeated, forward and backward. "native" where both agree, else "repeat" (also where the call raises)."""
    if _KERNEL_GQA[0] == "unknown" and _VARLEN_ATTN and _VARLEN_ATTN[0] is not None:
        _KERNEL_GQA[0] = "native" if _native_gqa_agrees(_VARLEN_ATTN[0], device) else "repeat"
    return _KERNEL_GQA[0]


def _native_gqa_agrees(kernel, device) -> bool:
    """Whether `kernel(q, k, v)` with 2 kv heads for 4 query heads equals the call with k and v repeated (query
    head i reads kv head i // 2), in its output and its input gradients."""
    gen = torch.Generator().manual_seed(0)
    tokens, d = 24, 64
    q0, k0, v0 = (torch.randn(tokens, h, d, generator=gen) for h in (4, 2, 2))
    weight = torch.randn(tokens, 4, d, generator=gen).to(device, torch.bfloat16)
    cu = torch.tensor([0, 9, 24], dtype=torch.int32, device=device)

    def attend(repeat: bool):
        q, k, v = (t.to(device, torch.bfloat16).requires_grad_() for t in (q0, k0, v0))
        kk, vv = (t.repeat_interleave(2, dim=1) for t in (k, v)) if repeat else (k, v)
        with torch.enable_grad():
            out = kernel(q, kk, vv, cu, cu, 15, 15, window_size=(-1, 0))
            grads = torch.autograd.grad(out, (q, k, v), weight)
        return [out.detach().float()] + [g.float() for g in grads]

    want = attend(repeat=True)
    try:
        got = attend(repeat=False)
    except Exception:  # noqa: BLE001 - any failure of the grouped call means: repeat K and V
        return False
    return all(torch.allclose(a, b, atol=2e-2, rtol=2e-2) for a, b in zip(got, want))


KERNEL_ENV = "FITUNE_VARLEN_KERNEL"
"""Set to 0 (or no / false / off, as FITUNE_PROGRESS reads them) to turn the kernel path off (the segment loop then runs on the GPU too). On by default since it ran on
a GPU as the segment loop does (H100, torch 2.11): outputs and gradients equal to the loop's (largest difference 0)
in bench/packed_attention.py, the `gpu` test of tests/test_varlen_kernel.py passed, and `fitune train` on the
real-length workload had the loop's losses to the third decimal at 6x its speed
(bench/results/issue32/packed)."""


def kernel_available(device) -> bool:
    """Whether the kernel path is on (`KERNEL_ENV` not 0) and torch's `varlen_attn` can run on `device` (a CUDA
    device, torch >= 2.10)."""
    off = os.environ.get(KERNEL_ENV, "").strip().lower() in ("0", "no", "false", "off", "never")
    return not off and torch.device(device).type == "cuda" and load_kernel() is not None


def _kernel(query: torch.Tensor):
    """The varlen kernel where it runs this query (CUDA, flash attention's dtypes and head sizes), else None.
    (The CPU tests put a reference in its place.)"""
    d = query.shape[-1]
    if not query.is_cuda or query.dtype not in FLASH_DTYPES or d % 8 or d > FLASH_MAX_HEAD_DIM or not _VARLEN_ATTN:
        return None
    return _VARLEN_ATTN[0]


def varlen_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                             scaling: float | None = None, is_causal: bool | None = None, **kwargs):
    """transformers attention-interface function: query (b, heads, s, d), key/value (b, kv_heads, s, d).

    With `varlen_inputs`' arguments and a kernel for the query: one `varlen_attn` call (traceable, no graph
    break); otherwise the segment loop (eager under compile)."""
    packed = {k: kwargs.pop(k, None) for k in KERNEL_ARGS}
    kernel = _kernel(query)
    if (kernel is not None and packed["cu_seq_lens_q"] is not None and attention_mask is None and not dropout
            and query.shape[2] == key.shape[2]):
        return _kernel_forward(kernel, query, key, value, packed["cu_seq_lens_q"], packed["cu_seq_lens_k"],
                               packed["max_length_q"], packed["max_length_k"], scaling)
    return _segment_loop_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                 is_causal=is_causal, **kwargs)


def _kernel_forward(kernel, query, key, value, cu_q, cu_k, max_q: int, max_k: int, scaling: float | None):
    """All rows as one packed sequence through `kernel` (varlen_attn's signature): causal within each segment of
    `cu_q` / `cu_k`. Returns transformers' (output (b, s, heads, d), None)."""
    b, heads, s, d = query.shape
    kv_heads = key.shape[1]
    # (b, heads, s, d) -> (b * s, heads, d), tokens of all rows in a row: the projections' memory layout, so a
    # view where RoPE kept it (one copy otherwise)
    q = query.transpose(1, 2).reshape(b * s, heads, d)
    k = key.transpose(1, 2).reshape(b * s, kv_heads, d)
    v = value.transpose(1, 2).reshape(b * s, kv_heads, d)
    gqa = {}
    mode = _KERNEL_GQA[0]
    if kv_heads != heads and mode == "keyword":
        gqa = {"enable_gqa": True}  # GQA without repeating K and V
    elif kv_heads != heads and mode != "native":  # no GQA in this varlen_attn: each kv head repeated for its group
        k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))  # query head i reads kv head i // group
    out = kernel(q, k, v, cu_q, cu_k, max_q, max_k, scale=scaling, window_size=(-1, 0), **gqa)  # (-1, 0): causal
    return out.view(b, s, heads, d), None


@torch.compiler.disable  # a compiled layer (compile: layers) runs this eagerly: the segments are data-dependent
def _segment_loop_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                          scaling: float | None = None, is_causal: bool | None = None, **kwargs):
    """The packed rows segment by segment (SDPA is_causal per segment): the CPU / older-torch path."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    position_ids = kwargs.pop("position_ids", None)
    if attention_mask is not None or position_ids is None or query.shape[2] != key.shape[2]:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    if position_ids.shape[0] != query.shape[0]:  # one row of positions for the whole batch
        position_ids = position_ids.expand(query.shape[0], -1)
    rows = []
    for r, segments in enumerate(_segments(position_ids)):
        if len(segments) == 1:
            out, _ = sdpa_attention_forward(module, query[r:r + 1], key[r:r + 1], value[r:r + 1], None,
                                            dropout=dropout, scaling=scaling, is_causal=True, **kwargs)
        else:
            parts = [sdpa_attention_forward(module, query[r:r + 1, :, a:b], key[r:r + 1, :, a:b],
                                            value[r:r + 1, :, a:b], None, dropout=dropout, scaling=scaling,
                                            is_causal=True, **kwargs)[0] for a, b in segments]
            out = torch.cat(parts, dim=1)
        rows.append(out)
    return (rows[0] if len(rows) == 1 else torch.cat(rows, dim=0)), None


def varlen_supported(config) -> bool:
    """False for models whose attention uses a sliding window (segments longer than it would see too much)."""
    window = getattr(config, "sliding_window", None)
    if getattr(config, "use_sliding_window", True) is False:
        window = None
    layer_types = getattr(config, "layer_types", None) or ()
    return window is None and "sliding_attention" not in layer_types


def enable_varlen_attention(model) -> bool:
    """Make `model` (PEFT-wrapped or not) run packed rows segment by segment. Returns False (and changes nothing)
    for a model with a sliding window or an attention other than sdpa."""
    from transformers import AttentionInterface

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = base.config
    if getattr(config, "_attn_implementation", None) not in ("sdpa", NAME) or not varlen_supported(config):
        return False
    AttentionInterface.register(NAME, varlen_attention_forward)
    load_kernel()  # here, eagerly: the traced attention only reads the module global
    base.set_attn_implementation(NAME)
    return True

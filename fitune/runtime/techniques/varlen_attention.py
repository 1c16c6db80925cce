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

Under `compile: layers` this function runs eagerly (torch.compiler.disable): its segment bounds come from the data,
and traced they would recompile the layer for every new row layout (measured on the H200: 2,037 tokens/s instead of
about 17k, bench/results/peers/real_length.jsonl). The compiled layer is then two graphs, before and after attention.
"""

from __future__ import annotations

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


@torch.compiler.disable  # a compiled layer (compile: layers) runs this eagerly: the segments are data-dependent
def varlen_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                             scaling: float | None = None, is_causal: bool | None = None, **kwargs):
    """transformers attention-interface function: query (b, heads, s, d), key/value (b, kv_heads, s, d)."""
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
    base.set_attn_implementation(NAME)
    return True

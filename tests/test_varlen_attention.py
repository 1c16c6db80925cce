"""Packed rows attended example by example (no mask) against transformers' block-diagonal mask and against the
examples run one at a time: logits, loss and every LoRA gradient."""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

from fitune.runtime.model import wrap_lora  # noqa: E402
from fitune.runtime.techniques.varlen_attention import (NAME, _segments, enable_varlen_attention,  # noqa: E402
                                                       varlen_supported)

CFG = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
           vocab_size=120)


def _model():
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CFG, attn_implementation="sdpa"))
    model = wrap_lora(model, 4, "all-linear")
    for n, p in model.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.05)
    return model.train()


def _packed():
    torch.manual_seed(1)
    lengths = [[5, 9, 2], [16]]  # two rows of 16 tokens: three examples, then one
    ids = torch.randint(0, 120, (2, 16))
    pos = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths])
    return ids, pos, lengths


def _run(model, ids, pos):
    out = model(input_ids=ids, position_ids=pos, labels=ids, use_cache=False)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return out.logits.detach(), out.loss.detach(), grads


def test_segments_follow_restarting_position_ids():
    _, pos, lengths = _packed()
    assert _segments(pos) == [[(0, 5), (5, 14), (14, 16)], [(0, 16)]]


def test_varlen_equals_the_block_diagonal_mask_and_separate_examples():
    ids, pos, lengths = _packed()
    ref_logits, ref_loss, ref_grads = _run(_model(), ids, pos)  # transformers' masked path
    model = _model()
    assert enable_varlen_attention(model)
    assert model.get_base_model().config._attn_implementation == NAME
    logits, loss, grads = _run(model, ids, pos)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss, ref_loss)
    for n, g in ref_grads.items():
        torch.testing.assert_close(grads[n], g, rtol=1e-4, atol=1e-6)
    # each example alone gives the same logits as its segment of the packed row
    single = _model()
    with torch.no_grad():
        start = 0
        for n in lengths[0]:
            alone = single(input_ids=ids[:1, start:start + n], use_cache=False).logits
            torch.testing.assert_close(logits[:1, start:start + n], alone, rtol=1e-5, atol=1e-5)
            start += n


def test_unpacked_rows_are_plain_causal_attention():
    torch.manual_seed(2)
    ids = torch.randint(0, 120, (2, 12))
    ref = _model()(input_ids=ids, use_cache=False).logits
    model = _model()
    enable_varlen_attention(model)
    torch.testing.assert_close(model(input_ids=ids, use_cache=False).logits, ref, rtol=1e-5, atol=1e-5)


def test_sliding_window_models_keep_the_masked_path():
    cfg = transformers.MistralConfig(**CFG, sliding_window=8, attn_implementation="sdpa")
    assert not varlen_supported(cfg)
    model = transformers.MistralForCausalLM(cfg)
    assert not enable_varlen_attention(model)
    assert model.config._attn_implementation == "sdpa"

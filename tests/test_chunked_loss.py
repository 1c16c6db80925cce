"""Chunked linear + cross-entropy against the plain PyTorch computation: forward and gradients."""

import pytest

torch = pytest.importorskip("torch")

from fitune.runtime.techniques.chunked_loss import (  # noqa: E402
    causal_lm_chunked_loss,
    chunked_linear_cross_entropy,
    trained_rows,
)


def _reference(hidden, weight, labels, num_items, softcap=None):
    logits = (hidden @ weight.t()).float()
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), shifted.reshape(-1),
                                             ignore_index=-100, reduction="sum")
    return loss / num_items


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("softcap", [None, 30.0])
@pytest.mark.parametrize("train_weight", [False, True])
@pytest.mark.parametrize("compiled", [False, "eager-function", True])
@pytest.mark.parametrize("only_trained", [False, True])
def test_forward_and_gradients_match(dtype, tol, softcap, train_weight, compiled, only_trained, monkeypatch):
    """Eager in-place chunks; `chunk_loss_and_grad` run uncompiled (its arithmetic); and compiled by Inductor (the
    CPU backend here: `compile: layers` runs it on the GPU with Triton). `only_trained`: the head runs only at the
    trained positions (`trained_rows`, as `fitune train` passes them); the masked positions' gradient is zero."""
    if compiled == "eager-function":  # the compiled path's function, without the compiler
        from fitune.runtime.techniques import chunked_loss

        monkeypatch.setattr(chunked_loss, "_compiled_chunk", lambda: chunked_loss.chunk_loss_and_grad)
    elif compiled:
        torch._dynamo.reset()
    torch.manual_seed(0)
    b, s, h, v = 3, 37, 16, 101
    hidden = torch.randn(b, s, h, dtype=dtype, requires_grad=True)
    weight = (torch.randn(v, h) / h**0.5).to(dtype).requires_grad_(train_weight)
    labels = torch.randint(0, v, (b, s))
    labels[0, :5] = -100  # masked prompt
    labels[2, -3:] = -100  # padding
    n = int((torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:] != -100).sum())
    ref = _reference(hidden, weight, labels, n, softcap)
    ref.backward()
    g_ref_h = hidden.grad.clone()
    g_ref_w = weight.grad.clone() if train_weight else None
    hidden.grad = None
    if train_weight:
        weight.grad = None
    rows = trained_rows(labels) if only_trained else None
    if only_trained:
        assert rows.shape[0] == n < b * s  # 3 rows' last positions, the prompt's 5 (4 shifted) and the padding's 3
    out = chunked_linear_cross_entropy(hidden, weight, labels, n, chunk_tokens=16, softcap=softcap,
                                       compiled=bool(compiled), rows=rows)
    (out * 2).backward()  # a non-unit upstream gradient
    if only_trained:
        assert hidden.grad[0, :4].abs().sum() == 0 and hidden.grad[:, -1].abs().sum() == 0
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(hidden.grad.float(), 2 * g_ref_h.float(), rtol=tol, atol=tol)
    if train_weight:
        torch.testing.assert_close(weight.grad.float(), 2 * g_ref_w.float(), rtol=tol, atol=tol)


def test_trained_rows_count_the_loss_when_no_count_is_given_and_a_batch_without_trained_tokens_adds_zero():
    torch.manual_seed(0)
    hidden = torch.randn(2, 9, 8, requires_grad=True)
    weight = torch.randn(30, 8) / 8**0.5
    labels = torch.randint(0, 30, (2, 9))
    labels[1, :6] = -100
    whole = chunked_linear_cross_entropy(hidden, weight, labels, chunk_tokens=4)
    picked = chunked_linear_cross_entropy(hidden, weight, labels, chunk_tokens=4, rows=trained_rows(labels))
    torch.testing.assert_close(picked, whole)  # the mean over the same 8 + 3 trained positions
    none = torch.full((2, 9), -100)
    assert trained_rows(none).shape == (0,)
    out = chunked_linear_cross_entropy(hidden, weight, none, chunk_tokens=4, rows=trained_rows(none))
    out.backward()
    assert out.item() == 0 and hidden.grad.abs().sum() == 0


def test_whole_model_loss_and_lora_gradients_match_transformers():
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("peft")
    from fitune.runtime.model import wrap_lora

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=300)
    model = wrap_lora(transformers.LlamaForCausalLM(cfg), 8, ["q_proj", "v_proj"])
    for n, p in model.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.02)  # non-zero B so every adapter weight gets a gradient
    ids = torch.randint(0, 300, (2, 24))
    labels = ids.clone()
    labels[:, :4] = -100
    ref = model(input_ids=ids, labels=labels, use_cache=False).loss
    ref.backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    loss = causal_lm_chunked_loss(model, ids, labels, chunk_tokens=10, use_cache=False)
    loss.backward()
    torch.testing.assert_close(loss, ref)
    for n, p in model.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(p.grad, ref_grads[n], rtol=1e-4, atol=1e-6)

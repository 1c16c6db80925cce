"""Offloaded and selective checkpointing against the plain computation: loss and every LoRA gradient."""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

from fitune.runtime.model import enable_checkpointing, wrap_lora  # noqa: E402
from fitune.runtime.techniques.offload import enable_offloaded_checkpointing, enable_selective_checkpointing  # noqa: E402


def _model(seed=0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=200)
    model = wrap_lora(transformers.LlamaForCausalLM(cfg), 8, ["q_proj", "v_proj", "down_proj"])
    for n, p in model.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.02)
    model.train()
    return model


def _loss_and_grads(model, ids):
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def _count_layer_calls(model):
    calls = []
    for layer in model.base_model.model.model.layers:
        layer.register_forward_pre_hook(lambda m, a, i=len(calls): calls.append(m))
    return calls


@pytest.mark.parametrize("mode", ["offload", "selective:1", "selective:3", "full"])
def test_same_loss_and_gradients_as_without_checkpointing(mode):
    ids = torch.randint(0, 200, (2, 24))
    ref_loss, ref_grads = _loss_and_grads(_model(), ids)
    model = _model()
    enable_checkpointing(model)
    if mode == "offload":
        manager = enable_offloaded_checkpointing(model)
    elif mode.startswith("selective"):
        enable_selective_checkpointing(model, int(mode.split(":")[1]))
    calls = _count_layer_calls(model)
    loss, grads = _loss_and_grads(model, ids)
    torch.testing.assert_close(loss, ref_loss)
    for n, g in ref_grads.items():
        torch.testing.assert_close(grads[n], g, rtol=1e-5, atol=1e-7)
    recomputed = {"offload": 3, "selective:1": 1, "selective:3": 3, "full": 3}[mode]
    assert len(calls) == 3 + recomputed  # every layer once, the checkpointed ones once more in backward
    if mode == "offload":
        assert manager.contexts == []  # every host copy released after its backward


def test_offload_keeps_only_host_copies_between_forward_and_backward():
    model = _model()
    enable_checkpointing(model)
    manager = enable_offloaded_checkpointing(model)
    ids = torch.randint(0, 200, (2, 24))
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    assert len(manager.contexts) == 3 and all(c.host is not None and c.restored is None for c in manager.contexts)
    loss.backward()
    assert manager.contexts == []


def test_pinned_pool_lends_exact_size_buffers_and_reuses_them_across_steps():
    """Offloaded checkpoints' host buffers: exact size (no power-of-two rounding), one set kept across steps, grown
    (the smaller ones unlocked) only when a longer batch comes; every buffer made is locked once and unlocked once."""
    import torch

    from fitune.runtime.techniques.offload import PinnedPool

    locked, unlocked = [], []
    pool = PinnedPool(lock=lambda b: locked.append(b.numel()), unlock=lambda b: unlocked.append(b.numel()))
    shape = (1, 3, 5)  # 15 bf16 values: 30 bytes, which a power-of-two allocator would round to 32
    for _step in range(3):
        lent = [pool.take(shape, torch.bfloat16) for _layer in range(4)]
        for host, _ in lent:
            assert host.shape == shape and host.dtype == torch.bfloat16
            host.fill_(1.5)
        assert len({b.data_ptr() for _, b in lent}) == 4  # no buffer lent twice at once
        for _, buffer in lent:
            pool.give_back(buffer)
    assert locked == [30] * 4 and unlocked == [] and pool.registered_bytes == 120
    host, buffer = pool.take((2, 3, 5), torch.bfloat16)  # a longer batch: a bigger buffer, the short ones unlocked
    assert buffer.numel() == 60 and unlocked == [30] * 4 and pool.registered_bytes == 60
    pool.give_back(buffer)
    small, again = pool.take(shape, torch.bfloat16)  # a shorter batch fits in the big buffer (no new lock)
    assert again is buffer and small.numel() == 15 and locked == [30] * 4 + [60]
    pool.close()
    assert unlocked == [30] * 4 + [60] and pool.registered_bytes == 0


def test_pinned_pool_falls_back_to_pytorchs_pinned_blocks_where_page_locking_fails(caplog):
    import torch

    from fitune.runtime.techniques.offload import PinnedPool

    def refuse(buffer):
        raise RuntimeError("cudaHostRegister of 30 host bytes failed (CUDA error 2)")

    made = []
    pool = PinnedPool(lock=refuse, unlock=lambda b: None,
                      pinned=lambda shape, dtype: made.append(shape) or torch.zeros(shape, dtype=dtype))
    with caplog.at_level("WARNING"):
        for _ in range(2):
            host, buffer = pool.take((1, 3, 5), torch.bfloat16)
            assert host.shape == (1, 3, 5) and buffer is None
            pool.give_back(buffer)  # nothing to give back
    assert pool.fell_back and made == [(1, 3, 5)] * 2 and pool.registered_bytes == 0
    assert sum("using PyTorch's pinned allocator" in r.getMessage() for r in caplog.records) == 1  # said once


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the side stream and its allocator)")
def test_offload_on_the_gpu_is_exact_while_the_gpu_lags_the_host():  # pragma: no cover - GPU only
    """On CUDA each restored input is filled on the side stream while the compute stream may still read the block
    the allocator hands out: with every layer's input the same size, a block freed by one layer's backward is what
    the next prefetch gets. Each layer's forward here first makes the GPU sleep, so the host runs ahead of it, and
    the loss and gradients must still be those of the run without checkpointing."""
    def model():
        torch.manual_seed(0)
        cfg = transformers.LlamaConfig(hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                                       num_attention_heads=8, num_key_value_heads=2, vocab_size=256)
        m = wrap_lora(transformers.LlamaForCausalLM(cfg), 8, ["q_proj", "v_proj", "down_proj"]).cuda()
        for n, p in m.named_parameters():
            if "lora_B" in n:
                torch.nn.init.normal_(p, std=0.02)
        m.train()
        for layer in m.base_model.model.model.layers:
            layer.register_forward_pre_hook(lambda mod, args: torch.cuda._sleep(20_000_000))
        return m

    ids = torch.randint(0, 256, (2, 1024), device="cuda")
    ref_loss, ref_grads = _loss_and_grads(model(), ids)
    m = model()
    enable_checkpointing(m)
    enable_offloaded_checkpointing(m)
    for _ in range(2):  # the second step reuses the pool's host buffers and the allocator's cached blocks
        m.zero_grad(set_to_none=True)
        loss, grads = _loss_and_grads(m, ids)
        torch.cuda.synchronize()
        torch.testing.assert_close(loss, ref_loss)
        for n, g in ref_grads.items():
            torch.testing.assert_close(grads[n], g, rtol=1e-4, atol=1e-6, msg=n)

"""Tiled MLP against the plain MLP: loss and every LoRA gradient, with and without checkpointing."""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

from tiny import init_lora_b, loss_and_grads  # noqa: E402

from fitune.runtime.model import enable_checkpointing, wrap_lora  # noqa: E402
from fitune.runtime.techniques.tiled_mlp import enable_tiled_mlp  # noqa: E402


def _model(targets):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=200)
    model = wrap_lora(transformers.LlamaForCausalLM(cfg), 8, targets)
    init_lora_b(model, std=0.02)
    return model.train()


_run = loss_and_grads


@pytest.mark.parametrize("targets", [["q_proj", "v_proj"], "all-linear"])
@pytest.mark.parametrize("ckpt", [False, True])
def test_tiled_mlp_is_exact(targets, ckpt):
    ids = torch.randint(0, 200, (2, 30))
    ref_loss, ref = _run(_model(targets), ids)
    model = _model(targets)
    if ckpt:
        enable_checkpointing(model)
    assert enable_tiled_mlp(model, tile_tokens=16) == 2  # 60 tokens: tiles of 16, 16, 16, 12
    loss, grads = _run(model, ids)
    torch.testing.assert_close(loss, ref_loss)
    for n, g in ref.items():
        torch.testing.assert_close(grads[n], g, rtol=1e-5, atol=1e-7)


def test_the_estimator_models_the_runners_tile_and_chunk():
    import importlib

    from fitune.memory import loss as loss_terms
    from fitune.runtime.techniques import chunked_loss, tiled_mlp

    est = importlib.import_module("fitune.memory.estimate")  # the module, not the function of the same name
    assert est.TILE_TOKENS == tiled_mlp.TILE_TOKENS
    assert loss_terms.CHUNK_TOKENS == chunked_loss.CHUNK_TOKENS


def test_tiled_mlp_tiles_without_grad_too():
    """A checkpointed layer's first forward runs under no_grad: the MLP still works a tile at a time, so no
    intermediate of the whole sequence exists (the estimator models the same)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    model = _model(["q_proj", "v_proj"])
    mlp = model.get_base_model().model.layers[0].mlp
    x = torch.randn(1, 60, 64)
    with torch.no_grad():
        ref = mlp(x)
    enable_tiled_mlp(model, tile_tokens=16)
    largest = []

    class Sizes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and out.shape[-1] == 160:  # an intermediate: tokens x 160
                largest.append(out.numel() // 160)
            return out

    with torch.no_grad(), Sizes():
        got = mlp(x)
    torch.testing.assert_close(got, ref)
    assert 16 in largest and 60 not in largest  # one tile's tokens at a time, never all 60

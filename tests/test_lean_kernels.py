"""Lean RMSNorm and lean LoRA against the modules they replace: forward and every gradient (CPU, fp32 and bf16)."""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

from tiny import init_lora_b, loss_and_grads  # noqa: E402

from fitune.runtime.model import enable_checkpointing, wrap_lora  # noqa: E402
from fitune.runtime.techniques.lean_lora import enable_lean_lora  # noqa: E402
from fitune.runtime.techniques.lean_norm import enable_lean_norm, is_llama_rms_norm  # noqa: E402

CFG = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
           vocab_size=200)


def _model(targets, dtype=torch.float32, family="llama"):
    torch.manual_seed(0)
    cfg_cls, model_cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                          "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)}[family]
    model = model_cls(cfg_cls(**CFG)).to(dtype)
    for m in model.modules():  # non-trivial norm weights, so their gradients are checked too
        if type(m).__name__.endswith("RMSNorm"):
            torch.nn.init.normal_(m.weight, mean=1.0, std=0.1)
    if targets is None:
        return model.train()
    model = wrap_lora(model, 8, targets)
    init_lora_b(model, std=0.05)
    return model.train()


_run = loss_and_grads


def _compare(ref, got, rtol, atol):
    ref_loss, ref_grads = ref
    loss, grads = got
    torch.testing.assert_close(loss, ref_loss, rtol=rtol, atol=atol)
    assert grads.keys() == ref_grads.keys() and ref_grads
    for n, g in ref_grads.items():
        torch.testing.assert_close(grads[n], g, rtol=rtol, atol=atol, msg=lambda m, n=n: f"{n}: {m}")


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_lean_norm_forward_is_bit_identical_and_backward_matches(family):
    torch.manual_seed(1)
    model = _model(None, family=family)
    norms = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]
    assert norms and all(is_llama_rms_norm(m) for m in norms)
    x = torch.randn(3, 37, norms[0].weight.shape[0], requires_grad=True)
    ref_y = norms[0](x)
    g = torch.randn_like(ref_y)
    ref_gx, ref_gw = torch.autograd.grad(ref_y, (x, norms[0].weight), g)
    n = enable_lean_norm(model, tile_tokens=16)  # 111 rows: tiles of 16 and a remainder
    assert n == len(norms)
    y = norms[0](x)
    assert torch.equal(y, ref_y)
    gx, gw = torch.autograd.grad(y, (x, norms[0].weight), g)
    torch.testing.assert_close(gx, ref_gx, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gw, ref_gw, rtol=1e-5, atol=1e-5)


def test_lean_norm_in_bf16_is_exact_forward_and_close_backward():
    model = _model(None, dtype=torch.bfloat16)
    norm = model.model.norm
    x = torch.randn(2, 50, 64, dtype=torch.bfloat16, requires_grad=True)
    ref_y = norm(x)
    g = torch.randn_like(ref_y)
    (ref_gx,) = torch.autograd.grad(ref_y, (x,), g)
    enable_lean_norm(model, tile_tokens=32)
    y = norm(x)
    assert torch.equal(y, ref_y)
    (gx,) = torch.autograd.grad(y, (x,), g)
    torch.testing.assert_close(gx.float(), ref_gx.float(), rtol=2e-2, atol=2e-2)  # bf16 rounding of the chain


def test_lean_norm_leaves_other_norms_alone():
    gemma = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**CFG, head_dim=16))
    assert not any(is_llama_rms_norm(m) for m in gemma.modules())
    with pytest.raises(ValueError, match="no Llama-style RMSNorm"):
        enable_lean_norm(gemma)


@pytest.mark.parametrize("targets", [["q_proj", "v_proj"], "all-linear"])
@pytest.mark.parametrize("ckpt", [False, True])
def test_lean_lora_and_norm_match_peft_in_fp32(targets, ckpt):
    ids = torch.randint(0, 200, (2, 30))
    ref = _run(_model(targets), ids)
    model = _model(targets)
    if ckpt:
        enable_checkpointing(model)
    n_lora = enable_lean_lora(model)
    assert n_lora == (4 if targets != "all-linear" else 14)
    enable_lean_norm(model, tile_tokens=16)
    _compare(ref, _run(model, ids), rtol=1e-4, atol=1e-6)


def test_lean_lora_matches_peft_in_bf16():
    """bf16 model, fp32 adapters (PEFT's default): PEFT computes the branch in fp32, lean LoRA in bf16."""
    ids = torch.randint(0, 200, (2, 30))
    ref = _run(_model("all-linear", dtype=torch.bfloat16), ids)
    model = _model("all-linear", dtype=torch.bfloat16)
    enable_lean_lora(model)
    enable_lean_norm(model)
    got = _run(model, ids)
    assert all(g.dtype == torch.float32 for g in got[1].values())
    torch.testing.assert_close(got[0], ref[0], rtol=1e-2, atol=1e-2)
    for n, g in ref[1].items():  # gradient direction and size within bf16 rounding
        cos = torch.nn.functional.cosine_similarity(got[1][n].flatten(), g.flatten(), dim=0)
        assert cos > 0.99, n
        assert abs(got[1][n].norm() / g.norm() - 1) < 0.05, n


def test_lean_lora_branch_is_built_from_plain_autograd_ops():
    """No custom autograd Function in the branch: inside a compiled layer on CUDA (torch 2.11) the earlier Function
    was traced with a zero gradient for its output, and every LoRA gradient came out zero while the CPU parity tests
    passed (bench/results/speed/zero_grads/). The branch's backward graph, walked from its output, has only
    PyTorch's own nodes, and its gradients reach A and B."""
    from fitune.runtime.techniques.lean_lora import lora_branch

    torch.manual_seed(0)
    x = torch.randn(3, 5, 16, dtype=torch.bfloat16, requires_grad=True)
    a = torch.randn(4, 16, requires_grad=True)
    b = torch.randn(8, 4, requires_grad=True)
    y = lora_branch(x, a, b, 2.0)
    custom = torch.autograd.function.BackwardCFunction  # the node class of every custom Function
    names, todo = set(), [y.grad_fn]
    while todo:
        node = todo.pop()
        if node is not None and type(node).__name__ not in names:
            names.add(type(node).__name__)
            assert not isinstance(node, custom), type(node).__name__
            todo.extend(n for n, _ in node.next_functions)
    assert "MmBackward0" in names or "AddmmBackward0" in names or "UnsafeViewBackward0" in names, names
    assert y.dtype == torch.bfloat16
    y.float().square().sum().backward()
    assert a.grad is not None and a.grad.dtype == torch.float32 and a.grad.abs().sum() > 0
    assert b.grad is not None and b.grad.dtype == torch.float32 and b.grad.abs().sum() > 0
    ref = (x.detach().float() @ a.detach().t() @ b.detach().t()) * 2.0
    assert ((y.detach().float() - ref).norm() / ref.norm()).item() < 1e-2  # bf16 rounding


def test_lean_lora_keeps_peft_forward_when_adapters_are_disabled():
    model = _model(["q_proj", "v_proj"])
    ids = torch.randint(0, 200, (1, 12))
    with model.disable_adapter(), torch.no_grad():
        off_ref = model(input_ids=ids).logits
    enable_lean_lora(model)
    with model.disable_adapter(), torch.no_grad():
        off = model(input_ids=ids).logits
    with torch.no_grad():
        on = model(input_ids=ids).logits
    torch.testing.assert_close(off, off_ref)  # PEFT's path: the base model alone
    assert not torch.allclose(on, off)  # and the adapters act again once enabled


def test_liger_kernels_explain_what_they_need():
    from fitune.errors import ConfigError
    from fitune.setup import TrainSetup
    from fitune.runtime.techniques.fused_kernels import enable_liger_kernels

    with pytest.raises(ConfigError, match="liger"):
        enable_liger_kernels(_model(None))  # no liger-kernel here, or no CUDA GPU: both say what to do
    with pytest.raises(ConfigError, match="both replace RMSNorm"):
        TrainSetup(stack="fitune", kernels="liger", lean_norm=True).validate()
    with pytest.raises(ConfigError, match="use --stack fitune"):
        TrainSetup(kernels="liger").validate()
    with pytest.raises(ConfigError, match="--kernels 'triton' is not one of"):
        TrainSetup(stack="fitune", kernels="triton").validate()


def test_configure_allocator_sets_what_the_setup_needs(monkeypatch):
    from fitune.setup import TrainSetup
    from fitune.runtime.device import configure_allocator

    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    assert configure_allocator(TrainSetup()) == {}
    assert "PYTORCH_CUDA_ALLOC_CONF" not in __import__("os").environ
    offload = TrainSetup(stack="fitune", grad_checkpointing="offload", expandable_segments=True)
    added = configure_allocator(offload)
    import os

    conf = os.environ["PYTORCH_CUDA_ALLOC_CONF"]
    assert "expandable_segments:True" in conf
    assert added == {"expandable_segments": "True"}  # offloaded checkpoints need no pinned-allocator setting
    # what the user set wins
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")
    assert configure_allocator(offload) == {}
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:False"

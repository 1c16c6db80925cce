"""fitune merge of a QLoRA run, on the CPU with a stand-in for bitsandbytes (its dequantize kernels need CUDA):
`dequantize_nf4` frees each NF4 linear as soon as it is replaced (the 8B merge measured on the GPU held every NF4
weight to the end, through bitsandbytes' reference cycle: bench/results/pretrained_load/phases), and a model whose
quantization markers are cleared can be cast with `.to(dtype)` (transformers refuses it for a bitsandbytes model:
the GPU run's "You cannot cast a bitsandbytes model in a new `dtype`")."""

import gc
import sys
import types
import weakref

import pytest

torch = pytest.importorskip("torch")

from fitune.infer.merge import _forget_quantization, dequantize_nf4  # noqa: E402


class FakeLinear4bit(torch.nn.Module):
    """What `dequantize_nf4` reads of bitsandbytes' Linear4bit: in/out features, bias, weight.data / quant_state,
    and the reference cycle bitsandbytes makes (`Params4bit(module=self)`: the weight points back at its module)."""

    def __init__(self, n_in, n_out, seed):
        super().__init__()
        self.in_features, self.out_features = n_in, n_out
        self.weight = torch.nn.Parameter(torch.zeros(1), requires_grad=False)
        self.weight.quant_state = torch.Generator().manual_seed(seed)
        self.weight.module = self
        self.bias = None


def _fake_bitsandbytes(alive_at_each_call: list, refs: list):
    def dequantize_4bit(data, quant_state):
        alive_at_each_call.append(sum(r() is not None for r in refs))
        return torch.randn(8, 4, generator=quant_state)

    bnb = types.ModuleType("bitsandbytes")
    bnb.nn = types.SimpleNamespace(Linear4bit=FakeLinear4bit)
    bnb.functional = types.SimpleNamespace(dequantize_4bit=dequantize_4bit)
    return bnb


def test_each_nf4_linear_is_freed_once_replaced(monkeypatch):
    model = torch.nn.Sequential(*[torch.nn.Sequential(FakeLinear4bit(4, 8, k), torch.nn.ReLU()) for k in range(5)])
    refs = [weakref.ref(layer[0]) for layer in model]
    alive: list = []
    monkeypatch.setitem(sys.modules, "bitsandbytes", _fake_bitsandbytes(alive, refs))
    gc.disable()  # only reference counting frees them: nothing may wait for a collection
    try:
        assert dequantize_nf4(model, torch.bfloat16) == 5
    finally:
        gc.enable()
    assert alive == [5, 4, 3, 2, 1]  # at the k-th dequantize, the k-1 replaced ones are gone
    for k, layer in enumerate(model):
        assert type(layer[0]) is torch.nn.Linear and layer[0].weight.dtype == torch.bfloat16
        expected = torch.randn(8, 4, generator=torch.Generator().manual_seed(k)).to(torch.bfloat16)
        assert torch.equal(layer[0].weight, expected)


def test_a_model_marked_bitsandbytes_casts_once_its_markers_are_cleared():
    transformers = pytest.importorskip("transformers")
    from transformers.utils.quantization_config import QuantizationMethod

    cfg = transformers.LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=1, vocab_size=32)
    model = transformers.LlamaForCausalLM(cfg)
    model.quantization_method = QuantizationMethod.BITS_AND_BYTES
    model.is_quantized = True
    model.config.quantization_config = {"quant_method": "bitsandbytes"}
    with pytest.raises(ValueError, match="cannot cast a bitsandbytes model"):
        model.to(torch.bfloat16)
    _forget_quantization(model)
    model.to(torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert not model.is_quantized and not hasattr(model.config, "quantization_config")

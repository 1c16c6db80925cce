"""ModelSpec / GpuSpec parsing, with sizes worked out by hand."""

import json

import pytest

from fitune.errors import UnknownGpuError, UnknownModelError, UnsupportedArchitectureError
from fitune.specs.gpu import CONSUMER_CONTEXT_BYTES, resolve_gpu
from fitune.specs.model import load_model_spec, model_spec_from_hf_config
from fitune.units import GiB, MiB


def test_llama_31_8b_shapes():
    m = load_model_spec("llama-3.1-8b")
    assert (m.hidden_size, m.num_layers, m.num_heads, m.num_kv_heads, m.head_dim) == (4096, 32, 32, 8, 128)
    assert m.kv_dim == 1024 and m.q_dim == 4096 and not m.tie_word_embeddings
    assert [lin.name for lin in m.linears()] == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def test_qwen25_bias_and_tied_embeddings():
    m = load_model_spec("qwen2.5-1.5b")
    assert m.qkv_bias and not m.o_bias and m.tie_word_embeddings
    assert m.num_kv_heads == 2 and m.head_dim == 128


def test_explicit_head_dim_and_qk_norm():
    m = load_model_spec("qwen3-1.7b")
    assert m.head_dim == 128 and m.q_dim == 16 * 128 and m.qk_norm
    g = load_model_spec("gemma-2-2b")
    assert g.head_dim == 256 and g.q_dim == 2048 != g.hidden_size
    assert g.norms_per_layer == 4 and g.final_logit_softcapping == 30.0
    assert g.sliding_window == 4096 and g.sliding_window_layers == 13


def test_moe_experts_are_not_linear_targets():
    m = load_model_spec("mixtral-8x7b")
    assert m.num_experts == 8 and m.experts_per_token == 2 and m.moe_layers == 32
    assert "gate_proj" not in [lin.name for lin in m.linears(moe_layer=True)]


def test_phi3_fused_projections():
    m = load_model_spec("phi-3-mini")
    names = [lin.name for lin in m.linears()]
    assert names == ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
    assert m.linears()[0].out_features == 3072 * 3


def test_unknown_model_suggests_close_names():
    with pytest.raises(UnknownModelError, match="closest catalog names: llama-3.1-8b"):
        load_model_spec("llama-3.1-8")


def test_config_missing_key_is_named(tmp_path):
    p = tmp_path / "config.json"
    p.write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 10,
                             "intermediate_size": 128}))
    with pytest.raises(UnknownModelError, match="'num_hidden_layers'"):
        load_model_spec(str(p))


def test_model_folder_and_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mamba", "hidden_size": 8}))
    with pytest.raises(UnsupportedArchitectureError, match="--engine trace"):
        load_model_spec(str(tmp_path))


def test_gpu_catalog_budget_and_memory_amounts():
    g = resolve_gpu("rtx4090")
    assert g.total_bytes == 24564 * MiB
    assert g.allocator_budget_bytes == 24564 * MiB - CONSUMER_CONTEXT_BYTES
    assert abs(g.allocator_budget_bytes - 23.4 * GiB) < MiB
    assert resolve_gpu("23.4GiB").allocator_budget_bytes == int(round(23.4 * GiB))
    assert resolve_gpu("24576MiB").allocator_budget_bytes == 24 * GiB


def test_gpu_errors():
    with pytest.raises(UnknownGpuError, match="closest: rtx4090"):
        resolve_gpu("rtx4090x")
    with pytest.raises(UnknownGpuError, match="1024-based"):
        resolve_gpu("7GB")  # no card is sold with 7 GB; `24GB` is a card (tests/test_gpu_names.py)


def test_spec_from_hf_config_defaults():
    m = model_spec_from_hf_config({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
                                   "num_attention_heads": 4, "vocab_size": 100, "intermediate_size": 128})
    assert m.num_kv_heads == 4 and m.head_dim == 16 and m.sliding_window is None

"""config.json dicts the trace engine is exercised on besides the catalog's seed models.

`PHI3_MINI_4K_INSTRUCT` is microsoft/Phi-3-mini-4k-instruct's config.json (the values that shape the model:
hidden 3072, intermediate 8192, 32 layers, 32 attention heads, 32 KV heads, vocab 32064; the attention
projections are one fused `qkv_proj` and the MLP's gate and up projections one fused `gate_up_proj`).
"""

PHI3_MINI_4K_INSTRUCT: dict = {
    "architectures": ["Phi3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 1,
    "embd_pdrop": 0.0,
    "eos_token_id": 32000,
    "hidden_act": "silu",
    "hidden_size": 3072,
    "initializer_range": 0.02,
    "intermediate_size": 8192,
    "max_position_embeddings": 4096,
    "model_type": "phi3",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 32,
    "original_max_position_embeddings": 4096,
    "pad_token_id": 32000,
    "resid_pdrop": 0.0,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 10000.0,
    "sliding_window": 2047,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 32064,
}

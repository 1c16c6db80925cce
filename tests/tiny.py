"""Tiny models, tokenizers and data sets that tests build themselves (no downloads)."""

from __future__ import annotations

import json

WORDS = ["the", "cat", "dog", "sat", "on", "mat", "a", "red", "blue", "big", "small", "ran", "to", "home", "what",
         "is", "color", "sky", "grass", "green", "yes", "no", "hello", "world", "answer", "question", "one", "two"]
from fitune.train.synthetic import SPECIALS  # noqa: E402


def make_tokenizer(folder: str) -> str:
    """A word-level tokenizer with a chat template, saved as a Hugging Face tokenizer folder."""
    from fitune.train.synthetic import make_word_tokenizer

    return make_word_tokenizer(folder, WORDS)


def make_model_folder(folder: str, vocab_size: int | None = None, seed: int = 0) -> str:
    """A tiny random Llama saved with save_pretrained (safetensors) next to the tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    make_tokenizer(folder)
    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=vocab_size or len(SPECIALS) + len(WORDS),
                      max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(cfg).save_pretrained(folder, safe_serialization=True)
    return folder


def make_chat_data(path: str, n: int = 48, seed: int = 0) -> str:
    """Question/answer chats with a learnable pattern: the answer repeats the question's colour word."""
    import random

    rng = random.Random(seed)
    colours = ["red", "blue", "green"]
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(n):
            c = rng.choice(colours)
            thing = rng.choice(["cat", "dog", "mat", "sky", "grass"])
            msgs = [{"role": "user", "content": f"what color is the {c} {thing}"},
                    {"role": "assistant", "content": f"the answer is {c} {c} {c}"}]
            f.write(json.dumps({"messages": msgs}) + "\n")
    return path


def write_config(path: str, **keys) -> str:
    import yaml

    with open(path, "w", encoding="utf-8") as f:
        yaml.safe_dump(keys, f)
    return path


def init_lora_b(model, std: float) -> None:
    """PEFT starts lora_B at zero (the adapter adds nothing); give it values so gradients reach lora_A too."""
    import torch

    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=std)


def loss_and_grads(model, ids):
    """One causal-LM step on `ids` (labels = inputs): the loss and every trainable gradient, in fp32."""
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    return loss.detach().float(), {n: p.grad.float().clone() for n, p in model.named_parameters() if p.requires_grad}

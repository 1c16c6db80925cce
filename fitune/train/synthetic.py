"""Synthetic tokenizers and data sets for smoke runs and benchmarks (no downloads): a word-level tokenizer with
a chat template, and chat records whose answers follow a learnable pattern."""

from __future__ import annotations

import json
import os
import random

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} </s> {% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|> {% endif %}")


def make_word_tokenizer(folder: str, words: list[str]) -> str:
    """A word-level Hugging Face tokenizer (specials + `words`) with a chat template, saved in `folder`."""
    # tokenizers, transformers: optional, imported where used (estimate, plan and doctor SCRIPT never load them)
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS + list(dict.fromkeys(words)))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", additional_special_tokens=SPECIALS[4:])
    fast.chat_template = CHAT_TEMPLATE
    os.makedirs(folder, exist_ok=True)
    fast.save_pretrained(folder)
    return folder


def synthetic_words(n: int) -> list[str]:
    return [f"w{i}" for i in range(n)]


def write_chat_data(path: str, n_records: int, words: list[str], answer_words: int, seed: int = 0) -> str:
    """Chats whose assistant turn repeats a word of the question `answer_words` times (learnable)."""
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(n_records):
            key = rng.choice(words)
            question = " ".join(rng.choice(words) for _ in range(8)) + f" {key}"
            answer = " ".join([key] * answer_words)
            f.write(json.dumps({"messages": [{"role": "user", "content": question},
                                             {"role": "assistant", "content": answer}]}) + "\n")
    return path

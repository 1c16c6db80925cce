"""`python -m fitune.train.quickstart FOLDER`: everything `fitune train` needs to try it on a CPU, no download.

It writes a tiny random Llama (2 layers, 64 wide) with a word-level tokenizer and chat template, a chat data set
whose answers follow a pattern the model can learn, and `FOLDER/run.yaml`. Then:

    fitune train FOLDER/run.yaml        # 60 LoRA steps on the CPU; the loss falls
"""

from __future__ import annotations

import argparse
import os
import sys

COLOURS = ["red", "blue", "green", "black", "white"]
THINGS = ["cat", "dog", "mat", "sky", "car", "hat"]
WORDS = ["what", "color", "is", "the", "answer"] + COLOURS + THINGS


def write_colour_chats(path: str, n: int, seed: int) -> str:
    """Chats whose answer repeats the colour the question names: learnable by a tiny model in a few dozen steps."""
    import json
    import random

    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(n):
            c, thing = rng.choice(COLOURS), rng.choice(THINGS)
            f.write(json.dumps({"messages": [{"role": "user", "content": f"what color is the {c} {thing}"},
                                             {"role": "assistant", "content": f"the answer is {c} {c} {c}"}]}) + "\n")
    return path


def write_quickstart(folder: str, seed: int = 0) -> str:
    """Write model/, train.jsonl, eval.jsonl and run.yaml under `folder`; returns the config's path."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from ..config import config_from_dict
    from .synthetic import SPECIALS, make_word_tokenizer

    folder = os.path.abspath(folder)  # the config works from any working directory
    model_dir = os.path.join(folder, "model")
    make_word_tokenizer(model_dir, WORDS)
    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=len(SPECIALS) + len(WORDS), max_position_embeddings=256,
                      pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(model_dir, safe_serialization=True)
    train = write_colour_chats(os.path.join(folder, "train.jsonl"), 256, seed)
    evald = write_colour_chats(os.path.join(folder, "eval.jsonl"), 32, seed + 1)
    doc = {"model": model_dir, "data": {"path": train, "eval_path": evald}, "method": "lora",
           "lora": {"rank": 16, "alpha": 32, "targets": ["all-linear"]}, "dtype": "fp32", "seq_len": 64,
           "batch_size": 8, "max_steps": 60, "lr": 5e-3, "warmup_steps": 5, "eval_every": 20,
           "output_dir": os.path.join(folder, "run")}
    config_from_dict(doc, "quickstart")  # what we write must be a valid config
    path = os.path.join(folder, "run.yaml")
    from ..plan.emit import to_yaml

    with open(path, "w", encoding="utf-8") as f:
        f.write(to_yaml(doc, ["a tiny random Llama on the CPU: `fitune train " + path + "`"]))
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fitune.train.quickstart", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder", help="where to write the tiny model, the data and run.yaml (created)")
    args = p.parse_args(argv)
    if os.path.exists(args.folder) and os.listdir(args.folder):
        print(f"{args.folder} is not empty; pick a new folder", file=sys.stderr)
        return 2
    path = write_quickstart(args.folder)
    print(f"wrote {path}\nnext: fitune train {path}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

"""Issue 14: the model folder every peer stack loads: a random-init bf16 model from fitune's catalog config
(`save_pretrained`, safetensors), a fast word-level tokenizer built here (pad token set, loads offline with
`AutoTokenizer.from_pretrained`), and the shared data: seeded random token ids (rows x seq_len) in data.pt.

    PYTHONPATH=. python3 bench/peers/make_model.py --out /tmp/peers/llama8b
    python3 bench/peers/make_model.py --out /tmp/tiny --device cpu --layers 2 --hidden 64 --intermediate 128 \
        --heads 4 --kv-heads 2 --vocab 8192 --seq-len 256        # a CPU smoke-test model

The tokenizer's vocabulary (4,007 words) is smaller than the model's (128,256): the data are ids below the
tokenizer's size, which every stack embeds the same way.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from bench.peers.peerlib import DATA_FILE  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="model folder to write")
    p.add_argument("--model", default="llama-3.1-8b", help="fitune catalog name")
    p.add_argument("--device", default="cuda", help="where the random weights are drawn (cuda: fast)")
    p.add_argument("--layers", type=int, help="override num_hidden_layers (e.g. 2 for a smoke test)")
    p.add_argument("--hidden", type=int, help="override hidden_size (tiny CPU models)")
    p.add_argument("--intermediate", type=int, help="override intermediate_size")
    p.add_argument("--heads", type=int, help="override num_attention_heads")
    p.add_argument("--kv-heads", type=int, help="override num_key_value_heads")
    p.add_argument("--vocab", type=int, help="override vocab_size (at least the tokenizer's 4,007)")
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--words", type=int, default=4000, help="tokenizer words (plus 7 special tokens)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    import torch
    from transformers import AutoTokenizer

    from fitune.runtime.model import build_random_model
    from fitune.specs.model import load_model_spec
    from fitune.train.synthetic import make_word_tokenizer, synthetic_words

    t0 = time.perf_counter()
    os.makedirs(args.out, exist_ok=True)
    make_word_tokenizer(args.out, synthetic_words(args.words))
    tok = AutoTokenizer.from_pretrained(args.out)
    assert tok.pad_token is not None and tok.pad_token_id is not None, "tokenizer without a pad token"
    n_tok = len(tok)

    cfg = dict(load_model_spec(args.model).hf_config)
    for key, value in (("num_hidden_layers", args.layers), ("hidden_size", args.hidden),
                       ("intermediate_size", args.intermediate), ("num_attention_heads", args.heads),
                       ("num_key_value_heads", args.kv_heads), ("vocab_size", args.vocab)):
        if value is not None:
            cfg[key] = value
    if cfg["vocab_size"] < n_tok:
        raise SystemExit(f"--vocab {cfg['vocab_size']} is below the tokenizer's {n_tok} tokens")
    # the special ids of the tokenizer that ships with the folder (compute does not depend on them)
    cfg.update(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(args.seed)
    model = build_random_model(cfg, attn="sdpa", device=args.device, dtype_name="bf16")
    model.config.use_cache = False
    model.save_pretrained(args.out)  # safetensors
    n_params = sum(p.numel() for p in model.parameters())
    del model
    if args.device == "cuda":
        torch.cuda.empty_cache()

    g = torch.Generator().manual_seed(args.seed)
    # ids below the tokenizer's size, past its special tokens (no pad / eos in the middle of a row)
    rows = torch.randint(7, n_tok, (args.rows, args.seq_len), generator=g, dtype=torch.long)
    torch.save(rows, os.path.join(args.out, DATA_FILE))
    meta = {"model": args.model, "layers": cfg["num_hidden_layers"], "hidden_size": cfg["hidden_size"],
            "vocab_size": cfg["vocab_size"], "tokenizer_size": n_tok, "rows": args.rows, "seq_len": args.seq_len,
            "seed": args.seed, "parameters": n_params}
    with open(os.path.join(args.out, "peers_meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
    size = sum(os.path.getsize(os.path.join(args.out, f)) for f in os.listdir(args.out))
    print(json.dumps({**meta, "folder": args.out, "folder_bytes": size,
                      "seconds": round(time.perf_counter() - t0, 1)}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

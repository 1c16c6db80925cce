"""`fitune merge RUN_DIR --out DIR`: the run's LoRA adapter merged into the base weights, as a standalone model."""

from __future__ import annotations

import argparse
import os

from ..errors import ConfigError

DESCRIPTION = """\
Merge a LoRA run's adapter into its base model (PEFT merge_and_unload) and write a standalone Hugging Face model
folder: safetensors shards (--max-shard-size), the tokenizer, config.json and generation_config.json. It loads
anywhere without PEFT or fitune (AutoModelForCausalLM.from_pretrained(DIR)), and `fitune export` converts it.

RUN_DIR: the output_dir of `fitune train` (its adapter/), or a PEFT adapter folder. --out must be a new or empty
folder (not a link); the files are written into a fresh temporary folder beside it and renamed at the end, so DIR
is never half-written.

dtype: the run's by default (its `dtype:`; QLoRA: bf16); --dtype to choose. QLoRA: the adapter was trained on the
NF4 (4-bit) base, so the NF4 weights are dequantized to bf16 first and the adapter merged into those (bitsandbytes,
CUDA only): the merged model computes what the trained model computed, at 2 bytes per weight.

examples:
  fitune merge runs/x --out runs/x-merged
  fitune merge runs/x --out /models/x --dtype bf16 --max-shard-size 2GB
"""


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("merge", help="merge a LoRA adapter into its base model (a standalone model folder)",
                              description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", metavar="RUN_DIR", help="a fitune train output_dir, or a PEFT adapter folder")
    p.add_argument("--out", required=True, metavar="DIR", help="the merged model's folder (new or empty)")
    p.add_argument("--dtype", metavar="bf16|fp16|fp32", help="the merged weights' dtype (default: the run's)")
    p.add_argument("--max-shard-size", default="5GB", metavar="SIZE",
                   help="the largest safetensors file (default 5GB; transformers' units: 500MB, 2GB)")
    p.add_argument("--checkpoint", metavar="DIR", help="merge a checkpoint of the run (checkpoints/step-N) instead "
                   "of its final adapter")
    p.set_defaults(run=run)
    return p


def run(args) -> int:
    # the command's library: imported when it runs, so that `fitune --help` stays light
    from ..infer.merge import QLORA_NOTE, check_out_dir, mergeable

    check_out_dir(args.out)  # before loading anything
    info = mergeable(args.run_dir, args.checkpoint)
    try:
        # torch: optional, imported where used (estimate, plan and doctor SCRIPT never load it)
        import torch  # noqa: F401
    except ImportError as exc:
        raise ConfigError("fitune merge needs torch, transformers and peft (pip install 'fitune[torch]')") from exc
    from ..infer.merge import merge_run

    out = merge_run(args.run_dir, args.out, dtype=args.dtype, max_shard_size=args.max_shard_size,
                    checkpoint=args.checkpoint)
    files = sorted(os.listdir(out))
    size = sum(os.path.getsize(os.path.join(out, f)) for f in files if f.endswith(".safetensors"))
    shards = sum(f.endswith(".safetensors") for f in files)
    from ..infer.load import dtype_name

    dtype = dtype_name(args.dtype) if args.dtype else info.dtype
    print(f"merged {info.weights_dir} into {info.base_model} -> {out} ({dtype}, {shards} safetensors "
          f"file{'s' if shards != 1 else ''}, {size / 2**30:.2f} GiB)")
    if info.method == "qlora":
        print(f"note: {QLORA_NOTE}")
    return 0

"""Issue 5: tokens/s of each stack on the seeds' workload under a card's allocator budget. Run on the GPU machine.

Llama-3.1-8B-shaped, LoRA r8 on q,v, bf16, 2 x 2048 tokens per optimizer step, allocator capped (default rtx4090).
One stack per process (liger patches transformers' classes globally); each variant of the stack is measured over
--steps steps (the first is warm-up) and written as a JSON line: fits, tokens/s, peaks, allocator retries.

Variants:
  hf        checkpointing none | full                         (the HF recipe)
  hf_liger  checkpointing none | full, with Liger's kernels
  fitune    chunked loss with checkpointing none | selective:K (K in --selective) | full, optionally the tiled MLP

    PYTHONPATH=. python3 bench/throughput.py --stack fitune --out $OUT/throughput.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench.common import cap_allocator, timed_steps, training_step  # noqa: E402
from fitune.profile import hf_recipe  # noqa: E402
from fitune.specs.model import load_model_spec  # noqa: E402


def variants(stack: str, selective: list[int]) -> list[dict]:
    if stack in ("hf", "hf_liger"):
        return [{"grad_checkpointing": "none"}, {"grad_checkpointing": "full"}]
    out = [{"grad_checkpointing": "none", "loss": "chunked"}]
    out += [{"grad_checkpointing": f"selective:{k}", "loss": "chunked"} for k in selective]
    out += [{"grad_checkpointing": "full", "loss": "chunked"}, {"grad_checkpointing": "full", "loss": "chunked",
                                                                "tiled_mlp": True}]
    return out


def measure(args, spec, base, variant: dict, device: str) -> dict:
    import torch

    from fitune.train.techniques.offload import enable_selective_checkpointing
    from fitune.train.techniques.tiled_mlp import enable_tiled_mlp

    model = hf_recipe.wrap_lora(base, 8, ["q_proj", "v_proj"])
    ckpt = variant["grad_checkpointing"]
    if ckpt != "none":
        hf_recipe.enable_checkpointing(model)
        if ckpt.startswith("selective:"):
            enable_selective_checkpointing(model, int(ckpt.split(":")[1]))
    if variant.get("tiled_mlp"):
        enable_tiled_mlp(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    ids = torch.randint(0, spec.vocab_size, (args.batch_size, args.seq_len), device=device)
    rec = {"stack": args.stack, "model": args.model, "cap": args.cap, "batch_size": args.batch_size,
           "seq_len_tokens": args.seq_len, **variant}

    rec.update(timed_steps(lambda: training_step(model, opt, ids, variant.get("loss") == "chunked"), args.steps, args.batch_size * args.seq_len, device))
    if ckpt != "none":
        hf_recipe.disable_checkpointing(model)
    model.unload()  # back to the plain base model for the next variant
    return rec


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stack", choices=("hf", "hf_liger", "fitune"), required=True)
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--cap", default="rtx4090")
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--selective", default="8,16,24", help="K values for selective checkpointing (fitune stack)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    cap_allocator(args.cap, args.device)
    if args.stack == "hf_liger":
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        apply_liger_kernel_to_llama()
    spec = load_model_spec(args.model)
    base = hf_recipe.build_random_model(spec.hf_config, attn="sdpa", device=args.device)
    selective = [int(k) for k in args.selective.split(",") if k]
    for variant in variants(args.stack, selective):
        rec = measure(args, spec, base, variant, args.device)
        with open(args.out, "a") as f:
            f.write(json.dumps(rec) + "\n")
        print(json.dumps({k: rec.get(k) for k in ("stack", "grad_checkpointing", "loss", "tiled_mlp", "fits",
                                                  "tokens_per_s")}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

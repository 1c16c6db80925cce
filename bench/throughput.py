"""Issue 5: tokens/s of each stack on the seeds' workload under a card's allocator budget. Run on the GPU machine.

Llama-3.1-8B-shaped, LoRA r8 on q,v, bf16, 2 x 2048 tokens per optimizer step (micro-batch 2, or 1 with two
accumulation steps), allocator capped (default rtx4090).
One stack per process (liger patches transformers' classes globally); each variant of the stack is measured over
--steps steps (the first is warm-up) and written as a JSON line: fits, tokens/s, peaks, allocator retries.

Variants:
  hf        checkpointing none | full                         (the HF recipe)
  hf_liger  checkpointing none | full, with Liger's kernels
  fitune    fitune's runner (fitune.runtime.model.prepare_model): chunked loss, lean LoRA, lean RMSNorm, expandable segments, with
            checkpointing selective:K (K in --selective) | full. --liger: kernels: liger (Liger's RMSNorm, SwiGLU
            and RoPE) in place of the lean RMSNorm, the rest the same.

    PYTHONPATH=. python3 bench/throughput.py --stack fitune --out $OUT/throughput.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench.common import cap_allocator, pop_training, timed_steps, training_step, write_record  # noqa: E402
from fitune.specs.model import load_model_spec  # noqa: E402


def variants(stack: str, selective: list[int]) -> list[dict]:
    """Each stack's candidates for the 2 x 2048 step: micro-batch 2, or micro-batch 1 with 2 accumulation steps."""
    micro1 = {"grad_checkpointing": "none", "micro_batch_size": 1}
    if stack in ("hf", "hf_liger"):
        return [{"grad_checkpointing": "none"}, {"grad_checkpointing": "full"}, micro1]
    return [{"grad_checkpointing": f"selective:{k}"} for k in selective] + [{"grad_checkpointing": "full"}, micro1]


def fitune_setup(args, grad_checkpointing: str, liger: bool, micro: int | None = None):
    from fitune.setup import TrainSetup

    micro = micro or args.batch_size
    return TrainSetup(method="lora", lora_rank=8, lora_targets=("q_proj", "v_proj"), batch_size=micro,
                      grad_accum=args.batch_size // micro, seq_len_tokens=args.seq_len,
                      grad_checkpointing=grad_checkpointing, loss="chunked",
                      lean_lora=True, lean_norm=not liger, kernels="liger" if liger else "torch",
                      expandable_segments=True, stack="fitune")


def hf_setup(args, grad_checkpointing: str):
    """The HF recipe's setup: PEFT's LoRA r8 on q,v (alpha 16) and transformers' checkpointing, nothing else."""
    from fitune.setup import TrainSetup

    return TrainSetup(method="lora", lora_rank=8, lora_targets=("q_proj", "v_proj"), batch_size=args.batch_size,
                      seq_len_tokens=args.seq_len, grad_checkpointing=grad_checkpointing, stack="hf")


def measure(args, spec, base, variant: dict, device: str) -> dict:
    import torch

    from fitune.memory import estimate
    from fitune.runtime.model import prepare_model, set_checkpointing
    from fitune.runtime.optim import build_optimizer

    ckpt = variant["grad_checkpointing"]
    rec = {"stack": args.stack, "model": args.model, "cap": args.cap, "batch_size": args.batch_size,
           "seq_len_tokens": args.seq_len, **variant}
    if args.stack == "fitune":
        setup = fitune_setup(args, ckpt, args.liger, variant.get("micro_batch_size"))
        model = prepare_model(base, setup)
        est = estimate(spec, setup)
        rec.update({"kernels": "liger" if args.liger else "torch", "loss": "chunked", "lean_lora": True,
                    "lean_norm": not args.liger, "expandable_segments": True,
                    "est_peak_allocated_bytes": est.peak_allocated_bytes,
                    "est_peak_reserved_bytes": est.peak_reserved_bytes})
    else:
        model = prepare_model(base, hf_setup(args, ckpt))
    opt = build_optimizer("adamw", [p for p in model.parameters() if p.requires_grad], lr=1e-5)
    ids = torch.randint(0, spec.vocab_size, (args.batch_size, args.seq_len), device=device)
    micro = variant.get("micro_batch_size")
    rec.update(timed_steps(lambda check_gradients: training_step(model, opt, ids, args.stack == "fitune", micro,
                                                                 check_gradients), args.steps,
                           args.batch_size * args.seq_len, device))
    if ckpt != "none":
        set_checkpointing(model, False)
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
    p.add_argument("--selective", default="20,22,24", help="K values for selective checkpointing (fitune stack)")
    p.add_argument("--liger", action="store_true", help="fitune stack: Liger's RMSNorm, SwiGLU and RoPE kernels")
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    if args.stack == "fitune":
        from fitune.runtime.device import configure_allocator

        configure_allocator(fitune_setup(args, "full", args.liger))  # before CUDA starts
    cap_allocator(args.cap, args.device)
    if args.stack == "hf_liger":
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        apply_liger_kernel_to_llama()
    from fitune.runtime.model import build_model

    spec = load_model_spec(args.model)
    base = build_model(spec, dtype_name="bf16", attn="sdpa", device=args.device, init="random")
    selective = [int(k) for k in args.selective.split(",") if k]
    for variant in variants(args.stack, selective):
        rec = measure(args, spec, base, variant, args.device)
        write_record(args.out, rec, training=pop_training(rec))
        print(json.dumps({k: rec.get(k) for k in ("stack", "kernels", "grad_checkpointing", "micro_batch_size",
                                                  "fits", "tokens_per_s",
                                                  "peak_allocated_bytes", "peak_reserved_bytes",
                                                  "est_peak_allocated_bytes")}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Issue 14, peer stack "hf_loop": the plain PyTorch loop on transformers + PEFT, as people write it. With --liger,
`liger_kernel.transformers.apply_liger_kernel_to_llama()` (RMSNorm, RoPE, SwiGLU, fused linear cross-entropy)
patches transformers' Llama classes before the model is built. Same model folder, data, LoRA (r8 alpha 16
dropout 0 on q_proj,v_proj), `torch.optim.AdamW` over the trainable parameters (lr 1e-4), loss from
`model(input_ids=..., labels=...)`, transformers' checkpointing (use_reentrant False) when full; no autocast (bf16
weights, PEFT's fp32 adapters), no clipping. One candidate per process, one JSON line appended to --out.

    PYTHONPATH=. python3 bench/peers/hf_loop.py --model-dir DIR --out peers.jsonl --liger --micro-batch 1 --grad-accum 2
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))


from bench.peers.peerlib import hf_args, load_rows, plain_loop, reset_peaks, run_case  # noqa: E402


def main() -> int:
    args = hf_args(__doc__, "apply_liger_kernel_to_llama() before the model is built")

    def body(rec, clock):
        import torch

        if args.liger:
            from liger_kernel.transformers import apply_liger_kernel_to_llama

            apply_liger_kernel_to_llama()
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        t0 = time.perf_counter()
        kwargs = {"dtype": torch.bfloat16, "attn_implementation": "sdpa"}
        if args.device == "cuda":
            kwargs["device_map"] = {"": 0}
        model = AutoModelForCausalLM.from_pretrained(args.model_dir, **kwargs)
        if args.grad_checkpointing == "full":
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.enable_input_require_grads()
        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                                 target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
        model.train()
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
        rows = load_rows(args.model_dir)
        rec["load_s"] = round(time.perf_counter() - t0, 2)
        rec["trainable_params"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
        rec["_retries0"] = reset_peaks(args.device)
        plain_loop(model, opt, rows, args, clock)

    run_case("hf_loop_liger" if args.liger else "hf_loop", args, body, liger=args.liger, loop="plain")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Compiled layers against eager layers on the GPU: the loss and every LoRA gradient of one micro-batch, for LoRA
and QLoRA, with and without checkpointing. The CPU parity tests (tests/test_compile_layers.py) run Inductor's CPU
backend; this runs the CUDA one, with bitsandbytes' CUDA kernels for QLoRA. Run on the GPU machine:

    export PYTHONPATH=.:/tmp/site PYTHONUNBUFFERED=1
    python3 bench/compile_parity.py --out $OUT/compile_parity.jsonl

One JSON line per case: the setup's method and checkpointing, the loss eager and compiled, and over the LoRA
gradients the largest relative difference (|g_c - g_e| / |g_e|, Frobenius norms) and how many are all zeros in
each run. A compiled run that trains like the eager one has the same non-zero gradients to bf16 rounding.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench.common import write_record  # noqa: E402

#: a small Llama-shaped model: 4 layers, the 8B model's ratios (intermediate 3.5 x hidden, 4 query heads per KV head)
CONFIG = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=1024, intermediate_size=3584,
              num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, head_dim=128, vocab_size=4096,
              max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False)


def grads_of(method: str, ckpt: str, compiled: bool, ids, device: str = "cuda", seed: int = 0):
    import torch

    from fitune.runtime.model import build_model, prepare_model
    from fitune.runtime.step import forward_loss
    from fitune.setup import TrainSetup

    torch.manual_seed(seed)
    model = build_model(CONFIG, dtype_name="bf16", attn="sdpa", device=device, init="random",
                        quantize="nf4" if method == "qlora" else None)
    setup = TrainSetup(method=method, lora_rank=16, lora_targets=("all-linear",), lean_lora=True, stack="fitune",
                       loss="chunked", dtype="bf16", grad_checkpointing=ckpt, compile="layers" if compiled else "none")
    model = prepare_model(model, setup).train()
    gen = torch.Generator(device=device).manual_seed(1)
    for n, p in model.named_parameters():  # B starts at zero in PEFT: give it values so every gradient is non-zero
        if "lora_" in n:
            p.data.copy_(torch.randn(p.shape, generator=gen, device=device) * 0.02)
    losses = []
    for _ in range(2):  # the first call compiles; the second is what training runs
        model.zero_grad(set_to_none=True)
        loss = forward_loss(model, ids, loss="chunked")
        loss.backward()
        losses.append(loss.item())
    grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.requires_grad}
    del model
    torch._dynamo.reset()
    if device == "cuda":
        torch.cuda.empty_cache()
    return losses[-1], grads


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--device", default="cuda", help="cpu: a smoke test of this script (LoRA only: NF4 needs CUDA)")
    args = p.parse_args()
    import torch

    ids = torch.randint(0, CONFIG["vocab_size"], (1, args.tokens), device=args.device,
                        generator=torch.Generator(device=args.device).manual_seed(2))
    for method in ("lora", "qlora") if args.device == "cuda" else ("lora",):
        for ckpt in ("none", "full"):
            loss_e, ge = grads_of(method, ckpt, False, ids, args.device)
            loss_c, gc = grads_of(method, ckpt, True, ids, args.device)
            rel = {n: ((gc[n] - ge[n]).norm() / ge[n].norm().clamp_min(1e-30)).item() for n in ge}
            worst = max(rel, key=rel.get)
            rec = {"method": method, "grad_checkpointing": ckpt, "tokens": args.tokens, "loss_eager": loss_e,
                   "loss_compiled": loss_c, "lora_grads": len(ge), "max_rel_diff": rel[worst], "worst": worst,
                   "median_rel_diff": sorted(rel.values())[len(rel) // 2],
                   "zero_grads_eager": sum(int(not g.any()) for g in ge.values()),
                   "zero_grads_compiled": sum(int(not g.any()) for g in gc.values()),
                   "versions": {"torch": torch.__version__}}
            write_record(args.out, rec)
            print(json.dumps(rec), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Issue 5: the longest sequence (batch 1) each stack trains under a card's allocator budget. Run on the GPU machine.

For one stack per process (liger patches transformers' classes globally): build the model once, run one short
step (--warmup-tokens) so the optimizer's states exist as in any later step, then probe sequence lengths:
either the list --seqs, or a search doubling from --start until a step runs out of memory, then bisecting to
--resolution tokens. A probe runs --steps training steps; it fits when every step completes under the cap. One
JSON line per probe (with fitune's estimate of the same configuration), appended to --out as it ends.

Stacks:
  hf        the HF recipe with checkpointing (transformers' loss)            fitune/runtime/model.py
  hf_liger  the same with Liger's kernels (fused linear cross-entropy, RMSNorm, SwiGLU, RoPE)
  fitune    fitune's runner, prepared by fitune.runtime.model.prepare_model: offloaded checkpoints, chunked
            loss, tiled MLP, lean LoRA, lean RMSNorm, expandable segments (--no-expandable to compare)

    PYTHONPATH=. python3 bench/max_context.py --stack fitune --method qlora --lora-rank 32 --lora-targets all-linear \\
        --cap rtx4090 --out $OUT/max_context.jsonl
    PYTHONPATH=. python3 bench/max_context.py --stack fitune --method lora --seqs 49152,65536 ... (fixed lengths)
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench.common import cap_allocator, pop_training, timed_steps, training_step, write_record  # noqa: E402
from fitune.specs.model import load_model_spec  # noqa: E402


def fitune_setup(args, seq: int):
    """The TrainSetup fitune's runner uses for a long-context probe (what `fitune estimate --stack fitune` takes)."""
    from fitune.setup import TrainSetup, parse_targets

    return TrainSetup(method=args.method, lora_rank=args.lora_rank, lora_targets=parse_targets(args.lora_targets),
                      batch_size=args.batch_size, seq_len_tokens=seq, grad_checkpointing="offload", loss="chunked",
                      tiled_mlp=True, lean_lora=True, lean_norm=True, expandable_segments=not args.no_expandable,
                      stack="fitune")


def hf_setup(args, seq: int):
    from fitune.setup import TrainSetup, parse_targets

    return TrainSetup(method=args.method, lora_rank=args.lora_rank, lora_targets=parse_targets(args.lora_targets),
                      batch_size=args.batch_size, seq_len_tokens=seq, grad_checkpointing="full", stack="hf")


def build(args, device):
    from fitune.runtime.model import build_model, prepare_model
    from fitune.runtime.optim import build_optimizer

    spec = load_model_spec(args.model)
    if args.stack == "hf_liger":
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        apply_liger_kernel_to_llama()  # patches the Llama classes before the model is built
    model = build_model(spec, dtype_name="bf16", attn="sdpa", device=device, init="random",
                        quantize="nf4" if args.method == "qlora" else None)
    # fitune: its techniques; hf / hf_liger: PEFT's LoRA and transformers' checkpointing (the HF recipe)
    setup = fitune_setup(args, args.start) if args.stack == "fitune" else hf_setup(args, args.start)
    model = prepare_model(model, setup)
    opt = build_optimizer("adamw", [p for p in model.parameters() if p.requires_grad], lr=1e-5)
    return spec, model, opt


def estimated(args, spec, seq: int) -> dict:
    """fitune's estimate of the probe (the hf_liger stack is not modelled: none)."""
    if args.stack == "hf_liger":
        return {}
    from fitune.memory import estimate

    est = estimate(spec, fitune_setup(args, seq) if args.stack == "fitune" else hf_setup(args, seq))
    return {"est_peak_allocated_bytes": est.peak_allocated_bytes, "est_peak_reserved_bytes": est.peak_reserved_bytes,
            "est_host_bytes": est.host_bytes}


def probe(args, spec, model, opt, seq: int, device: str) -> dict:
    import torch

    rec = {"stack": args.stack, "model": args.model, "method": args.method, "lora_rank": args.lora_rank,
           "lora_targets": args.lora_targets, "batch_size": args.batch_size, "seq_len_tokens": seq, "cap": args.cap,
           "expandable_segments": args.stack == "fitune" and not args.no_expandable}
    ids = torch.randint(0, spec.vocab_size, (args.batch_size, seq), device=device)
    rec.update(timed_steps(lambda check_gradients: training_step(model, opt, ids, args.stack == "fitune",
                                                                 check_gradients=check_gradients), args.steps,
                           args.batch_size * seq, device))
    rec.update(estimated(args, spec, seq))
    rec["host_rss_peak_bytes"] = _peak_rss_bytes()
    rec.update(_pinned_host_bytes())
    opt.zero_grad(set_to_none=True)  # an OOM can leave partial gradients
    return rec


def write_snapshot(path: str) -> None:
    import gzip

    import torch

    from bench.hf_recipe import compact_snapshot

    snapshot = torch.cuda.memory._snapshot()
    with gzip.open(path, "wt") as f:
        json.dump(compact_snapshot(snapshot), f)


def _pinned_host_bytes() -> dict:
    """Pinned host memory held by PyTorch's host allocator (its blocks, as rounded), where this PyTorch reports it."""
    try:
        import torch

        stats = torch.cuda.memory.host_memory_stats()
        return {"host_pinned_peak_bytes": stats.get("allocated_bytes.peak"),
                "host_pinned_current_bytes": stats.get("allocated_bytes.current")}
    except Exception:  # noqa: BLE001 - older PyTorch, or no CUDA
        return {}


def _peak_rss_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def search(fits, start: int, resolution: int, limit: int) -> int:
    """Largest n (a multiple of `resolution`) with fits(n): double from `start`, then bisect."""
    lo, hi = 0, None
    n = start
    while n <= limit:
        if fits(n):
            lo = n
            n *= 2
        else:
            hi = n
            break
    if hi is None:
        return lo
    while hi - lo > resolution:
        mid = (lo + hi) // 2 // resolution * resolution
        if mid <= lo:
            break
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stack", choices=("hf", "hf_liger", "fitune"), required=True)
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--method", choices=("lora", "qlora"), default="lora")
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--lora-targets", default="q_proj,v_proj")
    p.add_argument("--cap", default="rtx4090")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--start", type=int, default=4096)
    p.add_argument("--resolution", type=int, default=1024)
    p.add_argument("--limit", type=int, default=262144)
    p.add_argument("--seqs", default="", help="probe these lengths (comma-separated) instead of searching")
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--warmup-tokens", type=int, default=256, help="one short step first: the optimizer's states")
    p.add_argument("--no-expandable", action="store_true", help="fitune stack without expandable segments")
    p.add_argument("--snapshot", help="write a compact allocation trace of the probes' steps to this .json.gz "
                   "(bench/hf_recipe.py's format, for attributing the measured peak)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    if args.stack == "fitune":
        from fitune.runtime.device import configure_allocator

        print("allocator:", configure_allocator(fitune_setup(args, args.start)), flush=True)  # before CUDA starts
    cap_allocator(args.cap, args.device)
    spec, model, opt = build(args, args.device)
    if args.warmup_tokens:
        import torch

        ids = torch.randint(0, spec.vocab_size, (1, args.warmup_tokens), device=args.device)
        training_step(model, opt, ids, args.stack == "fitune")

    if args.snapshot:
        import torch

        torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="python", max_entries=2_000_000)

    def fits(seq: int) -> bool:
        rec = probe(args, spec, model, opt, seq, args.device)
        if args.snapshot:
            write_snapshot(args.snapshot)
        write_record(args.out, rec, training=pop_training(rec))
        print(json.dumps({k: rec.get(k) for k in ("stack", "method", "seq_len_tokens", "fits", "tokens_per_s",
                                                  "peak_allocated_bytes", "peak_reserved_bytes",
                                                  "est_peak_allocated_bytes")}), flush=True)
        return rec["fits"]

    if args.seqs:
        for seq in (int(x) for x in args.seqs.split(",") if x):
            fits(seq)
        return 0
    best = search(fits, args.start, args.resolution, args.limit)
    write_record(args.out, {"stack": args.stack, "model": args.model, "method": args.method,  # the search's answer
                            "lora_rank": args.lora_rank, "lora_targets": args.lora_targets, "cap": args.cap,
                            "max_seq_len_tokens": best}, training=None)
    print(f"{args.stack} {args.method}: {best} tokens fit under {args.cap}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

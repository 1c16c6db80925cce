"""Issue 14, "a loss option where faster than the chunked loss": the linear + cross-entropy alone, fitune's chunked
loss against Liger's fused linear cross-entropy, Apple's Cut Cross-Entropy and transformers' plain path, on the
seeds' shapes (Llama-3.1-8B's lm_head: vocabulary 128,256 x 4,096, bf16, frozen as under LoRA).

For each implementation and token count: forward + backward time (median of `--iters` after `--warmup`, CUDA
events), the peak allocated above the inputs, and the loss and input gradient against fitune's chunked loss (the
exactness check). One JSON line per case, appended to OUT as it goes.

    python3 bench/loss_kernels.py --out $OUT/loss_kernels.jsonl --tokens 2048,4096,16384

On the CPU (`--device cpu`, tiny shapes) it runs the same code, which tests/test_loss_kernels.py uses.
"""

from __future__ import annotations

import argparse
import json
import statistics
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench.common import write_record  # noqa: E402


def implementations(device: str) -> dict:
    """name -> loss(hidden (N, H), weight (V, H), labels (N,)) -> mean loss over labels != -100; those importable."""
    import torch

    from fitune.runtime.techniques.chunked_loss import IGNORE_INDEX, _ChunkedLinearCrossEntropy

    def chunked(h, w, y):
        n = (y != IGNORE_INDEX).sum().float().clamp_min(1)
        return _ChunkedLinearCrossEntropy.apply(h, w, y, n, 1024, None)

    def plain(h, w, y):  # transformers' ForCausalLMLoss on pre-shifted labels: fp32 logits, then cross-entropy
        return torch.nn.functional.cross_entropy((h @ w.t()).float(), y, ignore_index=IGNORE_INDEX)

    def chunked_compiled(h, w, y):  # what `compile: layers` runs: each chunk's softmax gradient compiled
        n = (y != IGNORE_INDEX).sum().float().clamp_min(1)
        return _ChunkedLinearCrossEntropy.apply(h, w, y, n, 1024, None, True)

    impls = {"chunked": chunked, "hf": plain, "chunked_compiled": chunked_compiled}
    if device == "cuda":
        try:
            from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss

            liger = LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE_INDEX)
            impls["liger_flce"] = lambda h, w, y: liger(w, h, y)
        except ImportError as exc:
            print(f"liger-kernel: {exc}", file=sys.stderr)
    try:
        from cut_cross_entropy import linear_cross_entropy

        if device == "cuda":
            impls["cce"] = lambda h, w, y: linear_cross_entropy(h, w, y, impl="cce")  # gradient filter "high"
            impls["cce_exact"] = lambda h, w, y: linear_cross_entropy(h, w, y, impl="cce", filter_eps=None)
    except ImportError as exc:
        print(f"cut-cross-entropy: {exc}", file=sys.stderr)
    return impls


def measure(name: str, fn, n_tokens: int, hidden: int, vocab: int, device: str, iters: int, warmup: int,
            reference: dict | None) -> dict:
    import torch

    g = torch.Generator(device="cpu").manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    h0 = (torch.randn(n_tokens, hidden, generator=g) * 0.5).to(device, dtype)
    w = (torch.randn(vocab, hidden, generator=g) * hidden ** -0.5).to(device, dtype)
    y = torch.randint(0, vocab, (n_tokens,), generator=g)
    y[torch.rand(n_tokens, generator=g) < 0.25] = -100  # a prompt's share of masked labels
    y = y.to(device)
    rec = {"impl": name, "tokens": n_tokens, "hidden": hidden, "vocab": vocab, "dtype": str(dtype).split(".")[-1],
           "device": device}
    cuda = device == "cuda"
    times = []
    try:
        for i in range(warmup + iters):
            h = h0.detach().requires_grad_(True)
            if cuda:
                torch.cuda.synchronize()
                if i == warmup:
                    torch.cuda.reset_peak_memory_stats()
                    base = torch.cuda.memory_allocated()
            t0 = time.perf_counter()
            loss = fn(h, w, y)
            loss.backward()
            if cuda:
                torch.cuda.synchronize()
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        rec["ms"] = statistics.median(times) * 1e3
        rec["tokens_per_s"] = n_tokens / statistics.median(times)
        if cuda:
            rec["peak_above_inputs_bytes"] = torch.cuda.max_memory_allocated() - base
        rec["loss"] = float(loss.detach())
        grad = h.grad.float()
        if reference is not None:
            rec["loss_rel_diff"] = abs(rec["loss"] - reference["loss"]) / abs(reference["loss"])
            ref = reference["grad"]
            rec["grad_max_abs_diff"] = float((grad - ref).abs().max())
            rec["grad_rel_norm_diff"] = float((grad - ref).norm() / ref.norm())
        rec["_grad"] = grad
    except Exception as exc:  # noqa: BLE001 - a failing kernel is a result here
        rec["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    return rec


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="JSON lines, appended")
    p.add_argument("--tokens", default="2048,4096,16384", help="comma-separated token counts per call")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--impls", default=None, help="comma-separated subset (default: all importable)")
    args = p.parse_args(argv)
    impls = implementations(args.device)
    if args.impls:
        impls = {k: v for k, v in impls.items() if k in args.impls.split(",")}
    for n in (int(x) for x in args.tokens.split(",")):
        reference = None
        for name, fn in impls.items():  # chunked first: the reference of the exactness check
            rec = measure(name, fn, n, args.hidden, args.vocab, args.device, args.iters, args.warmup, reference)
            grad = rec.pop("_grad", None)
            if name == "chunked" and grad is not None:
                reference = {"loss": rec["loss"], "grad": grad}
            write_record(args.out, rec)  # a kernel's loss and gradient against the reference: no training run
            print(json.dumps(rec), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

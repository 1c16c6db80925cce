"""Issue 32, "packed rows at full speed": the attention of packed rows, fitune's segment loop (SDPA is_causal per
example, a Python loop) against the varlen kernel path (one torch `varlen_attn` call for all rows), and against
SDPA with transformers' block-diagonal mask, on real-length data: example lengths drawn lognormal (median
`--median-tokens`, spread `--sigma`), packed into rows of `--row-tokens` (an example that does not fit is cut
at the row's end, as concatenate-and-chunk packing does), positions restarting at each example.

Each case runs fitune's attention function (fitune/runtime/techniques/varlen_attention.py
`varlen_attention_forward`) forward + backward on bf16 query / key / value of Llama-3.1-8B's attention shape
(32 heads, 8 kv heads, 128 dims), cycling over `--layouts` packed batches (new segment bounds every call), and
records the median time (CUDA-synchronised wall clock, after `--warmup`), tokens/s, the peak allocated above
the inputs, and the output and gradients' largest difference from the segment loop (the exactness check).
With `--compile`, each case's call is torch.compile'd (`dynamic=None`, as `compile: layers` compiles a layer)
and the record says how many graphs dynamo compiled over all the layouts (the segment loop breaks the graph
and runs eagerly; the varlen call is one traced op). One JSON line per case through bench.common.write_record.

    python3 bench/packed_attention.py --out $OUT/packed_attention.jsonl [--compile]

`--device cpu` is a dry run of the same code on tiny shapes (the varlen kernel is CUDA-only: its case records
the reason it was skipped).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from types import SimpleNamespace

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench.common import write_record  # noqa: E402

CASES = ("loop", "varlen", "mask")


def packed_positions(rows: int, row_tokens: int, median_tokens: float, sigma: float, seed: int):
    """(rows, row_tokens) position ids: lognormal example lengths (median `median_tokens`) packed in order; an
    example longer than what is left of a row is cut at its end. Returns (positions, example lengths)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    positions, lengths = [], []
    for _ in range(rows):
        row, left = [], row_tokens
        while left:
            n = math.exp(math.log(median_tokens) + sigma * float(torch.randn((), generator=g)))
            n = max(1, min(left, round(n)))
            row.append(torch.arange(n))
            lengths.append(n)
            left -= n
        positions.append(torch.cat(row))
    return torch.stack(positions), lengths


def _module(heads: int, kv_heads: int, head_dim: int):
    """What transformers' attention functions read from the attention module."""
    return SimpleNamespace(num_key_value_groups=heads // kv_heads, is_causal=True, training=True,
                           scaling=head_dim ** -0.5)


def _mask(position_ids, dtype):
    """transformers' packed-sequence mask: each token sees the earlier tokens of its own example (rows, 1, s, s)."""
    import torch

    example = (position_ids == 0).cumsum(-1)
    same = example[:, :, None] == example[:, None, :]
    causal = torch.ones(same.shape[-1], same.shape[-1], dtype=torch.bool, device=same.device).tril()
    return (same & causal)[:, None]


def attention_call(case: str, heads: int, kv_heads: int, head_dim: int, device: str):
    """fn(q, k, v, positions_on_device, positions_on_cpu) -> attention output (rows, s, heads, d) for `case`;
    or a string saying why the case cannot run here."""
    from fitune.runtime.techniques import varlen_attention as va
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    module = _module(heads, kv_heads, head_dim)
    if case == "loop":
        return lambda q, k, v, pos, pos_cpu, kw: va.varlen_attention_forward(
            module, q, k, v, None, scaling=module.scaling, position_ids=pos)[0]
    if case == "mask":
        return lambda q, k, v, pos, pos_cpu, kw: sdpa_attention_forward(
            module, q, k, v, _mask(pos, q.dtype), scaling=module.scaling)[0]
    if device != "cuda" or va.load_kernel() is None:  # the kernel itself, whether or not FITUNE_VARLEN_KERNEL is set
        return "varlen_attn needs a CUDA device and torch >= 2.10"
    return lambda q, k, v, pos, pos_cpu, kw: va.varlen_attention_forward(
        module, q, k, v, None, scaling=module.scaling, position_ids=pos, **kw)[0]


def _inputs(args, device: str, dtype, seed: int):
    """Query / key / value (rows, heads, s, d) requiring gradients, the output gradient, and `--layouts` packed
    batches: (positions on the device, on the CPU, the varlen kernel's keyword arguments)."""
    import torch

    from fitune.runtime.techniques.varlen_attention import NAME, varlen_inputs

    g = torch.Generator().manual_seed(seed)
    shape = (args.rows, args.row_tokens, args.head_dim)
    q, k, v = (torch.randn(shape[0], h, shape[1], shape[2], generator=g).to(device, dtype).requires_grad_()
               for h in (args.heads, args.kv_heads, args.kv_heads))
    grad = torch.randn(args.rows, args.row_tokens, args.heads, args.head_dim, generator=g).to(device, dtype)
    model = SimpleNamespace(config=SimpleNamespace(_attn_implementation=NAME))  # what varlen_inputs asks
    layouts, lengths = [], []
    for i in range(args.layouts):
        pos, n = packed_positions(args.rows, args.row_tokens, args.median_tokens, args.sigma, seed + 1 + i)
        kw = varlen_inputs(model, pos, args.rows, device)
        kw = {key: val.to(device) if hasattr(val, "to") else val for key, val in kw.items()}
        layouts.append((pos.to(device), pos, kw))
        lengths += n
    return (q, k, v, grad), layouts, lengths


def measure(case: str, args, device: str, tensors, layouts, reference: dict | None) -> dict:
    """Forward + backward of `case` over the layouts; the record and, as `_out`, its output and gradients."""
    import torch

    q, k, v, grad = tensors
    rec = {"case": case, "compiled": args.compile, "device": device}
    fn = attention_call(case, args.heads, args.kv_heads, args.head_dim, device)
    if isinstance(fn, str):
        return {**rec, "skipped": fn}
    cuda = device == "cuda"
    if args.compile:
        torch._dynamo.reset()
        from torch._dynamo.utils import counters

        counters.clear()
        fn = torch.compile(fn, dynamic=None)
    times = []
    try:
        for i in range(args.warmup + args.iters):
            pos, pos_cpu, kw = layouts[i % len(layouts)]
            if cuda:
                torch.cuda.synchronize()
                if i == args.warmup:
                    torch.cuda.reset_peak_memory_stats()
                    base = torch.cuda.memory_allocated()
            t0 = time.perf_counter()
            out = fn(q, k, v, pos, pos_cpu, kw)
            grads = torch.autograd.grad(out, (q, k, v), grad)  # the op's gradients alone: a kernel, not a step
            if cuda:
                torch.cuda.synchronize()
            if i >= args.warmup:
                times.append(time.perf_counter() - t0)
        rec.update(_timing(times, args, cuda, base if cuda else 0))
        if args.compile:
            rec["unique_graphs"] = int(counters["stats"]["unique_graphs"])
        if case == "varlen":  # how the kernel was given grouped-query K and V (keyword / native / repeat)
            from fitune.runtime.techniques.varlen_attention import settle_gqa

            rec["kernel_gqa"] = settle_gqa(device)
        rec.update(_exactness(out, grads, reference))
    except Exception as exc:  # noqa: BLE001 - a failing kernel is a result here
        rec["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
    return rec


def _timing(times: list, args, cuda: bool, base_bytes: int) -> dict:
    import torch

    median_s = statistics.median(times)
    rec = {"fwd_bwd_ms": median_s * 1e3, "tokens_per_s": args.rows * args.row_tokens / median_s}
    if cuda:
        rec["peak_above_inputs_bytes"] = torch.cuda.max_memory_allocated() - base_bytes
    return rec


def _exactness(out, grads, reference: dict | None) -> dict:
    """The last layout's output and gradients, and their largest difference from the reference (the loop's)."""
    rec = {"_out": [out.detach().float()] + [g.float() for g in grads]}
    if reference is not None:
        names = ("out", "dq", "dk", "dv")
        rec.update({f"{n}_max_abs_diff": float((a - b).abs().max()) for n, a, b in zip(names, rec["_out"],
                                                                                      reference)})
    return rec


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="JSON lines, appended")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: a dry run on tiny shapes")
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {','.join(CASES)}")
    p.add_argument("--rows", type=int, default=1, help="packed rows per batch")
    p.add_argument("--row-tokens", type=int, default=4096, help="tokens per packed row")
    p.add_argument("--median-tokens", type=float, default=300.0, help="median example length (lognormal)")
    p.add_argument("--sigma", type=float, default=1.0, help="lognormal spread of example lengths (log space)")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--layouts", type=int, default=8, help="packed batches cycled through (new bounds each call)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--compile", action="store_true", help="torch.compile each case's call (dynamic=None)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    return run(args)


def run(args) -> int:
    import torch

    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        print("packed_attention: error: --device cuda but no CUDA device; pass --device cpu for a dry run",
              file=sys.stderr)
        return 2
    if device == "cpu":  # a dry run: the same code on tiny shapes
        args.row_tokens, args.heads, args.kv_heads, args.head_dim = min(args.row_tokens, 256), 4, 2, 16
        args.median_tokens, args.iters, args.warmup = min(args.median_tokens, 30), 1, 1
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    tensors, layouts, lengths = _inputs(args, device, dtype, args.seed)
    shape = {"rows": args.rows, "row_tokens": args.row_tokens, "median_tokens": args.median_tokens,
             "sigma": args.sigma, "examples": len(lengths), "mean_example_tokens": statistics.mean(lengths),
             "layouts": args.layouts, "heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim,
             "dtype": str(dtype).split(".")[-1], "iters": args.iters, "warmup": args.warmup}
    reference = None
    for case in args.cases.split(","):  # the loop first: the reference of the exactness check
        rec = {**shape, **measure(case, args, device, tensors, layouts, reference)}
        out = rec.pop("_out", None)
        if case == "loop":
            reference = out
        write_record(args.out, rec, gpu=device == "cuda")  # an attention kernel's time: no training run
        print(json.dumps(rec), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

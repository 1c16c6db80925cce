"""What is live at a step's peak: one setup of fitune's runner, traced by PyTorch's allocator history (Python stacks),
replayed here, and the tensors live at the peak listed by size with the frames that allocated them. Run on the GPU
machine; used to find what the estimator misses on a measured case.

    export PYTHONPATH=.:/tmp/site PYTHONUNBUFFERED=1
    python3 bench/trace_peak.py --model llama-3.1-8b --setup '{"method": "lora", "kernels": "liger", ...}' --out $OUT/peak.json

Writes --out (JSON): the setup, the measured peak, the estimate, and the live blocks at the peak (size, the frames in
fitune, liger_kernel, peft, transformers and torch.utils.checkpoint / autograd code).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

KEEP = ("fitune/", "liger_kernel/", "peft/", "transformers/", "torch/utils/checkpoint", "bitsandbytes/")


def frames_of(event: dict) -> list[str]:
    out = []
    for f in event.get("frames") or []:
        name = f.get("filename", "")
        if any(k in name for k in KEEP):
            out.append(f"{name.split('site-packages/')[-1]}:{f.get('line')}:{f.get('name')}")
    return out[:6]


def live_at_peak(trace: list[dict]) -> tuple[int, list[dict]]:
    """Replay alloc / free_completed events; return the peak live bytes and the blocks live then."""
    live: dict[int, dict] = {}
    total = peak = 0
    at_peak: list[dict] = []
    for e in trace:
        a = e.get("action")
        if a == "alloc":
            live[e["addr"]] = e
            total += e["size"]
            if total > peak:
                peak = total
                at_peak = list(live.values())
        elif a == "free_completed" and e["addr"] in live:
            total -= live.pop(e["addr"])["size"]
    return peak, at_peak


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--setup", required=True, help="TrainSetup fields as JSON")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--out", required=True)
    p.add_argument("--events-min-mib", type=float, default=0,
                   help="also write every alloc / free of a block this large or larger, in order (size, action, "
                        "address, the first frame): to see which of a layer's tensors are freed before the peak")
    p.add_argument("--stacks", action="store_true",
                   help="record Python stacks (not with checkpointing: see below); blocks then name their frames")
    args = p.parse_args()

    import torch

    from fitune.memory import estimate
    from fitune.runtime.device import configure_allocator
    from fitune.runtime.model import build_model, prepare_model
    from fitune.runtime.optim import build_optimizer
    from fitune.runtime.step import train_step
    from fitune.setup import TrainSetup
    from fitune.specs.model import load_model_spec

    setup = TrainSetup.from_dict(json.loads(args.setup))
    spec = load_model_spec(args.model)
    configure_allocator(setup)
    base = build_model(spec, dtype_name="bf16", attn=setup.attn, device="cuda", init="random",
                       quantize="nf4" if setup.method == "qlora" else None)
    model = prepare_model(base, setup)
    opt = build_optimizer(setup.optimizer, [q for q in model.parameters() if q.requires_grad], lr=1e-5)
    ids = torch.randint(0, spec.vocab_size, (setup.batch_size * setup.grad_accum, setup.seq_len_tokens), device="cuda")
    micro = ids.split(setup.batch_size)
    train_step(model, opt, micro, loss=setup.loss)  # the optimizer state exists from here on, as in a run
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    # no stacks: recording Python stacks breaks custom autograd Functions run under checkpoint recomputation
    # (torch 2.11: "SystemError: ... returned NULL without setting an exception"), so blocks are told apart by size
    torch.cuda.memory._record_memory_history(max_entries=3_000_000, context="alloc" if args.stacks else None,
                                             stacks="python" if args.stacks else "all")
    for _ in range(args.steps):
        train_step(model, opt, micro, loss=setup.loss)
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    measured = torch.cuda.max_memory_allocated()
    trace = snap["device_traces"][0]
    # blocks allocated before recording started are in the snapshot's segments, not the trace: count them as a base
    base_bytes = sum(b["size"] for s in snap["segments"] for b in s["blocks"] if b["state"] == "active_allocated")
    peak, blocks = live_at_peak(trace)
    est = estimate(spec, setup)
    rows = sorted(({"bytes": b["size"], "frames": frames_of(b)} for b in blocks), key=lambda r: -r["bytes"])
    out = {"model": args.model, "setup": json.loads(args.setup), "measured_peak_allocated_bytes": measured,
           "estimated_peak_allocated_bytes": est.peak_allocated_bytes, "trace_peak_live_bytes": peak,
           "live_at_end_bytes": base_bytes, "trace_events": len(trace), "blocks_at_peak": len(rows),
           "largest_at_peak": rows[:60],
           "estimate_peak_phase": est.peak_phase,
           "estimate_at_peak": sorted(est.breakdown.items(), key=lambda kv: -kv[1])}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps({k: v for k, v in out.items() if k not in ("largest_at_peak", "estimate_at_peak")}))
    print("estimate at its peak:", [(k, round(v / 2**20, 1)) for k, v in out["estimate_at_peak"]])
    from collections import Counter

    sizes = Counter(r["bytes"] for r in rows)
    if args.events_min_mib:
        live_total, rows_ev = 0, []
        for e in trace:
            a = e.get("action")
            if a in ("alloc", "free_completed"):
                live_total += e["size"] if a == "alloc" else -e["size"]
                if e["size"] >= args.events_min_mib * 2**20:
                    rows_ev.append([a, round(e["size"] / 2**20, 2), e["addr"] % 10**9, round(live_total / 2**20),
                                    " | ".join(frames_of(e)[:3])])
        out["events"] = rows_ev
    out["sizes_at_peak"] = sorted(([size, n] for size, n in sizes.items()), key=lambda x: -x[0] * x[1])[:40]
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    for size, n in out["sizes_at_peak"][:25]:
        print(f"{n:5d} x {size / 2**20:10.2f} MiB = {n * size / 2**20:10.1f} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

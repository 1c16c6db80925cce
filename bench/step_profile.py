"""Where a step's time goes, along the user's path: `fitune plan WORKLOAD --write` (bench/rank_check.py's
`write_plan_config`), then `fitune train plan.yaml` run in this process with PyTorch's profiler around a few steps
after warm-up (the training code is not changed: the loop's `_optimizer_step` is wrapped).

    python3 bench/step_profile.py --out $OUT --workload seeds --steps 10 --profile-steps 3
    python3 bench/step_profile.py --out $OUT --workload seeds --sdpa-first cudnn   # SDPA's cuDNN kernel first

One JSON line in OUT/step_profile.jsonl: the profiled steps' wall time, the GPU's busy time (the union of its kernels,
copies and fills), the kernel time per kind (matmul, attention, compiled Triton, loss, optimizer, copies, other),
the top kernels, and the run's median tokens/s over its steps 3 and later (the profiled steps included).
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import inspect
import json
import os
import re
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench.common import grad_norm_probe, training_facts, write_record  # noqa: E402

KINDS = (  # the first pattern a kernel's name matches names its kind
    ("attention", r"flash|fmha|attention|sdpa|cudnn"),
    ("matmul", r"gemm|nvjet|xmma|cutlass|cublas|splitk|sm90_|sm80_|ampere_"),
    ("loss", r"softmax|nll|cross_entropy|logsumexp"),
    ("optimizer", r"multi_tensor|foreach|adam"),
    ("compiled", r"^triton_"),
)


def kind_of(name: str, category: str) -> str:
    if category in ("gpu_memcpy", "gpu_memset"):
        return "copy_fill"
    low = name.lower()
    for kind, pattern in KINDS:
        if re.search(pattern, low):
            return kind
    return "other"


def summarize(trace_path: str, wall_s: float, steps: int) -> dict:
    """The profiled steps' GPU time from a Chrome trace PyTorch's profiler exported."""
    opener = gzip.open if trace_path.endswith(".gz") else open
    with opener(trace_path, "rt") as f:
        events = json.load(f)["traceEvents"]
    gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]
    per_kind: dict[str, float] = {}
    per_name: dict[str, list] = {}
    spans = []
    for e in gpu:
        k = kind_of(e["name"], e["cat"])
        per_kind[k] = per_kind.get(k, 0.0) + e["dur"] / 1e6
        entry = per_name.setdefault(e["name"][:120], [0, 0.0, k])
        entry[0] += 1
        entry[1] += e["dur"] / 1e6
        spans.append((e["ts"], e["ts"] + e["dur"]))
    spans.sort()
    busy_us, end = 0.0, None
    start = spans[0][0] if spans else 0
    for a, b in spans:  # the union of the intervals: overlapping kernels (several streams) count once
        if end is None or a > end:
            busy_us += b - a
            end = b
        elif b > end:
            busy_us += b - end
            end = b
    top = sorted(per_name.items(), key=lambda kv: -kv[1][1])[:30]
    return {"profiled_steps": steps, "wall_s": wall_s, "gpu_span_s": ((end or 0) - start) / 1e6,
            "gpu_busy_s": busy_us / 1e6, "gpu_idle_fraction": 1 - busy_us / 1e6 / wall_s if wall_s else None,
            "kernel_s_per_kind": {k: round(v, 6) for k, v in sorted(per_kind.items(), key=lambda kv: -kv[1])},
            "kernels": len(gpu),
            "top_kernels": [{"name": n, "count": c, "s": round(t, 6), "kind": k} for n, (c, t, k) in top],
            **idle_gaps(events, spans)}


GAP_BINS_US = (10, 50, 200, 1000)
"""Idle gaps between the GPU's kernels by length: under 10 us is one kernel waiting for the next launch; longer ones
are the host falling behind (Python, a guard check, a sync)."""


def idle_gaps(events: list[dict], spans: list[tuple[float, float]], top: int = 25) -> dict:
    """Where the GPU waits: its idle time between kernels by gap length (`idle_s_by_gap_us`: upper bound in us ->
    seconds), and the host operations running during the gaps of 10 us or more (`host_ops_in_gaps`: the CPU
    operation's name, the seconds of gap it overlaps, how many gaps), longest first. An operation that spans many
    gaps (the autograd engine's, a compiled region's) names the phase; a short one the cause."""
    gaps = []
    end = None
    for a, b in spans:  # sorted by start
        if end is not None and a > end:
            gaps.append((end, a))
        end = b if end is None else max(end, b)
    by_bin: dict[str, float] = {}
    for a, b in gaps:
        label = next((f"<{x}" for x in GAP_BINS_US if b - a < x), f">={GAP_BINS_US[-1]}")
        by_bin[label] = by_bin.get(label, 0.0) + (b - a) / 1e6
    long_gaps = [(a, b) for a, b in gaps if b - a >= GAP_BINS_US[0]]
    host = sorted(((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events
                   if e.get("cat") in ("cpu_op", "python_function", "user_annotation") and "dur" in e
                   and not str(e["name"]).startswith("ProfilerStep")))
    starts = [h[0] for h in host]
    overlap: dict[str, list] = {}
    for a, b in long_gaps:
        for h0, h1, name in host[:bisect.bisect_left(starts, b)]:
            o = min(b, h1) - max(a, h0)
            if o > 0:
                entry = overlap.setdefault(str(name)[:120], [0.0, 0])
                entry[0] += o / 1e6
                entry[1] += 1
    ranked = sorted(overlap.items(), key=lambda kv: -kv[1][0])[:top]
    return {"idle_s_by_gap_us": {k: round(v, 6) for k, v in by_bin.items()},
            "host_ops_in_gaps": [{"name": n, "s": round(t, 6), "gaps": c} for n, (t, c) in ranked]}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--workload", default="seeds")
    p.add_argument("--pick", type=int, default=1, help="the plan's rank to train")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--profile-from", type=int, default=5, help="the first profiled step (0-based)")
    p.add_argument("--profile-steps", type=int, default=3)
    p.add_argument("--cap", default="rtx4090")
    p.add_argument("--sdpa-first", choices=("default", "cudnn", "flash", "efficient"), default="default",
                   help="put this SDPA backend first for the whole run (torch.nn.attention.sdpa_kernel set_priority)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=YAML",
                   help="a key of the written plan changed before training (e.g. compile=none)")
    args = p.parse_args()

    import torch

    from bench.rank_check import parse_overrides, write_plan_config

    name = args.workload + (f".{args.sdpa_first}" if args.sdpa_first != "default" else "") + \
        "".join(f".{kv}" for kv in args.set)
    safe = re.sub(r"[^\w.=-]", "_", name)
    work = os.path.join(args.out, "work", safe)
    path, cfg = write_plan_config(work, args.workload, args.pick, args.steps, args.cap, parse_overrides(args.set))

    import fitune.train.loop as loop

    original = loop._optimizer_step
    state: dict = {}
    trace_path = os.path.join(args.out, f"trace.{safe}.json.gz")
    last = args.profile_from + args.profile_steps - 1

    step_arg = list(inspect.signature(original).parameters).index("step")

    def profiled(*a, **kw):  # the loop's own signature, whatever it is: only `step` is read
        step = kw["step"] if "step" in kw else a[step_arg]
        if step == args.profile_from:
            torch.cuda.synchronize()
            state["prof"] = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                               torch.profiler.ProfilerActivity.CUDA])
            state["prof"].__enter__()
            state["t0"] = time.perf_counter()
        loss = original(*a, **kw)
        if step == last:
            torch.cuda.synchronize()
            state["wall_s"] = time.perf_counter() - state["t0"]
            state["prof"].__exit__(None, None, None)
            state["prof"].export_chrome_trace(trace_path)
        return loss

    loop._optimizer_step = profiled
    from fitune.cli.main import main as fitune_main

    if args.sdpa_first != "default":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        first = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                 "efficient": SDPBackend.EFFICIENT_ATTENTION}[args.sdpa_first]
        order = [first] + [b for b in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                                       SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH) if b != first]
        ctx = sdpa_kernel(order, set_priority=True)
    else:
        import contextlib

        ctx = contextlib.nullcontext()
    with ctx, grad_norm_probe() as seen:  # seen: the first step's trainable-gradient norm
        code = fitune_main(["train", path, "--no-progress"])
    metrics = os.path.join(cfg["output_dir"], "metrics.jsonl")
    steps = [json.loads(x) for x in open(metrics)] if os.path.exists(metrics) else []
    losses = [s["loss"] for s in steps if "loss" in s]
    steps = [s for s in steps if "tokens_per_s" in s]
    record = {"workload": args.workload, "name": name, "pick": args.pick, "set": args.set,
              "sdpa_first": args.sdpa_first, "exit": code, "steps": len(steps),
              "setup": {k: v for k, v in cfg.items() if k not in ("data", "tokenizer", "output_dir")},
              "tokens_per_s_median": statistics.median(s["tokens_per_s"] for s in steps[2:]) if len(steps) > 2
              else None,
              "step_time_s": [round(s["step_time_s"], 4) for s in steps],
              "peak_allocated_bytes": max((s["peak_allocated_bytes"] or 0 for s in steps), default=None),
              "peak_reserved_bytes": max((s["peak_reserved_bytes"] or 0 for s in steps), default=None),
              "versions": {"torch": torch.__version__}}
    if "wall_s" in state:
        record.update(summarize(trace_path, state["wall_s"], args.profile_steps))
    write_record(os.path.join(args.out, "step_profile.jsonl"), record,
                 training=training_facts(losses, seen, why_none=f"fitune train exited {code} before it"))
    print(json.dumps({k: v for k, v in record.items() if k != "top_kernels"}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

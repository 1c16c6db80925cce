"""Issue 15's single-GPU record: DeepSpeed ZeRO-2, ZeRO-3 and ZeRO-3 + offload against no DeepSpeed, on one GPU,
along the user's path (`fitune train run.yaml --gpus 1 --strategy S`), random weights, synthetic data. Claims C14
("ZeRO-2 on one GPU helps at once; ZeRO-3 only adds overhead") and C24 ("ZeRO-Offload frees a block of memory").

Workloads: the seeds' Llama-3.1-8B LoRA (r8 q,v, bf16, 2 x 2048, checkpointing) and a Llama-3.2-1B full fine-tune
(AdamW, bf16, 2 x 2048, checkpointing). No allocator cap: the peaks are what each strategy needs. One JSON line per
run in --out/zero.jsonl: the per-step metrics `fitune train` wrote (tokens/s, peak allocated / reserved), the
child processes' largest resident set (host memory, offload), and fitune's estimate of the same setup.

    export PYTHONPATH=.:/tmp/site PYTHONUNBUFFERED=1
    python3 bench/zero_single_gpu.py --out $OUT --steps 10
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import yaml  # noqa: E402

from fitune.train.synthetic import make_word_tokenizer, synthetic_words, write_chat_data  # noqa: E402

WORKLOADS = {
    "lora8b": {"model": "llama-3.1-8b", "method": "lora", "lora": {"rank": 8, "alpha": 16,
                                                                  "targets": ["q_proj", "v_proj"]}},
    "full1b": {"model": "llama-3.2-1b", "method": "full"},
}
STRATEGIES = ("none", "zero2", "zero3", "zero3_offload")


def estimate_of(cfg: dict) -> dict:
    from fitune.memory import estimate
    from fitune.specs.model import load_model_spec
    from fitune.config import config_from_dict

    tc = config_from_dict(dict(cfg))
    est = estimate(load_model_spec(cfg["model"]), tc.setup)
    return {"estimate_peak_allocated_bytes": est.peak_allocated_bytes,
            "estimate_peak_reserved_bytes": est.peak_reserved_bytes, "estimate_host_bytes": est.host_bytes,
            "estimate_breakdown": est.breakdown}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--timeout", type=float, default=240)
    args = p.parse_args()
    work = os.path.join(args.out, "work")
    os.makedirs(work, exist_ok=True)
    words = synthetic_words(4000)
    tok = make_word_tokenizer(os.path.join(work, "tokenizer"), words)
    data = write_chat_data(os.path.join(work, "train.jsonl"), 64, words, answer_words=2100)
    results = os.path.join(args.out, "zero.jsonl")
    for wl in args.workloads.split(","):
        for strategy in args.strategies.split(","):
            name = f"{wl}-{strategy}"
            cfg = {**WORKLOADS[wl], "init": "random", "tokenizer": tok, "data": {"path": data, "format": "chat"},
                   "dtype": "bf16", "seq_len": 2048, "batch_size": 2, "grad_accum": 1, "grad_checkpointing": "full",
                   "attn": "sdpa", "optimizer": "adamw", "max_steps": args.steps, "lr": 1e-5, "schedule": "constant",
                   "output_dir": os.path.join(work, name)}
            if strategy != "none":
                cfg.update({"gpus": 1, "strategy": strategy})
            path = os.path.join(work, f"{name}.yaml")
            with open(path, "w") as f:
                yaml.safe_dump(cfg, f)
            record = {"run": name, "workload": wl, "strategy": strategy, "config": cfg}
            try:
                record.update(estimate_of(cfg))
            except Exception as exc:  # noqa: BLE001 - the run still counts without an estimate
                record["estimate_error"] = repr(exc)
            cmd = [sys.executable, "-m", "fitune", "train", path, "--no-progress"]
            print("###", name, " ".join(cmd), flush=True)
            before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
            t0 = time.time()
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
                record["exit"], tail = proc.returncode, (proc.stdout[-1500:] + proc.stderr[-2500:])
            except subprocess.TimeoutExpired as exc:
                record["exit"], tail = "timeout", str(exc)[-2000:]
            record["wall_s"] = round(time.time() - t0, 1)
            after = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
            record["max_child_rss_bytes"] = after * 1024 if after > before else None  # None: not above an earlier run
            metrics = os.path.join(cfg["output_dir"], "metrics.jsonl")
            steps = [json.loads(x) for x in open(metrics)] if os.path.exists(metrics) else []
            steps = [s for s in steps if "tokens_per_s" in s]
            record["steps"] = steps
            if steps:
                steady = [s["tokens_per_s"] for s in steps[2:]] or [s["tokens_per_s"] for s in steps]
                record["tokens_per_s_median"] = statistics.median(steady)
                record["peak_allocated_bytes"] = max(s["peak_allocated_bytes"] or 0 for s in steps)
                record["peak_reserved_bytes"] = max(s["peak_reserved_bytes"] or 0 for s in steps)
            record["log_tail"] = tail
            with open(results, "a") as f:
                f.write(json.dumps(record) + "\n")
            print(json.dumps({k: record.get(k) for k in ("run", "exit", "wall_s", "tokens_per_s_median",
                                                         "peak_allocated_bytes", "peak_reserved_bytes",
                                                         "estimate_peak_allocated_bytes")}), flush=True)
            if record["exit"] != 0:
                print(tail, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

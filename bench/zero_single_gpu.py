"""Issue 15's single-GPU record: DeepSpeed ZeRO-2, ZeRO-3 and ZeRO-3 + offload against no DeepSpeed, on one GPU,
along the user's path (`fitune train run.yaml --gpus 1 --strategy S`), random weights, synthetic data. Claims C14
("ZeRO-2 on one GPU helps at once; ZeRO-3 only adds overhead") and C24 ("ZeRO-Offload frees a block of memory").

Workloads: the seeds' Llama-3.1-8B LoRA (r8 q,v, bf16, 2 x 2048, checkpointing) and a Llama-3.2-1B full fine-tune
(AdamW, bf16, 2 x 2048, checkpointing). No allocator cap: the peaks are what each strategy needs. One JSON line per
run in --out/zero.jsonl: the per-step metrics `fitune train` wrote (tokens/s, peak allocated / reserved), the
child processes' largest resident set (host memory, offload), and fitune's estimate of the same setup.

    export PYTHONPATH=.:/tmp/site PYTHONUNBUFFERED=1
    python3 bench/zero_single_gpu.py --out $OUT --steps 10

--runs NAME[,NAME...] picks runs by name (workload-strategy: lora8b-zero3_offload); --memory-history NAME[,...] records
PyTorch's allocator history in those runs' training process (rank 0, no stacks: bench/_with_memory_history.py) and
writes its summary to --out/NAME.memory.json: the peak of live bytes replayed from the trace, the blocks live then by
size, the phase it fell in (building the model, deepspeed.initialize, step N, ...). The runs' folders, configs and
full logs go to --work (a temporary folder by default), so --out holds zero.jsonl, the summaries and logs_tail.txt.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench.common import probed_fitune_cmd, training_facts, write_record  # noqa: E402

import yaml  # noqa: E402

from fitune.train.synthetic import make_word_tokenizer, synthetic_words, write_chat_data  # noqa: E402

WORKLOADS = {
    "lora8b": {"model": "llama-3.1-8b", "method": "lora", "lora": {"rank": 8, "alpha": 16,
                                                                  "targets": ["q_proj", "v_proj"]}},
    "full1b": {"model": "llama-3.2-1b", "method": "full"},
}
STRATEGIES = ("none", "zero2", "zero3", "zero3_offload")
HERE = os.path.dirname(os.path.abspath(__file__))
LOG_TAIL_LINES = 40
"""Lines of each run's log that go into --out/logs_tail.txt (the whole log stays in --work)."""


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
    p.add_argument("--runs", default=None,
                   help="only these runs, by name (workload-strategy, comma-separated): lora8b-zero3_offload,...")
    p.add_argument("--memory-history", default="",
                   help="runs (by name, comma-separated) that record the allocator history (summary: OUT/NAME.memory.json)")
    p.add_argument("--work", default=None, help="the runs' folders, configs and logs (default: a temporary folder)")
    p.add_argument("--timeout", type=float, default=240)
    args = p.parse_args()
    names = [f"{wl}-{st}" for wl in args.workloads.split(",") for st in args.strategies.split(",")]
    if args.runs:
        wanted = args.runs.split(",")
        unknown = sorted(set(wanted) - {f"{wl}-{st}" for wl in WORKLOADS for st in STRATEGIES})
        if unknown:
            p.error(f"--runs: unknown {unknown}; names are workload-strategy, workloads {', '.join(WORKLOADS)}, "
                    f"strategies {', '.join(STRATEGIES)}")
        names = wanted
    traced = set(filter(None, args.memory_history.split(",")))
    if traced - set(names):
        p.error(f"--memory-history: {sorted(traced - set(names))} are not among the runs ({', '.join(names)})")
    os.makedirs(args.out, exist_ok=True)
    work = args.work or tempfile.mkdtemp(prefix="fitune-zero-")
    os.makedirs(work, exist_ok=True)
    words = synthetic_words(4000)
    tok = make_word_tokenizer(os.path.join(work, "tokenizer"), words)
    data = write_chat_data(os.path.join(work, "train.jsonl"), 64, words, answer_words=2100)
    results = os.path.join(args.out, "zero.jsonl")
    for name in names:
        wl, strategy = name.split("-", 1)
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
        probe, env = os.path.join(work, f"{name}.grad_norm.json"), None
        if os.path.exists(probe):
            os.remove(probe)
        if strategy == "none" and name not in traced:  # one process trains: it reads its first-step gradient norm
            probed, env = probed_fitune_cmd(probe)
            cmd = [*probed, "train", path, "--no-progress"]
        summary = os.path.join(args.out, f"{name}.memory.json")
        if os.path.exists(summary):
            os.remove(summary)  # an earlier bench's: never read as this run's
        if name in traced:  # the same command, through the wrapper that records in the training process
            cmd = [sys.executable, os.path.join(HERE, "_with_memory_history.py"), "--summary", summary, "--",
                   "train", path, "--no-progress"]
        print("###", name, " ".join(cmd), flush=True)
        before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        t0 = time.time()
        log_path = os.path.join(work, f"{name}.log")
        with open(log_path, "w") as log:
            try:
                record["exit"] = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT,
                                                timeout=args.timeout, env=env).returncode
            except subprocess.TimeoutExpired:
                record["exit"] = "timeout"
        with open(log_path, errors="replace") as log:
            lines = log.read().splitlines()
        tail = "\n".join(lines[-LOG_TAIL_LINES:])
        with open(os.path.join(args.out, "logs_tail.txt"), "a") as f:
            f.write(f"### {name} exit {record['exit']}\n{tail}\n")
        record["wall_s"] = round(time.time() - t0, 1)
        if name in traced:
            record["memory_history"] = _memory_history_brief(summary)
        after = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        record["max_child_rss_bytes"] = after * 1024 if after > before else None  # None: not above an earlier run
        metrics = os.path.join(cfg["output_dir"], "metrics.jsonl")
        steps = [json.loads(x) for x in open(metrics)] if os.path.exists(metrics) else []
        losses = [s["loss"] for s in steps if "loss" in s]
        steps = [s for s in steps if "tokens_per_s" in s]
        record["steps"] = steps
        if steps:
            steady = [s["tokens_per_s"] for s in steps[2:]] or [s["tokens_per_s"] for s in steps]
            record["tokens_per_s_median"] = statistics.median(steady)
            record["peak_allocated_bytes"] = max(s["peak_allocated_bytes"] or 0 for s in steps)
            record["peak_reserved_bytes"] = max(s["peak_reserved_bytes"] or 0 for s in steps)
        record["log_tail"] = tail[-4000:]
        why = (f"fitune train exited {record['exit']} before it" if env is not None else
               "not read: the step ran in a rank process fitune launched, or under the memory-history wrapper "
               "(and DeepSpeed's ZeRO keeps the gradients in its own buffers)")
        write_record(results, record, training=training_facts(losses, probe, why_none=why))
        print(json.dumps({k: record.get(k) for k in ("run", "exit", "wall_s", "tokens_per_s_median",
                                                     "peak_allocated_bytes", "peak_reserved_bytes",
                                                     "estimate_peak_allocated_bytes", "memory_history")}),
              flush=True)
        if record["exit"] != 0:
            print(tail[-3000:], flush=True)
    return 0


def _memory_history_brief(path: str) -> dict:
    """The few numbers of a run's allocator-history summary that its zero.jsonl line carries (the rest: `path`)."""
    if not os.path.exists(path):
        return {"summary": None, "why": "no summary written (the run failed before rank 0 finished training?)"}
    with open(path) as f:
        s = json.load(f)
    return {"summary": os.path.basename(path),
            **{k: s.get(k) for k in ("trace_events", "trace_full", "peak_live_bytes", "peak_reserved_bytes", "error",
                                     "note")},
            "peak_phase": (s.get("peak") or {}).get("phase"),
            "peak_reserved_phase": (s.get("peak_reserved") or {}).get("phase"),
            "largest_at_peak": (s.get("live_at_peak_by_size") or [])[:5]}


if __name__ == "__main__":
    raise SystemExit(main())

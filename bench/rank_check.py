"""Issue 12's ranking check, along the user's path: `fitune plan ... --top 3`, then each of the three plans written
with `--write plan.yaml --pick N` and trained with `fitune train` under the card's allocator cap (random weights,
synthetic data). Does the measured order follow the predicted one; is plan 1 the fastest or within 5 %?

    export PYTHONPATH=.:/tmp/site PYTHONUNBUFFERED=1
    python3 bench/rank_check.py --out $OUT --workload seeds --steps 12
    python3 bench/rank_check.py --out $OUT --workload qlora_seeds --steps 12 --plans 1   # a call's: plan 1 only

One JSON line per plan in --out/rank_check.jsonl: the workload, the plan's number, its setup and predicted tokens/s,
and the run's median tokens/s over steps 3 and later, its peaks and exit code.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench.common import probed_fitune_cmd, training_facts, write_record  # noqa: E402

import yaml  # noqa: E402

from fitune.train.synthetic import make_word_tokenizer, synthetic_words, write_chat_data  # noqa: E402

WORKLOADS = {
    "seeds": ["llama-3.1-8b", "--gpu", "rtx4090", "--seq-len", "2048", "--batch-size", "2"],
    "qlora32k": ["llama-3.1-8b", "--gpu", "rtx4090", "--seq-len", "32768", "--batch-size", "1", "--method", "qlora",
                 "--lora-rank", "32", "--lora-targets", "all-linear"],
    "full1b": ["llama-3.2-1b", "--gpu", "rtx4090", "--seq-len", "2048", "--batch-size", "2", "--method", "full"],
}
"""Issue 12's ranking check: the workloads of bench/results/rank_check/ (tests/test_rank_check.py holds the planner
to their record)."""

CALL_WORKLOADS = {
    # issue 32: the seeds' tokens as QLoRA r16 on every linear layer, fitune's plan 1 against Unsloth's QLoRA
    # (bench/calls/issue32_unsloth.sh)
    "qlora_seeds": ["llama-3.1-8b", "--gpu", "rtx4090", "--seq-len", "2048", "--batch-size", "2", "--method", "qlora",
                    "--lora-rank", "16", "--lora-targets", "all-linear"],
    # the seeds' workload planned without compiled layers or Liger (a CUDA machine without Triton): plan 1 keeps
    # checkpointing on the first layers only, plan 2 recomputes every layer at micro-batch 2 (docs/plan.md)
    "seeds_eager": ["llama-3.1-8b", "--gpu", "rtx4090", "--seq-len", "2048", "--batch-size", "2", "--kernels", "torch",
                    "--compile", "none"],
}
"""Workloads other calls train along the same path (`--workload NAME --plans 1`), outside issue 12's record."""

ALL_WORKLOADS = {**WORKLOADS, **CALL_WORKLOADS}


def write_plan_config(work: str, workload: str, pick: int, steps: int, cap: str,
                      overrides: dict | None = None) -> tuple[str, dict]:
    """The user's path up to `fitune train`: `fitune plan WORKLOAD --write plan{pick}.yaml --pick N`, then the run's
    own keys set in that file (random weights, a synthetic chat data set and word tokenizer made in `work`, the
    steps, the card's cap) and `overrides` (a variant of the plan a call measures beside it, e.g.
    grad_checkpointing: selective:3). Returns the file's path and its content."""
    os.makedirs(work, exist_ok=True)
    plan_args = ALL_WORKLOADS[workload] + ["--top", "3"]
    model = plan_args[0]
    seq = int(plan_args[plan_args.index("--seq-len") + 1])
    words = synthetic_words(4000)
    tok = make_word_tokenizer(os.path.join(work, "tokenizer"), words)
    data = write_chat_data(os.path.join(work, "train.jsonl"), 64, words, answer_words=seq + 50)
    path = os.path.join(work, f"plan{pick}.yaml")
    subprocess.run([sys.executable, "-m", "fitune", "plan", *plan_args, "--write", path, "--pick", str(pick)],
                   capture_output=True, text=True, check=True)
    cfg = yaml.safe_load(open(path))
    cfg.pop("epochs", None)
    cfg.update({"model": model, "init": "random", "tokenizer": tok, "data": {"path": data, "format": "chat"},
                "max_steps": steps, "cap": cap, "output_dir": os.path.join(work, f"run{pick}")})
    cfg.update(overrides or {})
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)
    return path, cfg


def parse_overrides(items: list[str]) -> dict:
    """`--set KEY=VALUE` items as a dict, each value read as YAML (2 -> int, selective:3 -> str)."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--set {item!r}: write KEY=VALUE, e.g. --set grad_checkpointing=selective:3")
        out[key.strip()] = yaml.safe_load(value)
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--workload", default="seeds", choices=sorted(ALL_WORKLOADS))
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--cap", default="rtx4090")
    p.add_argument("--timeout", type=float, default=240)
    p.add_argument("--plans", type=int, default=3, choices=(1, 2, 3),
                   help="train the first N of the top 3 plans (1: plan 1 only)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="change a key of the written plan before training (a variant measured beside plan 1, e.g. "
                        "--set grad_checkpointing=selective:3 --set batch_size=2); the record says so")
    p.add_argument("--case", help="the call's name for this run, kept in the record (a variant, a repeat)")
    args = p.parse_args()
    overrides = parse_overrides(args.set)
    work = os.path.join(args.out, "work", args.workload)
    plan_args = ALL_WORKLOADS[args.workload] + ["--top", "3"]
    fitune = [sys.executable, "-m", "fitune"]
    listing = subprocess.run(fitune + ["plan", *plan_args, "--json"], capture_output=True, text=True)
    plans = json.loads(listing.stdout)["plans"] if listing.stdout.strip() else []
    print("### plan:", [(p["rank"], round(p["tokens_per_s"])) for p in plans], listing.stderr[-500:], flush=True)
    for n, planned in enumerate(plans[:args.plans], 1):
        path, cfg = write_plan_config(work, args.workload, n, args.steps, args.cap, overrides)
        model = cfg["model"]
        probe = os.path.join(work, f"grad_norm_{n}.json")  # the child's first-step trainable-gradient norm
        probed, env = probed_fitune_cmd(probe)
        try:
            proc = subprocess.run(probed + ["train", path, "--no-progress"], capture_output=True, text=True,
                                  timeout=args.timeout, env=env)
            code, tail = proc.returncode, proc.stdout[-800:] + proc.stderr[-1500:]
        except subprocess.TimeoutExpired as exc:
            code, tail = "timeout", str(exc)[-800:]
        metrics = os.path.join(cfg["output_dir"], "metrics.jsonl")
        steps = [json.loads(x) for x in open(metrics)] if os.path.exists(metrics) else []
        losses = [s["loss"] for s in steps if "loss" in s]
        steps = [s for s in steps if "tokens_per_s" in s]
        setup = {**planned["setup"], **{k: v for k, v in overrides.items() if k in planned["setup"]}}
        record = {"workload": args.workload, "case": args.case, "model": model, "plan": n, "setup": setup,
                  "overrides": overrides,
                  "predicted_tokens_per_s": planned["tokens_per_s"], "exit": code, "steps": len(steps),
                  "tokens_per_s_median": statistics.median(s["tokens_per_s"] for s in steps[2:]) if len(steps) > 2
                  else None,
                  "peak_allocated_bytes": max((s["peak_allocated_bytes"] or 0 for s in steps), default=None),
                  "peak_reserved_bytes": max((s["peak_reserved_bytes"] or 0 for s in steps), default=None),
                  "micro_batch_sizes": sorted({s["micro_batch_size"] for s in steps}),
                  "step_time_s": [s.get("step_time_s") for s in steps],
                  "alloc_retries_per_step": [s.get("alloc_retries") for s in steps],
                  "peak_reserved_per_step_bytes": [s.get("peak_reserved_bytes") for s in steps], "log_tail": tail}
        write_record(os.path.join(args.out, "rank_check.jsonl"), record,
                     training=training_facts(losses, probe, why_none=f"fitune train exited {code} before it"))
        print(json.dumps({k: v for k, v in record.items() if k not in ("setup", "log_tail")}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Issue 4 / 6 GPU record: `fitune train` on the seeds' case (Llama-3.1-8B-shaped, LoRA r8 q,v, bf16, 2 x 2048)
under an RTX 4090's allocator budget, starting from the configuration that runs out of memory, so the OOM
guard re-plans it; and the planner's top plan. Synthetic tokenizer and data (no downloads). Run on the GPU
machine from the repository root:

    PYTHONPATH=. python3 bench/train_seeds.py --out $OUT --steps 12
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench.common import probed_fitune_cmd, provenance, training_facts, write_record  # noqa: E402

import yaml  # noqa: E402

from fitune.train.synthetic import make_word_tokenizer, synthetic_words, write_chat_data  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--runs", default="guard", help="comma list of: guard, ckpt, chunked, plan")
    p.add_argument("--model", default="llama-3.1-8b", help="catalog model or config.json (random weights)")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--cap", default="rtx4090")
    args = p.parse_args()
    work = os.path.join(args.out, "work")
    os.makedirs(work, exist_ok=True)
    from fitune.specs.model import load_model_spec

    words = synthetic_words(min(4000, load_model_spec(args.model).vocab_size - 16))
    tok = make_word_tokenizer(os.path.join(work, "tokenizer"), words)
    data = write_chat_data(os.path.join(work, "train.jsonl"), 64, words, answer_words=args.seq_len + 50)
    base = {"model": args.model, "init": "random", "tokenizer": tok, "data": {"path": data, "format": "chat"},
            "method": "lora", "lora": {"rank": 8, "alpha": 16, "targets": ["q_proj", "v_proj"]}, "dtype": "bf16",
            "seq_len": args.seq_len, "batch_size": 2, "grad_accum": 1, "max_steps": args.steps, "lr": 2e-4,
            "schedule": "constant", "cap": args.cap, "attn": "sdpa"}
    runs = {
        "guard": {**base, "grad_checkpointing": "none"},   # runs out of memory; the guard re-plans
        "ckpt": {**base, "grad_checkpointing": "full"},    # the recipe's own fix
        "chunked": {**base, "grad_checkpointing": "full", "loss": "chunked"},  # + fitune's chunked loss
    }
    if os.path.exists(os.path.join(args.out, "plan.yaml")):
        plan = yaml.safe_load(open(os.path.join(args.out, "plan.yaml")))
        plan.pop("epochs", None)
        runs["plan"] = {**plan, "model": args.model, "init": "random", "tokenizer": tok,
                        "data": {"path": data, "format": "chat"}, "max_steps": args.steps, "cap": args.cap}
    for name in args.runs.split(","):
        if name not in runs:
            continue
        cfg = {**runs[name], "output_dir": os.path.join(work, name)}
        path = os.path.join(work, f"{name}.yaml")
        with open(path, "w") as f:
            yaml.safe_dump(cfg, f)
        probe = os.path.join(work, f"{name}_grad_norm.json")  # the child's first-step trainable-gradient norm
        probed, env = probed_fitune_cmd(probe)
        cmd = [*probed, "train", path, "--no-progress"]
        print("###", " ".join(cmd), flush=True)
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
        metrics = os.path.join(cfg["output_dir"], "metrics.jsonl")
        lines = [json.loads(x) for x in open(metrics)] if os.path.exists(metrics) else []
        out = os.path.join(args.out, f"train_{name}.jsonl")
        if os.path.exists(out):
            os.remove(out)  # one run's lines per file, as before
        facts = training_facts([line["loss"] for line in lines if "loss" in line], probe,
                               why_none=f"fitune train exited {proc.returncode} before it")
        prov = provenance()  # once for the run's lines
        for line in lines:  # one line per step, each with the run's provenance and facts
            write_record(out, {"run": name, **line}, training=facts, prov=prov)
        print(proc.stdout[-2000:], proc.stderr[-3000:], f"exit {proc.returncode}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

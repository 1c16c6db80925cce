"""Issue 18 GPU record: the OOM guard mid-run loses no step and trains none twice.

Run A trains normally until step k, where the allocator is capped (emptied, then limited to what the step held
before it plus 3/4 of the step's own activations), so step k runs out of memory for real. The guard frees the
step, re-plans (halves the micro-batch; the effective batch stays) and runs the same data again; the cap stays for
the rest of the run. Run B starts from A's checkpoint of step k-1 with the re-planned setup already applied (the
plan changes A recorded, written into that checkpoint's copy) and no cap. Steps k..N of A and B should have the
same losses: equal on the CPU; on the GPU within bf16 noise (the max difference is recorded). One JSON line per
run goes to --out as it finishes, then a "compare" line.

GPU (the lead runs this; < 4 min on an H200; a random-init Qwen2.5-1.5B, LoRA all-linear, bf16, 2 x 8 x 1024 tokens):

    PYTHONPATH=. python3 bench/oom_guard.py --out bench/results/oom_guard.jsonl

CPU smoke (a tiny random Llama; the OOM is raised by the loop's fault hook at micro-batch 1 of step k, after
micro-batch 0 has put its gradients in, so the retry must discard them):

    PYTHONPATH=. python3 bench/oom_guard.py --device cpu --out /tmp/oom_guard.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench.common import grad_norm_probe, training_facts, write_record  # noqa: E402


def _gpu_doc(work: str, args) -> dict:
    from fitune.specs.model import load_model_spec
    from fitune.train.synthetic import make_word_tokenizer, synthetic_words, write_chat_data

    words = synthetic_words(min(4000, load_model_spec(args.model).vocab_size - 16))
    tok = make_word_tokenizer(os.path.join(work, "tokenizer"), words)
    data = write_chat_data(os.path.join(work, "train.jsonl"), 256, words, answer_words=args.seq_len)
    return {"model": args.model, "init": "random", "tokenizer": tok, "data": {"path": data, "format": "chat"},
            "method": "lora", "lora": {"rank": 16, "alpha": 32, "targets": ["all-linear"]}, "dtype": "bf16",
            "seq_len": args.seq_len, "batch_size": 8, "grad_accum": 2, "grad_checkpointing": "none",
            "attn": "sdpa", "lr": 2e-4, "schedule": "constant"}


def _cpu_doc(work: str) -> dict:
    from fitune.train.quickstart import write_quickstart

    import yaml

    doc = yaml.safe_load(open(write_quickstart(os.path.join(work, "quickstart"))))
    doc.pop("eval_every", None)
    doc["data"].pop("eval_path", None)
    return {**doc, "batch_size": 8, "grad_accum": 2, "seq_len": 32, "schedule": "constant", "warmup_steps": 0}


def _capper(oom_step: int, device: str, out_dir: str):
    """The loop's fault hook: at step `oom_step` (1-based) make the step run out of memory."""
    import torch

    state = {"capped": False, "cap_bytes": None}

    def fault(step: int, micro: int) -> None:
        if step + 1 != oom_step or state["capped"]:
            return
        if device == "cpu":
            if micro == 1:  # after micro-batch 0's backward: its gradients are in .grad and must go
                state["capped"] = True
                raise torch.OutOfMemoryError("CUDA out of memory (simulated by bench/oom_guard.py on the CPU)")
            return
        # the step before held `before` at its start and peaked at `peak`: cap at before + 3/4 of the difference
        with open(os.path.join(out_dir, "metrics.jsonl")) as f:
            peak = [json.loads(line) for line in f][-1]["peak_allocated_bytes"]
        torch.cuda.empty_cache()  # cached blocks would let the step run under the cap without asking for more
        before = torch.cuda.memory_allocated()
        cap = before + 3 * (peak - before) // 4
        torch.cuda.set_per_process_memory_fraction(cap / torch.cuda.get_device_properties(0).total_memory)
        state.update(capped=True, cap_bytes=cap, before_bytes=before, previous_peak_bytes=peak)

    return fault, state


def _record(path: str, row: dict, training: dict | None) -> None:
    write_record(path, row, training=training)
    print(json.dumps({k: v for k, v in row.items() if k not in ("losses", "micro_batch_size")}), flush=True)


def _step_lines(out_dir: str) -> list[dict]:
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if '"loss"' in line]


def run(args) -> dict:
    """Runs A and B; returns the compare row (also written to --out)."""
    import torch

    from fitune.config import config_from_dict
    from fitune.train import checkpoint
    from fitune.train.loop import train

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    work = args.work or tempfile.mkdtemp(prefix="oom_guard-")
    os.makedirs(work, exist_ok=True)
    base = _cpu_doc(work) if device == "cpu" else _gpu_doc(work, args)
    base.update(max_steps=args.steps, save_every=1, keep_checkpoints=args.steps, oom_guard=True)
    k = args.oom_step
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    # ---- A: capped at step k mid-run ---------------------------------------------------------------------
    a_dir = os.path.join(work, "A")
    shutil.rmtree(a_dir, ignore_errors=True)
    fault, cap = _capper(k, device, a_dir)
    t0 = time.perf_counter()
    with grad_norm_probe() as seen_a:  # the first step's trainable-gradient norm
        result_a = train(config_from_dict({**base, "output_dir": a_dir}, "oom_guard A"), fault=fault,
                         progress=False)
    a = _step_lines(a_dir)
    if device == "cuda":
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()
    _record(args.out, {"run": "A", "device": device, "model": base["model"], "steps": args.steps, "oom_step": k,
                       "cap": cap, "plan_changes": result_a.plan.changes, "wall_s": time.perf_counter() - t0,
                       "steps_logged": [line["step"] for line in a], "losses": [line["loss"] for line in a],
                       "micro_batch_size": [line["micro_batch_size"] for line in a],
                       "peak_allocated_bytes": [line["peak_allocated_bytes"] for line in a]},
            training_facts([line["loss"] for line in a], seen_a))
    del result_a

    # ---- B: the re-planned setup from A's checkpoint of step k-1 ------------------------------------------
    b_dir = os.path.join(work, "B")
    shutil.rmtree(b_dir, ignore_errors=True)
    os.makedirs(os.path.join(b_dir, checkpoint.CHECKPOINTS))
    shutil.copy(os.path.join(a_dir, "run.json"), b_dir)  # the same run identity: --resume takes it
    start = checkpoint.checkpoint_dir(b_dir, k - 1)
    shutil.copytree(checkpoint.checkpoint_dir(a_dir, k - 1), start)
    final_a = checkpoint.read_state(checkpoint.checkpoint_dir(a_dir, args.steps))
    state_file = os.path.join(start, "trainer_state.json")
    state = json.load(open(state_file))
    state["plan_changes"] = final_a["plan_changes"]  # started with the re-planned setup, not re-planning
    with open(state_file, "w") as f:
        json.dump(state, f)
    checkpoint.reseal(start)  # the edit above is on purpose: its manifest follows it
    t0 = time.perf_counter()
    with grad_norm_probe() as seen_b:  # B's first step (k) is the first this process trains
        train(config_from_dict({**base, "output_dir": b_dir}, "oom_guard B"), resume=True, progress=False)
    b = _step_lines(b_dir)
    _record(args.out, {"run": "B", "device": device, "model": base["model"], "resumed_from_step": k - 1,
                       "plan_changes": final_a["plan_changes"], "wall_s": time.perf_counter() - t0,
                       "steps_logged": [line["step"] for line in b], "losses": [line["loss"] for line in b],
                       "micro_batch_size": [line["micro_batch_size"] for line in b],
                       "peak_allocated_bytes": [line["peak_allocated_bytes"] for line in b]},
            training_facts([line["loss"] for line in b], seen_b))

    # ---- compare steps k..N ----------------------------------------------------------------------------
    after_a = {line["step"]: line["loss"] for line in a if line["step"] >= k}
    after_b = {line["step"]: line["loss"] for line in b if line["step"] >= k}
    diffs = [abs(after_a[s] - after_b[s]) for s in after_a if s in after_b]
    compare = {"run": "compare", "device": device, "oom_step": k,
               "a_steps_once": [line["step"] for line in a] == list(range(1, args.steps + 1)),
               "replanned": bool(final_a["plan_changes"]) and final_a["plan_changes"][0]["step"] == k,
               "same_steps": sorted(after_a) == sorted(after_b) == list(range(k, args.steps + 1)),
               "max_abs_loss_diff": max(diffs) if diffs else None,
               "max_rel_loss_diff": max((d / abs(after_b[s]) for d, s in zip(diffs, sorted(after_b))),
                                        default=None),
               "equal": diffs == [0.0] * len(diffs) and bool(diffs)}
    _record(args.out, compare, training=None)  # A against B: no run of its own
    return compare


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="JSON lines file (appended): one line per run and a compare line")
    p.add_argument("--device", choices=["cuda", "cpu"], help="default: cuda when available")
    p.add_argument("--model", default="qwen2.5-1.5b", help="GPU: a catalog model or config.json (random weights)")
    p.add_argument("--seq-len", type=int, default=1024, help="GPU: tokens per sequence")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--oom-step", type=int, default=5, help="the 1-based step that runs out of memory")
    p.add_argument("--work", help="where the runs' folders go (default: a new temporary folder)")
    args = p.parse_args(argv)
    if not 2 <= args.oom_step <= args.steps:
        p.error("--oom-step must be between 2 and --steps (run B starts from the checkpoint before it)")
    print("# " + " ".join(["python3", "bench/oom_guard.py", *(sys.argv[1:] if argv is None else argv)]), flush=True)
    compare = run(args)
    ok = compare["a_steps_once"] and compare["replanned"] and compare["same_steps"]
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

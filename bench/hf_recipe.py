"""Measure the HF recipe's peak GPU memory over many cases (issue 2, item 7). Run on the GPU machine.

One JSON line per case, appended to --out as soon as the case ends (a run cut at its time limit keeps what it
measured). Each architecture is built once, with random weights, directly on the GPU; each case wraps it with
PEFT, runs 3 recipe steps, records every phase's allocator counters, and unwraps it again.

    PYTHONUNBUFFERED=1 python3 bench/hf_recipe.py --group llama-3.1-8b:bf16 --out $OUT/hf_recipe.jsonl

`--list` prints the groups. `--snapshot-dir DIR` writes a compact allocation trace of the last step of the cases
marked for it (what was allocated where, for attributing the peak).
"""

from __future__ import annotations

import argparse
import gc
import gzip
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench.common import grad_norm_probe, training_facts, write_record  # noqa: E402

QV = ["q_proj", "v_proj"]
ALL = "all-linear"

# (targets, rank, batch, seq, checkpointing, attn, snapshot)
LLAMA_BF16 = [
    (QV, 8, 2, 2048, True, "sdpa", True),
    (QV, 8, 2, 2048, False, "sdpa", True),
    (QV, 8, 1, 512, False, "sdpa", False),
    (QV, 8, 8, 256, False, "sdpa", False),
    (QV, 8, 1, 8192, True, "sdpa", False),
    (QV, 8, 1, 32768, True, "sdpa", False),
    (QV, 8, 4, 1024, True, "eager", False),
    (QV, 8, 1, 2048, False, "eager", False),
    (ALL, 16, 2, 2048, True, "sdpa", False),
    (ALL, 16, 2, 2048, False, "sdpa", True),
    (ALL, 64, 1, 4096, True, "sdpa", False),
    (ALL, 32, 1, 16384, True, "sdpa", False),
    (QV, 8, 4, 4096, True, "sdpa", False),
]
LLAMA_NF4 = [
    (QV, 8, 2, 2048, True, "sdpa", True),
    (ALL, 32, 1, 8192, True, "sdpa", False),
    (ALL, 16, 2, 2048, False, "sdpa", False),
    (QV, 8, 1, 16384, True, "sdpa", False),
    (ALL, 64, 4, 1024, True, "eager", False),
    (ALL, 32, 1, 32768, True, "sdpa", False),
]
MISTRAL_BF16 = [
    (QV, 8, 2, 2048, True, "sdpa", False),
    (QV, 8, 2, 2048, False, "sdpa", False),
    (ALL, 16, 1, 4096, True, "sdpa", False),
    (QV, 16, 8, 512, False, "sdpa", False),
    (QV, 8, 2, 1024, False, "eager", False),
    (QV, 8, 1, 16384, True, "sdpa", False),
]
QWEN25_BF16 = [
    (QV, 8, 2, 2048, True, "sdpa", False),
    (QV, 8, 2, 2048, False, "sdpa", False),
    (ALL, 16, 4, 2048, False, "sdpa", False),
    (ALL, 64, 1, 32768, True, "sdpa", False),
    (QV, 8, 8, 1024, True, "eager", False),
    (QV, 32, 1, 256, False, "sdpa", False),
]
QWEN25_NF4 = [
    (QV, 8, 2, 2048, True, "sdpa", False),
    (ALL, 16, 2, 4096, False, "sdpa", False),
]
QWEN3_BF16 = [
    (QV, 8, 2, 2048, True, "sdpa", False),
    (QV, 8, 2, 2048, False, "sdpa", False),
    (ALL, 32, 1, 8192, True, "sdpa", False),
    (ALL, 8, 4, 1024, False, "eager", False),
    (QV, 8, 1, 16384, False, "sdpa", False),
    (QV, 16, 8, 512, True, "sdpa", False),
]
GEMMA2_BF16 = [
    (QV, 8, 2, 2048, True, "eager", False),
    (QV, 8, 2, 2048, False, "eager", True),
    (ALL, 16, 1, 4096, True, "eager", False),
    (QV, 8, 2, 2048, True, "sdpa", False),
    (ALL, 8, 4, 512, False, "sdpa", False),
    (QV, 8, 1, 8192, True, "sdpa", False),
]

# full fine-tuning and freeze (issue 12): (method, optimizer, batch, seq, checkpointing, freeze K, snapshot)
LLAMA1B_FULL = [
    ("full", "adamw", 2, 2048, True, 0, True),
    ("full", "adamw", 4, 4096, True, 0, True),
    ("full", "adamw", 2, 512, False, 0, True),
    ("full", "adafactor", 2, 2048, True, 0, True),
    ("full", "adamw8bit", 2, 2048, True, 0, True),
    ("full", "sgd", 2, 2048, True, 0, False),
    ("freeze", "adamw", 2, 2048, True, 4, True),
]
QWEN15_FULL = [
    ("full", "adamw", 2, 2048, True, 0, True),
    ("full", "adamw", 2, 512, False, 0, True),
    ("full", "adamw8bit", 2, 2048, True, 0, False),
    ("full", "adafactor", 1, 4096, True, 0, False),
    ("freeze", "adamw", 2, 2048, True, 4, False),
]
FULL_GROUPS = {
    "llama-3.2-1b:full": ("llama-3.2-1b", LLAMA1B_FULL),
    "qwen2.5-1.5b:full": ("qwen2.5-1.5b", QWEN15_FULL),
}

GROUPS = {
    "llama-3.1-8b:bf16": ("llama-3.1-8b", "lora", LLAMA_BF16),
    "llama-3.1-8b:nf4": ("llama-3.1-8b", "qlora", LLAMA_NF4),
    "mistral-7b:bf16": ("mistral-7b", "lora", MISTRAL_BF16),
    "qwen2.5-1.5b:bf16": ("qwen2.5-1.5b", "lora", QWEN25_BF16),
    "qwen2.5-1.5b:nf4": ("qwen2.5-1.5b", "qlora", QWEN25_NF4),
    "qwen3-1.7b:bf16": ("qwen3-1.7b", "lora", QWEN3_BF16),
    "gemma-2-2b:bf16": ("gemma-2-2b", "lora", GEMMA2_BF16),
}


@dataclass
class StepPeaks:
    """Measured CUDA allocator counters of one training step, phase by phase (bytes)."""

    step: int
    start_allocated_bytes: int
    forward_peak_allocated_bytes: int
    forward_peak_reserved_bytes: int
    after_forward_allocated_bytes: int
    backward_peak_allocated_bytes: int
    backward_peak_reserved_bytes: int
    after_backward_allocated_bytes: int
    optimizer_peak_allocated_bytes: int
    optimizer_peak_reserved_bytes: int
    after_step_allocated_bytes: int
    step_time_s: float
    saved_tensor_bytes: int | None = None
    loss: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def run_recipe_steps(model, optimizer, ids, steps: int = 3, count_saved_on_last: bool = True,
                     check_first: bool = False) -> list[StepPeaks]:
    """Run `steps` HF-recipe steps (fitune's runtime step with `recipe=True`: `model(input_ids=ids,
    labels=ids).loss`, backward, AdamW step, zero_grad) and record the allocator counters of each phase.
    `check_first`: the first step checks its gradients (where `bench.common.grad_norm_probe` reads their norm)."""
    import contextlib

    import torch

    from fitune.runtime.step import count_saved_tensors, train_step

    cuda = torch.cuda
    param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    out: list[StepPeaks] = []
    for step in range(steps):
        counters: dict[str, int] = {}
        saved: dict[int, int] | None = None
        if count_saved_on_last and step == steps - 1:
            saved = {}

        @contextlib.contextmanager
        def phase(name: str):
            cuda.reset_peak_memory_stats()
            with contextlib.ExitStack() as stack:
                if name == "forward" and saved is not None:
                    ctx, seen = count_saved_tensors()
                    stack.enter_context(ctx)
                yield
            if name == "forward" and saved is not None:
                saved.update(seen)
            cuda.synchronize()
            counters[f"{name}_peak_allocated_bytes"] = cuda.max_memory_allocated()
            counters[f"{name}_peak_reserved_bytes"] = cuda.max_memory_reserved()
            counters[f"after_{name}_allocated_bytes"] = cuda.memory_allocated()

        cuda.synchronize()
        t0 = time.perf_counter()
        start = cuda.memory_allocated()
        loss = train_step(model, optimizer, [ids], recipe=True, phase=phase,
                          check_gradients=check_first and step == 0).loss
        cuda.synchronize()
        out.append(StepPeaks(
            step=step, start_allocated_bytes=start,
            forward_peak_allocated_bytes=counters["forward_peak_allocated_bytes"],
            forward_peak_reserved_bytes=counters["forward_peak_reserved_bytes"],
            after_forward_allocated_bytes=counters["after_forward_allocated_bytes"],
            backward_peak_allocated_bytes=counters["backward_peak_allocated_bytes"],
            backward_peak_reserved_bytes=counters["backward_peak_reserved_bytes"],
            after_backward_allocated_bytes=counters["after_backward_allocated_bytes"],
            optimizer_peak_allocated_bytes=counters["optimizer_peak_allocated_bytes"],
            optimizer_peak_reserved_bytes=counters["optimizer_peak_reserved_bytes"],
            after_step_allocated_bytes=counters["after_optimizer_allocated_bytes"],
            step_time_s=time.perf_counter() - t0,
            saved_tensor_bytes=None if saved is None else sum(n for p, n in saved.items() if p not in param_ptrs),
            loss=loss,
        ))
    return out


def load_catalog_config(name: str) -> dict:
    here = os.path.dirname(os.path.abspath(__file__))
    for fname in ("models.json", "models_seed.json"):
        path = os.path.join(here, "..", "fitune", "specs", "data", fname)
        if os.path.exists(path):
            with open(path) as f:
                data = json.load(f)
            if name in data:
                return data[name]["config"]
    raise SystemExit(f"model {name!r} not in the catalog")


_KEEP = ("deepspeed/", "transformers/", "peft/", "bitsandbytes/", "bench/", "fitune/", "torch/nn/", "torch/optim/",
         "torch/utils/checkpoint", "torch/autograd")


def _where(frames) -> str:
    for fr in frames:
        fn = fr.get("filename", "")
        for k in _KEEP:
            i = fn.find(k)
            if i >= 0:
                return f"{fn[i:]}:{fr.get('line')}:{fr.get('name')}"
    return "?"


def compact_snapshot(snapshot: dict) -> dict:
    """Reduce a CUDA memory snapshot to events [action, addr, size, where] with a table of where-strings."""
    wheres: dict[str, int] = {}
    events = []
    for e in snapshot["device_traces"][0]:
        action = e["action"]
        if action not in ("alloc", "free_completed", "segment_alloc", "segment_free"):
            continue
        w = _where(e.get("frames", []))
        idx = wheres.setdefault(w, len(wheres))
        events.append([action, e["addr"], e["size"], idx])
    segments = [[seg["total_size"], [[b["size"], b["state"]] for b in seg["blocks"]]]
                for seg in snapshot.get("segments", []) if seg.get("device", 0) == 0]
    return {"where": list(wheres), "events": events, "segments_at_end": segments}


def measure_steps(model, opt, ids, record: dict, steps: int, snapshot_path: str | None,
                  trace_first_step: bool) -> None:
    """Run `steps` recipe steps and put their counters in `record`: the allocator state before them, each step's
    phase peaks, the peaks over all of them, tokens/s (the fastest step after the first) and allocator retries.
    With `snapshot_path`, a compact allocation trace is written there: of every step (`trace_first_step`: the
    first step creates a full fine-tune's optimizer state) or of all but the first."""
    import torch

    batch, seq = ids.shape
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_stats()
    record["before_steps_allocated_bytes"] = torch.cuda.memory_allocated()
    record["before_steps_reserved_bytes"] = torch.cuda.memory_reserved()
    probe = grad_norm_probe()
    record["_grad_probe"] = probe.__enter__()  # the first step's trainable-gradient norm, for _record_case
    try:
        if snapshot_path:
            peaks = [] if trace_first_step else run_recipe_steps(model, opt, ids, steps=1, count_saved_on_last=False,
                                                                 check_first=True)
            torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="python")
            peaks += run_recipe_steps(model, opt, ids, steps=steps - len(peaks), check_first=not peaks)
            snapshot = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
            with gzip.open(snapshot_path, "wt") as f:
                json.dump(compact_snapshot(snapshot), f)
            del snapshot
        else:
            peaks = run_recipe_steps(model, opt, ids, steps=steps, check_first=True)
    finally:
        probe.__exit__(None, None, None)
    stats = torch.cuda.memory_stats()
    record["num_alloc_retries"] = stats.get("num_alloc_retries", 0) - before.get("num_alloc_retries", 0)
    record["steps"] = [asdict(p) for p in peaks]
    record["peak_allocated_bytes"] = max(x for p in peaks for x in (
        p.forward_peak_allocated_bytes, p.backward_peak_allocated_bytes, p.optimizer_peak_allocated_bytes))
    record["peak_reserved_bytes"] = max(x for p in peaks for x in (
        p.forward_peak_reserved_bytes, p.backward_peak_reserved_bytes, p.optimizer_peak_reserved_bytes))
    record["tokens_per_s"] = batch * seq / min(p.step_time_s for p in peaks[1:] or peaks)


def run_group(group: str, out_path: str, snapshot_dir: str | None, steps: int,
              only: set[int] | None = None, snapshot_all: bool = False) -> None:
    import torch

    from fitune.runtime.model import build_model, set_checkpointing, wrap_lora
    from fitune.runtime.optim import build_optimizer

    model_name, method, cases = GROUPS[group]
    cfg = load_catalog_config(model_name)
    torch.cuda.empty_cache()
    t0 = time.perf_counter()
    model = build_model(cfg, dtype_name="bf16", attn="sdpa", device="cuda", init="random",
                        quantize="nf4" if method == "qlora" else None)
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    base_allocated = torch.cuda.memory_allocated()
    print(f"[{group}] built in {time.perf_counter() - t0:.1f}s, {base_allocated / 2**30:.2f} GiB", flush=True)
    vocab = cfg["vocab_size"]
    for i, (targets, rank, batch, seq, ckpt, attn, snap) in enumerate(cases):
        if only is not None and i not in only:
            continue
        snap = snap or snapshot_all
        record = {
            "group": group, "model": model_name, "method": method, "case": i,
            "lora_targets": targets if isinstance(targets, str) else ",".join(targets), "lora_rank": rank,
            "batch_size": batch, "seq_len_tokens": seq, "grad_checkpointing": "full" if ckpt else "none",
            "attn": attn, "dtype": "bf16", "optimizer": "adamw", "loss": "hf", "stack": "hf",
            "model_only_allocated_bytes": base_allocated, "cap": CAP,
        }
        peft_model = None
        try:
            model.set_attn_implementation(attn)
            peft_model = wrap_lora(model, rank, targets)
            if ckpt:
                set_checkpointing(peft_model, True)
            trainable = [p for p in peft_model.parameters() if p.requires_grad]
            record["trainable_params"] = sum(p.numel() for p in trainable)
            record["trainable_bytes"] = sum(p.numel() * p.element_size() for p in trainable)
            opt = build_optimizer("adamw", trainable, lr=1e-4)
            ids = torch.randint(0, vocab, (batch, seq), device="cuda")
            gc.collect()
            torch.cuda.empty_cache()
            path = os.path.join(snapshot_dir, f"snap_{group.replace(':', '_')}_{i}.json.gz") \
                if snap and snapshot_dir else None
            measure_steps(peft_model, opt, ids, record, steps, path, trace_first_step=False)
            record["num_alloc_retries_total"] = torch.cuda.memory_stats().get("num_alloc_retries", 0)
            record["ok"] = True
            del opt, ids, trainable
        except torch.OutOfMemoryError as exc:
            record["ok"] = False
            record["error"] = "oom: " + str(exc)[:300]
        except Exception as exc:  # noqa: BLE001 - a benchmark records the failure and goes on
            record["ok"] = False
            record["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        finally:
            if peft_model is not None:
                if ckpt:
                    set_checkpointing(peft_model, False)
                model = peft_model.unload()
                del peft_model
            gc.collect()
            torch.cuda.empty_cache()
        _record_case(out_path, record, f"[{group}] case {i} {record['lora_targets']} r{rank} b{batch} s{seq} "
                                       f"ckpt={ckpt} {attn}")
    del model
    gc.collect()
    torch.cuda.empty_cache()


def run_full_group(group: str, out_path: str, snapshot_dir: str | None, steps: int,
                   only: set[int] | None = None) -> None:
    """Full fine-tuning / freeze cases: the model is built afresh for each case (its parameters' requires_grad,
    gradients and optimizer state must not carry over), the optimizer state is created in the first step, so a
    snapshot covers every step from the first."""
    import torch

    from fitune.runtime.model import build_model
    from fitune.runtime.optim import build_optimizer
    from fitune.setup import TrainSetup
    from fitune.runtime.model import prepare_model

    model_name, cases = FULL_GROUPS[group]
    cfg = load_catalog_config(model_name)
    vocab = cfg["vocab_size"]
    for i, (method, optimizer, batch, seq, ckpt, freeze_k, snap) in enumerate(cases):
        if only is not None and i not in only:
            continue
        record = {
            "group": group, "model": model_name, "method": method, "case": i, "optimizer": optimizer,
            "batch_size": batch, "seq_len_tokens": seq, "grad_checkpointing": "full" if ckpt else "none",
            "attn": "sdpa", "dtype": "bf16", "loss": "hf", "stack": "hf", "cap": CAP,
        }
        if method == "freeze":
            record["freeze_trainable_layers"] = freeze_k
        model = opt = ids = trainable = None  # all freed before the next case builds its model
        try:
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            model = build_model(cfg, dtype_name="bf16", attn="sdpa", device="cuda", init="random")
            record["model_only_allocated_bytes"] = torch.cuda.memory_allocated()
            setup = TrainSetup(method=method, optimizer=optimizer, batch_size=batch, seq_len_tokens=seq,
                               grad_checkpointing="full" if ckpt else "none",
                               freeze_trainable_layers=max(freeze_k, 1))
            model = prepare_model(model, setup)
            model.train()
            trainable = [p for p in model.parameters() if p.requires_grad]
            record["trainable_params"] = sum(p.numel() for p in trainable)
            record["trainable_bytes"] = sum(p.numel() * p.element_size() for p in trainable)
            opt = build_optimizer(optimizer, trainable, lr=1e-5)
            ids = torch.randint(0, vocab, (batch, seq), device="cuda")
            torch.cuda.synchronize()
            path = os.path.join(snapshot_dir, f"snap_{group.replace(':', '_')}_{i}.json.gz") \
                if snap and snapshot_dir else None
            measure_steps(model, opt, ids, record, steps, path, trace_first_step=True)
            record["ok"] = True
        except torch.OutOfMemoryError as exc:
            record["ok"] = False
            record["error"] = "oom: " + str(exc)[:300]
        except Exception as exc:  # noqa: BLE001 - a benchmark records the failure and goes on
            record["ok"] = False
            record["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        finally:
            del model, opt, ids, trainable  # `trainable` held the parameters: the next case started on them
            gc.collect()
            torch.cuda.empty_cache()
        _record_case(out_path, record, f"[{group}] case {i} {method} {optimizer} b{batch} s{seq} ckpt={ckpt}")


_VERSIONS: dict | None = None
CAP: str | None = None  # the --cap of this run, recorded in every line


def _record_case(out_path: str, record: dict, label: str) -> None:
    """Append one case's record (with the stack's versions) to `out_path` and print its line."""
    record["versions"] = _versions()
    training = training_facts([st["loss"] for st in record.get("steps", [])], record.pop("_grad_probe", None),
                              why_none=record.get("error"))
    write_record(out_path, record, training=training)
    msg = (f"peak {record['peak_allocated_bytes'] / 2**30:.2f} GiB alloc, "
           f"{record['peak_reserved_bytes'] / 2**30:.2f} GiB reserved, {record['tokens_per_s']:.0f} tok/s"
           if record["ok"] else record["error"][:120])
    print(f"{label}: {msg}", flush=True)


def _versions() -> dict:
    global _VERSIONS
    if _VERSIONS is None:
        import torch
        import transformers
        import peft

        v = {"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__,
             "gpu": torch.cuda.get_device_name(), "gpu_total_bytes": torch.cuda.get_device_properties(0).total_memory}
        try:
            import bitsandbytes

            v["bitsandbytes"] = bitsandbytes.__version__
        except ImportError:
            pass
        _VERSIONS = v
    return _VERSIONS


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--group", action="append", help="a group from --list (repeatable); default: all")
    p.add_argument("--out", default="hf_recipe.jsonl")
    p.add_argument("--snapshot-dir")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--list", action="store_true")
    p.add_argument("--cases", help="comma-separated case indices of the group(s) to run (default: all)")
    p.add_argument("--snapshot-all", action="store_true", help="write an allocation trace for every case run")
    p.add_argument("--cap", help="limit PyTorch's allocator to this GPU's budget (e.g. rtx4090) for every case")
    args = p.parse_args()
    if args.list:
        for g, (_, _, cases) in GROUPS.items():
            print(g, len(cases))
        for g, (_, cases) in FULL_GROUPS.items():
            print(g, len(cases))
        return 0
    if args.cap:
        import torch

        global CAP
        CAP = args.cap
        from fitune.specs.gpu import resolve_gpu

        budget = resolve_gpu(args.cap).allocator_budget_bytes
        torch.cuda.set_per_process_memory_fraction(budget / torch.cuda.get_device_properties(0).total_memory)
    for g in args.group or list(GROUPS):
        only = {int(c) for c in args.cases.split(",")} if args.cases else None
        if g in FULL_GROUPS:
            run_full_group(g, args.out, args.snapshot_dir, args.steps, only)
            continue
        run_group(g, args.out, args.snapshot_dir, args.steps, only, args.snapshot_all)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

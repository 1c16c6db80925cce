"""Measured verdicts for three claims of ../shared/claims.md that one GPU settles (issue 13): C13 (torch.compile and
memory / speed, with and without checkpointing), C16 (finer-grained checkpointing) and C27 (DataLoader
`num_workers` / `pin_memory` and GPU memory). Run on the GPU machine, one process per model:

    export PYTHONPATH=.:/tmp/site PYTHONUNBUFFERED=1
    python3 bench/claims_single_gpu.py --model llama-3.2-1b --out $OUT/claims.jsonl
    python3 bench/claims_single_gpu.py --model llama-3.1-8b --out $OUT/claims.jsonl

The step is the runtime's one (`fitune.runtime.step.train_step(recipe=True)`: the loop forum posters write,
`loss = model(input_ids=ids, labels=ids).loss; loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)`), on a
random-init model of the catalog's config with PEFT LoRA r8 on
q_proj,v_proj, bf16, sdpa, 2 x 2048 tokens, torch AdamW; no allocator cap. Cases:
- C13: checkpointing on / off x no compile, `torch.compile(model)` (the whole model, what `Trainer(torch_compile=
  True)` does) and regional compile (`layer.compile()` on each decoder layer);
- C16: checkpointing the attention and the MLP of each layer separately (finer than transformers' per-layer
  checkpointing), against per-layer;
- C27 (--dataloader): a DataLoader over CPU tensors with num_workers 0 / 4 and pin_memory off / on, 30 steps:
  the allocator's and the device's memory after every step.

One JSON line per case: tokens/s (median of steps 3 and later; compile's first steps excluded), the peak allocated /
reserved over all steps and over the steps after the second (the steady state, after compilation), compile time.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench.common import grad_norm_probe, training_facts, write_record  # noqa: E402

BATCH, SEQ = 2, int(os.environ.get("CLAIMS_SEQ", 2048))
DEVICE = "cuda"


class _NoCuda:
    """--device cpu (a smoke test of this script on a tiny config): CUDA's counters read as 0."""

    def __getattr__(self, name):
        return {"mem_get_info": lambda: (0, 0), "get_device_name": lambda: "cpu"}.get(name, lambda *a, **k: 0)


def cuda():
    import torch

    return torch.cuda if DEVICE == "cuda" else _NoCuda()


def build(model_name: str):
    import torch

    from fitune.runtime.model import build_model, wrap_lora
    from fitune.specs.model import load_model_spec

    spec = load_model_spec(model_name)
    model = build_model(spec, dtype_name="bf16", attn="sdpa", device=DEVICE)
    model.config.use_cache = False
    model = wrap_lora(model, 8, ["q_proj", "v_proj"], alpha=16)
    model.train()
    cuda().synchronize()
    return spec, model


def layers_of(model):
    return model.base_model.model.model.layers


def set_ckpt(model, mode: str) -> list:
    """mode: none | layer (transformers' per-layer, non-reentrant) | attn_mlp (each layer's attention and MLP
    checkpointed separately). Returns what `unset_fine` needs to undo attn_mlp."""
    import torch.utils.checkpoint as cp

    if mode == "layer":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
        return []
    model.gradient_checkpointing_disable()
    undo = []
    if mode == "attn_mlp":
        for layer in layers_of(model):
            for name in ("self_attn", "mlp"):
                mod = getattr(layer, name)
                orig = mod.forward
                mod.forward = (lambda *a, _f=orig, **k: cp.checkpoint(_f, *a, use_reentrant=False, **k))
                undo.append((mod, orig))
        model.enable_input_require_grads()
    return undo


def unset_fine(undo: list) -> None:
    for mod, orig in undo:
        mod.forward = orig


def run_case(model, record: dict, steps: int, compile_mode: str, out_path: str) -> None:
    import torch

    from fitune.runtime.optim import build_optimizer
    from fitune.runtime.step import train_step

    opt = build_optimizer("adamw", [p for p in model.parameters() if p.requires_grad], lr=1e-5)
    ids = torch.randint(100, 20000, (BATCH, SEQ), device=DEVICE)
    fwd = model
    t_compile = time.perf_counter()
    if compile_mode == "model":
        fwd = torch.compile(model)
    elif compile_mode == "regional":
        for layer in layers_of(model):
            layer.compile()
    gc.collect()
    cuda().empty_cache()
    cuda().reset_peak_memory_stats()
    times, steady_peak, steady_reserved, losses = [], 0, 0, []
    first_s = None
    probe = grad_norm_probe()
    seen = probe.__enter__()  # the first step's trainable-gradient norm (its gradient check)
    try:
        for step in range(steps):
            if step == 2:
                cuda().reset_peak_memory_stats()
            cuda().synchronize()
            t0 = time.perf_counter()
            losses.append(train_step(fwd, opt, [ids], recipe=True, check_gradients=step == 0).loss)
            cuda().synchronize()
            times.append(time.perf_counter() - t0)
            if step == 0:
                first_s = time.perf_counter() - t_compile
            if step == 1:
                record["peak_allocated_first2_bytes"] = cuda().max_memory_allocated()
                record["peak_reserved_first2_bytes"] = cuda().max_memory_reserved()
        steady_peak, steady_reserved = cuda().max_memory_allocated(), cuda().max_memory_reserved()
        record.update(status="ok", step_times_s=[round(t, 4) for t in times],
                      tokens_per_s=BATCH * SEQ / statistics.median(times[2:]),
                      peak_allocated_steady_bytes=steady_peak, peak_reserved_steady_bytes=steady_reserved,
                      first_step_with_compile_s=round(first_s, 2))
    except Exception as exc:  # noqa: BLE001 - a failure is a result
        record.update(status="error", error=f"{type(exc).__name__}: {str(exc)[:400]}")
    finally:
        probe.__exit__(None, None, None)
        if compile_mode == "regional":
            for layer in layers_of(model):
                layer._compiled_call_impl = None
        del fwd, opt, ids
        torch._dynamo.reset()
        gc.collect()
        cuda().empty_cache()
    write_record(out_path, record, training=training_facts(losses, seen))
    print(json.dumps({k: v for k, v in record.items() if k != "step_times_s"}), flush=True)


def run_dataloader(model, record: dict, workers: int, pin: bool, steps: int, out_path: str) -> None:
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from fitune.runtime.optim import build_optimizer
    from fitune.runtime.step import train_step

    set_ckpt(model, "layer")
    opt = build_optimizer("adamw", [p for p in model.parameters() if p.requires_grad], lr=1e-5)
    data = TensorDataset(torch.randint(100, 20000, (BATCH * steps, SEQ)))
    loader = DataLoader(data, batch_size=BATCH, shuffle=True, num_workers=workers, pin_memory=pin)
    gc.collect()
    cuda().empty_cache()
    cuda().reset_peak_memory_stats()
    per_step, times, losses = [], [], []
    with grad_norm_probe() as seen:  # the first step's trainable-gradient norm (its gradient check)
        for (batch,) in loader:
            t0 = time.perf_counter()
            ids = batch.to(DEVICE, non_blocking=pin)
            losses.append(train_step(model, opt, [ids], recipe=True, check_gradients=not losses).loss)
            del ids
            cuda().synchronize()
            times.append(time.perf_counter() - t0)
            free, total = cuda().mem_get_info()
            per_step.append({"allocated_bytes": cuda().memory_allocated(),
                             "reserved_bytes": cuda().memory_reserved(), "device_used_bytes": total - free,
                             "peak_allocated_bytes": cuda().max_memory_allocated()})
    record.update(status="ok", per_step=per_step, tokens_per_s=BATCH * SEQ / statistics.median(times[2:]),
                  peak_allocated_bytes=cuda().max_memory_allocated(),
                  peak_reserved_bytes=cuda().max_memory_reserved())
    del opt, loader
    gc.collect()
    cuda().empty_cache()
    write_record(out_path, record, training=training_facts(losses, seen))
    print(json.dumps({k: v for k, v in record.items() if k != "per_step"}), flush=True)


def main() -> int:
    import torch
    import transformers

    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--compile", default="none,model,regional", help="compile modes for C13")
    p.add_argument("--fine", action="store_true", help="C16: attention and MLP checkpointed separately")
    p.add_argument("--dataloader", action="store_true", help="C27: DataLoader workers / pin_memory")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: a smoke test (tiny configs)")
    args = p.parse_args()
    global DEVICE
    DEVICE = args.device
    spec, model = build(args.model)
    base = {"model": args.model, "batch": BATCH, "seq_len": SEQ, "lora": "r8 q_proj,v_proj", "dtype": "bf16",
            "torch": torch.__version__, "transformers": transformers.__version__,
            "gpu": cuda().get_device_name(), "device": DEVICE}
    if args.fine:
        for ckpt in ("layer", "attn_mlp"):
            undo = set_ckpt(model, ckpt)
            run_case(model, {**base, "claim": "C16", "checkpointing": ckpt, "compile": "none"}, args.steps, "none",
                     args.out)
            unset_fine(undo)
    if args.dataloader:
        for workers, pin in ((0, False), (4, False), (4, True)):
            run_dataloader(model, {**base, "claim": "C27", "checkpointing": "layer", "num_workers": workers,
                                   "pin_memory": pin}, workers, pin, 30, args.out)
    for compile_mode in [c for c in args.compile.split(",") if c]:
        for ckpt in ("layer", "none"):
            set_ckpt(model, ckpt)
            run_case(model, {**base, "claim": "C13", "checkpointing": ckpt, "compile": compile_mode}, args.steps,
                     compile_mode, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

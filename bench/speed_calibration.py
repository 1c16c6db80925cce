"""Issue 12: tokens/s of fitune's own runner, with its techniques, on several models: the data the throughput model
(fitune/plan/throughput.py) is calibrated on. Run on the GPU machine.

Each case is a `TrainSetup` of `stack: fitune` run through the runtime `fitune train` uses
(`fitune.runtime.model.prepare_model` and `fitune.runtime.step.train_step`), random weights, one model built per
process and reused across its cases, no allocator cap (the speed of a step does not depend on the cap as long as
it fits), `--steps` optimizer steps, tokens/s = the median over steps 3 and later. One JSON line per case: the whole
setup (every TrainSetup field), the model, tokens/s, the step times, the peaks.

A group is the set of cases one process runs (techniques that patch modules for good cannot be undone between
cases, so a group keeps them fixed, and the tiled MLP, which stays patched, runs last):
  lora        LoRA, transformers' modules + fitune's lean RMSNorm (Llama-family norms), lean LoRA
  lora_liger  the same with Liger's RMSNorm, SwiGLU and RoPE (no lean RMSNorm)
  qlora       QLoRA (NF4 base weights), lean RMSNorm, lean LoRA
  qlora_liger QLoRA with Liger's kernels
  full        full fine-tuning (AdamW), lean RMSNorm
  lora_compile, qlora_compile  each decoder layer compiled (issue 14), lean LoRA, no lean RMSNorm / Liger (the
              compiled layer fuses them); compilation is paid in step 1, the median is over steps 3 and later
  lora_compile_check, qlora_compile_check  the same technique at shapes the estimator's model of compiled layers
              was not made from (r32 all-linear: 1 x 16384 and 2 x 4096 with checkpointing, 1 x 4096 without): its
              out-of-sample check

    export PYTHONPATH=.:/tmp/site PYTHONUNBUFFERED=1
    python3 bench/speed_calibration.py --model llama-3.2-1b --group lora --out $OUT/speed.jsonl
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench.common import grad_norm_probe, pop_training, training_facts, write_record  # noqa: E402

from fitune.setup import TrainSetup  # noqa: E402

LEAN_NORM_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3")
QV = ("q_proj", "v_proj")
ALL = ("all-linear",)


def cases(group: str, model_type: str) -> list[TrainSetup]:
    """The setups one group measures, in order (the tiled MLP last: it stays patched)."""
    liger = group.endswith("_liger")
    compiled = group.endswith(("_compile", "_compile_check"))
    method = group.split("_")[0]
    base = TrainSetup(method="qlora" if method == "qlora" else "lora", lora_rank=8, lora_targets=QV, batch_size=2,
                      seq_len_tokens=2048, loss="chunked", lean_lora=method != "full",
                      lean_norm=not (liger or compiled) and model_type in LEAN_NORM_TYPES,
                      kernels="liger" if liger else "torch", expandable_segments=True, stack="fitune",
                      compile="layers" if compiled else "none")
    if group.endswith("_compile_check"):
        long = base.replace(lora_rank=32, lora_targets=ALL, batch_size=1, grad_checkpointing="full")
        return [long.replace(seq_len_tokens=16384), long.replace(batch_size=2, seq_len_tokens=4096),
                long.replace(seq_len_tokens=4096, grad_checkpointing="none")]
    if compiled:
        long = base.replace(lora_rank=32, lora_targets=ALL, batch_size=1)
        return [base, base.replace(batch_size=1, grad_accum=2), base.replace(grad_checkpointing="full"),
                long.replace(seq_len_tokens=8192, grad_checkpointing="full"),
                base.replace(batch_size=1, seq_len_tokens=4096)]
    if method == "full":
        f = base.replace(method="full", lean_lora=False)
        return [f, f.replace(grad_checkpointing="full"), f.replace(batch_size=1, grad_accum=2),
                f.replace(loss="hf")]
    long = base.replace(lora_rank=32, lora_targets=ALL, batch_size=1)
    out = [base, base.replace(grad_checkpointing="full"), base.replace(grad_checkpointing="offload"),
           base.replace(batch_size=1, grad_accum=2), long.replace(seq_len_tokens=8192, grad_checkpointing="full")]
    if method == "lora":
        out.insert(4, base.replace(loss="hf"))
    out.append(long.replace(seq_len_tokens=16384, grad_checkpointing="offload", tiled_mlp=True))
    return out


def run_case(model_base, spec, setup: TrainSetup, steps: int, device: str = "cuda") -> dict:
    import torch

    from fitune.runtime.model import prepare_model, set_checkpointing
    from fitune.runtime.oom import is_oom
    from fitune.runtime.optim import build_optimizer
    from fitune.runtime.step import train_step

    if setup.method == "full":
        for p in model_base.parameters():
            p.requires_grad_(True)
    model = prepare_model(model_base, setup)
    opt = build_optimizer(setup.optimizer, [p for p in model.parameters() if p.requires_grad], lr=1e-5)
    ids = torch.randint(0, spec.vocab_size, (setup.batch_size * setup.grad_accum, setup.seq_len_tokens),
                        device=device)
    micro = ids.split(setup.batch_size)
    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    times, rec, losses = [], {}, []
    probe = grad_norm_probe()
    seen = probe.__enter__()  # the first step checks its gradients; the probe reads their norm
    try:
        for _ in range(steps):
            sync()
            t0 = time.perf_counter()
            losses.append(train_step(model, opt, micro, loss=setup.loss, check_gradients=not losses).loss)
            sync()
            times.append(time.perf_counter() - t0)
        tokens = setup.batch_size * setup.grad_accum * setup.seq_len_tokens
        rec.update(ok=True, tokens_per_s=tokens / statistics.median(times[2:]))
    except Exception as exc:  # noqa: BLE001 - an OOM is a result; anything else too, recorded, next case
        rec.update(ok=False, oom=is_oom(exc), error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}")
    finally:
        probe.__exit__(None, None, None)
    rec.update(training_facts(losses, seen, why_none=rec.get("error")))
    rec["step_times_s"] = [round(t, 5) for t in times]
    if cuda:
        rec.update(peak_allocated_bytes=torch.cuda.max_memory_allocated(),
                   peak_reserved_bytes=torch.cuda.max_memory_reserved())
    opt.zero_grad(set_to_none=True)
    del opt
    if setup.grad_checkpointing != "none":
        set_checkpointing(model, False)
    if setup.compile == "layers":
        from fitune.runtime.techniques.compile_layers import disable_compiled_layers

        disable_compiled_layers(model)
    if setup.method in ("lora", "qlora"):
        model.unload()
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return rec


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--group", required=True, choices=("lora", "lora_liger", "qlora", "qlora_liger", "full",
                                                             "lora_compile", "qlora_compile",
                                                             "lora_compile_check", "qlora_compile_check"))
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="a 2-layer, 64-wide copy of the model and 64-token cases "
                   "(a smoke test of this script on the CPU)")
    args = p.parse_args()

    import torch
    import transformers

    from fitune.runtime.device import configure_allocator
    from fitune.runtime.model import build_model
    from fitune.specs.model import load_model_spec

    spec = load_model_spec(args.model)
    todo = cases(args.group, spec.model_type)
    source = spec
    if args.tiny:
        from fitune.specs.model import model_spec_from_hf_config

        cfg = dict(spec.hf_config, num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, vocab_size=512)
        spec = source = model_spec_from_hf_config(cfg, name=args.model + "-tiny")
        todo = [s.replace(seq_len_tokens=64) for s in todo]
    if args.device == "cuda":
        configure_allocator(todo[0])  # expandable segments, before CUDA starts
    t0 = time.perf_counter()
    base = build_model(source, dtype_name="bf16", attn="sdpa", device=args.device, init="random",
                       quantize="nf4" if args.group.startswith("qlora") else None)
    built_s = time.perf_counter() - t0
    for setup in todo:
        rec = {"model": args.model, "group": args.group, "setup": dataclasses.asdict(setup), "steps": args.steps,
               "build_s": round(built_s, 1), "gpu": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
               "versions": {"torch": torch.__version__, "transformers": transformers.__version__}}
        rec.update(run_case(base, spec, setup, args.steps, args.device))
        write_record(args.out, rec, training=pop_training(rec))
        s = setup
        print(json.dumps({"model": args.model, "group": args.group, "ckpt": s.grad_checkpointing, "loss": s.loss,
                          "shape": f"{s.batch_size}x{s.grad_accum}x{s.seq_len_tokens}", "tiled": s.tiled_mlp,
                          "ok": rec["ok"], "tokens_per_s": round(rec.get("tokens_per_s") or 0),
                          "error": rec.get("error")}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

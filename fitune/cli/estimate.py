"""`fitune estimate`: where every byte of a training step goes, and whether it fits a GPU."""

from __future__ import annotations

import argparse
import json
import sys

from ..errors import ConfigError
from ..setup import DEFAULT_SETUP, TrainSetup, parse_targets
from ..units import gib

DESCRIPTION = """\
Estimate the peak GPU memory of one fine-tuning step, before running it.

MODEL is a catalog name (llama-3.1-8b, qwen2.5-7b, mistral-7b, ... see --list-models), a config.json, or a
Hugging Face model folder. The estimate models a plain transformers + PEFT training script (--stack hf) op by op
and reports the bytes per category at the peak (weights, adapter weights, gradients, optimizer states, saved
activations, logits and loss, transients, workspaces, allocator overhead), the peak of each phase, and with --gpu
whether the run fits. Its error against 45 measured runs is in the README (bench/results/hf_recipe/).

examples:
  fitune estimate llama-3.1-8b --method lora --seq-len 2048 --batch-size 2 --grad-checkpointing full --gpu rtx4090
  fitune estimate qwen2.5-7b --method qlora --lora-targets all-linear --lora-rank 32 --gpu 23.4GiB --json
  fitune estimate ./my-model/config.json --engine trace --seq-len 512
"""


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("estimate", help="estimate peak GPU memory of a training step",
                              description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_setup_arguments(p)
    p.add_argument("--gpu", metavar="NAME|NGiB", help="judge the fit on a catalog GPU (rtx4090, a100-80gb, h100, "
                   "... see --list-gpus) or on a memory budget for PyTorch's allocator, e.g. 23.4GiB")
    p.add_argument("--engine", choices=("analytic", "trace"), default="analytic",
                   help="analytic (default, pure Python, instant) or trace (runs the real transformers model on "
                   "fake tensors on the CPU; needs torch + transformers + peft; for architectures the analytic "
                   "engine does not model)")
    p.add_argument("--json", action="store_true", help="print one JSON object (keys documented in the README)")
    p.add_argument("--list-models", action="store_true", help="print the model catalog and exit")
    p.add_argument("--list-gpus", action="store_true", help="print the GPU catalog and exit")
    p.set_defaults(run=run)
    return p


def add_setup_arguments(p: argparse.ArgumentParser) -> None:
    """The TrainSetup flags, shared with other subcommands. Defaults come from TrainSetup itself."""
    d = DEFAULT_SETUP
    p.add_argument("model", nargs="?", metavar="MODEL", help="catalog name, config.json, or model folder")
    p.add_argument("--method", default=d.method, help="lora | qlora (NF4, double quantisation) | full | freeze "
                   f"(default {d.method})")
    p.add_argument("--seq-len", type=int, default=d.seq_len_tokens, help=f"tokens per sequence (default {d.seq_len_tokens})")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help=f"sequences per micro-batch (default {d.batch_size})")
    p.add_argument("--lora-rank", type=int, default=d.lora_rank, help=f"LoRA rank r (default {d.lora_rank})")
    p.add_argument("--lora-targets", default=",".join(d.lora_targets),
                   help="comma-separated module names, or all-linear (default q_proj,v_proj)")
    p.add_argument("--grad-checkpointing", default=d.grad_checkpointing, metavar="none|full|offload|selective:K",
                   help="activation checkpointing: none, full (every layer), offload (checkpoints in pinned CPU "
                   f"memory), selective:K (the first K layers) (default {d.grad_checkpointing})")
    p.add_argument("--attn", default=d.attn, help=f"eager | sdpa | flash (default {d.attn})")
    p.add_argument("--optimizer", default=d.optimizer,
                   help=f"adamw | adamw8bit | paged_adamw8bit | adafactor | sgd (default {d.optimizer})")
    p.add_argument("--dtype", default=d.dtype, help=f"bf16 | fp16 | fp32 (default {d.dtype})")
    p.add_argument("--loss", default=d.loss, help=f"hf (full fp32 logits, as transformers) | chunked (default {d.loss})")
    p.add_argument("--tiled-mlp", action="store_true", help="fitune's runner: run each MLP a tile of tokens at a "
                   "time (needs --stack fitune)")
    p.add_argument("--lean-lora", action="store_true", help="fitune's runner: LoRA branch in bf16, no fp32 copy of "
                   "each adapter's input (needs --stack fitune)")
    p.add_argument("--lean-norm", action="store_true", help="fitune's runner: RMSNorm in tiles, saving only its bf16 "
                   "input (needs --stack fitune)")
    p.add_argument("--kernels", default=d.kernels, help="fitune's runner: torch | liger (Liger Kernel's RMSNorm, "
                   f"SwiGLU and RoPE; needs --stack fitune) (default {d.kernels})")
    p.add_argument("--expandable-segments", action="store_true", help="fitune's runner: PyTorch's allocator with "
                   "expandable segments (little fragmentation; needs --stack fitune)")
    p.add_argument("--stack", default=d.stack, help="hf (a plain transformers + PEFT script) | fitune (fitune's "
                   f"runner) (default {d.stack})")


def setup_from_args(args) -> TrainSetup:
    return TrainSetup(
        method=args.method, lora_rank=args.lora_rank, lora_targets=parse_targets(args.lora_targets),
        dtype=args.dtype, grad_checkpointing=args.grad_checkpointing, attn=args.attn, optimizer=args.optimizer,
        batch_size=args.batch_size, seq_len_tokens=args.seq_len, loss=args.loss, stack=args.stack,
        tiled_mlp=args.tiled_mlp, lean_lora=args.lean_lora, lean_norm=args.lean_norm,
        expandable_segments=args.expandable_segments, kernels=args.kernels,
    )


def run(args) -> int:
    from ..specs.gpu import catalog_gpu_names, gpu_catalog, resolve_gpu
    from ..specs.model import load_model_spec, model_catalog

    if args.list_models:
        for name, entry in sorted(model_catalog().items()):
            print(f"{name:18s} {entry.get('hf_id', '')}")
        return 0
    if args.list_gpus:
        for name in catalog_gpu_names():
            e = gpu_catalog()[name]
            print(f"{name:18s} {e['total_memory_mib'] / 1024:6.1f} GiB  {e.get('display_name', '')}")
        return 0
    if not args.model:
        raise ConfigError("MODEL is missing: name a catalog model (e.g. llama-3.1-8b), a config.json or a model folder")
    model = load_model_spec(args.model)
    setup = setup_from_args(args)
    gpu = resolve_gpu(args.gpu) if args.gpu else None
    if args.engine == "trace":
        return _run_trace(args, model, setup, gpu)
    from ..memory import estimate

    est = estimate(model, setup, gpu)
    suggestions = []
    if gpu is not None and (not est.fits or est.retries_expected):
        from ..memory.suggest import suggest_changes

        suggestions = suggest_changes(model, setup, gpu, base=est)
    if args.json:
        doc = estimate_to_json(est)
        if gpu is not None:
            doc["suggestions"] = [{"change": x.change, "why": x.why, "peak_reserved_bytes": x.peak_reserved_bytes,
                                   "retries_expected": x.retries} for x in suggestions]
        json.dump(doc, sys.stdout, indent=2)
        print()
    else:
        print(format_estimate(est, suggestions))
    return 0


def estimate_to_json(est) -> dict:
    """The stable --json document (README, "JSON output")."""
    out = {
        "model": est.model,
        "engine": "analytic",
        "setup": est.setup.to_dict(),
        "peak_allocated_bytes": est.peak_allocated_bytes,
        "peak_reserved_bytes": est.peak_reserved_bytes,
        "peak_phase": est.peak_phase,
        "breakdown": dict(est.breakdown),
        "phases": {p: {"peak_allocated_bytes": ph.peak_allocated_bytes, "breakdown": dict(ph.breakdown)}
                   for p, ph in est.phases.items()},
        "resident_bytes": dict(est.resident_bytes),
        "trainable_params": est.trainable_params,
        "total_params": est.total_params,
        "host_bytes": est.host_bytes,
        "notes": list(est.notes),
    }
    if est.gpu is not None:
        out["gpu"] = {"name": est.gpu.name, "total_bytes": est.gpu.total_bytes,
                      "allocator_budget_bytes": est.gpu.allocator_budget_bytes}
        out["fits"] = est.fits
        out["retries_expected"] = est.retries_expected
        out["tight"] = est.tight
        out["headroom_bytes"] = est.headroom_bytes
    return out


LABELS = {
    "weights": "weights",
    "adapter_weights": "adapter weights",
    "gradients": "gradients",
    "optimizer_states": "optimizer states",
    "saved_activations": "saved activations",
    "logits_and_loss": "logits and loss",
    "transients": "transients",
    "workspaces": "cuBLAS workspaces",
    "allocator_overhead": "allocator overhead",
}


def format_estimate(est, suggestions=()) -> str:
    s = est.setup
    lines = []
    targets = ",".join(s.lora_targets)
    method = f"{s.method}" + (f" r{s.lora_rank} on {targets}" if s.method in ("lora", "qlora") else "")
    lines.append(f"{est.model}: {method}, {s.batch_size} x {s.seq_len_tokens} tokens, {s.dtype}, "
                 f"checkpointing {s.grad_checkpointing}, attention {s.attn}, optimizer {s.optimizer}, "
                 f"loss {s.loss}, stack {s.stack}")
    lines.append(f"  {est.total_params / 1e9:.2f}B parameters, {est.trainable_params / 1e6:.2f}M trainable")
    lines.append("")
    lines.append(f"  at the peak ({est.peak_phase}):")
    for key, label in LABELS.items():
        v = est.breakdown.get(key, 0)
        lines.append(f"    {label:22s} {gib(v):>12s}")
    lines.append(f"    {'-' * 22} {'-' * 12}")
    lines.append(f"    {'peak allocated':22s} {gib(est.peak_allocated_bytes):>12s}   (torch.cuda.max_memory_allocated)")
    lines.append(f"    {'peak reserved':22s} {gib(est.peak_reserved_bytes):>12s}   (torch.cuda.max_memory_reserved)")
    lines.append("")
    lines.append("  phase peaks (allocated): " + ", ".join(
        f"{p} {gib(ph.peak_allocated_bytes)}" for p, ph in est.phases.items()))
    if est.host_bytes:
        lines.append(f"  pinned host memory for offloaded checkpoints: {gib(est.host_bytes)}")
    for n in est.notes:
        lines.append(f"  note: {n}")
    if est.gpu is not None:
        g = est.gpu
        top = ", ".join(f"{LABELS[k]} {gib(v)}" for k, v in est.largest_terms(3))
        if not est.fits:
            verdict = "DOES NOT FIT"
        elif est.retries_expected and est.setup.expandable_segments:
            verdict = ("FITS WITH ALLOCATOR RETRIES: the cache would outgrow the budget, so the allocator gives "
                       "free pages back mid-step (expandable segments: the live blocks fit; measured on the 143k-token "
                       "QLoRA step, bench/results/issue5/)")
        elif est.retries_expected:
            verdict = ("FITS ONLY WITH ALLOCATOR RETRIES: the reserved peak is over the budget, so the allocator "
                       "will flush its cache mid-step (slower; a fragmented cache can still fail)")
        else:
            verdict = "FITS"
            if est.tight:
                verdict += " (tight: within 5 % of the budget, where run-to-run fragmentation decides)"
        lines.append("")
        lines.append(f"  {g.name}: {gib(g.allocator_budget_bytes)} for PyTorch's allocator "
                     f"(of {gib(g.total_bytes)}) -> {verdict}, headroom {gib(est.headroom_bytes)}")
        lines.append(f"  largest terms: {top}")
        if suggestions:
            lines.append("  changes that fit (one at a time):")
            for x in suggestions:
                why = x.why + ("; over the budget reserved: allocator retries" if x.retries else "")
                lines.append(f"    {x.change:52s} {gib(x.peak_reserved_bytes):>10s} reserved  ({why})")
        elif not est.fits or est.retries_expected:
            lines.append("  no single change fits; combine them (e.g. --method qlora --grad-checkpointing full)")
    return "\n".join(lines)


def _run_trace(args, model, setup: TrainSetup, gpu) -> int:
    try:
        from ..trace import trace_training_step
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ConfigError(f"--engine trace needs torch, transformers and peft installed ({exc})") from exc
    try:
        import torch  # noqa: F401
    except ImportError as exc:
        raise ConfigError("--engine trace needs torch (pip install torch); the analytic engine does not") from exc
    res = trace_training_step(
        model.hf_config, method=setup.method, lora_rank=setup.lora_rank,
        lora_targets="all-linear" if setup.all_linear else list(setup.lora_targets),
        batch_size=setup.batch_size, seq_len_tokens=setup.seq_len_tokens,
        grad_checkpointing="full" if setup.grad_checkpointing != "none" else "none",
        attn=setup.attn if setup.attn != "flash" else "sdpa", dtype=setup.dtype, optimizer=setup.optimizer,
    )
    doc = {
        "model": model.name, "engine": "trace", "setup": setup.to_dict(),
        "peak_allocated_bytes": res.peak_bytes,
        "breakdown": {
            "weights": res.weights_bytes, "adapter_weights": res.adapter_weights_bytes,
            "gradients": res.gradients_bytes, "optimizer_states": res.optimizer_states_bytes,
            "saved_activations": res.saved_activations_bytes,
        },
        "phases": {"forward": {"peak_allocated_bytes": res.forward_peak_bytes},
                   "backward": {"peak_allocated_bytes": res.backward_peak_bytes},
                   "optimizer": {"peak_allocated_bytes": res.optimizer_peak_bytes}},
        "notes": list(res.notes) + ["the trace engine counts live tensors on the CPU (fake tensors): no CUDA "
                                    "workspaces, no caching-allocator overhead"],
    }
    if gpu is not None:
        doc["fits"] = res.peak_bytes <= gpu.allocator_budget_bytes
        doc["headroom_bytes"] = gpu.allocator_budget_bytes - res.peak_bytes
    if args.json:
        json.dump(doc, sys.stdout, indent=2)
        print()
    else:
        print(f"{model.name} (trace engine): peak {gib(res.peak_bytes)} live tensors")
        for k, v in doc["breakdown"].items():
            print(f"    {LABELS.get(k, k):22s} {gib(v):>12s}")
        for p, v in doc["phases"].items():
            print(f"    {p} peak {gib(v['peak_allocated_bytes'])}")
        if gpu is not None:
            print(f"  {gpu.name}: {'FITS' if doc['fits'] else 'DOES NOT FIT'} (headroom {gib(doc['headroom_bytes'])})")
    return 0

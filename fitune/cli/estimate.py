"""`fitune estimate`: where every byte of a training step goes, and whether it fits a GPU."""

from __future__ import annotations

import argparse
import json
import sys

from ..errors import ConfigError
from ..memory import estimate
from ..memory.phases import host_peak, phase_peaks, source_of, worst_phase
from ..report import add_html_argument, maybe_write_html
from ..setup import TrainSetup, technique_labels
from ..specs.gpu import catalog_gpu_names, gpu_catalog, resolve_gpu
from ..specs.model import check_hf_config, describe_source, load_model_spec, model_catalog, resolve_model_source
from ..units import count_text, gib
from .common import add_setup_arguments as add, check_output_file, kernel_images_said, setup_and_model

DESCRIPTION = """\
Estimate the peak GPU memory of one fine-tuning step, before running it.

MODEL is a catalog name (llama-3.1-8b, qwen2.5-7b, mistral-7b, ... see --list-models), a config.json, a
Hugging Face model folder, a Hub id (its config.json from the Hub cache, else its catalog entry) or a .gguf file
(its architecture from the GGUF metadata; the weights train dequantized to --dtype). The estimate models a plain transformers + PEFT training script (--stack hf) op by op
and reports the bytes per category at the peak (weights, adapter weights, gradients, optimizer states, saved
activations, logits and loss, transients, workspaces, allocator overhead), the peak of each phase, and with --gpu
whether the run fits. Its error against 45 measured runs: docs/accuracy.md.

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
    p.add_argument("--source", choices=("folder", "hub", "gguf", "random"),
                   help="where the run loads its weights from, for the load phase: a model folder, the Hub cache, a "
                   ".gguf file or random weights (default: what MODEL is; a catalog name loads from the Hub)")
    p.add_argument("--eval-seq-len", type=int, metavar="TOKENS",
                   help="the longest eval row, for the eval phase (default: --seq-len, which eval rows are cut to)")
    p.add_argument("--json", action="store_true", help="print one JSON object (keys documented in docs/reference.md, \"JSON output\", and docs/phases.md)")
    p.add_argument("--list-models", action="store_true", help="print the model catalog and exit")
    p.add_argument("--list-gpus", action="store_true", help="print the GPU catalog and exit")
    add_html_argument(p)
    p.set_defaults(run=run)
    return p


def add_setup_arguments(p: argparse.ArgumentParser) -> None:
    """MODEL, --config and the TrainSetup flags, shared with `fitune profile` (generated: fitune/cli/common.py)."""
    add(p)


def setup_from_args(args) -> TrainSetup:
    """The setup the flags (and --config) describe; `args.model` is filled from the config when not given."""
    model, setup, origin = setup_and_model(args)
    args.model = model
    args.setup_origin = origin
    return setup


def _setup_pointing_to_translate(args) -> TrainSetup:
    """`setup_from_args`; another trainer's --config first gets one line pointing to `fitune train --translate`."""
    try:
        return setup_from_args(args)
    except ConfigError as exc:
        if not getattr(args, "config", None):
            raise
        # the command's library: imported when it runs, so that `fitune --help` stays light
        from ..translate import foreign_config_error

        pointed = foreign_config_error(exc, args.config, then="fitune estimate --config run.yaml")
        if pointed is None:
            raise
        raise pointed from None


def run(args) -> int:
    if args.list_models:
        for name, entry in sorted(model_catalog().items()):
            print(f"{name:18s} {entry.get('hf_id', '')}")
        return 0
    if args.list_gpus:
        for name in catalog_gpu_names():
            e = gpu_catalog()[name]
            print(f"{name:18s} {e['total_memory_mib'] / 1024:6.1f} GiB  {e.get('display_name', '')}")
        return 0
    setup = _setup_pointing_to_translate(args)
    if not args.model:
        raise ConfigError("MODEL is missing: name a catalog model (e.g. llama-3.1-8b), a config.json or a model folder")
    if args.html is not None:
        check_output_file(args.html, "--html", make_parents=True)
    gpu = resolve_gpu(args.gpu) if args.gpu is not None else None
    if args.engine == "trace":  # builds any architecture transformers knows: no analytic ModelSpec, no arch check
        return _run_trace(args, setup, gpu)
    model = load_model_spec(args.model)
    est = estimate(model, setup, gpu)
    suggestions = []
    if gpu is not None and (not est.fits or est.retries_expected):
        from ..memory.suggest import suggest_changes

        suggestions = suggest_changes(model, setup, gpu, base=est)
    peaks = _run_phases(args, model, setup, est)
    doc = estimate_to_json(est)
    doc.update(run_phases_to_json(peaks, est.gpu))
    source_note = describe_source(model, setup.dtype, setup.method)
    doc["source_note"] = source_note  # null for a catalog name or a local config.json (docs/reference.md, "JSON output")
    if gpu is not None:
        doc["suggestions"] = [{"change": x.change, "why": x.why, "peak_reserved_bytes": x.peak_reserved_bytes,
                               "retries_expected": x.retries} for x in suggestions]
    maybe_write_html(args, "estimate", doc)
    if args.json:
        json.dump(doc, sys.stdout, indent=2)
        print()
    else:
        if source_note:
            print(f"model source: {source_note}")
        print(format_estimate(est, suggestions))
        print(format_run_phases(peaks, est.gpu))
    return 0


def _run_phases(args, model, setup: TrainSetup, est) -> list:
    """Every phase of the run (fitune/memory/phases.py), for --source and --eval-seq-len."""
    if args.eval_seq_len is not None and args.eval_seq_len < 1:
        raise ConfigError(f"--eval-seq-len {args.eval_seq_len}: give the longest eval row in tokens (1 or more)")
    source = args.source or source_of(args.model)
    budget = est.gpu.training_budget_bytes if est.gpu is not None else None  # eval then fits it as train does
    return phase_peaks(setup, model, est, source=source, eval_rows_tokens=args.eval_seq_len, gpu_budget_bytes=budget)


def run_phases_to_json(peaks, gpu) -> dict:
    """The keys --json adds for every phase of the run (docs/phases.md): `run_phases`, `worst_phase`,
    `host_peak_phase`, `host_peak_bytes`, and with --gpu `run_fits`."""
    worst, host = worst_phase(peaks), host_peak(peaks)
    out = {
        "run_phases": [{"name": p.name, "gpu_allocated_bytes": p.gpu_allocated_bytes,
                        "gpu_reserved_bytes": p.gpu_reserved_bytes, "host_bytes": p.host_bytes, "note": p.note}
                       for p in peaks],
        "worst_phase": worst.name,
        "host_peak_phase": host.name,
        "host_peak_bytes": host.host_bytes,
    }
    if gpu is not None:
        out["run_fits"] = worst.gpu_allocated_bytes <= gpu.training_budget_bytes
    return out


def format_run_phases(peaks, gpu) -> str:
    """One line per phase of the run (GPU allocated / reserved, host), then the verdict on the worst phase."""
    lines = ["", "  every phase of the run (GPU allocated / reserved; host memory):"]
    for p in peaks:
        gpu_part = f"{gib(p.gpu_allocated_bytes):>10s} / {gib(p.gpu_reserved_bytes):>10s}" if p.gpu_allocated_bytes \
            else f"{'CPU only':>23s}"
        lines.append(f"    {p.name:10s} {gpu_part}   host {gib(p.host_bytes):>10s}   {p.note}")
    worst, host = worst_phase(peaks), host_peak(peaks)
    lines.append(f"  host memory of fitune train: {gib(host.host_bytes)} at the most ({host.name}); fitune plan "
                 "checks it against --host-ram")
    if gpu is not None:
        budget = gpu.training_budget_bytes
        over = [p for p in peaks if p.gpu_allocated_bytes > budget]
        if over:
            names = ", ".join(f"{p.name} needs {gib(p.gpu_allocated_bytes)}" for p in over)
            lines.append(f"  whole run -> DOES NOT FIT: {names} > {gib(budget)} budget (worst: {worst.name})")
        else:
            lines.append(f"  whole run -> FITS: the worst phase, {worst.name}, needs {gib(worst.gpu_allocated_bytes)} "
                         f"of {gib(budget)}")
    return "\n".join(lines)


def estimate_to_json(est) -> dict:
    """The stable --json document (docs/reference.md, "JSON output")."""
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
    if _per_gpu(est.setup):  # one rank of a multi-GPU run: every byte above is per GPU
        out["per_gpu"] = True
        out["host_breakdown"] = dict(est.host_breakdown)
    if est.gpu is not None:
        out["gpu"] = {"name": est.gpu.name, "total_bytes": est.gpu.total_bytes,
                      "allocator_budget_bytes": est.gpu.allocator_budget_bytes,
                      "training_budget_bytes": est.gpu.training_budget_bytes}
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
    "gathered_weights": "gathered weights",
    "comm_buffers": "comm buffers",
    "allocator_overhead": "allocator overhead",
}


def _per_gpu(s) -> bool:
    """The estimate is one rank's of several GPUs, or of a sharding strategy on one."""
    return s.num_gpus > 1 or s.strategy != "ddp"


def format_estimate(est, suggestions=()) -> str:
    s = est.setup
    lines = []
    targets = ",".join(s.lora_targets)
    method = f"{s.method}" + (f" r{s.lora_rank} on {targets}" if s.method in ("lora", "qlora") else "")
    lines.append(f"{est.model}: {method}, {s.batch_size} x {s.seq_len_tokens} tokens, {s.dtype}, "
                 f"checkpointing {s.grad_checkpointing}, attention {s.attn}, optimizer {s.optimizer}, "
                 f"loss {s.loss}, stack {s.stack}")
    techniques = technique_labels(s)
    if techniques:
        lines.append(f"  with {', '.join(techniques)}")
    lines.append(f"  {count_text(est.total_params)} parameters, {count_text(est.trainable_params)} trainable")
    per_gpu = _per_gpu(s)
    if per_gpu:
        lines.append(f"  per GPU: one of {s.num_gpus} GPU{'s' if s.num_gpus > 1 else ''}, strategy {s.strategy} "
                     f"(batch {s.batch_size} per GPU; every number below is one GPU's)")
    lines.append("")
    lines.append(f"  at the peak ({est.peak_phase}){', per GPU' if per_gpu else ''}:")
    for key, label in LABELS.items():
        if key not in est.breakdown and key in ("gathered_weights", "comm_buffers"):
            continue  # single-GPU estimates have no such category
        v = est.breakdown.get(key, 0)
        lines.append(f"    {label:22s} {gib(v):>12s}")
    lines.append(f"    {'-' * 22} {'-' * 12}")
    lines.append(f"    {'peak allocated':22s} {gib(est.peak_allocated_bytes):>12s}   (torch.cuda.max_memory_allocated)")
    lines.append(f"    {'peak reserved':22s} {gib(est.peak_reserved_bytes):>12s}   (torch.cuda.max_memory_reserved)")
    lines.append("")
    lines.append("  phase peaks (allocated): " + ", ".join(
        f"{p} {gib(ph.peak_allocated_bytes)}" for p, ph in est.phases.items()))
    if est.host_bytes and est.host_breakdown:
        parts = ", ".join(f"{k.replace('_', ' ')} {gib(v)}" for k, v in est.host_breakdown.items() if v)
        lines.append(f"  pinned host memory per GPU: {gib(est.host_bytes)} ({parts})")
    elif est.host_bytes:
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
                       "QLoRA step: docs/phases.md)")
        elif est.retries_expected:
            verdict = ("FITS ONLY WITH ALLOCATOR RETRIES: the reserved peak is over the budget, so the allocator "
                       "will flush its cache mid-step (slower; a fragmented cache can still fail)")
        else:
            verdict = "FITS"
            if est.tight:
                verdict += " (tight: within 5 % of the budget, where run-to-run fragmentation decides)"
        lines.append("")
        lines.append(f"  {g.name}{' (each GPU)' if per_gpu else ''}: {gib(g.allocator_budget_bytes)} for PyTorch's "
                     f"allocator (of {gib(g.total_bytes)}){kernel_images_said(g)} -> {verdict}, headroom "
                     f"{gib(est.headroom_bytes)}")
        if g.note:
            lines.append(f"  ({g.note})")
        lines.append(f"  largest terms: {top}")
        if suggestions:
            lines.append("  changes that fit (one at a time):")
            for x in suggestions:
                why = x.why + ("; over the budget reserved: allocator retries" if x.retries else "")
                lines.append(f"    {x.change:52s} {gib(x.peak_reserved_bytes):>10s} reserved  ({why})")
        elif not est.fits or est.retries_expected:
            lines.append("  no single change fits; combine them (e.g. --method qlora --grad-checkpointing full)")
    return "\n".join(lines)


def _run_trace(args, setup: TrainSetup, gpu) -> int:
    """`--engine trace`: the real transformers + PEFT model on fake tensors, for any architecture transformers
    builds from the config.json. Every setting is traced as given or refused by name (fitune/trace/support.py)."""
    source = resolve_model_source(args.model)
    cfg = source.hf_config.get("text_config") if isinstance(source.hf_config.get("text_config"), dict) \
        else source.hf_config
    problems = check_hf_config(cfg, source.model_type, required=(), bounds_only=True)  # before transformers
    if problems:  # builds 10**6 layers; the rest (heads dividing hidden, ...) transformers checks and says itself
        raise ConfigError(f"{source.source or source.name}: config.json's {'; '.join(problems)}; fix the file")
    try:
        # peft, torch, transformers: optional, imported where used (estimate, plan and doctor SCRIPT never load them)
        import peft  # noqa: F401
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as exc:
        raise ConfigError(f"--engine trace needs torch, transformers and peft installed ({exc}); the analytic "
                          "engine needs none of them") from exc
    from ..trace import trace_training_step

    res = trace_training_step(source, setup)
    s = res.setup  # the setup that was traced: the one given (or PEFT's default LoRA targets, see its notes)
    doc = {
        "model": res.model, "model_type": res.model_type, "engine": "trace", "setup": s.to_dict(),
        "peak_allocated_bytes": res.peak_bytes,
        "peak_phase": res.peak_phase,
        "breakdown": {
            "weights": res.weights_bytes, "adapter_weights": res.adapter_weights_bytes,
            "gradients": res.gradients_bytes, "optimizer_states": res.optimizer_states_bytes,
            "saved_activations": res.saved_activations_bytes,
        },
        "peak_by_category": dict(res.by_category),
        "phases": {"forward": {"peak_allocated_bytes": res.forward_peak_bytes},
                   "backward": {"peak_allocated_bytes": res.backward_peak_bytes},
                   "optimizer": {"peak_allocated_bytes": res.optimizer_peak_bytes}},
        "trainable_params": res.trainable_params,
        "total_params": res.total_params,
        "notes": list(res.notes) + ["the trace engine counts live tensors on the CPU (fake tensors): no CUDA "
                                    "workspaces, no caching-allocator overhead"],
    }
    if gpu is not None:
        doc["gpu"] = {"name": gpu.name, "total_bytes": gpu.total_bytes,
                      "allocator_budget_bytes": gpu.allocator_budget_bytes,
                      "training_budget_bytes": gpu.training_budget_bytes}
        doc["fits"] = res.peak_bytes <= gpu.training_budget_bytes
        doc["headroom_bytes"] = gpu.training_budget_bytes - res.peak_bytes
    if args.json:
        json.dump(doc, sys.stdout, indent=2)
        print()
        return 0
    targets = ",".join(s.lora_targets)
    method = s.method + (f" r{s.lora_rank} on {targets}" if s.method == "lora" else "") + \
        (f" (the last {s.freeze_trainable_layers} layers train)" if s.method == "freeze" else "")
    accum = f" x {s.grad_accum} accumulation" if s.grad_accum > 1 else ""
    print(f"{res.model} (trace engine, model_type {res.model_type}): {method}, {s.batch_size} x {s.seq_len_tokens} "
          f"tokens{accum}, {s.dtype}, checkpointing {s.grad_checkpointing}, attention {s.attn}, optimizer "
          f"{s.optimizer}, loss {s.loss}, stack {s.stack}")
    print(f"  {res.total_params:,} parameters, {res.trainable_params:,} trainable (counted on the model transformers "
          "built)")
    print("")
    print(f"  peak {gib(res.peak_bytes)} of live tensors ({res.peak_phase}); resident and saved:")
    for k, v in doc["breakdown"].items():
        print(f"    {LABELS.get(k, k):22s} {gib(v):>12s}")
    print("  phase peaks: " + ", ".join(f"{p} {gib(v['peak_allocated_bytes'])}" for p, v in doc["phases"].items()))
    for n in doc["notes"]:
        print(f"  note: {n}")
    if gpu is not None:
        print(f"  {gpu.name}: {gib(gpu.allocator_budget_bytes)} for PyTorch's allocator{kernel_images_said(gpu)} -> "
              f"{'FITS' if doc['fits'] else 'DOES NOT FIT'} (headroom {gib(doc['headroom_bytes'])}, before the "
              "allocator's overhead)")
    return 0

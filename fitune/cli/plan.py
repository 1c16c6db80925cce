"""`fitune plan`: the fastest training setup that fits the GPU, and why the faster ones do not."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from ..errors import ConfigError, DoesNotFitError
from ..plan import PlanRequest, plan, policy
from ..plan.data import choose_seq_len, profile_data
from ..plan.emit import PLACEHOLDER_DATA, hf_code, model_location, plan_yaml
from ..plan.policy import available_attns, resolve_host_ram  # noqa: F401 - the names callers and tests import
from ..plan.search import (MAX_GRAD_ACCUM, MAX_MICRO_BATCH, describe, fallback_setup, kept_as_given,
                           micro_batch_candidates)
from ..report import add_html_argument, maybe_write_html
from ..schema import Problems, add_arguments, values_from_args
from ..setup import DEFAULT_SETUP, SETUP_KEYS, TrainSetup
from ..specs import optimizers as optimizer_specs
from ..specs.gpu import resolve_gpu
from ..specs.model import catalog_key, describe_source, load_model_spec, model_catalog
from ..units import GiB
from .common import check_output_file, kernel_images_said, write_keeping_previous

DESCRIPTION = """\
Search the training setups of MODEL that fit the GPU and rank them by predicted speed.

The method stays yours (--method, LoRA by default) unless you name others it may switch to (--method lora,qlora);
the search varies the micro-batch and gradient accumulation
(their product stays the batch you ask for), activation checkpointing, attention and optimizer; with --data the
sequence length comes from the token lengths (the 99th percentile, rounded up to 64; an explicit --seq-len stays) and
packing is turned on when it removes at least 10 % of the padding, or when rows without it would be under half
the sequence length. LoRA rank and targets stay as you give them.
On Llama (where it was measured) each decoder layer is compiled when Triton is installed (CUDA builds of PyTorch
bring it; --compile none leaves it out), else, on Llama and Qwen2, Liger's kernels are used when liger-kernel is
installed (--kernels torch leaves them out; --kernels liger picks them over compiling).
Only what `fitune train` runs today is proposed; memory is fitune's estimate (the plans shown are confirmed with
the full estimate), speed a model calibrated on 141 measured H200 steps of 7 models (docs/plan.md).

Output: the ranked plans (memory, predicted tokens/s, what each turns on), one line for each faster option that
does not fit, and when nothing fits: the smallest requirement and the changes that would fit.

exit codes: 0 plans found, 2 bad input or nothing fits (the report says what would).

examples:
  fitune plan llama-3.1-8b --gpu rtx4090 --seq-len 2048 --batch-size 2
  fitune plan qwen2.5-7b --gpu 23.4GiB --method lora,qlora,full --lora-targets all-linear --lora-rank 16
  fitune plan ./Llama-3.1-8B --gpu rtx3090 --data train.jsonl --write plan.yaml   # then: fitune train plan.yaml
  fitune plan llama-3.1-8b --gpu rtx4090 --emit hf > train.py
"""


def add_parser(subparsers) -> argparse.ArgumentParser:
    d = DEFAULT_SETUP
    p = subparsers.add_parser("plan", help="find the fastest training setup that fits a GPU",
                              description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", metavar="MODEL", help="catalog name, config.json, model folder, Hub id or .gguf file")
    p.add_argument("--gpu", required=True, metavar="NAME|NGiB",
                   help="a catalog GPU (rtx4090, a100-80gb, ...: fitune estimate --list-gpus) or the memory PyTorch "
                   "may use, e.g. 23.4GiB")
    p.add_argument("--gpus", type=int, default=1, metavar="N",
                   help="up to N GPUs (default 1): searches DDP (a full copy on each), FSDP and DeepSpeed ZeRO-2/3 "
                   "(sharded) on N and on its divisors; the batch is split over the GPUs, memory is per GPU")
    batch = p.add_mutually_exclusive_group()
    batch.add_argument("--batch-size", type=int, help=f"sequences per optimizer step, all GPUs together "
                       f"(default {d.batch_size})")
    batch.add_argument("--tokens-per-step", type=int, metavar="N", help="tokens per optimizer step; the batch is "
                       "N / seq-len sequences")
    p.add_argument("--data", metavar="FILE", help="training data (.jsonl / .json / .parquet): its token lengths set "
                   "the sequence length and packing (needs --tokenizer unless MODEL is a folder; imports transformers)")
    p.add_argument("--tokenizer", metavar="DIR", help="tokenizer folder for --data (default: the MODEL folder)")
    p.add_argument("--method", default="lora",
                   help="the method to train with: lora, qlora, full or freeze (default lora). Name several, "
                        "comma-separated, to let the plan change it (lora,qlora: QLoRA where it is faster or "
                        "fits); the first is yours, and a plan with another says what that costs and buys")
    p.add_argument("--no-quantize", action="store_true", help="leave out QLoRA (4-bit base weights)")
    p.add_argument("--optimizer", metavar="NAME[,NAME]",
                   help="the optimizers the plans may use, comma-separated, in fitune's names or the HF Trainer's "
                        f"({', '.join(optimizer_specs.names())}; adamw_torch, adamw_8bit, paged_adamw_8bit, ... "
                        "read as theirs). Default: any, AdamW first, a lighter one where AdamW does not fit")
    p.add_argument("--host-ram", metavar="NGiB", help="host memory the plans must fit (default: this machine's when "
                   "its GPU is here, else 64GiB assumed): methods whose loading or final save needs more, and "
                   "offloaded checkpoints over it, are left out (docs/phases.md)")
    p.add_argument("--top", type=int, default=3, help="plans to show (default 3; each costs a full estimate)")
    p.add_argument("--json", action="store_true", help="print one JSON object (keys in docs/plan.md)")
    p.add_argument("--write", metavar="PLAN.yaml", help="save the best plan as a `fitune train` config (an "
                   "existing file with other contents is kept as PLAN.yaml.bak)")
    p.add_argument("--emit", choices=("hf",), help="print the best plan as Hugging Face transformers + PEFT code")
    p.add_argument("--pick", type=int, default=1, metavar="N",
                   help="with --write / --emit: take plan N of the list instead of the first (1 to --top)")
    # The setup fields a plan keeps as given: the same flags (and names) as every other command.
    add_arguments(p, [k for k in SETUP_KEYS if k.field in KEPT_FIELDS], defaults=d.to_dict(),
                  group_title="kept as given (the same flags as fitune estimate / train)")
    add_html_argument(p)
    p.set_defaults(run=run)
    return p


#: TrainSetup fields the planner does not search: the user's choice stands.
KEPT_FIELDS = ("seq_len_tokens", "lora_rank", "lora_alpha", "lora_dropout", "lora_targets", "freeze_trainable_layers",
               "kernels", "compile", "keep_outputs")


def kept_setup(args) -> TrainSetup:
    """The defaults with the kept fields' flags applied (problems named by flag)."""
    problems = Problems()
    values = values_from_args(args, [k for k in SETUP_KEYS if k.field in KEPT_FIELDS], problems)
    problems.raise_if_any()
    return DEFAULT_SETUP.replace(**values)


def run(args) -> int:
    """Search, then print the plans (or the JSON document, or the code), writing --write / --html when asked."""
    # the command's library: imported when it runs, so that `fitune --help` stays light
    from .progress import progress_callback

    _check_outputs(args)
    t0 = time.perf_counter()
    req, notes = _request(args)
    with progress_callback("plan: searching", "setup", enabled=not args.json) as progress:
        result = plan(req, progress=progress)
    elapsed = time.perf_counter() - t0
    source_note = describe_source(req.model, req.dtype)
    if source_note:
        notes = [f"model source: {source_note}"] + notes
    if result.plans and args.pick > len(result.plans):
        raise ConfigError(f"--pick {args.pick}: only {len(result.plans)} plan(s) fit; pick one of 1-{len(result.plans)}")
    chosen = result.plans[args.pick - 1] if result.plans else None
    kept_previous = None
    if args.write and chosen is not None:
        text = plan_yaml(chosen, req, args.model, _command(), data_path=args.data, tokenizer=args.tokenizer)
        kept_previous = write_keeping_previous(args.write, text)
    maybe_write_html(args, "plan", result_to_json(result, elapsed, notes))
    if args.json:
        return _print_json(args, req, result, chosen, elapsed, notes, source_note, kept_previous)
    if not result.plans:
        raise DoesNotFitError("nothing fits " + format_result(result, elapsed, notes))
    if args.emit == "hf":
        print(hf_code(chosen, req, args.model, _hf_id(args.model), args.data), end="")
        return 0
    print(format_result(result, elapsed, notes, written=bool(args.write)))
    if args.write:
        print(f"\nwrote {args.write}: run it with `fitune train {args.write}`" + _write_caveats(args))
        if kept_previous:
            print(f"kept the earlier {args.write}, which differed, as {kept_previous}")
    return 0


def _check_outputs(args) -> None:
    """--pick within --top, and --write / --html writable, before the search (not after it)."""
    if not 1 <= args.pick <= max(1, args.top):
        raise ConfigError(f"--pick {args.pick}: give a plan number from 1 to --top ({args.top})")
    for flag, path in (("--write", args.write), ("--html", args.html)):
        if path is not None:
            check_output_file(path, flag, make_parents=flag == "--html")


def _request(args) -> tuple[PlanRequest, list[str]]:
    """The PlanRequest the flags describe, and the notes that say what was chosen for the user (kernels, data,
    batch, host RAM)."""
    model = load_model_spec(args.model)
    gpu = resolve_gpu(args.gpu)
    methods = tuple(m.strip() for m in args.method.split(",") if m.strip())
    if args.no_quantize:
        methods = tuple(m for m in methods if m != "qlora")
    host_ram, host_ram_origin, host_ram_line = policy.resolve_host_ram(args.host_ram)
    optimizers, optimizer_notes = _optimizers(args.optimizer)
    kept = kept_setup(args)
    if kept.keep_outputs and (args.write or args.emit):
        raise ConfigError(f"--keep-outputs plans your own loop as it is (it keeps the model output through backward); "
                          f"{'--write makes a fitune train config' if args.write else '--emit hf prints a script'}, "
                          "whose loop never keeps it: drop --keep-outputs to plan that instead")
    kernels_given = getattr(args, "cfg_kernels", None) is not None
    kernels, kernel_notes = policy.default_kernels(kept, model, kernels_given)
    compile_layers, kernels, compile_notes = policy.default_compile(
        kept, model, kernels, getattr(args, "cfg_compile", None) is not None, kernels_given)
    data, seq_len, data_notes = None, kept.seq_len_tokens, []
    if args.data:
        data, seq_len, data_notes = _read_data(args, model)
    batch_size, batch_notes = _batch_size(args, seq_len)
    _check_batch(args, batch_size)
    req = PlanRequest(model=model, gpu=gpu, seq_len_tokens=seq_len, batch_size=batch_size, num_gpus=args.gpus,
                      methods=methods, lora_rank=kept.lora_rank, lora_alpha=kept.lora_alpha,
                      lora_dropout=kept.lora_dropout, lora_targets=kept.lora_targets,
                      freeze_trainable_layers=kept.freeze_trainable_layers, attns=policy.available_attns(),
                      allow_quantize=not args.no_quantize, host_ram_bytes=host_ram, host_ram_origin=host_ram_origin,
                      kernels=kernels, compile=compile_layers, keep_outputs=kept.keep_outputs, data=data,
                      top=args.top, optimizers=optimizers)
    notes = ["--keep-outputs: plans for your own transformers + PEFT loop as written (the output kept through "
             "backward), none of fitune's techniques; `fitune doctor` shows what freeing it saves"] \
        if kept.keep_outputs else []
    return req, notes + (compile_notes or kernel_notes) + data_notes + batch_notes + optimizer_notes + [host_ram_line]


def _optimizers(given: str | None) -> tuple[tuple[str, ...], list[str]]:
    """The optimizers `--optimizer` allows, in the planner's order of preference, and the note that says so (none
    without the flag: every optimizer).

    Raises:
        ConfigError: a name neither fitune nor the HF Trainer uses for one (the message lists fitune's).
    """
    preference = optimizer_specs.preference()
    if given is None:
        return preference, []
    canonical = {n: optimizer_specs.canonical_name(n.lower()) for n in (n.strip() for n in given.split(",")) if n}
    unknown = [n for n, name in canonical.items() if name is None]
    if unknown or not canonical:
        raise ConfigError(f"--optimizer {given}: {', '.join(unknown) or 'no name'} is not an optimizer fitune "
                          f"trains with; give one or more of {', '.join(preference)}, comma-separated")
    allowed = tuple(o for o in preference if o in canonical.values())
    return allowed, [f"optimizer: {' or '.join(allowed)} only (--optimizer)"]


def _hf_id(model_name: str) -> str | None:
    name = catalog_key(model_name)
    return model_catalog()[name].get("hf_id") if name else None


def _print_json(args, req, result, chosen, elapsed, notes, source_note, kept_previous) -> int:
    doc = result_to_json(result, elapsed, notes)
    doc["source_note"] = source_note  # null for a catalog name or a local config.json (docs/plan.md)
    if args.write and result.plans:
        doc["written"] = args.write
        doc["kept_previous"] = kept_previous
    if args.emit == "hf" and result.plans:
        doc["hf_code"] = hf_code(chosen, req, args.model, _hf_id(args.model), args.data)
    json.dump(doc, sys.stdout, indent=2)
    print()
    return 0 if result.plans else DoesNotFitError.exit_code


def _command() -> str:
    return "fitune " + " ".join(sys.argv[1:]) if sys.argv and sys.argv[0].endswith("fitune") else "fitune plan"


def _write_caveats(args) -> str:
    out = []
    if not model_location(args.model)[1]:
        out.append(f"set `model:` to a local folder, a .gguf file or the Hub id of {args.model} (fitune train loads "
                   "pretrained weights from one of those)")
    if not args.data:
        out.append(f"`data.path: {PLACEHOLDER_DATA}` must exist")
    return "".join(f"\n  before that: {x}" for x in out)


def _batch_size(args, seq_len: int) -> tuple[int, list[str]]:
    if args.tokens_per_step is None:
        return (args.batch_size if args.batch_size is not None else DEFAULT_SETUP.batch_size), []
    if args.tokens_per_step < 1:
        raise ConfigError(f"--tokens-per-step must be a positive integer, got {args.tokens_per_step}")
    batch = max(1, (2 * args.tokens_per_step + seq_len) // (2 * seq_len))  # the nearest whole batch, in integers
    notes = []
    if batch * seq_len != args.tokens_per_step:
        notes.append(f"--tokens-per-step {args.tokens_per_step:,}: {batch} sequences of {seq_len} = "
                     f"{batch * seq_len:,} tokens per step (the nearest whole batch)")
    return batch, notes


def _check_batch(args, batch_size: int) -> None:
    """--gpus and the batch within what a plan can hold (TrainSetup's bounds), said before the search starts."""
    if args.gpus > 4096:
        raise ConfigError(f"--gpus must be at most 4096, got {args.gpus}")
    if args.gpus >= 1 and batch_size >= 1 and batch_size % args.gpus == 0 \
            and not micro_batch_candidates(batch_size // args.gpus):
        raise ConfigError(f"--batch-size {batch_size:,}: no micro-batch of at most {MAX_MICRO_BATCH:,} sequences "
                          f"divides it with at most {MAX_GRAD_ACCUM:,} accumulation steps; choose a batch with such a "
                          f"divisor (at most {MAX_MICRO_BATCH * MAX_GRAD_ACCUM:,} sequences per GPU)")


def _read_data(args, model):
    from ..specs.sources import is_gguf_path, is_hub_id

    has_tokenizer = os.path.isdir(args.model) or is_gguf_path(args.model) or is_hub_id(args.model)
    tokenizer = args.tokenizer or (args.model if has_tokenizer else None)
    if tokenizer is None:
        raise ConfigError(f"--data needs --tokenizer DIR (a folder with tokenizer.json); {args.model} is not a model "
                          "folder, a .gguf file or a Hub id to take it from")
    if not os.path.exists(args.data) and not is_hub_id(args.data):  # ORG/NAME: a Hub data set (fitune.data.hub)
        raise ConfigError(f"--data {args.data}: no such file")
    from .progress import progress_callback

    with progress_callback("plan: encoding --data", "record", enabled=not args.json) as progress:
        profile = profile_data(args.data, tokenizer, progress=progress)
    given = getattr(args, "cfg_seq_len_tokens", None) is not None  # an explicit --seq-len is the user's and stays
    cap = kept_setup(args).seq_len_tokens
    seq, truncated = choose_seq_len(profile, cap)
    lengths = (f"--data {args.data}: {profile.examples:,} {profile.format} examples, mean {profile.mean_tokens:,.0f} "
               f"tokens, 99th percentile {profile.percentile_tokens(0.99):,}, longest {profile.max_tokens:,}")
    if given:
        truncated = sum(1 for n in profile.lengths_tokens if n > cap)
        notes = [f"{lengths}; --seq-len {cap:,} kept as given"
                 + truncated_said(truncated)
                 + (f" (without --seq-len the plan would use {seq:,}, from the lengths)" if seq < cap else "")]
        return profile, cap, notes
    notes = [f"{lengths} -> --seq-len {seq}" + truncated_said(truncated)]
    return profile, seq, notes


def truncated_said(truncated: int) -> str:
    """' (3 longer examples are truncated)', ' (1 longer example is truncated)', or '' for none."""
    if not truncated:
        return ""
    return f" ({truncated:,} longer example{'s are' if truncated > 1 else ' is'} truncated)"


# ---- output -----------------------------------------------------------------------------------------------------


def _gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB"


def format_result(result, elapsed_s: float, notes=(), written: bool = False) -> str:
    """The plan as text; `written`: --write was given (the "next:" line then does not ask for it)."""
    req = result.request
    g = req.gpu
    lines = [("fitune plan: " if result.plans else "") + f"{req.model.name} on {g.name} "
             f"({_gib(g.allocator_budget_bytes)} for PyTorch's allocator{kernel_images_said(g, _gib)})" + (f" x {req.num_gpus}" if req.num_gpus > 1 else ""),
             f"  {req.batch_size} x {req.seq_len_tokens} tokens per step, {req.dtype}; "
             f"{kept_as_given(req.methods, req.lora_rank, req.lora_targets)}; searched {result.searched} setups "
             f"({result.estimated_fast} extrapolated + {result.estimated_full} full estimates) in {elapsed_s:.2f} s"]
    if g.note:
        lines.append(f"  ({g.note})")
    if result.plans:
        lines.append("")
        lines.append(f"  {'#':>2} {'tokens/s':>9s} {'allocated':>10s} {'reserved':>10s}   plan"
                     + ("   (tokens/s over all GPUs; memory per GPU)" if req.num_gpus > 1 else ""))
        for i, p in enumerate(result.plans, 1):
            flag = "!" if p.retries_expected else " "
            lines.append(f"  {i:>2} {p.trained_tokens_per_s:>9,.0f} {_gib(p.peak_allocated_bytes):>10s} "
                         f"{_gib(p.peak_reserved_bytes):>10s} {flag} {describe(p.setup)}" + (", packing" if p.packing else ""))
            lines.append(f"      turns on: {'; '.join(p.turns_on) if p.turns_on else 'nothing (the plain setup fits)'}")
            if p.retries_expected:
                lines.append("      ! the reserved peak is over the budget: expect allocator retries (about one a "
                             f"layer, {p.retry_cost_s:.2f} s of a {p.step_time_s:.2f} s step at the measured 11 ms "
                             "each, ranked net of it and after the plans without; a fragmented cache can still fail)")
            if p.fallback_tokens_per_s is not None:
                lines.append("      at risk: the allocated peak is within 2 % of the budget, so the first step may run "
                             "out of memory" + _tight_fallback(p.setup) + "; ranked at that fallback's predicted "
                             f"{p.fallback_tokens_per_s:,.0f} tokens/s")
            elif p.tight:
                lines.append("      tight: the reserved peak is within 5 % of the budget, where run-to-run "
                             "fragmentation decides" + _tight_fallback(p.setup))
            if p.method_change:
                lines.append(f"      method: {p.method_change}")
            if p.unvalidated_reasons:
                lines.append(f"      unvalidated: {'; '.join(p.unvalidated_reasons)}")
            if p.requires:
                lines.append(f"      needs: {', '.join(p.requires)}")
    if result.rejected:
        lines.append("")
        lines.append("  does not fit:")
        lines += [f"    {r.message}" for r in result.rejected]
    host_only = any(r.reason == "host_ram" for r in result.rejected) and result.minimum is not None and \
        result.minimum.peak_reserved_bytes <= g.training_budget_bytes
    if not result.plans and host_only:
        lines.append("")
        lines.append("  the card would hold it: the host RAM is what is short (above); --host-ram if this computer "
                     "has more, or a machine with more RAM")
    elif not result.plans and result.minimum is not None:
        m = result.minimum
        lines.append("")
        lines.append(f"  the smallest requirement: {_gib(m.peak_allocated_bytes)} allocated, {_gib(m.peak_reserved_bytes)} "
                     f"reserved ({describe(m.setup)}) > {_gib(g.training_budget_bytes)}")
        if result.changes:
            lines.append("  changes that would fit:")
            for c in result.changes:
                tag = "" if c.runnable else " [not runnable by fitune train today]"
                retries = "; allocator retries expected" if c.fits and c.retries_expected else ""
                need = _gib(c.peak_allocated_bytes) if c.fits else "no fit"
                lines.append(f"    {c.change:36s} {need:>10s}  {c.why}{retries}{tag}")
    for n in list(notes) + list(result.notes):
        lines.append(f"  note: {n}")
    if result.plans and req.keep_outputs:
        lines.append("  next: apply the plan's micro-batch and checkpointing to your script; or free the output before "
                     "backward (`loss = model(**batch).loss`) and plan again without --keep-outputs")
    elif result.plans and not written:
        lines.append("  next: add --write plan.yaml (then `fitune train plan.yaml`) or --emit hf for your own script")
    return "\n".join(lines)


def result_to_json(result, elapsed_s: float, notes=()) -> dict:
    """The stable --json document (docs/plan.md, "JSON output")."""
    req = result.request
    doc = {
        "model": req.model.name,
        "gpu": {"name": req.gpu.name, "total_bytes": req.gpu.total_bytes,
                "allocator_budget_bytes": req.gpu.allocator_budget_bytes,
                "training_budget_bytes": req.gpu.training_budget_bytes},
        "num_gpus": req.num_gpus,
        "request": {"seq_len_tokens": req.seq_len_tokens, "batch_size": req.batch_size,
                    "per_gpu_batch_size": req.per_gpu_batch, "tokens_per_step": req.batch_size * req.seq_len_tokens,
                    "methods": list(req.methods), "lora_rank": req.lora_rank, "lora_alpha": req.lora_alpha,
                    "lora_targets": list(req.lora_targets), "dtype": req.dtype, "keep_outputs": req.keep_outputs,
                    "host_ram_bytes": req.host_ram_bytes, "host_ram_origin": req.host_ram_origin},
        "plans": [plan_to_json(p, i) for i, p in enumerate(result.plans, 1)],
        "rejected": [{"option": r.option, "reason": r.reason, "message": r.message,
                      "peak_allocated_bytes": r.peak_allocated_bytes, "peak_reserved_bytes": r.peak_reserved_bytes,
                      "budget_bytes": r.budget_bytes} for r in result.rejected],
        "fits": bool(result.plans),
        "minimum": None,
        "changes": [{"change": c.change, "why": c.why, "peak_allocated_bytes": c.peak_allocated_bytes, "fits": c.fits,
                     "retries_expected": c.retries_expected, "runnable": c.runnable} for c in result.changes],
        "search": {"setups": result.searched, "estimated_extrapolated": result.estimated_fast,
                   "estimated_full": result.estimated_full, "seconds": round(elapsed_s, 3)},
        "notes": list(notes) + list(result.notes),
    }
    if req.data is not None:
        d = req.data
        doc["data"] = {"path": d.path, "examples": d.examples, "mean_tokens": round(d.mean_tokens, 1),
                       "p99_tokens": d.percentile_tokens(0.99), "max_tokens": d.max_tokens, "tokenized_by": d.source}
    if result.minimum is not None:
        m = result.minimum
        doc["minimum"] = {"setup": m.setup.to_dict(), "peak_allocated_bytes": m.peak_allocated_bytes,
                          "peak_reserved_bytes": m.peak_reserved_bytes}
    return doc


def plan_to_json(p, rank: int) -> dict:
    return {
        "rank": rank,
        "setup": p.setup.to_dict(),
        "micro_batch_size": p.setup.batch_size,
        "grad_accum": p.setup.grad_accum,
        "packing": p.packing,
        "peak_allocated_bytes": p.peak_allocated_bytes,
        "peak_reserved_bytes": p.peak_reserved_bytes,
        "budget_bytes": p.budget_bytes,
        "headroom_bytes": p.headroom_bytes,
        "fits": True,
        "retries_expected": p.retries_expected,
        "retry_cost_s": round(p.retry_cost_s, 4),
        "breakdown": dict(p.breakdown),
        "step_time_s": round(p.step_time_s, 4),
        "tokens_per_s": round(p.tokens_per_s, 1),
        "trained_tokens_per_s": round(p.trained_tokens_per_s, 1),
        "turns_on": list(p.turns_on),
        "requires": list(p.requires),
        "runnable": True,
        "num_gpus": p.setup.num_gpus,
        "strategy": p.setup.strategy,
        "tight": p.tight,
        "fallback_tokens_per_s": None if p.fallback_tokens_per_s is None else round(p.fallback_tokens_per_s, 1),
        "method_change": p.method_change or None,
        "unvalidated": bool(p.unvalidated_reasons),
        "unvalidated_reasons": list(p.unvalidated_reasons),
    }


def _tight_fallback(s) -> str:
    """What `fitune train` does when a tight plan's step runs out of memory (its OOM guard, as
    fitune/plan/search.py `fallback_setup` states it), said where the plan is shown. Measured: QLoRA r16 all-linear's
    tight plan 1 ran out of memory in step 1 and went on at micro-batch 1 (docs/speed.md)."""
    fallback = fallback_setup(s)
    if fallback is None:
        return ""  # the user's own loop has no guard, or nothing lighter is left
    if fallback.batch_size < s.batch_size:
        return (f"; if a step runs out of memory, `fitune train` runs it again at micro-batch {fallback.batch_size}"
                " (same data, same effective batch)")
    return "; if a step runs out of memory, `fitune train` runs it again with checkpointing (same data)"

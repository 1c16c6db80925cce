"""Issue 14, "real-length data": each stack's trained tokens/s on the same instruction-like length distribution.

Every stack reads the same seeded prompt/completion records (peerlib.write_length_data: an example's words are
lognormal, median 300, sigma 0.9, clipped to [32, 2048]; distribution percentiles p10 95, p25 163, p50 300, p75 550,
p90 951, p95 1318, p99 2048, mean about 435; the 2,000 records of seed 0 measure p10 96, p25 170, p50 304, p75 545,
p90 938, p95 1332, p99 2048, mean 438, 1.85 % at 2048; the prompt is 10-50 % of an example and is not trained),
the same model folder (bench/peers/make_model.py: Llama-3.1-8B-shaped, random bf16 weights, word-level tokenizer),
LoRA r8 alpha 16 dropout 0 on q_proj,v_proj, bf16, SDPA, AdamW (torch), lr 1e-4, with the micro-batch its users
would pick:

  hf_trainer   transformers `Trainer` + PEFT; prompt + completion + eos tokenized per example (prompt labels -100),
               truncated at 2048, `DataCollatorForSeq2Seq` (pads each batch to its longest row, labels with -100),
               per_device_train_batch_size 4 (the tutorials' value; TrainingArguments' own default is 8),
               gradient checkpointing on (non-reentrant; --grad-checkpointing off: none), --liger: Liger Kernel
               (`use_liger_kernel=True`)
  trl_packing  TRL's `SFTTrainer` on the prompt/completion records (it tokenizes them, loss on the completion),
               `packing=True` (TRL 1.15's default strategy "bfd", best-fit decreasing), `padding_free=True` (implied
               by bfd packing: each batch is one flattened row with position ids, no padding), max_length 2048,
               per_device_train_batch_size 2, TRL's defaults otherwise (gradient checkpointing on); LoRA through
               `peft_config`. The peer's strongest setup is searched with --grad-checkpointing off, --liger
               (`use_liger_kernel=True`: TRL 1.15 applies Liger's layer kernels, RMSNorm, SwiGLU and RoPE, and keeps
               its own fused LM head) and --micro-batch / --grad-accum
  unsloth_packing
               Unsloth 2026.10.9 (`from unsloth import FastLanguageModel` first in the process, as
               bench/peers/unsloth_run.py): `FastLanguageModel.from_pretrained(MODEL_DIR, max_seq_length 2048, bf16,
               load_in_4bit=False)`, `get_peft_model(r 8, alpha 16, dropout 0, q_proj,v_proj,
               use_gradient_checkpointing="unsloth" | False | True)` (--grad-checkpointing unsloth (default) | off |
               on), then TRL's `SFTTrainer` (as Unsloth patches it) with `SFTConfig(packing=True, padding_free=True,
               max_length 2048)` on the same prompt/completion records, micro-batch 2; under a cap the memory
               queries answer as the capped card (peerlib.simulate_card_view; --no-card-view: not)
  fitune       `fitune plan MODEL_DIR --gpu CAP --data FILE --tokenizer MODEL_DIR --write plan.yaml` (its sequence
               length, packing, micro-batch and the rest as the plan says), then `fitune train plan.yaml` with
               max_steps and `cap:` set

Per optimizer step: the padded tokens (rows x width of each micro-batch, what the GPU computes on), the non-pad
tokens and the TRAINED tokens (labels != -100: completion tokens, less the first of each example). The record's
`tokens_per_s` is the trained tokens/s: the median over steps 3 and later of (trained tokens / step seconds);
`*_tokens_per_s_total` divides the sums over those steps instead (steps differ in size here). For the HF stacks the
counts come from a wrapper around the trainer's data collator (batches are collated in step order); for fitune from
its metrics.jsonl (tokens, trained_tokens, step_time_s) and, for the padded tokens, from fitune's own batch stream
rebuilt on the CPU with the run's seed (`stream_matches_metrics` checks it against metrics.jsonl); fitune's record
also carries the plan's own estimate (`fitune estimate --config plan.yaml --json`, after training):
`estimate_allocated_bytes` / `estimate_reserved_bytes`. One JSON line per run appended to --out; any failure (out of
memory: fits false; Unsloth not importable: fits null) is a line with `error`.

    PYTHONPATH=.:$PWD/.peers_site python3 bench/peers/real_length.py --stack trl_packing --model-dir DIR --out F
    PYTHONPATH=.:$PWD/.peers_site python3 bench/peers/real_length.py --stack trl_packing --grad-checkpointing off \
        --liger --micro-batch 1 --grad-accum 2 --model-dir DIR --out F
    PYTHONPATH=.:$PWD/.peers_site python3 bench/peers/real_length.py --stack unsloth_packing --model-dir DIR --out F
    python3 bench/peers/real_length.py --stack hf_trainer --model-dir TINY --out F --device cpu --cap '' --steps 4
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, ROOT)

from bench.common import PROBE_ENV, probed_fitune_cmd, training_facts  # noqa: E402
from bench.peers.peerlib import (StepClock, record_whatever_happens, reset_peaks, simulate_card_view,  # noqa: E402
                                 start_cuda, trainer_callback, write_length_data)

STACKS = ("hf_trainer", "trl_packing", "unsloth_packing", "fitune")
MICRO_BATCH = {"hf_trainer": 4, "trl_packing": 2, "unsloth_packing": 2}
#: --grad-checkpointing's default per stack (TRL's SFTConfig defaults it on; Unsloth's notebooks pass "unsloth")
GRAD_CHECKPOINTING = {"hf_trainer": "on", "trl_packing": "on", "unsloth_packing": "unsloth"}
#: get_peft_model's use_gradient_checkpointing for each --grad-checkpointing value
UNSLOTH_GC = {"unsloth": "unsloth", "off": False, "on": True}
LOOPS = {"hf_trainer": "Trainer", "trl_packing": "SFTTrainer", "unsloth_packing": "Unsloth SFTTrainer"}
TARGETS = ["q_proj", "v_proj"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stack", required=True, choices=STACKS)
    p.add_argument("--model-dir", required=True, help="folder written by bench/peers/make_model.py")
    p.add_argument("--out", required=True, help="JSON lines file; one line per run is appended")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps (rates: steps 3 and later)")
    p.add_argument("--cap", default="rtx4090", help="allocator budget (cuda only; fitune plan's --gpu); '' for none")
    p.add_argument("--device", default="cuda", help="cuda | cpu (cpu: tiny models, to test the script)")
    p.add_argument("--micro-batch", type=int, help="hf_trainer 4, trl_packing 2, unsloth_packing 2 (fitune: the "
                                                    "plan's)")
    p.add_argument("--grad-accum", type=int, default=1, help="hf_trainer / trl_packing / unsloth_packing (fitune: "
                                                             "the plan's)")
    p.add_argument("--grad-checkpointing", choices=("on", "off", "unsloth"),
                   help="hf_trainer / trl_packing: on (default) | off; unsloth_packing: unsloth (default) | off | on "
                        "(get_peft_model's use_gradient_checkpointing \"unsloth\" / False / True); fitune: the plan's")
    p.add_argument("--liger", action="store_true", help="hf_trainer / trl_packing: use_liger_kernel=True")
    p.add_argument("--no-card-view", action="store_true",
                   help="unsloth_packing: leave torch.cuda.mem_get_info / total_memory as the card reports them")
    p.add_argument("--max-length", type=int, default=2048, help="truncation (hf_trainer) / packed length (TRL)")
    p.add_argument("--examples", type=int, default=2000, help="records of the shared data file")
    p.add_argument("--seed", type=int, default=0, help="seed of the data (the trainers' seed is 0)")
    p.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "peers_real_length"),
                   help="the data file and fitune's plan and run go here")
    p.add_argument("--timeout", type=float, default=540, help="fitune: seconds for `fitune plan` + `fitune train`")
    p.add_argument("--plan-args", default="", help="fitune: more `fitune plan` flags, one string (e.g. "
                                                    "'--compile layers')")
    args = p.parse_args(argv)
    if args.micro_batch is None:
        args.micro_batch = MICRO_BATCH.get(args.stack)
    if args.stack == "fitune" and (args.grad_checkpointing or args.liger):
        p.error("--grad-checkpointing / --liger: fitune's come from its plan (--plan-args)")
    if args.liger and args.stack == "unsloth_packing":
        p.error("--liger: hf_trainer / trl_packing only (Unsloth brings its own kernels)")
    if args.grad_checkpointing == "unsloth" and args.stack != "unsloth_packing":
        p.error("--grad-checkpointing unsloth: unsloth_packing only (the others: on | off)")
    if args.stack != "fitune" and args.grad_checkpointing is None:
        args.grad_checkpointing = GRAD_CHECKPOINTING[args.stack]
    return args


# ---- per-step token counts ---------------------------------------------------------------------------------

class Tally:
    """Step seconds (a StepClock fed by the trainer's callback) and the token counts of every collated batch."""

    def __init__(self, device: str):
        self.clock = StepClock(device)
        self.batches: list[tuple[int, int, int, int]] = []  # (rows, padded, non-pad, trained) per micro-batch
        self.external: list[dict] | None = None  # fitune: the steps as read from metrics.jsonl

    def collator(self, inner):
        batches = self.batches

        def collate(features):
            b = inner(features)
            ids, labels = b["input_ids"], b["labels"]
            mask = b.get("attention_mask")
            nonpad = int(mask.sum()) if mask is not None else int(ids.numel())
            batches.append((int(ids.shape[0]), int(ids.numel()), nonpad, int((labels != -100).sum())))
            return b

        return collate

    def steps(self, grad_accum: int) -> list[dict]:
        if self.external is not None:
            return self.external
        out = []
        for i, sec in enumerate(self.clock.seconds):
            bs = self.batches[i * grad_accum:(i + 1) * grad_accum]
            if len(bs) < grad_accum:
                break
            out.append({"seconds": sec, "rows": sum(b[0] for b in bs), "padded": sum(b[1] for b in bs),
                        "nonpad": sum(b[2] for b in bs), "trained": sum(b[3] for b in bs)})
        return out


def summarize_steps(steps: list[dict], skip: int = 2) -> dict:
    """Rates over steps 3 and later (all steps when there are fewer): per-step medians and sums over sums."""
    steady = steps[skip:] if len(steps) > skip else steps
    out: dict = {"steps_done": len(steps)}
    seconds = sum(s["seconds"] for s in steady)
    for key in ("trained", "nonpad", "padded"):
        out[f"{key}_tokens_per_s"] = (statistics.median(s[key] / s["seconds"] for s in steady if s["seconds"] > 0)
                                      if steady else None)
        out[f"{key}_tokens_per_s_total"] = sum(s[key] for s in steady) / seconds if seconds > 0 else None
    out["tokens_per_s"] = out["trained_tokens_per_s"]
    padded = sum(s["padded"] for s in steps)
    if padded:
        out["padding_share"] = round(1 - sum(s["nonpad"] for s in steps) / padded, 4)
        out["trained_share_of_padded"] = round(sum(s["trained"] for s in steps) / padded, 4)
    for key in ("trained", "nonpad", "padded"):
        out[f"{key}_tokens"] = sum(s[key] for s in steps)
    out["step_seconds"] = [round(s["seconds"], 4) for s in steps[:64]]
    out["step_tokens"] = [[s["padded"], s["nonpad"], s["trained"]] for s in steps[:64]]  # padded, non-pad, trained
    return out


def run_varlen_case(stack: str, args, body, in_process: bool = True, **extra) -> dict:
    """peerlib.run_case for steps of varying size: `body(rec, tally, data)` trains; one record is written whatever
    happens (`peerlib.record_whatever_happens`). `in_process`: CUDA peaks from this process (the HF stacks);
    fitune's come from its metrics.jsonl."""
    rec = {"stack": stack, "workload": "real_length", "device": args.device,
           "cap": args.cap if args.device == "cuda" else None, "micro_batch_size": args.micro_batch,
           "grad_accum": args.grad_accum, "steps": args.steps, "max_length": args.max_length,
           "lora": {"r": 8, "alpha": 16, "dropout": 0.0, "targets": TARGETS}, "optim": "adamw_torch", **extra}
    tally = Tally(args.device)

    def summarize(rec: dict) -> None:
        steps = tally.steps(rec.get("grad_accum") or 1)
        if rec["fits"] and len(steps) < args.steps:
            rec.update({"fits": None, "error": f"only {len(steps)} of {args.steps} steps were counted"})
        rec.update(summarize_steps(steps))
        if not rec["fits"]:
            for key in [k for k in rec if k.endswith("tokens_per_s") or k.endswith("tokens_per_s_total")]:
                rec[key] = None
        if getattr(tally.clock, "losses", None):
            rec["losses"] = [round(x, 4) for x in tally.clock.losses[:64]]
        if "first_step_grad_norm" not in rec:  # fitune's body sets it from its child
            rec["first_step_grad_norm"] = getattr(tally.clock, "first_grad_norm", None)

    def run() -> None:
        os.makedirs(args.work, exist_ok=True)
        data = os.path.join(args.work, f"data_{args.examples}_seed{args.seed}.jsonl")
        rec["data"] = write_length_data(data, args.examples, args.seed)
        rec["data_file"] = data
        body(rec, tally, data)

    return record_whatever_happens(rec, args, run, summarize,
                                   lambda: f"{len(tally.steps(rec.get('grad_accum') or 1))} counted steps",
                                   in_process)


# ---- the stacks --------------------------------------------------------------------------------------------

def _records(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _load_model(args):
    import torch
    from transformers import AutoModelForCausalLM

    kwargs = {"dtype": torch.bfloat16, "attn_implementation": "sdpa"}
    if args.device == "cuda":
        kwargs["device_map"] = {"": 0}
    return AutoModelForCausalLM.from_pretrained(args.model_dir, **kwargs)


def _lora_config():
    from peft import LoraConfig

    return LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=list(TARGETS), task_type="CAUSAL_LM")


def _common_training_args(args) -> dict:
    return dict(per_device_train_batch_size=args.micro_batch, gradient_accumulation_steps=args.grad_accum,
                max_steps=args.steps, learning_rate=1e-4, optim="adamw_torch", bf16=True, logging_steps=1,
                report_to=[], save_strategy="no", dataloader_num_workers=0, use_cpu=args.device == "cpu", seed=0)


def hf_trainer_body(args):
    def body(rec, tally, data):
        from peft import get_peft_model
        from transformers import AutoTokenizer, DataCollatorForSeq2Seq, Trainer, TrainingArguments

        t0 = time.perf_counter()
        tok = AutoTokenizer.from_pretrained(args.model_dir)
        records = _records(data)
        prompts = tok([r["prompt"] for r in records], add_special_tokens=True)["input_ids"]
        completions = tok([r["completion"] for r in records], add_special_tokens=False)["input_ids"]
        features = []
        for p, c in zip(prompts, completions):
            c = list(c) + [tok.eos_token_id]
            ids, labels = (list(p) + c)[:args.max_length], ([-100] * len(p) + c)[:args.max_length]
            features.append({"input_ids": ids, "attention_mask": [1] * len(ids), "labels": labels})
        model = get_peft_model(_load_model(args), _lora_config())
        collator = tally.collator(DataCollatorForSeq2Seq(tok, padding="longest", label_pad_token_id=-100))
        gc = args.grad_checkpointing == "on"
        targs = TrainingArguments(
            output_dir=os.path.join(args.work, "hf_trainer_out"), gradient_checkpointing=gc,
            gradient_checkpointing_kwargs={"use_reentrant": False} if gc else None, remove_unused_columns=False,
            use_liger_kernel=args.liger, **_common_training_args(args))
        trainer = Trainer(model=model, args=targs, train_dataset=features, data_collator=collator,
                          callbacks=[trainer_callback(tally.clock)])
        rec["load_s"] = round(time.perf_counter() - t0, 2)
        rec["trainable_params"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
        rec["setup"] = {"collator": "DataCollatorForSeq2Seq(padding='longest')",
                        "gradient_checkpointing": targs.gradient_checkpointing,
                        "use_liger_kernel": targs.use_liger_kernel, "truncation": args.max_length}
        rec["_retries0"] = reset_peaks(args.device)
        trainer.train()

    return body


def trl_packing_body(args):
    def body(rec, tally, data):
        from datasets import Dataset
        from transformers import AutoTokenizer
        from trl import SFTConfig, SFTTrainer

        t0 = time.perf_counter()
        tok = AutoTokenizer.from_pretrained(args.model_dir)
        dataset = Dataset.from_list(_records(data))
        config = SFTConfig(output_dir=os.path.join(args.work, "trl_out"), max_length=args.max_length, packing=True,
                           padding_free=True, gradient_checkpointing=args.grad_checkpointing == "on",
                           use_liger_kernel=args.liger, **_common_training_args(args))
        trainer = SFTTrainer(model=_load_model(args), args=config, train_dataset=dataset, processing_class=tok,
                             peft_config=_lora_config(), callbacks=[trainer_callback(tally.clock)])
        trainer.data_collator = tally.collator(trainer.data_collator)  # TRL refuses a custom one with padding-free
        model = trainer.model
        rec["load_s"] = round(time.perf_counter() - t0, 2)
        rec["trainable_params"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
        rec["setup"] = {"packing": config.packing, "packing_strategy": getattr(config, "packing_strategy", None),
                        "padding_free": getattr(trainer, "padding_free", None),
                        "completion_only_loss": getattr(trainer, "completion_only_loss", None),
                        "gradient_checkpointing": config.gradient_checkpointing,
                        "gradient_checkpointing_kwargs": config.gradient_checkpointing_kwargs,
                        "use_liger_kernel": config.use_liger_kernel,
                        "liger_kernel_config": getattr(config, "liger_kernel_config", None),
                        "attn_implementation": getattr(model.config, "_attn_implementation", None),
                        "packed_rows": len(trainer.train_dataset)}
        rec["_retries0"] = reset_peaks(args.device)
        trainer.train()

    return body


def _unsloth_attention() -> dict:
    """Which attention Unsloth's Llama forward runs on packed rows here (unsloth/utils/attention_dispatch.py's
    `select_attention_backend(use_varlen=True)`: flash_varlen with flash-attn installed, else xformers, else sdpa,
    whose packed route is torch's varlen kernel where it loaded, else SDPA per segment)."""
    out: dict = {}
    try:
        from unsloth.utils import attention_dispatch as ad

        out["packed_attention_backend"] = ad.select_attention_backend(use_varlen=True)
        out["torch_varlen_attn"] = getattr(ad, "_TORCH_VARLEN_ATTN", None) is not None
        out["has_flash_attention"] = getattr(ad, "HAS_FLASH_ATTENTION", None)
        out["has_xformers"] = getattr(ad, "HAS_XFORMERS", None)
    except Exception as e:  # noqa: BLE001 - notes only
        out["attention_dispatch_error"] = repr(e)[:300]
    return out


def unsloth_packing_body(args):
    def body(rec, tally, data):
        # before unsloth, which patches transformers, peft and trl when it is imported: none of them yet
        rec["imported_before_unsloth"] = sorted(m for m in ("transformers", "peft", "trl", "datasets")
                                                if m in sys.modules)
        if args.device == "cuda" and not args.no_card_view:
            rec["card_view"] = simulate_card_view(args.cap)
        from unsloth import FastLanguageModel  # first: it patches transformers, peft and trl

        import torch
        from datasets import Dataset
        from trl import SFTConfig, SFTTrainer

        t0 = time.perf_counter()
        gc = UNSLOTH_GC[args.grad_checkpointing]
        model, tok = FastLanguageModel.from_pretrained(
            model_name=args.model_dir, max_seq_length=args.max_length, dtype=torch.bfloat16, load_in_4bit=False,
            use_gradient_checkpointing=gc)  # as unsloth_run.py: from_pretrained applies (or undoes) the patch too
        model = FastLanguageModel.get_peft_model(
            model, r=8, target_modules=list(TARGETS), lora_alpha=16, lora_dropout=0, bias="none",
            use_gradient_checkpointing=gc, random_state=0)
        records = _records(data)
        dataset = Dataset.from_list(records)
        # TRL's configs default gradient_checkpointing to True; Unsloth's patched trainer turns that default off
        # for a model loaded with False, plain TRL does not: say it for "off" (as unsloth_run.py)
        off = {"gradient_checkpointing": False} if gc is False else {}
        config = SFTConfig(**off, output_dir=os.path.join(args.work, "unsloth_out"), max_length=args.max_length,
                           packing=True, padding_free=True, dataset_num_proc=1, **_common_training_args(args))
        trainer = SFTTrainer(model=model, args=config, train_dataset=dataset, processing_class=tok,
                             callbacks=[trainer_callback(tally.clock)])
        targs, collator = trainer.args, trainer.data_collator
        rec["load_s"] = round(time.perf_counter() - t0, 2)
        rec["trainable_params"] = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
        rec["setup"] = {
            "packing": getattr(targs, "packing", None), "packing_strategy": getattr(targs, "packing_strategy", None),
            "padding_free": getattr(trainer, "padding_free", getattr(targs, "padding_free", None)),
            "args_padding_free": getattr(targs, "padding_free", None),
            "completion_only_loss": getattr(trainer, "completion_only_loss", None),
            "gradient_checkpointing": args.grad_checkpointing, "use_gradient_checkpointing": repr(gc),
            "model_gradient_checkpointing": repr(getattr(model, "_unsloth_gradient_checkpointing", None)),
            "args_gradient_checkpointing": getattr(targs, "gradient_checkpointing", None),
            "use_liger_kernel": getattr(targs, "use_liger_kernel", None),
            "attn_implementation": getattr(model.config, "_attn_implementation", None), **_unsloth_attention(),
            "collator": f"{type(collator).__module__}.{type(collator).__name__}",
            "unsloth_packing_collator": bool(getattr(collator, "_unsloth_packing_wrapped", False)),
            "trainer_class": f"{type(trainer).__module__}.{type(trainer).__name__}",
            "records": len(records), "packed_rows": len(trainer.train_dataset),
            "train_columns": list(getattr(trainer.train_dataset, "column_names", None) or [])}
        # after Unsloth wrapped the collator's torch_call (packed_seq_lengths); TRL refuses a custom one
        trainer.data_collator = tally.collator(collator)
        rec["_retries0"] = reset_peaks(args.device)
        trainer.train()

    return body


def fitune_estimate(fitune: list[str], plan_path: str, gpu: str, env: dict) -> dict:
    """`fitune estimate --config plan.yaml --gpu GPU --json`'s peaks (the plan's own estimate of the run); never
    raises: None and `estimate_error` saying why."""
    out = {"estimate_allocated_bytes": None, "estimate_reserved_bytes": None}
    try:
        proc = subprocess.run(fitune + ["estimate", "--config", plan_path, "--gpu", gpu, "--json"],
                              capture_output=True, text=True, env=env, timeout=180)
        out["estimate_exit"] = proc.returncode
        answer = json.loads(proc.stdout) if proc.stdout.strip() else None
        if not isinstance(answer, dict):
            raise RuntimeError(f"no JSON answer (exit {proc.returncode}): {_tail(proc)[-600:]}")
        out["estimate_allocated_bytes"] = answer.get("peak_allocated_bytes")
        out["estimate_reserved_bytes"] = answer.get("peak_reserved_bytes")
        out["estimate_fits"] = answer.get("fits")
        if out["estimate_allocated_bytes"] is None or out["estimate_reserved_bytes"] is None:
            out["estimate_error"] = f"the answer lacks peak_allocated_bytes / peak_reserved_bytes (exit " \
                                    f"{proc.returncode})"
    except Exception as e:  # noqa: BLE001 - a note beside the measurement, never its failure
        out["estimate_error"] = f"{type(e).__name__}: {str(e)[:600]}"
    return out


def fitune_steps_from_stream(cfg: dict, steps: int) -> list[dict]:
    """fitune's batches rebuilt on the CPU as `fitune train` builds them (fitune/train/loop.py): the same records,
    tokenizer, sequence length, packing, rows and seed -> per step the padded / non-pad / trained tokens."""
    from fitune import data as data_mod

    tok = data_mod.load_tokenizer(cfg.get("tokenizer") or cfg["model"])
    seq = int(cfg["seq_len"])
    examples, _ = data_mod.tokenize_records(data_mod.read_records(cfg["data"]["path"]), tok,
                                            (cfg.get("data") or {}).get("format"), seq)
    packing = bool(cfg.get("packing"))
    items = data_mod.pack(examples, seq) if packing else examples
    stream = data_mod.BatchStream(items, int(cfg["batch_size"]), int(cfg.get("seed", 0)), data_mod.pad_id(tok),
                                  packed=packing)
    out = []
    for _ in range(steps):
        bs = [stream.next_batch() for _ in range(int(cfg.get("grad_accum", 1)))]
        out.append({"rows": sum(b.rows for b in bs), "padded": sum(b.rows * b.width_tokens for b in bs),
                    "nonpad": sum(b.tokens for b in bs), "trained": sum(b.trained_tokens for b in bs)})
    return out


def _tail(proc) -> str:
    return ((proc.stdout or "")[-800:] + (proc.stderr or "")[-2500:]).strip()


def fitune_body(args):
    def body(rec, tally, data):
        import shutil

        import yaml

        deadline = time.monotonic() + args.timeout
        fitune = [sys.executable, "-m", "fitune"]
        run = os.path.join(args.work, "fitune")
        shutil.rmtree(run, ignore_errors=True)
        os.makedirs(run)
        plan_path = os.path.join(run, "plan.yaml")
        plan_cmd = fitune + ["plan", args.model_dir, "--gpu", args.cap or "rtx4090", "--data", data, "--tokenizer",
                             args.model_dir, "--method", "lora", "--lora-rank", "8", "--lora-targets",
                             ",".join(TARGETS), "--write", plan_path] + shlex.split(args.plan_args)
        rec["plan_command"] = " ".join(plan_cmd[2:])
        path = os.environ.get("PYTHONPATH")  # this checkout first on the subprocesses' path
        env = dict(os.environ, PYTHONPATH=os.path.abspath(ROOT) + (os.pathsep + path if path else ""))
        if args.device == "cpu":
            env["CUDA_VISIBLE_DEVICES"] = ""
        rec["varlen_kernel_env"] = env.get("FITUNE_VARLEN_KERNEL")  # the opt-in kernel path for packed rows (issue 32)
        rec["trained_rows_env"] = env.get("FITUNE_TRAINED_ROWS")  # 0: the loss's head over every position
        proc = subprocess.run(plan_cmd, capture_output=True, text=True, env=env,
                              timeout=max(30, deadline - time.monotonic()))
        if proc.returncode != 0:
            raise RuntimeError(f"fitune plan exit {proc.returncode}: {_tail(proc)}")
        cfg = yaml.safe_load(open(plan_path))
        cfg.pop("epochs", None)
        cfg.update({"model": args.model_dir, "init": "pretrained", "tokenizer": args.model_dir,
                    "max_steps": args.steps, "output_dir": os.path.join(run, "out")})
        if args.cap and args.device == "cuda":
            cfg["cap"] = args.cap
        else:
            cfg.pop("cap", None)
        with open(plan_path, "w") as f:
            yaml.safe_dump(cfg, f)
        rec["micro_batch_size"], rec["grad_accum"] = int(cfg["batch_size"]), int(cfg.get("grad_accum", 1))
        rec["max_length"] = int(cfg["seq_len"])
        rec["setup"] = {k: cfg.get(k) for k in ("method", "seq_len", "batch_size", "grad_accum", "packing",
                                                "packing_attention", "grad_checkpointing", "attn", "optimizer",
                                                "loss", "kernels", "tiled_mlp", "lean_lora", "lean_norm",
                                                "expandable_segments", "compile")}
        t0 = time.perf_counter()
        probe = os.path.join(run, "grad_norm.json")  # the child's first-step trainable-gradient norm
        probed, _ = probed_fitune_cmd(probe)
        proc = subprocess.run(probed + ["train", plan_path, "--no-progress"], capture_output=True, text=True,
                              env={**env, PROBE_ENV: probe}, timeout=max(30, deadline - time.monotonic()))
        rec["train_s"] = round(time.perf_counter() - t0, 2)
        rec["exit"] = proc.returncode
        metrics = os.path.join(cfg["output_dir"], "metrics.jsonl")
        lines = [json.loads(x) for x in open(metrics)] if os.path.exists(metrics) else []
        rec["losses"] = [round(x["loss"], 4) for x in lines if "loss" in x][:64]
        rec["first_step_grad_norm"] = training_facts([], probe)["first_step_grad_norm"]
        lines = [x for x in lines if "step_time_s" in x]
        rebuilt = fitune_steps_from_stream(cfg, len(lines))
        rec["stream_matches_metrics"] = all(r["nonpad"] == m["tokens"] and r["trained"] == m["trained_tokens"]
                                            for r, m in zip(rebuilt, lines))
        tally.external = [{**r, "seconds": m["step_time_s"]} for r, m in zip(rebuilt, lines)]
        peaks = [m for m in lines if m.get("peak_allocated_bytes") is not None]
        if peaks:
            rec["peak_allocated_bytes"] = max(m["peak_allocated_bytes"] for m in peaks)
            rec["peak_reserved_bytes"] = max(m["peak_reserved_bytes"] for m in peaks)
        rec["oom_guard_replans"] = proc.stderr.count("fitune: out of memory at step")
        rec.update(fitune_estimate(fitune, plan_path, args.cap or "rtx4090", env))  # on the CPU, after the run
        if proc.returncode != 0:
            raise RuntimeError(f"fitune train exit {proc.returncode}: {_tail(proc)}")

    return body


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.stack == "fitune":
        run_varlen_case("fitune", args, fitune_body(args), in_process=False, loop="fitune train")
        return 0
    if args.stack == "unsloth_packing":  # as unsloth_run.py, before anything reads them
        for key in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", "UNSLOTH_DISABLE_STATISTICS"):
            os.environ.setdefault(key, "1")
    start_cuda(args)  # before any CUDA allocation of this process (imports torch, not transformers)
    body = {"hf_trainer": hf_trainer_body, "trl_packing": trl_packing_body,
            "unsloth_packing": unsloth_packing_body}[args.stack](args)
    run_varlen_case(args.stack, args, body, loop=LOOPS[args.stack], grad_checkpointing=args.grad_checkpointing,
                    liger=args.liger)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

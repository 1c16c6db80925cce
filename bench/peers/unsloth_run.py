"""Issue 14, peer stack "unsloth": Unsloth 2026.10.9's documented path on the shared model folder and data.

`from unsloth import FastLanguageModel` first (before transformers, peft, trl), `FastLanguageModel.from_pretrained(
folder, max_seq_length, dtype=bf16, load_in_4bit=False)`, `FastLanguageModel.get_peft_model(r=8, q_proj,v_proj,
alpha 16, dropout 0, use_gradient_checkpointing="unsloth" | False | True)`, then TRL's `SFTTrainer` + `SFTConfig` as
Unsloth's notebooks train (AdamW torch, bf16, lr 1e-4), on a pre-tokenized `datasets.Dataset` (column input_ids:
TRL skips tokenization, its collator makes the labels). One candidate per process (Unsloth patches transformers
globally); one JSON line appended to --out; any failure (the import included) is a line with `error`.

Issue 32, Unsloth at its strongest: `--loop plain` drives the same Unsloth model with a plain PyTorch loop instead of
the SFTTrainer (bench/peers/hf_loop.py's loop and clock: `FastLanguageModel.for_training(model)`, which Unsloth's own
trainers call at `train()`, then fused `torch.optim.AdamW` over the trainable parameters, lr 1e-4, `grad_accum`
micro-batches of `model(input_ids=ids, labels=ids).loss / grad_accum` backward, step, zero_grad; no autocast, no
clipping). `--qlora` loads the base in 4-bit NF4 (`load_in_4bit=True`); `--lora-rank N` (alpha 2 N) and
`--lora-targets q_proj,v_proj | all-linear` (q, k, v, o, gate, up, down) set the adapters.

With a cap on CUDA, `torch.cuda.mem_get_info` and `get_device_properties().total_memory` report the capped card
(peerlib.simulate_card_view): Unsloth sizes buffers from them. --no-card-view keeps the H200's answers.

    export HF_HUB_OFFLINE=1 UNSLOTH_DISABLE_STATISTICS=1
    PYTHONPATH=.:.peers_site python3 bench/peers/unsloth_run.py --model-dir DIR --out peers.jsonl
    PYTHONPATH=.:.peers_site python3 bench/peers/unsloth_run.py --model-dir DIR --out peers.jsonl --loop plain \\
        --grad-checkpointing none --micro-batch 1 --grad-accum 2 [--qlora --lora-rank 16 --lora-targets all-linear]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("UNSLOTH_DISABLE_STATISTICS", "1")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from bench.peers.peerlib import (load_rows, parser, plain_loop, reset_peaks, run_case,  # noqa: E402
                                 simulate_card_view, start_cuda, trainer_callback)

GC = {"unsloth": "unsloth", "none": False, "true": True}
LOOPS = {"sfttrainer": "SFTTrainer", "plain": "plain PyTorch loop"}
"""--loop: the record's `loop`."""
ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""`--lora-targets all-linear`: every linear layer of a Llama decoder layer (not lm_head)."""
PATCHED = ("transformers", "peft", "trl")
"""What Unsloth patches: none of them may be imported before it (the record's `imported_before_unsloth`)."""


def lora_targets(text: str) -> list[str]:
    """`all-linear`, or a comma-separated list of ALL_LINEAR's names (in the order given)."""
    names = [x.strip() for x in text.split(",") if x.strip()]
    if names == ["all-linear"]:
        return list(ALL_LINEAR)
    unknown = [x for x in names if x not in ALL_LINEAR]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"--lora-targets: 'all-linear' or a list of {', '.join(ALL_LINEAR)}; "
                                         f"not {text!r}")
    return names


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, not {text}")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser(__doc__, ckpt_choices=tuple(GC))
    p.add_argument("--no-card-view", action="store_true",
                   help="leave torch.cuda.mem_get_info / total_memory as the H200 reports them")
    p.add_argument("--loop", default="sfttrainer", choices=tuple(LOOPS),
                   help="sfttrainer: TRL's SFTTrainer as Unsloth patches it (the notebooks' path); plain: a plain "
                        "PyTorch loop on Unsloth's model")
    p.add_argument("--qlora", action="store_true", help="4-bit NF4 base weights (load_in_4bit=True)")
    p.add_argument("--lora-rank", type=positive_int, default=8, help="LoRA rank (alpha: twice the rank)")
    p.add_argument("--lora-targets", type=lora_targets, default=lora_targets("q_proj,v_proj"),
                   help="'all-linear' (q, k, v, o, gate, up, down) or a comma-separated list (default q_proj,v_proj)")
    p.add_argument("--case", help="the call's name for this case, kept in the record")
    return p.parse_args(argv)


def lora_config(args) -> dict:
    """The adapters' settings (the record's `lora`): alpha twice the rank, as 16 for the seeds' r8."""
    return {"r": args.lora_rank, "alpha": 2 * args.lora_rank, "dropout": 0.0, "targets": list(args.lora_targets)}


def load_unsloth(args, rec: dict):
    """Unsloth imported first, the model loaded and its adapters added as its docs do. Returns
    (FastLanguageModel, model, tokenizer, rows, use_gradient_checkpointing, t0)."""
    if args.device == "cuda" and not args.no_card_view:
        rec["card_view"] = simulate_card_view(args.cap)
    rec["imported_before_unsloth"] = [m for m in PATCHED if m in sys.modules]
    from unsloth import FastLanguageModel  # first: it patches transformers, peft and trl

    import torch

    t0 = time.perf_counter()
    rows = load_rows(args.model_dir)
    seq = int(rows.shape[1])
    gc = GC[args.grad_checkpointing]
    lora = lora_config(args)
    model, tokenizer = FastLanguageModel.from_pretrained(
        model_name=args.model_dir, max_seq_length=seq, dtype=torch.bfloat16, load_in_4bit=args.qlora,
        use_gradient_checkpointing=gc)  # from_pretrained applies (or undoes) Unsloth's checkpointing patch too
    model = FastLanguageModel.get_peft_model(
        model, r=lora["r"], target_modules=lora["targets"], lora_alpha=lora["alpha"], lora_dropout=0, bias="none",
        use_gradient_checkpointing=gc, random_state=0)
    return FastLanguageModel, model, tokenizer, rows, gc, t0


def setup_notes(model, gc) -> dict:
    """What Unsloth made of the setup (notes only): its checkpointing mode, where the embedding lives, the class of
    the first adapted layer's base (bitsandbytes' Linear4bit under --qlora)."""
    base = next((type(m.base_layer).__name__ for n, m in model.named_modules() if hasattr(m, "base_layer")), None)
    return {"use_gradient_checkpointing": repr(gc),
            "model_gradient_checkpointing": repr(getattr(model, "_unsloth_gradient_checkpointing", None)),
            "embedding_device": str(model.get_input_embeddings().weight.device), "adapted_base_class": base}


def sfttrainer_body(args, rec, clock) -> None:
    FastLanguageModel, model, tokenizer, rows, gc, t0 = load_unsloth(args, rec)
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    seq = int(rows.shape[1])
    dataset = Dataset.from_dict({"input_ids": rows.tolist()})
    # TRL's configs default gradient_checkpointing to True; Unsloth's patched trainer turns that default off
    # for a model loaded with False, plain TRL does not: say it for "none" (the notebooks leave it unset)
    off = {"gradient_checkpointing": False} if gc is False else {}
    config = SFTConfig(
        **off, output_dir=os.path.join(tempfile.gettempdir(), "peers_unsloth_out"),
        per_device_train_batch_size=args.micro_batch, gradient_accumulation_steps=args.grad_accum,
        max_steps=args.steps, learning_rate=1e-4, optim="adamw_torch", bf16=True, logging_steps=1,
        report_to=[], save_strategy="no", max_length=seq, packing=False, dataset_num_proc=1, seed=0)
    trainer = SFTTrainer(model=model, processing_class=tokenizer, train_dataset=dataset, args=config,
                         callbacks=[trainer_callback(clock)])
    rec["load_s"] = round(time.perf_counter() - t0, 2)
    rec["trainable_params"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
    try:  # what Unsloth made of the setup (notes only)
        targs = trainer.args
        rec["unsloth_setup"] = {
            **setup_notes(model, gc), "args_gradient_checkpointing": getattr(targs, "gradient_checkpointing", None),
            "padding_free": getattr(targs, "padding_free", None), "packing": getattr(targs, "packing", None),
            "trainer_class": f"{type(trainer).__module__}.{type(trainer).__name__}",
            "train_rows": len(trainer.train_dataset)}
    except Exception as e:  # noqa: BLE001
        rec["unsloth_setup_error"] = repr(e)[:300]
    rec["_retries0"] = reset_peaks(args.device)
    trainer.train()


def plain_body(args, rec, clock) -> None:
    FastLanguageModel, model, _tokenizer, rows, gc, t0 = load_unsloth(args, rec)
    # Unsloth's trainers call `model.for_training(use_gradient_checkpointing=<the mode given at setup>)` when
    # train() starts (unsloth/models/rl.py prepare_for_training_mode); a custom loop calls it itself: train mode,
    # the checkpointing mode recorded by get_peft_model (None: keep it), the KV cache off (llama.py for_training)
    FastLanguageModel.for_training(model)
    rec["load_s"] = round(time.perf_counter() - t0, 2)
    rec["trainable_params"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
    try:
        rec["unsloth_setup"] = {**setup_notes(model, gc), "training": model.training}
    except Exception as e:  # noqa: BLE001
        rec["unsloth_setup_error"] = repr(e)[:300]
    unsloth_plain_loop(args, rec, clock, model, rows)


def unsloth_plain_loop(args, rec, clock, model, rows) -> None:
    """peerlib.plain_loop (bench/peers/hf_loop.py's loop and clock) on Unsloth's model, with fused AdamW."""
    import torch

    # Fused AdamW on CUDA: what a user after speed picks (PyTorch's docs name the fused implementation the fastest;
    # one kernel for every adapter instead of foreach's per-op launches). The difference is small here (a few
    # million to 42 million fp32 adapter parameters), but it is the strongest choice. The CPU keeps the default.
    fused = args.device == "cuda"
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4,
                            **({"fused": True} if fused else {}))
    rec["optim"] = "adamw_torch_fused" if fused else "adamw_torch"
    rec["_retries0"] = reset_peaks(args.device)
    plain_loop(model, opt, rows, args, clock)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start_cuda(args)
    body = plain_body if args.loop == "plain" else sfttrainer_body
    extra = {"case": args.case} if args.case else {}
    run_case("unsloth", args, lambda rec, clock: body(args, rec, clock), loop=LOOPS[args.loop],
             method="qlora" if args.qlora else "lora", lora=lora_config(args), **extra)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

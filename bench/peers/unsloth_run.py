"""Issue 14, peer stack "unsloth": Unsloth 2026.10.9's documented path on the shared model folder and data.

`from unsloth import FastLanguageModel` first (before transformers, peft, trl), `FastLanguageModel.from_pretrained(
folder, max_seq_length, dtype=bf16, load_in_4bit=False)`, `FastLanguageModel.get_peft_model(r=8, q_proj,v_proj,
alpha 16, dropout 0, use_gradient_checkpointing="unsloth" | False | True)`, then TRL's `SFTTrainer` + `SFTConfig` as
Unsloth's notebooks train (AdamW torch, bf16, lr 1e-4), on a pre-tokenized `datasets.Dataset` (column input_ids:
TRL skips tokenization, its collator makes the labels). One candidate per process (Unsloth patches transformers
globally); one JSON line appended to --out; any failure (the import included) is a line with `error`.

With a cap on CUDA, `torch.cuda.mem_get_info` and `get_device_properties().total_memory` report the capped card
(peerlib.simulate_card_view): Unsloth sizes buffers from them. --no-card-view keeps the H200's answers.

    export HF_HUB_OFFLINE=1 UNSLOTH_DISABLE_STATISTICS=1
    PYTHONPATH=.:.peers_site python3 bench/peers/unsloth_run.py --model-dir DIR --out peers.jsonl
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("UNSLOTH_DISABLE_STATISTICS", "1")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from bench.peers.peerlib import (load_rows, parser, reset_peaks, run_case, simulate_card_view,  # noqa: E402
                                 start_cuda, trainer_callback)

GC = {"unsloth": "unsloth", "none": False, "true": True}


def main() -> int:
    p = parser(__doc__, ckpt_choices=tuple(GC))
    p.add_argument("--no-card-view", action="store_true",
                   help="leave torch.cuda.mem_get_info / total_memory as the H200 reports them")
    args = p.parse_args()
    start_cuda(args)

    def body(rec, clock):
        if args.device == "cuda" and not args.no_card_view:
            rec["card_view"] = simulate_card_view(args.cap)
        from unsloth import FastLanguageModel  # first: it patches transformers, peft and trl

        import torch
        from datasets import Dataset
        from trl import SFTConfig, SFTTrainer

        t0 = time.perf_counter()
        rows = load_rows(args.model_dir)
        seq = int(rows.shape[1])
        gc = GC[args.grad_checkpointing]
        model, tokenizer = FastLanguageModel.from_pretrained(
            model_name=args.model_dir, max_seq_length=seq, dtype=torch.bfloat16, load_in_4bit=False,
            use_gradient_checkpointing=gc)  # from_pretrained applies (or undoes) Unsloth's checkpointing patch too
        model = FastLanguageModel.get_peft_model(
            model, r=8, target_modules=["q_proj", "v_proj"], lora_alpha=16, lora_dropout=0, bias="none",
            use_gradient_checkpointing=gc, random_state=0)
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
                "use_gradient_checkpointing": repr(gc),
                "model_gradient_checkpointing": repr(getattr(model, "_unsloth_gradient_checkpointing", None)),
                "args_gradient_checkpointing": getattr(targs, "gradient_checkpointing", None),
                "padding_free": getattr(targs, "padding_free", None), "packing": getattr(targs, "packing", None),
                "embedding_device": str(model.get_input_embeddings().weight.device),
                "trainer_class": f"{type(trainer).__module__}.{type(trainer).__name__}",
                "train_rows": len(trainer.train_dataset)}
        except Exception as e:  # noqa: BLE001
            rec["unsloth_setup_error"] = repr(e)[:300]
        rec["_retries0"] = reset_peaks(args.device)
        trainer.train()

    run_case("unsloth", args, body, loop="SFTTrainer")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

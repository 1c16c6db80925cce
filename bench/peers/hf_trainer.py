"""Issue 14, peer stack "hf_trainer": what the seed users run. transformers `AutoModelForCausalLM.from_pretrained`
(bf16, sdpa), PEFT LoRA r8 alpha 16 dropout 0 on q_proj,v_proj, the `Trainer` (AdamW torch, bf16, transformers'
checkpointing, optionally `use_liger_kernel`), on the shared data of bench/peers/make_model.py. One candidate per
process; one JSON line appended to --out (fits, median tokens/s over steps 3 and later, CUDA peaks, retries).

    PYTHONPATH=. python3 bench/peers/hf_trainer.py --model-dir DIR --out peers.jsonl --grad-checkpointing full
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from bench.peers.peerlib import hf_args, load_rows, reset_peaks, run_case, trainer_callback  # noqa: E402


class RowsDataset:
    """A torch-style dataset of {input_ids, labels, attention_mask} rows (labels = inputs)."""

    def __init__(self, rows):
        import torch

        self.rows = rows
        self.mask = torch.ones_like(rows[0])

    def __len__(self):
        return self.rows.shape[0]

    def __getitem__(self, i):
        ids = self.rows[i]
        return {"input_ids": ids, "labels": ids.clone(), "attention_mask": self.mask}


def main() -> int:
    args = hf_args(__doc__, "TrainingArguments(use_liger_kernel=True)")

    def body(rec, clock):
        import torch
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

        t0 = time.perf_counter()
        kwargs = {"dtype": torch.bfloat16, "attn_implementation": "sdpa"}
        if args.device == "cuda":
            kwargs["device_map"] = {"": 0}  # straight onto the GPU (the Trainer would move it there anyway)
        model = AutoModelForCausalLM.from_pretrained(args.model_dir, **kwargs)
        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                                 target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
        ckpt = args.grad_checkpointing == "full"
        targs = TrainingArguments(
            output_dir=os.path.join(tempfile.gettempdir(), "peers_hf_trainer_out"),
            bf16=True, gradient_checkpointing=ckpt,
            gradient_checkpointing_kwargs={"use_reentrant": False} if ckpt else None,
            per_device_train_batch_size=args.micro_batch, gradient_accumulation_steps=args.grad_accum,
            max_steps=args.steps, learning_rate=1e-4, optim="adamw_torch", logging_steps=1, report_to=[],
            save_strategy="no", use_liger_kernel=args.liger, dataloader_num_workers=0,
            remove_unused_columns=False, use_cpu=args.device == "cpu", seed=0)
        trainer = Trainer(model=model, args=targs, train_dataset=RowsDataset(load_rows(args.model_dir)),
                          callbacks=[trainer_callback(clock)])
        rec["load_s"] = round(time.perf_counter() - t0, 2)
        rec["trainable_params"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
        rec["_retries0"] = reset_peaks(args.device)
        trainer.train()

    run_case("hf_trainer_liger" if args.liger else "hf_trainer", args, body, liger=args.liger, loop="Trainer")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

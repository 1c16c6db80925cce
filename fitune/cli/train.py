"""`fitune train CONFIG.yaml`: fine-tune with fitune's own runner."""

from __future__ import annotations

import argparse
import logging

from ..errors import ConfigError

DESCRIPTION = """\
Fine-tune a causal LM (LoRA, QLoRA, full or freeze) with fitune's runner: transformers + PEFT + bitsandbytes,
one readable loop, metrics.jsonl, atomic resumable checkpoints, and an out-of-memory guard that re-plans the
step (smaller micro-batches with more accumulation, then checkpointing) and retries it with the same data.

The config is YAML (see the README, "fitune train"); flags override its keys:
  fitune train run.yaml --max-steps 200 --set lora.rank=16 --set data.eval_path=eval.jsonl

Outputs in output_dir: metrics.jsonl (one line per step), checkpoints/step-N/ (resumable), adapter/ (a PEFT
folder: PeftModel.from_pretrained(base, path)), merged/ with --merge. Ctrl-C writes a checkpoint; --resume
continues from the newest complete one and reproduces the losses of an uninterrupted run.
"""


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("train", help="fine-tune with fitune's runner", description=DESCRIPTION,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", metavar="CONFIG.yaml", help="the training config")
    p.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint")
    p.add_argument("--merge", action="store_true", help="also write the base weights with the adapter merged")
    p.add_argument("--max-steps", type=int, help="override max_steps")
    p.add_argument("--lr", type=float, help="override lr")
    p.add_argument("--output-dir", help="override output_dir")
    p.add_argument("--cap", metavar="GPU|NGiB", help="limit PyTorch's allocator to this budget (rehearse a smaller card)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override any key (dotted for nested: lora.rank=16, data.path=x.jsonl); values are YAML")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (metrics.jsonl is still written)")
    p.set_defaults(run=run)
    return p


def parse_overrides(args) -> dict:
    import yaml

    out = {}
    for item in args.set:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: write KEY=VALUE, e.g. --set lora.rank=16")
        key, value = item.split("=", 1)
        out[key.strip()] = yaml.safe_load(value)
    if args.max_steps is not None:
        out["max_steps"] = args.max_steps
        out.setdefault("epochs", None)
    if args.lr is not None:
        out["lr"] = args.lr
    if args.output_dir:
        out["output_dir"] = args.output_dir
    if args.merge:
        out["merge"] = True
    if args.cap:
        out["cap"] = args.cap
    return out


def run(args) -> int:
    from ..setup import load_config_file
    from ..train.config import config_from_dict

    doc = load_config_file(args.config)
    overrides = parse_overrides(args)
    if "max_steps" in overrides and isinstance(doc, dict):
        doc.pop("epochs", None)
    cfg = config_from_dict(doc, args.config, overrides)
    try:
        import torch  # noqa: F401
    except ImportError as exc:
        raise ConfigError("fitune train needs torch, transformers and peft (pip install 'fitune[torch]')") from exc
    from ..train.loop import train

    logging.getLogger("fitune").setLevel(logging.INFO)
    result = train(cfg, resume=args.resume, progress=not args.no_progress)
    last = f"{result.losses[-1]:.4f}" if result.losses else "n/a"
    print(f"trained {result.steps} steps; last loss {last}; outputs in {result.output_dir}"
          + (f" (adapter: {result.adapter_dir})" if result.adapter_dir else ""))
    for change in result.plan.changes:
        print(f"  re-planned at step {change['step']}: {change['why']}")
    return 0

"""`fitune train [CONFIG.yaml]`: fine-tune with fitune's own runner (the flags alone make a config too)."""

from __future__ import annotations

import argparse
import logging
import os
import re

from ..config import ALL_KEYS, TrainConfig, config_from_dict, flat_values, train_values_from_args
from ..errors import ConfigError
from ..report import add_html_argument, maybe_write_html
from ..schema import add_arguments, load_config_file, parse_yaml_value
from .common import check_output_file

DESCRIPTION = """\
Fine-tune a causal LM (LoRA, QLoRA, full or freeze) with fitune's runner: transformers + PEFT + bitsandbytes,
one readable loop, metrics.jsonl, atomic resumable checkpoints, and an out-of-memory guard that re-plans the
step (smaller micro-batches with more accumulation, then checkpointing) and retries it with the same data.

The config is YAML (see docs/reference.md, "fitune train"); flags override its keys:
  fitune train run.yaml --max-steps 200 --set lora.rank=16 --set data.eval_path=eval.jsonl
Every key has a flag, so the file is optional; without one, the flags are the whole config:
  fitune train --model ./my-model --data train.jsonl --method qlora --max-steps 200 --output-dir runs/x
Another trainer's config (Axolotl, HF Trainer / TRL, torchtune) becomes a fitune config with:
  fitune train axolotl.yml --translate > run.yaml

Outputs in output_dir: metrics.jsonl (one line per step), checkpoints/step-N/ (resumable), adapter/ (a PEFT
folder: PeftModel.from_pretrained(base, path)), merged/ with --merge. One run per output_dir: a used one is
refused unless --resume (continue it) or --overwrite (move it aside). Checkpoints are written every save_every
steps, every save_every_minutes (default 30) and at the end. Ctrl-C writes a checkpoint; --resume continues
from the newest complete one, reproduces the losses of an uninterrupted run, and applies (lr, max_steps, ...) or
refuses (lora.rank, batch_size, ...) each config change by name.

Several GPUs (one machine): --gpus N starts N processes with torchrun, one per GPU, each running the same loop on
its slice of every batch (the global batch is batch_size x grad_accum x gpus); rank 0 writes the outputs.
--strategy picks the engine: ddp (DistributedDataParallel, a whole copy per GPU: LoRA, QLoRA), fsdp (PyTorch
FSDP2, sharded per decoder layer: LoRA, full), zero2 / zero3 / zero3_offload (DeepSpeed ZeRO; pip install
deepspeed). FSDP2 checkpoints are sharded and resume on another number of GPUs:
  fitune train run.yaml --gpus 4 --strategy fsdp
  fitune train run.yaml --gpus 2 --resume          (continues the 4-GPU run's checkpoint on 2 GPUs)
Without CUDA, FITUNE_CPU_RANKS=1 rehearses the run as N CPU processes (gloo).
"""


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("train", help="fine-tune with fitune's runner", description=DESCRIPTION,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", metavar="CONFIG.yaml", nargs="?", default=None,
                   help="the training config (optional: without it the flags give every key)")
    p.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint")
    p.add_argument("--overwrite", action="store_true",
                   help="output_dir holds another run: move it to output_dir.old-<time> and start fresh")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override any key (dotted for nested: lora.rank=16, data.path=x.jsonl); values are YAML")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (metrics.jsonl is still written)")
    p.add_argument("--allow-changed", action="store_true",
                   help="with --resume: continue even if the base model's weights or the training data changed since "
                        "the run started (said when it happens)")
    p.add_argument("--translate", action="store_true",
                   help="CONFIG is another trainer's (Axolotl, HF Trainer / TRL, PEFT, torchtune): print it as a fitune "
                        "config, with what could not be carried over as comments, and exit (> run.yaml to keep it)")
    # One flag per config key (fitune/config.py, fitune/setup.py): --lr, --max-steps, --lora-rank, --grad-accum, ...
    add_arguments(p, ALL_KEYS, defaults=flat_values(TrainConfig()),
                  group_title="config keys (each overrides the file's value; same names as the YAML keys)")
    add_html_argument(p)
    p.set_defaults(run=run)
    return p


def parse_overrides(args) -> dict:
    """The `--set KEY=VALUE` pairs as {dotted key: YAML value}."""
    out = {}
    for item in args.set:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: write KEY=VALUE, e.g. --set lora.rank=16")
        key, value = item.split("=", 1)
        if key.strip() == "trust_remote_code" and value.strip() not in ("true", "false"):
            raise ConfigError(f"--set trust_remote_code={value.strip()!r}: only the literal true runs a model folder's "
                              "own code; write --set trust_remote_code=true (or --trust-remote-code)")
        out[key.strip()] = parse_yaml_value(value, f"--set {item}")
    return out


def run(args) -> int:
    if args.html is not None:
        check_output_file(args.html, "--html", make_parents=True)
    if args.config is None:
        if args.translate:
            raise ConfigError("--translate needs the other trainer's config file: fitune train axolotl.yml "
                              "--translate > run.yaml")
        cfg = _config_from_flags(args)
    else:
        doc = load_config_file(args.config)
        if args.translate:
            # the command's library: imported when it runs, so that `fitune --help` stays light
            from ..translate import translated_yaml

            if not isinstance(doc, dict):
                raise ConfigError(f"{args.config}: expected a mapping of keys to translate")
            print(translated_yaml(doc, args.config), end="")
            return 0
        try:
            cfg = config_from_dict(doc, args.config, parse_overrides(args), train_values_from_args(args))
        except ConfigError as exc:
            from ..translate import foreign_config_error

            pointed = foreign_config_error(exc, args.config, doc)
            if pointed is None:
                raise
            raise pointed from None
    from ..train.preflight import preflight_problems

    problems = preflight_problems(cfg)  # everything that needs no model, said before anything loads
    if problems:
        raise ConfigError(problems)
    try:
        # torch, transformers, datasets: optional, imported where used
        import torch  # noqa: F401
    except ImportError as exc:
        raise ConfigError("fitune train needs torch, transformers and peft (pip install 'fitune[torch]')") from exc
    from ..parallel.launch import launch, needs_launch
    if needs_launch(cfg.setup):  # several GPUs or DeepSpeed: torchrun starts one rank per GPU (fitune/parallel)
        code = launch(cfg, resume=args.resume, overwrite=args.overwrite, progress=not args.no_progress,
                      allow_changed=args.allow_changed)
        if code == 0:
            maybe_write_html(args, "train", cfg.output_dir)
        return code
    from ..train.loop import train

    if args.no_progress:
        _quiet_library_progress_bars()
    rank0 = os.environ.get("RANK", "0") == "0"  # one of several ranks (fitune/parallel/launch.py): rank 0 reports
    if rank0:
        logging.getLogger("fitune").setLevel(logging.INFO)
    result = train(cfg, resume=args.resume, progress=not args.no_progress, overwrite=args.overwrite,
                   allow_changed=args.allow_changed)
    if not rank0:
        return 0
    print_result(result)
    maybe_write_html(args, "train", result.output_dir)
    return 0


def _config_from_flags(args):
    """No CONFIG.yaml: the run from its flags (and --set) alone. A problem names the flag to give (`--model
    missing`), not a YAML key of a file that does not exist; a key given with --set keeps its dotted name."""
    overrides = parse_overrides(args)
    try:
        return config_from_dict({}, "the command line", overrides, train_values_from_args(args))
    except ConfigError as exc:
        flags = {k.yaml: k.flag for k in ALL_KEYS if k.yaml not in overrides}
        names = "|".join(re.escape(y) for y in sorted(flags, key=len, reverse=True))
        as_flag = re.compile(rf"(?<![\w.-])({names}):")  # `model:` and `/ epochs:`, not `data.path:` inside a path
        raise ConfigError([as_flag.sub(lambda m: flags[m.group(1)], p) for p in exc.problems]) from None


def _quiet_library_progress_bars() -> None:
    """--no-progress means no bar at all: transformers draws its own while loading weights ("Loading weights"),
    datasets while mapping."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        import datasets
    except ImportError:
        return
    datasets.disable_progress_bars()


def print_result(result) -> None:
    """The run's summary line (and its re-plans) on stdout."""
    last = f"{result.losses[-1]:.4f}" if result.losses else "n/a"
    print(f"trained {result.steps} steps; last loss {last}; outputs in {result.output_dir}"
          + (f" (adapter: {result.adapter_dir})" if result.adapter_dir else ""))
    for change in result.plan.changes:
        print(f"  re-planned at step {change['step']}: {change['why']}")

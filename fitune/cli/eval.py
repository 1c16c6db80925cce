"""`fitune eval RUN_DIR --data eval.jsonl`: loss and perplexity with the labels fitune train uses."""

from __future__ import annotations

import argparse
import json
import sys

from ..data import FORMATS
from ..data.read import read_records
from ..errors import ConfigError
from . import generate as generate_cli
from .generate import add_load_arguments

DESCRIPTION = """\
Evaluate a trained model (or any model folder) on a data file: the mean loss over the tokens training scores
(the same encoder as fitune train: chat scores the assistant turns, completion the completion, text all of it;
records cut at --seq-len as in training) and the perplexity, exp(loss). Batches are padded, never packed; the loss
is the sum over tokens divided by their number, so --batch-size does not change it.

RUN_DIR: the output_dir of `fitune train` (its adapter/ over the base model the run names, or merged/ / model/),
a Hugging Face model folder (evaluate the base model before training, for comparison), or a PEFT adapter folder.

It also prints the lm-evaluation-harness command for standard benchmarks on the same weights.

examples:
  fitune eval runs/x --data eval.jsonl
  fitune eval models/base --data eval.jsonl --seq-len 2048 --json
"""


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("eval", help="loss and perplexity of a trained model on a data file",
                              description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_load_arguments(p)
    p.add_argument("--data", required=True, metavar="FILE", help="records as fitune train reads them (.jsonl, .json, "
                   ".parquet, a dataset folder)")
    p.add_argument("--format", choices=FORMATS, help="the records' format (default: the run's data.format, else "
                   "detected)")
    p.add_argument("--seq-len", type=int, metavar="N", help="tokens per record, longer ones cut (default: the run's "
                   "seq_len; 2048 for a model folder)")
    p.add_argument("--batch-size", type=int, default=8, metavar="N", help="records per forward pass (default 8)")
    p.add_argument("--json", action="store_true", help="one JSON line (stable keys) instead of text")
    p.set_defaults(run=run)
    return p


def run(args) -> int:
    # the command's library: imported when it runs, so that `fitune --help` stays light
    from ..infer.evaluate import DEFAULT_SEQ_LEN_TOKENS, evaluate, lm_eval_command
    from .progress import progress_callback

    if args.batch_size < 1:
        raise ConfigError(f"--batch-size {args.batch_size}: give at least 1")
    if args.seq_len is not None and args.seq_len < 2:
        raise ConfigError(f"--seq-len {args.seq_len}: give at least 2 tokens (typical: 512-4096)")
    read_records(args.data)  # a missing or unreadable data file is said before the model loads (seconds to minutes)
    model, tokenizer, info = generate_cli.load_from_args(args)  # looked up when called: tests replace it
    seq_len = args.seq_len or info.seq_len_tokens or DEFAULT_SEQ_LEN_TOKENS
    with progress_callback("eval", "batch", enabled=not args.json) as progress:
        result = evaluate(model, tokenizer, args.data, seq_len_tokens=seq_len,
                          data_format=args.format or info.data_format, batch_size=args.batch_size,
                          progress=progress)
    command = lm_eval_command(info)
    if args.json:
        doc = result.to_dict() | {"model": info.weights_dir, "weights": info.weights, "base_model": info.base_model,
                                  "dtype": info.dtype, "lm_eval": command}
        print(json.dumps(doc))
        return 0
    seq_from = "--seq-len" if args.seq_len else ("the run's seq_len" if info.seq_len_tokens else "default")
    print(f"model: {info.describe()}")
    print(f"data: {result.data}: {result.examples} examples (format {result.data_format}), {result.tokens:,} tokens, "
          f"{result.trained_tokens:,} scored; {result.truncated} cut at {seq_len} tokens ({seq_from})"
          + (f"; {result.dropped} with nothing to score left out" if result.dropped else ""))
    print(f"loss {result.loss:.4f} (mean over {result.trained_tokens:,} scored tokens), perplexity "
          f"{result.perplexity:.3f}")
    print("standard benchmarks on the same weights (lm-evaluation-harness: pip install 'lm_eval[hf]'):")
    print(f"  {command}")
    sys.stdout.flush()
    return 0

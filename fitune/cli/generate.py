"""`fitune generate RUN_DIR --prompt TEXT | --prompts FILE.jsonl`: responses of a trained model as JSON lines.

Also the options every inference command shares (`add_load_arguments`, `load_from_args`): chat, generate and
eval take the same RUN_DIR, --merged / --adapter, --checkpoint, --device and --dtype."""

from __future__ import annotations

import argparse
import json
import sys

from ..data.convert import ShapeProblem, alpaca_prompt
from ..errors import ConfigError, DataError
from ..files import UnsafeFileError, open_output_stream, read_text_regular
from ..infer.generate import GenerationSettings, has_chat_template, iter_generate
from .common import check_output_file

DESCRIPTION = """\
Generate responses with a trained model, one JSON line per prompt on stdout (or --out FILE):
  {"prompt": "...", "response": "...", "new_tokens": 17, "finished": true}
finished: the model ended the response itself (false: cut at --max-new-tokens); new_tokens counts the stop token.

RUN_DIR: the output_dir of `fitune train` (its adapter/ over the base model the run names, or merged/ / model/),
a Hugging Face model folder, or a PEFT adapter folder.

Prompts: --prompt TEXT (one), or --prompts FILE.jsonl, one object a line: {"prompt": "..."},
{"messages": [{"role": "user", "content": "..."}, ...]}, or an alpaca row {"instruction", "input"?, "system"?}
(its "output", if there, is left out: a held-out part of the training file works as it is). A prompt string is sent
as one user message through the tokenizer's chat template (as fitune train's chat format renders it); --raw sends it
as plain text instead. An alpaca row is rendered as fitune train renders its prompt: through the chat template, or
as the Alpaca prompt text where the tokenizer has none (or with --raw).
Prompts are generated --batch-size at a time (left padding). Greedy by default (--temperature 0): the same
tokens as generating each prompt alone.

examples:
  fitune generate runs/x --prompt "What is LoRA?"
  fitune generate runs/x --prompts eval_prompts.jsonl --out answers.jsonl --max-new-tokens 512
"""


def add_load_arguments(p: argparse.ArgumentParser) -> None:
    """RUN_DIR and how to load it (shared by chat, generate and eval)."""
    p.add_argument("run_dir", metavar="RUN_DIR", help="a fitune train output_dir, a model folder or a PEFT adapter "
                   "folder")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--merged", dest="merged", action="store_const", const=True, default=None,
                       help="load the run's merged/ weights (merge: true) instead of its adapter")
    which.add_argument("--adapter", dest="merged", action="store_const", const=False,
                       help="load the adapter over the base model (the default when the run has one)")
    which.add_argument("--checkpoint", metavar="DIR", help="load a checkpoint of the run (checkpoints/step-N, or "
                       "step-N): a run that is still going or was interrupted")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="where the model runs (default: auto, CUDA when there is a GPU)")
    p.add_argument("--dtype", metavar="bf16|fp16|fp32", help="the weights' dtype (default: the run's)")


def load_from_args(args):
    """(model, tokenizer, RunInfo) for the shared options; notes about what was loaded go to stderr."""
    try:
        # torch: optional, imported where used (estimate, plan and doctor SCRIPT never load it)
        import torch  # noqa: F401
    except ImportError as exc:
        raise ConfigError(f"fitune {args.command} needs torch, transformers and peft (pip install "
                          "'fitune[torch]')") from exc
    # the command's library: imported when it runs, so that `fitune --help` stays light
    from ..infer.load import load_run
    from ..runtime.device import pick_device

    device = pick_device() if args.device == "auto" else args.device
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("--device cuda: no CUDA GPU is visible here; use --device cpu (or auto)")
    merged = getattr(args, "merged", None)
    model, tokenizer, info = load_run(args.run_dir, merged=merged, device=device, dtype=args.dtype,
                                      checkpoint=getattr(args, "checkpoint", None))
    for note in info.notes:
        print(f"fitune {args.command}: note: {note}", file=sys.stderr)
    return model, tokenizer, info


def add_sampling_arguments(p: argparse.ArgumentParser, max_new_tokens: int) -> None:
    default = GenerationSettings()
    p.add_argument("--max-new-tokens", type=int, default=max_new_tokens, metavar="N",
                   help=f"the most tokens per response (default {max_new_tokens})")
    p.add_argument("--temperature", type=float, default=default.temperature, metavar="T",
                   help="0 = greedy, the default; above 0 samples (0.7 is common)")
    p.add_argument("--top-p", type=float, default=default.top_p, metavar="P",
                   help="sampling: keep the likeliest tokens up to this probability mass (default 1: all)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling (default 0)")


def settings_from_args(args):
    return GenerationSettings(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                              top_p=args.top_p).validate()


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("generate", help="generate responses with a trained model (JSON lines)",
                              description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_load_arguments(p)
    prompts = p.add_mutually_exclusive_group(required=True)
    prompts.add_argument("--prompt", metavar="TEXT", help="one prompt")
    prompts.add_argument("--prompts", metavar="FILE.jsonl", help='prompts, one {"prompt": ...}, {"messages": '
                         '[...]} or alpaca {"instruction": ..., "input": ...} a line')
    p.add_argument("--raw", action="store_true", help="send prompt strings as plain text, not through the chat "
                   "template")
    add_sampling_arguments(p, max_new_tokens=256)
    p.add_argument("--batch-size", type=int, default=8, metavar="N", help="prompts generated together (default 8)")
    p.add_argument("--out", metavar="FILE.jsonl", help="write the JSON lines here instead of stdout")
    p.set_defaults(run=run)
    return p


def read_prompts(path: str) -> list:
    """The prompts of a JSONL file: strings ({"prompt"}), message lists ({"messages"}) and alpaca rows (as dicts,
    rendered by `resolve_prompts` once the tokenizer is loaded).

    Raises:
        DataError: a missing file, a line that is not such an object (every bad line named), no prompt at all.
    """
    try:
        lines = read_text_regular(path, what="--prompts").splitlines()  # a FIFO or device: refused, never waited on
    except FileNotFoundError:
        raise DataError(f"--prompts {path} does not exist", path=path) from None
    except UnicodeDecodeError as exc:
        raise DataError(f"--prompts {path} is not UTF-8 text ({exc.reason} at byte {exc.start})", path=path) from None
    prompts, bad = [], []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as exc:
            bad.append(f"line {number}: not JSON ({exc.msg})")
            continue
        if isinstance(record, dict) and isinstance(record.get("prompt"), str):
            prompts.append(record["prompt"])
        elif isinstance(record, dict) and _is_messages(record.get("messages")):
            prompts.append(record["messages"])
        elif isinstance(record, dict) and "instruction" in record and _alpaca_problem(record) is None:
            prompts.append(dict(record))  # rendered once the tokenizer is known (`resolve_prompts`)
        elif isinstance(record, dict) and "instruction" in record:
            bad.append(f"line {number}: an alpaca row whose {_alpaca_problem(record)}")
        else:
            bad.append(f"line {number}: expected {{\"prompt\": \"...\"}}, {{\"messages\": [{{\"role\": ..., "
                       "\"content\": ...}, ...]} or {\"instruction\": \"...\", \"input\": \"...\"}")
    if bad:
        shown = "; ".join(bad[:5]) + (f"; ... ({len(bad)} bad lines)" if len(bad) > 5 else "")
        raise DataError(f"--prompts {path}: {shown}", path=path, line=int(bad[0].split()[1].rstrip(":")))
    if not prompts:
        raise DataError(f"--prompts {path} holds no prompt (one JSON object a line)", path=path)
    return prompts


def _alpaca_problem(record: dict) -> str | None:
    try:
        alpaca_prompt(record, chat_template=True)
    except ShapeProblem as exc:
        return str(exc)
    return None


def resolve_prompts(prompts: list, tokenizer, raw: bool) -> list:
    """Alpaca rows (dicts from `read_prompts`) rendered for `tokenizer` as fitune train renders their prompts; the
    other prompts as they are."""
    chat = has_chat_template(tokenizer) and not raw
    return [alpaca_prompt(p, chat) if isinstance(p, dict) else p for p in prompts]


def _is_messages(value) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value)


def run(args) -> int:
    settings = settings_from_args(args)
    if args.batch_size < 1:
        raise ConfigError(f"--batch-size {args.batch_size}: give at least 1")
    prompts = [args.prompt] if args.prompt is not None else read_prompts(args.prompts)
    if args.out:
        check_output_file(args.out, "--out")
    model, tokenizer, _ = load_from_args(args)
    prompts = resolve_prompts(prompts, tokenizer, args.raw)
    import torch

    from .progress import progress_callback

    torch.manual_seed(args.seed)
    # --out grows line by line (read it while it runs; an interrupted run keeps its lines), never through a link
    out = open_output_stream(args.out, what="--out") if args.out else sys.stdout
    try:
        with progress_callback("generate", "prompt", enabled=args.prompts is not None) as progress:
            for done, g in enumerate(iter_generate(model, tokenizer, prompts, settings, raw=args.raw,
                                                   batch_size=args.batch_size), 1):
                line = {("prompt" if isinstance(g.prompt, str) else "messages"): g.prompt, "response": g.response,
                        "new_tokens": g.new_tokens, "finished": g.finished}
                _write_line(out, json.dumps(line, ensure_ascii=False) + "\n", args.out, done - 1, UnsafeFileError)
                if progress is not None:
                    progress(done, len(prompts))
    finally:
        if out is not sys.stdout:
            out.close()
    return 0


def _write_line(out, text: str, path: str | None, written: int, error) -> None:
    try:
        out.write(text)
        out.flush()
    except OSError as exc:
        if path is None or isinstance(exc, BrokenPipeError):
            raise
        raise error(f"--out {path}: could not write it ({exc.strerror or exc}) after {written} line(s), which it "
                    "holds; free some space (or write elsewhere) and run again", path=path) from None

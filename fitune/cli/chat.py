"""`fitune chat RUN_DIR`: talk to a trained model in the terminal, its replies streamed as they are generated."""

from __future__ import annotations

import argparse
import sys

from ..infer.generate import ChatSession
from . import generate as generate_cli
from .generate import add_load_arguments, add_sampling_arguments, settings_from_args

DESCRIPTION = """\
Chat with a trained model: type a message, the reply is printed token by token as it is generated. The
conversation goes through the tokenizer's chat template and is kept across turns.

  /reset   forget the conversation (the --system message stays)
  /exit    end (so do Ctrl-D and Ctrl-C)

RUN_DIR: the output_dir of `fitune train` (its adapter/ over the base model the run names, or merged/ / model/),
a Hugging Face model folder, or a PEFT adapter folder. Reads stdin, so a conversation can be piped in:
  printf 'Hello\\nWhat is LoRA?\\n' | fitune chat runs/x
"""


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("chat", help="chat with a trained model in the terminal",
                              description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_load_arguments(p)
    p.add_argument("--system", metavar="TEXT", help="a system message, first in the conversation")
    add_sampling_arguments(p, max_new_tokens=512)
    p.set_defaults(run=run)
    return p


def run(args) -> int:
    settings = settings_from_args(args)
    model, tokenizer, info = generate_cli.load_from_args(args)  # looked up when called: tests replace it
    # torch: optional, imported where used (estimate, plan and doctor SCRIPT never load it)
    import torch

    torch.manual_seed(args.seed)
    session = ChatSession(model, tokenizer, settings, system=args.system)
    interactive = sys.stdin.isatty()
    if interactive:
        try:
            import readline  # noqa: F401  - input() gets line editing and history
        except ImportError:  # Windows
            pass
        print(f"chatting with {info.describe()}\n/reset forgets the conversation; /exit, Ctrl-D or Ctrl-C ends",
              file=sys.stderr)

    def write(piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()

    try:
        while True:
            line = _read_line(interactive)
            if line is None:  # Ctrl-D / end of the piped input
                break
            text = line.strip()
            if not text:
                continue
            if text in ("/exit", "/quit"):
                break
            if text == "/reset":
                session.reset()
                print("(conversation reset)", file=sys.stderr)
                continue
            if text.startswith("/") and " " not in text:
                print(f"unknown command {text}: /reset forgets the conversation, /exit ends", file=sys.stderr)
                continue
            session.send(text, on_text=write)
            write("\n")
    except KeyboardInterrupt:  # Ctrl-C, while typing or during a reply: end cleanly
        write("\n")
    return 0


def _read_line(interactive: bool) -> str | None:
    """The next line of input, or None at its end. A terminal gets a prompt and line editing (input())."""
    if interactive:
        try:
            return input("> ")
        except EOFError:
            sys.stdout.write("\n")
            return None
    line = sys.stdin.readline()
    return line if line else None

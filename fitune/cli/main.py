"""`fitune`: the command line. One module per subcommand; `main()` wires them and turns errors into messages."""

from __future__ import annotations

import argparse
import logging
import sys

from .. import __version__
from ..errors import FituneError
from . import doctor, estimate, plan, profile, report, train

SUBCOMMANDS = (estimate, plan, profile, train, doctor, report)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fitune",
        description="fitune makes LLM fine-tuning fit, and run fast, on the GPU you have.",
        epilog="Start with: fitune estimate llama-3.1-8b --method lora --seq-len 2048 --batch-size 2 --gpu rtx4090",
    )
    p.add_argument("--version", action="version", version=f"fitune {__version__}")
    p.add_argument("-v", "--verbose", action="store_true", help="log what fitune does")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for module in SUBCOMMANDS:
        module.add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    if not getattr(args, "run", None):
        parser.print_help()
        return 2
    try:
        return int(args.run(args) or 0)
    except FituneError as exc:
        print(f"fitune {args.command}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except BrokenPipeError:  # `fitune estimate ... | head`
        return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

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
    # The last line of defence of "no input gets a traceback" (tests/test_bad_inputs.py): what slips past the
    # checks still gets one message saying what to do, and exit status 2.
    except RecursionError:
        print(f"fitune {args.command}: error: an input is nested too deeply to read (Python's recursion limit); "
              "check the files given (a config, a data file or a script nested thousands of levels deep)",
              file=sys.stderr)
        return 2
    except MemoryError:
        print(f"fitune {args.command}: error: ran out of host memory; check the sizes given (--seq-len, "
              "--batch-size, lora.rank, the model) and the files' sizes", file=sys.stderr)
        return 2
    except OSError as exc:  # a file that vanished, a full disk, a permission the checks could not foresee
        where = f" {exc.filename}" if exc.filename else ""
        print(f"fitune {args.command}: error: cannot use{where}: {exc.strerror or exc}; check the path, its "
              "permissions and the free space", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

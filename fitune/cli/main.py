"""`fitune`: the command line. One module per subcommand; `main()` wires them and turns errors into messages."""

from __future__ import annotations

import argparse
import logging
import sys

from .. import __version__
from ..config import ALL_KEYS
from ..errors import FituneError
from ..schema import FOREIGN_KEYS, unknown_flag_hint
from . import chat, doctor, estimate, eval, export, generate, merge, plan, profile, report, train

SUBCOMMANDS = (estimate, plan, train, chat, generate, eval, merge, export, profile, doctor, report)


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


#: How other tools name the model on a command line: `--model` (vLLM, lm-eval, llama.cpp's scripts) and the keys of
#: FOREIGN_KEYS that mean fitune's `model` (`--model_name_or_path` of HF's example scripts and TRL, Axolotl's
#: `base_model`), with - or _. Commands whose MODEL is positional take them as MODEL.
MODEL_FLAGS = frozenset(["--model"] + [f"--{spelling}" for key, target in FOREIGN_KEYS.items() if target == "model"
                                       for spelling in (key, key.replace("_", "-"))])


def _model_flag_as_positional(parser: argparse.ArgumentParser, argv: list[str]) -> tuple[list[str], str]:
    """`fitune plan --model llama-3.1-8b ...` as `fitune plan llama-3.1-8b ...`: (argv, the flag it moved, or "").

    Only for a command with a positional MODEL and no `--model` flag of its own (doctor has one), and only once."""
    sub_action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    where = next((i for i, a in enumerate(argv) if a in sub_action.choices), None)
    if where is None:
        return argv, ""
    sub = sub_action.choices[argv[where]]
    if not any(a.dest == "model" and not a.option_strings for a in sub._actions) or "--model" in sub._option_string_actions:
        return argv, ""
    for i in range(where + 1, len(argv)):
        flag, eq, value = argv[i].partition("=")
        if argv[i] == "--":
            break
        if flag not in MODEL_FLAGS:
            continue
        if eq:
            rest = argv[:i] + argv[i + 1:]
        elif i + 1 < len(argv) and not argv[i + 1].startswith("-"):
            value, rest = argv[i + 1], argv[:i] + argv[i + 2:]
        else:
            return argv, ""  # no value: the unknown-flag message says what to write
        return rest[:where + 1] + [value] + rest[where + 1:], flag
    return argv, ""


def _value_after_a_switch(parser: argparse.ArgumentParser, command: str, argv: list[str], extras: list[str]) -> str:
    """`--lean-lora true`: a value given to an on/off flag (which takes none). The message for it, or ""."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    for value in extras:
        i = argv.index(value) if value in argv else -1
        action = sub._option_string_actions.get(argv[i - 1]) if i > 0 else None
        if isinstance(action, argparse.BooleanOptionalAction):
            on, off = action.option_strings[:2]
            yaml_key = next((k.yaml for k in ALL_KEYS if k.flag == on), None)
            in_yaml = f"; in a YAML config: `{yaml_key}: true`" if yaml_key else ""
            return f"{argv[i - 1]} takes no value (got {value!r}): write {on} to turn it on, {off} to turn it off{in_yaml}"
    return ""


def _unknown_arguments(parser: argparse.ArgumentParser, args, extras: list[str], argv) -> int:
    """Flags the command does not have: one line each, with a "did you mean" that knows how HF Trainer, TRL, PEFT,
    Axolotl and torchtune spell fitune's keys (`--per-device-train-batch-size` -> `--batch-size`); exit 2. Anything
    else (a stray value) gets argparse's own message."""
    flags = [e for e in extras if e.startswith("--")]
    command = getattr(args, "command", None)
    if command and not flags:
        switched = _value_after_a_switch(parser, command, list(sys.argv[1:] if argv is None else argv), extras)
        if switched:
            print(f"fitune {command}: error: {switched}", file=sys.stderr)
            return 2
    if not flags or not command:
        parser.parse_args(argv)  # argparse prints usage and its message, and exits 2
        return 2
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    known = sorted(s for s in sub._option_string_actions if s.startswith("--") and s != "--help")
    for flag in flags:
        print(f"fitune {command}: error: {flag.split('=', 1)[0]} is not a flag of fitune {command}"
              f"{unknown_flag_hint(flag, known, ALL_KEYS)} (fitune {command} --help lists them)", file=sys.stderr)
    return 2


class _DropAcceleratorNotice(logging.Filter):
    """Drops DeepSpeed's "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect
    it." (deepspeed/accelerator/real_accelerator.py), and its older "Setting ds_accelerator to ..." form."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(("Setting accelerator to ", "Setting ds_accelerator to "))


def _drop_deepspeed_accelerator_notice() -> None:
    """DeepSpeed logs which accelerator it picked when it is imported, to stdout. accelerate imports it whenever it
    is installed (every `save_pretrained`: merge, train's merged/ folder), so commands that never use DeepSpeed
    printed it, and a CPU machine read it as a warning. That one record is dropped on DeepSpeed's logger
    ("DeepSpeed", created by deepspeed/utils/logging.py; a filter set here stays when DeepSpeed sets it up); its
    other messages are kept."""
    logger = logging.getLogger("DeepSpeed")
    if not any(isinstance(f, _DropAcceleratorNotice) for f in logger.filters):
        logger.addFilter(_DropAcceleratorNotice())


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    given = list(sys.argv[1:] if argv is None else argv)
    argv, model_flag = _model_flag_as_positional(parser, given)
    args, extras = parser.parse_known_args(argv)
    if model_flag and extras and not any(e.startswith("-") for e in extras):
        print(f"fitune {args.command}: error: the model is given twice ({model_flag} {args.model} and "
              f"{' '.join(extras)}); give MODEL once, as the first argument or with {model_flag}", file=sys.stderr)
        return 2
    if extras:
        return _unknown_arguments(parser, args, extras, argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    _drop_deepspeed_accelerator_notice()
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
    except KeyboardInterrupt:  # Ctrl-C outside the training loop's own handling (e.g. after a run has finished)
        print(f"fitune {args.command}: interrupted", file=sys.stderr)
        return 130
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

"""`fitune doctor`: what is wrong in a training script (static rules) or a data file (token lengths, padding)."""

from __future__ import annotations

import argparse
import json
import sys

from ..errors import ConfigError

DESCRIPTION = """\
Check a training script, or a training data file, for what makes fine-tuning run out of memory or run slowly.

SCRIPT: the script is read, never run (Python's ast). HF Trainer, TRL, PEFT, accelerate and plain PyTorch loops.
Each finding has a rule, a line, a severity (error | warning | info), a message, a fix, and its evidence: a
measured figure from fitune's GPU benchmarks (bench/results/...), fitune's estimate, or a reasoned statement
marked as such. `--list-rules` prints the rules.

--data FILE --tokenizer DIR: tokenises every record (.jsonl or .json; chat {"messages"}, {"prompt",
"completion"} or {"text"} records) and prints the token-length histogram, the share of padding when padding to
--seq-len vs per batch vs packing, the records that would be truncated, and bad or empty records by line.

For checks inside a live run use fitune.integrations.hf.FituneCallback (HF Trainer) or
fitune.doctor.runtime.RunMonitor (plain loops).

exit codes: 0 no error-severity finding, 1 at least one, 2 bad input (missing file, not Python, no tokenizer).

examples:
  fitune doctor train.py
  fitune doctor train.py --json
  fitune doctor --data train.jsonl --tokenizer ./Llama-3.1-8B --seq-len 2048
"""


def add_parser(subparsers) -> argparse.ArgumentParser:
    from ..doctor.data import DEFAULT_BATCH_SIZE
    from ..setup import DEFAULT_SETUP

    p = subparsers.add_parser("doctor", help="find what is wrong in a training script or data file",
                              description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("script", nargs="?", metavar="SCRIPT", help="a training script (.py); read, never run")
    p.add_argument("--data", metavar="FILE", help="a .jsonl / .json data file to scan instead of a script")
    p.add_argument("--tokenizer", metavar="DIR", help="with --data: a folder holding the tokenizer (a model folder)")
    p.add_argument("--seq-len", type=int, default=None, metavar="N",
                   help="with --data: the training sequence length in tokens "
                   f"(default {DEFAULT_SETUP.seq_len_tokens}, as fitune estimate)")
    p.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE, metavar="N",
                   help="with --data: sequences per batch for the dynamic-padding figure "
                   f"(default {DEFAULT_BATCH_SIZE})")
    p.add_argument("--json", action="store_true", help="SCRIPT: a JSON list of findings (keys: rule, line, severity, "
                   "message, fix, evidence, claims); --data: one JSON object with a findings list")
    p.add_argument("--list-rules", action="store_true", help="print the script rules and exit")
    p.set_defaults(run=run)
    return p


def run(args) -> int:
    from ..doctor.findings import worst_exit_code

    if args.list_rules:
        return _list_rules()
    if args.script and args.data:
        raise ConfigError("pass either SCRIPT or --data FILE, not both (run fitune doctor twice)")
    if args.data:
        return _run_data(args, worst_exit_code)
    if not args.script:
        raise ConfigError("nothing to check: pass a training script (fitune doctor train.py) or a data file "
                          "(fitune doctor --data train.jsonl --tokenizer DIR)")
    if args.tokenizer or args.seq_len is not None:
        raise ConfigError("--tokenizer and --seq-len go with --data FILE, not with a script")
    from ..doctor import check_script
    from ..doctor.report import count_text, format_findings
    from ..doctor.rules import ALL_RULES

    findings = check_script(args.script)
    if args.json:
        json.dump([f.to_dict() for f in findings], sys.stdout, indent=2)
        print()
    elif findings:
        print(f"{args.script}: {count_text(findings)}\n")
        print(format_findings(findings, args.script))
    else:
        print(f"{args.script}: no findings ({len(ALL_RULES)} rules checked)")
    return worst_exit_code(findings)


def _run_data(args, worst_exit_code) -> int:
    from ..doctor.data import scan_data
    from ..doctor.report import format_data_report

    if not args.tokenizer:
        raise ConfigError("--data needs --tokenizer DIR: the folder of the tokenizer your training uses "
                          "(a model folder)")
    report = scan_data(args.data, args.tokenizer, seq_len_tokens=args.seq_len, batch_size=args.batch_size)
    if args.json:
        json.dump(report.to_dict(), sys.stdout, indent=2)
        print()
    else:
        print(format_data_report(report))
    return worst_exit_code(report.findings)


def _list_rules() -> int:
    from ..doctor.rules import ALL_RULES

    for r in ALL_RULES:
        claims = f"  [{', '.join(r.claims)}]" if r.claims else ""
        print(f"{r.id:36s} {r.severity:8s} {r.summary}{claims}")
    return 0

"""`fitune doctor`: what is wrong in a training script (static rules) or a data file (token lengths, padding)."""

from __future__ import annotations

import argparse
import json
import os
import sys

from ..data.hub import is_hub_id
from ..data.read import SUFFIXES
from ..doctor.data import DEFAULT_BATCH_SIZE, scan_data
from ..doctor.findings import worst_exit_code
from ..doctor.script import diagnose_script
from ..errors import ConfigError
from ..report import add_html_argument
from ..schema import Problems, values_from_args
from ..setup import SETUP_KEYS
from ..specs.gpu import resolve_gpu
from .common import add_setup_arguments, check_output_file
from .estimate import estimate_to_json, format_estimate

DESCRIPTION = """\
Check a training script, or a training data file, for what makes fine-tuning run out of memory or run slowly.

SCRIPT: the script is read, never run (Python's ast). HF Trainer, TRL, Unsloth, PEFT, accelerate and plain PyTorch
loops. fitune recovers the setup the script runs - model, method, LoRA rank and targets, dtype, checkpointing,
attention, optimizer, micro-batch, accumulation, sequence length, whether the output is kept through backward -
each with its line; what the script does not say is listed as assumed, with the flag that sets it (the same flags
as fitune estimate). It then estimates that step on --gpu (default rtx4090, a 24 GB card), with the breakdown
and verdict of fitune estimate, and when it does not fit cleanly ranks the smallest changes to the script that
make it fit, each with the lines to change, its memory and its predicted speed. Then the rule findings: a rule, a
line, a severity (error | warning | info), a message, a fix, and its evidence (a live estimate of this script's
step with and without the fix, a measured figure from fitune's GPU benchmarks, a source reference, or a reasoned
statement marked as such). `--list-rules` prints the rules. --html FILE writes all of it as one page: the setup, the
estimate and its verdict, the ranked fixes, and the findings on the script's lines.

A Jupyter notebook (.ipynb) is read as its code cells joined in order (`!shell` and `%magic` lines skipped); every
line is given as "cell 3, line 2" (cells counted from 1 over the whole notebook, markdown included; in --json each
finding has `cell` beside `line`). A data, text, Markdown or YAML file is refused (exit 2) with the command that
reads it.

--data FILE --tokenizer DIR: tokenises every record (.jsonl or .json; chat {"messages"}, {"prompt",
"completion"} or {"text"} records) and prints the token-length histogram, the share of padding when padding to
--seq-len vs per batch vs packing, the records that would be truncated, and bad or empty records by line.

For checks inside a live run use fitune.integrations.hf.FituneCallback (HF Trainer) or
fitune.doctor.runtime.RunMonitor (plain loops).

exit codes: 0 no error-severity finding, 1 at least one, 2 bad input (missing file, not Python, no tokenizer,
unknown --model or --gpu). Whether the step fits does not change the exit code: read `estimate.fits` in --json.

examples:
  fitune doctor train.py --gpu rtx4090
  fitune doctor train.py --seq-len 4096 --model llama-3.1-8b --json
  fitune doctor --data train.jsonl --tokenizer ./Llama-3.1-8B --seq-len 2048
"""

SCRIPT_JSON_KEYS = ("script", "gpu", "setup", "estimate", "tokens_per_s", "fixes", "plan", "findings")
"""The keys of `fitune doctor SCRIPT --json`. Stable."""
DEFAULT_GPU = "rtx4090"
"""The card a script is judged on without --gpu: the 24 GB cards the forum posts are about."""
_SHARED_FLAGS = ("seq_len_tokens", "batch_size")
"""Setup fields whose flags (--seq-len, --batch-size) also serve --data: declared here once, for both."""


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("doctor", help="find what is wrong in a training script or data file",
                              description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("script", nargs="?", metavar="SCRIPT", help="a training script (.py) or notebook (.ipynb); read, "
                   "never run")
    p.add_argument("--data", metavar="FILE", help="a .jsonl / .json data file to scan instead of a script")
    p.add_argument("--tokenizer", metavar="DIR", help="with --data: a folder holding the tokenizer (a model folder)")
    p.add_argument("--gpu", metavar="NAME|NGiB", help=f"SCRIPT: judge the fit on this GPU (default {DEFAULT_GPU}) "
                   "or allocator budget, e.g. 23.4GiB")
    p.add_argument("--model", metavar="MODEL", help="SCRIPT: the model to estimate when the script's is not a "
                   "catalog model (a catalog name, a config.json or a model folder)")
    p.add_argument("--seq-len", type=int, default=None, metavar="N",
                   help="tokens per sequence: SCRIPT: instead of what the script says; --data: the training "
                   "sequence length (default 2048, as fitune estimate)")
    p.add_argument("--batch-size", type=int, default=None, metavar="N",
                   help="sequences per micro-batch: SCRIPT: instead of what the script says; --data: for the "
                   f"dynamic-padding figure (default {DEFAULT_BATCH_SIZE})")
    p.add_argument("--json", action="store_true", help="SCRIPT: one JSON object (keys: " + ", ".join(
        SCRIPT_JSON_KEYS) + "; each finding: rule, line, severity, message, fix, evidence, claims); --data: one "
                   "JSON object with a findings list")
    p.add_argument("--list-rules", action="store_true", help="print the script rules and exit")
    add_setup_arguments(p, model=False, config=False, skip=_SHARED_FLAGS)
    add_html_argument(p)
    p.set_defaults(run=run)
    return p


def run(args) -> int:
    if args.list_rules:
        return _list_rules()
    if args.html is not None:
        check_output_file(args.html, "--html", make_parents=True)
    if args.script and args.data:
        raise ConfigError("pass either SCRIPT or --data FILE, not both (run fitune doctor twice)")
    if args.data:
        if args.batch_size is None:
            args.batch_size = DEFAULT_BATCH_SIZE
        return _run_data(args, worst_exit_code)
    if not args.script:
        raise ConfigError("nothing to check: pass a training script (fitune doctor train.py) or a data file "
                          "(fitune doctor --data train.jsonl --tokenizer DIR)")
    if args.tokenizer:
        raise ConfigError("--tokenizer goes with --data FILE, not with a script")
    return _run_script(args, worst_exit_code)


def setup_overrides(args) -> dict:
    """TrainSetup fields given as flags (generated from the schema, as fitune estimate's), checked by name."""
    problems = Problems()
    out = values_from_args(args, [k for k in SETUP_KEYS if k.field not in _SHARED_FLAGS], problems)
    for f, flag in (("seq_len_tokens", "--seq-len"), ("batch_size", "--batch-size")):
        v = getattr(args, "seq_len" if f == "seq_len_tokens" else f)
        if v is not None:
            if v < 1:
                problems.add(f"{flag} must be a positive integer, got {v}")
            out[f] = v
    problems.raise_if_any()
    return out


def _run_script(args, worst_exit_code) -> int:
    gpu = resolve_gpu(DEFAULT_GPU if args.gpu is None else args.gpu)
    report = diagnose_script(args.script, gpu, setup_overrides(args), args.model)
    doc = _script_document(args.script, gpu.name, report)
    if args.html is not None:
        # the command's library: imported when it runs, so that `fitune --help` stays light
        from ..doctor.html import write_script_page

        write_script_page(args.html, report, doc)
        print(f"wrote {args.html} (open it in a browser)", file=sys.stderr)
    if args.json:
        json.dump(doc, sys.stdout, indent=2)
        print()
    else:
        print(_script_text(args.script, report))
    return worst_exit_code(report.findings)


def _script_document(path: str, gpu_name: str, report) -> dict:
    """`fitune doctor SCRIPT --json`'s document (keys: SCRIPT_JSON_KEYS). For a notebook, every line counts within
    its cell, with a `cell` key beside it (fitune.doctor.notebook.Notebook.locate_document)."""
    d = report.diagnosis
    doc = {"script": path, "gpu": gpu_name,
           "setup": report.script.to_dict() if report.script else None,
           "estimate": estimate_to_json(d.estimate) if d else None,
           "tokens_per_s": round(d.tokens_per_s, 1) if d else None,
           "fixes": [f.to_dict() for f in d.fixes] if d else [],
           "plan": d.runner_plan.to_dict() if d and d.runner_plan else None,
           "findings": [f.to_dict() for f in report.findings]}
    notebook = report.source.notebook if report.source is not None else None
    return notebook.locate_document(doc) if notebook is not None else doc


def _script_text(path: str, report) -> str:
    """What `fitune doctor SCRIPT` prints: the setup, the estimate, the fixes, then the findings."""
    from ..doctor.report import count_text, format_findings, format_fixes, format_script_setup
    from ..doctor.rules import ALL_RULES
    notebook = report.source.notebook if report.source is not None else None
    d, findings, out = report.diagnosis, report.findings, []
    if d is not None:
        out += [format_script_setup(report.script, path, notebook), "", _estimate_text(format_estimate(d.estimate))]
        fixes = format_fixes(d, notebook)
        if fixes:
            out += ["", fixes]
    else:
        out.append(f"{path}: no model load found, so no estimate (name one with --model, e.g. --model llama-3.1-8b)")
    out.append("")
    if findings:
        out += [f"{path}: {count_text(findings)}\n", format_findings(findings, path, notebook)]
    else:
        out.append(f"{path}: no findings ({len(ALL_RULES)} rules checked)")
    return "\n".join(out)


def _estimate_text(text: str) -> str:
    """fitune estimate's report without its closing hint about flags: the script's own fixes follow instead."""
    return "\n".join(line for line in text.splitlines() if not line.startswith("  no single change fits"))


def _run_data(args, worst_exit_code) -> int:
    from ..doctor.report import format_data_report

    if not os.path.exists(args.data) and not is_hub_id(args.data, SUFFIXES):  # ORG/NAME: a Hub data set
        raise ConfigError(f"--data {args.data}: no such file; pass the data file (or Hub data set id ORG/NAME) your "
                          "training reads")
    if not args.tokenizer:
        raise ConfigError("--data needs --tokenizer DIR: the folder of the tokenizer your training uses "
                          "(a model folder)")
    from .progress import progress_callback

    with progress_callback("doctor: encoding", "record", enabled=not args.json) as progress:
        report = scan_data(args.data, args.tokenizer, seq_len_tokens=args.seq_len, batch_size=args.batch_size,
                           progress=progress)
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

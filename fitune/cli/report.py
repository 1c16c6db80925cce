"""`fitune report`: a command's --json answer (or a training run) as a self-contained HTML page with charts."""

from __future__ import annotations

import argparse
import os
import sys
import time

from ..errors import ConfigError, FituneError
from ..files import same_file
from ..report import load_document, read_run, write_html
from ..report.check import check_numbers
from ..report.load import KINDS, check_kind, read_json
from .common import check_output_file

DESCRIPTION = """\
Turn a fitune answer into an HTML page you can look at: one file, its CSS, JS and SVG charts inline (nothing is
fetched when you open it; it works offline and can be attached to an issue).

KIND and INPUT:
  estimate FILE.json   `fitune estimate ... --json`: the peak as a stacked bar by category against the card's
                       budget, the phase peaks, the changes that fit; --measured PROFILE.json puts a measured run
                       of the same setup beside the estimate
  plan FILE.json       `fitune plan ... --json`: each plan's memory and predicted tokens/s, what it turns on, why
                       the faster setups do not fit; click a plan for its breakdown
  profile FILE.json    `fitune profile ... --json`: measured against estimated per category, phase peaks, speed,
                       the post-mortem of an out-of-memory error
  train RUN_DIR        the output_dir of `fitune train` (metrics.jsonl): loss, eval loss, tokens/s, peak memory
                       per step; --watch N rewrites the page every N seconds while the run goes on
  doctor FILE.json     `fitune doctor SCRIPT --json`: setup, estimate, fixes, findings (--script: on their lines)

INPUT `-` reads the JSON from stdin. The page goes to -o FILE.html (default: INPUT with .html, or
fitune-KIND.html for stdin, or RUN_DIR/report.html).

exit codes: 0 written, 2 bad input (missing file, not the JSON of that command).

examples:
  fitune estimate llama-3.1-8b --gpu rtx4090 --json > est.json && fitune report estimate est.json
  fitune plan llama-3.1-8b --gpu rtx4090 --json | fitune report plan - -o plan.html
  fitune doctor train.py --json > findings.json; fitune report doctor findings.json --script train.py
  fitune report train runs/x --watch 30
"""


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("report", help="write an answer or a training run as an HTML page with charts",
                              description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("kind", metavar="KIND", choices=KINDS, help=" | ".join(KINDS))
    p.add_argument("input", metavar="INPUT", help="the JSON a command printed with --json (- for stdin); for train "
                   "the run folder")
    p.add_argument("-o", "--output", metavar="FILE.html", help="where to write the page (default: beside INPUT)")
    p.add_argument("--measured", metavar="PROFILE.json", help="estimate: a `fitune profile --json` of the same setup, "
                   "shown beside the estimate")
    p.add_argument("--script", metavar="SCRIPT.py", help="doctor: the script the findings are about (shown with "
                   "each finding on its line)")
    p.add_argument("--refresh", type=int, metavar="SECONDS", help="the page reloads itself every SECONDS")
    p.add_argument("--watch", type=int, metavar="SECONDS", help="train: rewrite the page every SECONDS until the "
                   "run writes its final outputs (Ctrl-C stops); the page reloads itself as often")
    p.set_defaults(run=run)
    return p


def default_output(kind: str, source: str) -> str:
    if kind == "train":
        return os.path.join(source, "report.html")
    if source == "-":
        return f"fitune-{kind}.html"
    root, _ = os.path.splitext(source)
    return root + ".html"


def run(args) -> int:
    problems = []
    if args.measured and args.kind != "estimate":
        problems.append("--measured goes with `fitune report estimate` (a profile shown beside the estimate)")
    if args.script and args.kind != "doctor":
        problems.append("--script goes with `fitune report doctor`")
    if args.watch is not None and args.kind != "train":
        problems.append("--watch goes with `fitune report train RUN_DIR`")
    for flag in ("refresh", "watch"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            problems.append(f"--{flag} must be a positive number of seconds, got {value}")
    if problems:
        raise ConfigError(problems)
    for flag, path in (("INPUT", args.input if args.kind != "train" else None), ("--measured", args.measured),
                       ("--script", args.script)):
        if path and path != "-" and os.path.exists(path) and not os.path.isfile(path) and not os.path.isdir(path):
            raise ConfigError(f"{flag} {path} is not a regular file (a pipe or a device?); pass a file (or - for "
                              "stdin)")  # opening a pipe nobody writes to would wait forever
    out = args.output or default_output(args.kind, args.input)
    flag = "-o" if args.output else "-o (default: beside INPUT)"
    check_output_file(out, flag, make_parents=True)
    _refuse_writing_an_input(args, out, flag)
    try:
        doc = load_document(args.kind, args.input, script=args.script)
    except RecursionError:
        raise ConfigError(f"{args.input}: JSON nested too deeply to be the output of `fitune {args.kind} --json`; "
                          "pass what the command printed") from None
    options = {"refresh_s": args.refresh}
    if args.measured:
        measured = read_json(args.measured, "--measured")
        check_kind("profile", measured, args.measured, "--measured")
        check_numbers(measured, "profile", f"--measured {args.measured}")
        options["measured"] = measured
    if args.watch:
        return _watch(args.input, out, args.watch, read_run, write_html)
    _write(write_html, args.kind, doc, out, args.input, **options)
    print(f"wrote {out}")
    return 0


def _refuse_writing_an_input(args, out: str, flag: str) -> None:
    """`fitune report estimate page.html` (whose default output is page.html itself), `-o` naming INPUT,
    --measured, --script or a run's metrics.jsonl, by any path or link: refused before anything is read."""
    inputs = [("INPUT", args.input if args.kind != "train" else None), ("--measured", args.measured),
              ("--script", args.script)]
    if args.kind == "train":
        inputs += [("the run's", os.path.join(args.input, name)) for name in ("metrics.jsonl", "run.json")]
    for what, path in inputs:
        if path and path != "-" and os.path.lexists(out) and same_file(out, path):
            raise ConfigError(f"{flag} {out} is {what} {path} itself: the page would overwrite what it is made from; "
                              "give another file with -o (e.g. -o report.html)")


def _write(write_html, kind: str, doc, out: str, source: str, **options) -> None:
    """write_html, with any value the checks let through that the page cannot draw turned into one message."""
    try:
        write_html(kind, doc, out, what="-o", **options)
    except FituneError:
        raise
    except (TypeError, ValueError, AttributeError, KeyError, IndexError, OverflowError, ZeroDivisionError) as exc:
        raise ConfigError(f"{source}: a value in it has a type or size `fitune {kind} --json` never writes "
                          f"({type(exc).__name__}: {exc}); pass what the command printed, unedited") from None


def _watch(run_dir: str, out: str, every_s: int, read_run, write_html) -> int:
    """Rewrite the page until the run is finished; the page reloads itself at the same pace."""
    print(f"writing {out} every {every_s} s until the run finishes (Ctrl-C stops)", file=sys.stderr)
    try:
        while True:
            doc = read_run(run_dir)
            _write(write_html, "train", doc, out, run_dir, refresh_s=None if doc["finished"] else every_s)
            if doc["finished"]:
                break
            time.sleep(every_s)
    except KeyboardInterrupt:
        _write(write_html, "train", read_run(run_dir), out, run_dir)  # the last page stops reloading
    print(f"wrote {out}")
    return 0

"""The estimator core imports no torch, and answers with bounded work.

"Answers fast" is checked by counting, not timing: the Python function calls (`sys.setprofile` "call" events, the
imports included) that `fitune estimate` and `fitune plan` make in a fresh interpreter stay under a bound. The count
is the same on any machine for the same code, so the test neither flakes under load nor passes on a fast machine
alone. Measured when the bounds were set (issue 34): estimate 434 k calls, plan 642 k (0.1-0.3 s on a laptop core);
the bounds leave about 3.5x room, so a change that makes either several times slower fails here (and one that
imports torch, transformers, peft or numpy fails the import check).
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CODE = """
import json, sys
calls = [0]
def count(frame, event, arg):
    if event == "call":
        calls[0] += 1
sys.setprofile(count)
import io, contextlib
from fitune.cli.main import main
buf = io.StringIO()
with contextlib.redirect_stdout(buf):
    rc = main(json.loads(sys.argv[1]))
sys.setprofile(None)
print(json.dumps({"rc": rc, "calls": calls[0], "out_chars": len(buf.getvalue()),
                  "heavy": sorted(m for m in ("torch", "transformers", "peft", "numpy") if m in sys.modules)}))
"""

ESTIMATE = ["estimate", "llama-3.1-8b", "--method", "lora", "--seq-len", "2048", "--batch-size", "2",
            "--grad-checkpointing", "full", "--gpu", "rtx4090"]
PLAN = ["plan", "llama-3.1-8b", "--gpu", "rtx4090"]
MAX_CALLS = {"estimate": 1_500_000, "plan": 2_500_000}
"""Python function calls allowed for each command (see the module's docstring for the measured counts)."""


def _run(argv: list[str]) -> dict:
    out = subprocess.run([sys.executable, "-c", CODE, json.dumps(argv)], cwd=ROOT, capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("argv", [ESTIMATE, PLAN], ids=["estimate", "plan"])
def test_estimate_and_plan_import_no_torch_and_answer_within_bounded_work(argv):
    doc = _run(argv)
    assert doc["rc"] == 0 and doc["out_chars"] > 100, doc  # it answered
    assert doc["heavy"] == [], f"fitune {argv[0]} imported {doc['heavy']}"
    assert doc["calls"] <= MAX_CALLS[argv[0]], \
        f"fitune {argv[0]} made {doc['calls']} Python calls, over its bound {MAX_CALLS[argv[0]]}"


def test_the_bound_fails_on_several_times_the_work():
    """The count measures the work: the same estimate answered four times in one process is over the bound."""
    code = CODE.replace("    rc = main(json.loads(sys.argv[1]))",
                        "    for _ in range(4):\n        rc = main(json.loads(sys.argv[1]))")
    out = subprocess.run([sys.executable, "-c", code, json.dumps(ESTIMATE)], cwd=ROOT, capture_output=True,
                         text=True, check=True)
    doc = json.loads(out.stdout.strip().splitlines()[-1])
    assert doc["rc"] == 0 and doc["calls"] > MAX_CALLS["estimate"], doc


def test_importing_fitune_runs_nothing():
    code = ("import sys, fitune, fitune.memory, fitune.trace, fitune.runtime, fitune.runtime.device, fitune.runtime.oom, "
            "fitune.runtime.optim; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"

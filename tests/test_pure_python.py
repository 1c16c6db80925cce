"""The estimator core imports no torch, and answers fast."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CODE = """
import json, sys, time
t = time.perf_counter()
from fitune.cli.main import main
import io, contextlib
buf = io.StringIO()
with contextlib.redirect_stdout(buf):
    main(["estimate", "llama-3.1-8b", "--method", "lora", "--seq-len", "2048", "--batch-size", "2",
          "--grad-checkpointing", "full", "--gpu", "rtx4090"])
print(json.dumps({"torch": "torch" in sys.modules, "transformers": "transformers" in sys.modules,
                  "seconds": time.perf_counter() - t}))
"""


def test_estimate_imports_no_torch():
    out = subprocess.run([sys.executable, "-c", CODE], cwd=ROOT, capture_output=True, text=True, check=True)
    doc = json.loads(out.stdout.strip().splitlines()[-1])
    assert doc["torch"] is False and doc["transformers"] is False


def test_importing_fitune_runs_nothing():
    code = ("import sys, fitune, fitune.memory, fitune.trace, fitune.runtime, fitune.runtime.device, fitune.runtime.oom, "
            "fitune.runtime.optim; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"

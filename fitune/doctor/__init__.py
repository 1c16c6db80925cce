"""`fitune doctor`: what is wrong in a training script, its data, and its run.

- `check_script(path)`: static rules over the script's syntax tree (script.py, rules/); pure Python.
- `scan_data(path, tokenizer_dir)`: token lengths, padding waste, truncation, bad records (data.py; tokenizer via
  transformers, imported when called).
- `fitune.doctor.runtime.RunMonitor` and `fitune.integrations.hf.FituneCallback`: checks inside a live run (torch).

Every check returns `Finding`s (findings.py) as data; the CLI (fitune/cli/doctor.py) prints them.
"""

from .data import DataReport, scan_data
from .findings import ERROR, INFO, WARNING, DataError, Finding, ScriptError
from .script import check_script, check_source

__all__ = ["ERROR", "INFO", "WARNING", "DataError", "DataReport", "Finding", "ScriptError", "check_script",
           "check_source", "scan_data"]

"""No function in fitune/ is longer than 80 lines (issue 34: functions of one idea; STYLE.md).

A function is measured from its `def` line (decorators excluded) to its last line, docstring and comments
included. `NOT_YET_SPLIT` names the functions still being split; the lead empties it as each one lands, and a
name left in it after its function shrank fails too, so the set only ever gets smaller.
"""

from __future__ import annotations

import ast
import os

MAX_LINES = 80
ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fitune")

#: "path/relative/to/fitune.py:name" of each function still over MAX_LINES, while it is being split (issue 34 had
#: twelve: estimate, _trace, _train, profile, hf_code, line_chart, model_spec_from_hf_config, validate, run, render,
#: make_tracker, attention_core; all split since).
NOT_YET_SPLIT: set[str] = set()


def _function_lengths() -> dict[str, int]:
    """{"path:name": lines} for every function and method under fitune/ (methods by their bare name, nested
    functions by theirs: one key per def; the longest wins when two share a key)."""
    lengths: dict[str, int] = {}
    for folder, _, files in os.walk(ROOT):
        for file in files:
            if not file.endswith(".py"):
                continue
            path = os.path.join(folder, file)
            rel = os.path.relpath(path, ROOT).replace(os.sep, "/")
            with open(path, encoding="utf-8") as f:
                tree = ast.parse(f.read(), filename=path)
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    key = f"{rel}:{node.name}"
                    lengths[key] = max(lengths.get(key, 0), node.end_lineno - node.lineno + 1)
    return lengths


def test_no_function_is_over_80_lines():
    lengths = _function_lengths()
    too_long = sorted(f"{key} ({n} lines)" for key, n in lengths.items() if n > MAX_LINES and key not in NOT_YET_SPLIT)
    assert not too_long, (f"functions over {MAX_LINES} lines: {', '.join(too_long)}; split each into named steps "
                          "of one idea (STYLE.md)")


def test_not_yet_split_names_only_long_functions():
    lengths = _function_lengths()
    missing = sorted(key for key in NOT_YET_SPLIT if key not in lengths)
    assert not missing, f"NOT_YET_SPLIT names functions that do not exist: {', '.join(missing)}"
    done = sorted(f"{key} ({lengths[key]} lines)" for key in NOT_YET_SPLIT if lengths[key] <= MAX_LINES)
    assert not done, (f"already {MAX_LINES} lines or fewer, remove from NOT_YET_SPLIT: {', '.join(done)}")


def test_the_measure_counts_a_long_function():
    """The measure itself: a 81-line function is over the limit, an 80-line one is not."""
    body = "\n".join(f"    x{i} = {i}" for i in range(79))
    tree = ast.parse(f"def long():\n{body}\n    return 0\n\ndef short():\n{body}\n")
    lengths = {n.name: n.end_lineno - n.lineno + 1 for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    assert lengths == {"long": 81, "short": 80}

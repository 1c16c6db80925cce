"""User-facing text names the documentation, not repository paths an installed wheel does not have (issue 34).

Every string literal in fitune/ that is not a docstring is a candidate message (errors, notes, the doctor's evidence
lines, verdicts). None may name `bench/results/` or `tests/`, except the constants that hold a record's path for the
code to read (a name in READ_PATHS), which messages cite through the documentation instead."""

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
READ_PATHS = {  # (file, the name the path is bound to): paths the code opens, never printed
    ("fitune/doctor/evidence.py", "HF_RECIPE"),
    ("fitune/doctor/evidence.py", "DOCTOR_SCRIPTS"),
    ("fitune/doctor/evidence.py", "SEEDS_CAPPED"),
    ("fitune/doctor/evidence.py", "SEEDS_UNCAPPED"),
    ("fitune/doctor/evidence.py", "SEEDS_NOCKPT_CAPPED"),
    ("fitune/plan/throughput.py", "*"),  # SOURCES, and the header of the calibration file it writes
    ("fitune/plan/calibration.py", "SOURCES"),
    ("fitune/profile/accuracy.py", "*"),  # the measured records' table and the generated file's header
}


def _docstring_ids(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list):
            for stmt in body:  # a module / class / function docstring, and the attribute docstrings after fields
                if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) and isinstance(stmt.value.value, str):
                    out.add(id(stmt.value))
    return out


def _bound_name(tree: ast.AST, const: ast.Constant) -> str | None:
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(sub is const for sub in ast.walk(node.value)) if node.value is not None else False:
                names = [t.id for t in targets if isinstance(t, ast.Name)]
                return names[0] if names else None
    return None


def test_no_message_names_a_repository_path():
    found = []
    for folder, _, files in os.walk(os.path.join(ROOT, "fitune")):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            rel = os.path.relpath(path, ROOT).replace(os.sep, "/")
            tree = ast.parse(open(path, encoding="utf-8").read())
            docs = _docstring_ids(tree)
            for node in ast.walk(tree):
                if not (isinstance(node, ast.Constant) and isinstance(node.value, str)) or id(node) in docs:
                    continue
                if "bench/results" not in node.value and "tests/" not in node.value:
                    continue
                if (rel, "*") in READ_PATHS or (rel, _bound_name(tree, node)) in READ_PATHS:
                    continue
                found.append(f"{rel}:{node.lineno}: {node.value[:80]!r}")
    assert not found, "user-facing text names repository paths (link docs/ instead):\n" + "\n".join(found)


def test_the_check_sees_a_message_with_a_path(tmp_path):
    """The scan itself: a message naming bench/results is found, a docstring naming it is not."""
    src = 'def f():\n    """see bench/results/x"""\n    raise ValueError("measured in bench/results/y")\n'
    tree = ast.parse(src)
    docs = _docstring_ids(tree)
    hits = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
            and "bench/results" in n.value and id(n) not in docs]
    assert hits == ["measured in bench/results/y"]

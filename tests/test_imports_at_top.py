"""Issue 34: a file's dependencies are visible at its top. Read from the source with `ast` (nothing imported but
`fitune.cli.main`, once, in a subprocess):

- across fitune/ (`CLEANED`: every part), every import inside a function is of a module in
  an allow-list, each with its reason: an optional heavy package (`HEAVY_PACKAGES`), a fitune module that imports a
  heavy package at module level (`HEAVY_MODULES`: the pure estimator and `fitune --help` never load torch), or a
  fitune module kept out of `fitune --help`, which imports every command module (`KEPT_OUT_OF_HELP`); an import
  guarded by `except ImportError` is optional by design (the code has a fallback: POSIX-only `fcntl`, `resource`,
  Windows without `readline`, a post-mortem that may be missing) and is allowed; everything else is at the top;
- each reason still holds: a `HEAVY_MODULES` entry does import a heavy package at import, a `KEPT_OUT_OF_HELP` entry is
  not loaded by `fitune --help` and is imported lazily only from modules that are;
- the function-level imports across fitune/ are counted and printed (`pytest -s`), the number issue 34 tracks.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = os.path.join(ROOT, "fitune")

CLEANED = ("errors", "units", "files", "specs", "schema", "setup", "datasource", "config", "memory", "perf", "data",
           "plan", "runtime", "parallel", "train", "infer", "export", "trace", "profile", "report", "doctor",
           "integrations", "translate", "cli", "__init__", "__main__")
"""fitune's parts whose function-level imports are checked: every one (tests/test_layering.py's LAYERS, bottom
first, and the root package's own modules); `test_every_part_is_cleaned` keeps it so."""

_OPTIONAL = "optional heavy package: imported where used, so that estimate, plan and doctor SCRIPT never load it"
HEAVY_PACKAGES = {
    "torch": _OPTIONAL, "transformers": _OPTIONAL, "peft": _OPTIONAL, "datasets": _OPTIONAL,
    "bitsandbytes": _OPTIONAL, "liger_kernel": _OPTIONAL, "deepspeed": _OPTIONAL, "accelerate": _OPTIONAL,
    "safetensors": _OPTIONAL, "tokenizers": _OPTIONAL, "numpy": _OPTIONAL, "pyarrow": _OPTIONAL,
    "matplotlib": "optional: only `fitune profile --plot` and the report's PNG charts draw with it",
    "gguf": "optional: only `fitune export` writes GGUF (and reads a GGUF model's header)",
    "tqdm": "optional: the progress bar when it is installed",
    "wandb": "optional: only `report_to: wandb` logs with it",
    "yaml": "imported only when a YAML file is read or written (a pure command given flags never needs it)",
}
_TORCH = "imports torch at module level"
HEAVY_MODULES = {
    "fitune.runtime.model": _TORCH, "fitune.runtime.step": _TORCH, "fitune.runtime.layers": _TORCH,
    "fitune.runtime.techniques.chunked_loss": _TORCH, "fitune.runtime.techniques.varlen_attention": _TORCH,
    "fitune.parallel.wrap": _TORCH, "fitune.train._parallel_steps": _TORCH,
    "fitune.runtime.techniques.offload": _TORCH,
}
_HELP = "a command's library, loaded when the command runs: `fitune --help` imports every command module"
KEPT_OUT_OF_HELP = {
    "fitune.cli.progress": _HELP, "fitune.doctor.fixes": _HELP, "fitune.doctor.html": _HELP,
    "fitune.doctor.report": _HELP, "fitune.doctor.rules": _HELP, "fitune.export.gguf": _HELP,
    "fitune.infer.evaluate": _HELP, "fitune.infer.load": _HELP, "fitune.infer.merge": _HELP,
    "fitune.memory.suggest": _HELP, "fitune.parallel.launch": _HELP, "fitune.profile.plot": _HELP,
    "fitune.profile.run": _HELP, "fitune.report.doctor": _HELP, "fitune.report.estimate": _HELP,
    "fitune.report.plan": _HELP, "fitune.report.profile": _HELP, "fitune.runtime.device": _HELP,
    "fitune.runtime.oom": _HELP, "fitune.specs.sources": _HELP, "fitune.trace": _HELP, "fitune.train.loop": _HELP,
    "fitune.train.preflight": _HELP, "fitune.translate": _HELP,
}


def _python_files(folder: str):
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for name in sorted(filenames):
            if name.endswith(".py"):
                yield os.path.join(dirpath, name)


def _module_name(path: str, root: str) -> str:
    rel = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
    return rel[: -len(".__init__")] if rel.endswith(".__init__") else rel


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool, root: str) -> list[str]:
    """The absolute dotted modules an import statement loads (`from pkg import sub`: pkg.sub; a name: pkg)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        parts = (module if is_package else module.rpartition(".")[0]).split(".")
        base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
    out = []
    for alias in node.names:
        sub = os.path.join(root, *f"{base}.{alias.name}".split("."))
        out.append(f"{base}.{alias.name}" if os.path.isfile(sub + ".py") or os.path.isdir(sub) else base)
    return sorted(set(out))


def _catches_import_error(node: ast.AST) -> bool:
    return isinstance(node, ast.Try) and any(
        h.type is None or any(name in ast.unparse(h.type) for name in ("ImportError", "ModuleNotFoundError"))
        for h in node.handlers)


def imports_of(path: str, root: str = ROOT, *, guarded: bool = True) -> tuple[list[str], list[tuple[int, str]]]:
    """(modules imported at module level, [(line, module) imported inside a function]); imports under
    `if TYPE_CHECKING:` are left out (they never run), and with `guarded=False` the function-level ones in the body
    of a `try` that catches ImportError (optional by design)."""
    module, is_package = _module_name(path, root), path.endswith("__init__.py")
    top: list[str] = []
    inner: list[tuple[int, str]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        if in_function and not guarded and _catches_import_error(node):
            for child in node.handlers + node.orelse + node.finalbody:
                visit(child, in_function)
            return
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and ast.unparse(child.test).endswith("TYPE_CHECKING"):
                continue
            if isinstance(child, ast.ImportFrom) and child.module == "__future__":
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found = _targets(child, module, is_package, root)
                if in_function:
                    inner.extend((child.lineno, m) for m in found)
                else:
                    top.extend(found)
            else:
                visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(ast.parse(open(path, encoding="utf-8").read(), path), False)
    return top, inner


def _reason(target: str) -> str | None:
    root = target.split(".")[0]
    if root != "fitune":
        return HEAVY_PACKAGES.get(root)
    return HEAVY_MODULES.get(target) or KEPT_OUT_OF_HELP.get(target)


def _checked_files(pkg: str = PKG, parts=CLEANED):
    """The files of `parts` (a package folder, or a module: `config` is fitune/config.py)."""
    for part in parts:
        folder = os.path.join(pkg, part)
        yield from _python_files(folder) if os.path.isdir(folder) else [folder + ".py"]


def unexplained_imports(pkg: str = PKG, parts=CLEANED) -> list[str]:
    """Function-level imports in `parts` of no allowed module, one line each: file:line imports module."""
    root = os.path.dirname(pkg)
    out = []
    for path in _checked_files(pkg, parts):
        for line, target in imports_of(path, root, guarded=False)[1]:
            if _reason(target) is None:
                out.append(f"{os.path.relpath(path, root)}:{line} imports {target} inside a function")
    return out


def test_every_part_is_cleaned():
    parts = {name[:-3] if name.endswith(".py") else name for name in os.listdir(PKG) if name != "__pycache__"}
    assert sorted(parts - set(CLEANED)) == [], "add these parts of fitune/ to CLEANED"
    assert sorted(set(CLEANED) - parts) == [], "CLEANED names parts fitune/ no longer has"


def test_function_level_imports_in_the_cleaned_parts_are_allowed_and_counted():
    lazy = [(path, line) for path in _python_files(PKG) for line, _ in imports_of(path)[1]]
    every = sum(isinstance(n, (ast.Import, ast.ImportFrom)) for path in _python_files(PKG)
                for n in ast.walk(ast.parse(open(path, encoding="utf-8").read())))
    print(f"\nfunction-level imports in fitune/: {len(set(lazy))} of {every} import statements")
    found = unexplained_imports()
    assert not found, ("move these imports to the top of their file, or add the module to an allow-list of "
                       "tests/test_imports_at_top.py with its reason:\n" + "\n".join(found))


def test_the_check_names_a_stdlib_import_inside_a_function(tmp_path):
    pkg = tmp_path / "fitune"
    (pkg / "cli").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "cli" / "__init__.py").write_text("")
    (pkg / "cli" / "x.py").write_text("import os\n\n\ndef f():\n    import json\n    import torch\n    try:\n"
                                      "        import fcntl\n    except ImportError:\n        fcntl = None\n"
                                      "    return json, fcntl\n")
    assert unexplained_imports(str(pkg), ("cli",)) == ["fitune/cli/x.py:5 imports json inside a function"]


def _heavy_at_import(module: str, seen: set[str]) -> bool:
    """Does importing `module` (with its parent packages) load a heavy package, following fitune's module-level
    imports?"""
    parts = module.split(".")
    for name in (".".join(parts[:n]) for n in range(2, len(parts) + 1)):
        if name in seen:
            continue
        seen.add(name)
        base = os.path.join(ROOT, *name.split("."))
        path = base + ".py" if os.path.isfile(base + ".py") else os.path.join(base, "__init__.py")
        for target in imports_of(path)[0] if os.path.isfile(path) else []:
            if target.split(".")[0] in HEAVY_PACKAGES or target.startswith("fitune.") and \
                    _heavy_at_import(target, seen):
                return True
    return False


def test_each_heavy_fitune_module_imports_a_heavy_package():
    light = [m for m in HEAVY_MODULES if not _heavy_at_import(m, set())]
    assert light == [], f"these import no heavy package at import: move their imports to the top instead: {light}"


def _loaded_by_help() -> set[str]:
    code = "import json, sys; import fitune.cli.main; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    return set(json.loads(out.stdout))


def test_the_modules_kept_out_of_help_are_out_of_it_and_imported_lazily_only_where_it_matters():
    loaded = _loaded_by_help()
    assert sorted(m for m in KEPT_OUT_OF_HELP if m in loaded) == [], "`fitune --help` loads these already"
    needless = []
    for path in _checked_files():
        module = _module_name(path, ROOT)
        needless += [f"{module}:{line} {target}" for line, target in imports_of(path, guarded=False)[1]
                     if target in KEPT_OUT_OF_HELP and module not in loaded and target not in HEAVY_MODULES]
    assert needless == [], f"imported lazily from modules `fitune --help` does not load: move them to the top: " \
                           f"{needless}"

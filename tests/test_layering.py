"""The package's layering, read from the source with `ast` (nothing is imported), imports inside functions counted:

- fitune's top-level parts (memory, plan, specs, data, runtime, train, profile, trace, doctor, cli, ...) stand in a
  declared order of layers (`LAYERS`, bottom first): a part imports only parts at or below its own layer, so the
  spine (specs, setup, schema, config) imports nothing above it;
- no import cycle between fitune's parts, nor between the modules inside any package (imports under
  `if TYPE_CHECKING:` are left out of the module check: they never run; the layer check counts them);
- `fitune.profile` is used by nothing but itself and `fitune profile`'s command;
- one model builder, one training step, one optimizer factory (and one place that imports the optimizer registry's
  classes by their dotted names) across fitune/ and bench/.
"""

from __future__ import annotations

import ast
import os
import sys
from collections import defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = os.path.join(ROOT, "fitune")


def _python_files(folder: str):
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        for name in sorted(filenames):
            if name.endswith(".py"):
                yield os.path.join(dirpath, name)


def _module_name(path: str) -> str:
    rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
    return rel[: -len(".__init__")] if rel.endswith(".__init__") else rel


def _is_module(dotted: str) -> bool:
    base = os.path.join(ROOT, *dotted.split("."))
    return os.path.isfile(base + ".py") or os.path.isfile(os.path.join(base, "__init__.py"))


def _type_checking_nodes(tree: ast.Module) -> set[int]:
    """ids of the nodes under `if TYPE_CHECKING:` (imports there are for annotations, never run)."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _dotted(node.test).rpartition(".")[2] == "TYPE_CHECKING":
            for child in node.body:
                out.update(id(n) for n in ast.walk(child))
    return out


def imported_modules(path: str, *, type_checking: bool = True) -> set[str]:
    """Every module `path` imports, at module level or inside functions, as absolute dotted names; without the
    imports under `if TYPE_CHECKING:` when `type_checking` is False. `from pkg import sub` (a submodule) counts as
    importing `pkg.sub` only: `pkg`, its parent package, is loaded before any of its modules anyway."""
    module = _module_name(path)
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    skip = set() if type_checking else _type_checking_nodes(tree)
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module or ""
            submodules = [f"{base}.{a.name}" for a in node.names if _is_module(f"{base}.{a.name}")]
            out.update(submodules)  # `from fitune import data`: the submodule itself
            if len(submodules) < len(node.names):  # a name defined in `base` itself
                out.add(base)
    return out


def _part(dotted: str) -> str | None:
    """fitune.runtime.step -> runtime; fitune.setup -> setup; the root package and other packages -> None."""
    parts = dotted.split(".")
    return parts[1] if parts[0] == "fitune" and len(parts) > 1 else None


#: The declared order of fitune's parts, bottom first: a part may import only parts at or below its own layer
#: (parts of one layer may import each other, without a cycle). The spine (what a run is: specs, setup, schema,
#: config) sits low and imports nothing above it; every command's library sits above what it uses.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("foundation", ("errors", "units", "files")),
    ("catalogs", ("specs",)),  # ModelSpec, GpuSpec and the catalogs with their sources
    ("what a run is", ("schema", "setup", "datasource")),  # TrainSetup, its keys; the data vocabulary
    ("the spine", ("config",)),  # TrainConfig: `fitune train`'s YAML
    ("the estimate", ("memory", "perf")),  # pure Python: the memory model, FLOPs
    ("data", ("data",)),  # read, detect, encode, batch
    ("the planner", ("plan",)),  # search, throughput, plan.yaml / HF code (`plan --data` counts tokens with data)
    ("runtime", ("runtime",)),  # build the model, LoRA, techniques, optimizer, one train_step, OOM
    ("several GPUs", ("parallel",)),  # launch the ranks, wrap, shard
    ("training", ("train",)),  # the loop, checkpoints, the output folder
    ("users of runtime", ("infer", "export", "trace", "profile")),
    ("pages", ("report",)),  # HTML pages from the commands' JSON (doctor --html renders with them)
    ("checks", ("doctor",)),  # script / data / run checks
    ("bridges", ("integrations", "translate")),  # the HF Trainer callback; other trainers' configs
    ("commands", ("cli",)),
    ("entry point", ("__main__",)),
)
LAYER_OF = {part: n for n, (_, parts) in enumerate(LAYERS) for part in parts}

#: Upward imports allowed for now, (file, imported module) -> why and what removes them. The test fails once one no
#: longer occurs, so that the list only shrinks. They are left out of the cycle checks too.
TRANSITIONAL = {
}


def _layer_name(part: str) -> str:
    n = LAYER_OF[part]
    return f"layer {n} ({LAYERS[n][0]})"


def upward_imports() -> list[str]:
    """Every import of a part above the importing file's own, one line each: file, import, both layers."""
    out = []
    for path in _python_files(PKG):
        src = _part(_module_name(path))
        if src is None or src not in LAYER_OF:
            continue
        rel = os.path.relpath(path, ROOT).replace(os.sep, "/")
        for dotted in sorted(imported_modules(path)):
            dst = _part(dotted)
            if dst is None or dst not in LAYER_OF or (rel, dotted) in TRANSITIONAL:
                continue
            if LAYER_OF[dst] > LAYER_OF[src]:
                out.append(f"{rel} imports {dotted}: {src} is {_layer_name(src)}, {dst} is {_layer_name(dst)}")
    return out


def test_every_part_has_a_declared_layer():
    parts = {_part(_module_name(p)) for p in _python_files(PKG)} - {None}
    declared = [part for _, names in LAYERS for part in names]
    assert len(declared) == len(set(declared)), f"a part declared twice in LAYERS: {declared}"
    new, gone = sorted(parts - set(declared)), sorted(set(declared) - parts)
    assert new == [], f"place these parts of fitune/ in LAYERS (tests/test_layering.py): {new}"
    assert gone == [], f"LAYERS names parts fitune/ no longer has; remove them: {gone}"


def test_parts_import_only_parts_at_or_below_their_layer():
    found = upward_imports()
    assert not found, "upward imports (the declared order is LAYERS in tests/test_layering.py):\n" + "\n".join(found)


def test_the_transitional_upward_imports_still_exist():
    gone = [f"{f} -> {d}" for f, d in TRANSITIONAL if d not in imported_modules(os.path.join(ROOT, f))]
    assert gone == [], f"no longer imported: remove them from TRANSITIONAL: {gone}"


def test_the_layer_check_finds_an_upward_import(tmp_path, monkeypatch):
    """A spine module importing data is named, with both layers."""
    pkg = tmp_path / "fitune"
    (pkg / "data").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "data" / "__init__.py").write_text("X = 1\n")
    (pkg / "config.py").write_text("def f():\n    from .data import X\n    return X\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", str(tmp_path))
    monkeypatch.setattr(sys.modules[__name__], "PKG", str(pkg))
    assert upward_imports() == [
        "fitune/config.py imports fitune.data: config is layer 3 (the spine), data is layer 5 (data)"]


def part_graph() -> dict[str, dict[str, list[str]]]:
    """{part: {imported part: [the importing files]}} over fitune/, self-imports and TRANSITIONAL imports left out."""
    graph: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for path in _python_files(PKG):
        src = _part(_module_name(path))
        if src is None:  # fitune/__init__.py stands above every part (fitune.oom_report imports runtime)
            continue
        rel = os.path.relpath(path, ROOT).replace(os.sep, "/")
        for dotted in imported_modules(path):
            if (rel, dotted) in TRANSITIONAL:
                continue
            dst = _part(dotted)
            if dst is not None and dst != src:
                graph[src][dst].append(os.path.relpath(path, ROOT))
    return graph


def cycles(graph) -> list[list[str]]:
    """The strongly connected components with more than one part (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(set(graph) | {w for edges in graph.values() for w in edges}):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_between_fitunes_parts():
    graph = part_graph()
    found = cycles(graph)
    lines = []
    for component in found:
        lines.append(" <-> ".join(component) + ":")
        for a in component:
            for b in component:
                if b in graph.get(a, {}):
                    lines.append(f"  {a} -> {b}: {', '.join(sorted(set(graph[a][b])))}")
    assert not found, "import cycles between fitune's parts:\n" + "\n".join(lines)


def test_the_cycle_finder_finds_cycles():
    graph = {"train": {"profile": ["x"]}, "profile": {"runtime": ["y"], "train": ["z"]}, "runtime": {}}
    assert cycles(graph) == [["profile", "train"]]


def module_graph() -> dict[str, dict[str, list[str]]]:
    """{module: {imported module: [the importing file]}} over fitune/'s modules (package __init__s included), imports
    under `if TYPE_CHECKING:` left out (they never run, so they make no cycle at import), TRANSITIONAL ones too."""
    graph: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for path in _python_files(PKG):
        src = _module_name(path)
        rel = os.path.relpath(path, ROOT).replace(os.sep, "/")
        for dotted in imported_modules(path, type_checking=False):
            if dotted != src and dotted.startswith("fitune.") and _is_module(dotted) \
                    and (rel, dotted) not in TRANSITIONAL:
                graph[src][dotted].append(rel)
    return graph


def test_no_import_cycle_between_modules_inside_any_package():
    graph = module_graph()
    found = cycles(graph)
    lines = []
    for component in found:
        lines.append(" <-> ".join(component) + ":")
        lines += [f"  {a} -> {b}" for a in component for b in component if b in graph.get(a, {})]
    assert not found, "import cycles between fitune's modules:\n" + "\n".join(lines)


def test_only_profile_and_its_command_import_fitune_profile():
    users = []
    for folder in (PKG, os.path.join(ROOT, "bench")):
        for path in _python_files(folder):
            rel = os.path.relpath(path, ROOT)
            if rel.startswith(os.path.join("fitune", "profile") + os.sep) or rel == os.path.join("fitune", "cli",
                                                                                                 "profile.py"):
                continue
            # fitune.profile.accuracy (the estimate against the GPU records; pure Python, no run) is read by the
            # README's table generator too: it builds nothing
            if any((d == "fitune.profile" or d.startswith("fitune.profile.")) and d != "fitune.profile.accuracy"
                   for d in imported_modules(path)):
                users.append(rel)
    assert users == [], f"these import fitune.profile (use fitune.runtime): {users}"


# ---- one of each ---------------------------------------------------------------------------------------------

#: Functions allowed to be a second builder / step / optimizer factory, with the reason.
ALLOWED = {
    # issue 14's peers: the other stacks as their users write them (the HF Trainer, a plain loop on transformers +
    # PEFT), measured beside fitune; built on fitune's runtime they would not be the peers
    ("bench/peers/hf_trainer.py", "body"),
    ("bench/peers/hf_loop.py", "body"),
    ("bench/peers/real_length.py", "_load_model"),
    ("bench/peers/peerlib.py", "plain_loop"),  # the loop people write, shared by hf_loop.py and unsloth_run.py
    ("bench/peers/unsloth_run.py", "unsloth_plain_loop"),  # issue 32: Unsloth's model in that loop, fused AdamW
    # one decoder layer's forward and backward under saved_tensors_hooks: a measurement of what autograd saves,
    # not a training step
    ("bench/compile_saved.py", "saved_by_layer"),
    # the loss op alone (lm_head + cross-entropy) forward and backward, per kernel: a microbenchmark, not a step
    ("bench/loss_kernels.py", "measure"),
    # one micro-batch's forward (fitune's forward_loss) and backward, its gradients compared compiled against eager,
    # no optimizer: a parity check, not a step
    ("bench/compile_parity.py", "grads_of"),
    # issue 30: the reference fitune's runner is checked against, a plain transformers + PEFT loop written without
    # fitune's runtime (built on it, it would check fitune against itself)
    ("bench/train_parity.py", "build_reference_model"),
    ("bench/train_parity.py", "reference_run"),
}


def _dotted(node) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def _imports_torch(tree) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "torch" for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            return True
    return False


def _registry_builds() -> list[str | None]:
    """Each optimizer registry entry's `build=` (the dotted class it builds: `torch.optim.AdamW`; None where it is
    not a literal), read from fitune/specs/optimizers.py's source: an entry added there is recognised here with no
    edit."""
    tree = ast.parse(open(os.path.join(PKG, "specs", "optimizers.py"), encoding="utf-8").read())
    entries = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and _dotted(n.func) == "OptimizerSpec"]
    return [next((k.value.value for k in n.keywords if k.arg == "build" and isinstance(k.value, ast.Constant)), None)
            for n in entries]


REGISTRY_CLASSES = frozenset(_registry_builds())


def _kinds(func, uses_torch: bool) -> set[str]:
    """What `func` itself does (nested functions are inspected on their own). An optimizer factory constructs an
    optimizer: it names a class of torch.optim / bitsandbytes.optim or one the registry builds (the dotted name, or
    a call by the bare class name: `Adafactor(...)`), or it calls the class the registry's dotted name resolves to
    (`optimizer_class(spec)(...)`). An optimizer class resolver imports a registry entry's `build` by name."""
    kinds = set()
    bare = {c.rpartition(".")[2] for c in REGISTRY_CLASSES}
    imports_by_name = reads_build = False
    todo = list(ast.iter_child_nodes(func))
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            continue
        todo.extend(ast.iter_child_nodes(node))
        if isinstance(node, ast.Attribute):
            name = _dotted(node)
            head, _, last = name.rpartition(".")
            if (head in ("torch.optim", "bnb.optim", "bitsandbytes.optim") and last[:1].isupper()
                    and last != "Optimizer") or name in REGISTRY_CLASSES:
                kinds.add("optimizer factory")
            reads_build = reads_build or node.attr == "build"
        if isinstance(node, ast.Call):
            name = _dotted(node.func)
            if name.rpartition(".")[2] in bare:
                kinds.add("optimizer factory")
            if isinstance(node.func, ast.Call) and _dotted(node.func.func).endswith("optimizer_class"):
                kinds.add("optimizer factory")  # the class the registry names, constructed
            imports_by_name = imports_by_name or name.endswith("import_module") or name == "__import__"
            if name.endswith(("ForCausalLM.from_pretrained", "ForCausalLM.from_config")):
                kinds.add("model builder")
            # `x.backward()`: a training step; torch.autograd.backward inside a custom op's backward is not one,
            # nor the pure-Python estimator's own tape (its modules import no torch)
            if uses_torch and isinstance(node.func, ast.Attribute) and node.func.attr == "backward" \
                    and name != "torch.autograd.backward":
                kinds.add("training step")
    if imports_by_name and reads_build:
        kinds.add("optimizer class resolver")
    return kinds


def one_of_each() -> dict[str, list[str]]:
    found: dict[str, list[str]] = defaultdict(list)
    for folder in (PKG, os.path.join(ROOT, "bench")):
        for path in _python_files(folder):
            rel = os.path.relpath(path, ROOT).replace(os.sep, "/")
            tree = ast.parse(open(path, encoding="utf-8").read(), path)
            uses_torch = _imports_torch(tree)
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and (rel, node.name) not in ALLOWED:
                    for kind in _kinds(node, uses_torch):
                        found[kind].append(f"{rel}:{node.name}")
    return found


def test_one_model_builder_one_step_one_optimizer_factory():
    found = one_of_each()
    assert found == {
        # build_model and the pretrained-loading half it calls (one builder, split for length)
        "model builder": ["fitune/runtime/model.py:build_model", "fitune/runtime/model.py:_from_pretrained"],
        "training step": ["fitune/runtime/step.py:train_step"],
        "optimizer factory": ["fitune/runtime/optim.py:build_optimizer"],
        "optimizer class resolver": ["fitune/runtime/optim.py:optimizer_class"],
    }, dict(found)


def test_the_optimizer_factory_check_knows_every_registry_class():
    """The factory check reads the registry's classes from its source, so a new entry is recognised wherever else it
    would be built, by its dotted name or its bare class name; and it recognises each way of building one."""
    builds = _registry_builds()
    assert len(builds) >= 5 and None not in builds, builds  # every entry's class is a literal this check reads
    assert {"torch.optim.AdamW", "torch.optim.SGD", "bitsandbytes.optim.AdamW8bit", "bitsandbytes.optim.PagedAdamW8bit",
            "transformers.optimization.Adafactor"} <= REGISTRY_CLASSES
    for source in ("def f(p):\n    return transformers.optimization.Adafactor(p)\n",
                   "def f(p):\n    return PagedAdamW8bit(p, lr=1)\n",
                   "def f(p):\n    return torch.optim.RMSprop(p)\n",
                   "def f(spec, p):\n    return optimizer_class(spec)(p, lr=1)\n"):
        assert _kinds(ast.parse(source).body[0], True) == {"optimizer factory"}, source
    resolver = ("def f(spec):\n    m, _, a = spec.build.rpartition('.')\n"
                "    return getattr(importlib.import_module(m), a)\n")
    assert _kinds(ast.parse(resolver).body[0], True) == {"optimizer class resolver"}

"""`ScriptIndex`: the facts the script rules ask about, read once from a training script's syntax tree.

The script is parsed with `ast` and never run. Names are resolved through the script's imports
(`from transformers import AutoModelForCausalLM as AM` makes `AM.from_pretrained` read as
`transformers.AutoModelForCausalLM.from_pretrained`); simple constants (`MAX_LEN = 2048`, argparse defaults,
dataclass field defaults) are resolved so `max_length=MAX_LEN` reads as 2048. Anything not resolvable is UNKNOWN,
and rules treat UNKNOWN as "cannot tell" - they do not guess.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Callable


class _Unknown:
    def __repr__(self) -> str:
        return "UNKNOWN"

    def __bool__(self) -> bool:
        return False


UNKNOWN = _Unknown()
"""A value the script computes at run time (or that this index does not follow)."""

TRAINER_CLASSES = ("Trainer", "Seq2SeqTrainer", "SFTTrainer", "DPOTrainer", "ORPOTrainer", "KTOTrainer",
                   "GRPOTrainer", "RewardTrainer", "PPOTrainer", "CPOTrainer")
TRAINER_CONFIGS = ("SFTConfig", "DPOConfig", "ORPOConfig", "KTOConfig", "GRPOConfig", "RewardConfig", "CPOConfig")
"""TRL's argument classes (subclasses of TrainingArguments with other names)."""
PEFT_CALLS = ("get_peft_model", "LoraConfig", "AdaLoraConfig", "IA3Config", "LoHaConfig", "LoKrConfig",
              "prepare_model_for_kbit_training", "add_adapter", "inject_adapter_in_model")
GRAD_OFF_CONTEXTS = ("no_grad", "inference_mode")
UNSLOTH_LOADERS = ("FastLanguageModel", "FastModel", "FastVisionModel")
"""Unsloth's model classes: `X.from_pretrained(...)` loads (dtype=None: Unsloth picks bf16 where the GPU has it,
else fp16; load_in_4bit defaults to True), `X.get_peft_model(model, ...)` adds LoRA."""
_ARITHMETIC = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
               ast.FloorDiv: lambda a, b: a // b, ast.Div: lambda a, b: a / b}
"""Arithmetic on literals the index evaluates (`2 * 256`, `MAX_LEN // 2`)."""
_SURROGATE = re.compile("[\ud800-\udfff]")
"""Half of a UTF-16 pair: a string literal may hold one (`'\\ud800'`), no output can write it."""
MAX_LITERAL_BITS = 4096
"""The largest integer arithmetic on literals makes (about 1,233 digits): past it the value is unknown, so that
multiplying 400-digit literals never builds a number Python cannot print (4,300 digits) or takes long to."""
DTYPE_ALIASES = {
    "float32": "fp32", "float": "fp32", "fp32": "fp32",
    "bfloat16": "bf16", "bf16": "bf16",
    "float16": "fp16", "half": "fp16", "fp16": "fp16",
    "auto": "auto",
}


@dataclass
class Call:
    """One call in the script, with where it sits."""

    node: ast.Call
    name: str
    """The callee as a dotted name with imports resolved ("torch.cuda.empty_cache", "model.train"); "" if opaque."""
    function: str
    """The innermost enclosing `def` ("" at module level)."""
    scope: int
    """An id of the innermost enclosing def (0 = module): calls in the same scope share it."""
    in_loop: bool
    """Inside a `for`/`while` body of its own function."""
    grad_disabled: bool
    """Inside `with torch.no_grad()` / `torch.inference_mode()`, or a function decorated with one of them."""

    @property
    def line(self) -> int:
        return self.node.lineno

    @property
    def tail(self) -> str:
        return self.name.rsplit(".", 1)[-1]

    @property
    def receiver(self) -> str:
        """`model` for `model.train()`; "" for a plain function call."""
        return self.name.rsplit(".", 1)[0] if "." in self.name else ""

    @property
    def open_kwargs(self) -> bool:
        """`f(**kwargs)`: any keyword may be set without this index seeing it."""
        return any(k.arg is None for k in self.node.keywords)

    def kw(self, name: str) -> ast.expr | None:
        for k in self.node.keywords:
            if k.arg == name:
                return k.value
        return None

    def has_kw(self, *names: str) -> bool:
        return any(self.kw(n) is not None for n in names)

    def arg(self, i: int) -> ast.expr | None:
        args = self.node.args
        return args[i] if i < len(args) and not isinstance(args[i], ast.Starred) else None


@dataclass
class Assignment:
    """`target = value` (also `target += value` with `augmented`), targets written as dotted text or `x["key"]`."""

    target: str
    value: ast.expr
    line: int
    scope: int
    in_loop: bool
    grad_disabled: bool
    augmented: bool = False


@dataclass
class _Context:
    function: str = ""
    scope: int = 0
    in_loop: bool = False
    grad_disabled: bool = False


@dataclass
class ScriptIndex:
    """Everything the rules read: calls, assignments, imports, constants, class bases."""

    tree: ast.Module
    calls: list[Call] = field(default_factory=list)
    assignments: list[Assignment] = field(default_factory=list)
    imports: dict[str, str] = field(default_factory=dict)
    constants: dict[str, object] = field(default_factory=dict)
    """NAME -> literal, for names bound once to a literal anywhere in the script."""
    attr_defaults: dict[str, object] = field(default_factory=dict)
    """attribute -> literal: argparse `--max-length` defaults and dataclass field defaults (`args.max_length`)."""
    class_bases: dict[str, list[str]] = field(default_factory=dict)
    setup_overrides: dict = field(default_factory=dict)
    """TrainSetup fields given on the command line (`fitune doctor --seq-len 4096`): they win over the script."""
    model_override: str | None = None
    """`fitune doctor --model NAME`: the model to estimate when the script's is not recognised."""
    gpu: str | None = None
    """`fitune doctor --gpu`: the GPU the script's estimates are judged on (default rtx4090)."""
    read_setup: Callable[..., Any] | None = None
    """How `script_setup` is read: `fitune.doctor.extract.extract_setup`, handed in by whoever builds the index
    (`fitune.doctor.script.index_source`), so that the index imports nothing of the doctor's above it."""

    @classmethod
    def build(cls, tree: ast.Module, setup_overrides: dict | None = None, model_override: str | None = None,
              gpu: str | None = None, read_setup: Callable[..., Any] | None = None) -> "ScriptIndex":
        ix = cls(tree, setup_overrides=dict(setup_overrides or {}), model_override=model_override, gpu=gpu,
                 read_setup=read_setup)
        ix._collect_imports()
        ix._collect_constants()
        _Walker(ix).visit_body(tree.body, _Context())
        return ix

    # ---- names and values ---------------------------------------------------------------------------------------
    def dotted(self, node: ast.AST | None) -> str:
        """`torch.cuda.empty_cache` -> "torch.cuda.empty_cache" (imports resolved); `f(x).to` -> "f().to"."""
        parts = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        if isinstance(node, ast.Name):
            parts.append(self.imports.get(node.id, node.id))
        elif isinstance(node, ast.Call):
            inner = self.dotted(node.func)
            parts.append(f"{inner}()" if inner else "()")
        else:
            return ""
        return ".".join(reversed(parts))

    def value(self, node: ast.AST | None):
        """The literal a node stands for, or UNKNOWN. Dotted references (torch.float32) come back as their text."""
        if node is None:
            return UNKNOWN
        if isinstance(node, ast.Constant):
            if isinstance(node.value, str) and _SURROGATE.search(node.value):
                # '\ud800' in the script: kept as its escape, which a terminal and a JSON file can write
                return node.value.encode("utf-8", "backslashreplace").decode("utf-8")
            return node.value
        if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
            items = [self.value(e) for e in node.elts]
            return UNKNOWN if any(i is UNKNOWN for i in items) else items
        if isinstance(node, ast.Dict):
            if any(k is None for k in node.keys):
                return UNKNOWN
            keys = [self.value(k) for k in node.keys]
            vals = [self.value(v) for v in node.values]
            if any(k is UNKNOWN for k in keys):
                return UNKNOWN
            try:
                return dict(zip(keys, vals))
            except TypeError:  # a key that is a list or a dict (`{[1]: 2}`): Python itself would refuse it
                return UNKNOWN
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            v = self.value(node.operand)
            return -v if isinstance(v, (int, float)) and not isinstance(v, bool) else UNKNOWN
        if isinstance(node, ast.BinOp) and isinstance(node.op, tuple(_ARITHMETIC)):  # lora_alpha=2 * 256
            left, right = self.value(node.left), self.value(node.right)
            if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (left, right)):
                try:
                    result = _ARITHMETIC[type(node.op)](left, right)
                except (ZeroDivisionError, OverflowError):  # `x / 0`; a 400-digit integer over a float
                    return UNKNOWN
                if isinstance(result, int) and result.bit_length() > MAX_LITERAL_BITS:
                    return UNKNOWN  # products of huge literals: no setting is that large, and str() would refuse it
                return result
            return UNKNOWN
        if isinstance(node, ast.Name):
            if node.id in self.constants:
                return self.constants[node.id]
            return UNKNOWN
        if isinstance(node, ast.Attribute):
            local = isinstance(node.value, ast.Name) and node.value.id not in self.imports
            if local and node.attr in self.attr_defaults:  # args.max_length, cfg.max_length
                return self.attr_defaults[node.attr]
            text = self.dotted(node)
            return Ref(text) if text else UNKNOWN
        if isinstance(node, ast.Call) and self.dotted(node.func) == "dict":
            if node.args or any(k.arg is None for k in node.keywords):
                return UNKNOWN
            return {k.arg: self.value(k.value) for k in node.keywords}
        return UNKNOWN

    def dtype_of(self, node: ast.AST | None) -> str | None:
        """"fp32" | "bf16" | "fp16" | "auto" for a dtype argument (torch.bfloat16, "bfloat16", "auto"), else None."""
        v = self.value(node)
        text = v.text if isinstance(v, Ref) else v
        if not isinstance(text, str):
            return None
        return DTYPE_ALIASES.get(text.rsplit(".", 1)[-1].lower())

    def is_true(self, node: ast.AST | None) -> bool:
        return self.value(node) is True

    def is_false(self, node: ast.AST | None) -> bool:
        return self.value(node) is False

    # ---- facts the rules share ------------------------------------------------------------------------------------
    @cached_property
    def script_setup(self):
        """The model and TrainSetup the script runs, each field with its lines (`read_setup`: extract.py)."""
        if self.read_setup is None:
            raise TypeError("this ScriptIndex was built without read_setup; build it with "
                            "fitune.doctor.script.index_source, or call fitune.doctor.extract.extract_setup(ix)")
        return self.read_setup(self, self.setup_overrides, self.model_override, self.gpu)

    def calls_named(self, *tails: str) -> list[Call]:
        return [c for c in self.calls if c.tail in tails]

    @cached_property
    def trainer_classes(self) -> set[str]:
        """Trainer class names, including the script's own subclasses (`class MyTrainer(Trainer)`)."""
        names = set(TRAINER_CLASSES)
        changed = True
        while changed:
            changed = False
            for cls_name, bases in self.class_bases.items():
                if cls_name not in names and any(b.rsplit(".", 1)[-1] in names for b in bases):
                    names.add(cls_name)
                    changed = True
        return names

    @cached_property
    def trainer_calls(self) -> list[Call]:
        return [c for c in self.calls if c.tail in self.trainer_classes]

    @cached_property
    def uses_trainer(self) -> bool:
        return bool(self.trainer_calls)

    @cached_property
    def uses_peft(self) -> bool:
        return (any(c.tail in PEFT_CALLS or c.name.startswith("peft.") for c in self.calls)
                or any(c.has_kw("peft_config") for c in self.calls))

    @cached_property
    def trains(self) -> bool:
        """A Trainer is built, or something calls `.backward(...)` (loss.backward, accelerator.backward)."""
        return self.uses_trainer or any(c.tail == "backward" for c in self.calls)

    @cached_property
    def freezes_parameters(self) -> bool:
        """`requires_grad_(False)`, `p.requires_grad = False`, or PEFT (which freezes the base model)."""
        if self.uses_peft:
            return True
        if any(c.tail == "requires_grad_" and (self.is_false(c.arg(0)) or self.is_false(c.kw("requires_grad")))
               for c in self.calls):
            return True
        return any(a.target.endswith(".requires_grad") and self.is_false(a.value) for a in self.assignments)

    @cached_property
    def model_loads(self) -> list[Call]:
        """`XForCausalLM.from_pretrained(...)` / `AutoModel*.from_pretrained(...)`: loads of model weights."""
        return [c for c in self.calls if c.tail == "from_pretrained" and _is_model_class(c.receiver)]

    @cached_property
    def model_variables(self) -> set[str]:
        """Names holding the model: assigned from a model load or from get_peft_model(...), and `model`."""
        loads = {id(c.node) for c in self.model_loads}
        names = {"model"}
        for a in self.assignments:
            if isinstance(a.value, ast.Call) and (id(a.value) in loads or self.dotted(a.value.func).endswith(
                    "get_peft_model")):
                names.add(a.target)
        return names

    @cached_property
    def training_args(self) -> list[Call]:
        """`TrainingArguments(...)`, `SFTConfig(...)` and the other argument classes of trainers."""
        return [c for c in self.calls if c.tail.endswith("TrainingArguments") or c.tail in TRAINER_CONFIGS]

    @cached_property
    def tokenizer_names(self) -> set[str]:
        """Variables holding a tokenizer: assigned from `*Tokenizer*.from_pretrained`, or named like one."""
        names = {"tokenizer", "tok", "processing_class", "self.tokenizer"}
        for a in self.assignments:
            if isinstance(a.value, ast.Call):
                callee = self.dotted(a.value.func)
                if callee.endswith("from_pretrained") and "Tokenizer" in callee:
                    names.add(a.target)
        return names

    def assignments_to(self, target: str, scope: int | None = None) -> list[Assignment]:
        return [a for a in self.assignments if a.target == target and (scope is None or a.scope == scope)]

    # ---- collection ---------------------------------------------------------------------------------------------
    def _collect_imports(self) -> None:
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.asname:
                        self.imports[a.asname] = a.name
                    else:
                        top = a.name.split(".", 1)[0]
                        self.imports[top] = top
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for a in node.names:
                    self.imports[a.asname or a.name] = f"{node.module}.{a.name}"

    def _collect_constants(self) -> None:
        seen: dict[str, list] = {}
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                seen.setdefault(node.targets[0].id, []).append(node.value)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
                seen.setdefault(node.target.id, []).append(node.value)
                if isinstance(node.value, ast.Constant):  # dataclass field: `max_length: int = 2048`
                    self.attr_defaults[node.target.id] = node.value.value
            elif isinstance(node, ast.ClassDef):
                self.class_bases[node.name] = [self.dotted(b) for b in node.bases]
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                if node.func.attr == "add_argument":
                    self._collect_argparse_default(node)
        for name, values in seen.items():
            if len(values) == 1 and isinstance(values[0], ast.Constant):
                self.constants[name] = values[0].value

    def _collect_argparse_default(self, node: ast.Call) -> None:
        flags = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
        dest = next((k.value.value for k in node.keywords
                     if k.arg == "dest" and isinstance(k.value, ast.Constant)), None)
        if dest is None:
            long_flags = [f for f in flags if f.startswith("--")]
            if not long_flags:
                return
            dest = long_flags[0][2:].replace("-", "_")
        default = next((k.value for k in node.keywords if k.arg == "default"), None)
        if isinstance(default, ast.Constant):
            self.attr_defaults[dest] = default.value


@dataclass(frozen=True)
class Ref:
    """A dotted reference the index does not evaluate, e.g. torch.float32."""

    text: str


ENCODE_METHODS = ("encode", "encode_plus", "batch_encode_plus", "__call__", "apply_chat_template")
"""A tokenizer's methods that turn text into token ids."""


def tokenizer_calls(ix: ScriptIndex) -> list[Call]:
    """`tokenizer(...)`, `tokenizer.encode(...)`, `tok.apply_chat_template(..., tokenize=True)` on known tokenizers."""
    out = []
    for c in ix.calls:
        direct = c.name in ix.tokenizer_names
        method = c.receiver in ix.tokenizer_names and c.tail in ENCODE_METHODS
        if not (direct or method):
            continue
        if c.tail == "apply_chat_template" and not ix.is_true(c.kw("tokenize")) and c.kw("tokenize") is not None:
            continue  # tokenize=False returns text
        out.append(c)
    return out


def is_unsloth_loader(receiver: str) -> bool:
    """`unsloth.FastLanguageModel`, `FastModel`, `FastVisionModel` (as imported, or bare)."""
    return receiver.rsplit(".", 1)[-1] in UNSLOTH_LOADERS


def _is_model_class(receiver: str) -> bool:
    """AutoModelForCausalLM, LlamaForCausalLM, AutoModel, FastLanguageModel...; not tokenizers, configs, adapters."""
    cls = receiver.rsplit(".", 1)[-1]
    if not cls or any(s in cls for s in ("Tokenizer", "Config", "Processor", "FeatureExtractor")):
        return False
    if cls == "PeftModel" or (cls.startswith("PeftModel") and "For" in cls):
        return False  # PeftModel.from_pretrained(base, adapter_dir) loads adapters onto an already loaded base
    return cls.startswith("AutoModel") or "For" in cls or cls.endswith(("Model", "LM"))


class _Walker:
    """Walks statements keeping the context (function, loop, no_grad) and records calls and assignments."""

    def __init__(self, ix: ScriptIndex):
        self.ix = ix
        self.next_scope = 1

    def visit_body(self, body: list[ast.stmt], ctx: _Context) -> None:
        for stmt in body:
            self.visit_stmt(stmt, ctx)

    def visit_stmt(self, stmt: ast.stmt, ctx: _Context) -> None:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for d in stmt.decorator_list:
                self.visit_expr(d, ctx)
            grad_off = any(self._is_grad_off(d) for d in stmt.decorator_list)
            inner = _Context(function=stmt.name, scope=self.next_scope, in_loop=False, grad_disabled=grad_off)
            self.next_scope += 1
            self.visit_body(stmt.body, inner)
            return
        if isinstance(stmt, ast.ClassDef):
            self.visit_body(stmt.body, ctx)
            return
        if isinstance(stmt, (ast.For, ast.AsyncFor, ast.While)):
            self.visit_expr(stmt.iter if not isinstance(stmt, ast.While) else stmt.test, ctx)
            loop = _Context(ctx.function, ctx.scope, True, ctx.grad_disabled)
            self.visit_body(stmt.body, loop)
            self.visit_body(stmt.orelse, ctx)
            return
        if isinstance(stmt, (ast.With, ast.AsyncWith)):
            grad_off = ctx.grad_disabled
            for item in stmt.items:
                self.visit_expr(item.context_expr, ctx)
                grad_off = grad_off or self._is_grad_off(item.context_expr)
            self.visit_body(stmt.body, _Context(ctx.function, ctx.scope, ctx.in_loop, grad_off))
            return
        if isinstance(stmt, ast.Assign):
            for t in stmt.targets:
                self._record_assignment(t, stmt.value, stmt.lineno, ctx)
        elif isinstance(stmt, ast.AugAssign) and isinstance(stmt.op, ast.Add):
            self._record_assignment(stmt.target, stmt.value, stmt.lineno, ctx, augmented=True)
        elif isinstance(stmt, ast.AnnAssign) and stmt.value is not None:
            self._record_assignment(stmt.target, stmt.value, stmt.lineno, ctx)
        for child in ast.iter_child_nodes(stmt):
            if isinstance(child, ast.stmt):
                self.visit_stmt(child, ctx)
            elif isinstance(child, ast.expr):
                self.visit_expr(child, ctx)
            elif isinstance(child, ast.excepthandler):
                self.visit_body(child.body, ctx)
            elif isinstance(child, ast.match_case):
                self.visit_body(child.body, ctx)

    def visit_expr(self, expr: ast.expr, ctx: _Context) -> None:
        for node in ast.walk(expr):
            if isinstance(node, ast.Call):
                self.ix.calls.append(Call(node, self.ix.dotted(node.func), ctx.function, ctx.scope, ctx.in_loop,
                                          ctx.grad_disabled))
            elif isinstance(node, ast.Dict):  # {"labels": ...} builds a batch as much as batch["labels"] = ...
                for k, v in zip(node.keys, node.values):
                    if isinstance(k, ast.Constant) and isinstance(k.value, str):
                        self.ix.assignments.append(Assignment(f'["{k.value}"]', v, v.lineno, ctx.scope,
                                                              ctx.in_loop, ctx.grad_disabled))

    def _record_assignment(self, target: ast.expr, value: ast.expr, line: int, ctx: _Context,
                           augmented: bool = False) -> None:
        targets = target.elts if isinstance(target, (ast.Tuple, ast.List)) else [target]
        for t in targets:
            text = _target_text(self.ix, t)
            if text:
                self.ix.assignments.append(Assignment(text, value, line, ctx.scope, ctx.in_loop, ctx.grad_disabled,
                                                      augmented))

    def _is_grad_off(self, node: ast.expr) -> bool:
        """torch.no_grad(), torch.inference_mode(), torch.set_grad_enabled(False), and the bare decorator forms."""
        func = node.func if isinstance(node, ast.Call) else node
        name = self.ix.dotted(func)
        tail = name.rsplit(".", 1)[-1]
        if tail in GRAD_OFF_CONTEXTS:
            return True
        if tail == "set_grad_enabled" and isinstance(node, ast.Call) and node.args:
            return self.ix.is_false(node.args[0])
        return False


def _target_text(ix: ScriptIndex, t: ast.expr) -> str:
    """`labels` -> "labels"; `model.config.use_cache` -> "model.config.use_cache"; `batch["labels"]` -> '["labels"]'."""
    if isinstance(t, (ast.Name, ast.Attribute)):
        return ix.dotted(t)
    if isinstance(t, ast.Subscript):
        key = t.slice
        if isinstance(key, ast.Constant) and isinstance(key.value, str):
            return f'["{key.value}"]'
    return ""

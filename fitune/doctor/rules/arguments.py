"""Rules about the values handed to the trainer, the adapter config and the optimizer: a number written as a string."""

from __future__ import annotations

import ast
import re
from typing import Iterator

from ..findings import ERROR
from ..index import Call, ScriptIndex, is_unsloth_loader
from .base import Hit, call_text, rule

CHECKED_WITH = "transformers 5.17, torch 2.13, PEFT 0.21"
"""The versions the failures below were reproduced with (on the CPU; tests/test_doctor_issue31.py re-runs two)."""
ADAM_CHECK = "AdamW raises TypeError: '<=' not supported between instances of 'float' and 'str'"
"""torch/optim/adam.py checks `0.0 <= lr` (and eps, betas, weight_decay) when the optimizer is built."""
TRAINER_NUMBERS = {
    "learning_rate": f"when the Trainer builds the optimizer, {ADAM_CHECK}",
    "adam_beta1": f"when the Trainer builds the optimizer, {ADAM_CHECK}",
    "adam_beta2": f"when the Trainer builds the optimizer, {ADAM_CHECK}",
    "adam_epsilon": f"when the Trainer builds the optimizer, {ADAM_CHECK}",
    "weight_decay": "the first optimizer step raises TypeError (AdamW's kernel is handed weight_decay as a str)",
    "max_grad_norm": "the first optimizer step raises TypeError: '>' not supported between instances of 'str' and "
                     "'int' (the Trainer's gradient clipping)",
    "num_train_epochs": "trainer.train() raises TypeError: '>' not supported between instances of 'str' and 'int'",
    "gradient_accumulation_steps": "trainer.train() raises TypeError: unsupported operand type(s) for //: 'int' "
                                   "and 'str'",
    "per_device_train_batch_size": "the DataLoader raises ValueError: batch_size should be a positive integer value",
    "warmup_steps": "TrainingArguments(...) itself raises TypeError: '<' not supported between instances of 'str' "
                    "and 'int'",
    "warmup_ratio": "",
    "max_steps": "",
    "max_length": "",
    "max_seq_length": "",
}
"""TrainingArguments / SFTConfig keywords that must be numbers -> what a string does (checked with CHECKED_WITH;
"" where not reproduced: the TypeError where the value is first compared or computed with)."""
LORA_NUMBERS = {
    "r": "get_peft_model raises TypeError: '<=' not supported between instances of 'str' and 'int' "
         "(peft/tuners/lora/layer.py)",
    "lora_alpha": "get_peft_model raises TypeError: unsupported operand type(s) for /: 'str' and 'int' "
                  "(peft/tuners/lora/layer.py)",
    "lora_dropout": "get_peft_model raises TypeError: '>' not supported between instances of 'str' and 'float' "
                    "(peft/tuners/lora/layer.py)",
}
OPTIMIZER_NUMBERS = ("lr", "weight_decay", "eps", "momentum", "alpha")
OPTIMIZERS = ("AdamW", "Adam", "SGD", "Adafactor", "AdamW8bit", "Adam8bit", "PagedAdamW", "PagedAdamW8bit",
              "PagedAdamW32bit", "AdamW32bit", "Lion", "Lion8bit", "RMSprop", "Adagrad", "Adamax", "NAdam", "RAdam")
"""Optimizer classes of torch.optim, bitsandbytes.optim and transformers."""
OPTIMIZER_MODULES = ("torch.optim", "bitsandbytes", "bnb", "transformers")
ENV_READS = ("os.environ.get", "os.getenv", "os.environ.setdefault")
YAML_FLOAT = re.compile(r"([+-]?\d+)([eE][+-]?\d+)")
"""`2e-4`: YAML 1.1 (PyYAML's yaml.safe_load) reads it as a string; it needs a dot (2.0e-4)."""
NUMBER_LITERAL = re.compile(r"[+-]?(\d[\d_]*\.?\d*|\.\d+)([eE][+-]?\d+)?")
"""A string that is a Python number literal once the quotes go: "2e-4", "16", "0.05"."""


@rule("string-hyperparameter", ERROR, "a number (learning rate, epochs, LoRA r, ...) given as a string")
def string_hyperparameter(ix: ScriptIndex) -> Iterator[Hit]:
    """`TrainingArguments(learning_rate="2e-4")`: nothing converts the string, and training stops with a TypeError
    (or ValueError) where the value is first used, after the model has loaded."""
    for call, owner, keys in _sites(ix):
        by_line: dict[int, list[tuple[str, str, str | None, str]]] = {}
        for kw, failure in keys.items():
            found = _string_value(ix, call.kw(kw))
            if found is not None:
                by_line.setdefault(call.kw(kw).lineno, []).append((kw, *found, failure or GENERIC_FAILURE))
        for line, items in by_line.items():  # one finding per line (the doctor keeps one per rule and line)
            yield _hit(line, call, owner, items)


GENERIC_FAILURE = "a TypeError is raised where the value is first compared or computed with"


def _hit(line: int, call: Call, owner: str, items: list[tuple[str, str, str | None, str]]) -> Hit:
    """The finding for the string keywords `items` (keyword, as written, the string, what it does) on one line."""
    written = ", ".join(f"`{kw}={text}`" for kw, text, _, _ in items)
    if len(items) == 1:
        head = f"{written} in `{call_text(call)}` is a string where {owner} expects a number. Nothing converts it"
        what = items[0][3]
    else:
        head = f"{written} in `{call_text(call)}` are strings where {owner} expects numbers. Nothing converts them"
        what = "; ".join(f"{kw}: {failure}" for kw, _, _, failure in items)
    adam = any("AdamW" in failure for *_, failure in items)
    return Hit(line, f"{head}, so the run stops after the model has loaded: {what}.",
               "; ".join(_fix(kw, value, text) for kw, text, value, _ in items),
               f"checked on the CPU with {CHECKED_WITH}: each keyword given as a string, the run stopped as said "
               "(fitune's tests re-run learning_rate and LoRA r); " + (
                   "source: torch/optim/adam.py checks 0.0 <= lr when AdamW is built" if adam
                   else "source: the Python comparison or arithmetic where the value is first used"))


def _sites(ix: ScriptIndex) -> Iterator[tuple[Call, str, dict[str, str]]]:
    """(call, who expects the numbers, keywords to check) for every call that takes numeric hyper-parameters."""
    for c in ix.training_args:
        yield c, c.tail, TRAINER_NUMBERS
    for c in ix.calls:
        if c.tail == "LoraConfig" or (c.tail == "get_peft_model" and is_unsloth_loader(c.receiver)):
            yield c, "PEFT" if c.tail == "LoraConfig" else "Unsloth (PEFT underneath)", LORA_NUMBERS
        elif c.tail in OPTIMIZERS and (c.name == c.tail or c.name.startswith(OPTIMIZER_MODULES)):
            checks = {k: (ADAM_CHECK.replace("AdamW", f"{c.tail}(...)") + " as it is built"
                          if c.tail in ("AdamW", "Adam") and c.name.startswith("torch.optim") else "")
                      for k in OPTIMIZER_NUMBERS}
            yield c, c.tail, checks


def _string_value(ix: ScriptIndex, node: ast.expr | None) -> tuple[str, str | None] | None:
    """(the value as written, the string when known) when `node` is a string at run time: a literal, a name bound
    once to one, or a read of an environment variable (always a str when set). None otherwise, and for argparse /
    dataclass defaults, which argparse converts with `type=`."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return repr(node.value), node.value
    if isinstance(node, ast.Name) and isinstance(ix.constants.get(node.id), str):
        return f"{node.id} (= {ix.constants[node.id]!r})", ix.constants[node.id]
    if isinstance(node, ast.Call) and ix.dotted(node.func) in ENV_READS:
        return ast.unparse(node), None
    if isinstance(node, ast.Subscript) and ix.dotted(node.value) == "os.environ":
        return ast.unparse(node), None
    return None


def _fix(kw: str, value: str | None, written: str) -> str:
    """What to write instead; `written` is the argument as written (a constant's name: the fix goes where it is set)."""
    if value is None:  # an environment variable
        return f"convert it: {kw}=float(os.environ.get(...)) (int(...) for a count)"
    text = value.strip()
    name = written.split(" (= ", 1)[0] if " (= " in written else None
    if not NUMBER_LITERAL.fullmatch(text):
        return f"pass a number for {kw}" + (f": {kw}=float({value!r})" if _is_float(text) else "")
    fix = (f"write the number without quotes where {name} is set: {name} = {text}" if name else
           f"write the number without quotes: {kw}={text}")
    m = YAML_FLOAT.fullmatch(text)
    if m:
        fix += (f" (from a YAML file: yaml.safe_load reads {text} as a string; write {m[1]}.0{m[2]} there, with a "
                "dot, or convert it with float())")
    return fix


def _is_float(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


RULES = (string_hyperparameter,)

"""What a script rule is: a named function from a `ScriptIndex` to `Hit`s, with its id, severity and claims."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Callable, Iterable

from ..evidence import REFERENCE_MODEL, catalog_name
from ..findings import Finding
from ..index import ScriptIndex


@dataclass(frozen=True)
class Hit:
    """Where a rule fired and what to say; `Rule` turns it into a `Finding`."""

    line: int
    message: str
    fix: str
    evidence: str
    severity: str | None = None
    """Overrides the rule's default severity (a rule may be an error in one form and a warning in another)."""


@dataclass(frozen=True)
class Rule:
    id: str
    severity: str
    """Default severity of its findings."""
    summary: str
    """One line for `fitune doctor --list-rules` and docs/evidence.md."""
    claims: tuple[str, ...]
    check: Callable[[ScriptIndex], Iterable[Hit]]

    def __call__(self, ix: ScriptIndex) -> list[Finding]:
        return [Finding(self.id, h.line, h.severity or self.severity, h.message, h.fix, h.evidence, self.claims)
                for h in self.check(ix)]


def rule(id: str, severity: str, summary: str, claims: tuple[str, ...] = ()):
    """Decorator: `@rule("load-in-fp32", WARNING, "model loaded as float32", ("C10",))` over `def f(ix) -> Hits`."""

    def wrap(check: Callable[[ScriptIndex], Iterable[Hit]]) -> Rule:
        return Rule(id, severity, summary, claims, check)

    return wrap


def known_setup(ix: ScriptIndex):
    """The script's own setup (extract.py) when its model is known (a catalog model in the script, or --model):
    evidence then quotes a live estimate of this very step. None otherwise (or when the script cannot be read that
    far): evidence falls back to the reference cases."""
    try:
        ss = ix.script_setup
    except Exception:  # noqa: BLE001 - an unusual script must not stop the rules; the CLI reports extraction errors
        return None
    return ss if ss.model_known else None


def script_catalog_model(ix: ScriptIndex) -> str | None:
    """The catalog name of the model the script loads (or --model names), or None."""
    ss = known_setup(ix)
    if ss is not None:
        return ss.model
    for load in ix.model_loads:
        value = ix.value(load.arg(0) if load.arg(0) is not None else load.kw("pretrained_model_name_or_path"))
        if isinstance(value, str):
            name = catalog_name(value)
            if name:
                return name
    return None


def script_model(ix: ScriptIndex) -> str:
    """The model to quote estimates for: the script's own when it is in the catalog, else REFERENCE_MODEL."""
    return script_catalog_model(ix) or REFERENCE_MODEL


def call_text(call) -> str:
    """The call as written in the script, arguments elided: `AutoModelForCausalLM.from_pretrained(...)`."""
    return f"{ast.unparse(call.node.func)}(...)"

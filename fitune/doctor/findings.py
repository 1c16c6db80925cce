"""`Finding`: one thing the doctor found, as data. Script rules, the data scan and the run monitor all return these."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..errors import DataError, FituneError  # noqa: F401  (DataError: fitune.doctor's public name)

ERROR = "error"
"""Wrong: the run fails, trains nothing, or silently does not do what the script asks."""
WARNING = "warning"
"""Costs memory or speed for no benefit in the common case; the fix is cheap."""
INFO = "info"
"""A trade-off worth knowing (what it costs), not a mistake."""
SEVERITIES = (ERROR, WARNING, INFO)

JSON_KEYS = ("rule", "line", "severity", "message", "fix", "evidence", "claims")
"""The keys of `Finding.to_dict()`, i.e. of every object `fitune doctor --json` prints. Stable."""


@dataclass(frozen=True)
class Finding:
    """One finding. `evidence` is either a measured figure with the file it comes from, fitune's estimate (validated
    against those measurements), a source reference, or a statement marked "reasoned (not measured)"."""

    rule: str
    """Stable rule id, kebab-case, e.g. "load-in-fp32" (see `fitune doctor --list-rules`)."""
    line: int | None
    """1-based line in the script or data file; None for findings about a run."""
    severity: str
    """error | warning | info."""
    message: str
    """What is wrong and what it costs."""
    fix: str
    """What to change."""
    evidence: str
    """Why fitune believes it (see the class docstring)."""
    claims: tuple[str, ...] = ()
    """Folklore claims (../shared/claims.md, docs/evidence.md) this finding bears on, e.g. ("C10",)."""

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["claims"] = list(self.claims)
        return d


def sort_findings(findings) -> list[Finding]:
    """By line (run-level findings last), then severity (errors first), then rule id."""
    rank = {s: i for i, s in enumerate(SEVERITIES)}
    return sorted(findings, key=lambda f: (f.line is None, f.line or 0, rank.get(f.severity, 9), f.rule))


def worst_exit_code(findings) -> int:
    """The doctor's exit code: 1 when any finding is an error, else 0."""
    return 1 if any(f.severity == ERROR for f in findings) else 0


class ScriptError(FituneError):
    """The script cannot be read or parsed (missing, not UTF-8, not Python)."""

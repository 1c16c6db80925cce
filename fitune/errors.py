"""Typed errors. The CLI catches `FituneError` once, prints its message without a traceback and exits 2."""


class FituneError(Exception):
    """Base class: a problem the user can fix; the message says what went wrong and what to do next."""

    exit_code = 2


class ConfigError(FituneError):
    """A training setup or flag has an impossible or unknown value (all problems listed at once)."""

    def __init__(self, problems: list[str] | str):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        if len(self.problems) == 1:
            msg = self.problems[0]
        else:
            msg = f"{len(self.problems)} problems in the training setup:\n" + "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(msg)


class UnknownModelError(FituneError):
    """A model name that is not in the catalog and is not a path."""


class UnknownGpuError(FituneError):
    """A GPU name that is not in the catalog and is not a memory amount."""


class UnsupportedArchitectureError(FituneError):
    """A config.json whose architecture the analytic engine does not model."""


class DoesNotFitError(FituneError):
    """Raised by callers that require a fit (plan, train); estimate itself only reports `fits`."""


class DataError(FituneError):
    """A data file, record or tokenizer that cannot be used: the message names the file, the line (or record) and
    what to do. `path` and `line` (the first bad one) are kept for callers."""

    def __init__(self, message: str, *, path: str | None = None, line: int | None = None):
        super().__init__(message)
        self.path = path
        self.line = line

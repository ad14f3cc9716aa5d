"""User-facing errors.

Every problem a user can cause (a bad override, a missing asset, a budget that does not fit the
context) is raised as a :class:`KvbenchError`. The CLI prints it as one line, with the fix, and exits
non-zero; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class KvbenchError(Exception):
    """An error the user can fix. ``fix`` says how, in one sentence."""

    exit_code = 2

    def __init__(self, message: str, fix: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.fix = fix

    def __str__(self) -> str:
        return f"{self.message} (fix: {self.fix})" if self.fix else self.message


class ConfigError(KvbenchError):
    """An unknown or invalid configuration value."""


class AssetError(KvbenchError):
    """A model or data asset is missing, corrupted or cannot be fetched."""


class BudgetError(ConfigError):
    """A KV budget that is negative, contradictory or larger than the context."""


class ContextTooLongError(KvbenchError):
    """A prompt longer than the model's maximum context."""


class CompressionNotApplied(KvbenchError):
    """A method asked to compress attended (or kept) every token: a silent failure made loud."""

    exit_code = 3


class Interrupted(KvbenchError):
    """The user pressed Ctrl-C: finished samples are saved, and the same command resumes."""

    exit_code = 130

    def __init__(self, message: str, *, saved: int = 0, total: int | None = None, run_dir: object = None) -> None:
        super().__init__(message)
        self.saved = saved
        self.total = total
        self.run_dir = run_dir

"""User-facing errors.

Every problem a user can cause (a bad override, a missing asset, a budget that does not fit the
context) is raised as a :class:`KvbenchError`. The CLI prints it as one line, with the fix, and exits
non-zero; anything else is a bug and keeps its traceback. A choice kvbench made for the user that
does not stop the run (tasks left out for want of data) is a :func:`note`, printed once per process.
"""

from __future__ import annotations

import sys

_NOTED: set[str] = set()


def note(message: str) -> None:
    """Print ``kvbench: note: <message>`` to stderr, once per process: the task behind it is built again
    for every sweep point and every check, and the user needs to read it once."""
    if message not in _NOTED:
        _NOTED.add(message)
        print(f"kvbench: note: {message}", file=sys.stderr, flush=True)


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

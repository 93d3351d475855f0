"""The parent's side of the error-file channel (llmctl.errors).

A process that llmctl starts (torchrun and its ranks, an srun step, the engine's dry start) records its failure with
`llmctl.errors.report` in the file that $LLMCTL_ERROR_FILE names. The parent names that file (`ChildErrors`),
gives the child the variable (`env`, `variable`), and once the child has ended turns its first record into the
parent's own one-line error (`raise_first`) or reads it (`first`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from llmctl.errors import ERROR_FILE_ENV, ErrorReport, InputError, RuntimeFailure, read_reports

FILE_NAME = "errors.jsonl"


@dataclass(frozen=True)
class ChildErrors:
    """The error file of the processes one parent starts (several ranks may share it)."""

    path: Path

    @classmethod
    def in_folder(cls, folder: Path) -> ChildErrors:
        """`folder`/errors.jsonl (a temporary folder of the parent's, typically)."""
        return cls(folder / FILE_NAME)

    @property
    def variable(self) -> dict[str, str]:
        """The one environment variable that points a child's `report` at this file."""
        return {ERROR_FILE_ENV: str(self.path)}

    def env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """A child's environment: `base` (default: this process's) with the variable set."""
        return {**(os.environ if base is None else base), **self.variable}

    def reports(self) -> list[ErrorReport]:
        """What the children recorded, first first, one per distinct message."""
        return read_reports(self.path)

    def first(self) -> ErrorReport | None:
        """The first failure recorded (the cause; later ones are mostly ranks stopped because of it)."""
        reports = self.reports()
        return reports[0] if reports else None

    def raise_first(self, prefix: str = "", *, count_others: bool = False) -> None:
        """Raise the children's first failure as this process's one line, when there is one: an InputError when it
        was bad input (exit code 2), else a RuntimeFailure, its message after `prefix`; `count_others` adds how many
        other messages the ranks recorded. Returns when nothing was recorded (the caller says what it knows)."""
        reports = self.reports()
        if not reports:
            return
        first = reports[0]
        more = f" (+{len(reports) - 1} more rank messages)" if count_others and len(reports) > 1 else ""
        cls = InputError if first.exit_code == InputError.exit_code else RuntimeFailure
        raise cls(prefix + first.message + more)

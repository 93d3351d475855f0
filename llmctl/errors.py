"""One exception hierarchy. The library raises these; `llmctl.cli.main` turns them into one line + exit code.

Exit codes: 2 for bad input (the user can fix the command or file), 1 for runtime failures.
"""

from __future__ import annotations


class LlmctlError(Exception):
    """Base class. `hint` is an optional second sentence telling the user what to do."""

    exit_code = 1

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message} ({self.hint})"


class InputError(LlmctlError):
    """Bad user input: an unknown name, a malformed file, an impossible number."""

    exit_code = 2


class UnknownNameError(InputError):
    """A name (model preset, GPU kind, option value) that is not in a known set."""


class SpecError(InputError):
    """A model, hardware or plan specification that is malformed or inconsistent."""


class DoesNotFitError(LlmctlError):
    """The requested setup does not fit in memory on any allowed configuration."""


class RuntimeFailure(LlmctlError):
    """Something failed while running (a subprocess, a collective, a submission)."""

    exit_code = 1


def suggest(name: str, known: list[str], n: int = 3) -> str | None:
    """Close matches for a misspelt name, formatted as a hint (or None)."""
    import difflib

    lowered = {k.lower(): k for k in known}
    close = difflib.get_close_matches(name.lower(), list(lowered), n=n, cutoff=0.5)
    # Substring matches catch "llama-2" -> every llama-2 preset, which difflib alone misses.
    close += [k for k in lowered if name.lower() in k and k not in close][: max(0, n - len(close))]
    return ("did you mean: " + ", ".join(lowered[c] for c in close) + "?") if close else None

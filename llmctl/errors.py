"""One exception hierarchy and one error path.

The library raises `LlmctlError` subclasses; every entry point (the CLI, the engine, the bench-net worker, the
token-file builder) turns an exception into one line and an exit code with `report`, the only place that reads
`LLMCTL_DEBUG`. Exit codes: 2 for bad input (the user can fix the command or file), 1 for runtime failures,
130 for an interrupt.

Processes that llmctl starts (torchrun ranks, srun tasks) also append their failure as one JSON object per line to
the file named by `$LLMCTL_ERROR_FILE` when it is set (`read_reports`), so the parent learns what failed from a
structured record rather than by scraping their stderr.
"""

from __future__ import annotations

import errno
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

DEBUG_ENV = "LLMCTL_DEBUG"
ERROR_FILE_ENV = "LLMCTL_ERROR_FILE"
PREFIX = "llmctl: error: "


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


class RuleError(InputError):
    """A training setup a rule between decisions refuses (llmctl.spec.rules); `decisions` names what it constrains
    (a plan file's error names their keys, a command's their flags), `rule` which rule."""

    def __init__(self, message: str, hint: str | None = None, decisions: tuple[str, ...] = (), rule: str = "") -> None:
        super().__init__(message, hint=hint)
        self.decisions = decisions
        self.rule = rule


class UnknownNameError(InputError):
    """A name (model preset, GPU kind, option value) that is not in a known set."""


class SpecError(InputError):
    """A model, hardware or plan specification that is malformed or inconsistent."""


class DoesNotFitError(LlmctlError):
    """The requested setup does not fit in memory on any allowed configuration. `fewest_gpus`: the smallest count of
    this GPU kind the planner found that would fit, where it says one (llmctl.plan.compare starts its search there)."""

    def __init__(self, message: str, hint: str | None = None, fewest_gpus: int | None = None) -> None:
        super().__init__(message, hint)
        self.fewest_gpus = fewest_gpus


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


# --- the one error path ------------------------------------------------------------------------------------------
OOM_HINT = "lower training.micro_batch_size, or set training.activation_checkpointing: full"


def debug() -> bool:
    """`LLMCTL_DEBUG=1`: re-raise instead of printing one line (tracebacks for bug reports)."""
    return os.environ.get(DEBUG_ENV) == "1"


def is_out_of_memory(e: BaseException) -> bool:
    """torch.OutOfMemoryError (CUDA) without importing torch: a planning problem, not a bug."""
    return type(e).__name__ == "OutOfMemoryError"


DISK_FULL_HINT = "free some space, or write it elsewhere"
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


def disk_full(e: BaseException) -> int | None:
    """ENOSPC or EDQUOT when `e` says the disk or the quota is full, else None: an OSError, or an error of a library
    written in Rust that carries the OS error in its text (safetensors: "I/O error: No space left on device (os error
    28)")."""
    if isinstance(e, OSError):
        return e.errno if e.errno in _DISK_FULL else None
    text = str(e)
    return next((code for code in _DISK_FULL if f"(os error {code})" in text), None)


def one_line(text: str) -> str:
    """`text` with every character that would break or hide the line (newline, \\x1e, U+2028, other controls)
    written as its escape: a user's path or value with a line break still makes one error line."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def describe(e: BaseException) -> tuple[str, int]:
    """(one-line message, exit code) for any exception."""
    message, code = _describe(e)
    return one_line(message), code


def _describe(e: BaseException) -> tuple[str, int]:
    if isinstance(e, LlmctlError):
        return str(e), e.exit_code
    if isinstance(e, KeyboardInterrupt):  # Ctrl-C, or another stop signal (llmctl.interrupts.Interrupted)
        signum = getattr(e, "signum", None)
        return ("interrupted", 130) if signum is None else (f"interrupted ({e})", 128 + signum)
    if isinstance(e, ValueError) and str(e) == "embedded null byte":  # os.* on a path or value holding NUL
        return "a path or value contains a NUL byte (\\x00)", 2
    full = disk_full(e)
    if full is not None:  # a full disk or quota: the user's to fix, not a bug
        path = getattr(e, "filename", None)
        what = os.strerror(full).lower()
        return (f"{path}: {what}" if path else what) + f" ({DISK_FULL_HINT})", 1
    first = (str(e).strip().splitlines() or [""])[0]
    if is_out_of_memory(e):
        return f"out of memory: {first} ({OOM_HINT})", 1
    report_it = f"a bug in llmctl: please report it with the traceback that {DEBUG_ENV}=1 prints"
    return f"internal error: {type(e).__name__}: {first} ({report_it})", 1


@dataclass(frozen=True)
class ErrorReport:
    """What a failed process tells its parent through $LLMCTL_ERROR_FILE."""

    message: str
    exit_code: int
    kind: str
    """The exception's class name (InputError, RuntimeFailure, OutOfMemoryError, ...)."""
    rank: int | None = None


def report(
    e: BaseException,
    *,
    rank: int | None = None,
    say: bool = True,
    stream: TextIO | None = None,
    reraise_bugs: bool = False,
) -> int:
    """Turn an exception into one line on stderr (`llmctl: error: [rank R] message`) and return the exit code.

    Re-raises when LLMCTL_DEBUG=1, and with `reraise_bugs` for anything that is neither an LlmctlError, an
    interrupt nor an out-of-memory error (the engine: a bug's traceback, which torchrun records, is what one needs).
    `say=False` records the failure without printing (the engine's bad-input errors are said by rank 0 only).
    Must be called from an `except` block when it may re-raise.
    """
    known = isinstance(e, (LlmctlError, KeyboardInterrupt)) or is_out_of_memory(e)
    if debug() or (reraise_bugs and not known):
        raise e
    message, code = describe(e)
    where = f"[rank {rank}] " if rank else ""
    if say:
        print(f"{PREFIX}{where}{message}", file=stream or sys.stderr, flush=True)
    path = os.environ.get(ERROR_FILE_ENV)
    if path:
        record = {"message": message, "exit_code": code, "kind": type(e).__name__, "rank": rank}
        try:
            with open(path, "a") as f:  # one short write per line: lines from several ranks do not interleave
                f.write(json.dumps(record) + "\n")
        except OSError:
            pass  # the line on stderr is still there
    return code


def read_reports(path: str | os.PathLike[str]) -> list[ErrorReport]:
    """The failures child processes recorded in an error file, first first, one per distinct message."""
    p = Path(path)
    if not p.is_file():
        return []
    out: list[ErrorReport] = []
    seen: set[str] = set()
    for line in p.read_text(errors="replace").splitlines():
        try:
            rec = json.loads(line)
            r = ErrorReport(str(rec["message"]), int(rec["exit_code"]), str(rec["kind"]), rec.get("rank"))
        except (ValueError, KeyError, TypeError):
            continue  # a line cut by a crash mid-write
        if r.message not in seen:
            seen.add(r.message)
            out.append(r)
    return out

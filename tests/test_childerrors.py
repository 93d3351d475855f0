"""The parent's side of the error-file channel (llmctl.childerrors): a real child process records its failure with
llmctl.errors.report, the parent turns it into its own one line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from llmctl.childerrors import ChildErrors
from llmctl.errors import InputError, RuntimeFailure


def child(errors: ChildErrors, *raises: str) -> int:
    """A child process that reports each of `raises` (Python expressions of exceptions) as a rank would."""
    code = "import sys\nfrom llmctl.errors import InputError, RuntimeFailure, report\n"
    code += "".join(
        f"try:\n    raise {r}\nexcept Exception as e:\n    rc = report(e, rank={i})\n" for i, r in enumerate(raises)
    )
    code += "sys.exit(rc)\n"
    env = errors.env({"PATH": "/usr/bin:/bin", "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=60).returncode


def test_the_childs_failure_is_the_parents_one_line(tmp_path: Path) -> None:
    errors = ChildErrors.in_folder(tmp_path)
    assert errors.path == tmp_path / "errors.jsonl" and errors.variable == {"LLMCTL_ERROR_FILE": str(errors.path)}
    assert errors.first() is None
    errors.raise_first("dry start: ")  # nothing recorded: returns, the caller says what it knows
    assert child(errors, "InputError('no such plan')", "RuntimeFailure('rank 1 stopped')") == 1
    assert errors.first().message == "no such plan" and errors.first().kind == "InputError"
    with pytest.raises(InputError, match=r"^dry start: no such plan$"):
        errors.raise_first("dry start: ")
    with pytest.raises(InputError, match=r"^no such plan \(\+1 more rank messages\)$"):
        errors.raise_first(count_others=True)


def test_a_runtime_failure_stays_one(tmp_path: Path) -> None:
    errors = ChildErrors(tmp_path / "errors-1.jsonl")
    assert child(errors, "RuntimeFailure('link down')") == 1
    with pytest.raises(RuntimeFailure, match=r"^link down$"):
        errors.raise_first(count_others=True)

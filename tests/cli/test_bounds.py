"""Every numeric option of every command (enumerated from the app, so a new option is covered without editing
this file): non-finite, absurdly large and non-numeric values are one line naming the option, exit 2, before any
command code runs, and nothing is written."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import typer.main
from typer.testing import CliRunner

from llmctl import bounds
from llmctl.cli.main import app

# Arguments that let each command reach its options (none of them starts anything: the bad value stops parsing).
BASE = {
    "estimate-memory": ["llama-2-7b"],
    "estimate": ["llama-2-7b"],
    "plan": ["llama-2-7b", "--gpu", "A100-80GB"],
    "launch": ["plan.yaml", "--dry-run"],
    "logs": ["1"],
    "cancel": ["1"],
    "data prepare": ["corpus.txt", "--out", "prepared"],
}
BAD_FLOATS = ["nan", "inf", "-inf", "1e30", "-1e30", "abc", "", "$(id)"]
BAD_INTS = ["9" * 25, "-" + "9" * 25, "nan", "inf", "1.5", "abc", "", "$(id)"]


def numeric_options() -> list[tuple[str, str, type]]:
    """(command path, flag, kind) of every numeric option, sub-commands included (`data prepare`)."""
    out = []
    stack = [("", typer.main.get_command(app))]
    while stack:
        prefix, group = stack.pop()
        for name, command in group.commands.items():
            path = f"{prefix} {name}".strip()
            if hasattr(command, "commands"):
                stack.append((path, command))
                continue
            for param in command.params:
                kind = bounds._kind(param)
                if kind is not None and getattr(param, "opts", None):
                    out.append((path, param.opts[0], kind))
    return out


OPTIONS = numeric_options()


def test_the_app_has_numeric_options_to_check() -> None:
    flags = {flag for _, flag, _ in OPTIONS}
    assert {"--nodes", "--seq-len", "--inter-gbps", "--price", "--timeout", "--cuda-context-gib"} <= flags
    assert {("data prepare", "--workers"), ("data prepare", "--val-fraction")} <= {(c, f) for c, f, _ in OPTIONS}
    assert set(bounds.LIMITS) <= flags | {"--nproc-per-node"}, set(bounds.LIMITS) - flags  # no stale limit


@pytest.mark.parametrize(("command", "flag", "kind"), OPTIONS, ids=[f"{c} {f}" for c, f, _ in OPTIONS])
def test_bad_numbers_are_one_line_exit_2(command: str, flag: str, kind: type, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    for value in BAD_FLOATS if kind is float else BAD_INTS:
        start = time.monotonic()
        result = CliRunner().invoke(app, [*command.split(), *BASE.get(command, []), f"{flag}={value}"])
        lines = result.output.strip().splitlines()
        assert result.exit_code == 2, (value, result.output)
        assert len(lines) == 1 and lines[0].startswith("llmctl: error: "), (value, result.output)
        assert flag in lines[0] and "internal error" not in lines[0] and "Traceback" not in result.output
        # Refused before any command code runs (no model, no torch): milliseconds. The bound is loose because a
        # loaded 2-core CI machine once took more than 1 s here; command code (a plan, an import of torch) takes more.
        assert time.monotonic() - start < 5.0, (value, "took too long to refuse")
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_limits_themselves_pass_and_just_past_them_fail() -> None:
    for flag, limit in bounds.LIMITS.items():
        kind = int if float(limit).is_integer() else float
        bounds.check(flag, kind, kind(limit))
        with pytest.raises(ValueError, match="out of range"):
            bounds.check(flag, kind, kind(limit) + 1)
    bounds.check("--some-new-option", float, 1e14)
    with pytest.raises(ValueError, match="not a finite number"):
        bounds.check("--some-new-option", float, float("nan"))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["plan", *BASE["plan"], "--tokens", "1e30"], "--tokens '1e30' is out of range: at most 1e+15"),
        (["plan", *BASE["plan"], "--tokens", "inf"], "cannot read --tokens 'inf'"),
        (["estimate-memory", "--params", "1e999"], "parameter count '1e999' is out of range"),
        (["estimate-memory", "--params", "nan"], "cannot read parameter count 'nan'"),
    ],
)
def test_counts_given_as_text_are_bounded_too(args: list[str], message: str) -> None:
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2 and result.output.strip().startswith(f"llmctl: error: {message}"), result.output
    assert len(result.output.strip().splitlines()) == 1

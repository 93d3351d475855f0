"""The docs cannot drift from the code.

- Every option of every command (nested groups included) is in the command reference that docs/hooks.py generates
  from the typer app at build time; the check itself is shown to catch a missing option.
- The README's and the docs' `$ llmctl ...` example lines still parse: each, with `--help` appended, exits 0, so a
  renamed or removed option or command fails here (the outputs beside them are captured from real runs).
- The generated plan-file schema and GPU catalog name every plan section key and every shipped GPU.

`make test` also runs `mkdocs build --strict` (broken links, anchors and nav entries fail the build).
"""

from __future__ import annotations

import importlib.util
import re
import shlex
from pathlib import Path

import pytest
import typer.main
from typer.testing import CliRunner

from llmctl.cli.main import app

ROOT = Path(__file__).resolve().parents[1]


def _hooks():
    pytest.importorskip("mkdocs", reason="the docs need MkDocs (pip install -e '.[docs]')")
    spec = importlib.util.spec_from_file_location("llmctl_docs_hooks", ROOT / "docs" / "hooks.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _commands(group, path="llmctl"):
    """(path, command) of the root and every command under it, nested groups included."""
    out = [(path, group)]
    for name, cmd in getattr(group, "commands", {}).items():
        out += _commands(cmd, f"{path} {name}")
    return out


def _sections(markdown: str) -> dict[str, str]:
    """Command path -> its section of the reference (from its `## `llmctl ...`` heading to the next)."""
    parts = re.split(r"^## `(llmctl[^`]*)`$", markdown, flags=re.M)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts), 2)}


def missing_options(markdown: str) -> list[str]:
    """'PATH OPTION' for every option spelling of every command that its reference section does not show."""
    sections = _sections(markdown)
    missing = []
    for path, cmd in _commands(typer.main.get_command(app)):
        section = sections.get(path)
        if section is None:
            missing.append(f"{path} (no section)")
            continue
        for param in cmd.params:
            if param.param_type_name != "option":
                continue
            for opt in [*param.opts, *param.secondary_opts]:
                if not re.search(rf"`{re.escape(opt)}`", section):
                    missing.append(f"{path} {opt}")
    return missing


def test_every_option_of_every_command_is_in_the_reference():
    reference = _hooks().cli_reference()
    commands = _commands(typer.main.get_command(app))
    assert {"llmctl plan", "llmctl data prepare", "llmctl launch"} <= {p for p, _ in commands}
    assert missing_options(reference) == []
    n_options = sum(len(p.opts) for _, c in commands for p in c.params if p.param_type_name == "option")
    assert n_options > 150, n_options  # the walk really reached the commands' options


def test_the_check_catches_an_option_left_out():
    reference = _hooks().cli_reference()
    section = _sections(reference)["llmctl data prepare"]
    row = next(line for line in section.splitlines() if line.startswith("| `--val-fraction`"))
    assert missing_options(reference.replace(row + "\n", "")) == ["llmctl data prepare --val-fraction"]
    assert "llmctl tune (no section)" in missing_options(reference.replace("## `llmctl tune`", "## tune"))


def test_generated_schema_and_gpu_catalog():
    hooks = _hooks()
    from llmctl.spec.hardware import gpu_catalog
    from llmctl.spec.planfile import Plan

    schema = hooks.planfile_reference()
    for key in Plan.model_fields:
        assert f"| `{key}` |" in schema, key
    assert "| `pad_vocab_multiple` |" in schema and "tensor-core shapes" in schema  # attribute docstrings read
    gpus = hooks.gpu_reference()
    for name in gpu_catalog():
        assert f"| {name.replace('_', chr(92) + '_')} |" in gpus, name


def _example_commands() -> list[tuple[str, str]]:
    """(where, command line) of every `$ llmctl ...` line in a fenced block of README.md and docs/ (continuation
    lines joined, a trailing comment or pipe cut)."""
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        lines = path.read_text().splitlines()
        fenced = False
        i = 0
        while i < len(lines):
            line = lines[i]
            if line.startswith("```"):
                fenced = not fenced
            elif fenced and line.startswith("$ llmctl "):
                cmd = line[2:]
                while cmd.endswith("\\") and i + 1 < len(lines):
                    i += 1
                    cmd = cmd[:-1] + " " + lines[i].strip()
                found.append((f"{path.relative_to(ROOT)}:{i + 1}", cmd))
            i += 1
    return found


def test_readme_and_docs_example_commands_still_parse():
    examples = _example_commands()
    assert sum(where.startswith("README.md") for where, _ in examples) >= 8
    runner = CliRunner()
    failed = []
    for where, cmd in examples:
        argv = shlex.split(cmd, comments=True)
        if "|" in argv:
            argv = argv[: argv.index("|")]
        r = runner.invoke(app, [*argv[1:], "--help"])
        if r.exit_code != 0:
            failed.append(f"{where}: {cmd}: exit {r.exit_code}: {(r.output or str(r.exception)).strip()[-300:]}")
    assert not failed, "\n".join(failed)

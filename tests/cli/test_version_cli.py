"""`llmctl --version` prints the installed distribution's version and exits 0, before any command runs."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import version

from typer.testing import CliRunner

from llmctl.cli.main import app


def test_version_option():
    r = CliRunner().invoke(app, ["--version"])
    assert r.exit_code == 0, r.output
    assert r.output == f"llmctl {version('llmctl')}\n"


def test_version_from_the_console_entry():
    r = subprocess.run([sys.executable, "-m", "llmctl", "--version"], capture_output=True, text=True, timeout=60)
    assert (r.returncode, r.stdout.strip()) == (0, f"llmctl {version('llmctl')}"), r.stderr


def test_completion_options_are_offered():
    r = CliRunner().invoke(app, ["--help"])
    assert r.exit_code == 0
    assert "--install-completion" in r.output and "--show-completion" in r.output

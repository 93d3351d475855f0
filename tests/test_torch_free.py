"""The planning commands never import torch or transformers (checked in a fresh interpreter)."""

import subprocess
import sys

import pytest

CHECK = """
import sys
sys.argv = {argv!r}
from llmctl.cli.main import main
try:
    main()
except SystemExit as e:
    code = e.code
else:
    code = 0
heavy = sorted(m for m in ("torch", "transformers", "numpy", "matplotlib") if m in sys.modules)
print("HEAVY=" + ",".join(heavy), "CODE=" + str(code), file=sys.stderr)
"""


@pytest.mark.parametrize(
    "argv",
    [
        ["llmctl", "--help"],
        ["llmctl", "estimate-memory", "llama-3.1-70b", "--gpu", "H100-SXM", "--nodes", "4", "--gpus-per-node", "8"],
        ["llmctl", "estimate", "gpt2", "--json"],
        ["llmctl", "estimate-memory", "--list-models"],
    ],
)
def test_no_torch_import(argv):
    r = subprocess.run([sys.executable, "-c", CHECK.format(argv=argv)], capture_output=True, text=True, timeout=60)
    last = r.stderr.strip().splitlines()[-1]
    assert last == "HEAVY= CODE=0", r.stderr[-2000:]


# The static half: no module under these packages imports them, at any depth (a function-level import too), so
# that a lazy import added to some rarely-run branch cannot slip past the runtime check above.
TORCH_FREE_PACKAGES = ("llmctl/spec", "llmctl/plan", "llmctl/units.py", "llmctl/secrets.py", "llmctl/errors.py")
FORBIDDEN = ("torch", "transformers", "llmctl.engine", "llmctl.measure")


def _imports(path):
    import ast

    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = getattr(node.func, "attr", getattr(node.func, "id", ""))
            if func in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                yield node.lineno, node.args[0].value


def test_spec_and_plan_never_import_torch_statically():
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    files = [f for p in TORCH_FREE_PACKAGES for f in ([root / p] if p.endswith(".py") else (root / p).rglob("*.py"))]
    assert len(files) > 10, files
    bad = [
        f"{f.relative_to(root)}:{line}: import {name}"
        for f in files
        for line, name in _imports(f)
        if any(name == m or name.startswith(m + ".") for m in FORBIDDEN)
    ]
    assert not bad, "\n".join(bad)


# --- start-up: a command imports its own module and what it needs, nothing of the other commands ------------------
IMPORTS = """
import sys
sys.argv = {argv!r}
from llmctl.cli.main import main
try:
    main()
except SystemExit as e:
    assert not e.code, e.code
print("MODULES=" + ",".join(sorted(sys.modules)), file=sys.stderr)
"""
# What `llmctl plan` must not import (llmctl.cli.main imports each command's module when that command runs): the
# engine's and the launchers' libraries, and the other commands' modules, which are most of the start-up time.
NOT_FOR_PLAN = (
    "torch",
    "transformers",
    "numpy",
    "matplotlib",
    "jinja2",
    "submitit",
    "llmctl.engine",
    "llmctl.launch",
    "llmctl.tune",
    "llmctl.data",
    "llmctl.netbench",
    "llmctl.cli.estimate",
    "llmctl.cli.bench_net",
    "llmctl.cli.launch",
    "llmctl.cli.jobs",
    "llmctl.cli.tune",
    "llmctl.cli.export",
    "llmctl.cli.data",
)


def _modules(argv: list[str]) -> set[str]:
    r = subprocess.run([sys.executable, "-c", IMPORTS.format(argv=argv)], capture_output=True, text=True, timeout=120)
    line = [ln for ln in r.stderr.splitlines() if ln.startswith("MODULES=")]
    assert r.returncode == 0 and line, r.stderr[-2000:]
    return set(line[-1].removeprefix("MODULES=").split(","))


def _under(modules: set[str], names: tuple[str, ...]) -> list[str]:
    return sorted(m for m in modules if any(m == n or m.startswith(n + ".") for n in names))


def test_plan_imports_only_its_own_command():
    mods = _modules(["llmctl", "plan", "llama-3.1-8b", "--gpu", "H100", "--gpus", "8", "--json", "--no-write"])
    assert "llmctl.cli.plan" in mods and "llmctl.plan.planner" in mods  # the check sees the command's imports
    assert _under(mods, NOT_FOR_PLAN) == []


def test_listing_the_commands_imports_them_all():
    # --help lists every command (with its help line): each module is imported, which the check above must notice.
    mods = _modules(["llmctl", "--help"])
    assert _under(mods, ("llmctl.cli.launch", "llmctl.cli.data", "llmctl.cli.tune", "llmctl.cli.export")) == [
        "llmctl.cli.data",
        "llmctl.cli.export",
        "llmctl.cli.launch",
        "llmctl.cli.tune",
    ]


def test_the_lazy_command_table_is_what_the_modules_register():
    """llmctl.cli.main.COMMAND_MODULES names each module's commands; a command added to a module and not to the
    table would be unreachable: each module's registered names, in order, are the table's."""
    import typer.main

    from llmctl.cli import main as cli_main

    for mod, names in cli_main.COMMAND_MODULES.items():  # each module's register(), run once (_module_app)
        assert tuple(typer.main.get_group(cli_main._module_app(mod)).commands) == names, mod
    root = typer.main.get_command(cli_main.app)
    listed = root.list_commands(None)
    assert listed == [n for names in cli_main.COMMAND_MODULES.values() for n in names]

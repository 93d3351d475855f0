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

"""llmctl/data sits below the engine: the engine reads what `llmctl data prepare` writes, never the other way round
(no import cycle between llmctl.data and llmctl.engine)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

DATA = Path(__file__).resolve().parents[2] / "llmctl" / "data"


def _engine_references(path: Path) -> list[str]:
    """Imports of llmctl.engine at any depth, and module names in strings (a forkserver preload list)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and " " not in node.value:
            names = [node.value]
        out += [
            f"{path.name}:{node.lineno}: {n}" for n in names if n == "llmctl.engine" or n.startswith("llmctl.engine.")
        ]
    return out


def test_no_module_of_llmctl_data_names_the_engine() -> None:
    files = sorted(DATA.glob("*.py"))
    assert len(files) >= 5, files
    bad = [ref for f in files for ref in _engine_references(f)]
    assert not bad, "\n".join(bad)


def test_importing_llmctl_data_loads_no_engine_module() -> None:
    code = (
        "import sys, llmctl.data.prepare, llmctl.data.format, llmctl.data.tokenizer, llmctl.data.sources; "
        "print(sorted(m for m in sys.modules if m.startswith('llmctl.engine')))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr[-2000:]

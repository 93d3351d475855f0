"""`llmctl launch --dry-start`: the engine's setup of rank 0 (`python -m llmctl.engine --dry-start`) run in a process
of its own on this machine, its report read back."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from llmctl.childerrors import ChildErrors
from llmctl.errors import RuntimeFailure


def dry_start(plan: Path, allocate_all: bool = False, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run `python -m llmctl.engine --dry-start` in a process of its own (its fake process group and its peak
    memory are its own); its report (llmctl.engine.dryrun), or the child's one error line raised. `overrides`:
    decisions by name (tp, cp, ...) at which to size the plan instead of its own (a copy in the temporary folder; the
    file is not touched)."""
    with tempfile.TemporaryDirectory(prefix="llmctl-dry-start-") as tmp:
        if overrides:
            plan = _at(plan, overrides, Path(tmp))
        out, errors = Path(tmp) / "report.json", ChildErrors.in_folder(Path(tmp))
        env = errors.env()
        env.setdefault("TMPDIR", tmp)
        argv = [sys.executable, "-m", "llmctl.engine", "--dry-start", "--json-out", str(out), str(plan)]
        if allocate_all:
            argv.insert(4, "--allocate-all")
        proc = subprocess.run(argv, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True)
        if proc.returncode != 0:
            errors.raise_first("dry start: ")
            tail = [ln for ln in proc.stderr.splitlines() if ln.strip()][-1:] or ["?"]
            raise RuntimeFailure(f"dry start failed (exit {proc.returncode}): {tail[0][:300]}")
        return json.loads(out.read_text())


def _at(path: Path, overrides: dict[str, Any], folder: Path) -> Path:
    """A copy of the plan at `path` with these decisions replaced (validated as the plan file would be: one line
    naming the key)."""
    from llmctl.errors import InputError, SpecError
    from llmctl.spec.decisions import with_values
    from llmctl.spec.planfile import load_plan, save_plan

    plan = load_plan(path)
    at = " ".join(f"{k} {v}" for k, v in overrides.items())
    try:
        moved = with_values(plan.setup, **overrides)
    except InputError as e:
        raise SpecError(f"{path} at {at}: {e.message}") from None
    out = folder / path.name
    save_plan(plan.with_setup(moved, f"{path} at {at}"), out)
    return out

"""Re-run the `$ llmctl ...` examples of markdown pages and replace the output under each with what the command prints
now: after a change to the planner's numbers, the docs show real output again (tests/test_docs.py checks that the
commands still parse; this keeps their output true).

A fenced block is refreshed when its first line is `$ llmctl ...` (continued with a trailing backslash) and
everything after the command is its output; `--dry-run` lists them. Commands run from the repository root with
COLUMNS=140 (the width the pages were captured at) in a scratch copy of the files they could write (plan.yaml,
runs/), so the working tree is not touched; a command that exits non-zero keeps its old output and is reported.
Only `llmctl plan` and `llmctl estimate-memory` examples are refreshed unless --all is given (the others need a
GPU, a cluster or the network).

Run: .venv/bin/python scripts/refresh_docs.py README.md docs/concepts/*.md docs/how-to/*.md [--dry-run] [--all]
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^```[a-z]*\n(.*?)^```$", re.S | re.M)
SAFE = ("llmctl plan ", "llmctl estimate-memory ", "llmctl estimate ")


def command_of(block: str) -> tuple[str, str] | None:
    """(the command, the text of its lines) of a block that starts with `$ llmctl`, else None."""
    lines = block.splitlines()
    if not lines or not lines[0].startswith("$ llmctl "):
        return None
    cmd, used = [], 0
    for line in lines:
        used += 1
        text = line[2:] if line.startswith("$ ") else line.strip()
        cmd.append(text.rstrip("\\").strip())
        if not line.rstrip().endswith("\\"):
            break
    return " ".join(cmd), "\n".join(lines[:used])


def run(cmd: str, scratch: Path) -> tuple[int, str]:
    """The command's output in the scratch folder, as on a fresh checkout: what an earlier example wrote is gone."""
    (scratch / "plan.yaml").unlink(missing_ok=True)
    shutil.rmtree(scratch / "runs", ignore_errors=True)
    args = shlex.split(cmd, comments=True)
    env = dict(os.environ, COLUMNS="140", PYTHONPATH=str(ROOT), NO_COLOR="1", TERM="dumb")
    p = subprocess.run(
        [sys.executable, "-m", "llmctl", *args[1:]], cwd=scratch, env=env, capture_output=True, text=True, timeout=600
    )
    return p.returncode, "\n".join(line.rstrip() for line in (p.stdout + p.stderr).rstrip("\n").splitlines())


def refresh(path: Path, scratch: Path, dry: bool, every: bool) -> int:
    text = path.read_text()
    out, last, changed, failed = [], 0, 0, 0
    for m in FENCE.finditer(text):
        found = command_of(m.group(1))
        if found is None or (not every and not found[0].startswith(SAFE)):
            continue
        cmd, head = found
        if dry:
            print(f"{path}: {cmd}")
            continue
        code, output = run(cmd, scratch)
        if code not in (0,):
            print(f"{path}: kept the old output of `{cmd}` (exit {code}: {output.splitlines()[-1:]})", file=sys.stderr)
            failed += 1
            continue
        out.append(text[last : m.start(1)] + head + "\n" + output + "\n")
        last = m.end(1)
        changed += 1
    if not dry and changed:
        path.write_text("".join(out) + text[last:])
    print(f"{path}: {changed} refreshed, {failed} kept")
    return failed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pages", nargs="+", type=Path)
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--all", action="store_true", help="every `$ llmctl` example, not only plan and estimate-memory")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp) / "repo"
        shutil.copytree(ROOT / "examples", scratch / "examples")
        failed = sum(refresh(p.resolve(), scratch, a.dry_run, a.all) for p in a.pages)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

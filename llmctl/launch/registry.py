"""The per-user index of launched jobs, so that `llmctl status`, `logs` and `cancel` work from any folder: one small
JSON file per job under `$LLMCTL_HOME/jobs/` (default `$XDG_STATE_HOME/llmctl`, else `~/.local/state/llmctl`),
pointing at the job's folder, which stays where the launch put it (./llmctl-jobs, --jobs-dir or $LLMCTL_JOBS_DIR).
Torch-free.

One file per job, written whole by `write_atomic` (temporary file + rename) and named after the job's folder, so that
two launches at once never write the same file, a reader never sees half a file, and re-saving a record (a local run
learns its id once torchrun has started) replaces its entry. An append-only index would need O_APPEND to be atomic,
which NFS home folders do not promise.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from llmctl.fileio import write_atomic

HOME_ENV = "LLMCTL_HOME"


def home() -> Path:
    """$LLMCTL_HOME, else $XDG_STATE_HOME/llmctl, else ~/.local/state/llmctl (the XDG base directory spec's place
    for state that persists between runs but is not worth backing up)."""
    given = os.environ.get(HOME_ENV)
    if given:
        return Path(given).expanduser().absolute()
    state = os.environ.get("XDG_STATE_HOME") or os.path.join("~", ".local", "state")
    return (Path(state).expanduser() / "llmctl").absolute()


def index_dir() -> Path:
    return home() / "jobs"


@dataclass(frozen=True)
class Entry:
    """What the index keeps of a job: enough to list it and find its folder (the folder's job.json has the rest)."""

    job_id: str
    backend: str
    folder: str
    plan_name: str
    submitted_at: str


def _entry_path(folder: str) -> Path:
    # The folder's name (a UTC stamp first, so the index lists in launch order) and a hash of its full path: job
    # folders in two roots may share a name.
    digest = hashlib.sha256(folder.encode(errors="surrogateescape")).hexdigest()[:12]
    return index_dir() / f"{Path(folder).name[:80]}-{digest}.json"


def register(entry: Entry) -> None:
    """Add (or update) a job's entry. Raises OSError when the index folder cannot be written."""
    write_atomic(_entry_path(entry.folder), json.dumps(asdict(entry)) + "\n")


def entries() -> list[Entry]:
    """Every registered job, oldest first (by submission time, then folder). Unreadable entries are skipped."""
    d = index_dir()
    if not d.is_dir():
        return []
    names = {f.name for f in fields(Entry)}
    out = []
    for p in d.glob("*.json"):
        try:
            data = json.loads(p.read_text())
            out.append(Entry(**{k: str(data[k]) for k in names}))
        except (OSError, ValueError, KeyError, TypeError):
            continue  # another llmctl's format, or a file someone edited: not ours to judge
    return sorted(out, key=lambda e: (e.submitted_at, e.folder))

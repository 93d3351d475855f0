"""Writing the files llmctl owns (plans, reports, job records, scripts, token-file metadata) so that a crash or a
full disk never leaves a half-written file or destroys the previous one. Torch-free."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_atomic(path: str | os.PathLike[str], data: str | bytes, mode: int | None = None) -> None:
    """Write `data` to `path` all or nothing: a temporary file in the same folder, fsync, rename over the target,
    fsync the folder (so the rename itself survives a power cut). `mode` sets the permissions (e.g. 0o755); by default
    they are those of a new file (0666 less the umask)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", dir=p.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        # mkstemp creates the file 0600; a plan or a report is as readable as any file the user writes.
        os.chmod(tmp, mode if mode is not None else 0o666 & ~_umask())
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(p.parent)


def _umask() -> int:
    current = os.umask(0)  # reading the umask means setting it: put it back at once
    os.umask(current)
    return current


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Persist a folder's entries (a rename or a new file in it); a no-op where folders cannot be opened."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)

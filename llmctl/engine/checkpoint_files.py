"""What makes a checkpoint folder safe to read: llmctl's marker, the checks against it, plain-data loading.

A checkpoint's files are read with pickle: DCP's `.metadata` always (torch.distributed.checkpoint unpickles it),
and `torch.load` for trainer.pt and rng-rank<R>.pt. A pickle can run any code, so llmctl reads them only from a
folder it wrote itself:
- after a save completes, rank 0 writes MARKER into the folder: the sha256 and size of every small file (.metadata,
  trainer.pt, rng-rank<R>.pt, plan.yaml) and the size of every DCP shard (hashing gigabytes of shards would cost a
  minute per save; a size catches a truncated or missing shard, the usual damage);
- before reading anything, `verify` checks the folder against it: no marker is a folder llmctl did not write
  (refused: ForeignCheckpoint, exit 2); a marker that does not match is a damaged checkpoint (DamagedCheckpoint,
  naming the file), and the engine resumes from the previous one;
- trainer.pt and the RNG files hold plain data (tensors, numbers, strings) and are loaded with
  `weights_only=True` (`load_plain`): a pickled object in them is refused, never run.
A checkpoint copied from elsewhere, marker and all, is trusted like code (docs/concepts/checkpoint-trust.md).

Torch-free at import (`verify` and the marker run in `llmctl export`'s checks before torch is imported).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from llmctl.errors import InputError

MARKER = "llmctl-checkpoint.json"
MARKER_FORMAT = 1
DCP_METADATA = ".metadata"
SHARD_SUFFIX = ".distcp"
"""DCP's FileSystemWriter shard files: recorded by size only."""
TRUST_DOC = "docs/concepts/checkpoint-trust.md"


class ForeignCheckpoint(InputError):
    """A step folder without llmctl's marker: not read (its pickles could run code)."""


class DamagedCheckpoint(InputError):
    """A checkpoint file that is missing, truncated or altered since the save; `file` names it."""

    def __init__(self, file: Path, what: str, folder: Path | None = None) -> None:
        self.folder = file.parent if folder is None else folder
        where = f"{file}: {what}" if file != self.folder else f"checkpoint {file} {what}"
        super().__init__(f"{where} (checkpoint {self.folder} is damaged)" if file != self.folder else where)
        self.file, self.what = file, what


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MARKER)


def manifest(folder: Path) -> dict[str, Any]:
    """The marker's content for `folder` as it is now: every file's size, the small files' sha256."""
    files: dict[str, dict[str, Any]] = {}
    for p in _files(folder):
        entry: dict[str, Any] = {"bytes": p.stat().st_size}
        if p.suffix != SHARD_SUFFIX:
            entry["sha256"] = _sha256(p)
        files[p.relative_to(folder).as_posix()] = entry
    meta = files.get(DCP_METADATA, {})
    return {"format": MARKER_FORMAT, "writer": "llmctl", "metadata_sha256": meta.get("sha256"), "files": files}


def write_marker(folder: Path) -> None:
    """Record `folder`'s files in MARKER (rank 0, after every rank's files are written, before the rename)."""
    text = json.dumps(manifest(folder), indent=1, sort_keys=True) + "\n"
    with open(folder / MARKER, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def verify(folder: Path) -> None:
    """Raise ForeignCheckpoint or DamagedCheckpoint unless `folder` holds exactly what its marker records."""
    marker = folder / MARKER
    if not marker.is_file():
        raise ForeignCheckpoint(
            f"{marker}: missing: {folder} was not written by this llmctl, and its pickled files are not read",
            hint=f"a checkpoint from elsewhere is trusted like code; see {TRUST_DOC}",
        )
    try:
        recorded = json.loads(marker.read_text())
        files = recorded["files"]
        meta_sha = recorded["metadata_sha256"]
        if not isinstance(files, dict) or recorded.get("format") != MARKER_FORMAT:
            raise ValueError("not a marker of this format")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DamagedCheckpoint(marker, f"unreadable ({type(e).__name__})") from None
    if DCP_METADATA not in files or files[DCP_METADATA].get("sha256") != meta_sha:
        raise DamagedCheckpoint(marker, f"records no {DCP_METADATA} checksum")
    for rel, entry in sorted(files.items(), key=lambda kv: (kv[0] != DCP_METADATA, kv[0])):
        _check_file(folder / rel, entry)


def _check_file(path: Path, entry: dict[str, Any]) -> None:
    if not path.is_file():
        raise DamagedCheckpoint(path, "missing")
    size = path.stat().st_size
    if size != entry.get("bytes"):
        raise DamagedCheckpoint(path, f"{size} bytes, the save wrote {entry.get('bytes')}")
    if "sha256" in entry and _sha256(path) != entry["sha256"]:
        raise DamagedCheckpoint(path, "its sha256 differs from the one recorded at save")


def load_plain(path: Path) -> Any:
    """`torch.load(path, weights_only=True)`: tensors and plain data only. A file holding any other pickled object
    is refused in one line (loading it could run code); a truncated one is a DamagedCheckpoint."""
    import pickle

    import torch

    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as e:
        if "weights_only" in str(e) or "Weights only" in str(e):
            raise InputError(
                f"{path}: holds pickled objects other than tensors and plain data; not loaded (it could run code)",
                hint=f"a checkpoint written by another program, or by llmctl before {MARKER}; see {TRUST_DOC}",
            ) from None
        raise DamagedCheckpoint(path, f"unreadable ({_first(e)})") from None
    except FileNotFoundError:
        raise DamagedCheckpoint(path, "missing") from None
    except (RuntimeError, EOFError, ValueError, OSError) as e:  # a truncated zip archive or pickle stream
        raise DamagedCheckpoint(path, f"unreadable ({_first(e)})") from None


def _first(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:160]}" if lines else type(e).__name__

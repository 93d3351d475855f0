"""The output folder of `llmctl data prepare`: shard files written in a hidden temporary folder beside --out, which
becomes --out by one rename once meta.json is in it; an existing --out is replaced only after that (--force).

A prepare killed by SIGKILL leaves its temporary folder (`.OUT.tmp-HOST-PID`); the next prepare of the same --out on
that host removes it once that process is gone. Nothing here looks complete without meta.json.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from llmctl.data.format import META_FILE, is_prepared, shard_name
from llmctl.errors import InputError
from llmctl.fileio import pid_alive


# --- the shards ------------------------------------------------------------------------------------------------
class ShardWriter:
    """Appends one split's tokens to split-00000.bin, split-00001.bin, ... of at most `shard_tokens` tokens each
    (little-endian); a shard is fsynced when it is full or closed. No file for a split without tokens. `name`: the
    shard files' names (the flags stream of packed data: llmctl.data.format.flags_name)."""

    def __init__(
        self,
        folder: Path,
        split: str,
        dtype: np.dtype,
        shard_tokens: int,
        name: Callable[[str, int], str] = shard_name,
    ) -> None:
        self.folder, self.split, self.shard_tokens, self.name = folder, split, shard_tokens, name
        self.dtype = np.dtype(dtype).newbyteorder("<")
        self.shards: list[dict[str, Any]] = []
        self.documents = 0
        self._file: Any = None
        self._in_shard = 0

    @property
    def tokens(self) -> int:
        return sum(s["tokens"] for s in self.shards) + self._in_shard

    def write(self, tokens: np.ndarray) -> None:
        tokens = np.ascontiguousarray(tokens, dtype=self.dtype)
        pos = 0
        while pos < tokens.size:
            if self._file is None:
                self._file = open(self.folder / self.name(self.split, len(self.shards)), "wb")  # noqa: SIM115
            take = min(tokens.size - pos, self.shard_tokens - self._in_shard)
            self._file.write(memoryview(tokens[pos : pos + take]).cast("B"))
            self._in_shard += take
            pos += take
            if self._in_shard == self.shard_tokens:
                self._close_shard()

    def _close_shard(self) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        self.shards.append({"file": self.name(self.split, len(self.shards)), "tokens": self._in_shard})
        self._file, self._in_shard = None, 0

    def close(self) -> None:
        if self._file is not None:
            self._close_shard()

    def abort(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


# --- the output folder -----------------------------------------------------------------------------------------
def temp_prefix(out: Path) -> str:
    return f".{out.name}.tmp-{socket.gethostname()}-"


def remove_stale_temps(out: Path) -> list[Path]:
    """Temporary folders of prepares of `out` on this host whose process is gone (killed: SIGKILL, a power cut)."""
    removed = []
    prefix = temp_prefix(out)
    for p in out.parent.iterdir() if out.parent.is_dir() else ():
        if not p.name.startswith(prefix):  # not glob: --out may hold "[" or "*"
            continue
        pid = p.name[len(prefix) :]
        if pid.isdigit() and int(pid) != os.getpid() and not pid_alive(int(pid)):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


def new_temp(out: Path) -> Path:
    """The empty temporary folder beside `out` this process writes into (stale ones of dead prepares removed)."""
    tmp = out.with_name(f"{temp_prefix(out)}{os.getpid()}")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temps(out)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    except OSError as e:
        raise InputError(f"--out: cannot create a folder in {out.parent} ({e.strerror or e})") from None
    return tmp


def check_out(out: Path, force: bool) -> None:
    """Refuse an existing --out without --force, and with it anything but a prepared folder (or an empty one):
    --force must never delete a folder of the user's that happens to share the name."""
    if not (out.exists() or out.is_symlink()):
        return
    if not force:
        raise InputError(f"{out} already exists", hint="use --force to replace it once the new dataset is complete")
    if not out.is_dir() or out.is_symlink() or not (is_prepared(out) or not any(out.iterdir())):
        raise InputError(
            f"{out} exists and is not a prepared dataset: --force only replaces one",
            hint="choose another --out, or remove it yourself",
        )


def commit(tmp: Path, out: Path, force: bool) -> None:
    """Rename the complete temporary folder to `out`. With an old `out` (--force): move it aside first, put it back
    if the rename fails, delete it last. (POSIX has no atomic exchange of folders: between the two renames, for
    microseconds, `out` does not exist; it is never incomplete.)"""
    from llmctl.fileio import fsync_dir

    check_out(out, force)  # again: another process may have created it meanwhile
    if out.exists():
        old = out.with_name(f".{out.name}.old-{socket.gethostname()}-{os.getpid()}")
        os.rename(out, old)
        try:
            os.rename(tmp, out)
        except BaseException:
            os.rename(old, out)
            raise
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, out)
    fsync_dir(out.parent)


def write_meta(folder: Path, meta: dict[str, Any]) -> None:
    with open(folder / META_FILE, "w") as f:
        f.write(json.dumps(meta, indent=2) + "\n")
        f.flush()
        os.fsync(f.fileno())

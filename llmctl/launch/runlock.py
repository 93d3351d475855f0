"""A run owns its folder: an `flock` on a lock file in the run folder, held for the run's life (issue 46).

Two launches of one plan at once used to share the run folder: one died with a 90-line traceback in the shared
temporary checkpoint folder, and `metrics.jsonl` got two start events and a duplicate step. Now the run's owner
takes an exclusive, non-blocking `flock` on `<folder>/.llmctl-run.lock` before anything is written there:

- `llmctl launch` (the local launcher) holds it while torchrun runs; it tells the engine so through
  `HELD_ENV`, and the ranks then take none of their own;
- otherwise (a SLURM job, submitit, a torchrun typed by hand) the engine's rank 0 holds it.

The run folder is the plan's `logging.dir` (metrics.jsonl, TensorBoard, W&B); a `checkpoint.dir` outside it is
locked too. A second launch gets one line naming the job, pid and host that hold the folder, exit 2, and writes
nothing. The kernel drops an flock when its holder dies, however it dies (SIGKILL, a lost node's process ends with
its job), so a stale lock file never blocks: the file stays, only the lock matters. Its content (holder, for the
message) is rewritten by each new holder.

Where the file system cannot lock (ENOLCK, EOPNOTSUPP: some Lustre or NFS mounts without a lock service), the run
goes on unlocked with a warning: refusing every run there would be worse than the race the lock prevents. Torch-free.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from llmctl.errors import InputError, one_line

LOCK_FILE = ".llmctl-run.lock"
HELD_ENV = "LLMCTL_RUN_LOCK_HELD"
"""Set by `llmctl launch` for the ranks it starts: the run folders' locks are held by the launching llmctl (its pid),
so the engine takes none of its own (a second flock on the file from a rank would fail: locks of separate opens
conflict even within one run)."""
_UNSUPPORTED = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS}


class RunFolderBusy(InputError):
    """Another live process holds a run folder's lock (exit 2: wait for it, cancel it, or use another folder)."""


@dataclass
class RunLock:
    """The locks one run holds (one open file per folder); released by `release` or when this process ends."""

    files: dict[Path, int] = field(default_factory=dict)
    """lock file -> its open descriptor (the flock lives as long as the descriptor)."""
    warnings: list[str] = field(default_factory=list)
    """Folders whose file system could not lock (the run goes on unlocked there)."""

    def describe(self, job: str | None) -> None:
        """Record who holds the locks (for a second launch's message): the job id once it is known."""
        text = json.dumps(holder(job)) + "\n"
        for fd in self.files.values():
            with contextlib.suppress(OSError):  # the message loses its detail, the lock still holds
                os.ftruncate(fd, 0)
                os.pwrite(fd, text.encode(), 0)

    def release(self) -> None:
        for fd in self.files.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self.files.clear()


def holder(job: str | None) -> dict[str, object]:
    return {
        "job": job,
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def run_folders(logging_dir: str | os.PathLike[str], checkpoint_dir: str | os.PathLike[str] | None) -> list[Path]:
    """The folders a run writes and owns: logging.dir, and checkpoint.dir when it is not inside it."""
    folders = [Path(os.path.abspath(logging_dir))]
    if checkpoint_dir is not None:
        ckpt = Path(os.path.abspath(checkpoint_dir))
        if ckpt != folders[0] and folders[0] not in ckpt.parents:
            folders.append(ckpt)
    return folders


def acquire(folders: Iterable[Path], job: str | None = None) -> RunLock:
    """Lock every folder (created if missing) or raise RunFolderBusy naming the holder; nothing of the holder's is
    touched (the file is opened without truncation and written only once locked)."""
    lock = RunLock()
    try:
        for folder in folders:
            _lock_one(lock, Path(folder))
    except BaseException:
        lock.release()
        raise
    lock.describe(job)
    return lock


def probe(folders: Iterable[Path]) -> None:
    """Raise RunFolderBusy when a live process holds one of these folders' locks; take nothing and create nothing
    (a SLURM submission: the job's rank 0 takes the lock when it starts, maybe hours later)."""
    for folder in folders:
        path = Path(folder) / LOCK_FILE
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue  # no lock file: nobody ever ran there
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # conflicts with the holder's exclusive lock only
            fcntl.flock(fd, fcntl.LOCK_UN)
        except BlockingIOError:
            raise RunFolderBusy(
                one_line(f"run folder {folder} is in use by {_read_holder(fd)}"), hint=BUSY_HINT
            ) from None
        except OSError:
            pass  # a file system that cannot lock: nothing to learn here
        finally:
            os.close(fd)


BUSY_HINT = (
    "wait for that run to end or cancel it; to run beside it, give this plan another logging.dir and checkpoint.dir"
)


def _lock_one(lock: RunLock, folder: Path) -> None:
    path = folder / LOCK_FILE
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise InputError(f"run folder {folder}: cannot create its lock file: {e.strerror or e}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        text = _read_holder(fd)
        os.close(fd)
        raise RunFolderBusy(one_line(f"run folder {folder} is in use by {text}"), hint=BUSY_HINT) from None
    except OSError as e:
        os.close(fd)
        if e.errno not in _UNSUPPORTED:
            raise
        lock.warnings.append(f"run folder {folder}: the file system cannot lock ({e.strerror}); not locked")
        return
    lock.files[path] = fd


def _read_holder(fd: int) -> str:
    """'job J (pid P on host H, since T)' from the holder's lock file, as far as it says."""
    try:
        rec = json.loads(os.pread(fd, 4096, 0).decode(errors="replace") or "{}")
    except (OSError, ValueError):
        rec = {}
    if not isinstance(rec, dict) or "pid" not in rec:
        return "another run (it has not said which yet)"
    job = f"job {rec['job']}" if rec.get("job") else "a run"
    return f"{job} (pid {rec.get('pid')} on host {rec.get('host')}, since {rec.get('since')})"


def held_by_launcher() -> bool:
    """Whether `llmctl launch` holds this run's locks: HELD_ENV names a live process (the launching llmctl)."""
    value = os.environ.get(HELD_ENV, "")
    if not value.isdigit():
        return False
    from llmctl.fileio import pid_alive

    return pid_alive(int(value))


def for_engine(logging_dir: str, checkpoint_dir: str | None, rank: int) -> RunLock | None:
    """The engine's lock (rank 0, unless the launching llmctl holds it): kept until the process ends."""
    if rank != 0 or held_by_launcher():
        return None
    return acquire(run_folders(logging_dir, checkpoint_dir), job=os.environ.get("SLURM_JOB_ID"))

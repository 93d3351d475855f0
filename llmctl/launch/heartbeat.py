"""A hung run names its stuck rank (issue 50): each rank's heartbeat, and the diagnosis read from them.

A rank stopped inside a collective (a bad NIC, a dead GPU, a rank that took another code path) used to sit silent
until NCCL's 10-30 minute timeout and then die with a wall of identical tracebacks, while `llmctl status` said
RUNNING. Now every rank writes a heartbeat beside the metrics, `<logging.dir>/heartbeats/rank-NNNNN.json`: its last
finished step, the phase it is in (data, forward, backward, optimizer, checkpoint, eval), when it entered it, its
host and pid, and its mean step time so far. A few hundred bytes, replaced whole (a temporary file renamed over it),
at each phase change: a reader never sees half a file.

The diagnosis (`diagnose`): the run is STALLED when no rank has moved for K x the step time (measured by the ranks,
else the plan's prediction; never less than a floor, so start-up and the first compile are not a stall). The ranks
behind are those at the earliest (step, phase): the others wait for them in a collective. When every rank shows the
same place, the heartbeats alone cannot tell who is stuck: their Python stacks can (`llmctl status --stacks`: the
engine dumps every thread's stack with `faulthandler` on SIGUSR2 into `<logging.dir>/stacks/rank-NNNNN.txt`).
Torch-free.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from llmctl.launch import flight

DIR = "heartbeats"
STACKS_DIR = "stacks"
PHASES = ("setup", "data", "forward", "backward", "optimizer", "eval", "checkpoint", "done")
"""In the order a step goes through them: a rank in an earlier phase of the same step is behind."""
STACK_SIGNAL = "SIGUSR2"
"""What `llmctl status --stacks` sends a rank (SIGUSR1 is the checkpoint-and-stop signal)."""
DEFAULT_FACTOR = 3.0
DEFAULT_FLOOR_S = 60.0


@dataclass(frozen=True)
class Beat:
    rank: int
    step: int
    """The last step this rank finished (0: none yet)."""
    phase: str
    since: float
    """When it entered the phase (Unix time)."""
    host: str
    pid: int
    step_s: float | None = None
    """Its mean step time so far (None before the second step)."""

    @property
    def place(self) -> tuple[int, int]:
        """Where it is in the run: (step, phase order); a smaller place is behind."""
        return self.step, PHASES.index(self.phase) if self.phase in PHASES else len(PHASES)

    def where(self) -> str:
        return f"rank {self.rank} ({self.host}, pid {self.pid}) in {self.phase} of step {self.step + 1}"


def path_of(run_dir: str | os.PathLike[str], rank: int) -> Path:
    return Path(run_dir) / DIR / f"rank-{rank:05d}.json"


def stacks_path(run_dir: str | os.PathLike[str], rank: int) -> Path:
    return Path(run_dir) / STACKS_DIR / f"rank-{rank:05d}.txt"


class Writer:
    """One rank's heartbeat file. `beat` never raises: a full or read-only disk costs the diagnosis, not the run."""

    def __init__(self, run_dir: str | os.PathLike[str], rank: int) -> None:
        self.path = path_of(run_dir, rank)
        self.rank, self.host, self.pid = rank, socket.gethostname(), os.getpid()
        self.step, self.phase = 0, "setup"
        self._steps_s: list[float] = []
        self._finished_at: float | None = None
        """When the last step given to `beat` was finished (the step time is the time from one to the next)."""
        self.failed = False
        with contextlib.suppress(OSError):
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def beat(self, phase: str, step: int | None = None) -> None:
        """This rank enters `phase` (having finished `step`, when given)."""
        now = time.time()
        if step is not None:
            if self._finished_at is not None and step > self.step:
                self._steps_s.append((now - self._finished_at) / (step - self.step))
            if self._finished_at is None or step > self.step:
                self._finished_at = now
            self.step = step
        self.phase = phase
        mean = statistics.median(self._steps_s[-20:]) if self._steps_s else None  # eval and saves: outliers
        beat = Beat(self.rank, self.step, phase, now, self.host, self.pid, mean)
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        try:
            tmp.write_text(json.dumps(asdict(beat)))
            os.replace(tmp, self.path)
        except OSError:
            self.failed = True


def read_all(run_dir: str | os.PathLike[str]) -> list[Beat]:
    """Every rank's last heartbeat in the run folder (unreadable files skipped), by rank."""
    out = []
    for p in sorted((Path(run_dir) / DIR).glob("rank-*.json")):
        try:
            data = json.loads(p.read_text())
            out.append(Beat(**{k: data[k] for k in Beat.__dataclass_fields__ if k in data}))
        except (OSError, ValueError, TypeError, KeyError):
            continue
    return out


@dataclass(frozen=True)
class Diagnosis:
    stalled: bool
    quiet_s: float
    """Seconds since the last rank moved."""
    limit_s: float
    """How long a quiet run may be before it is STALLED."""
    step_s: float | None
    """The step time the limit is a multiple of (measured, else planned)."""
    behind: tuple[Beat, ...]
    """The ranks at the earliest place (all of them when they agree: then only the stacks tell)."""
    ahead: tuple[Beat, ...]
    factor: float = DEFAULT_FACTOR

    def line(self) -> str:
        """One line for `status`, the launcher and the event."""
        if not self.stalled:
            return f"moving (last heartbeat {self.quiet_s:.0f} s ago)"
        basis = f"{self.factor:g} x the step time {self.step_s:.3g} s" if self.step_s else "the stall floor"
        who = "; ".join(b.where() for b in self.behind[:4]) + (
            f" (+{len(self.behind) - 4} more)" if len(self.behind) > 4 else ""
        )
        if not self.ahead:
            return (
                f"STALLED: no rank moved for {self.quiet_s:.0f} s (limit {self.limit_s:.0f} s: {basis}); every rank "
                f"is at the same place ({who}): `llmctl status --stacks` shows which one is stuck"
            )
        waiting = ", ".join(str(b.rank) for b in self.ahead[:8]) + ("..." if len(self.ahead) > 8 else "")
        waiting = f"ranks {waiting} wait" if len(self.ahead) > 1 else f"rank {waiting} waits"
        return (
            f"STALLED: no rank moved for {self.quiet_s:.0f} s (limit {self.limit_s:.0f} s: {basis}); behind: {who}; "
            f"{waiting} for it in {self.ahead[0].phase} of step {self.ahead[0].step + 1}"
        )


def diagnose(
    beats: list[Beat],
    now: float | None = None,
    planned_step_s: float | None = None,
    factor: float = DEFAULT_FACTOR,
    floor_s: float = DEFAULT_FLOOR_S,
) -> Diagnosis | None:
    """Is the run stalled, and who is behind (module docstring)? None without heartbeats."""
    if not beats:
        return None
    now = time.time() if now is None else now
    measured = [b.step_s for b in beats if b.step_s]
    step_s = max(measured) if measured else planned_step_s
    limit = max(floor_s, factor * step_s) if step_s else floor_s
    quiet = now - max(b.since for b in beats)
    first = min(b.place for b in beats)
    behind = tuple(b for b in beats if b.place == first)
    ahead = tuple(b for b in beats if b.place != first)
    return Diagnosis(quiet > limit, quiet, limit, step_s, behind, ahead, factor)


def group_stacks(texts: dict[int, str]) -> list[tuple[list[int], str]]:
    """Ranks' stack dumps grouped: ranks with the same stack (the thread ids and addresses left out) listed once,
    the smallest group first (the odd one out is usually the stuck rank)."""
    groups: dict[str, list[int]] = {}
    for rank, text in sorted(texts.items()):
        key = "\n".join(
            line.split(" (most recent call first)")[0] if line.startswith(("Thread", "Current thread")) else line
            for line in text.strip().splitlines()
        )
        key = "\n".join(ln for ln in key.splitlines() if not ln.startswith(("Thread 0x", "Current thread 0x")))
        groups.setdefault(key, []).append(rank)
    return sorted(((ranks, key) for key, ranks in groups.items()), key=lambda g: (len(g[0]), g[0]))


COLLECTIVES = ("all_to_all", "reduce_scatter", "all_gather", "all_reduce", "broadcast", "barrier", "recv", "send")
"""Names of torch.distributed's collectives and point-to-point calls as they appear in a stack's function names
(all_to_all_single_backward, reduce_scatter_single, all_gather_into_tensor, recv_object_list, ...)."""


def waiting_in(text: str) -> str | None:
    """The collective a rank's stack dump waits in: the innermost frame of the dump's first (current) thread whose
    function names one (faulthandler lists the most recent call first), or None."""
    for line in text.splitlines():
        line = line.strip()
        if not line and text.strip():
            break  # the first thread's dump ends at a blank line
        if line.startswith("File ") and " in " in line:
            func = line.rsplit(" in ", 1)[1].strip()
            if any(c in func for c in COLLECTIVES):
                return func
    return None


def mismatch(groups: list[tuple[list[int], str]]) -> str | None:
    """One line when groups of ranks wait in different collectives (a collective that did not match: one rank took
    another code path, or entered the collectives in another order), else None."""
    where = [(ranks, waiting_in(text)) for ranks, text in groups]
    found = [(ranks, w) for ranks, w in where if w]
    if len({w for _, w in found}) < 2:
        return None
    parts = "; ".join(f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r[:8]))} in {w}" for r, w in found)
    return f"the ranks wait in different collectives ({parts}): a collective that did not match"


def request_stacks(run_dir: str | os.PathLike[str], wait_s: float = 3.0) -> tuple[dict[int, str], list[str]]:
    """Ask every rank for its stacks and read what each added to its stacks file. The ranks of this host (their
    heartbeat's pid) get SIGUSR2 (the engine's faulthandler answers even while blocked in a collective); the ranks of
    other hosts see the request file (`llmctl.launch.flight`) on the shared run folder and dump them from a thread.
    Every rank also dumps its flight recorder then (`flight_lines`). Returns ({rank: stack text}, [why a rank gave
    none])."""
    import signal

    host = socket.gethostname()
    flight.write_request(run_dir, host)
    sizes: dict[int, int] = {}
    missing: list[str] = []
    for b in read_all(run_dir):
        path = stacks_path(run_dir, b.rank)
        try:
            sizes[b.rank] = path.stat().st_size if path.exists() else 0
            if b.host == host:
                os.kill(b.pid, getattr(signal, STACK_SIGNAL))
        except OSError as e:
            sizes.pop(b.rank, None)
            missing.append(f"rank {b.rank} (pid {b.pid}): {e.strerror or e}")
    texts: dict[int, str] = {}
    deadline = time.monotonic() + wait_s
    while sizes and time.monotonic() < deadline:
        for rank, size in list(sizes.items()):
            path = stacks_path(run_dir, rank)
            with contextlib.suppress(OSError):
                if path.stat().st_size > size:
                    time.sleep(0.2)  # faulthandler writes a dump in a burst: let it finish
                    with path.open("rb") as f:
                        f.seek(size)
                        texts[rank] = f.read().decode(errors="replace")
                    del sizes[rank]
        time.sleep(0.05)
    missing += [f"rank {r}: no stack within {wait_s:g} s" for r in sizes]
    return texts, missing


def flight_lines(run_dir: str | os.PathLike[str], since: float, wait_s: float = 2.0) -> list[str]:
    """What the ranks' flight recorders, dumped after `since` (a request or a timeout), say about the collective
    they disagree on (`llmctl.launch.flight.disagreement`)."""
    ranks = [b.rank for b in read_all(run_dir)]
    return flight.disagreement(flight.wait_for_dumps(run_dir, ranks, since, wait_s))

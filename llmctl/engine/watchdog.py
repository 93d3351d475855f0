"""One rank's side of hang diagnosis (issue 50; the reader is llmctl.launch.heartbeat).

- A heartbeat per phase change (data, forward, backward, optimizer, eval, checkpoint): `beat`.
- Every thread's Python stack on SIGUSR2, appended to `<logging.dir>/stacks/rank-NNNNN.txt` by `faulthandler` (in C:
  it answers even while the rank is blocked in a collective), for `llmctl status --stacks`.
- The process group's timeout from the plan (`watchdog.collective_timeout_s`, else 10 x the planned step time, at
  least 600 s), and a collective that timed out or lost its peer ends the rank with one line naming where it was,
  not a traceback per rank.
- On NCCL, torch's flight recorder switched on (`TORCH_NCCL_TRACE_BUFFER_SIZE`), dumping on a timeout into
  `<logging.dir>/flight/` (read with `python -m torch.distributed.flight_recorder.fr_trace <dir>`).
- For tests only: `LLMCTL_TEST_STALL=RANK:STEP:SECONDS` makes that rank sleep in the data phase of that step (in
  slices, leaving early when the launcher asks the ranks to stop), so the stall tests are real.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

from llmctl.errors import RuntimeFailure
from llmctl.launch import heartbeat

STALL_ENV = "LLMCTL_TEST_STALL"
FLIGHT_DIR = "flight"
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")
_TIMED_OUT = ("Timed out", "timed out", "Timeout", "Watchdog caught collective operation timeout")


class Watchdog:
    def __init__(self, run_dir: str | os.PathLike[str], rank: int) -> None:
        self.rank = rank
        self.beats = heartbeat.Writer(run_dir, rank)
        self._stacks: IO[str] | None = None
        path = heartbeat.stacks_path(run_dir, rank)
        with contextlib.suppress(OSError, ValueError, RuntimeError):  # no file, no stacks: the run goes on
            path.parent.mkdir(parents=True, exist_ok=True)
            self._stacks = path.open("a")
            faulthandler.register(signal.SIGUSR2, file=self._stacks, all_threads=True, chain=False)
        self._stall = _stall_hook(rank)

    def beat(self, phase: str, step: int | None = None) -> None:
        self.beats.beat(phase, step)

    def data(self, step: int, stopping: Callable[[], bool]) -> None:
        """The data phase of step `step + 1` begins (`step` finished): the heartbeat, and the test hook's sleep."""
        self.beat("data", step)
        if self._stall is not None and step + 1 == self._stall[0]:
            until = time.monotonic() + self._stall[1]
            while time.monotonic() < until and not stopping():
                time.sleep(0.05)

    def where(self) -> str:
        b = self.beats
        return f"in {b.phase} of step {b.step + 1}"

    def close(self) -> None:
        with contextlib.suppress(RuntimeError, ValueError):
            faulthandler.unregister(signal.SIGUSR2)
        if self._stacks is not None:
            self._stacks.close()


def _stall_hook(rank: int) -> tuple[int, float] | None:
    """(step, seconds) of LLMCTL_TEST_STALL for this rank, or None."""
    value = os.environ.get(STALL_ENV, "")
    try:
        r, step, seconds = value.split(":")
        return (int(step), float(seconds)) if int(r) == rank else None
    except ValueError:
        return None


def flight_recorder_env(run_dir: str | os.PathLike[str]) -> None:
    """NCCL's flight recorder on (before the process group exists): the last 2,000 collectives per rank, dumped on a
    timeout (torch/csrc/distributed/c10d/FlightRecorder; the env names of torch 2.13)."""
    folder = Path(run_dir) / FLIGHT_DIR
    with contextlib.suppress(OSError):
        folder.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000")
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    os.environ.setdefault("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", str(folder / "rank_"))


def collective_failure(e: BaseException, rank: int, where: str, timeout: float) -> RuntimeFailure | None:
    """One line for a collective that timed out or lost its peer (another rank is stuck or gone), else None."""
    text = str(e)
    if not isinstance(e, RuntimeError):
        return None
    who = "rank 0: " if rank == 0 else ""  # the others' lines are prefixed "[rank N]" (llmctl.errors.report)
    if any(m in text for m in _TIMED_OUT):
        return RuntimeFailure(
            f"{who}a collective waited more than {timeout:.0f} s {where} (watchdog.collective_timeout_s): "
            "another rank is stuck or gone",
            hint="`llmctl status` names the rank that is behind; `llmctl status --stacks JOB` shows its stack",
        )
    if any(m in text for m in _PEER_GONE):
        return RuntimeFailure(
            f"{who}another rank left during a collective {where}",
            hint="its own line (or `llmctl logs`) says why",
        )
    return None

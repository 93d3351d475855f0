"""One rank's side of hang diagnosis (issue 50; the reader is llmctl.launch.heartbeat).

- A heartbeat per phase change (data, forward, backward, optimizer, eval, checkpoint): `beat`.
- Every thread's Python stack on SIGUSR2, appended to `<logging.dir>/stacks/rank-NNNNN.txt` by `faulthandler` (in C:
  it answers even while the rank is blocked in a collective), for `llmctl status --stacks`.
- The process group's timeout from the plan (`watchdog.collective_timeout_s`, else 10 x the planned step time, at
  least 600 s), and a collective that timed out or lost its peer ends the rank with one line naming where it was,
  not a traceback per rank.
- torch's flight recorder switched on for gloo and NCCL (`TORCH_FR_BUFFER_SIZE`), written as JSON to
  `<logging.dir>/flight/rank-NNNNN.json` when a reader asks (`llmctl.launch.flight`'s request file, watched by a
  thread: it answers while the main thread is blocked in a collective, and for ranks on other hosts, which also dump
  their stacks then, since no signal reaches them) and when a collective times out. On NCCL, torch's own dump on a
  timeout too (a pickle for `python -m torch.distributed.flight_recorder.fr_trace <dir>`).
- For tests only: `LLMCTL_TEST_STALL=RANK:STEP:SECONDS` makes that rank sleep in the data phase of that step (in
  slices, leaving early when the launcher asks the ranks to stop), so the stall tests are real.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, TYPE_CHECKING

from llmctl.errors import RuntimeFailure
from llmctl.launch import flight, heartbeat

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

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
        self.run_dir = Path(run_dir)
        self._closed = threading.Event()
        self._requests = threading.Thread(target=self._answer_requests, name="llmctl-flight", daemon=True)
        self._requests.start()

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

    def dump_flight(self) -> None:
        """This rank's flight recorder(s) as JSON into the run folder (whole: a temporary file renamed over it)."""
        recorders = flight_recorders()
        if not recorders:
            return
        path = flight.dump_path(self.run_dir, self.rank)
        with contextlib.suppress(OSError):
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.tmp")
            body = {
                "rank": self.rank,
                "host": socket.gethostname(),
                "time": time.time(),
                "recorders": recorders,
                "groups": group_members(),
            }
            tmp.write_text(json.dumps(body))
            os.replace(tmp, path)

    def _answer_requests(self) -> None:
        """Each new request (written after this rank started): the flight recorder, and the stacks when the reader
        runs on another host (its SIGUSR2 reaches only the ranks of its own host)."""
        seen = time.time()
        host = socket.gethostname()
        while not self._closed.wait(0.5):
            req = flight.read_request(self.run_dir)
            if req is None or req.stamp <= seen:
                continue
            seen = req.stamp
            self.dump_flight()
            if req.host != host and self._stacks is not None:
                with contextlib.suppress(OSError, ValueError, RuntimeError):
                    faulthandler.dump_traceback(file=self._stacks, all_threads=True)

    def close(self) -> None:
        self._closed.set()
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


def flight_recorder_env(run_dir: str | os.PathLike[str], backend: str) -> None:
    """torch's flight recorder on (before the process group exists): the last 2,000 collectives per rank, for gloo
    and NCCL; on NCCL also torch's own dump on a timeout (torch/csrc/distributed/c10d/FlightRecorder; the env names
    of torch 2.13)."""
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", str(flight.BUFFER_ENTRIES))
    if backend != "nccl":
        return
    folder = Path(run_dir) / FLIGHT_DIR
    with contextlib.suppress(OSError):
        folder.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", str(flight.BUFFER_ENTRIES))
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    os.environ.setdefault("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", str(folder / "rank_"))


def flight_recorders() -> dict[str, object]:
    """{backend: torch's flight-recorder dump as parsed JSON} of this process: gloo's (CPU collectives) and, on a CUDA
    build, NCCL's. Empty when the recorder is off or torch has none."""
    import torch._C._distributed_c10d as c10d

    out: dict[str, object] = {}
    for backend, name in (("gloo", "_dump_fr_trace_json"), ("nccl", "_dump_nccl_trace_json")):
        dump = getattr(c10d, name, None)
        if dump is None:
            continue
        with contextlib.suppress(RuntimeError, ValueError, TypeError):
            fr = json.loads(dump(True, False))
            if fr.get("entries") or any(
                int(s.get("last_enqueued_collective", -1)) > 0 for s in fr.get("pg_status", {}).values()
            ):
                out[backend] = fr
    return out


def with_plan_timeout(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh's sub-groups wait as long as the default group (the plan's `watchdog.collective_timeout_s`, set by
    `init_process_group`): torch makes them with its own default (30 minutes on gloo, 10 on NCCL), so a rank stuck
    under tensor, context, expert or pipeline parallelism, or HSDP, went unnoticed for half an hour (seen on a tp 2
    run whose stuck rank's peers waited in their tp group's all-reduce)."""
    import torch
    import torch.distributed.distributed_c10d as c10d

    default = c10d._get_default_group()
    try:
        timeout = default._get_backend(torch.device(mesh.device_type)).options._timeout
    except (RuntimeError, AttributeError, ValueError):  # a backend without options: torch's default stays
        return mesh
    for name in mesh.mesh_dim_names or ():
        group = mesh.get_group(name)
        if group is not default:
            c10d._set_pg_timeout(timeout, group)
    return mesh


def group_members() -> dict[str, list[int]]:
    """{process group name: its global ranks} of the groups this rank belongs to: the flight recorder names a
    collective's group but, on gloo, not its members, and groups of one mesh dimension share a description."""
    import torch.distributed as dist

    out: dict[str, list[int]] = {}
    with contextlib.suppress(RuntimeError, ValueError, AttributeError):
        for pg, name in dict(dist.distributed_c10d._world.pg_names).items():
            out[str(name)] = sorted(dist.get_process_group_ranks(pg))
    return out


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

"""Local launch: one `torchrun --standalone` on this machine running `python -m llmctl.engine PLAN`, and the
torchrun command line that `llmctl bench-net` uses too (`module_argv`). Torch-free.

A local run streams its output to this terminal and its exit code is llmctl's; it also gets a job folder with a
`job.json` record (the torchrun pid), `console.log` (everything torchrun and the ranks printed, tracebacks
included: llmctl copies torchrun's stdout and stderr there as it passes them to the terminal) and an `events` line
when it ends, so that `llmctl status`, `logs` and `cancel` work for it like for a SLURM job.

`llmctl cancel` asks the engine ranks themselves to stop (SIGTERM, the engine's stop signal: they agree at the next
step boundary, save a checkpoint and exit 0), so torchrun ends cleanly instead of raising its SignalException; the
launching llmctl then records `cancelled ...` in events and exits with CANCELLED_EXIT (143).

SIGTERM, SIGHUP and SIGINT to the launching llmctl (a job wrapper or CI timeout, a closed terminal, Ctrl-C) do the
same: torchrun runs in a session of its own, so no terminal signal reaches it or its ranks directly, and llmctl,
alive and still copying their output, asks the ranks to checkpoint, records the run as cancelled `by` the signal, and
exits with 128 + the signal's number (143, 129, 130), one line. A second signal ends the ranks through torchrun, a
third kills them. SIGKILL to llmctl cannot be handled: torchrun's parent-death signal (SIGTERM) ends the run.
Before, llmctl died at once: torchrun and its ranks went on with parent pid 1, died on the closed pipe before their
checkpoint, and `status` said UNKNOWN.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from llmctl.errors import InputError, RuntimeFailure, one_line
from llmctl.fileio import whole_lines_end
from llmctl.launch import flight, heartbeat, jobs, runlock, shell
from llmctl.launch.backends import Job, LaunchBackend

ENGINE_MODULE = "llmctl.engine"
CONSOLE_LOG = "console.log"
CANCELLED_EXIT = 128 + signal.SIGTERM
"""The launching llmctl's exit code after `llmctl cancel`: 143, what a shell reports for a process ended by SIGTERM
(the signal cancel sends), apart from 1 (the run failed), 2 (bad input) and 130 (Ctrl-C)."""
RANKS_READY_WAIT_S = 120.0
"""How long `cancel` waits for starting ranks to install the engine's stop-signal handler before it falls back to
SIGTERM to torchrun (ranks still importing torch would die of a SIGTERM, and torchrun would report a failure)."""
CANCEL_WAIT_S = 300.0
"""How long `cancel` waits for a run to save its checkpoint and end before it returns (the run keeps stopping)."""
LAUNCHER_LINE_WAIT_S = 10.0
"""How long `cancel` waits, once torchrun has exited, for the launching llmctl to record the end in events."""


def torchrun_command() -> list[str]:
    """torchrun of the Python that runs llmctl (a venv's own), else the one on PATH, else `python -m`."""
    beside = Path(sys.executable).with_name("torchrun")
    if beside.is_file():
        return [str(beside)]
    found = shutil.which("torchrun")
    return [found] if found else [sys.executable, "-m", "torch.distributed.run"]


def visible_gpus() -> int:
    """GPUs this process may use, without importing torch (CUDA_VISIBLE_DEVICES, else `nvidia-smi -L`)."""
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    if cvd is not None:
        return len([d for d in cvd.split(",") if d.strip() and d.strip() != "-1"])
    smi = shutil.which("nvidia-smi")
    if not smi:
        return 0
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=10, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


NPROC_AUTO = "auto"
"""--nproc-per-node's spelling for the GPUs this machine has."""


def resolve_nproc(requested: str | None, plan_nproc: int) -> int:
    """--nproc-per-node: None -> the plan's value; 'auto' -> the GPUs present (1 on a CPU-only machine)."""
    if requested is None:
        return plan_nproc
    if requested == NPROC_AUTO:
        return max(1, visible_gpus())
    try:
        n = int(requested)
    except ValueError:
        raise InputError(f"--nproc-per-node {requested!r}: expected a positive integer or 'auto'") from None
    if n < 1:
        raise InputError(f"--nproc-per-node {n}: must be at least 1")
    return n


@dataclass(frozen=True)
class Rendezvous:
    """How torchrun's agents find each other: one node alone (`--standalone`, torchrun picks a free port), or a
    static rendezvous hosted by node rank 0 at master_addr:master_port."""

    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    timeout_s: float | None = None
    """How long node rank 0 waits for the other nodes' agents (torchrun's rdzv timeout; several nodes only)."""


def module_argv(
    module: str,
    args: Sequence[str],
    nproc_per_node: int,
    rdzv: Rendezvous = Rendezvous(),
    *,
    max_restarts: int | None = None,
    launcher: Sequence[str] | None = None,
) -> list[str]:
    """`torchrun ... --module MODULE ARGS`: the one place llmctl builds a torchrun command line (launch, bench-net).
    `launcher` replaces the torchrun executable (default: `torchrun_command()`)."""
    argv = list(launcher or torchrun_command())
    if rdzv.nnodes == 1:
        argv += ["--standalone", "--nnodes=1"]
    else:
        argv += [
            f"--nnodes={rdzv.nnodes}",
            f"--node_rank={rdzv.node_rank}",
            f"--master_addr={rdzv.master_addr}",
            f"--master_port={rdzv.master_port}",
        ]
    argv.append(f"--nproc_per_node={nproc_per_node}")
    if max_restarts is not None:
        argv.append(f"--max_restarts={max_restarts}")
    if rdzv.nnodes > 1 and rdzv.timeout_s is not None:
        argv.append(f"--rdzv_conf=timeout={int(rdzv.timeout_s)}")
    return [*argv, "--module", module, *map(str, args)]


def torchrun_argv(plan_path: str | os.PathLike[str], nproc_per_node: int) -> list[str]:
    """The exact local command: single node, standalone rendezvous (torchrun picks a free port)."""
    return module_argv(ENGINE_MODULE, [str(plan_path)], nproc_per_node)


class RunFailed(RuntimeFailure):
    """The launched run failed: its exit code becomes llmctl's."""

    def __init__(self, code: int, hint: str | None = None) -> None:
        super().__init__(f"the run exited with code {code}", hint)
        self.exit_code = code


class RunCancelled(RuntimeFailure):
    """The launched run was stopped by `llmctl cancel` (llmctl exits with CANCELLED_EXIT) or by a signal to the
    launching llmctl (128 + the signal's number, as a shell reports a process that signal ended)."""

    def __init__(self, message: str, exit_code: int = CANCELLED_EXIT) -> None:
        super().__init__(message)
        self.exit_code = exit_code


STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)
"""What `llmctl launch` turns into a cancel of its run: a job wrapper's or CI timeout's SIGTERM, a closed terminal's
SIGHUP, Ctrl-C. The first asks the ranks to checkpoint and stop, the second ends them through torchrun, a third
SIGKILLs the ranks and torchrun (`_stop_on_signal`)."""


def run(
    argv: list[str],
    env: dict[str, str] | None = None,
    on_start: Callable[[subprocess.Popen], None] | None = None,
    console: Path | None = None,
    on_signal: Callable[[subprocess.Popen, int, int], None] | None = None,
    on_tick: Callable[[], None] | None = None,
) -> int:
    """Run the command, its output on this terminal's stdout/stderr, and return its exit code. `env` is added to this
    process's environment; `on_start` is called with the process once it runs. With `console`, the output also goes
    to that file: read from pipes, line by line (so the ranks see no terminal and print plain lines, unbuffered).

    Without `on_signal`, Ctrl-C reaches torchrun through the terminal's process group; we only wait for it. With it,
    the command runs in a session of its own (no terminal signal reaches it), and each STOP_SIGNALS this process gets
    while it runs calls `on_signal(process, signal, how many so far)`; we keep waiting (and copying its output), and
    call `on_tick()` every TICK_S seconds meanwhile (the stall watch)."""
    if console is not None:
        env = {**(env or {}), "PYTHONUNBUFFERED": "1"}  # a crashed rank's last lines are not lost in a buffer
        sys.stdout.flush()
        sys.stderr.flush()
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE} if console is not None else {}
    received: list[int] = []
    saved = {s: signal.signal(s, lambda n, _: received.append(n)) for s in STOP_SIGNALS} if on_signal else {}
    try:
        try:
            proc = subprocess.Popen(
                argv,
                env={**os.environ, **env} if env else None,
                start_new_session=bool(on_signal),
                preexec_fn=_ends_with(os.getpid()) if on_signal and sys.platform == "linux" else None,
                **pipes,
            )
        except OSError as e:
            raise RuntimeFailure(f"could not start {argv[0]}: {e.strerror}", hint="is torch installed?") from None
        tee = _Tee(proc, console) if console is not None else None
        try:
            if on_start is not None:
                on_start(proc)
            return _wait(proc, received, on_signal, on_tick)
        finally:
            if tee is not None:
                tee.close()
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)


def _ends_with(parent: int) -> Callable[[], None]:
    """For Popen's preexec_fn (Linux): the child gets SIGTERM when `parent` dies, even of SIGKILL, which no handler
    sees (prctl PR_SET_PDEATHSIG; kept across exec). In a session of its own, torchrun is out of reach of a kill of
    llmctl's process group: this ends it, and torchrun then ends its ranks, instead of their running on until their
    next line of output meets the closed pipe."""

    def preexec() -> None:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG (linux/prctl.h)
        if os.getppid() != parent:  # it died before the prctl
            os.kill(os.getpid(), signal.SIGTERM)

    return preexec


TICK_S = 2.0


def _wait(
    proc: subprocess.Popen,
    received: list[int],
    on_signal: Callable[[subprocess.Popen, int, int], None] | None,
    on_tick: Callable[[], None] | None = None,
) -> int:
    if on_signal is None:
        try:
            return _exit_code(proc.wait())
        except KeyboardInterrupt:
            # torchrun got the SIGINT too and is shutting its workers down; give it time, then insist.
            try:
                return _exit_code(proc.wait(timeout=60))
            except (subprocess.TimeoutExpired, KeyboardInterrupt):
                proc.send_signal(signal.SIGKILL)
                return _exit_code(proc.wait())
    handled = 0
    next_tick = time.monotonic() + TICK_S
    while True:
        while handled < len(received):  # the handlers only record: the work runs here, between waits
            handled += 1
            on_signal(proc, received[handled - 1], handled)
        try:
            return _exit_code(proc.wait(timeout=0.2))
        except subprocess.TimeoutExpired:
            pass
        if on_tick is not None and time.monotonic() >= next_tick:
            next_tick = time.monotonic() + TICK_S
            on_tick()


class _Tee:
    """Copies a process's stdout and stderr, line by line, to ours and to one log file (a thread per stream)."""

    def __init__(self, proc: subprocess.Popen, path: Path) -> None:
        self.log = open(path, "ab", buffering=0)  # noqa: SIM115 - closed in close(), after the copying threads
        self.lock = threading.Lock()
        self.threads = [
            threading.Thread(target=self._copy, args=(src, dst), daemon=True)
            for src, dst in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr))
        ]
        for t in self.threads:
            t.start()

    def _copy(self, src: BinaryIO, dst: object) -> None:
        out = getattr(dst, "buffer", None)
        quiet = AgentTraceback()
        for line in iter(src.readline, b""):
            with self.lock:
                self.log.write(line)
            shown = quiet.filter(line)
            if not shown:
                continue
            line = b"".join(shown)
            try:
                if out is not None:
                    out.write(line)
                    out.flush()
                else:  # a text-only stream (a test's capture)
                    dst.write(line.decode(errors="replace"))  # type: ignore[attr-defined]
                    dst.flush()  # type: ignore[attr-defined]
            except (OSError, ValueError):
                pass  # the terminal or reader went away: the log still gets every line
        src.close()

    def close(self) -> None:
        # The pipes close when torchrun and its ranks have exited; a stray grandchild holding them must not keep
        # llmctl waiting forever.
        for t in self.threads:
            t.join(timeout=10)
        if not any(t.is_alive() for t in self.threads):
            self.log.close()


class AgentTraceback:
    """Leaves torchrun's own ChildFailedError traceback (30 lines: its frames, then the failures table) out of the
    terminal: each rank already said why it failed in one line, and llmctl ends with one line naming the console log,
    which keeps every line."""

    RULE = b"=" * 20

    def __init__(self) -> None:
        self.held: bytes | None = None
        self.rules_left = 0

    def filter(self, line: bytes) -> list[bytes]:
        """The lines to show for this one (none, it, or a held line and it)."""
        if self.rules_left:
            if line.startswith(self.RULE):
                self.rules_left -= 1
            return []
        if self.held is not None:
            held, self.held = self.held, None
            if b"bin/torchrun" in line or b"torch/distributed/run.py" in line:
                self.rules_left = 2  # through the failures table's closing rule
                return []
            return [held, *self.filter(line)]
        if line.startswith(b"Traceback (most recent call last):"):
            self.held = line
            return []
        return [line]


def _exit_code(rc: int) -> int:
    # A child killed by signal N reports -N; shells report 128+N.
    return 128 - rc if rc < 0 else rc


def _process_start(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22): with the pid, it tells a
    process from a later one that reused the pid. None where /proc is missing."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # fields after "(comm)" start at field 3


def _alive(record: jobs.JobRecord) -> bool:
    if record.pid is None or record.host != socket.gethostname():
        return False
    try:
        os.kill(record.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # someone else's process: it exists
    return record.pid_start is None or _process_start(record.pid) == record.pid_start


_SIGTERM_BIT = 1 << (signal.SIGTERM - 1)


def _engine_ranks(torchrun_pid: int) -> dict[int, bool] | None:
    """torchrun's engine ranks (its children running ENGINE_MODULE): pid -> whether the rank catches SIGTERM yet
    (its SigCgt mask in /proc/PID/status: the engine installs its stop-signal handler early in the run). None where
    /proc cannot tell."""
    try:
        pids = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]
    except OSError:
        return None
    out: dict[int, bool] = {}
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[1]) != torchrun_pid:  # field 4, the parent pid
                continue
            if ENGINE_MODULE not in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0"):
                continue
            status = Path(f"/proc/{pid}/status").read_text()
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
        caught = next((ln.split()[1] for ln in status.splitlines() if ln.startswith("SigCgt:")), "0")
        out[pid] = bool(int(caught, 16) & _SIGTERM_BIT)
    return out


def _ranks_ready(record: jobs.JobRecord, timeout_s: float) -> list[int] | None:
    """The pids of the run's ranks once all of them catch SIGTERM; [] when the run ended meanwhile; None when that
    cannot be seen (no /proc) or did not happen within timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        if not _alive(record):
            return []
        ranks = _engine_ranks(record.pid)  # type: ignore[arg-type]
        if ranks is None:
            return None
        if len(ranks) >= record.nproc_per_node and all(ranks.values()):
            return list(ranks)
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.2)


def _wait_ended(record: jobs.JobRecord, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while _alive(record):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.2)
    return True


def _run_outcome(metrics: str | None, offset: int) -> dict[str, int | str | None]:
    """What this run's engine recorded in metrics.jsonl past `offset` (earlier runs of the plan wrote before it):
    the step it stopped at on the signal, its last checkpoint's step, and why it ended ("done", "signal")."""
    out: dict[str, int | str | None] = {"stop": None, "checkpoint": None, "end": None}
    if not metrics:
        return out
    try:
        with open(metrics, "rb") as f:
            f.seek(offset)
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return out
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a line cut by a crash
        event = rec.get("event") if isinstance(rec, dict) else None
        if event == "stop":
            out["stop"] = rec.get("step")
        elif event == "checkpoint":
            out["checkpoint"] = rec.get("step")
        elif event == "end":
            out["end"] = rec.get("reason")
    return out


def _cancelled_line(
    record: jobs.JobRecord, outcome: dict[str, int | str | None], code: int | None, by: str | None = None
) -> str:
    """The events line of a cancelled local run: `cancelled TIME step S checkpoint C exit N [by SIGNAL]` ("-": not
    known; `by`: the signal the launching llmctl got, when that is what stopped it)."""

    def word(v: object) -> str:
        return "-" if v is None else str(v)

    checkpoint = outcome["checkpoint"] if outcome["checkpoint"] is not None else jobs.last_checkpoint_step(record)
    return (
        f"{jobs.CANCELLED} {jobs.now_utc()} step {word(outcome['stop'])} checkpoint {word(checkpoint)}"
        f" exit {word(code)}" + (f" by {by}" if by else "")
    )


def cancel_message(record: jobs.JobRecord, line: str) -> str:
    """One line from a `cancelled ...` events line: "job X cancelled at step S: checkpoint at step S saved"."""
    words = line.split()
    fields = dict(zip(words[2::2], words[3::2]))
    step, ckpt, code, by = (fields.get(k, "-") for k in ("step", "checkpoint", "exit", "by"))
    text = (
        f"job {record.job_id} cancelled"
        + (f" by {by}" if by != "-" else "")
        + (f" at step {step}" if step != "-" else "")
    )
    if ckpt != "-" and ckpt == step:
        text += f": checkpoint at step {ckpt} saved (launch the plan again to resume from it)"
    elif ckpt != "-":
        text += f": last checkpoint at step {ckpt}"
    elif record.checkpoint_dir is None:
        text += ": no checkpoint (the plan has no checkpoint.dir)"
    else:
        text += ": no checkpoint saved"
    if code not in ("-", "0"):
        text += f" (torchrun exited with code {code})"
    return text


def _cancel_requested(record: jobs.JobRecord) -> bool:
    return any(ln.split()[0] == jobs.CANCEL_REQUESTED for ln in jobs.events(record))


def _ask_ranks_to_stop(record: jobs.JobRecord) -> None:
    """SIGTERM to each engine rank once all of them catch it (the engine's stop signal: they agree at the next step
    boundary, checkpoint and exit 0); to torchrun itself when /proc cannot tell or they never get that far."""
    ranks = _ranks_ready(record, RANKS_READY_WAIT_S)
    for pid in ranks or ([record.pid] if ranks is None else []):  # type: ignore[list-item]
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)


def _stop_on_signal(record: jobs.JobRecord, proc: subprocess.Popen, signum: int, count: int) -> None:
    """What a signal to the launching llmctl does to its run (`run`'s on_signal): the first what `llmctl cancel` does
    (recorded, then the ranks asked, from a thread: they may still be importing torch); the next one SIGTERM to
    torchrun, which ends its ranks now; from the third, SIGKILL to the ranks and torchrun."""
    if count == 1 and not _cancel_requested(record):
        jobs.append_event(record, f"{jobs.CANCEL_REQUESTED} {jobs.now_utc()} by {signal.Signals(signum).name}")
        threading.Thread(target=_ask_ranks_to_stop, args=(record,), daemon=True).start()
        return
    kill = signal.SIGTERM if count <= 2 else signal.SIGKILL
    targets = [proc.pid] if kill == signal.SIGTERM else [*(_engine_ranks(proc.pid) or {}), proc.pid]
    for pid in targets:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, kill)


def _own_run_folder(job: Job) -> runlock.RunLock:
    """The run folder's lock (llmctl.launch.runlock), held by this llmctl while torchrun runs."""
    lock = runlock.acquire(job.run_folders())  # the job id follows once torchrun runs (describe)
    for warning in lock.warnings:
        print(one_line(f"llmctl: warning: {warning}"), file=sys.stderr, flush=True)
    return lock


def _stall_watch(record: jobs.JobRecord) -> Callable[[], None]:
    """The local launcher's stall watch (issue 50): once the ranks' heartbeats say STALLED, one warning line naming
    the rank behind and how to see the stacks (again only after the run moved and stalled anew), and a `stalled`
    event in the job folder."""
    said: list[float] = []

    def tick() -> None:
        try:
            found = record.diagnosis()
        except OSError:
            return
        if found is None or not found.stalled:
            said.clear()
            return
        last = max(b.since for b in found.behind + found.ahead)
        if said and said[0] == last:
            return
        said[:] = [last]
        line = f"{found.line()}; `llmctl status --stacks {record.job_id}`"
        print(one_line(f"llmctl: warning: {line}"), file=sys.stderr, flush=True)
        if record.metrics:
            for why in _where_they_wait(Path(record.metrics).parent, every_rank_alike=not found.ahead):
                print(one_line(f"llmctl: warning: {why}"), file=sys.stderr, flush=True)
        with contextlib.suppress(OSError):
            jobs.append_event(record, f"stalled {jobs.now_utc()} {one_line(found.line())}")

    return tick


def _where_they_wait(run_dir: Path, every_rank_alike: bool) -> list[str]:
    """The collective the stalled ranks disagree on, from their flight recorders; when every heartbeat shows the
    same place, also the collectives their stacks wait in (the heartbeats cannot tell who is stuck then)."""
    asked = time.time()
    lines: list[str] = []
    with contextlib.suppress(OSError):
        if every_rank_alike:
            texts, _ = heartbeat.request_stacks(run_dir)
            lines += [why] if (why := heartbeat.mismatch(heartbeat.group_stacks(texts))) else []
        else:
            flight.write_request(run_dir, socket.gethostname())
        lines += [f"flight recorder: {line}" for line in heartbeat.flight_lines(run_dir, asked)]
    return lines


def check_machine(job: Job) -> None:
    """A GPU plan launched here needs the GPUs it asks for: on a machine with fewer (none), torchrun would start
    ranks that fail one by one ("flash needs a CUDA GPU", a ChildFailedError), or, with attention auto, train
    silently on the CPU at another speed and precision than planned. One line before anything starts instead (the
    same for --dry-run and --dry-start)."""
    gpu = job.plan.hardware.gpu
    if gpu is None:
        return
    have = visible_gpus()
    if have < job.nproc_per_node:
        seen = "no GPU" if have == 0 else f"{have} GPU{'s' if have > 1 else ''}"
        raise InputError(
            f"the plan is for {job.nproc_per_node} {gpu} GPU{'s' if job.nproc_per_node > 1 else ''} per node and "
            f"this machine has {seen} visible (CUDA_VISIBLE_DEVICES, nvidia-smi)",
            hint="launch it where the GPUs are (--slurm), or plan for this machine: hardware.gpu null runs on the CPU "
            "(gloo)",
        )


class LocalBackend(LaunchBackend):
    name = "local"
    help = "torchrun --standalone on this machine"
    foreground = True

    def _check(self, job: Job) -> None:
        if job.nodes != 1:
            raise InputError(
                f"the plan is for {job.nodes} nodes; a local launch runs on this one machine",
                hint="add --slurm, or pass --nodes 1",
            )
        check_machine(job)

    def render(self, job: Job) -> str:
        self._check(job)
        run_plan = job.plan_path
        if job.resized:
            job.effective_plan  # noqa: B018 - validates the resized plan, as a real launch would
            run_plan = job.dry_run_folder() / "plan.yaml"
        return job.env_prefix() + shell.join(torchrun_argv(run_plan, job.nproc_per_node)) + "\n"

    def submit(self, job: Job) -> jobs.JobRecord:
        self._check(job)
        if job.resized:
            job.effective_plan  # noqa: B018 - validate before creating anything
        lock = _own_run_folder(job)  # before anything is written: a second launch stops here, in one line
        try:
            return self._run(job, lock)
        finally:
            lock.release()

    def _run(self, job: Job, lock: runlock.RunLock) -> jobs.JobRecord:
        folder = job.new_folder()
        # The engine reads the world size from the plan too: a resized run uses the folder's copy that says so;
        # otherwise the user's own file (so the command is the one they would type).
        run_plan = folder / "plan.yaml" if job.resized else job.plan_path
        argv = torchrun_argv(run_plan, job.nproc_per_node)
        console = folder / CONSOLE_LOG
        record = job.record(self.name, "local", folder, [console], argv)
        record.host = socket.gethostname()
        metrics = Path(record.metrics)  # type: ignore[arg-type]
        # The plan's earlier runs wrote before this; a torn last line of theirs is cut by the engine on open.
        offset = whole_lines_end(metrics)
        print(one_line(f"llmctl: {job.env_prefix()}{shell.join(argv)}"), file=sys.stderr, flush=True)

        def started(proc: subprocess.Popen) -> None:
            record.job_id, record.pid, record.pid_start = f"local-{proc.pid}", proc.pid, _process_start(proc.pid)
            record.save()
            lock.describe(record.job_id)
            print(
                one_line(f"llmctl: job {record.job_id}, folder {shell.quote(str(folder))}"), file=sys.stderr, flush=True
            )

        signals: list[int] = []  # SIGTERM, SIGHUP, Ctrl-C to this llmctl: what `llmctl cancel` does (STOP_SIGNALS)

        def stop(proc: subprocess.Popen, signum: int, count: int) -> None:
            signals.append(signum)
            _stop_on_signal(record, proc, signum, count)

        env = {**job.env, runlock.HELD_ENV: str(os.getpid())}  # the ranks take no lock of their own
        code = run(argv, env=env, on_start=started, console=console, on_signal=stop, on_tick=_stall_watch(record))
        if _cancel_requested(record):
            outcome = _run_outcome(record.metrics, offset)
            if not (code == 0 and outcome["end"] == "done"):  # else it finished before the stop took effect
                by = signal.Signals(signals[0]).name if signals else None
                line = _cancelled_line(record, outcome, code, by)
                jobs.append_event(record, line)
                raise RunCancelled(cancel_message(record, line), 128 + signals[0] if signals else CANCELLED_EXIT)
        jobs.append_event(record, f"exit {code} {jobs.now_utc()} restart 0")  # the line the sbatch script appends
        if code:
            raise RunFailed(code, hint=f"its output: {shell.quote(str(console))}, or `llmctl logs {record.job_id}`")
        return record

    def logs(self, record: jobs.JobRecord) -> list[Path]:
        return [Path(record.folder) / CONSOLE_LOG]  # also for records that listed metrics.jsonl (older llmctl)

    def state(self, record: jobs.JobRecord) -> str:
        ended = jobs.folder_state(record)
        if ended == "CANCELLING":  # a stop was asked; no line since, so the launching llmctl has not seen the end
            return ended if _alive(record) else "CANCELLED"
        if ended != "UNKNOWN":
            return ended
        if _alive(record):
            return "RUNNING"
        if record.host != socket.gethostname():
            return f"UNKNOWN (ran on {record.host})"
        return "UNKNOWN"  # llmctl was killed before it could record the exit code

    def cancel(self, record: jobs.JobRecord) -> str:
        """Ask the ranks to checkpoint and stop (SIGTERM to each: the engine's stop signal), wait for the run to
        end, and say how it ended. A second cancel while it is still stopping sends SIGTERM to torchrun, which
        ends the ranks at once (SIGKILL after its shutdown timeout)."""
        if not _alive(record):
            raise InputError(f"job {record.job_id} is not running (state {self.state(record)})")
        pid: int = record.pid  # type: ignore[assignment]
        if _cancel_requested(record):
            os.kill(pid, signal.SIGTERM)
            return f"job {record.job_id}: already stopping; sent SIGTERM to torchrun, which ends its ranks now"
        jobs.append_event(record, f"{jobs.CANCEL_REQUESTED} {jobs.now_utc()}")
        _ask_ranks_to_stop(record)
        if not _wait_ended(record, CANCEL_WAIT_S):
            return (
                f"job {record.job_id}: asked to stop; still saving its checkpoint after {CANCEL_WAIT_S:.0f} s"
                f" (`llmctl status {record.job_id}`; `llmctl cancel {record.job_id}` again stops it at once)"
            )
        # The launching llmctl writes the last line once torchrun has exited; if it is gone too, write it here.
        deadline = time.monotonic() + LAUNCHER_LINE_WAIT_S
        while time.monotonic() < deadline:
            last = (jobs.events(record) or [""])[-1]
            if last.startswith((jobs.CANCELLED + " ", "exit ")):
                break
            time.sleep(0.2)
        else:
            last = _cancelled_line(record, {"stop": None, "checkpoint": None, "end": None}, None)
            jobs.append_event(record, last)
        if last.startswith("exit "):
            return f"job {record.job_id} ended before the stop took effect: {self.state(record)}"
        return cancel_message(record, last)

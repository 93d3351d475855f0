"""Local launch: one `torchrun --standalone` on this machine running `python -m llmctl.engine PLAN`, and the
torchrun command line that `llmctl bench-net` uses too (`module_argv`). Torch-free.

A local run streams its output to this terminal as before and its exit code is llmctl's; it also gets a job
folder with a `job.json` record (the torchrun pid) and an `events` line when it ends, so that `llmctl status`,
`logs` (the engine's metrics.jsonl) and `cancel` (SIGTERM to torchrun) work for it like for a SLURM job.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from llmctl.errors import InputError, RuntimeFailure
from llmctl.launch import jobs, shell
from llmctl.launch.backends import Job, LaunchBackend

ENGINE_MODULE = "llmctl.engine"


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


def resolve_nproc(requested: str | None, plan_nproc: int) -> int:
    """--nproc-per-node: None -> the plan's value; 'auto' -> the GPUs present (1 on a CPU-only machine)."""
    if requested is None:
        return plan_nproc
    if requested == "auto":
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

    def __init__(self, code: int) -> None:
        super().__init__(f"the run exited with code {code}")
        self.exit_code = code


def run(
    argv: list[str], env: dict[str, str] | None = None, on_start: Callable[[subprocess.Popen], None] | None = None
) -> int:
    """Run the command with this terminal's stdout/stderr (the engine's progress streams through) and return
    its exit code. Ctrl-C reaches torchrun through the terminal's process group; we only wait for it.
    `env` is added to this process's environment; `on_start` is called with the process once it runs."""
    try:
        proc = subprocess.Popen(argv, env={**os.environ, **env} if env else None)
    except OSError as e:
        raise RuntimeFailure(f"could not start {argv[0]}: {e.strerror}", hint="is torch installed?") from None
    if on_start is not None:
        on_start(proc)
    while True:
        try:
            return _exit_code(proc.wait())
        except KeyboardInterrupt:
            # torchrun got the SIGINT too and is shutting its workers down; give it time, then insist.
            try:
                return _exit_code(proc.wait(timeout=60))
            except (subprocess.TimeoutExpired, KeyboardInterrupt):
                proc.send_signal(signal.SIGKILL)
                return _exit_code(proc.wait())


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
        folder = job.new_folder()
        # The engine reads the world size from the plan too: a resized run uses the folder's copy that says so;
        # otherwise the user's own file (so the command is the one they would type).
        run_plan = folder / "plan.yaml" if job.resized else job.plan_path
        argv = torchrun_argv(run_plan, job.nproc_per_node)
        metrics = job.workdir / job.plan.logging.dir / "metrics.jsonl"
        record = job.record(self.name, "local", folder, [metrics], argv)
        record.host = socket.gethostname()
        print(f"llmctl: {job.env_prefix()}{shell.join(argv)}", file=sys.stderr, flush=True)

        def started(proc: subprocess.Popen) -> None:
            record.job_id, record.pid, record.pid_start = f"local-{proc.pid}", proc.pid, _process_start(proc.pid)
            record.save()
            print(f"llmctl: job {record.job_id}, folder {shell.quote(str(folder))}", file=sys.stderr, flush=True)

        code = run(argv, env=job.env, on_start=started)
        with open(folder / "events", "a") as f:  # the same line the sbatch script appends
            f.write(f"exit {code} {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} restart 0\n")
        if code:
            raise RunFailed(code)
        return record

    def state(self, record: jobs.JobRecord) -> str:
        ended = jobs.folder_state(record)
        if ended != "UNKNOWN":
            return ended
        if _alive(record):
            return "RUNNING"
        if record.host != socket.gethostname():
            return f"UNKNOWN (ran on {record.host})"
        return "UNKNOWN"  # llmctl was killed before it could record the exit code

    def cancel(self, record: jobs.JobRecord) -> None:
        if not _alive(record):
            raise InputError(f"job {record.job_id} is not running (state {self.state(record)})")
        # torchrun shares llmctl's process group (so Ctrl-C reaches it): signal torchrun, which stops its ranks.
        os.kill(record.pid, signal.SIGTERM)  # type: ignore[arg-type]

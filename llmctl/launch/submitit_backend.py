"""SLURM via submitit: the same job as the sbatch template, expressed as a submitit Checkpointable.

One task per rank (tasks_per_node = processes per node); each task exports submitit's torch distributed
environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT) and runs `python -m llmctl.engine PLAN` as a child.
Preemption: submitit asks SLURM for `--signal=USR1@<lead>` (we set SUBMITIT_PREEMPT_SIGNAL=USR1 because USR1 is
what the engine checkpoints on; submitit's default USR2 would kill the engine ranks). SLURM sends it to every
process of the step, so each engine rank sees it directly; task 0's submitit handler calls `checkpoint()`,
which waits for its engine child to finish the checkpoint and exit, then submitit requeues the job.

submitit is imported lazily (it is an optional dependency: `pip install llmctl[slurm]`).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from llmctl.errors import InputError, RuntimeFailure
from llmctl.launch import jobs, sharedfs, shell
from llmctl.launch.backends import Job, SlurmBackend, check_run_folders_free
from llmctl.launch.local import ENGINE_MODULE

PREEMPT_SIGNAL = "USR1"
SUPPORTED_VERSIONS = ">=1.5,<1.6"
"""The submitit versions whose private names we use (pyproject's `slurm` extra says the same; a test checks)."""
_CHECKPOINT_WAIT_S = 3600


class EngineTask:
    """The callable submitit pickles. Holds paths and the non-secret env the user asked for; nothing else."""

    def __init__(self, plan_path: str, workdir: str, env: dict[str, str]) -> None:
        self.plan_path = plan_path
        self.workdir = workdir
        self.env = dict(env)
        self._pid: int | None = None

    def __call__(self) -> int:
        import submitit

        dist = submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
        job_env = submitit.JobEnvironment()
        # submitit takes the first host name as MASTER_ADDR; node names need not resolve, NodeAddr does.
        addr = jobs.node_addr(job_env.hostnames[0])
        env = {**os.environ, **self.env}
        if addr:
            env["MASTER_ADDR"] = addr
        print(
            f"llmctl: task {dist.rank}/{dist.world_size} (restart {os.environ.get('SLURM_RESTART_COUNT', 0)})"
            f" master {env['MASTER_ADDR']}:{dist.master_port}",
            flush=True,
        )
        proc = subprocess.Popen([sys.executable, "-m", ENGINE_MODULE, self.plan_path], cwd=self.workdir, env=env)
        self._pid = proc.pid
        # Poll instead of wait(): submitit's signal handler runs on this thread and reaps the child itself.
        while proc.poll() is None:
            time.sleep(0.5)
        if proc.returncode != 0:
            raise RuntimeError(f"engine exited with code {proc.returncode} on rank {dist.rank}")
        return 0

    def checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        """submitit's Checkpointable hook (task 0 only): let the engine finish its checkpoint, then requeue."""
        import submitit

        pid, deadline = self._pid, time.monotonic() + _CHECKPOINT_WAIT_S
        if pid is not None:
            os.kill(pid, getattr(__import__("signal"), "SIG" + PREEMPT_SIGNAL))
            while time.monotonic() < deadline:
                try:
                    done, _ = os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    break
                if done:
                    break
                time.sleep(0.5)
        print("llmctl: engine checkpointed and exited; requeueing", flush=True)
        return submitit.helpers.DelayedSubmission(EngineTask(self.plan_path, self.workdir, self.env))


def _say_interpreter_note() -> None:
    """Every task runs this Python (submitit's command line names it): a note when the nodes may not have it."""
    fix = "launch from a venv on a shared file system, or use --executor sbatch with --setup or a container"
    note = sharedfs.interpreter_note([sys.executable], fix)
    if note is not None:
        print(f"llmctl: note: {note}", file=sys.stderr, flush=True)


def check_folder(folder: Path) -> None:
    """submitit writes the folder into `#SBATCH --output=...` lines (quoted, but a line break still ends the
    comment and would start a command), and reads `%j` in it as the job id: refuse such paths before anything
    is created."""
    text = str(folder)
    if any(c in text for c in "\n\r\0%") or not text.isprintable():
        raise InputError(
            f"--jobs-dir {text!r}: submitit cannot use a folder path with line breaks, control characters or %",
            hint="pass a plain --jobs-dir, or use --executor sbatch",
        )


def executor_parameters(job: Job) -> dict[str, Any]:
    """submitit.SlurmExecutor parameters for the job: its size and name, the user's SlurmOptions, and the same
    per-node resources, --setup lines and --env names as the sbatch template. One task per rank here, so a node's
    CPUs are split over its ranks. Containers are refused: each task runs this machine's Python (submitit's design)."""
    from llmctl.launch import slurm_resources

    options = job.slurm
    if options.container is not None:
        flag = "--container-image" if options.container == "pyxis" else "--apptainer"
        raise InputError(
            f"{flag}: the submitit executor runs this machine's Python in every task, not a container's",
            hint="use --executor sbatch (the default with --slurm)",
        )
    gpus = job.nproc_per_node if job.plan.hardware.gpu else None
    res = slurm_resources.derive(
        options, nproc_per_node=job.nproc_per_node, gpus_per_node=gpus, gpu=job.plan.hardware.gpu
    )
    params: dict[str, Any] = {
        "job_name": shell.safe_name(job.name),
        "nodes": job.nodes,
        "ntasks_per_node": job.nproc_per_node,
        **options.submitit_parameters(),
    }
    if gpus:
        params["gpus_per_node"] = gpus
    if res.exclusive:
        params["exclusive"] = True
    if res.mem is not None:
        params["mem"] = res.mem
    if res.cpus_per_task is not None:
        per_rank = res.cpus_per_task // job.nproc_per_node
        if per_rank < 1:
            raise InputError(
                f"--cpus-per-task {res.cpus_per_task}: the submitit executor runs one task per rank, and a node has "
                f"{job.nproc_per_node} ranks",
                hint=f"give at least {job.nproc_per_node}, or use --executor sbatch",
            )
        params["cpus_per_task"] = per_rank
    setup = [shell.comment(f"# Per node: {res.why} (llmctl.launch.slurm_resources), over {job.nproc_per_node} task(s)")]
    setup += res.srun_cpus_lines(tasks_per_node=job.nproc_per_node)
    for name in shell.env_names(job.env):  # passed by name: checked in the job, their values never written
        missing = f"llmctl: {name} (--env {name}) is not in the job's environment"
        setup.append(f'if [ -z "${{{name}+set}}" ]; then echo "{missing}" >&2; exit 1; fi')
    # --setup: run in the batch script before srun, which passes the environment they make to the tasks.
    for i, line in enumerate(options.setup, 1):
        setup += [
            line,
            f'llmctl_rc=$?; if [ "$llmctl_rc" != 0 ]; then echo "llmctl: --setup line {i} failed" >&2; exit "$llmctl_rc"; fi',
        ]
    params["setup"] = setup
    return params


def _import_submitit() -> Any:
    os.environ["SUBMITIT_PREEMPT_SIGNAL"] = PREEMPT_SIGNAL  # read by submitit here and, exported, in the job
    try:
        import submitit
    except ImportError:
        raise InputError("--executor submitit needs submitit", hint="pip install 'llmctl[slurm]'") from None
    from submitit.slurm import slurm

    # Two private names (the renderer for --dry-run, the class attribute behind the #SBATCH --signal line):
    # pyproject pins submitit to the minor version tests/launch/test_submitit_pin.py checks them against.
    if not hasattr(slurm, "_make_sbatch_string") or not hasattr(slurm.SlurmJobEnvironment, "USR_SIG"):
        raise RuntimeFailure(
            f"submitit {getattr(submitit, '__version__', '?')} lacks the internals llmctl uses",
            hint=f"pip install 'submitit{SUPPORTED_VERSIONS}'",
        )
    # Read at import: set it on the class too, in case submitit was imported before (the #SBATCH --signal line).
    slurm.SlurmJobEnvironment.USR_SIG = PREEMPT_SIGNAL
    return submitit


def render(folder: Path, params: dict[str, Any]) -> str:
    """The sbatch script submitit would submit (for --dry-run), from submitit's own renderer."""
    _import_submitit()
    from submitit.slurm.slurm import _make_sbatch_string

    submitit_folder = folder / "submitit"
    command = " ".join([shell.quote(sys.executable), "-u -m submitit.core._submit", shell.quote(submitit_folder)])
    return _make_sbatch_string(command=command, folder=submitit_folder, **params)


def submit(folder: Path, params: dict[str, Any], task: EngineTask) -> tuple[str, list[Path]]:
    """Submit through submitit; return the job id and the task-0 log paths."""
    submitit = _import_submitit()
    executor = submitit.SlurmExecutor(folder=folder / "submitit", max_num_timeout=20)
    executor.update_parameters(**params)
    try:
        job = executor.submit(task)
    except Exception as e:  # submitit raises its own types and subprocess errors for a failed sbatch
        raise RuntimeFailure(f"submitit could not submit: {str(e).strip().splitlines()[-1]}") from None
    return str(job.job_id), [Path(job.paths.stdout), Path(job.paths.stderr)]


class SubmititBackend(SlurmBackend):
    name = "submitit"
    help = "SLURM through submitit (one task per rank, Checkpointable requeue)"

    def render(self, job: Job) -> str:
        check_folder(job.jobs_root)
        params = executor_parameters(job)
        job.effective_plan  # noqa: B018 - validates the resized plan, as a real launch would
        _say_interpreter_note()
        return render(job.dry_run_folder(), params)

    def submit(self, job: Job) -> jobs.JobRecord:
        check_folder(job.jobs_root)  # before anything is created
        params = executor_parameters(job)
        job.effective_plan  # noqa: B018
        check_run_folders_free(job)
        folder = job.new_folder()
        task = EngineTask(str(folder / "plan.yaml"), str(job.workdir), job.env)
        job_id, logs = submit(folder, params, task)
        _say_interpreter_note()  # with the submitted job (a failed submission is its one line alone)
        record = job.record(self.name, job_id, folder, logs, ["submitit", "SlurmExecutor"])
        record.save()
        return record

    def logs(self, record: jobs.JobRecord) -> list[Path]:
        """Task 0's stdout and stderr (the console), then every other task's stderr, where a rank that crashed
        alone left its traceback (submitit names them <job>_<task>_log.err)."""
        others = []
        for p in (Path(record.folder) / "submitit").glob(f"{record.job_id}_*_log.err"):
            task = p.name[len(record.job_id) + 1 : -len("_log.err")]
            if task.isdigit() and task != "0":
                others.append((int(task), p))
        return [Path(p) for p in record.logs] + [p for _, p in sorted(others)]

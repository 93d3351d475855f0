"""One launcher interface: a `Job` (what to run, where) and the `LaunchBackend` hooks every executor implements
(render / submit / state / logs / cancel), with a registry that `llmctl launch --executor NAME` picks from and
that `llmctl status`/`logs`/`cancel` ask with the name a job's record carries. Torch-free.

Built-in backends: `local` (torchrun on this machine, llmctl/launch/local.py), `sbatch` (the rendered template,
llmctl/launch/slurm.py) and `submitit` (llmctl/launch/submitit_backend.py). They are imported on first use, so
that `llmctl --help` does not pay for jinja2 or submitit. A new backend is one `register_backend(...)` call.
"""

from __future__ import annotations

import contextlib
import importlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from llmctl.errors import InputError
from llmctl.launch import jobs, shell
from llmctl.launch.preflight.options import PreflightOptions
from llmctl.launch.slurm_options import SlurmOptions

if TYPE_CHECKING:
    from llmctl.spec.planfile import Plan

NEW_FOLDER = "<new job folder>"
"""What --dry-run shows in place of the job folder that a real launch would create."""


@dataclass(frozen=True)
class Job:
    """A plan to run and where: everything a backend needs, validated (except backend-specific limits)."""

    plan_path: Path
    """The user's plan file, as given (never modified)."""
    plan: Plan
    nodes: int
    nproc_per_node: int
    jobs_root: Path
    """Where job folders are created (`jobs.jobs_root`)."""
    workdir: Path
    """Where the engine runs (its current folder). The plan's relative paths resolve against the plan file's folder,
    not this one (llmctl.spec.planpaths: `plan` holds them absolute)."""
    env: dict[str, str] = field(default_factory=dict)
    """Non-secret variables for the job (`shell.check_env` has vetted them)."""
    slurm: SlurmOptions = field(default_factory=SlurmOptions)
    preflight: PreflightOptions = field(default_factory=PreflightOptions)
    """The check before training (backends with `preflight = True` run it; the others refuse its options)."""

    def __post_init__(self) -> None:
        if self.nodes < 1:
            raise InputError(f"--nodes {self.nodes}: must be at least 1")

    @property
    def name(self) -> str:
        return self.plan.name

    @property
    def resized(self) -> bool:
        """Whether the run differs from what the plan file says (then the engine must run a copy that says so)."""
        hw = self.plan.hardware
        return (hw.nodes, hw.nproc_per_node) != (self.nodes, self.nproc_per_node)

    @cached_property
    def effective_plan(self) -> Plan:
        """The plan with the node and process counts that will really run, validated again as a whole (a HYBRID
        shard size must still divide the new world size)."""
        from llmctl.spec.planfile import plan_from_dict

        data = self.plan.model_dump(mode="json")
        data["hardware"].update(nodes=self.nodes, nproc_per_node=self.nproc_per_node)
        return plan_from_dict(data, source=f"the plan with {self.nodes} nodes x {self.nproc_per_node} processes")

    def dry_run_folder(self) -> Path:
        return self.jobs_root / NEW_FOLDER

    def new_folder(self) -> Path:
        """A fresh job folder holding the plan that will run (the effective plan)."""
        from llmctl.spec.planfile import save_plan

        folder = jobs.new_folder(self.jobs_root, self.name)
        save_plan(self.effective_plan, folder / "plan.yaml")
        return folder

    def record(self, backend: str, job_id: str, folder: Path, logs: list[Path], command: list[str]) -> jobs.JobRecord:
        plan = self.effective_plan
        ckpt = plan.checkpoint.dir
        return jobs.JobRecord(
            job_id=job_id,
            backend=backend,
            folder=str(folder),
            plan_name=self.name,
            nodes=self.nodes,
            nproc_per_node=self.nproc_per_node,
            spare_nodes=self.preflight.spare_nodes,
            submitted_at=jobs.now_utc(precise=True),
            logs=[str(p) for p in logs],
            command=command,
            # Absolute already (load_plan resolved them against the plan file's folder): the joins leave them so.
            metrics=str(self.workdir / plan.logging.dir / "metrics.jsonl"),
            checkpoint_dir=str(self.workdir / ckpt) if ckpt else None,
            stall={
                "step_s": plan.predicted.step_time_s,
                "factor": plan.watchdog.stall_factor,
                "floor_s": plan.watchdog.stall_floor_s,
            },
        )

    def run_folders(self) -> list[Path]:
        """The folders the run owns (llmctl.launch.runlock): logging.dir, and checkpoint.dir outside it, as the
        engine resolves them (against the plan file's folder)."""
        from llmctl.launch import runlock

        plan = self.effective_plan
        ckpt = plan.checkpoint.dir
        return runlock.run_folders(self.workdir / plan.logging.dir, self.workdir / ckpt if ckpt else None)

    def env_prefix(self) -> str:
        """`NAME=value ` words for a printed command line (values shell-quoted)."""
        return "".join(f"{k}={shell.quote(v)} " for k, v in sorted(self.env.items()))


class LaunchBackend(ABC):
    """One way to run a Job. `render` must not touch the disk or start anything (it is --dry-run)."""

    name: ClassVar[str]
    help: ClassVar[str] = ""
    slurm: ClassVar[bool] = False
    """Whether this backend takes SlurmOptions (the others refuse them with one line)."""
    foreground: ClassVar[bool] = False
    """Whether `submit` runs the job to its end here (its output streamed, its exit code llmctl's)."""
    preflight: ClassVar[bool] = False
    """Whether the job runs the preflight (llmctl.launch.preflight) before training."""

    @abstractmethod
    def render(self, job: Job) -> str:
        """What would run: the command or script text that --dry-run prints (ends with a newline)."""

    @abstractmethod
    def submit(self, job: Job) -> jobs.JobRecord:
        """Start the job; return its record, saved in its job folder."""

    @abstractmethod
    def state(self, record: jobs.JobRecord) -> str:
        """The job's state, in SLURM's words where they fit (PENDING, RUNNING, COMPLETED, FAILED (exit N), ...)."""

    def logs(self, record: jobs.JobRecord) -> list[Path]:
        """The job's log files (they may not exist yet)."""
        return [Path(p) for p in record.logs]

    @abstractmethod
    def cancel(self, record: jobs.JobRecord) -> str | None:
        """Stop the job (no requeue). Returns the line `llmctl cancel` prints (None: a plain "cancelled job ...")."""


def check_run_folders_free(job: Job) -> None:
    """Before a submission: one line (exit 2) when the run folders are held by a live run (their lock) or belong to
    a job still queued or running that llmctl submitted (its record in the job index), instead of a second job that
    would wait in the queue only to fail, or worse, share the folder with the first."""
    from llmctl.launch import registry, runlock

    folders = job.run_folders()
    runlock.probe(folders)
    for entry in registry.entries():
        try:
            record = jobs.load(Path(entry.folder))
        except (OSError, ValueError, TypeError, InputError):
            continue
        owned = {Path(p) for p in (record.checkpoint_dir, record.metrics and Path(record.metrics).parent) if p}
        shared = [f for f in folders if f in owned]
        if not shared or record.backend == "local":  # a local run holds the lock while it runs: probed above
            continue
        try:
            state = get_backend(record.backend).state(record)
        except InputError:
            continue  # a backend this llmctl does not have: not ours to judge
        if state.split(" ")[0] in jobs.ACTIVE:
            raise runlock.RunFolderBusy(
                f"run folder {shared[0]} belongs to job {record.job_id} ({record.backend}, {state})",
                hint=f"wait for it or `llmctl cancel {record.job_id}`; to run beside it, give this plan another "
                "logging.dir and checkpoint.dir",
            )


class SlurmBackend(LaunchBackend):
    """A backend that submits to SLURM: state from squeue/sacct/scontrol and the job folder's events; scancel."""

    slurm = True

    def state(self, record: jobs.JobRecord) -> str:
        return jobs.slurm_job_state(jobs.slurm_state(record.job_id), jobs.folder_state(record), jobs.requeues(record))

    def cancel(self, record: jobs.JobRecord) -> str | None:
        jobs.scancel(record.job_id)
        # SLURM forgets a finished job without accounting (sacct) after MinJobAge: the folder remembers the cancel.
        with contextlib.suppress(OSError):  # scancel did the work; only that late `status` would lack the word
            jobs.append_event(record, f"{jobs.CANCELLED} {jobs.now_utc()} by llmctl cancel")
        return None


# name -> a backend, or "module:Class" for a built-in not imported yet.
_REGISTRY: dict[str, LaunchBackend | str] = {
    "local": "llmctl.launch.local:LocalBackend",
    "sbatch": "llmctl.launch.slurm:SbatchBackend",
    "submitit": "llmctl.launch.submitit_backend:SubmititBackend",
}


def register_backend(backend: LaunchBackend, *, replace: bool = False) -> None:
    """Make `backend` available as `--executor <backend.name>` and to status/logs/cancel of its jobs."""
    if backend.name in _REGISTRY and not replace:
        raise ValueError(f"a launch backend named {backend.name!r} is already registered")
    _REGISTRY[backend.name] = backend


def unregister_backend(name: str) -> None:
    _REGISTRY.pop(name, None)


def backend_names() -> list[str]:
    return list(_REGISTRY)


def get_backend(name: str, what: str = "--executor") -> LaunchBackend:
    entry = _REGISTRY.get(name)
    if entry is None:
        raise InputError(f"{what} {name!r}: expected one of {', '.join(backend_names())}")
    if isinstance(entry, str):
        module, _, cls = entry.partition(":")
        entry = getattr(importlib.import_module(module), cls)()
        _REGISTRY[name] = entry
    return entry


def backend_for(record: jobs.JobRecord) -> LaunchBackend:
    """The backend that launched a recorded job."""
    return get_backend(record.backend, what=f"job {record.job_id}: executor")


def resolve_executor(executor: str | None, slurm: bool) -> str:
    """`--executor` if given, else `sbatch` with `--slurm`, else `local`."""
    if executor is None:
        return "sbatch" if slurm else "local"
    if slurm and not get_backend(executor).slurm:
        raise InputError(f"--slurm with --executor {executor}: that executor does not submit to SLURM")
    return executor

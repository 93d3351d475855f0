"""`llmctl status`, `llmctl logs`, `llmctl cancel`: the jobs `llmctl launch` started, each asked through the backend
named in its record (llmctl.launch.backends)."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Annotated

import typer

from llmctl.cli.options import JobsDirOpt
from llmctl.errors import InputError
from llmctl.launch import jobs

JobArg = Annotated[str, typer.Argument(help="Job id, job folder name or path.", show_default=False)]


def status(
    job: Annotated[str | None, typer.Argument(help="Job id or folder (default: all jobs).")] = None,
    jobs_dir: JobsDirOpt = None,
) -> None:
    """State of jobs launched from here, from each job's own executor (SLURM, or a local run's pid; else its folder)."""
    from rich.console import Console
    from rich.table import Table

    from llmctl.launch import jobs

    root = jobs.jobs_root(jobs_dir)
    records = [jobs.find(job, root)] if job else jobs.all_records(root)
    if not records:
        typer.echo(f"no jobs launched from {root}")
        return
    table = Table(box=None)
    notes = [jobs.preflight_note(r) for r in records]
    columns = ("job", "backend", "plan", "nodes", "state", "submitted", "folder")
    for col in columns + (("preflight",) if any(notes) else ()):
        table.add_column(col, overflow="fold")
    for r, note in zip(records, notes):
        table.add_row(
            r.job_id,
            r.backend,
            r.plan_name,
            f"{r.nodes}x{r.nproc_per_node}" + (f" +{r.spare_nodes} spare" if r.spare_nodes else ""),
            _state(r),
            r.submitted_at,
            Path(r.folder).name,
            *((note,) if any(notes) else ()),
        )
    Console(width=200).print(table)


def logs(
    job: JobArg,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing until the job ends.")] = False,
    jobs_dir: JobsDirOpt = None,
) -> None:
    """Print a job's log (task 0's for submitit); --follow streams it until the job ends."""
    from llmctl.launch import backends, jobs

    record = jobs.find(job, jobs.jobs_root(jobs_dir))
    backend = backends.backend_for(record)
    paths = backend.logs(record)
    offsets = dict.fromkeys(paths, 0)

    def drain() -> None:
        for p in paths:
            if not p.is_file():
                continue
            with p.open("rb") as f:
                f.seek(offsets[p])
                data = f.read()
            offsets[p] += len(data)
            if data:
                sys.stdout.write(data.decode(errors="replace"))
                sys.stdout.flush()

    drain()
    if not follow:
        if not any(p.is_file() for p in paths):
            typer.echo(f"no log yet for job {record.job_id} (state {backend.state(record)})", err=True)
        return
    while True:
        active = backend.state(record).split()[0] in jobs.ACTIVE
        drain()
        if not active:
            return
        time.sleep(1.0)


def _state(record: jobs.JobRecord) -> str:
    """The job's state from its own backend; a record naming a backend that is not registered here says so."""
    from llmctl.launch import backends

    try:
        return backends.backend_for(record).state(record)
    except InputError:
        return f"UNKNOWN (executor {record.backend!r} not registered)"


def cancel(
    job: JobArg,
    jobs_dir: JobsDirOpt = None,
) -> None:
    """Stop a job (no requeue): scancel for SLURM jobs, SIGTERM to torchrun for a local run."""
    from llmctl.launch import backends, jobs

    record = jobs.find(job, jobs.jobs_root(jobs_dir))
    backends.backend_for(record).cancel(record)
    typer.echo(f"cancelled job {record.job_id} ({record.backend})")


def register(app: typer.Typer) -> None:
    app.command("status")(status)
    app.command("logs")(logs)
    app.command("cancel")(cancel)

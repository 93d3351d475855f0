"""`llmctl status`, `llmctl logs`, `llmctl cancel`: the jobs `llmctl launch` started, found through the per-user job
index (llmctl.launch.registry) from any folder, or under --jobs-dir, and each asked through the backend named in its
record (llmctl.launch.backends)."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Annotated

import typer

from llmctl.cli.options import JobsDirOpt
from llmctl.errors import InputError, one_line
from llmctl.launch import jobs

JobArg = Annotated[str, typer.Argument(help="Job id, job folder name or path.", show_default=False)]
LatestJobArg = Annotated[
    str | None,
    typer.Argument(help="Job id, job folder name or path (default: the latest launched).", show_default=False),
]
SHOWN = 20
"""`status` without a job lists the latest SHOWN jobs (--all: every one the index holds)."""


def _root(jobs_dir: str | None) -> Path | None:
    """--jobs-dir restricts to the jobs under it; without it, the per-user index (and ./llmctl-jobs)."""
    return jobs.jobs_root(jobs_dir) if jobs_dir else None


def status(
    job: Annotated[str | None, typer.Argument(help="Job id or folder (default: the latest jobs).")] = None,
    jobs_dir: JobsDirOpt = None,
    every: Annotated[bool, typer.Option("--all", help=f"Every job, not only the latest {SHOWN}.")] = False,
    stacks: Annotated[
        bool,
        typer.Option(
            "--stacks",
            help="Every rank's Python stack now (ranks on this host; those with the same stack listed once): what a "
            "STALLED run's ranks are doing.",
        ),
    ] = False,
) -> None:
    """State of the jobs llmctl launched (from any folder), from each job's own executor (SLURM, or a local run's pid)
    and its folder's events: RUNNING, COMPLETED, FAILED (exit N), CANCELLED, REQUEUED, ...; and the last checkpoint."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    if stacks:
        _print_stacks(jobs.find(job, _root(jobs_dir)))
        return
    if job:
        records, found = [jobs.find(job, _root(jobs_dir))], None
    else:
        found = jobs.listing(_root(jobs_dir))
        records = found.records if every else found.records[-SHOWN:]
        if found.note():
            typer.echo(found.note(), err=True)
    if not records:
        typer.echo(f"no jobs in {found.where if found else jobs_dir}")
        return
    table = Table(box=None)
    notes = [jobs.preflight_note(r) for r in records]
    stalls: list[str] = []
    columns = ("job", "backend", "plan", "nodes", "state", "checkpoint", "submitted", "folder")
    for col in columns + (("preflight",) if any(notes) else ()):
        table.add_column(col, overflow="fold")
    for r, note in zip(records, notes):
        step = jobs.last_checkpoint_step(r)
        cells = [
            r.job_id,
            r.backend,
            r.plan_name,
            f"{r.nodes}x{r.nproc_per_node}" + (f" +{r.spare_nodes} spare" if r.spare_nodes else ""),
            _state(r, stalls),
            "" if step is None else f"step {step}",
            r.submitted_at.split(".")[0].rstrip("Z") + "Z",  # to the second (the record keeps milliseconds)
            r.folder,
            *((note,) if any(notes) else ()),
        ]
        # A record is a file anyone may have written (or an older llmctl, before plan names were checked): its text
        # reaches the terminal with control characters escaped, and as plain text (no rich markup).
        table.add_row(*(Text(one_line(str(c))) for c in cells))
    Console(width=240).print(table)
    for line in stalls:
        typer.echo(one_line(line))
    if found is not None and len(records) < len(found.records):
        typer.echo(f"(the latest {len(records)} of {len(found.records)} jobs; --all lists every one)")


def logs(
    job: LatestJobArg = None,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing until the job ends.")] = False,
    jobs_dir: JobsDirOpt = None,
) -> None:
    """Print what a job's console showed (a local run's console.log, SLURM's slurm-<id>.out, submitit's task logs),
    tracebacks included; --follow streams it until the job ends. The engine's metrics stay in metrics.jsonl."""
    from llmctl.launch import backends

    record = jobs.find(job, _root(jobs_dir))
    if job is None:
        typer.echo(one_line(f"llmctl: job {record.job_id} (the latest launched), folder {record.folder}"), err=True)
    backend = backends.backend_for(record)
    offsets: dict[Path, int] = {}
    last: list[Path] = []

    def drain() -> None:
        for p in backend.logs(record):  # asked again each time: SLURM task logs appear as tasks start
            if not p.is_file():
                continue
            with p.open("rb") as f:
                f.seek(offsets.get(p, 0))
                data = f.read()
            offsets[p] = offsets.get(p, 0) + len(data)
            if not data:
                continue
            if last and last[0] != p:  # like tail: a header when the output switches to another file
                sys.stdout.write(f"\n==> {one_line(str(p))} <==\n")
            last[:] = [p]
            sys.stdout.write(data.decode(errors="replace"))
            sys.stdout.flush()

    drain()
    if not follow:
        if not offsets:
            typer.echo(one_line(f"no log yet for job {record.job_id} (state {backend.state(record)})"), err=True)
        return
    while True:
        active = backend.state(record).split()[0] in jobs.ACTIVE
        drain()
        if not active:
            return
        time.sleep(1.0)


def _state(record: jobs.JobRecord, stalls: list[str] | None = None) -> str:
    """The job's state from its own backend; a record naming a backend that is not registered here says so. A
    RUNNING job whose ranks stopped moving (their heartbeats) is STALLED, its diagnosis added to `stalls`."""
    from llmctl.launch import backends

    try:
        state = backends.backend_for(record).state(record)
    except InputError:
        return f"UNKNOWN (executor {record.backend!r} not registered)"
    if state.startswith("RUNNING"):
        found = record.diagnosis()
        if found is not None and found.stalled:
            if stalls is not None:
                stalls.append(f"job {record.job_id}: {found.line()}")
            return "STALLED"
    return state


def _print_stacks(record: jobs.JobRecord) -> None:
    """`status --stacks JOB`: each group of ranks with the same stack once, the smallest group first."""
    from llmctl.launch import heartbeat

    if not record.metrics:
        raise InputError(f"job {record.job_id} has no run folder recorded (an older llmctl launched it)")
    run_dir = Path(record.metrics).parent
    found = record.diagnosis()
    if found is None:
        raise InputError(f"job {record.job_id}: no heartbeats in {run_dir} (the engine has not started yet)")
    typer.echo(one_line(f"job {record.job_id}: {found.line()}"))
    asked = time.time()
    texts, missing = heartbeat.request_stacks(run_dir)
    groups = heartbeat.group_stacks(texts)
    if why := heartbeat.mismatch(groups):
        typer.echo(one_line(why))
    for line in heartbeat.flight_lines(run_dir, asked):
        typer.echo(one_line(f"flight recorder: {line}"))
    for ranks, text in groups:
        label = ", ".join(map(str, ranks))
        typer.echo(f"\n== rank{'s' if len(ranks) > 1 else ''} {label} ==")
        typer.echo(text)
    for why in missing:
        typer.echo(one_line(f"no stack: {why}"), err=True)


def cancel(
    job: JobArg,
    jobs_dir: JobsDirOpt = None,
) -> None:
    """Stop a job (no requeue), letting it save a checkpoint: scancel for SLURM jobs; for a local run, SIGTERM to its
    ranks, which checkpoint at the next step boundary, then it waits for the run to end (the launching llmctl exits
    with code 143)."""
    from llmctl.launch import backends

    record = jobs.find(job, _root(jobs_dir))
    message = backends.backend_for(record).cancel(record)
    typer.echo(one_line(message or f"cancelled job {record.job_id} ({record.backend})"))


def register(app: typer.Typer) -> None:
    app.command("status")(status)
    app.command("logs")(logs)
    app.command("cancel")(cancel)

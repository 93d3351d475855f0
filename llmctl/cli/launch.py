"""`llmctl launch` (local torchrun, or SLURM through an sbatch template or submitit), `llmctl status`, `llmctl logs`.

Only registers commands; the work is in llmctl.launch. Torch-free at import time (and at run time: torch runs
only inside the launched ranks).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Annotated

import typer

from llmctl.errors import InputError, RuntimeFailure


class RunFailed(RuntimeFailure):
    """The launched run failed: its exit code becomes llmctl's."""

    def __init__(self, code: int) -> None:
        super().__init__(f"the run exited with code {code}")
        self.exit_code = code


PlanArg = Annotated[Path, typer.Argument(help="Plan file (YAML), as written by `llmctl plan`.", show_default=False)]
SlurmOpt = Annotated[bool, typer.Option("--slurm", help="Submit to SLURM instead of running here.")]
ExecutorOpt = Annotated[
    str, typer.Option("--executor", help="SLURM submission: 'sbatch' (rendered template) or 'submitit'.")
]
PartitionOpt = Annotated[str | None, typer.Option("--partition", "-p", help="SLURM partition.")]
AccountOpt = Annotated[str | None, typer.Option("--account", "-A", help="SLURM account.")]
TimeOpt = Annotated[str | None, typer.Option("--time", "-t", help="Time limit, e.g. 4:00:00 or 2-00:00:00.")]
NodesOpt = Annotated[int | None, typer.Option("--nodes", "-N", help="Nodes (default: the plan's hardware.nodes).")]
QosOpt = Annotated[str | None, typer.Option("--qos", help="SLURM QOS.")]
ConstraintOpt = Annotated[str | None, typer.Option("--constraint", "-C", help="SLURM node features, e.g. a100.")]
ExcludeOpt = Annotated[str | None, typer.Option("--exclude", "-x", help="Nodes to avoid, e.g. gpu[03,07].")]
SbatchArgOpt = Annotated[
    list[str] | None, typer.Option("--sbatch-arg", help="Extra sbatch option, repeatable: --sbatch-arg=--mem=0")
]
SignalLeadOpt = Annotated[
    int, typer.Option("--signal-lead", help="Seconds before the time limit to signal a checkpoint (SIGUSR1).")
]
NprocOpt = Annotated[
    str | None,
    typer.Option(
        "--nproc-per-node",
        help="Processes per node: a number, or 'auto' (the GPUs present). Default: the plan's hardware.nproc_per_node.",
    ),
]
EnvOpt = Annotated[
    list[str] | None, typer.Option("--env", help="NAME=VALUE for the job (repeatable; secrets are refused).")
]
IfnameOpt = Annotated[
    str | None, typer.Option("--socket-ifname", help="Sets NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME.")
]
NcclDebugOpt = Annotated[str | None, typer.Option("--nccl-debug", help="Sets NCCL_DEBUG (e.g. INFO, WARN).")]
JobsDirOpt = Annotated[
    str | None, typer.Option("--jobs-dir", help="Where job folders go (default $LLMCTL_JOBS_DIR or ./llmctl-jobs).")
]
DryRunOpt = Annotated[bool, typer.Option("--dry-run", help="Print the command or script; run nothing.")]


def _job_env(env: list[str] | None, socket_ifname: str | None, nccl_debug: str | None) -> dict[str, str]:
    from llmctl.launch import shell

    out = shell.check_env(env or [])
    if socket_ifname:
        out["NCCL_SOCKET_IFNAME"] = socket_ifname
        out["GLOO_SOCKET_IFNAME"] = socket_ifname
    if nccl_debug:
        out["NCCL_DEBUG"] = nccl_debug
    return out


def launch(
    plan: PlanArg,
    slurm: SlurmOpt = False,
    executor: ExecutorOpt = "sbatch",
    partition: PartitionOpt = None,
    account: AccountOpt = None,
    time_limit: TimeOpt = None,
    nodes: NodesOpt = None,
    qos: QosOpt = None,
    constraint: ConstraintOpt = None,
    exclude: ExcludeOpt = None,
    sbatch_arg: SbatchArgOpt = None,
    signal_lead: SignalLeadOpt = 300,
    nproc_per_node: NprocOpt = None,
    env: EnvOpt = None,
    socket_ifname: IfnameOpt = None,
    nccl_debug: NcclDebugOpt = None,
    jobs_dir: JobsDirOpt = None,
    dry_run: DryRunOpt = False,
) -> None:
    """Run a plan: torchrun on this machine, or a SLURM job (sbatch template or submitit) that survives
    preemption (checkpoint on SIGUSR1, requeue, resume)."""
    from llmctl.launch import local
    from llmctl.spec.planfile import load_plan

    if executor not in ("sbatch", "submitit"):
        raise InputError(f"--executor {executor!r}: expected 'sbatch' or 'submitit'")
    slurm = slurm or executor == "submitit"
    loaded = load_plan(plan)
    nproc = local.resolve_nproc(nproc_per_node, loaded.hardware.nproc_per_node)
    job_env = _job_env(env, socket_ifname, nccl_debug)
    if not slurm:
        slurm_only = {
            "--partition": partition,
            "--account": account,
            "--time": time_limit,
            "--qos": qos,
            "--constraint": constraint,
            "--exclude": exclude,
            "--sbatch-arg": sbatch_arg,
        }
        given = [k for k, v in slurm_only.items() if v]
        if given:
            raise InputError(f"{', '.join(given)} only apply with --slurm")
        _launch_local(plan, loaded, nproc, nodes, job_env, jobs_dir, dry_run)
        return
    _launch_slurm(
        plan,
        loaded,
        nproc,
        nodes,
        job_env,
        jobs_dir,
        dry_run,
        executor=executor,
        partition=partition,
        account=account,
        time_limit=time_limit,
        qos=qos,
        constraint=constraint,
        exclude=exclude,
        sbatch_arg=sbatch_arg or [],
        signal_lead=signal_lead,
    )


def _resized(plan, nodes: int, nproc: int):  # noqa: ANN001, ANN202
    """The plan with the node and process counts that will really run, validated again as a whole (a HYBRID
    shard size must still divide the new world size)."""
    from llmctl.spec.planfile import plan_from_dict

    data = plan.model_dump(mode="json")
    data["hardware"].update(nodes=nodes, nproc_per_node=nproc)
    return plan_from_dict(data, source=f"the plan with {nodes} nodes x {nproc} processes")


def _launch_local(plan_path, plan, nproc, nodes, job_env, jobs_dir, dry_run) -> None:  # noqa: ANN001
    from llmctl.launch import jobs, local, shell
    from llmctl.spec.planfile import save_plan

    want_nodes = nodes if nodes is not None else plan.hardware.nodes
    if want_nodes != 1:
        raise InputError(
            f"the plan is for {want_nodes} nodes; a local launch runs on this one machine",
            hint="add --slurm, or pass --nodes 1",
        )
    run_plan = Path(plan_path)
    if nproc != plan.hardware.nproc_per_node or plan.hardware.nodes != 1:
        # The engine reads the world size from the plan too: run a copy that says what will really run.
        effective = _resized(plan, 1, nproc)
        if dry_run:
            run_plan = jobs.jobs_root(jobs_dir) / "<new job folder>" / "plan.yaml"
        else:
            run_plan = jobs.new_folder(jobs.jobs_root(jobs_dir), plan.name) / "plan.yaml"
            save_plan(effective, run_plan)
    argv = local.torchrun_argv(run_plan, nproc)
    prefix = "".join(f"{k}={shell.quote(v)} " for k, v in sorted(job_env.items()))
    if dry_run:
        typer.echo(prefix + shell.join(argv))
        return
    typer.echo(f"llmctl: {prefix}{shell.join(argv)}", err=True)
    os.environ.update(job_env)
    code = local.run(argv)
    if code:
        raise RunFailed(code)


def _launch_slurm(
    plan_path,
    plan,
    nproc,
    nodes,
    job_env,
    jobs_dir,
    dry_run,
    *,
    executor,
    partition,  # noqa: ANN001
    account,
    time_limit,
    qos,
    constraint,
    exclude,
    sbatch_arg,
    signal_lead,
) -> None:
    from llmctl.launch import jobs, local, shell, slurm
    from llmctl.spec.planfile import save_plan

    n_nodes = nodes if nodes is not None else plan.hardware.nodes
    gpus = nproc if plan.hardware.gpu else None
    root = jobs.jobs_root(jobs_dir)
    folder = root / "<new job folder>" if dry_run else None
    # Validate everything before creating anything on disk.
    params = slurm.make_params(
        job_name=plan.name,
        nodes=n_nodes,
        nproc_per_node=nproc,
        workdir=str(Path.cwd()),
        job_dir=str(folder or root / "_"),
        plan_path=str((folder or root / "_") / "plan.yaml"),
        torchrun=local.torchrun_command()[0] if len(local.torchrun_command()) == 1 else "torchrun",
        gpus_per_node=gpus,
        time=time_limit,
        partition=partition,
        account=account,
        qos=qos,
        constraint=constraint,
        exclude=exclude,
        extra_sbatch_args=sbatch_arg,
        env=job_env,
        signal_lead_s=signal_lead,
    )
    effective = _resized(plan, n_nodes, nproc)
    if executor == "submitit":
        from llmctl.launch import submitit_backend

        submitit_backend.check_folder(root)
        sparams = submitit_backend.executor_parameters(
            job_name=params.job_name,
            nodes=n_nodes,
            nproc_per_node=nproc,
            gpus_per_node=gpus,
            time_s=slurm.parse_time_s(time_limit) if time_limit else None,
            partition=partition,
            account=account,
            qos=qos,
            constraint=constraint,
            exclude=exclude,
            extra_sbatch_args=params.extra_sbatch_args,
            signal_lead_s=signal_lead,
        )
        if dry_run:
            typer.echo(submitit_backend.render(root / "<new job folder>", sparams), nl=False)
            return
        folder = jobs.new_folder(root, plan.name)
        save_plan(effective, folder / "plan.yaml")
        task = submitit_backend.EngineTask(str(folder / "plan.yaml"), str(Path.cwd()), job_env)
        job_id, logs = submitit_backend.submit(folder, sparams, task)
        command = ["submitit", "SlurmExecutor"]
    else:
        if dry_run:
            typer.echo(slurm.render(params), nl=False)
            return
        folder = jobs.new_folder(root, plan.name)
        save_plan(effective, folder / "plan.yaml")
        from dataclasses import replace

        params = replace(params, job_dir=str(folder), plan_path=str(folder / "plan.yaml"))
        script = folder / "job.sbatch"
        script.write_text(slurm.render(params))
        script.chmod(0o755)
        job_id = slurm.submit(script, folder)
        logs = [folder / f"slurm-{job_id}.out"]
        command = ["sbatch", "--parsable", script.name]
    record = jobs.JobRecord(
        job_id=job_id,
        backend=executor,
        folder=str(folder),
        plan_name=plan.name,
        nodes=n_nodes,
        nproc_per_node=nproc,
        submitted_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        logs=[str(p) for p in logs],
        command=command,
    )
    record.save()
    typer.echo(f"submitted job {job_id} ({executor}, {n_nodes} nodes x {nproc} processes)")
    typer.echo(f"job folder: {shell.quote(str(folder))}")
    for p in logs:
        typer.echo(f"log: {shell.quote(str(p))}")
    typer.echo(f"follow it: llmctl logs {job_id} --follow")


JobArg = Annotated[str, typer.Argument(help="Job id, job folder name or path.", show_default=False)]


def status(
    job: Annotated[str | None, typer.Argument(help="Job id or folder (default: all jobs).")] = None,
    jobs_dir: JobsDirOpt = None,
) -> None:
    """State of jobs launched from here (squeue/sacct/scontrol, else the job folder)."""
    from rich.console import Console
    from rich.table import Table

    from llmctl.launch import jobs

    root = jobs.jobs_root(jobs_dir)
    records = [jobs.find(job, root)] if job else jobs.all_records(root)
    if not records:
        typer.echo(f"no jobs launched from {root}")
        return
    table = Table(box=None)
    for col in ("job", "backend", "plan", "nodes", "state", "submitted", "folder"):
        table.add_column(col)
    for r in records:
        table.add_row(
            r.job_id,
            r.backend,
            r.plan_name,
            f"{r.nodes}x{r.nproc_per_node}",
            jobs.state(r),
            r.submitted_at,
            Path(r.folder).name,
        )
    Console(width=200).print(table)


def logs(
    job: JobArg,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing until the job ends.")] = False,
    jobs_dir: JobsDirOpt = None,
) -> None:
    """Print a job's log (task 0's for submitit); --follow streams it until the job ends."""
    from llmctl.launch import jobs

    record = jobs.find(job, jobs.jobs_root(jobs_dir))
    paths = [Path(p) for p in record.logs]
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
            typer.echo(f"no log yet for job {record.job_id} (state {jobs.state(record)})", err=True)
        return
    while True:
        active = jobs.state(record).split()[0] in jobs.ACTIVE
        drain()
        if not active:
            return
        time.sleep(1.0)


def register(app: typer.Typer) -> None:
    app.command("launch")(launch)
    app.command("status")(status)
    app.command("logs")(logs)

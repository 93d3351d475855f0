"""`llmctl launch`: local torchrun, or SLURM through an sbatch template or submitit (status, logs and cancel of the
jobs it starts: llmctl.cli.jobs).

Only registers the command; the work is in llmctl.launch: the backend registry (llmctl.launch.backends) picks what
`--executor` names. Torch-free at import time (and at run time: torch runs
only inside the launched ranks).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from llmctl.cli.decision_options import with_decisions
from llmctl.cli.launch_show import AllocateAllOpt, run_dry_start
from llmctl.cli.options import JobsDirOpt
from llmctl.errors import InputError, one_line
from llmctl.launch import jobs

PlanArg = Annotated[Path, typer.Argument(help="Plan file (YAML), as written by `llmctl plan`.", show_default=False)]
SlurmOpt = Annotated[
    bool, typer.Option("--slurm", help="Submit to SLURM instead of running here (--executor sbatch unless given).")
]
ExecutorOpt = Annotated[
    str | None,
    typer.Option(
        "--executor",
        help="Where the job runs: a registered launch backend (built in: local = torchrun here, sbatch = the "
        "rendered template, submitit). Default: local, or sbatch with --slurm.",
        show_default=False,
    ),
]
NodesOpt = Annotated[int | None, typer.Option("--nodes", "-N", help="Nodes (default: the plan's hardware.nodes).")]
NprocOpt = Annotated[
    str | None,
    typer.Option(
        "--nproc-per-node",
        "--gpus-per-node",
        help="Processes (GPUs) per node: a number, or 'auto' (the GPUs present). Default: the plan's "
        "hardware.nproc_per_node.",
    ),
]
GpusOpt = Annotated[
    int | None,
    typer.Option(
        "--gpus",
        help="Total processes (GPUs): one node up to the plan's GPUs per node, else whole nodes of them.",
        metavar="N",
    ),
]
EnvOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--env",
        help="NAME=VALUE for the job, or NAME alone to pass it from this environment by name (repeatable). Secrets, "
        "and values that hold one (a token, a URL's password), go by name only (--env HF_TOKEN): their values are "
        "never written into the job.",
    ),
]
IfnameOpt = Annotated[
    str | None, typer.Option("--socket-ifname", help="Sets NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME.")
]
NcclDebugOpt = Annotated[str | None, typer.Option("--nccl-debug", help="Sets NCCL_DEBUG (e.g. INFO, WARN).")]

DryRunOpt = Annotated[bool, typer.Option("--dry-run", help="Print the command or script; run nothing.")]
DryStartOpt = Annotated[
    bool,
    typer.Option(
        "--dry-start",
        help="Will this plan start? Run the engine's setup for rank 0 of the plan's world here, in one process "
        "(a fake process group of the plan's size): data, mesh, model on meta, sharding, rank 0's shard "
        "materialized and initialized or loaded, optimizer; print per-rank bytes next to estimate-memory's, and "
        "the peak resident memory. No training.",
    ),
]
NoPreflightOpt = Annotated[
    bool,
    typer.Option(
        "--no-preflight",
        help="With --slurm: skip the check that runs first in the job (each node's devices and ranks, all-reduce on "
        "each node, across nodes and in pairs, compared with the plan).",
    ),
]
PreflightStrictOpt = Annotated[
    bool,
    typer.Option(
        "--preflight-strict",
        help="With --slurm: stop the job when the preflight measures bandwidth well below the plan's assumption "
        "(default: a warning with the figure).",
    ),
]
SpareNodesOpt = Annotated[
    int,
    typer.Option(
        "--spare-nodes",
        help="With --slurm: ask SLURM for N more nodes than the plan needs; the preflight leaves out failed and "
        "slow nodes, then the worst of the rest, and training runs on the plan's number of nodes.",
    ),
]
AllowSyntheticOpt = Annotated[
    bool,
    typer.Option(
        "--allow-synthetic", help="Run a plan that trains on random tokens (data.kind synthetic): a benchmark."
    ),
]
AllowNoCheckpointOpt = Annotated[
    bool,
    typer.Option(
        "--allow-no-checkpoint",
        help="Run a plan that saves no checkpoint (checkpoint.dir null): nothing survives a preemption or the end.",
    ),
]

ResumeAnywayOpt = Annotated[
    bool,
    typer.Option(
        "--resume-anyway",
        help="Resume the checkpoint in checkpoint.dir even though the plan changed what it trains (model, data, "
        "optimizer, schedule, batch): the new plan's values apply from there, and a `resume` event in "
        "metrics.jsonl records the change. Without it such a resume is refused.",
    ),
]


@with_decisions("dry-start", "override", after="allocate_all")
def launch(
    plan: PlanArg,
    slurm: SlurmOpt = False,
    executor: ExecutorOpt = None,
    nodes: NodesOpt = None,
    gpus: GpusOpt = None,
    nproc_per_node: NprocOpt = None,
    env: EnvOpt = None,
    socket_ifname: IfnameOpt = None,
    nccl_debug: NcclDebugOpt = None,
    jobs_dir: JobsDirOpt = None,
    dry_run: DryRunOpt = False,
    dry_start: DryStartOpt = False,
    allocate_all: AllocateAllOpt = False,
    no_preflight: NoPreflightOpt = False,
    preflight_strict: PreflightStrictOpt = False,
    spare_nodes: SpareNodesOpt = 0,
    allow_synthetic: AllowSyntheticOpt = False,
    allow_no_checkpoint: AllowNoCheckpointOpt = False,
    resume_anyway: ResumeAnywayOpt = False,
    decisions: dict[str, Any] | None = None,
    **slurm_options: Any,
) -> None:
    """Run a plan: torchrun on this machine, or a SLURM job (sbatch template or submitit) that survives
    preemption (checkpoint on SIGUSR1, requeue, resume). --dry-start checks that it will start, in seconds."""
    from llmctl.launch import backends, local, shell
    from llmctl.launch.preflight.options import PreflightOptions
    from llmctl.launch.slurm_options import SlurmOptions
    from llmctl.spec.planfile import load_plan

    overrides = {k: v for k, v in (decisions or {}).items() if v is not None}
    if dry_start or allocate_all or overrides:
        run_dry_start(plan, dry_start, dry_run, allocate_all, overrides)
        return
    backend = backends.get_backend(backends.resolve_executor(executor, slurm))
    preflight = PreflightOptions(enabled=not no_preflight, strict=preflight_strict, spare_nodes=spare_nodes)
    if not backend.slurm and preflight.given:
        raise InputError(f"{', '.join(preflight.given)} only apply with --slurm")
    if not backend.preflight and [f for f in preflight.given if f != "--no-preflight"]:
        raise InputError(
            f"{', '.join(f for f in preflight.given if f != '--no-preflight')}: the {backend.name} executor runs "
            "no preflight",
            hint="use --executor sbatch, the default with --slurm",
        )
    loaded = load_plan(plan)
    refuse_plan_only(loaded.hardware.gpu, plan)
    from llmctl.launch.runnable import check

    for warning in check(loaded, str(plan), dry_run, allow_synthetic, allow_no_checkpoint):
        typer.echo(f"warning: {warning}", err=True)
    if dry_run and loaded.data.kind == "tokens":  # what `plan` said when it wrote it, for a plan edited since
        from llmctl.data.epochs import many_passes_warning

        if (passes := many_passes_warning(loaded)) is not None:
            typer.echo(f"warning: {plan}: {passes}", err=True)
    nproc = local.resolve_nproc(nproc_per_node, loaded.hardware.nproc_per_node)
    if gpus is not None:  # the one reading of --gpus (estimate, plan, tune): nodes of the per-node count
        from llmctl.spec.hardware import cluster_shape

        nodes, nproc = cluster_shape(gpus, nodes, nproc if nproc_per_node is not None else None, nproc)
    job_env = shell.job_env(env or [], socket_ifname, nccl_debug)
    if resume_anyway:  # read by the engine on every rank
        from llmctl.engine.resume import RESUME_ANYWAY_ENV

        job_env[RESUME_ANYWAY_ENV] = "1"
    if not backend.slurm:
        given = SlurmOptions.given_flags(slurm_options)
        if given:
            raise InputError(f"{', '.join(given)} only apply with --slurm")
    job = backends.Job(
        plan_path=plan,
        plan=loaded,
        nodes=nodes if nodes is not None else loaded.hardware.nodes,
        nproc_per_node=nproc,
        jobs_root=jobs.jobs_root(jobs_dir),
        workdir=Path.cwd(),
        env=job_env,
        slurm=SlurmOptions.from_kwargs(**slurm_options) if backend.slurm else SlurmOptions(),
        preflight=preflight if backend.preflight else PreflightOptions(enabled=False),
    )
    if dry_run:
        typer.echo(backend.render(job), nl=False)
        return
    try:
        record = backend.submit(job)
    except local.RunCancelled as e:  # `llmctl cancel` or a signal: what was asked, not an error; 128 + the signal
        with contextlib.suppress(OSError):  # a SIGHUP's terminal may be gone: the job's events hold the line
            typer.echo(f"llmctl: {e}", err=True)
        raise typer.Exit(e.exit_code) from None
    if backend.foreground:
        return  # it ran here, its output streamed through
    typer.echo(f"submitted job {record.job_id} ({backend.name}, {job.nodes} nodes x {job.nproc_per_node} processes)")
    if job.preflight.enabled:
        spares = f"; {job.preflight.spare_nodes} spare node(s) allocated" if job.preflight.spare_nodes else ""
        typer.echo(f"preflight: first in the job, before training{spares}")
    elif backend.slurm and not no_preflight:
        typer.echo(f"preflight: not run by the {backend.name} executor (--executor sbatch runs it)")
    typer.echo(one_line(f"job folder: {shell.quote(record.folder)}"))  # paths are the user's: escapes escaped
    for p in record.logs:
        typer.echo(one_line(f"log: {shell.quote(p)}"))
    typer.echo(f"follow it: llmctl logs {record.job_id} --follow")


def refuse_plan_only(gpu: str | None, plan: Path) -> None:
    """A plan for a GPU kind the engine cannot run (the catalog's plan_only: Intel Gaudi) is refused in one line. A
    kind this machine's catalog does not know is left to the job (the catalog can grow on the cluster)."""
    from llmctl.errors import UnknownNameError
    from llmctl.spec.hardware import resolve_gpu

    if not gpu:
        return
    try:
        spec = resolve_gpu(gpu)
    except UnknownNameError:
        return
    if spec.plan_only:
        raise InputError(
            f"{plan} is a plan for {spec.name}, which llmctl's engine cannot run: {spec.plan_only}",
            hint="plan it for a CUDA or ROCm GPU kind (llmctl plan ... --gpu KIND) to launch it",
        )


def _with_slurm_options(command: Callable[..., None]) -> Callable[..., None]:
    """Give the command one option per SlurmOptions field, declared there (its **kwargs receive them)."""
    from llmctl.launch.slurm_options import cli_parameters

    sig = inspect.signature(command, eval_str=True)
    params = [p for p in sig.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    command.__signature__ = sig.replace(parameters=[*params, *cli_parameters()])  # type: ignore[attr-defined]
    return command


def register(app: typer.Typer) -> None:
    app.command("launch")(_with_slurm_options(launch))

"""SLURM via sbatch: a pure renderer (`render(params) -> str`, tested against a golden file), `submit`, and the
`sbatch` launch backend built from them.

Every value that reaches the script is either validated for an `#SBATCH` line (see `shell.check_directive`)
or shell-quoted in the body (the `sq` filter). Torch-free.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass, field, fields, replace
from importlib import resources
from pathlib import Path
from typing import Any

import jinja2

import llmctl
from llmctl.errors import InputError, RuntimeFailure
from llmctl.fileio import write_atomic
from llmctl.launch import jobs, local, shell, slurm_options
from llmctl.launch.backends import Job, SlurmBackend
from llmctl.launch.local import ENGINE_MODULE
from llmctl.launch.preflight.options import PreflightOptions
from llmctl.launch.slurm_options import SlurmOptions

TEMPLATE_NAME = "slurm.sbatch.j2"
TUNE_TEMPLATE_NAME = "tune.sbatch.j2"
DEFAULT_MAX_REQUEUES = 20
RDZV_PORT_BASE = 29500
# Kept importable from here: the sbatch renderer's callers and tests know them by these names.
DEFAULT_SIGNAL_LEAD_S = slurm_options.DEFAULT_SIGNAL_LEAD_S
parse_time_s = slurm_options.parse_time_s
TUNE_RDZV_PORT_BASE = 33500
"""`llmctl tune --slurm` jobs: each trial's rendezvous port is this + job id % 2000 + the trial's run, clear of the
training's ports (29500 + 2000) and the preflight's (31500 + 2000)."""

# The job step on each node: one torchrun agent per node, rendezvous (c10d) hosted by $LLMCTL_RDZV_NODE at
# $LLMCTL_RDZV_ADDR:$LLMCTL_RDZV_PORT, running the engine on $LLMCTL_PLAN. Single-quoted into `bash -c` (sbatch
# template) or passed as one argument (tune's trials), so SLURMD_NODENAME and the node's own address expand on each
# node. torchrun handles SIGUSR1 (forwarding it to the ranks) instead of dying from it, and waits up to the shutdown
# timeout for them to finish their checkpoint.
_NODE_STEP_SCRIPT = """
node_addr=$(scontrol show node "$SLURMD_NODENAME" | sed -n "s/.*NodeAddr=\\([^ ]*\\).*/\\1/p" | head -n 1)
is_host=0
if [ "$SLURMD_NODENAME" = "$LLMCTL_RDZV_NODE" ]; then is_host=1; fi
exec "$LLMCTL_TORCHRUN" \\
  --nnodes="$LLMCTL_NNODES" \\
  --nproc_per_node="$LLMCTL_NPROC_PER_NODE" \\
  --rdzv_backend=c10d \\
  --rdzv_id="$SLURM_JOB_ID" \\
  --rdzv_endpoint="$LLMCTL_RDZV_ADDR:$LLMCTL_RDZV_PORT" \\
  --rdzv_conf=is_host="$is_host" \\
  --local_addr="$node_addr" \\
  --max_restarts=0 \\
  --signals_to_handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 \\
  --shutdown_timeout="$LLMCTL_SHUTDOWN_TIMEOUT_S" \\
  --module {engine_module} "$LLMCTL_PLAN"
"""


def node_step_script(engine_module: str = ENGINE_MODULE) -> str:
    return _NODE_STEP_SCRIPT.format(engine_module=engine_module)


def node_step_argv(nodes: list[str], engine_module: str = ENGINE_MODULE) -> list[str]:
    """The srun step that runs the engine on `nodes` (one torchrun per node): the LLMCTL_* variables the script reads
    come from the environment (the sbatch script exports them; tune's runner passes them)."""
    return [
        "srun",
        f"--nodes={len(nodes)}",
        f"--ntasks={len(nodes)}",
        f"--nodelist={','.join(nodes)}",
        "--ntasks-per-node=1",
        "bash",
        "-c",
        node_step_script(engine_module),
    ]


@dataclass(frozen=True)
class SbatchParams:
    """Everything the template needs. Build with `make_params` (which validates); `render` is pure."""

    job_name: str
    nodes: int
    nproc_per_node: int
    workdir: str
    """Where the engine runs (relative paths in the plan resolve from here): the directory launch ran in."""
    job_dir: str
    plan_path: str
    torchrun: str
    python: str = "python3"
    """The Python that runs the preflight on the batch host (the torchrun's own where llmctl knows it)."""
    gpus_per_node: int | None = None
    slurm: SlurmOptions = field(default_factory=SlurmOptions)
    """The user's SLURM options (validated when built)."""
    preflight: PreflightOptions = field(default_factory=PreflightOptions)
    env: dict[str, str] = field(default_factory=dict)
    max_requeues: int = DEFAULT_MAX_REQUEUES
    rdzv_port_base: int = RDZV_PORT_BASE
    engine_module: str = ENGINE_MODULE
    llmctl_version: str = llmctl.__version__

    @property
    def shutdown_timeout_s(self) -> int:
        # torchrun waits this long for the ranks to checkpoint and exit before SIGKILL; keep 10 s for the rest.
        return max(10, self.slurm.signal_lead_s - 10)


def make_params(
    *,
    job_name: str,
    nodes: int,
    nproc_per_node: int,
    workdir: str,
    job_dir: str,
    plan_path: str,
    torchrun: str,
    python: str = "python3",
    gpus_per_node: int | None = None,
    env: dict[str, str] | None = None,
    max_requeues: int = DEFAULT_MAX_REQUEUES,
    preflight: PreflightOptions | None = None,
    **slurm: Any,
) -> SbatchParams:
    """Validate user values and build the renderer's input. `slurm` holds SlurmOptions by name (time,
    partition, ..., extra_sbatch_args, signal_lead_s); an unknown name is an error listing the valid ones.
    Raises InputError naming the bad option."""
    if nodes < 1:
        raise InputError(f"--nodes {nodes}: must be at least 1")
    options = SlurmOptions.from_kwargs(**slurm)
    for key in env or {}:
        if shell.is_secret_name(key):
            raise InputError(f"env {key}: secrets are never written into the job script")
    return SbatchParams(
        job_name=shell.safe_name(job_name),
        nodes=nodes,
        nproc_per_node=nproc_per_node,
        workdir=workdir,
        job_dir=job_dir,
        plan_path=plan_path,
        torchrun=torchrun,
        python=python,
        gpus_per_node=gpus_per_node,
        slurm=options,
        env=dict(env or {}),
        max_requeues=max_requeues,
        preflight=preflight or PreflightOptions(),
    )


def template_text(name: str = TEMPLATE_NAME) -> str:
    """The template shipped in the wheel (llmctl/templates), else the repository's top-level templates/."""
    try:
        shipped = resources.files("llmctl") / "templates" / name
        if shipped.is_file():
            return shipped.read_text()
    except (FileNotFoundError, ModuleNotFoundError):
        pass
    repo = Path(__file__).resolve().parents[2] / "templates" / name
    if not repo.is_file():
        raise RuntimeFailure(f"{name} not found (looked in llmctl/templates and {repo.parent})")
    return repo.read_text()


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        undefined=jinja2.StrictUndefined,
        autoescape=False,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )
    env.filters["sq"] = shell.quote
    return env


def render(params: SbatchParams, template: str | None = None) -> str:
    """Pure: parameters in, script text out."""
    context = {f.name: getattr(params, f.name) for f in fields(params) if f.name not in ("slurm", "preflight")}
    context.update(
        preflight=params.preflight.enabled,
        preflight_strict=params.preflight.strict,
        spare_nodes=params.preflight.spare_nodes,
        alloc_nodes=params.nodes + params.preflight.spare_nodes,
        directives=params.slurm.directives(),
        extra_sbatch_args=params.slurm.extra_sbatch_args,
        signal_lead_s=params.slurm.signal_lead_s,
        shutdown_timeout_s=params.shutdown_timeout_s,
        node_step_script=node_step_script(params.engine_module),
    )
    return _environment().from_string(template if template is not None else template_text()).render(context)


@dataclass(frozen=True)
class TuneParams:
    """What templates/tune.sbatch.j2 needs: one allocation of the plan's nodes that runs `llmctl.tune.job`."""

    job_name: str
    nodes: int
    workdir: str
    tune_dir: str
    torchrun: str
    python: str
    gpus_per_node: int | None = None
    slurm: SlurmOptions = field(default_factory=SlurmOptions)
    rdzv_port_base: int = TUNE_RDZV_PORT_BASE
    llmctl_version: str = llmctl.__version__


def make_tune_params(
    *,
    job_name: str,
    nodes: int,
    workdir: str,
    tune_dir: str,
    torchrun: str,
    python: str,
    gpus_per_node: int | None = None,
    **slurm: Any,
) -> TuneParams:
    """Validated as `make_params` validates a launch's (the same SlurmOptions). The job gets the submitting
    environment (sbatch's default), as a launch's job does."""
    if nodes < 1:
        raise InputError(f"--nodes {nodes}: must be at least 1")
    return TuneParams(
        job_name=shell.safe_name(job_name),
        nodes=nodes,
        workdir=workdir,
        tune_dir=tune_dir,
        torchrun=torchrun,
        python=python,
        gpus_per_node=gpus_per_node,
        slurm=SlurmOptions.from_kwargs(**slurm),
    )


def render_tune(params: TuneParams) -> str:
    """Pure: the tune job's script."""
    context = {f.name: getattr(params, f.name) for f in fields(params) if f.name != "slurm"}
    context.update(
        directives=params.slurm.directives(),
        extra_sbatch_args=params.slurm.extra_sbatch_args,
        shutdown_timeout_s=max(10, params.slurm.signal_lead_s - 10),
    )
    return _environment().from_string(template_text(TUNE_TEMPLATE_NAME)).render(context)


def node_python_and_torchrun() -> tuple[str, str]:
    """What the nodes run: the login node's torchrun if it is one executable (a shared venv), else the compute
    node's PATH; the batch host's Python: this one when the torchrun is its venv's, else the nodes' python3."""
    command = local.torchrun_command()
    beside = len(command) == 1 and Path(command[0]).parent == Path(sys.executable).parent
    return (sys.executable if beside else "python3"), (command[0] if len(command) == 1 else "torchrun")


def submit(script_path: Path, job_dir: Path) -> str:
    """sbatch the script from its job folder (so relative log paths land there); return the job id."""
    try:
        out = subprocess.run(
            ["sbatch", "--parsable", script_path.name],
            cwd=job_dir,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    except FileNotFoundError:
        raise RuntimeFailure("sbatch not found", hint="run on a SLURM login node, or use --dry-run") from None
    except subprocess.TimeoutExpired:
        raise RuntimeFailure("sbatch did not answer within 60 s") from None
    if out.returncode != 0:
        msg = (out.stderr.strip().splitlines() or ["(no message)"])[-1]
        raise RuntimeFailure(f"sbatch failed: {msg}", hint=f"the script is in {job_dir}")
    job_id = out.stdout.strip().split(";")[0]
    if not job_id.isdigit():
        raise RuntimeFailure(f"sbatch printed an unexpected job id: {out.stdout.strip()!r}")
    return job_id


def params_for(job: Job, folder: Path) -> SbatchParams:
    """The template's parameters for a job whose folder is (or, for --dry-run, would be) `folder`."""
    python, torchrun = node_python_and_torchrun()
    return make_params(
        job_name=job.name,
        nodes=job.nodes,
        nproc_per_node=job.nproc_per_node,
        workdir=str(job.workdir),
        job_dir=str(folder),
        plan_path=str(folder / "plan.yaml"),
        torchrun=torchrun,
        python=python,
        gpus_per_node=job.nproc_per_node if job.plan.hardware.gpu else None,
        env=job.env,
        preflight=job.preflight,
        **{f.name: getattr(job.slurm, f.name) for f in fields(job.slurm)},
    )


class SbatchBackend(SlurmBackend):
    name = "sbatch"
    help = "SLURM: templates/slurm.sbatch.j2 rendered and submitted with sbatch"
    preflight = True

    def render(self, job: Job) -> str:
        params = params_for(job, job.dry_run_folder())
        job.effective_plan  # noqa: B018 - validates the resized plan, as a real launch would
        return render(params)

    def submit(self, job: Job) -> jobs.JobRecord:
        # Validate everything before creating anything on disk.
        params = params_for(job, job.dry_run_folder())
        job.effective_plan  # noqa: B018
        folder = job.new_folder()
        params = replace(params, job_dir=str(folder), plan_path=str(folder / "plan.yaml"))
        script = folder / "job.sbatch"
        write_atomic(script, render(params), mode=0o755)
        job_id = submit(script, folder)
        record = job.record(
            self.name, job_id, folder, [folder / f"slurm-{job_id}.out"], ["sbatch", "--parsable", script.name]
        )
        record.save()
        return record

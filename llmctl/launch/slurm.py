"""SLURM via sbatch: a pure renderer (`render(params) -> str`, tested against a golden file) and `submit`.

Every value that reaches the script is either validated for an `#SBATCH` line (see `shell.check_directive`)
or shell-quoted in the body (the `sq` filter). Torch-free.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path

import jinja2

import llmctl
from llmctl.errors import InputError, RuntimeFailure
from llmctl.launch import shell
from llmctl.launch.local import ENGINE_MODULE

TEMPLATE_NAME = "slurm.sbatch.j2"
DEFAULT_SIGNAL_LEAD_S = 300
"""Seconds before the time limit at which SIGUSR1 arrives: enough for a large sharded checkpoint."""
DEFAULT_MAX_REQUEUES = 20
RDZV_PORT_BASE = 29500


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
    gpus_per_node: int | None = None
    time: str | None = None
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    exclude: str | None = None
    extra_sbatch_args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    signal_lead_s: int = DEFAULT_SIGNAL_LEAD_S
    max_requeues: int = DEFAULT_MAX_REQUEUES
    rdzv_port_base: int = RDZV_PORT_BASE
    engine_module: str = ENGINE_MODULE
    llmctl_version: str = llmctl.__version__

    @property
    def shutdown_timeout_s(self) -> int:
        # torchrun waits this long for the ranks to checkpoint and exit before SIGKILL; keep 10 s for the rest.
        return max(10, self.signal_lead_s - 10)


_TIME = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")


def parse_time_s(value: str) -> int:
    """SLURM --time formats: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S -> seconds."""
    m = _TIME.match(value)
    if not m:
        raise InputError(
            f"--time {value!r}: not a SLURM time", hint="use minutes, HH:MM:SS or D-HH:MM:SS, e.g. 4:00:00"
        )
    days, a, b, c = m.groups()
    nums = [int(x) for x in (a, b, c) if x is not None]
    if days is not None:  # D-H, D-H:M, D-H:M:S
        h, mi, s = (nums + [0, 0])[:3]
        return ((int(days) * 24 + h) * 60 + mi) * 60 + s
    if len(nums) == 1:
        return nums[0] * 60
    if len(nums) == 2:
        return nums[0] * 60 + nums[1]
    return (nums[0] * 60 + nums[1]) * 60 + nums[2]


def make_params(
    *,
    job_name: str,
    nodes: int,
    nproc_per_node: int,
    workdir: str,
    job_dir: str,
    plan_path: str,
    torchrun: str,
    gpus_per_node: int | None = None,
    time: str | None = None,
    partition: str | None = None,
    account: str | None = None,
    qos: str | None = None,
    constraint: str | None = None,
    exclude: str | None = None,
    extra_sbatch_args: list[str] | tuple[str, ...] = (),
    env: dict[str, str] | None = None,
    signal_lead_s: int = DEFAULT_SIGNAL_LEAD_S,
    max_requeues: int = DEFAULT_MAX_REQUEUES,
) -> SbatchParams:
    """Validate user values and build the renderer's input. Raises InputError naming the bad option."""
    if nodes < 1:
        raise InputError(f"--nodes {nodes}: must be at least 1")
    if signal_lead_s < 10:
        raise InputError(f"--signal-lead {signal_lead_s}: must be at least 10 seconds")
    if time is not None:
        shell.check_directive("time", time)
        limit_s = parse_time_s(time)
        if limit_s <= signal_lead_s:
            raise InputError(
                f"--time {time}: the job would get its checkpoint signal ({signal_lead_s} s before the end) "
                "before it starts",
                hint="give a longer --time or a smaller --signal-lead",
            )
    for option, value in (
        ("partition", partition),
        ("account", account),
        ("qos", qos),
        ("constraint", constraint),
        ("exclude", exclude),
    ):
        if value is not None:
            shell.check_directive(option, value)
    extra = tuple(shell.check_sbatch_arg(a) for a in extra_sbatch_args)
    for a in extra:
        if a.split("=")[0] in ("--signal", "--requeue", "--no-requeue", "--output", "--open-mode"):
            raise InputError(f"--sbatch-arg {a}: llmctl sets this itself (it drives checkpoint and requeue)")
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
        gpus_per_node=gpus_per_node,
        time=time,
        partition=partition,
        account=account,
        qos=qos,
        constraint=constraint,
        exclude=exclude,
        extra_sbatch_args=extra,
        env=dict(env or {}),
        signal_lead_s=signal_lead_s,
        max_requeues=max_requeues,
    )


def template_text() -> str:
    """The template shipped in the wheel (llmctl/templates), else the repository's top-level templates/."""
    try:
        shipped = resources.files("llmctl") / "templates" / TEMPLATE_NAME
        if shipped.is_file():
            return shipped.read_text()
    except (FileNotFoundError, ModuleNotFoundError):
        pass
    repo = Path(__file__).resolve().parents[2] / "templates" / TEMPLATE_NAME
    if not repo.is_file():
        raise RuntimeFailure(f"{TEMPLATE_NAME} not found (looked in llmctl/templates and {repo.parent})")
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
    context = asdict(params)
    context["shutdown_timeout_s"] = params.shutdown_timeout_s
    return _environment().from_string(template if template is not None else template_text()).render(context)


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
